"""`RecipeOptimizers`: a recipe's optimizers — built from their configs, at the recipe's rate rule, with their schedule.

A mixin of `multiloss.base.module.Recipe`. A single-optimizer recipe sets ``self.optimizer_factory``; the
GAN builds its two in its own ``configure_optimizers`` through `with_schedule`. Each optimizer's
`RatePlan` (configured rate × the recipe's rule × the schedule's factor) is kept for checkpoints and
resumes (`multiloss.base.learning_rate`).
"""

from __future__ import annotations

from typing import Any

import lightning as L
from torch.optim import Optimizer

from multiloss import lightning_internals as internals
from multiloss.base.learning_rate import RatePlan, apply_rule
from multiloss.base.schedules import build_schedule
from multiloss.building.components import OptimizerFactory
from multiloss.config import ConfigError


class RecipeOptimizers(L.LightningModule):
    """The optimizer half of a recipe: ``configure_optimizers``, the rate rule, the schedule."""

    scheduler_spec: Any  # model.scheduler, set by Recipe.__init__

    def __init__(self) -> None:
        super().__init__()
        self.optimizer_factory: OptimizerFactory | None = None
        self.rate_plans: dict[str, RatePlan] = {}  # per optimizer config key, in configure_optimizers' order

    def lr_rule(self, optimizer: Optimizer) -> tuple[float, dict[str, Any]]:
        """The recipe's factor on ``optimizer``'s configured rates, and what it was computed from (1: none)."""
        return 1.0, {}

    def configure_optimizers(self) -> Any:
        return self.with_schedule(self.optimizer_of(self.optimizer_factory, self.parameters(), "model.optimizer"))

    def optimizer_of(self, factory: OptimizerFactory | None, params: Any, key: str) -> Optimizer:
        """``factory(params)``, the optimizer of config ``key``; `ConfigError` naming ``key`` without a factory."""
        if factory is None:
            raise ConfigError(
                key,
                None,
                "an optimizer config (an option of the optimizer group: optimizer=adam|adamw|sgd, "
                "optimizer@model.g_optimizer=adam_gan), or a callable params -> Optimizer",
                "this module was built without one (fine for inference, not for training)",
            )
        return factory(params)

    def with_schedule(self, optimizer: Optimizer, key: str = "model.optimizer") -> Any:
        """``optimizer`` (config key ``key``) at the recipe's rate rule, with its ``model.scheduler`` schedule, as
        ``configure_optimizers`` returns them; its `RatePlan` kept for checkpoints and resumes
        (`multiloss.base.learning_rate`). Outside a Trainer the optimizer alone, at its configured rates."""
        trainer = internals.attached_trainer(self)
        if trainer is None:
            return optimizer
        plan = apply_rule(optimizer, key, *self.lr_rule(optimizer))
        schedule, plan.schedule = build_schedule(self.scheduler_spec, optimizer, trainer)
        self.rate_plans[key] = plan
        return optimizer if schedule is None else {"optimizer": optimizer, "lr_scheduler": schedule}

    def total_optimizer_steps(self) -> int:
        """How many optimizer steps the run takes (a schedule's ``total_steps``): Lightning's estimate."""
        return int(self.trainer.estimated_stepping_batches)
