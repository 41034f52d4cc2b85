"""The state of a stateful torchjd object (``torchjd.Stateful``: GradVac, NashMTL, ExcessMTL, FAMO, ...) as a checkpoint
holds it: tensors, numbers and tuples only, so it loads with ``torch.load(weights_only=True)``.

torchjd keeps such state in private attributes (GradVac's EMA of the cosines ``_phi_t``, NashMTL's last weights
``prvs_alpha`` — a numpy array — and step count, ExcessMTL's squared-gradient sums), not in a ``state_dict``. Every
attribute of every stateful submodule is taken, so a state torchjd adds later is not lost silently: one of a type
this module cannot write refuses the save by name. NashMTL's cvxpy problem is rebuilt instead (it holds nothing
its parameters' values do not).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
from torch import nn

# What an nn.Module keeps in its __dict__ for itself: not an object's state.
_MODULE_OWN = set(vars(nn.Module()))
_NUMPY = "numpy"  # a numpy array is written as {"numpy": tensor}


def _stateful(module: nn.Module) -> bool:
    try:
        from torchjd._mixins import Stateful
    except ImportError:  # without the torchjd extra nothing is torchjd's
        return False
    return isinstance(module, Stateful)


def has_state(aggregator: Any) -> bool:
    """Whether ``aggregator`` (a torchjd aggregator or scalarizer, or a ``functools.partial`` of one's class) holds
    state between calls."""
    if isinstance(aggregator, functools.partial):
        from torchjd._mixins import Stateful

        return isinstance(aggregator.func, type) and issubclass(aggregator.func, Stateful)
    return isinstance(aggregator, nn.Module) and any(_stateful(m) for m in aggregator.modules())


def state_of(module: nn.Module) -> dict[str, dict[str, Any]]:
    """Each stateful submodule's attributes (by its name in ``module``), as a checkpoint can hold them."""
    return {
        name: {key: _written(f"{name}.{key}", value) for key, value in _fields(m).items() if not _rebuilt(value)}
        for name, m in module.named_modules()
        if _stateful(m)
    }


def load_state(module: nn.Module, state: dict[str, dict[str, Any]]) -> None:
    """Put back what `state_of` took (a NashMTL's cvxpy problem rebuilt around its restored values)."""
    modules = dict(module.named_modules())
    for name, fields in state.items():
        target = modules[name]
        key = fields.get("_state_key")
        # Where the state lived (ExcessMTL's key names its device): a checkpoint loads onto the CPU.
        device = next((v for v in key if isinstance(v, torch.device)), None) if isinstance(key, tuple) else None
        own_parameters = dict(target.named_parameters(recurse=False))
        for key, value in fields.items():
            value = _read(value, device)
            if key in own_parameters:  # FAMO's logits: the Parameter its own optimizer holds
                with torch.no_grad():
                    own_parameters[key].copy_(value)
            elif isinstance(value, dict) and "optimizer" in value:
                optimizer = getattr(torch.optim, value["class"])(target.parameters())
                optimizer.load_state_dict(value["optimizer"])
                setattr(target, key, optimizer)
            else:
                setattr(target, key, value)
        if getattr(target, "step", 0) and hasattr(target, "_init_optim_problem"):  # NashMTL after its first step
            target._init_optim_problem()


def _fields(module: nn.Module) -> dict[str, Any]:
    return {
        **{k: v for k, v in vars(module).items() if k not in _MODULE_OWN},
        **dict(module.named_parameters(recurse=False)),  # FAMO's logits (its own Adam steps them)
        # ExcessMTL registers its sums as buffers: None until its first call (then not listed: None is the fresh state)
        **dict(module.named_buffers(recurse=False)),
    }


def _rebuilt(value: Any) -> bool:
    return type(value).__module__.split(".")[0] == "cvxpy"


def _written(where: str, value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return {_NUMPY: torch.from_numpy(value.copy())}
    if isinstance(value, torch.Tensor):
        return value.detach().clone().cpu()
    if isinstance(value, torch.optim.Optimizer):  # FAMO's own Adam
        return {"optimizer": value.state_dict(), "class": type(value).__name__}
    if value is None or isinstance(value, bool | int | float | str | torch.dtype | torch.device):
        return value
    if isinstance(value, tuple | list):
        return type(value)(_written(where, v) for v in value)
    raise TypeError(
        f"the torchjd state {where} is a {type(value).__name__}, which a checkpoint cannot hold "
        "(multiloss.balancers.torchjd_state knows tensors, numbers, numpy arrays, optimizers and tuples)"
    )


def _read(value: Any, device: torch.device | None) -> Any:
    if isinstance(value, dict) and set(value) == {_NUMPY}:
        return value[_NUMPY].numpy().copy()
    if isinstance(value, tuple | list):
        return type(value)(_read(v, device) for v in value)
    if not isinstance(value, torch.Tensor):
        return value
    return value.clone() if device is None else value.to(device, copy=True)
