"""Where the modules of an earlier layout live now: every old dotted path still imports, in one place.

Users' YAML (``_target_: multiloss.fsdp.FSDPStrategy``), the hyper-parameters of checkpoints written before
(``multiloss.schedules.LinearDecay``) and users' own imports (``from multiloss.module import Recipe``) name modules
that moved into packages by concern. A finder on ``sys.meta_path`` answers for each old name with the module at its
new place — the same module object, so classes stay the same classes — and its spec names the new file, so the
early config check (`multiloss.config.source`) reads the source there too.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from types import ModuleType
from typing import Any

# old module -> new module
MOVED = {
    "multiloss.digit_features": "multiloss.gan.digit_features",
    "multiloss.gan_augment": "multiloss.gan.augment",
    "multiloss.gan_metrics": "multiloss.gan.metrics",
    "multiloss.gan_objectives": "multiloss.gan.objectives",
    "multiloss.generator_ema": "multiloss.gan.ema",
    "multiloss.distributed": "multiloss.parallel.ddp",
    "multiloss.fsdp": "multiloss.parallel.fsdp",
    "multiloss.parallelism": "multiloss.parallel.parallelism",
    "multiloss.sharding": "multiloss.parallel.sharding",
    "multiloss.stalls": "multiloss.parallel.stalls",
    "multiloss.torchrun": "multiloss.parallel.rendezvous",
    "multiloss.rendezvous": "multiloss.parallel.rendezvous",
    "multiloss.early_ranks": "multiloss.parallel.early_ranks",
    "multiloss.child_command": "multiloss.parallel.child_command",
    "multiloss.checkpoints": "multiloss.saving.checkpoints",
    "multiloss.history": "multiloss.saving.history",
    "multiloss.run_dir": "multiloss.saving.run_dir",
    "multiloss.run_log": "multiloss.saving.run_log",
    "multiloss.saved_state": "multiloss.saving.saved_state",
    "multiloss.learning_rate": "multiloss.base.learning_rate",
    "multiloss.lr_scaling": "multiloss.base.lr_scaling",
    "multiloss.module": "multiloss.base.module",
    "multiloss.multitask": "multiloss.base.multitask",
    "multiloss.precision": "multiloss.base.precision",
    "multiloss.recipe_logging": "multiloss.base.logging",
    "multiloss.recipe_optimizers": "multiloss.base.optimizers",
    "multiloss.schedules": "multiloss.base.schedules",
    "multiloss.step": "multiloss.base.step",
    "multiloss.training_log": "multiloss.base.training_log",
    "multiloss.min_norm": "multiloss.balancers.min_norm",
}


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: Any) -> ModuleType:
        return importlib.import_module(self.new)

    def exec_module(self, module: ModuleType) -> None:
        pass  # the module at its new place, executed there once


class MovedModules(importlib.abc.MetaPathFinder):
    """Finds each old name of `MOVED` as the module at its new place."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        new = MOVED.get(name)
        if new is None:
            return None
        found = importlib.util.find_spec(new)
        return importlib.util.spec_from_loader(name, _Alias(new), origin=found.origin if found else None)


def current_name(dotted: str) -> str:
    """A class or function's dotted name (``multiloss.schedules.Constant``) as it is now, for comparisons with names
    an earlier layout wrote (a checkpoint's); importing either finds the same object."""
    for old, new in MOVED.items():
        if dotted == old or dotted.startswith(f"{old}."):
            return new + dotted[len(old) :]
    return dotted


def install() -> None:
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(MovedModules())
