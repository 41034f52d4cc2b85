"""Lightning's rich progress bar, at the pace a person reads it rather than at every batch."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar

from multiloss.callbacks.lean import LeanCallback


class ProgressBar(RichProgressBar, LeanCallback):
    """`RichProgressBar` (all its arguments) taking the batch count and metrics at most ``refresh_rate`` times a second.

    The stock bar updates its task and re-reads the logged metrics (a walk over Lightning's result
    collection) after every batch, whatever ``refresh_rate`` says about drawing: on a model whose
    step takes a millisecond that is a third of the step. Here a batch ending less than
    ``1 / refresh_rate`` s after the last update leaves the bar alone; an epoch's last batch and
    the run's last (``max_steps``, a stop) always update it. The logger's version number (``v_num``) is not shown.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._next_update = 0.0

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.monotonic()
        last = (
            batch_idx + 1 >= trainer.num_training_batches
            or 0 < trainer.max_steps <= trainer.global_step
            or trainer.should_stop
        )
        if now < self._next_update and not last:
            return
        self._next_update = now + 1 / max(self.refresh_rate, 1)
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        # Without the logger's version number ("v_num: 0.000"), which says nothing about the run.
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        return items
