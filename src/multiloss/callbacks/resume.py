"""What a resume may change: the optimizer's hyper-parameters and the run's rate decisions yes (applied, and said), its
optimizer class and schedule class no.

Lightning restores each optimizer's ``state_dict`` whole, param groups included, over the optimizer
the config just built: ``ckpt_path=… model.optimizer.lr=1e-4`` trained on at the checkpoint's 3e-3
while the run's records said 1e-4; ``optimizer=sgd`` over an Adam checkpoint died on
``KeyError: 'momentum'`` after the run dir's ``.hydra/`` had been rewritten to say SGD.

`ResumeRule` compares, between the optimizers' creation and the restore of their states, each
optimizer the config built with the one the checkpoint saved. The learning rate is the config's base
× the recipe's rule × the schedule's progress (`multiloss.learning_rate`, whose parts it writes into
every checkpoint): a changed base, batch size, k, world size or schedule length applies from the
rate the schedule had reached, and is logged; a plateau's cuts and a schedule's progress are the
run's and continue. Every other group setting (weight decay, betas, momentum) of the config is
written into the checkpoint's copy before Lightning loads it, and each change is logged; the
optimizer's state (moments, step counts) continues. An optimizer of another class (other settings
in its groups), another number of optimizers or groups, or a schedule of another class is a
`ConfigError` naming the config key, before the run writes anything.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning as L

from multiloss.config import ConfigError
from multiloss.lean_callback import LeanCallback
from multiloss.learning_rate import LR_KEY, RatePlan, resume_rates

log = logging.getLogger("multiloss")


class ResumeRule(LeanCallback):
    def __init__(self) -> None:
        self._saved: dict[str, Any] | None = None

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        checkpoint[LR_KEY] = {key: plan.state() for key, plan in _plans(pl_module).items()}

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        self._saved = checkpoint  # the dict Lightning restores the optimizers from, a moment later

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._saved is None or "optimizer_states" not in self._saved:
            return
        plans = list(_plans(pl_module).values())
        keys = [plan.key for plan in plans] or ["model.optimizer"]
        saved_states = self._saved["optimizer_states"]
        built = trainer.optimizers
        if len(saved_states) != len(built):
            raise ConfigError(
                keys[0] if len(keys) == 1 else "model",
                [type(o).__name__ for o in built],
                f"the {len(saved_states)} optimizer(s) the checkpoint's run trained with",
                "a resume continues the optimizers it saved",
            )
        changes = []
        for index, (optimizer, saved) in enumerate(zip(built, saved_states)):
            changes += _settings(optimizer, saved, keys[index] if index < len(keys) else f"optimizer {index}")
        schedules = iter(config.scheduler for config in trainer.lr_scheduler_configs)
        schedulers = [next(schedules, None) if plan.scheduled else None for plan in plans]
        changes += resume_rates(plans, schedulers, self._saved)
        for change in changes:
            log.info("resuming with %s", change)


def _plans(pl_module: L.LightningModule) -> dict[str, RatePlan]:
    return getattr(pl_module, "rate_plans", {})


def _settings(optimizer: Any, saved: dict[str, Any], key: str) -> list[str]:
    """The config's group settings but the rate written over the checkpoint's (which then loads them); the changes."""
    groups = optimizer.state_dict()["param_groups"]
    saved_groups = saved["param_groups"]
    settings = [{k for k in g if k not in ("params", "lr", "initial_lr")} for g in (*groups, *saved_groups)]
    if len(groups) != len(saved_groups) or any(s != settings[0] for s in settings):
        raise ConfigError(
            key,
            type(optimizer).__name__,
            "the optimizer the checkpoint's run trained with (its state is in the checkpoint); "
            "another optimizer is a new run",
            f"the checkpoint's optimizer has other settings ({', '.join(sorted(settings[-1]))})",
        )
    changes = []
    for number, (group, old) in enumerate(zip(groups, saved_groups)):
        name = f"{key}" + (f" group {number}" if len(groups) > 1 else "")
        for setting in sorted(settings[0]):
            if setting != "name" and group[setting] != old[setting]:
                changes.append(f"{name}.{setting}={group[setting]} (the checkpoint's {old[setting]})")
                old[setting] = group[setting]
    return changes
