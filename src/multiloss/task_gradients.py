"""Per-task gradients on the shared parameters: what gradient-level balancers and the conflict monitor read.

One ``torch.autograd.grad`` per task (the graph kept until the last), so K tasks cost K backward
passes — the price of any method that looks at the tasks' gradients one by one. The *shared*
parameters are found, not configured: those that more than one task's loss reaches (a trunk),
so the shipped nets and a user's own need no key.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class TaskGradients:
    """Each task's gradient, as one flat vector over the shared parameters, and the rest per parameter."""

    shared: list[nn.Parameter]  # reached by more than one task
    vectors: torch.Tensor  # (tasks, n): task i's gradient on the shared parameters, flattened
    own: list[tuple[nn.Parameter, torch.Tensor, int]]  # a parameter only one task reaches, its gradient, the task

    def scaled(self, weights: torch.Tensor) -> TaskGradients:
        """Every task's gradients times its weight (``weights[i]`` for task i)."""
        weights = weights.to(self.vectors.dtype)
        own = [(p, g * weights[task].to(g.dtype), task) for p, g, task in self.own]
        return TaskGradients(self.shared, self.vectors * weights[:, None], own)


def task_gradients(losses: Sequence[torch.Tensor], params: Sequence[nn.Parameter]) -> TaskGradients:
    """``∇ losses[i]`` for every task, split into the shared parameters' vectors and the task-own parameters."""
    params = [p for p in params if p.requires_grad]
    per_task = [
        torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True, materialize_grads=False)
        for loss in losses
    ]
    shared_index = [j for j in range(len(params)) if sum(g[j] is not None for g in per_task) > 1]
    own = []
    for j, p in enumerate(params):
        if j in shared_index:
            continue
        reached = [(i, g[j]) for i, g in enumerate(per_task) if g[j] is not None]
        if reached:
            ((task, grad),) = reached  # not shared: one task at most
            own.append((p, grad, task))
    shared = [params[j] for j in shared_index]
    vectors = torch.stack(
        [
            torch.cat([(g[j] if g[j] is not None else torch.zeros_like(params[j])).reshape(-1) for j in shared_index])
            if shared_index
            else params[0].new_zeros(0)
            for g in per_task
        ]
    )
    return TaskGradients(shared, vectors, own)


def pairwise_cosines(vectors: torch.Tensor) -> torch.Tensor:
    """(tasks, tasks) cosines between the rows of ``vectors`` (0 where a row is all zeros)."""
    unit = vectors / vectors.norm(dim=1, keepdim=True).clamp_min(torch.finfo(vectors.dtype).tiny)
    return unit @ unit.T


def accumulate_into_grads(gradients: TaskGradients, shared_vector: torch.Tensor) -> None:
    """Add ``shared_vector`` (over the shared parameters) and the task-own gradients into ``.grad``.

    Through a backward of a surrogate (Σ ⟨p, g⟩), not by writing ``.grad``: DDP's reducer hears
    about gradients only when autograd accumulates them, so this keeps its all-reduce (and
    ``no_sync`` under accumulation) as for any backward.
    """
    surrogate = []
    offset = 0
    for p in gradients.shared:
        n = p.numel()
        surrogate.append((p * shared_vector[offset : offset + n].view_as(p).to(p.dtype)).sum())
        offset += n
    surrogate += [(p * g.detach()).sum() for p, g, _ in gradients.own]
    if surrogate:
        torch.autograd.backward(torch.stack([s.float() for s in surrogate]).sum())
