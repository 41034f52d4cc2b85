"""A run told to stop saves where it is, exactly, and ends with an exit code that says so.

Stock Lightning 2.6 on SIGTERM logs ``Received SIGTERM``, stops at the next batch and exits 0:
nothing saved, a scheduler reads success. Its SLURM path (SIGUSR1, ``auto_requeue``) saves
``hpc_ckpt_<n>.ckpt`` from inside the signal handler, wherever the step was: the requeued run resumed
one step short (479 of 480, weights off by 0.1), and from a file the run-dir rules do not know.
Under DDP its handler calls ``dist.broadcast`` from inside the signal handler, on every rank SLURM
signalled, in the middle of whatever collective that rank was in.

`Preemption` replaces both handlers while the run trains, and Python's Ctrl-C (SIGINT: stock Lightning
exits 1 keeping only the last epoch-end save) with the same. A handler only notes the signal (a
second Ctrl-C stops at once, unsaved, as Python's own would): it is a *request*, to save and stop.
`multiloss.callbacks.Checkpoint` decides when to save, and asks this callback's `requests` at the end
of a batch that took an optimizer step (never between the micro-batches of one step): the ranks agree
(`agree`: one ``all_reduce(MAX)`` of four flags under DDP, nothing at all in one process) on "a signal
came", on "it was a requeue signal" (any rank's: the job is requeued), on "the checkpoint's time
interval is due" and, at an epoch's end, on "an epoch-end save is due", judged on every rank's clock,
so no rank decides alone. Then every rank saves ``last.ckpt`` together, the state of that step with
everything exact resume restores (the data position, RNG states, tbptt's carried state), and on a
signal the run stops (`stop_run`: `RunPreempted`); the epoch's last batch is left to the epoch's end,
where the checkpoint resumes into the next epoch. Without a checkpoint that saves (``callbacks=none``)
this callback agrees on and stops the run by itself, unsaved.
Under SLURM the requeue signals (SIGUSR1, the one Lightning and ``sbatch --signal`` use, and
SIGUSR2, submitit's) also requeue the job from rank zero (``scontrol requeue``): the requeued job
keeps its id, so its run dir, and resumes from that checkpoint by itself (`multiloss.resume`).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

import lightning as L
import torch

from multiloss.callbacks.lean import LeanCallback

log = logging.getLogger("multiloss")

# SIGINT (Ctrl-C) too: a run a person stops is saved at the step reached, like one a scheduler stops; a second
# Ctrl-C does not wait for the step's end (Python's KeyboardInterrupt, Lightning's shutdown, exit 1).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
REQUEUE_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)  # under SLURM only: Lightning's / sbatch --signal, submitit's


class RunPreempted(Exception):
    """The run stopped on a signal after saving (or trying to save) the step it had reached."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None, requeued: str | None) -> None:
        self.signum, self.step, self.checkpoint, self.requeued = signum, step, checkpoint, requeued
        name = signal.Signals(signum).name
        saved = f"saved {checkpoint}" if checkpoint else "no checkpoint (callbacks.model_checkpoint is off)"
        super().__init__(f"{name} at global step {step}: {saved}" + (f"; {requeued}" if requeued else ""))

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # what a shell reports for a process the signal ended


def under_slurm() -> bool:
    return "SLURM_JOB_ID" in os.environ


class Preemption(LeanCallback):
    """Notes SIGTERM, Ctrl-C (and SLURM's requeue signals) while the run trains: a request to save and stop.

    The `multiloss.callbacks.Checkpoint` that saves ``last.ckpt`` asks `requests` at each step boundary, at the
    end of its own hooks (Lightning runs checkpoint callbacks after every other, the recipe's log rows
    included, so what is saved is the whole step), and stops the run. Without one (``callbacks=none``) a
    signal still stops the run, from here.
    """

    def __init__(self) -> None:
        self.signalled: int | None = None
        self._previous: dict[int, Any] = {}
        self._signalled_trainer: L.Trainer | None = None
        self._seen_step = 0

    def requests(self) -> tuple[bool, bool]:
        """What this process was asked, as flags for `agree`: stop (any signal), and requeue (a requeue signal)."""
        return self.signalled is not None, self.signalled in REQUEUE_SIGNALS

    # --- the handlers: installed once Lightning has installed its own (it does right before the loop)

    def on_sanity_check_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._install(trainer)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._install(trainer)
        self._seen_step = trainer.global_step
        if any(getattr(c, "saves_on_request", False) for c in trainer.callbacks):
            # The checkpoint that saves asks at its own hooks' end: Lightning skips a hook that is None.
            self.on_train_batch_end = self.on_train_epoch_end = None  # type: ignore[assignment]

    def _install(self, trainer: L.Trainer) -> None:
        if self._previous or threading.current_thread() is not threading.main_thread():
            return  # Python delivers signals to the main thread only (a run in a worker thread keeps its own)
        self._signalled_trainer = trainer
        signums = STOP_SIGNALS + (REQUEUE_SIGNALS if under_slurm() else ())
        for signum in signums:
            self._previous[signum] = signal.signal(signum, self._note)

    def _note(self, signum: int, frame: Any) -> None:
        # A signal handler runs between two bytecodes of the main thread, possibly inside a log call
        # or a collective's Python wrapper: it only notes, the loop acts at a step boundary.
        first = self.signalled is None
        if not first and signum == signal.SIGINT:
            raise KeyboardInterrupt  # Ctrl-C again: stop now, without the save
        self.signalled = signum if first else self.signalled
        launcher = self._signalled_trainer.strategy.launcher if self._signalled_trainer is not None else None
        if first and launcher is not None and getattr(launcher, "procs", None):
            launcher.kill(signum)  # ranks this process started (trainer=ddp_cpu from one command) stop too

    def _uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._uninstall()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._uninstall()

    # --- without a checkpoint that saves: the stop, at step boundaries, unsaved

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        stepped, self._seen_step = trainer.global_step != self._seen_step, trainer.global_step
        if stepped and batch_idx + 1 < trainer.num_training_batches:  # an epoch's last batch: its end decides
            self._stop_if_asked(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._stop_if_asked(trainer)

    def _stop_if_asked(self, trainer: L.Trainer) -> None:
        stop, requeue = agree(trainer, self.requests())
        if stop:
            stop_run(trainer, self.signalled, requeue, None)


def agree(trainer: L.Trainer, flags: tuple[bool, ...]) -> list[bool]:
    """``flags`` as every rank agrees on them (any rank's True: one ``all_reduce(MAX)``; itself in one process)."""
    if trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        agreed = torch.tensor(flags, dtype=torch.int32, device=trainer.strategy.root_device)
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX)
        return [bool(v) for v in agreed.tolist()]
    return list(flags)


def stop_run(trainer: L.Trainer, signalled: int | None, requeue: bool, saved: Path | None) -> None:
    """Stop the run on the signal the ranks agreed on (`RunPreempted`), rank zero requeueing a SLURM job first."""
    # The signal's kind is agreed too: a requeue signal any rank saw is the job's (rank zero requeues it), even
    # where this rank saw a SIGTERM or nothing yet (SLURM signals each node's tasks on its own).
    signum = signalled if signalled is not None else signal.SIGTERM  # another rank's signal
    if requeue and signum not in REQUEUE_SIGNALS:
        signum = signal.SIGUSR1
    requeued = None
    if under_slurm() and requeue and trainer.is_global_zero:
        requeued = _requeue()
    raise RunPreempted(signum, trainer.global_step, saved, requeued)


def _requeue() -> str:
    array = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array else os.environ["SLURM_JOB_ID"]
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"could not requeue SLURM job {job}: {err}"
    if done.returncode != 0:
        return f"could not requeue SLURM job {job}: {(done.stderr or done.stdout).strip()}"
    return f"requeued SLURM job {job}: it continues from that checkpoint"
