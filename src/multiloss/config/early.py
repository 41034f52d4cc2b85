"""The config checked before torch and Lightning are imported: a mistake named in a second, not after the imports.

`check_early` runs what `multiloss.train` checks first — the keys, the types, the top-level values, the
accelerator, the checkpoint path (`multiloss.config.validate`, each ``_target_`` read from its source) — then what
each component's constructor checks of its arguments (`multiloss.config.argument_checks`): the data module, the
recipe (and the optimizers inside it), the Trainer, the callbacks and loggers, in the order the run builds them,
and what a sharded run refuses of the recipe's settings. Each error is the one the run would raise later, word
for word (a test holds each against it). What needs torch — a network built and run on a batch, Lightning's
checks against the data — stays where it is, after the imports.
"""

from __future__ import annotations

import gc
from typing import Any

from omegaconf import DictConfig

from multiloss.config import argument_checks, source
from multiloss.config.argument_checks import UNKNOWN, Raised
from multiloss.config.errors import ConfigError, error_from_lightning, optimizer_rejection
from multiloss.config.validate import check_config, source_target

# What multiloss's builders pass the Trainer themselves (`multiloss.training.build_trainer`).
_TRAINER_PASSED = {"callbacks": UNKNOWN, "logger": UNKNOWN, "plugins": UNKNOWN}
_OPTIMIZER = "torch.optim.optimizer.Optimizer"
_LIGHTNING_ERRORS = ("lightning.fabric.utilities.exceptions.MisconfigurationException",)


def check_early(cfg: DictConfig) -> None:
    """Raise the `ConfigError` the run would raise for ``cfg`` among those that need nothing imported."""
    gc_was_on = gc.isenabled()
    gc.disable()  # the parse trees are many small objects: collecting while they are made triples the time
    try:
        _check_early(cfg)
    finally:
        if gc_was_on:
            gc.enable()


def _check_early(cfg: DictConfig) -> None:
    check_config(cfg, early=True)
    _check_arguments("data", cfg.data)
    recipe = _check_arguments("model", cfg.model)
    for path, node in _partial_optimizers(cfg.model, "model"):
        _check_arguments(path, node)
    _check_arguments("trainer", cfg.trainer, _TRAINER_PASSED)
    _check_sharded_run(cfg, recipe)
    for group in ("logger", "callbacks"):
        for name, node in (cfg.get(group) or {}).items():
            if isinstance(node, DictConfig) and "_target_" in node:
                _check_arguments(f"{group}.{name}", node)


def _check_arguments(path: str, node: DictConfig, passed: dict[str, Any] | None = None) -> Any:
    """Raise what the node's target raises of its arguments; return the instance its source leaves (or UNKNOWN)."""
    target = source_target(str(node._target_))
    if target is None or not isinstance(target.definition, source.Definition):
        return UNKNOWN
    arguments = argument_checks.config_arguments(node)
    if node.get("_partial_", False):
        arguments["params"] = UNKNOWN  # the optimizer's parameters, given when the recipe builds it
    if _takes_from_data(target.definition):
        # Arguments the data module supplies (tbptt's vocabulary) are not in the config: their defaults are not
        # what the recipe will get.
        for name, optional in target.params.items():
            if optional and name not in arguments:
                arguments[name] = UNKNOWN
    arguments.update(passed or {})
    error, instance = argument_checks.construct(target.definition, arguments)
    _raise(error, path, node, target)
    return instance


def _raise(error: ConfigError | Raised | None, path: str, node: DictConfig, target: Any) -> None:
    if isinstance(error, ConfigError):
        raise error.under(path)
    if isinstance(error, Raised):
        # Non-ConfigError rejections become config errors the way the run turns them into one.
        optimizer = source.is_subclass(target.definition, _OPTIMIZER) and node.get("_partial_", False)
        if optimizer and error.is_a("builtins.ValueError", "builtins.TypeError"):
            raise optimizer_rejection(path, node, error.message)
        if error.is_a(*_LIGHTNING_ERRORS) or (path == "trainer" and error.is_a("builtins.ValueError")):
            raise error_from_lightning(path, node, error.message)


def _partial_optimizers(node: DictConfig, path: str) -> list[tuple[str, DictConfig]]:
    """The ``_partial_`` optimizer nodes inside ``node`` (``model.optimizer``, ``model.g_optimizer``, ...)."""
    found = []
    for key in node:
        child = node._get_node(key)
        if not isinstance(child, DictConfig) or str(key).startswith("_"):
            continue
        where = f"{path}.{key}"
        if "_target_" in child and child.get("_partial_", False):
            target = source_target(str(child._target_))
            definition = target.definition if target is not None else None
            if isinstance(definition, source.Definition) and source.is_subclass(definition, _OPTIMIZER):
                found.append((where, child))
        elif "_target_" not in child:
            found.extend(_partial_optimizers(child, where))
    return found


def _takes_from_data(recipe: source.Definition) -> bool:
    """Whether the recipe class (or a base but multiloss's `Recipe`) defines ``from_data``."""
    for klass in source.mro(recipe, source.own_packages(recipe)) or [recipe]:
        if isinstance(klass, source.Definition) and klass.qualname == "multiloss.base.module.Recipe":
            return False
        if isinstance(klass, source.Definition) and source.method(klass, "from_data") is not None:
            return True
    return False


def _check_sharded_run(cfg: DictConfig, recipe: Any) -> None:
    """What a sharded run (FSDP2) refuses: a precision the CPU cannot shard in, the recipe's own refusals."""
    from multiloss.config.parallel import check_sharded_run, is_sharded

    check_sharded_run(cfg.trainer)
    if not is_sharded(cfg.trainer) or not isinstance(recipe, argument_checks.Instance):
        return
    error = argument_checks.method_rejection(recipe.cls, recipe, "check_sharding", UNKNOWN)
    if isinstance(error, ConfigError):
        raise error
