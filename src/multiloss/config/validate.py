"""Checks a composed config before anything is built or written.

Every node with a ``_target_`` is checked against the signature of what it names: unknown keys
(with the closest accepted names), values of the wrong type (by the target's own annotations,
with typeguard), required arguments left unset. Lightning's ``Trainer`` is checked the same way,
so the accepted keys are Lightning's own and never drift. Value ranges are each component's own
business: recipes and data modules raise `ConfigError` from their ``__init__``.

The same checks run twice in a run: first with each target read from its source (``early=True``,
`multiloss.config.source`: before torch and Lightning are imported, so a mistake is named in a second), then
with the imported targets (`multiloss.train`): what the source could not tell is judged there.
"""

from __future__ import annotations

import contextlib
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

from multiloss.config import source
from multiloss.config.errors import ConfigError, require
from multiloss.config.renamed import rename_targets
from multiloss.config.schema import COMPONENT_GROUPS, TrainSchema

# Arguments that `train` passes itself when it instantiates a node, so the config must not set them.
_PASSED_BY_TRAIN = {"lightning.pytorch.trainer.trainer.Trainer": {"callbacks", "logger"}}


def check_config(cfg: DictConfig, early: bool = False) -> None:
    """Raise `ConfigError` for the first problem found in ``cfg``; return quietly if there is none.

    ``early``: each ``_target_`` read from its source, nothing imported (what it cannot tell is left unchecked).
    First, the dotted names of earlier layouts ``cfg`` may carry are mapped to their modules' current places, in place
    (`multiloss.config.renamed`).
    """
    rename_targets(cfg)
    read = source_target if early else imported_target
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
    for key, default, what in (
        ("collective_timeout", 1800, "how long a rank waits in a collective for the others"),
        ("rendezvous_timeout", 300, "how long the ranks wait for each other before the process group is made"),
    ):
        timeout = cfg.get(key, default)
        require(
            isinstance(timeout, int | float) and not isinstance(timeout, bool) and timeout > 0,
            key,
            timeout,
            f"a number of seconds > 0 ({what})",
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
        check_node(cfg[key], key, read=read)
    for group in ("callbacks", "logger"):
        for name, node in (cfg.get(group) or {}).items():
            if node is not None:
                check_node(node, f"{group}.{name}", read=read)
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
    _check_accelerator(cfg.trainer.get("accelerator"), early)
    _check_schedule_lengths(cfg, read)


def _check_schedule_lengths(cfg: DictConfig, read: Callable[[str], Target | None]) -> None:
    """A schedule fitted to the run's length (``epochs``, ``total_steps`` left null) needs a run that has one."""
    spec = cfg.model.get("scheduler") if isinstance(cfg.get("model"), DictConfig) else None
    if not isinstance(spec, DictConfig) or not isinstance(spec.get("_target_"), str):
        return
    max_steps, max_epochs = cfg.trainer.get("max_steps", -1), cfg.trainer.get("max_epochs")
    # Lightning's own default: max_epochs=None means 1000 epochs, or none at all once max_steps is set.
    epochs = (max_epochs is not None and max_epochs >= 0) or (max_epochs is None and max_steps in (-1, None))
    known = {"epochs": epochs, "total_steps": epochs or max_steps not in (-1, None)}
    try:
        target = read(spec._target_)
    except ConfigError:  # an unimportable schedule: check_node names it
        return
    if target is None:
        return
    for name, bounded in known.items():
        if not bounded and spec.get(name) is None and (name in target.params or target.open_kwargs):
            what = "epochs" if name == "epochs" else "optimizer steps"
            bound = "trainer.max_epochs=<n>" if name == "epochs" else "trainer.max_steps=<n> or trainer.max_epochs=<n>"
            raise ConfigError(
                f"model.scheduler.{name}",
                None,
                f"the schedule's length in {what} (model.scheduler.{name}=<n>), or a run that has one ({bound})",
                f"trainer.max_epochs={max_epochs}, trainer.max_steps={max_steps}: the run has no last "
                f"{'epoch' if name == 'epochs' else 'step'} to fit {spec._target_.rsplit('.', 1)[-1]} to",
            )


def _check_accelerator(name: Any, early: bool = False) -> None:
    """A named accelerator must exist on this machine (Lightning's registry says which do; early, what the torch
    build and the machine tell without importing it: `multiloss.config.machine`)."""
    if not isinstance(name, str) or name == "auto":
        return
    if early:
        from multiloss.config.machine import accelerators

        found = accelerators()
        if found is None:
            return
        registry, usable = found
    else:
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


@dataclasses.dataclass
class Target:
    """What a ``_target_`` accepts, as `check_node` reads it: from the imported object or from its source."""

    name: str  # its qualified name where it is defined (``module.Class``)
    params: dict[str, bool]  # each named parameter -> whether the config may leave it unset (it has a default)
    open_kwargs: bool  # a ``**kwargs`` takes any other key
    hints: dict[str, Any]  # the annotations typeguard checks the values against
    passes_down: dict[str, Any]  # what the component supplies to the components configured inside it
    definition: Any = None  # its source definition (read early), for `multiloss.config.early`


def imported_target(target_name: str) -> Target:
    """The target imported (Hydra's ``get_object``); `ConfigError` if it does not import."""
    try:
        target = get_object(target_name)
    except Exception as err:  # ImportError, AttributeError, ... all mean the same to a user
        raise _not_importable(target_name, f"{err.__class__.__name__}: {err}") from None
    is_class = inspect.isclass(target)
    functions = [c.__init__ for c in inspect.getmro(target) if "__init__" in vars(c)] if is_class else [target]
    params: dict[str, bool] = {}
    open_kwargs = True
    for depth, fn in enumerate(functions):
        sig = inspect.signature(fn)
        _add_parameters(params, [(p.name, p.kind, p.default is not p.empty) for p in sig.parameters.values()], depth)
        if not any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
            open_kwargs = False
            break
    hints: dict[str, Any] = {}
    for fn in reversed(functions):
        try:
            hints.update(typing.get_type_hints(fn))
        except Exception:  # unresolvable forward references: skip the type check, keep the key check
            continue
    hints.pop("return", None)
    passes_down = getattr(target, "passed_to_components", {}) if is_class else {}
    return Target(_qualname(target), params, open_kwargs, hints, dict(passes_down))


def source_target(target_name: str) -> Target | None:
    """The target read from its source (`multiloss.config.source`), nothing imported; `ConfigError` if it surely does
    not import; None where the source does not tell."""
    found, error = source.locate(target_name)
    if error is not None:
        raise _not_importable(target_name, f"ImportError: {error}")
    initializers = source.initializers(found) if found not in (source.UNKNOWN, source.NOT_BOUND) else None
    if not initializers:
        return None
    params: dict[str, bool] = {}
    open_kwargs = True
    for depth, (_, fn) in enumerate(initializers):
        _add_parameters(params, [(p.name, p.kind, p.has_default) for p in fn.parameters], depth)
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in fn.parameters):
            open_kwargs = False
            break
    hints: dict[str, Any] = {}
    for _, fn in reversed(initializers):
        if fn.live is not None:
            with contextlib.suppress(Exception):  # as for an imported target: no hints where they do not resolve
                hints.update(typing.get_type_hints(fn.live))
            continue
        annotated = {p.name: source.annotation(fn.module, p.annotation) for p in fn.parameters if p.annotation}
        if fn.node is not None and fn.node.returns is not None:
            annotated["return"] = source.annotation(fn.module, fn.node.returns)
        if not any(a is source.NOT_BOUND for a in annotated.values()):  # as get_type_hints: a name it cannot find
            hints.update(annotated)
    hints.pop("return", None)
    passes_down: Any = {}
    if isinstance(found, source.Definition) and found.is_class:
        bound = source.class_attribute(found, "passed_to_components", source.own_packages(found))
        passes_down = source.literal(bound.module, bound.expr) if isinstance(bound, source.Value) else {}
        if isinstance(bound, source.Live):
            passes_down = bound.value
        if passes_down is source.UNKNOWN:
            return None
    name = found.qualname if isinstance(found, source.Definition) else _qualname(found.value)
    return Target(name, params, open_kwargs, hints, passes_down, definition=found)


def _add_parameters(params: dict[str, bool], found: list[tuple[str, Any, bool]], depth: int) -> None:
    """Named parameters of one ``__init__`` in a class's order. Only the outermost signature's parameters without
    default are required: a parent's required argument reached through ``**kwargs`` is the child's to pass."""
    for name, kind, has_default in found:
        if name != "self" and kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            params.setdefault(name, has_default if depth == 0 else True)


def _not_importable(target_name: str, why: str) -> ConfigError:
    return ConfigError("_target_", target_name, "an importable class or function", f"cannot import it ({why})")


def check_node(
    node: DictConfig,
    path: str,
    passed: frozenset[str] = frozenset(),
    read: Callable[[str], Target | None] = imported_target,
) -> None:
    """Check one ``_target_`` node (and the ``_target_`` nodes inside it) against its signature.

    ``passed``: arguments the enclosing component supplies itself (tbptt passes its net's
    ``vocab_size``), so the config need not set them. ``read``: how a target is read (imported, or from its
    source, which may not tell: then only the nodes inside are checked).
    """
    target_name = node.get("_target_")
    require(isinstance(target_name, str), f"{path}._target_", target_name, "a dotted import path")
    try:
        target = read(target_name)
    except ConfigError as err:
        raise err.under(path) from None
    if target is None:
        for key in node:
            child = node._get_node(key)
            if not str(key).startswith("_") and isinstance(child, DictConfig):
                for inner, inner_node in iter_target_nodes(child, f"{path}.{key}"):
                    _check_inside_unknown(inner_node, inner, read)
        return
    # Arguments `train` passes are refused in the config; those a recipe passes (tbptt's vocab_size) may
    # be set there too (the recipe checks the value), and need not be.
    passed_by_train = _PASSED_BY_TRAIN.get(target.name, set())
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
        if key not in target.params and not target.open_kwargs:
            close = difflib.get_close_matches(key, target.params, n=3)
            hint = f"did you mean {' or '.join(close)}? " if close else ""
            raise ConfigError(
                where,
                _plain(node, key),
                f"{hint}arguments of {target_name}: {', '.join(sorted(target.params))}",
                "unknown key",
            )
        if OmegaConf.is_missing(node, key):  # `???` in the option file: the user must give it
            raise ConfigError(where, "???", f"a value: {where}=<...> on the command line", "required but not set")
        child = node._get_node(key)
        if isinstance(child, DictConfig) and "_target_" in child:
            check_node(child, where, frozenset(target.passes_down.get(key, ())), read)
            continue
        if isinstance(child, DictConfig):  # e.g. tasks: the losses and metrics configured inside
            for inner, inner_node in iter_target_nodes(child, where):
                check_node(inner_node, inner, read=read)
        if key in target.hints:
            _check_type(where, _plain(node, key), target.hints[key])

    if not is_partial:
        missing = [
            n
            for n, optional in target.params.items()
            if not optional and n not in node and n not in passed_by_train | passed
        ]
        if missing:
            raise ConfigError(
                f"{path}.{missing[0]}",
                None,
                f"a value for each of: {', '.join(missing)}",
                f"required by {target_name} but not set",
            )


def _check_inside_unknown(node: DictConfig, path: str, read: Callable[[str], Target | None]) -> None:
    """A node inside one whose target the source does not tell: what that target passes it is unknown too, so an
    argument it lacks is not an error here."""
    try:
        check_node(node, path, read=read)
    except ConfigError as err:
        if not (err.problem or "").startswith("required by"):
            raise


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
