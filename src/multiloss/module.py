"""What every recipe's LightningModule shares: its optimizer from the config, and loss logging."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import lightning as L
import torch
from torch.optim import Optimizer

from multiloss.metrics import EpochMeans

OptimizerFactory = Callable[..., Optimizer]


class RecipeModule(L.LightningModule):
    """Base of the single-optimizer recipes: ``optimizer`` is a Hydra ``_partial_`` (``model.optimizer``)."""

    def __init__(self, optimizer: OptimizerFactory) -> None:
        super().__init__()
        self.optimizer_factory = optimizer
        self.epoch_means = EpochMeans()  # validation losses, filled by log_losses

    def check_trainer(self, trainer: L.Trainer) -> None:
        """Reject Trainer settings this recipe cannot honour (raise `ConfigError` with ``trainer.*`` keys).

        `multiloss.train` calls it after building the Trainer and before writing anything.
        """

    def configure_optimizers(self) -> Optimizer:
        return self.optimizer_factory(self.parameters())

    def log_losses(self, losses: Mapping[str, torch.Tensor], prefix: str = "loss/", batch_size: int | None = None):
        """Log each component under its own name (``loss/head0``, ...) beside the total.

        Training values are logged per step (the curves; under DDP, rank zero's own micro-batch, as
        Lightning does without a collective per step); validation values per epoch, as the mean over
        every rank's examples (`multiloss.metrics.EpochMeans`).
        """
        if not self.training:
            self.epoch_means.log(self, losses, prefix, batch_size or 1)
            return
        self.log_dict(
            {f"{prefix}{name}": value.detach() for name, value in losses.items()},
            on_step=True,
            on_epoch=False,
            batch_size=batch_size,
        )
