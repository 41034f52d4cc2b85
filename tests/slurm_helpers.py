"""A callback the SLURM tests put into a job: it has SLURM stop the job once, mid-run, as a pre-emption would."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import lightning as L


class PreemptOnce(L.Callback):
    """On the job's first attempt, at ``step``, rank 0 asks SLURM to stop it: ``scontrol requeue`` (SLURM
    then sends SIGTERM to every task and queues the job again) or ``scancel --signal=USR1`` (every task
    gets SIGUSR1, as ``sbatch --signal=USR1@<s>`` sends it before the time limit; the run requeues
    itself), or ``sigusr1_to_rank_1``: SIGUSR1 to rank 1 alone (SLURM signals each node's tasks on its own:
    rank 0's may come later, or not before the agreement). The steps after it are slowed, so that the run is
    still training when the signal lands; with ``hold``, the batch of ``step`` waits for the signal instead (a
    stop on that very batch). ``scontrol_requeuehold`` requeues the job held: its next attempt waits for
    ``scontrol release`` (a test changes the job's allocation in between).
    Writes ``preempted.txt`` (the step the run saved) into the run dir when the run stops.
    """

    def __init__(self, how: str, step: int, hold: bool = False) -> None:
        # hold: keep the batch of `step` from ending until this rank has the signal (a stop exactly there).
        self.how, self.step, self.hold, self.asked = how, step, hold, False

    def _first_attempt(self) -> bool:
        return os.environ.get("SLURM_RESTART_COUNT", "0") == "0"

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self._first_attempt() or trainer.global_step < self.step:
            return
        if not self.asked and self.how == "sigusr1_to_rank_1" and trainer.global_rank == 1:
            os.kill(os.getpid(), signal.SIGUSR1)  # this rank alone: rank 0 hears of it only through the agreement
        elif not self.asked and self.how != "sigusr1_to_rank_1" and trainer.global_rank == 0:
            job = os.environ["SLURM_JOB_ID"]
            if self.how.startswith("scontrol_"):  # requeue, requeuehold
                subprocess.Popen(["scontrol", self.how.removeprefix("scontrol_"), job])
            else:
                subprocess.Popen(["scancel", "-s", "USR1", job])
        first = not self.asked
        self.asked = True
        if self.hold and first:
            preemption = next(c for c in trainer.callbacks if type(c).__name__ == "Preemption")
            deadline = time.monotonic() + 60
            while preemption.signalled is None and time.monotonic() < deadline:
                time.sleep(0.05)  # the handler runs between two of these
            return
        time.sleep(0.3)

    def on_exception(self, trainer, pl_module, exception) -> None:
        from multiloss.callbacks import RunPreempted

        if isinstance(exception, RunPreempted) and trainer.global_rank == 0 and exception.checkpoint:
            Path(exception.checkpoint).parent.parent.joinpath("preempted.txt").write_text(f"{exception.step}\n")
