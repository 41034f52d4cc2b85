"""No distributed run hangs, and no two runs race for one run dir.

Every rank issues every collective in the same order: an epoch's logged values are reduced by every rank before any
callback reads them (a progress bar reads on rank zero only); a collective one rank issues alone ends the run with
one message naming each rank's hook, within ``collective_timeout`` (at once under the suite's
``TORCH_DISTRIBUTED_DEBUG=DETAIL``, which compares the ranks' calls), ``last.ckpt`` kept. Real processes throughout:
``python train.py`` under Lightning's DDP and FSDP2 launchers (gloo), and two runs started at one instant.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from tests.conftest import ROOT, run_cli
from tests.helpers import logged_rows

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

QUIET = ("print_config=false", "trainer.enable_model_summary=false", "~callbacks.loss_curves")


@pytest.mark.parametrize("trainer", ["ddp_cpu", "fsdp_cpu"])
def test_an_epoch_value_every_rank_logs_is_reduced_by_every_rank(tmp_path, trainer):
    """The outside check's hang: accumulation's `scaling/*` epoch values were reduced lazily by the first reader —
    rank zero's progress bar at the epoch's end — while rank 1 waited in the preemption agreement. Now those values
    (equal on every rank) are not reduced at all, and a value that is (`sync_dist=True`, here a callback's) is
    reduced by every rank before any callback reads it. The progress bar stays on (`callbacks=default`)."""
    out = tmp_path / "run"
    start = time.monotonic()
    proc = run_cli(
        "recipe=accumulation",
        f"trainer={trainer}",
        "seed=3",
        "++trainer.max_epochs=-1",
        "++trainer.max_steps=4",
        "++trainer.limit_val_batches=2",
        "callbacks=default",
        "+callbacks.probe._target_=tests.helpers.SyncedEpochValue",
        "collective_timeout=60",
        *QUIET,
        f"hydra.run.dir={out}",
        cwd=tmp_path,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert time.monotonic() - start < 150
    rows = logged_rows(out)
    assert [float(r["scaling/factor"]) for r in rows if r.get("scaling/factor")] == [4.0]  # b 64 × k 2 × 2 ranks
    assert [float(r["probe"]) for r in rows if r.get("probe")] == [1.0]  # reduced over the ranks: still 1


@pytest.mark.parametrize("debug", ["DETAIL", "OFF"])
def test_a_collective_one_rank_issues_alone_ends_the_run_with_one_message(tmp_path, debug):
    """Rank 0 alone waits in a barrier at the second epoch's end; rank 1 goes on to the next collective of the run
    (the checkpoint's agreement). Under DETAIL torch's checker fails both at once; without it, gloo after
    `collective_timeout` (10 s here). Either way: exit 1, one message naming each rank's collective and hook, and
    the first epoch's `last.ckpt` intact — never a hang."""
    out = tmp_path / "run"
    start = time.monotonic()
    proc = run_cli(
        "recipe=multihead",
        "trainer=ddp_cpu",
        "trainer.max_epochs=3",
        "trainer.limit_train_batches=3",
        "trainer.limit_val_batches=0",
        "trainer.num_sanity_val_steps=0",
        "callbacks.model_checkpoint.epoch_save_seconds=0",
        "+callbacks.alone._target_=tests.helpers.CollectiveOnOneRank",
        "collective_timeout=10",
        *QUIET,
        f"hydra.run.dir={out}",
        cwd=tmp_path,
        timeout=240,
        env={"TORCH_DISTRIBUTED_DEBUG": debug},
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert time.monotonic() - start < 150
    err = proc.stderr
    assert err.count("did not complete") == 1, err[-3000:]  # one message for the job
    assert "rank 0: barrier from CollectiveOnOneRank.on_train_epoch_end" in err
    assert "rank 1: all_reduce from Checkpoint.on_train_epoch_end" in err
    assert ("different collectives" in err) == (debug == "DETAIL")
    assert "Traceback" not in err
    checkpoint = torch.load(out / "checkpoints/last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 3  # the first epoch's end: the last save before the stall


def test_two_runs_started_into_one_new_dir_at_once_one_trains_the_other_touches_nothing(tmp_path):
    """The outside check's race: both runs made the run dir's files before either took the lock, and the refused
    one removed, on its way out, the folders the other had made (which then died). Now the lock is the first thing
    written, and a run refused at it removes nothing."""
    out = tmp_path / "run"
    command = [sys.executable, str(ROOT / "train.py"), "recipe=multihead", "trainer.max_steps=60", *QUIET]
    procs = [
        subprocess.Popen(
            [*command, f"seed={seed}", f"hydra.run.dir={out}"],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
        for seed in (101, 202)
    ]
    results = [(proc.wait(timeout=300), proc.stderr.read()) for proc in procs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results
    (refusal,) = [err for code, err in results if code == 2]
    assert "is training in it" in refusal or "holds another run's checkpoints" in refusal, refusal
    assert "Traceback" not in refusal
    (winner,) = [seed for seed, (code, _) in zip((101, 202), results) if code == 0]
    assert torch.load(out / "checkpoints/last.ckpt", weights_only=True)["global_step"] == 60
    assert (out / ".hydra/overrides.yaml").read_text().count(f"seed={winner}") == 1
    assert sorted(p.name for p in (out / "csv").iterdir()) == ["version_0"]
    assert not (out / ".multiloss.lock").exists()
