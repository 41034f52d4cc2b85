"""What a resume may change: the optimizer's hyper-parameters and the run's rate decisions yes (applied, and said), its
optimizer class and schedule class no.

Lightning restores each optimizer's ``state_dict`` whole, param groups included, over the optimizer
the config just built: ``ckpt_path=… model.optimizer.lr=1e-4`` trained on at the checkpoint's 3e-3
while the run's records said 1e-4; ``optimizer=sgd`` over an Adam checkpoint died on
``KeyError: 'momentum'`` after the run dir's ``.hydra/`` had been rewritten to say SGD.

`ResumeRule` compares, between the optimizers' creation and the restore of their states, each
optimizer the config built with the one the checkpoint saved. The learning rate is the config's base
× the recipe's rule × the schedule's progress (`multiloss.base.learning_rate`, whose parts it writes into
every checkpoint): a changed base, batch size, k, world size or schedule length applies from the
rate the schedule had reached, and is logged; a plateau's cuts and a schedule's progress are the
run's and continue. Every other group setting (weight decay, betas, momentum) of the config is
written into the checkpoint's copy before Lightning loads it, and each change is logged; the
optimizer's state (moments, step counts) continues. An optimizer of another class (other settings
in its groups), another number of optimizers or groups, or a schedule of another class is a
`ConfigError` naming the config key, before the run writes anything.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import lightning as L

from multiloss.base.learning_rate import RatePlan, refuse_other_schedules, resume_rates
from multiloss.callbacks.lean import LeanCallback
from multiloss.config import ConfigError
from multiloss.saving.checkpoints import sharded_metadata
from multiloss.saving.saved_state import LR_KEY, is_sharded_checkpoint

log = logging.getLogger("multiloss")


class ResumeRule(LeanCallback):
    """The rule above, for a checkpoint file (Lightning restores the optimizers from its dict after ``on_fit_start``)
    and for a sharded one (FSDP2 loads them into the optimizers before the callbacks see the rest: the rule then
    reads what was loaded, and writes the decisions back into the optimizers)."""

    def __init__(self, ckpt_path: str | None = None) -> None:
        self.ckpt_path = ckpt_path  # the run's (Lightning tells it only once it loads, after on_fit_start)
        self._saved: dict[str, Any] | None = None
        self._configured: list[list[dict[str, Any]]] | None = None  # a sharded resume: the config's groups

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        checkpoint[LR_KEY] = {key: plan.state() for key, plan in _plans(pl_module).items()}

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        self._saved = checkpoint  # the dict Lightning restores the optimizers from, a moment later
        if self._configured is not None:  # sharded: the optimizers already hold the checkpoint's groups
            self._apply(trainer, pl_module, checkpoint, self._configured)
            self._configured = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._saved is None and self.ckpt_path and is_sharded_checkpoint(self.ckpt_path):
            # Loaded after this hook, straight into the optimizers: what would not load is refused now (another
            # schedule, another optimizer), and the config's groups are kept for `on_load_checkpoint`.
            _refuse_what_a_shard_cannot_load(trainer, pl_module, self.ckpt_path)
            self._configured = [_groups(optimizer.param_groups) for optimizer in trainer.optimizers]
            return
        if self._saved is None or "optimizer_states" not in self._saved:
            return
        configured = [optimizer.state_dict()["param_groups"] for optimizer in trainer.optimizers]
        self._apply(trainer, pl_module, self._saved, configured)

    def _apply(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        checkpoint: dict[str, Any],
        configured: list[list[dict[str, Any]]],
    ) -> None:
        """Write the config's decisions into ``checkpoint``'s optimizer and schedule states (a sharded checkpoint's:
        into the optimizers themselves, which hold them already); log each change."""
        plans = list(_plans(pl_module).values())
        keys = [plan.key for plan in plans] or ["model.optimizer"]
        sharded = "optimizer_states" not in checkpoint
        if sharded:
            checkpoint["optimizer_states"] = [{"param_groups": _groups(o.param_groups)} for o in trainer.optimizers]
        saved_states = checkpoint["optimizer_states"]
        if len(saved_states) != len(configured):
            raise ConfigError(
                keys[0] if len(keys) == 1 else "model",
                [type(o).__name__ for o in trainer.optimizers],
                f"the {len(saved_states)} optimizer(s) the checkpoint's run trained with",
                "a resume continues the optimizers it saved",
            )
        changes = []
        for index, (optimizer, groups, saved) in enumerate(zip(trainer.optimizers, configured, saved_states)):
            name = keys[index] if index < len(keys) else f"optimizer {index}"
            scheduled = getattr(pl_module, "scheduled_settings", lambda i: ())(index)  # set every batch by the recipe
            changes += _settings(groups, saved, name, type(optimizer).__name__, scheduled)
        schedules = iter(config.scheduler for config in trainer.lr_scheduler_configs)
        schedulers = [next(schedules, None) if plan.scheduled else None for plan in plans]
        changes += resume_rates(plans, schedulers, checkpoint)
        if sharded:
            for optimizer, saved in zip(trainer.optimizers, checkpoint.pop("optimizer_states")):
                for group, decided in zip(optimizer.param_groups, saved["param_groups"]):
                    group.update({k: v for k, v in decided.items() if k != "params"})
        for change in changes if trainer.is_global_zero else ():  # one line a run, not one a rank
            log.info("resuming with %s", change)


def _groups(param_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of param groups' settings (not their parameters)."""
    return [{k: copy.deepcopy(v) for k, v in group.items() if k != "params"} for group in param_groups]


def _refuse_what_a_shard_cannot_load(trainer: L.Trainer, pl_module: L.LightningModule, path: str) -> None:
    """Another schedule class (its own keys in the param groups, ``initial_lr``) or another optimizer (other settings)
    than the sharded checkpoint's: FSDP2's loader would fail on the first missing key, with a traceback."""
    metadata = sharded_metadata(path)
    refuse_other_schedules(list(_plans(pl_module).values()), metadata["meta"])
    keys = [plan.key for plan in _plans(pl_module).values()] or ["model.optimizer"]
    for index, optimizer in enumerate(trainer.optimizers):
        saved = metadata["group_settings"].get(index)
        name = keys[index] if index < len(keys) else f"optimizer {index}"
        if saved is None:
            raise ConfigError(
                name, type(optimizer).__name__, "the optimizers the checkpoint's run trained with", "it saved fewer"
            )
        built = [{k for k in group if k != "params"} for group in optimizer.param_groups]
        if built != saved:
            _settings_differ(name, type(optimizer).__name__, sorted(saved[0] if saved else ()))


def _plans(pl_module: L.LightningModule) -> dict[str, RatePlan]:
    return getattr(pl_module, "rate_plans", {})


def _settings_differ(key: str, optimizer: str, saved: list[str]) -> None:
    raise ConfigError(
        key,
        optimizer,
        "the optimizer the checkpoint's run trained with (its state is in the checkpoint); another optimizer is a new "
        "run",
        f"the checkpoint's optimizer has other settings ({', '.join(saved)})",
    )


def _settings(
    groups: list[dict[str, Any]], saved: dict[str, Any], key: str, optimizer: str, scheduled: tuple[str, ...] = ()
) -> list[str]:
    """The config's group settings but the rate written over the checkpoint's (which then loads them); the changes.
    ``scheduled``: settings the recipe sets at every batch from the run's state (the GAN's β2 over images): the
    checkpoint's stand, as the straight run had them."""
    saved_groups = saved["param_groups"]
    settings = [{k for k in g if k not in ("params", "lr", "initial_lr")} for g in (*groups, *saved_groups)]
    if len(groups) != len(saved_groups) or any(s != settings[0] for s in settings):
        _settings_differ(key, optimizer, sorted(settings[-1]))
    changes = []
    for number, (group, old) in enumerate(zip(groups, saved_groups)):
        name = f"{key}" + (f" group {number}" if len(groups) > 1 else "")
        for setting in sorted(settings[0]):
            if setting != "name" and setting not in scheduled and group[setting] != old[setting]:
                changes.append(f"{name}.{setting}={group[setting]} (the checkpoint's {old[setting]})")
                old[setting] = group[setting]
    return changes
