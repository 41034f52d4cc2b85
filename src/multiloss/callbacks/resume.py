"""What a resume may change: the optimizer's hyper-parameters yes (applied, and said), its class no.

Lightning restores each optimizer's ``state_dict`` whole, param groups included, over the optimizer
the config just built: ``ckpt_path=… model.optimizer.lr=1e-4`` trained on at the checkpoint's 3e-3
while the run's records said 1e-4; ``optimizer=sgd`` over an Adam checkpoint died on
``KeyError: 'momentum'`` after the run dir's ``.hydra/`` had been rewritten to say SGD.

`ResumeRule` compares, between the optimizers' creation and the restore of their states, each
optimizer the config built with the one the checkpoint saved. The config's hyper-parameters win:
the learning rate (the schedule's base with it: its current value moves by the same factor) and any
other group setting (weight decay, betas, momentum) are written into the checkpoint's copy before
Lightning loads it, and each change is logged; the optimizer's state (moments, step counts)
continues. An optimizer of another class (other settings in its groups), or another number of
optimizers or groups, is a `ConfigError` naming the config key, before the run writes anything.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning as L
from omegaconf import DictConfig

from multiloss.config import ConfigError
from multiloss.lean_callback import LeanCallback

log = logging.getLogger("multiloss")


class ResumeRule(LeanCallback):
    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self._saved: dict[str, Any] | None = None

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        self._saved = checkpoint  # the dict Lightning restores the optimizers from, a moment later

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._saved is None or "optimizer_states" not in self._saved:
            return
        keys = self._optimizer_keys()
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
            key = keys[index] if index < len(keys) else f"optimizer {index}"
            changes += self._apply(optimizer, saved, key, index)
        for change in changes:
            log.info("resuming with %s", change)

    def _apply(self, optimizer: Any, saved: dict[str, Any], key: str, index: int) -> list[str]:
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
            # A schedule's base LR is the configured one (its first value may be 0: a warm-up).
            base, wanted = old.get("initial_lr", old["lr"]), group.get("initial_lr", group["lr"])
            if wanted != base:
                factor = wanted / base if base else 0.0
                changes.append(f"{name}.lr={wanted:g} (the checkpoint's {base:g})")
                old["lr"] = old["lr"] * factor if base else wanted
                if "initial_lr" in old:
                    old["initial_lr"] = wanted
                self._rescale_schedules(index, number, factor, wanted)
            for setting in sorted(settings[0]):
                if setting != "name" and group[setting] != old[setting]:
                    changes.append(f"{name}.{setting}={group[setting]} (the checkpoint's {old[setting]})")
                    old[setting] = group[setting]
        return changes

    def _rescale_schedules(self, optimizer_index: int, group: int, factor: float, base: float) -> None:
        # Lightning saves the schedulers in configure_optimizers' order; the recipes build one per
        # optimizer at most, in the optimizers' order.
        schedules = self._saved.get("lr_schedulers") or [] if self._saved else []
        if optimizer_index < len(schedules):
            state = schedules[optimizer_index]
            if "base_lrs" in state and group < len(state["base_lrs"]):
                state["base_lrs"][group] = base
            if "_last_lr" in state and group < len(state["_last_lr"]):
                state["_last_lr"][group] *= factor

    def _optimizer_keys(self) -> list[str]:
        model = self.cfg.get("model") or {}
        if "optimizer" in model:
            return ["model.optimizer"]
        return [f"model.{k}" for k in model if str(k).endswith("_optimizer")]
