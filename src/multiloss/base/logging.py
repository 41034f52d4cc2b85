"""`RecipeLogging`: how a recipe logs — its losses by name, other training values, the learning rates, the step index.

Training values go to the recipe's `TrainingLog` (one kernel a step, written as means on Lightning's
log rows, judged by the non-finite guard); validation values are logged per epoch as the mean over
every rank's examples (`multiloss.base.metrics.EpochMeans`). A mixin of `multiloss.base.module.Recipe`.
"""

from __future__ import annotations

from collections.abc import Mapping

import lightning as L
import torch

from multiloss import lightning_internals as internals
from multiloss.base.metrics import EpochMeans
from multiloss.base.training_log import TrainingLog


class RecipeLogging(L.LightningModule):
    """The logging half of a recipe (`multiloss.base.module.Recipe`)."""

    def __init__(self) -> None:
        super().__init__()
        self.training_log = TrainingLog()  # training values between log rows; the non-finite guard reads it
        self.epoch_means = EpochMeans()  # validation losses, filled by log_losses
        self._log_names: dict[tuple[str, ...], tuple[str, ...]] = {}  # (prefix, *names) -> logged names
        self._rate_names: tuple[str, ...] | None = None  # the learning-rate columns, named as Lightning names them

    @property
    def eval_prefix(self) -> str:
        """The prefix of evaluation metrics: ``test`` under ``trainer.test`` (``multiloss-eval``), else ``val``."""
        trainer = internals.attached_trainer(self)
        return "test" if trainer is not None and trainer.testing else "val"

    def log_losses(
        self, losses: Mapping[str, torch.Tensor], prefix: str = "loss/", batch_size: int | torch.Tensor | None = None
    ) -> None:
        """Log each loss component under its own name (``loss/head0``, ...) beside the total.

        Training values go to the `TrainingLog` (one kernel a step, written as means on Lightning's log
        rows, judged by the non-finite guard; under DDP rank zero's own micro-batches, as Lightning does
        without a collective per step). Validation values are logged per epoch, as the mean over every
        rank's examples (`multiloss.base.metrics.EpochMeans`).
        """
        if not self.training:
            self.epoch_means.log(self, losses, prefix, 1 if batch_size is None else batch_size)
            return
        key = (prefix, *losses)
        if (names := self._log_names.get(key)) is None:
            names = self._log_names[key] = tuple(f"{prefix}{name}" for name in losses)
        self.training_log.add(names, list(losses.values()), self.trainer.global_step)

    def log_train_values(self, names: tuple[str, ...], values: torch.Tensor) -> None:
        """Training values that are not losses (a 1-D tensor, one per name), logged as means on the log rows."""
        self.training_log.add(names, values.detach(), self.trainer.global_step, watched=False)

    def log_learning_rates(self) -> None:
        """The rate each param group trains this step at, on the log row, named as Lightning's LearningRateMonitor
        names it (``lr-SGD``, ``lr-Adam/generator``): the recipe owns the rate, so it logs it (no per-batch hook)."""
        optimizers = [getattr(o, "optimizer", o) for o in self.trainer.optimizers]
        if self._rate_names is None:
            self._rate_names = tuple(n for names in internals.learning_rate_names(optimizers) for n in names)
        rates = [group["lr"] for optimizer in optimizers for group in optimizer.param_groups]
        self.training_log.add(
            self._rate_names, torch.tensor(rates, dtype=torch.float64), self.trainer.global_step, watched=False
        )

    @property
    def step_index(self) -> int:
        """The step every output of a run names (`multiloss.base.training_log.TrainingLog`)."""
        if self.training_log.step_index is not None:
            return self.training_log.step_index
        return max(internals.batches_that_stepped(self.trainer) - 1, 0)

    def mean_over_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` averaged over the ranks (itself on one device): a collective, every rank calls it."""
        return self.trainer.strategy.reduce(tensor, reduce_op="mean")

    def sum_over_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over the ranks (itself on one device): a collective, every rank calls it."""
        return self.trainer.strategy.reduce(tensor, reduce_op="sum")
