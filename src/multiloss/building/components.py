"""Components chosen by config: build a network, a loss, a metric or an optimizer from its config.

Recipes receive their networks, tasks and optimizers as *configs* (plain mappings with a
``_target_``, what the ``net``, ``tasks`` and ``optimizer`` groups hold) and build them here. The
configs, never the built objects, are what a recipe saves as hyper-parameters: a checkpoint then
loads with ``torch.load(weights_only=True)``, and ``Recipe.load_from_checkpoint(path)`` rebuilds the
module from the checkpoint alone. A ready object (an ``nn.Module``, an optimizer factory) is accepted
too, for use from Python; it is then left out of the hyper-parameters.

Every failure is a `ConfigError` under the component's key (``net``, ``tasks.digit.loss``), which
`multiloss.train` reports under the recipe's node (``model.net``).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from hydra.errors import InstantiationException
from hydra.utils import get_object, instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf
from torch import nn
from torch.optim import Optimizer

from multiloss import lightning_internals as internals
from multiloss.config import ConfigError, require
from multiloss.config.errors import optimizer_rejection

OptimizerFactory = Callable[..., Optimizer]


def to_plain(value: Any) -> Any:
    """``value`` with every OmegaConf container turned into plain dicts and lists (interpolations resolved).

    Plain containers are what ``save_hyperparameters`` may store: a checkpoint holding an OmegaConf
    object no longer loads with ``torch.load(weights_only=True)``.
    """
    if isinstance(value, DictConfig | ListConfig):
        return OmegaConf.to_container(value, resolve=True)
    if isinstance(value, Mapping):
        return {str(k): to_plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_plain(v) for v in value]
    return value


def is_config(value: Any) -> bool:
    return isinstance(value, Mapping) and "_target_" in value


def names_given_as_objects(**arguments: Any) -> list[str]:
    """The names among ``arguments`` given as built objects rather than configs (left out of hyper-parameters)."""
    return [name for name, value in arguments.items() if value is not None and not isinstance(value, Mapping | str)]


def accepts(target: str, name: str) -> bool:
    """Whether the class or function ``target`` names takes an argument ``name`` (or any keyword)."""
    obj = get_object(target)
    try:
        params = inspect.signature(obj).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _instantiate(spec: Mapping[str, Any], key: str, **kwargs: Any) -> Any:
    target = spec.get("_target_")
    require(isinstance(target, str), f"{key}._target_", target, "a dotted import path")
    try:
        get_object(target)
    except Exception as err:
        raise ConfigError(
            f"{key}._target_", target, "an importable class or function", f"cannot import it ({err})"
        ) from None
    try:
        return instantiate(spec, **kwargs)
    except InstantiationException as err:
        cause = err.__cause__ or err
        if isinstance(cause, ConfigError):
            raise cause.under(key) from None
        if (named := _nested_argument(spec, key, str(err), cause)) is not None:
            raise named from None
        raise ConfigError(
            key, target, f"arguments {target} accepts", f"building it failed: {type(cause).__name__}: {cause}"
        ) from None


def _nested_argument(spec: Mapping[str, Any], key: str, message: str, cause: BaseException) -> ConfigError | None:
    """The argument of a nested component (``model.balancer.aggregator.c``) that failed, named with its value: the node
    Hydra's ``full_key`` names, or (a ``_partial_`` node, built by its parent) the nested node whose argument the
    error mentions; None where no single argument is mentioned."""
    found = re.search(r"full_key: ([\w.]+)", message)
    nodes = dict(_nested_nodes(spec))
    if found is not None:
        nodes = {found.group(1): nodes[found.group(1)]} if found.group(1) in nodes else {}
    said = str(cause)
    mentioned = [
        (path, name)
        for path, node in nodes.items()
        for name in node
        if not name.startswith("_") and re.search(rf"(?<![\w.]){re.escape(name)}(?![\w(])", said)
    ]
    if len(mentioned) != 1:
        return None
    path, name = mentioned[0]
    target = nodes[path].get("_target_", "?")
    return ConfigError(f"{key}.{path}.{name}", nodes[path][name], f"a value {target} accepts ({said})")


def _nested_nodes(spec: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Mapping[str, Any]]]:
    """Every component config inside ``spec`` (``aggregator``, ``scalarizer``, ...), by its dotted path."""
    found = []
    for name, value in spec.items():
        if isinstance(value, Mapping) and "_target_" in value:
            path = f"{prefix}{name}"
            found += [(path, value), *_nested_nodes(value, f"{path}.")]
    return found


def build_module(spec: Any, key: str, **passed: Any) -> nn.Module:
    """The ``nn.Module`` a config describes (or ``spec`` itself when it already is one).

    ``passed`` are arguments the recipe supplies (e.g. tbptt's ``vocab_size``): each goes to the
    target only when the config leaves it out and the target accepts it.
    """
    if isinstance(spec, nn.Module):
        return spec
    require(is_config(spec), key, spec, "a config with a `_target_` (an option of its config group), or an nn.Module")
    extra = {k: v for k, v in passed.items() if k not in spec and accepts(spec["_target_"], k)}
    module = _instantiate(spec, key, **extra)
    require(
        isinstance(module, nn.Module),
        f"{key}._target_",
        spec["_target_"],
        "a torch.nn.Module subclass",
        f"it built a {type(module).__name__}",
    )
    return module


def build_callable(spec: Any, key: str) -> Callable[..., Any]:
    """A loss, metric or activation: a dotted path (function, or class built without arguments), or a config."""
    if callable(spec) and not isinstance(spec, str):
        return spec
    if isinstance(spec, str):
        try:
            obj = get_object(spec)
        except Exception as err:
            raise ConfigError(key, spec, "the dotted path of a callable", f"cannot import it ({err})") from None
        if inspect.isclass(obj):
            obj = _instantiate({"_target_": spec}, key)
    else:
        require(is_config(spec), key, spec, "a dotted path (torch.nn.functional.mse_loss) or a config with `_target_`")
        obj = _instantiate(spec, key)
    require(callable(obj), key, spec, "something callable", f"it is a {type(obj).__name__}")
    return obj


def build_instance(spec: Any, key: str, base: type, spellings: Mapping[str, type], kind: str) -> Any:
    """An instance of ``base`` (``kind``: its dotted name, for messages) from ``spec``: a shipped spelling (a key of
    ``spellings``: its class, built without arguments), a config with a ``_target_`` (your subclass, from a
    ``--config-dir``), or an instance given as is. An unknown spelling or a target of another kind is refused here,
    where it is built, naming ``key``."""
    accepted = f"one of {', '.join(spellings)}, or {{_target_: <a {kind} subclass>}}"
    if isinstance(spec, str):
        require(spec in spellings, key, spec, accepted)
        return spellings[spec]()
    if isinstance(spec, base):
        return spec
    require(is_config(spec), key, spec, accepted)
    built = _instantiate(spec, key)
    require(
        isinstance(built, base),
        f"{key}._target_",
        spec["_target_"],
        f"a {kind} subclass",
        f"it built a {type(built).__name__}",
    )
    return built


def build_optimizer_factory(spec: Any, key: str) -> OptimizerFactory | None:
    """``params -> Optimizer`` from a ``_partial_`` optimizer config (or a callable given as is); None stays None."""
    if spec is None or (callable(spec) and not isinstance(spec, Mapping)):
        return spec
    require(
        is_config(spec) and spec.get("_partial_", False),
        key,
        spec,
        "an optimizer config with `_partial_: true` (an option of the optimizer group), or a callable",
    )
    factory = _instantiate(spec, key)
    # The optimizer's own argument checks (lr < 0, nan, weight_decay < 0, betas outside [0, 1)) run
    # now, on a stand-in parameter, instead of inside fit after the run dir was written.
    try:
        factory([torch.nn.Parameter(torch.zeros(1))])
    except (ValueError, TypeError) as err:
        raise optimizer_rejection(key, spec, str(err)) from None
    return factory


def name_of(component: Any) -> str:
    """How messages name a component: its config's ``_target_``, or the class of an object given as is."""
    if is_config(component):
        return str(component["_target_"])
    return component if isinstance(component, str) else type(component).__qualname__


def compile_in_place(module: nn.Module, names: Sequence[str], not_compilable: Callable[[str], str]) -> dict[str, str]:
    """``torch.compile`` each submodule of ``module`` named in ``names`` that ``not_compilable`` lets through.

    In place (``nn.Module.compile``): names, state-dict keys and checkpoints stay as without it. Returns
    what was not compiled and why (also said once on the console).
    """
    from lightning.pytorch.utilities import rank_zero_info

    skipped = {name: why for name in names if (why := not_compilable(name))}
    for name in names:
        component = getattr(module, name)
        if name not in skipped and not internals.is_compiled(component):
            component.compile()
    if skipped:
        rank_zero_info("model.compile: left eager: " + "; ".join(f"model.{n} ({why})" for n, why in skipped.items()))
    return skipped
