"""Checkpoints you can trust, and run dirs that keep their results.

A damaged, truncated, empty or foreign ``ckpt_path`` is refused before anything is written; a save
that fails stops the run and leaves the previous checkpoint whole; ``last.ckpt`` is the last step
trained however the run ended; a run dir holding another run's checkpoints is not trained over
unless asked, and a live run's dir is locked.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from multiloss import ConfigError, testing, train
from multiloss.saving.checkpoints import AtomicCheckpointIO, CheckpointWriteError
from multiloss.saving.run_dir import LOCK
from multiloss.saving.saved_state import SAVED_KEYS
from tests.conftest import BARE, QUIET, SMALL_GAN, load_checkpoint, train_here

SMALL = ("recipe=multihead", "model.net.width=16", "trainer.accelerator=cpu", "trainer.limit_val_batches=0")


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished 6-step multihead run (its run dir) to resume from or damage copies of."""
    out = tmp_path_factory.mktemp("finished") / "run"
    train(testing.compose(*QUIET, *SMALL, "trainer.max_steps=6", "~callbacks.loss_curves", output_dir=out))
    return out


def _last(run: Path) -> Path:
    return run / "checkpoints" / "last.ckpt"


def _damaged(tmp_path: Path, source: Path, how: str) -> Path:
    data = bytearray(source.read_bytes())
    if how == "overwritten":  # 8 bytes in the middle of the weights
        middle = len(data) // 2
        data[middle : middle + 8] = b"\xff" * 8
    elif how == "truncated":
        data = data[: len(data) // 3]
    elif how == "empty":
        data = bytearray()
    path = tmp_path / f"{how}.ckpt"
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize(
    ("how", "said"),
    [("overwritten", "fails its CRC check"), ("truncated", "not a readable"), ("empty", "not a readable")],
)
def test_a_damaged_checkpoint_is_refused_before_any_write(make_cfg, tmp_path, finished, how, said):
    bad = _damaged(tmp_path, _last(finished), how)
    out = tmp_path / "resumed"
    with pytest.raises(ConfigError, match=said) as err:
        train(make_cfg(*SMALL, "trainer.max_steps=8", f"ckpt_path={bad}", output_dir=out))
    assert err.value.key == "ckpt_path"
    assert not out.exists()


@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        (("recipe=weighted", "model.net.width=16"), "belongs to another model"),  # another recipe
        (("model.net.width=32",), "other shapes"),  # the same recipe, another width
    ],
)
def test_a_foreign_checkpoint_is_refused_naming_what_differs(make_cfg, tmp_path, finished, overrides, said):
    out = tmp_path / "resumed"
    with pytest.raises(ConfigError, match=said) as err:
        train(make_cfg(*SMALL, *overrides, "trainer.max_steps=8", f"ckpt_path={_last(finished)}", output_dir=out))
    assert err.value.key == "ckpt_path"
    assert not out.exists()


def test_a_failed_save_raises_and_keeps_the_previous_checkpoint(tmp_path):
    io = AtomicCheckpointIO()
    target = tmp_path / "checkpoints" / "last.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.ones(3)}}, target)
    with pytest.raises(Exception, match=r"pickle|Pickl|local object"):  # dies half-way through torch.save
        io.save_checkpoint({"state_dict": {"w": torch.zeros(3)}, "bad": lambda: None}, target)
    assert torch.equal(torch.load(target, weights_only=True)["state_dict"]["w"], torch.ones(3))
    assert sorted(p.name for p in target.parent.iterdir()) == ["last.ckpt"]  # no half-written temporary left


def test_an_unwritable_checkpoint_dir_stops_the_run(make_cfg, tmp_path):
    """Lightning 2.6 swallows the save's PermissionError (exit 0, no checkpoint); here the run stops, saying so."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoints").write_text("a file where the checkpoint dir should be")
    with pytest.raises(CheckpointWriteError, match="could not write the checkpoint"):
        train(make_cfg(*SMALL, "trainer.max_steps=2", "~callbacks.loss_curves", output_dir=out))
    proc = subprocess.run(
        [sys.executable, "train.py", *SMALL, "trainer.max_steps=2", f"hydra.run.dir={out}", "print_config=false"],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert proc.returncode == 1 and "multiloss: run stopped: could not write the checkpoint" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_last_checkpoint_is_the_last_step_when_epochs_end_between_periodic_saves(make_cfg, tmp_path):
    """23 steps an epoch, a checkpoint every 10: stock Lightning's last.ckpt stays at step 20."""
    train(
        make_cfg(
            *SMALL,
            "data.batch_size=64",  # 1438 examples: 23 batches
            "trainer.max_epochs=1",
            "callbacks.model_checkpoint.every_n_train_steps=10",
            "~callbacks.loss_curves",
            output_dir=tmp_path,
        )
    )
    assert torch.load(_last(tmp_path), weights_only=True)["global_step"] == 23


def test_a_finished_run_dir_is_not_trained_over(make_cfg, tmp_path):
    out = tmp_path / "run"
    train(make_cfg(*SMALL, "trainer.max_steps=2", "~callbacks.loss_curves", output_dir=out))
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}

    with pytest.raises(ConfigError, match="holds another run's checkpoints") as err:
        train(make_cfg(*SMALL, "trainer.max_steps=2", "~callbacks.loss_curves", output_dir=out))
    assert err.value.key == "hydra.run.dir" and "overwrite=true" in err.value.message
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == before  # nothing touched

    # Continuing the run that is there is what the dir is for; so is an explicit overwrite.
    train(make_cfg(*SMALL, "trainer.max_steps=4", f"ckpt_path={_last(out)}", "~callbacks.loss_curves", output_dir=out))
    assert torch.load(_last(out), weights_only=True)["global_step"] == 4
    train(make_cfg(*SMALL, "trainer.max_steps=3", "overwrite=true", "~callbacks.loss_curves", output_dir=out))
    assert torch.load(_last(out), weights_only=True)["global_step"] == 3
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["last.ckpt"]  # never last-v1.ckpt


def test_a_live_run_locks_its_dir_and_a_dead_ones_lock_is_taken_over(make_cfg, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    import socket

    (out / LOCK).write_text(f"{socket.gethostname()} {os.getpid()}")  # this very process: alive
    with pytest.raises(ConfigError, match="is training in it") as err:
        train(make_cfg(*SMALL, "trainer.max_steps=1", "~callbacks.loss_curves", output_dir=out))
    assert err.value.key == "hydra.run.dir"

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (out / LOCK).write_text(f"{socket.gethostname()} {dead.pid}")  # a run that was killed
    train(make_cfg(*SMALL, "trainer.max_steps=1", "~callbacks.loss_curves", output_dir=out))
    assert not (out / LOCK).exists()  # released when the run ended


def test_bare_runs_leave_no_lock(make_cfg, tmp_path):
    train(make_cfg(*SMALL, *BARE, "trainer.max_steps=1", output_dir=tmp_path))
    assert not (tmp_path / LOCK).exists()


def test_a_save_killed_midway_leaves_the_previous_checkpoint_whole(tmp_path):
    """kill -9 during a save (a preempted job): the old last.ckpt is intact, never a 0-byte or half file."""
    import signal
    import time

    target = tmp_path / "checkpoints" / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.ones(3)}}, target)
    big = "{'state_dict': {'w': torch.zeros(100_000_000)}}"  # 400 MB: long enough to be caught writing
    save = f"AtomicCheckpointIO().save_checkpoint({big}, {str(target)!r})"
    script = f"import torch; from multiloss.saving.checkpoints import AtomicCheckpointIO; {save}"
    proc = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.monotonic() + 60
    while not list(target.parent.glob(".last.ckpt.*.tmp")) and time.monotonic() < deadline:
        time.sleep(0.01)  # the new checkpoint is being written beside the old one
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert torch.equal(torch.load(target, weights_only=True)["state_dict"]["w"], torch.ones(3))


def test_a_full_disk_is_one_message_and_leaves_no_partial_file(tmp_path):
    """A real full filesystem: a 64 KiB tmpfs (root only; skipped elsewhere). torch's zip writer
    raises a RuntimeError there, not an OSError."""
    disk = tmp_path / "tiny"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        target = disk / "checkpoints" / "last.ckpt"
        with pytest.raises(CheckpointWriteError, match=r"could not write the checkpoint .*is the disk full\?"):
            AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.zeros(100_000)}}, target)
        assert list(target.parent.iterdir()) == []
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


# What Lightning itself writes into a checkpoint (its checkpoint connector's dump_checkpoint).
LIGHTNING_KEYS = {
    "epoch",
    "global_step",
    "pytorch-lightning_version",
    "state_dict",
    "loops",
    "callbacks",
    "optimizer_states",
    "lr_schedulers",
    "hparams_name",
    "hyper_parameters",
    "datamodule_hyper_parameters",
    "hparams_type",
    "MixedPrecision",
}


@pytest.mark.parametrize("recipe", ["multihead", "weighted", "gan", "tbptt", "accumulation"])
def test_every_key_a_checkpoint_holds_is_lightnings_or_declared_with_its_owner(tmp_path, recipe):
    small = {
        "gan": (*SMALL_GAN, "model.n_plot_samples=0"),
        "tbptt": ("model.net.hidden_size=16", "data.seq_len=32", "model.sample_length=5", "data.layout=streams"),
    }
    out = train_here(
        tmp_path / "run", f"recipe={recipe}", *small.get(recipe, ()), *QUIET, "trainer=cpu", "trainer.max_steps=2"
    )
    keys = set(load_checkpoint(out / "checkpoints/last.ckpt"))
    declared = {key.name for key in SAVED_KEYS}
    assert keys - LIGHTNING_KEYS <= declared, (
        f"undeclared in multiloss.saving.saved_state: {keys - LIGHTNING_KEYS - declared}"
    )
    assert keys & declared, "multiloss's own keys are in the checkpoint"
