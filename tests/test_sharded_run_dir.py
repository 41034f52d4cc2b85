"""A sharded run dir over its life: what a one-process resume may change holds for a sharded checkpoint, the run
continues in its own dir under another trainer (a file checkpoint where the shards' directory stood, and back), a
damaged sharded checkpoint is refused by every command before anything is written, and the FSDP policy takes one
name as a list of one. Real processes (``python train.py`` under ``trainer=fsdp_cpu``, ``ddp_cpu``, ``cpu``).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from multiloss import train
from multiloss.cli import consolidate_main
from multiloss.config import ConfigError
from multiloss.nets import DeepSupervisionMLP
from multiloss.parallel.sharding import _units, check_policy
from multiloss.saving.saved_state import is_sharded_checkpoint
from tests.conftest import QUIET, ROOT, run_cli
from tests.helpers import logged_rates
from tests.rank_pool import pooled_train

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

RUN = (
    *QUIET,
    "~callbacks.loss_curves",
    "recipe=multihead",
    "seed=5",
    "model.net.width=16",
    "data.batch_size=64",
    "trainer.num_sanity_val_steps=0",
    "trainer.limit_val_batches=2",
    "trainer.log_every_n_steps=1",
)
FSDP = ("trainer=fsdp_cpu",)


def _run(out: Path, *overrides: str) -> subprocess.CompletedProcess:
    out.parent.mkdir(parents=True, exist_ok=True)
    return run_cli(*RUN, *overrides, f"hydra.run.dir={out}", cwd=out.parent, timeout=600)


def _ok(out: Path, *overrides: str) -> subprocess.CompletedProcess:
    proc = _run(out, *overrides)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _refused(out: Path, key: str, *overrides: str) -> str:
    """The run is refused with one message naming ``key``, no traceback, nothing written into ``out``."""
    before = sorted(p.relative_to(out) for p in out.rglob("*")) if out.exists() else []
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} if out.exists() else {}
    proc = _run(out, *overrides)
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert proc.stderr.count("multiloss: config error:") == 1, proc.stderr[-4000:]
    assert f"config error: {key}" in proc.stderr, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr
    if out.exists():
        assert sorted(p.relative_to(out) for p in out.rglob("*")) == before
        assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == stamps
    return proc.stderr


def test_a_sharded_resume_applies_and_refuses_what_a_file_resume_does(tmp_path):
    """The outside check: a sharded resume ignored another base rate and crashed on another schedule (after making an
    empty csv/version_1/). Now refused before anything is written (another schedule, another optimizer, a max_steps
    already passed), or applied and said (another base rate)."""
    out = tmp_path / "run"
    # One name for a list of one, and a container named by its name: the trunk's blocks, each a unit (and below,
    # activation checkpointing of one class given without brackets).
    pooled_train(out, *RUN, *FSDP, "trainer.max_steps=3", "model.fsdp.shard=blocks")
    assert is_sharded_checkpoint(out / "checkpoints/last.ckpt")

    _refused(out, "model.scheduler._target_", *FSDP, "scheduler=step", "trainer.max_steps=6", "ckpt_path=last")
    _refused(out, "model.optimizer", *FSDP, "optimizer=sgd", "trainer.max_steps=6", "ckpt_path=last")
    _refused(out, "trainer.max_steps", *FSDP, "trainer.max_steps=2", "ckpt_path=last")  # already past it

    proc = _ok(
        out, *FSDP, "model.optimizer.lr=0.006", "trainer.max_steps=6", "ckpt_path=last", "model.fsdp.checkpoint=Linear"
    )
    said = (proc.stdout + proc.stderr).count("resuming with model.optimizer.lr=0.006 (the checkpoint's 0.003)")
    assert said == 1, proc.stdout + proc.stderr  # once for the run, not once a rank
    assert [logged_rates(out)[step] for step in range(6)] == [(0.003,)] * 3 + [(0.006,)] * 3

    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["last.ckpt"]  # nothing staged or aside left
    # Continued in its own dir under DDP (a file where the shards' directory stood) and back under FSDP2:
    # tests/test_sharding.py's continue-under-DDP test.


DAMAGES = {
    ".metadata deleted": lambda ckpt: (ckpt / ".metadata").unlink(),
    "meta.pt deleted": lambda ckpt: (ckpt / "meta.pt").unlink(),
    "a shard cut short": lambda ckpt: (ckpt / "__1_0.distcp").write_bytes((ckpt / "__1_0.distcp").read_bytes()[:999]),
}


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory) -> Path:
    return pooled_train(tmp_path_factory.mktemp("sharded") / "run", *RUN, *FSDP, "trainer.max_steps=3")


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_sharded_checkpoint_is_refused_by_every_command_before_anything_is_written(
    tmp_path, sharded_run, damage, capsys
):
    """The outside check: rank 0 refused while rank 1 trained on and hung (.metadata gone), or tracebacks (meta.pt
    gone, a shard truncated) — in train, in multiloss-eval (after writing its .hydra/) and in multiloss-consolidate
    (which with meta.pt gone said the file would load, and it did not)."""
    out = tmp_path / "run"
    shutil.copytree(sharded_run, out)
    ckpt = out / "checkpoints/last.ckpt"
    DAMAGES[damage](ckpt)

    said = _refused(out, "ckpt_path", *FSDP, "trainer.max_steps=6", "ckpt_path=last")
    assert "sharded" in said

    evaluated = subprocess.run(
        [sys.executable, str(ROOT / "eval.py"), f"ckpt_path={ckpt}", f"hydra.run.dir={tmp_path / 'eval'}"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert evaluated.returncode == 2 and "config error: ckpt_path" in evaluated.stderr, evaluated.stderr[-3000:]
    assert "Traceback" not in evaluated.stderr and not (tmp_path / "eval").exists()

    with pytest.raises(SystemExit) as consolidated:  # multiloss-consolidate, in this process
        consolidate_main([str(ckpt)])
    said = capsys.readouterr().err
    assert consolidated.value.code == 2 and "config error: checkpoint" in said, said
    assert not ckpt.with_name("last.whole.ckpt").exists()


def test_the_fsdp_policy_takes_one_name_as_a_list_and_never_offers_a_unit_it_cannot_shard(make_cfg, tmp_path):
    """`model.fsdp.checkpoint=Linear` was read letter by letter; `shard=blocks` (a ModuleList, listed as accepted) and
    `shard=blocks.*` ended in fully_shard's traceback; the net's own class was refused."""
    from multiloss import testing

    _, module = testing.build(make_cfg("recipe=multihead", "model.fsdp.checkpoint=Linear", "model.fsdp.shard=Block"))
    assert module.fsdp == {"shard": ["Block"], "checkpoint": ["Linear"]}
    net = DeepSupervisionMLP(width=8, depth=3)
    for shard in (["blocks"], ["blocks.*"], ["Sequential"]):
        units = _units(net, shard)
        assert units and not any(isinstance(u, nn.ModuleList | nn.ModuleDict) for u in units), shard
        assert all(any(True for _ in u.parameters()) for u in units)
    holder = nn.Module()
    holder.net = net
    check_policy(holder, ["net"], ["DeepSupervisionMLP"], ["Linear"])  # the root: one unit, the whole net
    with pytest.raises(ConfigError, match="matches none"):
        check_policy(holder, ["net"], ["NoSuchBlock"], [])


def test_token_streams_too_short_for_every_rank_are_refused_counting_the_ranks(make_cfg, tmp_path):
    """A 10-token validation text, 4 streams a rank, 2 ranks: one token a stream, nothing to validate on (one
    process validates). Refused before any process starts, naming data.val_batch_size and the ranks."""
    (tmp_path / "train.txt").write_text("abcdefghij" * 40)
    (tmp_path / "valid.txt").write_text("0123456789")
    overrides = (
        "recipe=tbptt",
        "data=text",
        f"data.path={tmp_path / 'train.txt'}",
        f"data.val_path={tmp_path / 'valid.txt'}",
        "data.level=chars",
        "data.layout=streams",
        "data.batch_size=2",
        "data.val_batch_size=4",
        "model.sample_length=5",
    )
    train(make_cfg(*overrides, "trainer=cpu", "trainer.max_steps=1", output_dir=tmp_path / "one"))  # 4 streams fit
    with pytest.raises(ConfigError) as err:
        train(make_cfg(*overrides, *FSDP, output_dir=tmp_path / "sharded"))
    assert err.value.key == "data.val_batch_size" and "2 ranks" in err.value.accepted
    assert not (tmp_path / "sharded").exists()


def test_a_batch_size_changed_at_an_epoch_end_is_said(make_cfg, tmp_path, caplog):
    out = tmp_path / "run"
    common = ("recipe=multihead", "model.net.width=8", "trainer=cpu", "~callbacks.loss_curves")
    train(make_cfg(*common, "trainer.max_epochs=1", output_dir=out))
    with caplog.at_level("INFO", logger="multiloss"):
        train(make_cfg(*common, "trainer.max_epochs=2", "data.batch_size=32", "ckpt_path=last", output_dir=out))
    assert "resuming with data.batch_size: 32 per rank (the checkpoint's 64), from this epoch on" in caplog.text
    assert torch.load(out / "checkpoints/last.ckpt", weights_only=True)["epoch"] == 2
