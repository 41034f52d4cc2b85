"""A balancer made from its config (``model.balancer``), in one place, and what its config asks of the run.

`build_balancer` makes it for the recipe's tasks once they are known (before the first step, or before a
checkpoint's weights load into it); `rule_on_each_rank` and `check_sharded_balancer` answer, from the
config alone and before training starts, what a gradient rule needs of FSDP2.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hydra.utils import get_object
from torch import nn

from multiloss.balancers.protocol import Balancer, GradientBalancer
from multiloss.balancers.weighting import Fixed
from multiloss.building.components import build_module
from multiloss.config import require

_FIXED = "multiloss.balancers.Fixed"


def build_balancer(
    spec: dict[str, Any] | None, tasks: Sequence[str], base: Sequence[float], net: nn.Module, key: str
) -> Balancer:
    """The balancer of config ``spec`` (None, or ``fixed``: the configured weights ``base``) for ``tasks``, on ``net``'s
    device (at setup Lightning already reports the target device while the weights are still on the CPU); ``key``:
    its config key in messages."""
    if spec is None or _target(spec) == _FIXED:
        balancer: Balancer = Fixed(tasks, base)
    else:
        balancer = build_module(spec, key, tasks=list(tasks), base=list(base), net=net)
    weight = next(net.parameters(), None)
    return balancer if weight is None else balancer.to(weight.device)


def combines_gradients(spec: dict[str, Any] | None) -> bool:
    """Whether the balancer of config ``spec`` combines the tasks' gradients (a `GradientBalancer`)."""
    if isinstance(spec, Balancer):  # given as an object
        return spec.combines_gradients
    cls = _balancer_class(spec)
    return cls is not None and cls.combines_gradients


def _balancer_class(spec: Any) -> type[Balancer] | None:
    """The `Balancer` subclass a config names (None: no target, or a target of another kind: refused when built)."""
    target = _target(spec)
    cls = get_object(target) if target is not None else None
    return cls if isinstance(cls, type) and issubclass(cls, Balancer) else None


def _scope(spec: Any) -> str:
    """A gradient rule's ``scope`` (``rank`` unless set), from its config or the balancer given as an object."""
    if isinstance(spec, dict):
        return spec.get("scope", "rank")
    return spec.scope if isinstance(spec, GradientBalancer) else "rank"


def _rep_grad(spec: Any) -> bool:
    return (
        spec.get("rep_grad") if isinstance(spec, dict) else spec.rep_grad if isinstance(spec, Balancer) else None
    ) is not None


def _target(spec: Any) -> str | None:
    return spec.get("_target_") if isinstance(spec, dict) else None


def rule_on_each_rank(spec: dict[str, Any] | None) -> bool:
    """Whether a gradient rule differentiates each rank's whole net per task (``scope=rank``): under FSDP2 the net is
    then held whole for its step. ``scope=global`` runs the rule on the shards instead."""
    # On the representation (rep_grad) no parameter's gradient is taken: the net stays as it is, sharded or not.
    return combines_gradients(spec) and _scope(spec) == "rank" and not _rep_grad(spec)


def check_sharded_balancer(spec: dict[str, Any] | None, accumulate_grad_batches: int) -> None:
    """Refuse what a gradient rule on the shards (``scope=global`` under FSDP2) cannot compute."""
    scope = _scope(spec)
    if not (combines_gradients(spec) and scope == "global") or _rep_grad(spec):
        return
    require(
        accumulate_grad_batches == 1,
        "model.balancer.scope",
        scope,
        f"rank with model.accumulate_grad_batches={accumulate_grad_batches} under sharded training, or "
        "model.accumulate_grad_batches=1",
        "the sharded rule reduce-scatters each task's gradient of a micro-batch that steps; micro-batches that "
        "do not step keep whole gradients",
    )
    if (cls := _balancer_class(spec)) is not None:
        cls.check_sharded_rule(spec)
