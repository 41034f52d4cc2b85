"""The progress bar takes the batch count at most ``refresh_rate`` times a second, and always at an epoch's end."""

from __future__ import annotations

from typing import ClassVar

from multiloss import train
from multiloss.callbacks import ProgressBar
from tests.conftest import ONE_CPU_NO_VAL


class CountingBar(ProgressBar):
    updated: ClassVar[list[int]] = []  # batch_idx of every update the bar took
    shown: ClassVar[set[str]] = set()  # every metric name the bar showed

    def get_metrics(self, trainer, pl_module):
        items = super().get_metrics(trainer, pl_module)
        CountingBar.shown |= set(items)
        return items

    def _update_metrics(self, trainer, pl_module) -> None:
        if trainer.training and not trainer.sanity_checking:
            CountingBar.updated.append(trainer.fit_loop.epoch_loop.batch_idx)
        super()._update_metrics(trainer, pl_module)


def test_bar_updates_at_its_rate_and_at_every_epoch_end(make_cfg, tmp_path):
    CountingBar.updated = []
    cfg = make_cfg(
        "recipe=multihead",
        *ONE_CPU_NO_VAL,
        "callbacks=default",
        "~callbacks.loss_curves",
        "trainer.limit_val_batches=2",
        "callbacks.progress_bar._target_=tests.test_progress.CountingBar",
        "callbacks.progress_bar.refresh_rate=1",
        "trainer.enable_progress_bar=true",
        "trainer.max_epochs=2",
        output_dir=tmp_path,
        quiet=False,
    )
    train(cfg)
    batches = 23  # digits: 1,437 training examples in batches of 64
    # Two epochs of millisecond batches at 1 update a second: a handful of updates, not 46; each
    # epoch's last batch among them (epoch-end hooks add their own).
    assert len(CountingBar.updated) < batches
    assert CountingBar.updated.count(batches - 1) >= 2
    assert CountingBar.shown and "v_num" not in CountingBar.shown  # the CSV logger's version is not a metric
