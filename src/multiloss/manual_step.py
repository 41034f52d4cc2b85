"""What a recipe's ``training_step`` calls to write its whole step by hand, under Lightning's manual optimization.

`ManualStep` is the half of `multiloss.module.Recipe` a step reads top to bottom: whether this
micro-batch ends an optimizer step (`steps_on`), DDP's all-reduce skipped on the micro-batches that
do not (`gradient_sync`), clipping at ``model.gradient_clip_val`` on the true gradients
(`clip_gradients`), and the learning-rate schedule (`step_lr_schedule`). It also refuses the Trainer
settings these replace (`check_trainer`) and tells Lightning's loop how many micro-batches make a
step (`count_steps_in`), so its logging step and log rows count optimizer steps. The options
themselves — ``accumulate_grad_batches``, ``gradient_clip_val``, ``gradient_clip_algorithm``,
``scheduler`` — every recipe takes, and hands to `set_step_options`.
"""

from __future__ import annotations

import contextlib
from typing import Any

import lightning as L
from lightning.pytorch.loops.utilities import _block_parallel_sync_behavior
from torch.optim import Optimizer

from multiloss import precision
from multiloss.components import plain
from multiloss.config import ConfigError, require
from multiloss.learning_rate import RatePlan, apply_rule
from multiloss.schedules import build_schedule

_NOTHING = contextlib.nullcontext()  # reusable: the block of a micro-batch that steps


class ManualStep(L.LightningModule):
    """The tools of a training step written by hand: accumulation, DDP's sync, clipping, the LR schedule."""

    accumulates_batches: bool  # a micro-batch is a training batch (the recipe contract: multiloss.module)

    def set_step_options(
        self,
        accumulate_grad_batches: int,
        gradient_clip_val: float | None,
        gradient_clip_algorithm: str,
        scheduler: Any,
    ) -> None:
        """Check and keep the step options (keys relative to the recipe's node: ``accumulate_grad_batches``, ...)."""
        require(
            isinstance(accumulate_grad_batches, int) and accumulate_grad_batches >= 1,
            "accumulate_grad_batches",
            accumulate_grad_batches,
            "an integer ≥ 1 (micro-batches per optimizer step; 1 = no accumulation)",
        )
        require(
            gradient_clip_val is None or gradient_clip_val > 0,
            "gradient_clip_val",
            gradient_clip_val,
            "a positive number (the largest gradient norm, or value, per step), or null for no clipping",
        )
        require(
            gradient_clip_algorithm in ("norm", "value"),
            "gradient_clip_algorithm",
            gradient_clip_algorithm,
            "norm or value",
        )
        self.accumulate_grad_batches = accumulate_grad_batches
        self.gradient_clip_val, self.gradient_clip_algorithm = gradient_clip_val, gradient_clip_algorithm
        self.scheduler_spec = plain(scheduler)
        self.rate_plans: dict[str, RatePlan] = {}  # per optimizer config key, in configure_optimizers' order

    def check_trainer(self, trainer: L.Trainer) -> None:
        """Refuse the Trainer settings a recipe does itself, naming its own key (called before anything is written)."""
        moved = (
            ("accumulate_grad_batches", trainer.accumulate_grad_batches, 1),
            ("gradient_clip_val", trainer.gradient_clip_val, None),
            ("gradient_clip_algorithm", getattr(trainer.gradient_clip_algorithm, "value", None), None),
        )
        for key, value, unset in moved:
            if value != unset:
                with_value = " with model.gradient_clip_val=<max>" if key == "gradient_clip_algorithm" else ""
                raise ConfigError(
                    f"trainer.{key}",
                    value,
                    f"{unset if unset is not None else 'null'}; every recipe does this in its own step: "
                    f"model.{key}={value}{with_value}",
                    "Lightning cannot apply it under manual optimization",
                )

    def count_steps_in(self, trainer: L.Trainer, stage: str) -> None:
        """Tell ``trainer`` the recipe's micro-batches per step, and give 16-mixed's scaler the clipping it needs."""
        if stage == "fit" and self.accumulates_batches:
            # Lightning's loop then counts optimizer steps as this recipe takes them: its logging step,
            # its log rows and estimated_stepping_batches (Lightning's own GradientAccumulationScheduler
            # sets it at run time the same way). Lightning checked it was 1 just before this hook.
            trainer.accumulate_grad_batches = self.accumulate_grad_batches
        precision.install(trainer.precision_plugin)

    def teardown(self, stage: str) -> None:
        if stage == "fit" and self._trainer is not None:
            self.trainer.accumulate_grad_batches = 1  # a Trainer fitted again passes Lightning's check again

    def total_optimizer_steps(self) -> int:
        """How many optimizer steps the run takes (a schedule's ``total_steps``): Lightning's estimate."""
        return int(self.trainer.estimated_stepping_batches)

    def lr_rule(self, optimizer: Optimizer) -> tuple[float, dict[str, Any]]:
        """The recipe's factor on ``optimizer``'s configured rates, and what it was computed from (1: none)."""
        return 1.0, {}

    def with_schedule(self, optimizer: Optimizer, key: str = "model.optimizer") -> Any:
        """``optimizer`` (config key ``key``) at the recipe's rate rule, with its ``model.scheduler`` schedule, as
        ``configure_optimizers`` returns them; its `RatePlan` kept for checkpoints and resumes
        (`multiloss.learning_rate`).

        Outside a Trainer the optimizer alone, at its configured rates: a rule and a schedule are made for a run.
        """
        if self._trainer is None:
            return optimizer
        plan = apply_rule(optimizer, key, *self.lr_rule(optimizer))
        schedule, plan.schedule = build_schedule(self.scheduler_spec, optimizer, self._trainer)
        self.rate_plans[key] = plan
        return optimizer if schedule is None else {"optimizer": optimizer, "lr_scheduler": schedule}

    def steps_on(self, batch_idx: int) -> bool:
        """Whether training batch ``batch_idx`` ends an optimizer step: every ``accumulate_grad_batches``-th of
        its epoch, and the epoch's last (no gradient is carried into the next epoch), as Lightning decides."""
        return (batch_idx + 1) % self.accumulate_grad_batches == 0 or self.epoch_ends()

    def epoch_ends(self) -> bool:
        """Whether the training batch being trained is its epoch's last."""
        return self.trainer.fit_loop.epoch_loop._num_ready_batches_reached()

    def gradient_sync(self, stepping: bool) -> Any:
        """A block whose backward DDP all-reduces only when ``stepping``: micro-batches that do not step skip it."""
        return _NOTHING if stepping else _block_parallel_sync_behavior(self.trainer.strategy, block=True)

    def clip_gradients(
        self,
        optimizer: Any,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Lightning's ``clip_gradients`` at ``model.gradient_clip_val`` (nothing when unset), on the true gradients
        under 16-mixed (`multiloss.precision`)."""
        value = self.gradient_clip_val if gradient_clip_val is None else gradient_clip_val
        if value is None:
            return
        precision.unscale_for_clipping(self.trainer.precision_plugin, optimizer)
        super().clip_gradients(optimizer, value, gradient_clip_algorithm or self.gradient_clip_algorithm)

    def step_lr_schedule(self, optimizer: Any, stepped: bool, batch_done: bool = True) -> None:
        """``optimizer``'s schedule: a step after each of its steps (interval step), one after an epoch's last batch."""
        configs = self.trainer.lr_scheduler_configs
        if not configs:
            return
        raw = getattr(optimizer, "optimizer", optimizer)
        for config in configs:
            interval = getattr(config.scheduler, "interval", config.interval)  # ours say; torch's: Lightning's
            if config.scheduler.optimizer is raw and (
                (stepped and interval == "step") or (interval == "epoch" and batch_done and self.epoch_ends())
            ):
                config.scheduler.step()
