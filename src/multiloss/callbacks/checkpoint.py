"""Lightning's ModelCheckpoint, whose ``last.ckpt`` resumes exactly wherever the run stopped."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch import callbacks as lightning_callbacks
from lightning.pytorch.callbacks import ModelCheckpoint

from multiloss import lightning_internals as internals
from multiloss.callbacks.lean import LeanCallback
from multiloss.callbacks.preemption import Preemption, agree, stop_run
from multiloss.config import ConfigError


class Checkpoint(ModelCheckpoint, LeanCallback):
    """`ModelCheckpoint` (all its arguments) whose ``last.ckpt`` is always the last step trained, resumable.

        Two more arguments make ``last.ckpt`` a policy that always leaves something to resume from
        (stock Lightning with ``save_top_k=0`` writes it only when training ends: a run killed after 2 of
        15 epochs left nothing):

        - ``save_last_every_epoch`` (default true): ``last.ckpt`` at a training epoch's end, once
          ``epoch_save_seconds`` of training have passed since the last save (0, the default here: every
          epoch's end; the shipped config's 60 s keeps a run of many short epochs from paying a save per
          epoch, and still loses at most a minute and an epoch);
        - ``last_every_minutes``: also mid-epoch, at the first step boundary after this many minutes of
          training since the last save (all ranks agree on it, `multiloss.callbacks.preemption.agree`).

    It decides when to save: at each step boundary, on its own clock and on what `multiloss.callbacks.Preemption`
    asks (a signal: save this step, then the run stops).

        Each save replaces the file atomically (`multiloss.saving.checkpoints.AtomicCheckpointIO`).

        Four holes in stock Lightning's ``last.ckpt``, each making a resume differ from a straight run:

        - A run stopped by ``max_steps`` *mid-epoch* is saved in ``on_train_end``, after the loop has
          marked the epoch finished: a resume starts a new epoch and skips the rest of this one. Here it
          is saved at the final batch's end, with the loader's position, like a periodic checkpoint.
        - A run stopped by ``max_steps`` exactly *at an epoch's last batch*, saved at that batch, resumes
          one epoch too far (Lightning's restart counts the finished epoch twice: a whole epoch of data
          skipped). Here that step is saved at the epoch's end instead, a state Lightning resumes from
          into the next epoch, and the data modules' sampler takes its epoch from the trainer
          (`multiloss.data.arrays`). (With ``limit_train_batches`` the loader is left mid-pass at an
          epoch's end and Lightning resumes it there: that case is still off.)
        - A step saved at the end of a training batch that a validation follows (``val_check_interval``)
          resumes after that validation without running it: a plateau schedule or early stopping that
          acts on it acts one validation later. Here such a step (stopped by ``max_steps``, a signal or
          ``last_every_minutes``) is saved when its validation ends.
        - Training that ends after a periodic checkpoint (``max_epochs``, early stopping) keeps that one
          as ``last.ckpt`` (step 20 of 23 with ``every_n_train_steps=10``). Here the final step is saved.
    """

    def __init__(
        self,
        *args: Any,
        save_last_every_epoch: bool = True,
        epoch_save_seconds: float = 0.0,
        last_every_minutes: float | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if not (isinstance(epoch_save_seconds, int | float) and epoch_save_seconds >= 0):
            raise ConfigError("epoch_save_seconds", epoch_save_seconds, "a number of seconds ≥ 0 (0: every epoch)")
        if last_every_minutes is not None and not (
            isinstance(last_every_minutes, int | float) and last_every_minutes > 0
        ):
            raise ConfigError("last_every_minutes", last_every_minutes, "a number of minutes > 0, or null (off)")
        self.preemption: Preemption | None = None  # what a signal asks: found when training starts
        self.save_last_every_epoch, self.epoch_save_seconds = save_last_every_epoch, epoch_save_seconds
        self.last_every_minutes = last_every_minutes
        self._saved_at = time.monotonic()
        self._batch_end_after_validation: int | None = None  # a training batch whose end waits for its validation
        self._seen_step = 0

    def interval_due(self) -> bool:
        """``last_every_minutes`` have passed since the last save (or the start), on this process's clock."""
        return self.last_every_minutes is not None and time.monotonic() - self._saved_at >= 60 * self.last_every_minutes

    def epoch_save_due(self, trainer: L.Trainer) -> bool:
        """An epoch's end is to save ``last.ckpt``: ``save_last_every_epoch`` and ``epoch_save_seconds`` since the
        last save (or training's start), on this process's clock (`multiloss.callbacks.Preemption` agrees the ranks)."""
        return (
            self.save_last_every_epoch
            and trainer.global_step > 0
            and time.monotonic() - self._saved_at >= self.epoch_save_seconds
        )

    @property
    def saves_on_request(self) -> bool:
        """Whether this callback saves what `Preemption` asks for (and stops the run after): it keeps ``last.ckpt``."""
        return bool(self.save_last)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._saved_at = time.monotonic()  # the intervals count training, not setup
        self._seen_step = trainer.global_step
        self.preemption = next((c for c in trainer.callbacks if isinstance(c, Preemption)), None)

    def save_last_now(self, trainer: L.Trainer) -> Path | None:
        """Save ``last.ckpt`` at this step (every rank together) unless it holds this step already; its path."""
        if self.save_last and not internals.saved_this_step(self, trainer):
            internals.save_last(self, trainer)
        return Path(self.last_model_path) if self.last_model_path else None

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        self._saved_at = time.monotonic()  # any save, this callback's or another's: the intervals count from it
        return super().on_save_checkpoint(trainer, pl_module, checkpoint)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if internals.saves_periodically(self):
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)  # Lightning's periodic saves
        stepped, self._seen_step = trainer.global_step != self._seen_step, trainer.global_step
        if not stepped:
            return  # a micro-batch inside a step: nothing to save, nothing for Preemption to decide
        if batch_idx + 1 < trainer.num_training_batches and internals.validation_follows(trainer):
            # A save here would precede this batch's validation, which a resume skips (Lightning counts it
            # done): a schedule stepped on it, or an early stop, would differ. The validation's end decides.
            self._batch_end_after_validation = batch_idx
            return
        self._batch_end(trainer, batch_idx)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        batch_idx, self._batch_end_after_validation = self._batch_end_after_validation, None
        if batch_idx is not None and not trainer.sanity_checking and trainer.state.fn == "fit":
            self._batch_end(trainer, batch_idx)

    def _batch_end(self, trainer: L.Trainer, batch_idx: int) -> None:
        epoch_ends = batch_idx + 1 >= trainer.num_training_batches
        if self.save_last and self._final_step(trainer) and not epoch_ends:
            internals.save_last(self, trainer)
        if self.save_last and not epoch_ends:  # after every other callback's hook: the whole step
            self._decide(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        if self.save_last and self._final_step(trainer):
            internals.save_last(self, trainer)
        if self.save_last:
            self._decide(trainer, epoch_end=True)

    def _decide(self, trainer: L.Trainer, epoch_end: bool = False) -> None:
        """Save ``last.ckpt`` at this step boundary when any rank is asked to stop (a signal: then the run stops), its
        time interval is due, or — at an epoch's end — the epoch-end save is due: one agreement of the ranks."""
        asked = self.preemption.requests() if self.preemption is not None else (False, False)
        epoch_due = epoch_end and self.epoch_save_due(trainer)
        stop, requeue, due, epoch_due = agree(trainer, (*asked, self.interval_due(), epoch_due))
        if not (stop or due or epoch_due):
            return
        saved = self.save_last_now(trainer)
        if stop:
            stop_run(trainer, self.preemption.signalled if self.preemption is not None else None, requeue, saved)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.save_last and trainer.global_step > 0 and not internals.saved_this_step(self, trainer):
            internals.save_last(self, trainer)
            return
        super().on_train_end(trainer, pl_module)

    def _final_step(self, trainer: L.Trainer) -> bool:
        """``max_steps`` reached by the step just taken, and no checkpoint of it yet."""
        return 0 < trainer.max_steps <= trainer.global_step and not internals.saved_this_step(self, trainer)


class LearningRateMonitor(lightning_callbacks.LearningRateMonitor, LeanCallback):
    """Lightning's `LearningRateMonitor` (all its arguments), skipped on the per-batch hooks it does not use."""
