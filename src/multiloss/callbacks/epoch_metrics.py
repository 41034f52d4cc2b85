"""An epoch's logged values reduced over the ranks by every rank at once, before any callback reads them."""

from __future__ import annotations

import lightning as L

from multiloss.callbacks.lean import LeanCallback


class EpochMetricsOnEveryRank(LeanCallback):
    """At an epoch's end, every rank computes the epoch's values (``sync_dist`` reductions, torchmetrics' ``compute``)
    right away, in the same order, before any other callback reads them.

    Lightning reduces an epoch value lazily: the first read of ``trainer.callback_metrics`` /
    ``progress_bar_metrics`` / ``logged_metrics`` after the epoch's last batch issues its collectives. The
    callbacks run before Lightning's own read (``_LoggerConnector.on_epoch_end``), and some of them read on rank
    zero only: the progress bar (``on_train_epoch_end``), a sample writer. That rank then waits in a collective
    the others never issue — they are in the next one (the preemption agreement, a checkpoint's) — and the run
    hangs. Read here first, on every rank, each value is reduced once and cached; every later reader, on any
    rank, only reads. `multiloss.training.run_callbacks` puts this callback first.
    """

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        _reduce_now(trainer)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        _reduce_now(trainer)

    def on_test_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        _reduce_now(trainer)


def _reduce_now(trainer: L.Trainer) -> None:
    if trainer.world_size > 1:
        _ = trainer.callback_metrics  # computes (and caches) every epoch value of the loop's results
