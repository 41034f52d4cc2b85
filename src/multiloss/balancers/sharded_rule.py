"""A gradient balancer's rule on sharded gradients (FSDP2, ``model.balancer.scope=global``): the net never held whole.

Each task's loss cᵢ·Lᵢ is backwarded on its own through FSDP2's own schedule, the graph kept until the last
(measured, torch 2.13: each backward gathers the units again and leaves that task's gradient of the global
batch reduce-scattered in the shards' ``.grad``). The rule needs only the tasks' K × K Gramian on the shared
parameters: each rank's dot products over its own shards, completed by one all-reduce
(`GradientBalancer.gramian_rule`). The step's gradient — Σᵢ αᵢ·gᵢ on the shared parameters, Σᵢ βᵢ·gᵢ on the
others — is then written shard by shard. Memory: K sharded gradients, never a whole weight or gradient; time:
K backward passes and K reduce-scatters a step (the rank rule's held-whole step: K local passes, one
reduce-scatter).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from multiloss.base.precision import widened


def apply_sharded_rule(
    net: nn.Module,
    balancer: Any,  # a multiloss.balancers.GradientBalancer (its `base`, `gramian_rule`)
    losses: Sequence[torch.Tensor],
    backward: Callable[..., None],
    sum_over_ranks: Callable[[torch.Tensor], torch.Tensor],
    shared: Sequence[nn.Parameter] | None = None,
) -> None:
    """Put the rule's gradient of ``losses`` (each task's own loss) into the sharded ``net``'s ``.grad`` (added to what
    is there), and the balancer's own term's into its parameters'. ``backward``: the recipe's ``manual_backward``;
    ``shared``: the parameters the balancer's ``shared`` key names (None: those more than one task reaches)."""
    params = list(net.named_parameters())  # DTensors: the net is sharded between steps
    kept = {name: p.grad for name, p in params}
    per_task: list[dict[str, torch.Tensor | None]] = []
    weighted = balancer.rule_losses(losses)
    for i, loss in enumerate(weighted):
        for _, p in params:
            p.grad = None
        backward(loss, retain_graph=i < len(weighted) - 1)
        per_task.append({name: p.grad for name, p in params})
    reached = {name: [t for t, grads in enumerate(per_task) if grads[name] is not None] for name, _ in params}
    chosen = None if shared is None else {id(p) for p in shared}
    shared_names = {name for name, p in params if (len(reached[name]) > 1 if chosen is None else id(p) in chosen)}

    with torch.autocast(weighted[0].device.type, enabled=False):
        rows = torch.stack(
            [
                torch.cat([widened(_local(grads[name], p).reshape(-1)) for name, p in params if name in shared_names])
                if shared_names
                else widened(weighted[0].new_zeros(0))
                for grads in per_task
            ]
        )
        gramian = sum_over_ranks(rows @ rows.T)  # each rank's shards' dot products, completed
        rule = balancer.gramian_rule(gramian, losses)
    for name, p in params:
        coefficients = rule.shared if name in shared_names else rule.own
        combined = None
        for t in reached[name]:
            term = per_task[t][name] * coefficients[t].to(p.dtype)
            combined = term if combined is None else combined + term
        p.grad = kept[name] if combined is None else combined if kept[name] is None else kept[name] + combined
    if rule.extra is not None:
        backward(rule.extra)


def _local(grad: torch.Tensor | None, param: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``grad`` (zeros where the task did not reach the parameter)."""
    local = param.to_local() if hasattr(param, "to_local") else param
    if grad is None:
        return torch.zeros_like(local)
    return grad.to_local() if hasattr(grad, "to_local") else grad
