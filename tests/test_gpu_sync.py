"""On a GPU, a training step that writes no log row never waits for the GPU (no host sync).

Loss components are summed on the device and read once per log row; the non-finite guard folds its
flags on the device and reads them on log rows. Checked with ``torch.cuda.set_sync_debug_mode``:
any synchronizing call (``.item()``, ``bool(tensor)``, a blocking copy to the host) inside a
non-row step raises. Skipped on a machine without CUDA.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch

from multiloss import train
from tests.conftest import SMALL_GAN

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

RECIPES = {
    "multihead": (),
    "weighted": (),
    "accumulation": (),
    "tbptt": ("data.seq_len=64", "data.batch_size=8"),
    "gan": (*SMALL_GAN, "model.n_plot_samples=0"),
}


class NoSyncBetweenRows(L.Callback):
    """Raise on any host sync from a batch's start to its end, on batches that write no log row."""

    checked = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step >= 2 and not trainer._logger_connector.should_update_logs:
            torch.cuda.set_sync_debug_mode("error")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if torch.cuda.get_sync_debug_mode():
            torch.cuda.set_sync_debug_mode(0)
            NoSyncBetweenRows.checked += 1

    def on_exception(self, trainer, pl_module, exception) -> None:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_steps_between_log_rows_do_not_sync(make_cfg, tmp_path, recipe):
    NoSyncBetweenRows.checked = 0
    cfg = make_cfg(
        f"recipe={recipe}",
        *RECIPES[recipe],
        "trainer.accelerator=gpu",
        "trainer.devices=1",
        "trainer.max_steps=24",
        "trainer.log_every_n_steps=8",
        "trainer.limit_val_batches=0",
        "trainer.num_sanity_val_steps=0",
        "+callbacks.no_sync._target_=tests.test_gpu_sync.NoSyncBetweenRows",
        output_dir=tmp_path,
    )
    train(cfg)
    assert NoSyncBetweenRows.checked >= 5
