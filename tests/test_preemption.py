"""Nothing lost: a run always leaves a checkpoint to continue from, and a SIGTERM saves the step it reached.

Real signals to the real process, real checkpoints on disk, resumed by ``ckpt_path=last`` in the
same run dir; every resume is compared with a run that was never interrupted (weights equal, 0.0).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

from multiloss import train
from multiloss.callbacks import RunPreempted
from multiloss.config import ConfigError
from tests.conftest import ROOT, load_weights, run_cli, run_shell
from tests.helpers import logged_rows

SMALL = (
    "model.net.width=32",
    "model.net.dropout=0.2",
    "data.batch_size=128",
    "trainer=cpu",
    "~callbacks.loss_curves",
)
# 1438 training digits / 128 = 12 batches an epoch.
RECIPES = {
    "multihead": ("recipe=multihead", *SMALL),
    # 4 micro-batches a step: a signal mid-step waits for the step's end.
    "accumulation": ("recipe=accumulation", *SMALL, "model.accumulate_grad_batches=4"),
}


def _signal_at(step: int, rank: int | None = None) -> tuple[str, ...]:
    rank_override = (f"+callbacks.signal.rank={rank}",) if rank is not None else ()
    return ("+callbacks.signal._target_=tests.helpers.SignalAt", f"+callbacks.signal.step={step}", *rank_override)


def _same(a, b) -> None:
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a if isinstance(a[k], torch.Tensor))
    assert worst == 0.0, f"weights differ by up to {worst:.3g}"


def _global_step(run) -> int:
    return torch.load(run / "checkpoints/last.ckpt", weights_only=True)["global_step"]


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_sigterm_saves_the_step_it_reached_and_ckpt_path_last_continues_exactly(make_cfg, tmp_path, recipe):
    common, end = RECIPES[recipe], "trainer.max_steps=9"
    straight, run = tmp_path / "straight", tmp_path / "run"
    train(make_cfg(*common, end, output_dir=straight))

    with pytest.raises(RunPreempted) as stopped:
        train(make_cfg(*common, end, *_signal_at(step=4), output_dir=run))
    assert stopped.value.signum == signal.SIGTERM and stopped.value.exit_code == 143
    # Sent as the batch of step 4 began: that batch (or under accumulation, that step's last
    # micro-batch) finished, and the checkpoint holds step 5, mid-epoch.
    assert stopped.value.checkpoint == run / "checkpoints/last.ckpt"
    assert _global_step(run) == 5

    train(make_cfg(*common, end, "ckpt_path=last", output_dir=run))
    assert _global_step(run) == 9
    _same(load_weights(run / "checkpoints/last.ckpt"), load_weights(straight / "checkpoints/last.ckpt"))


def test_a_run_stopped_inside_a_mid_epoch_validation_continues_its_log_rows_bit_for_bit(make_cfg, tmp_path):
    """The outside check: weighted stopped by SIGTERM inside its mid-epoch validation, continued with
    ckpt_path=last: the weights were equal, but the first training row after the resume was the mean of the steps
    since the resume, not of the row's window (5 steps, rows at steps 4, 9, ...: stopped at 16, the row of step 19
    holds steps 15-19). The window's rows are in the checkpoint now: every row of metrics.csv is the straight run's."""
    common = (
        "recipe=weighted",
        "model.net.width=16",
        "data.batch_size=64",  # 23 batches an epoch
        "trainer=cpu",
        "trainer.max_steps=30",
        "trainer.val_check_interval=8",  # after steps 8 and 16 of the first epoch
        "trainer.limit_val_batches=2",
        "trainer.num_sanity_val_steps=0",
        "~callbacks.loss_curves",
    )
    straight, run = tmp_path / "straight", tmp_path / "run"
    train(make_cfg(*common, output_dir=straight))
    signal_in_validation = ("+callbacks.signal._target_=tests.helpers.SignalInValidation", "+callbacks.signal.step=16")
    with pytest.raises(RunPreempted):
        train(make_cfg(*common, *signal_in_validation, output_dir=run))
    assert _global_step(run) == 16
    train(make_cfg(*common, "ckpt_path=last", output_dir=run))
    rows = logged_rows(run)
    assert rows == logged_rows(straight)
    assert [r["step"] for r in rows if r.get("loss/total")][:4] == ["4", "9", "14", "19"]
    _same(load_weights(run / "checkpoints/last.ckpt"), load_weights(straight / "checkpoints/last.ckpt"))


@pytest.mark.parametrize(
    "bounds",
    [("trainer.max_steps=20",), ("trainer.max_steps=100000", "trainer.max_epochs=2"), ("trainer.max_epochs=2",)],
    ids=["max_steps", "max_steps_and_max_epochs", "max_epochs"],
)
def test_sigterm_on_an_epochs_last_batch_resumes_into_the_next_epoch_whatever_bounds_the_run(
    make_cfg, tmp_path, bounds
):
    # Lightning 2.6 replays a finished epoch's end when max_steps is set: one epoch counted twice
    # (another data order; with max_epochs=2 it stopped at once, 12 of 24 steps trained).
    common = RECIPES["multihead"]
    straight, run = tmp_path / "straight", tmp_path / "run"
    train(make_cfg(*common, *bounds, output_dir=straight))
    with pytest.raises(RunPreempted):
        train(make_cfg(*common, *bounds, *_signal_at(step=11), output_dir=run))  # the batch of step 11: epoch 0's last
    assert _global_step(run) == 12

    train(make_cfg(*common, *bounds, "ckpt_path=last", output_dir=run))
    done = torch.load(run / "checkpoints/last.ckpt", weights_only=True)
    expected = torch.load(straight / "checkpoints/last.ckpt", weights_only=True)
    assert (done["global_step"], done["epoch"]) == (expected["global_step"], expected["epoch"])
    _same(done["state_dict"], expected["state_dict"])


def test_ctrl_c_saves_the_step_it_reached_like_sigterm(make_cfg, tmp_path):
    common, end = RECIPES["multihead"], "trainer.max_steps=9"
    straight, run = tmp_path / "straight", tmp_path / "run"
    train(make_cfg(*common, end, output_dir=straight))
    with pytest.raises(RunPreempted) as stopped:
        train(make_cfg(*common, end, *_signal_at(step=4), "+callbacks.signal.signum=2", output_dir=run))
    assert stopped.value.signum == signal.SIGINT and stopped.value.exit_code == 130
    assert _global_step(run) == 5
    train(make_cfg(*common, end, "ckpt_path=last", output_dir=run))
    _same(load_weights(run / "checkpoints/last.ckpt"), load_weights(straight / "checkpoints/last.ckpt"))


def test_a_second_ctrl_c_stops_at_once(make_cfg, tmp_path):
    twice = (*_signal_at(step=4), "+callbacks.signal.signum=2", "+callbacks.signal.times=2")
    with pytest.raises(SystemExit) as stopped:  # Lightning's shutdown on KeyboardInterrupt
        train(make_cfg(*RECIPES["multihead"], "trainer.max_steps=9", *twice, output_dir=tmp_path))
    assert stopped.value.code == 1
    assert not (tmp_path / "checkpoints/last.ckpt").exists()  # not saved: the first epoch had not ended


def test_the_handlers_before_the_run_are_back_after_it(make_cfg, tmp_path):
    def mine(signum, frame):
        raise AssertionError("not during the run")

    before = signal.signal(signal.SIGTERM, mine)
    try:
        with pytest.raises(RunPreempted):
            train(make_cfg(*RECIPES["multihead"], "trainer.max_steps=6", *_signal_at(step=2), output_dir=tmp_path))
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)


@pytest.mark.parametrize(("seconds", "saved_at"), [(0, 24), (3600, None)])
def test_a_run_killed_after_its_first_epoch_continues_from_the_epoch_boundary(make_cfg, tmp_path, seconds, saved_at):
    """last.ckpt at an epoch's end once ``epoch_save_seconds`` have passed since the last save (0: every epoch).
    A kill (no handler, no cleanup) in epoch 2 loses that epoch's steps only; ``ckpt_path=last`` goes on
    exactly. With an interval longer than the run, these short epochs saved nothing."""
    common, end = RECIPES["multihead"], "trainer.max_epochs=3"
    straight, run = tmp_path / "straight", tmp_path / "run"
    train(make_cfg(*common, end, output_dir=straight))

    killed = subprocess.run(
        [
            sys.executable,
            str(ROOT / "train.py"),
            *common,
            end,
            f"callbacks.model_checkpoint.epoch_save_seconds={seconds}",
            "print_config=false",
            "~callbacks.progress_bar",
            "trainer.enable_progress_bar=false",
            "+callbacks.die._target_=tests.helpers.DieOnRank",
            "+callbacks.die.rank=0",
            "+callbacks.die.step=30",  # epoch 2 (steps 24..35)
            f"hydra.run.dir={run}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},  # the threads of this process's runs: the same sums
    )
    assert killed.returncode == 3, killed.stderr[-3000:]
    if saved_at is None:
        assert not (run / "checkpoints/last.ckpt").exists()
        return
    assert _global_step(run) == saved_at  # the end of epoch 1

    train(make_cfg(*common, end, "ckpt_path=last", output_dir=run))
    _same(load_weights(run / "checkpoints/last.ckpt"), load_weights(straight / "checkpoints/last.ckpt"))


def test_ckpt_path_last_on_a_fresh_dir_starts_from_scratch(make_cfg, tmp_path):
    train(make_cfg(*RECIPES["multihead"], "trainer.max_steps=3", "ckpt_path=last", output_dir=tmp_path / "new"))
    assert _global_step(tmp_path / "new") == 3


def test_last_every_minutes_saves_mid_epoch(make_cfg, tmp_path):
    # An interval shorter than a step: a save at every step boundary, so the kill at step 7 leaves step 7.
    with pytest.raises(RunPreempted):
        train(
            make_cfg(
                *RECIPES["multihead"],
                "trainer.max_steps=11",
                "callbacks.model_checkpoint.last_every_minutes=1e-9",
                "callbacks.model_checkpoint.save_last_every_epoch=false",
                *_signal_at(step=7),
                output_dir=tmp_path,
            )
        )
    assert _global_step(tmp_path) == 8


@pytest.mark.parametrize("value", [0, -5])
def test_a_bad_interval_is_a_config_error_naming_the_key(make_cfg, tmp_path, value):
    with pytest.raises(ConfigError, match=r"callbacks\.model_checkpoint\.last_every_minutes"):
        train(
            make_cfg(
                *RECIPES["multihead"], f"callbacks.model_checkpoint.last_every_minutes={value}", output_dir=tmp_path
            )
        )
    assert not (tmp_path / "checkpoints").exists()


def test_sigterm_from_the_command_line_exits_143_with_the_line_that_continues(tmp_path):
    run = tmp_path / "my runs" / "one"  # a space: the printed line must still paste
    proc = run_cli(
        *RECIPES["multihead"],
        "trainer.max_steps=9",
        "print_config=false",
        *_signal_at(step=4),
        f"hydra.run.dir='{run}'",
    )
    assert proc.returncode == 143, proc.stderr[-3000:]
    message = [line for line in proc.stderr.splitlines() if line.startswith("multiloss:")]
    assert len(message) == 1
    assert "SIGTERM at global step 5" in message[0]
    resume = message[0].split("continue with: ")[1]
    # The run's own callback (a test's) trusted by name: a checkpoint names no code beyond the shipped configs' unless
    # the command says so (multiloss.saving.trust), and this command is the run's own.
    ckpt = f"\"ckpt_path='{run}/checkpoints/last.ckpt'\""
    assert resume == f"python {ROOT / 'train.py'} {ckpt} 'trust_checkpoint=[tests]'"
    # Pasted into a shell as it is (the signal's step moved past the run's end), it continues the run to its end:
    # the recipe and the budget come from the checkpoint.
    done = run_shell(f"{resume} +callbacks.signal.step=100 hydra.run.dir='{run}'")
    assert done.returncode == 0, done.stderr[-3000:]
    assert _global_step(run) == 9


def test_checkpoints_honour_the_umask(make_cfg, tmp_path):
    before = os.umask(0o027)
    try:
        train(make_cfg(*RECIPES["multihead"], "trainer.max_steps=2", output_dir=tmp_path))
    finally:
        os.umask(before)
    assert (tmp_path / "checkpoints/last.ckpt").stat().st_mode & 0o777 == 0o640


def test_without_a_checkpoint_callback_sigterm_still_stops_the_run_and_says_nothing_was_saved(make_cfg, tmp_path):
    with pytest.raises(RunPreempted, match="no checkpoint") as stopped:
        train(
            make_cfg(
                *(o for o in RECIPES["multihead"] if not o.startswith("~callbacks")),
                "trainer.max_steps=9",
                "callbacks=none",
                *_signal_at(step=3),
                "+trainer.enable_checkpointing=false",
                output_dir=tmp_path,
            )
        )
    assert stopped.value.checkpoint is None and stopped.value.step == 4


def test_a_run_in_a_worker_thread_trains_and_leaves_signals_alone(make_cfg, tmp_path):
    import threading

    errors: list[BaseException] = []
    cfg = make_cfg(*RECIPES["multihead"], "trainer.max_steps=2", output_dir=tmp_path)
    before = signal.getsignal(signal.SIGTERM)

    def run() -> None:
        try:
            train(cfg)
        except BaseException as err:  # reported by the assertion below
            errors.append(err)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    assert not errors and _global_step(tmp_path) == 2
    assert signal.getsignal(signal.SIGTERM) is before


def test_ctrl_c_from_the_command_line_exits_130_with_the_line_that_continues(tmp_path):
    run = tmp_path / "run"
    proc = run_cli(
        *RECIPES["multihead"],
        "trainer.max_steps=9",
        "print_config=false",
        *_signal_at(step=4),
        "+callbacks.signal.signum=2",
        f"hydra.run.dir={run}",
    )
    assert proc.returncode == 130, proc.stderr[-3000:]
    (message,) = [line for line in proc.stderr.splitlines() if line.startswith("multiloss:")]
    assert (
        "SIGINT at global step 5" in message
        and f"continue with: python {ROOT / 'train.py'} ckpt_path={run}/checkpoints/last.ckpt" in message
    )


def test_sigterm_during_set_up_gives_the_lock_back(tmp_path):
    """A SIGTERM while Lightning sets the run up (the lock taken first thing, no step yet, the run's own handler not
    installed): exit 143, one line, and the run dir keeps no lock (the next run would take over a dead one's, but the
    dir is left as found)."""
    import time

    run = tmp_path / "run"
    env = {**os.environ, "HYDRA_FULL_ERROR": "0", "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, str(ROOT / "train.py"), *RECIPES["multihead"], "print_config=false"]
    marker = tmp_path / "in_set_up"
    slow = ["+callbacks.slow._target_=tests.helpers.SlowSetup", f"+callbacks.slow.marker={marker}"]
    proc = subprocess.Popen(
        [*command, *slow, f"hydra.run.dir={run}"], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    assert (run / ".multiloss.lock").exists()
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143, stderr[-3000:]
    assert "multiloss: run stopped: SIGTERM before the first step: nothing to save" in stderr
    assert not (run / ".multiloss.lock").exists()
    assert not (run / "checkpoints").exists()
