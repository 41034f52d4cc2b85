"""Sharded training (FSDP2): every network of a recipe sharded on its own over the data-parallel ranks.

``trainer=fsdp_cpu`` (2 processes, gloo, fp32) and ``trainer=fsdp`` (every GPU, NCCL) run a recipe on
`multiloss.parallel.fsdp.FSDPStrategy`, Lightning's `ModelParallelStrategy` (FSDP2,
``torch.distributed.fsdp.fully_shard``) with
all ranks data-parallel. Lightning's `FSDPStrategy` (FSDP1) is not the path: it cannot run manual
optimization, and every recipe runs under it.

What a recipe's networks become (`shard_components`, from ``Recipe.configure_model``): each component
(``net``; the GAN's ``generator`` and ``discriminator``) is sharded on its own, so a GAN's two optimizers
each hold their own network's shards. Inside a component the units sharded together are chosen by
``model.fsdp.shard``: class names or name patterns (``fnmatch``) of its modules; null — each child
module that has parameters — then the component's root, as torchtitan wraps blocks. ``model.fsdp.
checkpoint`` names module classes whose forward is recomputed in the backward instead of kept
(activation checkpointing, ``torch.utils.checkpoint``). On GPUs a bf16 ``trainer.precision`` gives FSDP2's
mixed precision: bf16 parameters in the forward and backward, fp32 gradient reduction and optimizer step.

What the step needs of the strategy: micro-batches that do not step skip the reduce-scatter
(``set_requires_gradient_sync(False)``, FSDP2's ``no_sync``), and parameters outside every sharded
unit (a balancer's) have their gradients averaged over the ranks before each optimizer step, as DDP
would.

A step that differentiates a component's parameters more than once — a gradient balancer's per-task
``autograd.grad`` (PCGrad, GradNorm, UPGrad, MGDA), ``monitor=conflicts``, WGAN-GP's penalty (a
double backward through the critic) — cannot run on FSDP2's own schedule: its first backward reshards
the weights the next one needs, ``autograd.grad`` returns nothing for a sharded parameter, and its
reduce-scatter is a hook that a surrogate backward never reaches. Such a component is *held whole for
its step* (`LocalGradients`, the recipe names it: `Recipe.held_whole`): gathered at its
forward and kept until the step's gradients are taken, differentiated as on one device, its whole
gradient accumulated on each rank over the micro-batches of an optimizer step, then reduce-scattered
by hand into the sharded ``.grad`` (divided by the world size, as DDP averages) and the weights
resharded. Each rank applies the rule to its own gradients, then they are averaged: DDP's result to
the bit. At rest (optimizer state, parameters between steps, the optimizer's gradients) the component
stays sharded; during its step it takes the memory of a DDP replica's parameters and gradients.
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Generator, Iterable, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial

from multiloss.building.components import to_plain
from multiloss.config import require, require_options


def shard_components(
    module: nn.Module,
    names: Sequence[str],
    mesh: Any,
    shard: Sequence[str] | None = None,
    recompute: Sequence[str] = (),
    mp_policy: Any = None,
    held_whole: Sequence[str] = (),
) -> dict[str, LocalGradients]:
    """``fully_shard`` each component of ``module`` named in ``names`` on its own: the units ``shard`` picks (class
    names or fnmatch patterns of module names; None: each child with parameters), then the component's root.
    ``recompute``: the classes whose activations are recomputed in the backward (``model.fsdp.checkpoint``).
    `check_policy` has judged both (`Recipe.check_sharding`, before training starts).

    The components in ``held_whole`` are gathered at their forward and kept whole until their step's gradients are
    handed over (`LocalGradients`, returned by name)."""
    from torch.distributed.fsdp import fully_shard

    kwargs = {"mesh": mesh, **({"mp_policy": mp_policy} if mp_policy is not None else {})}
    local = {}
    for name in names:
        component = getattr(module, name)
        whole = name in held_whole
        _recompute_activations(component, recompute)
        for unit in _units(component, shard):  # innermost first: a unit inside another is sharded before it
            fully_shard(unit, **kwargs, **({"reshard_after_forward": False} if whole else {}))
        fully_shard(component, **kwargs, **({"reshard_after_forward": False} if whole else {}))
        if whole:
            local[name] = LocalGradients(component)
    return local


HELD_WHOLE = "_multiloss_held_whole"  # marks the FSDP units of a component LocalGradients holds


class LocalGradients:
    """A sharded component held whole for its step: differentiated as on one device, its gradients reduce-scattered
    by hand (see the module's docstring for why).

    ``with held.step(stepping):`` around the component's forward and backward(s): on entry, a component another
    network's step left whole (a GAN's G step through D, with D's weights frozen) drops those gradients and is
    resharded, so that its forward gathers it with the ``requires_grad`` its optimizer's toggle gives; at the exit,
    this step's gradients are added to the whole-gradient sum of the optimizer step, the weights resharded, and — when
    ``stepping`` — the sum averaged over the ranks into each sharded parameter's ``.grad``.
    """

    def __init__(self, component: nn.Module) -> None:
        self.component = component
        self.units = [m for m in component.modules() if hasattr(m, "reshard")]
        for unit in self.units:
            setattr(unit, HELD_WHOLE, True)
            # FSDP2 reduces nothing and reshards nothing in the backward: `hand_over` does both.
            unit.set_requires_gradient_sync(False, recurse=False)
            unit.set_reshard_after_backward(False, recurse=False)
        self.sums: dict[str, torch.Tensor] = {}  # parameter name -> this rank's whole gradient since the last step

    @contextmanager
    def step(self, stepping: bool) -> Generator[None, None, None]:
        for param in self.component.parameters():
            if not isinstance(param, DTensor):  # a whole weight (the component is gathered): not the optimizer's
                param.grad = None
        self._reshard()
        yield
        self.hand_over(stepping)

    def _reshard(self) -> None:
        for unit in self.units:
            unit.reshard()  # the optimizer steps the shards; the next forward gathers the stepped weights

    def hand_over(self, stepping: bool) -> None:
        for name, param in self.component.named_parameters():
            if not isinstance(param, DTensor) and param.grad is not None:
                grad, param.grad = param.grad, None
                self.sums[name] = grad if name not in self.sums else self.sums[name] + grad
        self._reshard()
        if not stepping:
            return
        for name, param in self.component.named_parameters():  # sharded again: DTensors, the same order on each rank
            # A parameter this rank's step did not reach gives zeros: every rank joins every collective.
            whole = self.sums.pop(name, None)
            whole = torch.zeros(param.shape, dtype=param.dtype, device=param.device) if whole is None else whole
            mesh = param.device_mesh
            # Divided first, then summed over the ranks (DDP's order): a reduce-scatter to this rank's shard.
            summed = DTensor.from_local(whole.to(param.dtype) / mesh.size(), mesh, [Partial()])
            shard = summed.redistribute(mesh, param.placements)
            param.grad = shard if param.grad is None else param.grad + shard


def fsdp_options(fsdp: Any) -> dict[str, Any]:
    """``model.fsdp`` checked: ``shard`` (names, or null: each child) and ``checkpoint`` (the classes whose activations
    are recomputed); one name on the command line (``fsdp.checkpoint=Block``) is a list of one."""
    options = {"shard": None, "checkpoint": [], **to_plain(fsdp or {})}
    require_options(options, "fsdp", ("shard", "checkpoint"))
    for key in ("shard", "checkpoint"):
        value = options[key]
        value = [value] if isinstance(value, str) else value
        names = isinstance(value, list) and all(isinstance(v, str) for v in value)
        require(
            names or (value is None and key == "shard"),
            f"fsdp.{key}",
            value,
            "a class name or name pattern, or a list of them" + (" (null: each child)" if key == "shard" else ""),
        )
        options[key] = value
    return options


def check_policy(
    module: nn.Module, names: Sequence[str], shard: Sequence[str] | None, recompute: Sequence[str]
) -> None:
    """Refuse a ``model.fsdp.shard`` or ``model.fsdp.checkpoint`` that names none of the components' modules (a
    typo would otherwise shard each network whole, or recompute nothing)."""
    components = [getattr(module, name) for name in names]
    listing = "; ".join(f"model.{name}: {_module_names(c)}" for name, c in zip(names, components, strict=True))
    require(
        shard is None or any(_units(c, shard) or type(c).__name__ in shard for c in components),
        "model.fsdp.shard",
        list(shard or []),
        f"class names or name patterns of the components' modules ({listing})",
        "it matches none of them",
    )
    classes = set(recompute)
    require(
        not classes or any(type(m).__name__ in classes for c in components for m in c.modules()),
        "model.fsdp.checkpoint",
        sorted(classes),
        f"class names of the components' modules ({listing})",
        "it names none of them",
    )


def _units(component: nn.Module, shard: Sequence[str] | None) -> list[nn.Module]:
    """The modules of ``component`` sharded as units (innermost first; the component's root is sharded after them
    anyway, so naming its own class adds no unit). A named container without a forward (ModuleList, ModuleDict:
    ``fully_shard`` refuses those) gives its children with parameters; a module without parameters is no unit."""
    if shard is None:
        return list(_children_with_parameters(component))
    picked: dict[int, nn.Module] = {}
    for name, m in component.named_modules():
        if name and any(type(m).__name__ == p or fnmatch.fnmatchcase(name, p) for p in shard):
            units = _children_with_parameters(m) if isinstance(m, nn.ModuleList | nn.ModuleDict) else [m]
            picked.update((id(u), u) for u in units if any(True for _ in u.parameters()))
    depth = {id(m): name.count(".") for name, m in component.named_modules()}
    return sorted(picked.values(), key=lambda m: -depth[id(m)])


def _children_with_parameters(module: nn.Module) -> Iterable[nn.Module]:
    """Each child that has parameters; a container without a forward (ModuleList, ModuleDict) gives its own."""
    for child in module.children():
        if isinstance(child, nn.ModuleList | nn.ModuleDict):
            yield from _children_with_parameters(child)
        elif any(True for _ in child.parameters()):
            yield child


def _module_names(component: nn.Module) -> str:
    names = [name for name, _ in component.named_modules() if name]
    classes = sorted({type(m).__name__ for _, m in component.named_modules()})
    return ", ".join(names[:6] + classes[:6])


def _recompute_activations(component: nn.Module, classes: Iterable[str]) -> None:
    """Recompute the forward of each module of one of ``classes`` in the backward (non-reentrant torch checkpoint)."""
    classes = set(classes)
    for m in component.modules():
        if type(m).__name__ in classes:
            m.forward = functools.partial(_recomputed, m.forward)


def _recomputed(forward: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import checkpoint

    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def average_unsharded_gradients(optimizer: Any, reduce: Any) -> None:
    """Average over the ranks the gradients of ``optimizer``'s parameters that no sharded unit owns (FSDP2 leaves them
    alone; DDP would have averaged them): a balancer's weights. One collective a tensor; nothing if there are none."""
    for group in getattr(optimizer, "optimizer", optimizer).param_groups:
        for param in group["params"]:
            if param.grad is not None and not isinstance(param, DTensor):
                param.grad.copy_(reduce(param.grad))


def mixed_precision_policy(trainer: Any) -> Any:
    """FSDP2's mixed precision for a bf16 ``trainer.precision``: bf16 parameters, fp32 gradient reduction."""
    if "bf16" not in str(trainer.precision):
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def full(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded tensor's whole value (a collective), or the tensor itself."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
