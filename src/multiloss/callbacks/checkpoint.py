"""Lightning's ModelCheckpoint, with the last checkpoint of a ``max_steps`` run resumable mid-epoch."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint


class Checkpoint(ModelCheckpoint):
    """`ModelCheckpoint` (all its arguments) whose ``last.ckpt`` is always the last step trained.

    Stock Lightning saves the last checkpoint of a run stopped by ``max_steps`` in ``on_train_end``,
    after the loop has marked the epoch finished: resuming it with a larger ``max_steps`` starts a
    new epoch and silently skips the rest of the interrupted one. Saved at the final batch's end
    instead, the checkpoint carries the loader's position and continues on exactly the next batch,
    like any ``every_n_train_steps`` checkpoint. And when training ends (``max_epochs``, early
    stopping) after a periodic checkpoint, stock Lightning keeps that one as ``last.ckpt`` (step 20
    of 23 with ``every_n_train_steps=10``); here the final step is saved.
    """

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        final_step = 0 < trainer.max_steps <= trainer.global_step
        if self.save_last and final_step and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.save_last and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
            return
        super().on_train_end(trainer, pl_module)
