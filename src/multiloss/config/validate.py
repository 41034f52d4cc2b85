"""Checks a composed config before anything is built or written.

Every node with a ``_target_`` is checked against the signature of what it names: unknown keys
(with the closest accepted names), values of the wrong type (by the target's own annotations,
with typeguard), required arguments left unset. Lightning's ``Trainer`` is checked the same way,
so the accepted keys are Lightning's own and never drift. Value ranges are each component's own
business: recipes and data modules raise `ConfigError` from their ``__init__``.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import types
import typing
from collections.abc import Callable, Iterator
from typing import Any, Literal, Union

from hydra.utils import get_object
from omegaconf import DictConfig, ListConfig, OmegaConf
from typeguard import CollectionCheckStrategy, TypeCheckError, check_type

from multiloss.config.errors import ConfigError, require
from multiloss.config.schema import COMPONENT_GROUPS, TrainSchema

# Arguments that `train` passes itself when it instantiates a node, so the config must not set them.
_PASSED_BY_TRAIN = {"lightning.pytorch.trainer.trainer.Trainer": {"callbacks", "logger"}}


def check_config(cfg: DictConfig) -> None:
    """Raise `ConfigError` for the first problem found in ``cfg``; return quietly if there is none."""
    accepted = sorted({f.name for f in dataclasses.fields(TrainSchema)} - set(COMPONENT_GROUPS))
    for key in cfg:
        if key not in accepted and key not in COMPONENT_GROUPS and key != "hydra":  # `+sed=3`: nothing reads it
            close = difflib.get_close_matches(str(key), accepted, n=3)
            hint = f"did you mean {' or '.join(close)}? " if close else ""
            raise ConfigError(str(key), _plain(cfg, key), f"{hint}top-level keys: {', '.join(accepted)}", "unknown key")
    for group in COMPONENT_GROUPS:
        # An option file without its package header lands at the top level instead of under `model`.
        if cfg.get(group) is not None:
            raise ConfigError(
                group,
                _plain(cfg, group),
                f"an option file of the `{group}` group whose first line is `# @package model.{group}`",
                "this option landed at the top level of the config, not under model",
            )
    require(
        cfg.get("nonfinite", "stop") in ("stop", "skip", "off"),
        "nonfinite",
        cfg.get("nonfinite"),
        "stop (end the run, naming the component and the step), skip (drop such steps) or off",
    )
    timeout = cfg.get("collective_timeout", 1800)
    require(
        isinstance(timeout, int | float) and not isinstance(timeout, bool) and timeout > 0,
        "collective_timeout",
        timeout,
        "a number of seconds > 0 (how long a rank waits in a collective for the others)",
    )
    seed = cfg.get("seed", 0)
    require(
        isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < 2**32,
        "seed",
        seed,
        "an integer from 0 to 4294967295 (numpy's seed range)",
    )
    for key in ("data", "model", "trainer"):
        require(isinstance(cfg.get(key), DictConfig), key, cfg.get(key), "a config node with a `_target_`")
        check_node(cfg[key], key)
    for group in ("callbacks", "logger"):
        for name, node in (cfg.get(group) or {}).items():
            if node is not None:
                check_node(node, f"{group}.{name}")
    require(
        cfg.trainer.get("use_distributed_sampler", False) is False,
        "trainer.use_distributed_sampler",
        cfg.trainer.get("use_distributed_sampler"),
        "false (multiloss's loaders shard by rank themselves, honour data.shuffle and resume mid-epoch; "
        "Lightning's replacement sampler would undo all three)",
    )
    accumulate = cfg.trainer.get("accumulate_grad_batches", 1)
    # Lightning does not check it: 0 or less would fail only deep inside the first epoch.
    require(
        isinstance(accumulate, int) and accumulate >= 1,
        "trainer.accumulate_grad_batches",
        accumulate,
        "an integer ≥ 1 (micro-batches per optimizer step; 1 = no accumulation)",
    )
    _check_accelerator(cfg.trainer.get("accelerator"))
    _check_schedule_lengths(cfg)
    ckpt = cfg.get("ckpt_path")
    if ckpt is not None:
        from multiloss.saved_state import checkpoint_exists

        require(
            checkpoint_exists(ckpt),
            "ckpt_path",
            ckpt,
            "the path of an existing checkpoint (a .ckpt file, or a sharded run's .ckpt directory)",
            "no such checkpoint",
        )


def _check_schedule_lengths(cfg: DictConfig) -> None:
    """A schedule fitted to the run's length (``epochs``, ``total_steps`` left null) needs a run that has one."""
    spec = cfg.model.get("scheduler") if isinstance(cfg.get("model"), DictConfig) else None
    if not isinstance(spec, DictConfig) or not isinstance(spec.get("_target_"), str):
        return
    max_steps, max_epochs = cfg.trainer.get("max_steps", -1), cfg.trainer.get("max_epochs")
    # Lightning's own default: max_epochs=None means 1000 epochs, or none at all once max_steps is set.
    epochs = (max_epochs is not None and max_epochs >= 0) or (max_epochs is None and max_steps in (-1, None))
    known = {"epochs": epochs, "total_steps": epochs or max_steps not in (-1, None)}
    try:
        params, open_kwargs = _parameters(get_object(spec._target_))
    except Exception:  # an unimportable schedule: check_node names it
        return
    for name, bounded in known.items():
        if not bounded and spec.get(name) is None and (name in params or open_kwargs):
            what = "epochs" if name == "epochs" else "optimizer steps"
            bound = "trainer.max_epochs=<n>" if name == "epochs" else "trainer.max_steps=<n> or trainer.max_epochs=<n>"
            raise ConfigError(
                f"model.scheduler.{name}",
                None,
                f"the schedule's length in {what} (model.scheduler.{name}=<n>), or a run that has one ({bound})",
                f"trainer.max_epochs={max_epochs}, trainer.max_steps={max_steps}: the run has no last "
                f"{'epoch' if name == 'epochs' else 'step'} to fit {spec._target_.rsplit('.', 1)[-1]} to",
            )


def _check_accelerator(name: Any) -> None:
    """A named accelerator must exist on this machine (Lightning's registry says which do)."""
    if not isinstance(name, str) or name == "auto":
        return
    from lightning.pytorch.accelerators import AcceleratorRegistry

    registry = AcceleratorRegistry.available_accelerators()
    usable = sorted(n for n in registry if AcceleratorRegistry[n]["accelerator"].is_available())
    wanted = {"gpu": {"cuda", "mps"}}.get(name, {name})
    if wanted & set(registry) and not wanted & set(usable):
        raise ConfigError(
            "trainer.accelerator",
            name,
            f"one this machine has: auto, {', '.join(usable)} (e.g. trainer=cpu)",
            "not available on this machine",
        )


def check_node(node: DictConfig, path: str, passed: frozenset[str] = frozenset()) -> None:
    """Check one ``_target_`` node (and the ``_target_`` nodes inside it) against its signature.

    ``passed``: arguments the enclosing component supplies itself (tbptt passes its net's
    ``vocab_size``), so the config need not set them.
    """
    target_name = node.get("_target_")
    require(isinstance(target_name, str), f"{path}._target_", target_name, "a dotted import path")
    try:
        target = get_object(target_name)
    except Exception as err:  # ImportError, AttributeError, ... all mean the same to a user
        raise ConfigError(
            f"{path}._target_",
            target_name,
            "an importable class or function",
            f"cannot import it ({err.__class__.__name__}: {err})",
        ) from None
    params, open_kwargs = _parameters(target)
    # Arguments `train` passes are refused in the config; those a recipe passes (tbptt's vocab_size) may
    # be set there too (the recipe checks the value), and need not be.
    passed_by_train = _PASSED_BY_TRAIN.get(_qualname(target), set())
    # What this component supplies to the components configured inside it, by argument name.
    passes_down: dict[str, Any] = getattr(target, "passed_to_components", {}) if inspect.isclass(target) else {}
    hints = _type_hints(target)
    is_partial = bool(node.get("_partial_", False))

    for key in node:
        key = str(key)
        if key.startswith("_"):
            continue
        where = f"{path}.{key}"
        if key in passed_by_train:
            raise ConfigError(
                where,
                OmegaConf.to_container(node)[key],
                "not set here",
                f"multiloss passes `{key}` itself (configure the `{key}` group instead)",
            )
        if key not in params and not open_kwargs:
            close = difflib.get_close_matches(key, params, n=3)
            hint = f"did you mean {' or '.join(close)}? " if close else ""
            raise ConfigError(
                where,
                _plain(node, key),
                f"{hint}arguments of {target_name}: {', '.join(sorted(params))}",
                "unknown key",
            )
        if OmegaConf.is_missing(node, key):  # `???` in the option file: the user must give it
            raise ConfigError(where, "???", f"a value: {where}=<...> on the command line", "required but not set")
        child = node._get_node(key)
        if isinstance(child, DictConfig) and "_target_" in child:
            check_node(child, where, frozenset(passes_down.get(key, ())))
            continue
        if isinstance(child, DictConfig):  # e.g. tasks: the losses and metrics configured inside
            for inner, inner_node in iter_target_nodes(child, where):
                check_node(inner_node, inner)
        if key in hints:
            _check_type(where, _plain(node, key), hints[key])

    if not is_partial:
        missing = [
            n
            for n, p in params.items()
            if p.default is inspect.Parameter.empty and n not in node and n not in passed_by_train | passed
        ]
        if missing:
            raise ConfigError(
                f"{path}.{missing[0]}",
                None,
                f"a value for each of: {', '.join(missing)}",
                f"required by {target_name} but not set",
            )


def _parameters(target: Any) -> tuple[dict[str, inspect.Parameter], bool]:
    """Named parameters of a class or callable; a class's ``**kwargs`` is followed up its MRO.

    Only the outermost signature's parameters without default count as required: a parent's
    required argument reached through ``**kwargs`` is the child's to pass.
    """
    params: dict[str, inspect.Parameter] = {}
    callables = (
        [c.__init__ for c in inspect.getmro(target) if "__init__" in vars(c)] if inspect.isclass(target) else [target]
    )
    for depth, fn in enumerate(callables):
        sig = inspect.signature(fn)
        for name, p in sig.parameters.items():
            if name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                params.setdefault(name, p if depth == 0 else p.replace(default=None))
        if not any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
            return params, False
    return params, True


def _type_hints(target: Any) -> dict[str, Any]:
    hints: dict[str, Any] = {}
    fns = (
        [c.__init__ for c in reversed(inspect.getmro(target)) if "__init__" in vars(c)]
        if inspect.isclass(target)
        else [target]
    )
    for fn in fns:
        try:
            hints.update(typing.get_type_hints(fn))
        except Exception:  # unresolvable forward references: skip the type check, keep the key check
            continue
    hints.pop("return", None)
    return hints


def _check_type(where: str, value: Any, annotation: Any) -> None:
    for candidate in (value, tuple(value) if isinstance(value, list) else value):
        try:
            check_type(candidate, annotation, collection_check_strategy=CollectionCheckStrategy.ALL_ITEMS)
            return
        except TypeCheckError:
            continue
    raise ConfigError(where, value, describe(annotation), "wrong type")


def describe(annotation: Any) -> str:
    """A short human reading of a type annotation: ``int``, ``one of 'a', 'b'``, ``list of float``."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(annotation))
    if origin in (Union, types.UnionType):
        parts = [describe(a) for a in typing.get_args(annotation) if a is not type(None)]
        text = " or ".join(dict.fromkeys(parts))
        return text + (" or null" if type(None) in typing.get_args(annotation) else "")
    if origin in (list, tuple, set, typing.get_origin(typing.Sequence), typing.get_origin(typing.Iterable)):
        args = [a for a in typing.get_args(annotation) if a is not Ellipsis]
        return f"list of {describe(args[0])}" if args else "list"
    if origin is dict:
        return "mapping"
    if origin is not None and isinstance(origin, type) and issubclass(origin, Callable):  # type: ignore[arg-type]
        return "callable"
    if annotation is Any:
        return "any value"
    return getattr(annotation, "__name__", str(annotation))


def _plain(node: DictConfig, key: str) -> Any:
    value = node._get_node(key)
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return node[key]


def _qualname(target: Any) -> str:
    return f"{target.__module__}.{target.__qualname__}"


def iter_target_nodes(cfg: DictConfig, path: str = "") -> Iterator[tuple[str, DictConfig]]:
    """Every ``_target_`` node in ``cfg`` with its dotted path (outermost first)."""
    if "_target_" in cfg:
        yield path, cfg
        return
    for key in cfg:
        child = cfg._get_node(key)
        if isinstance(child, DictConfig):
            yield from iter_target_nodes(child, f"{path}.{key}" if path else str(key))
