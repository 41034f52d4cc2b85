"""Per-task gradients on the shared parameters: what gradient-level balancers and the conflict monitor read.

One ``torch.autograd.grad`` per task (the graph kept until the last), so K tasks cost K backward
passes — the price of any method that looks at the tasks' gradients one by one. The *shared*
parameters are found: those that more than one task's loss reaches (a trunk), so the shipped nets
and a user's own need no key; a balancer's ``shared`` key names them instead (e.g. GradNorm's last
shared layer only, as in its paper), `select_parameters`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from multiloss.balancers.layer_gramian import reached
from multiloss.base.precision import widened
from multiloss.config import require


@dataclass
class TaskGradients:
    """Each task's gradient, as one flat vector over the shared parameters, and the rest per parameter."""

    shared: list[nn.Parameter]  # reached by more than one task
    vectors: torch.Tensor  # (tasks, n): task i's gradient on the shared parameters, flattened
    # Every other parameter a task reaches, with that task's gradient and index (once per task reaching it).
    own: list[tuple[nn.Parameter, torch.Tensor, int]]

    def averaged(self, mean_over_ranks: Callable[[torch.Tensor], torch.Tensor]) -> TaskGradients:
        """Every gradient averaged over the ranks (the global batch's), in one collective."""
        flat = torch.cat([self.vectors.reshape(-1), *(g.reshape(-1).to(self.vectors.dtype) for _, g, _ in self.own)])
        flat = mean_over_ranks(flat)
        vectors, offset, own = flat[: self.vectors.numel()].view_as(self.vectors), self.vectors.numel(), []
        for p, g, task in self.own:
            own.append((p, flat[offset : offset + g.numel()].view_as(g).to(g.dtype), task))
            offset += g.numel()
        return TaskGradients(self.shared, vectors, own)

    def scaled(self, weights: torch.Tensor) -> TaskGradients:
        """Every task's gradients times its weight (``weights[i]`` for task i)."""
        weights = weights.to(self.vectors.dtype)
        own = [(p, g * weights[task].to(g.dtype), task) for p, g, task in self.own]
        return TaskGradients(self.shared, self.vectors * weights[:, None], own)


def task_gradients(
    losses: Sequence[torch.Tensor], params: Sequence[nn.Parameter], shared: Collection[nn.Parameter] | None = None
) -> TaskGradients:
    """``∇ losses[i]`` for every task, split into the shared parameters' vectors and the rest.

    ``shared``: the parameters to treat as shared (None: those more than one task reaches). A
    parameter outside them that several tasks reach keeps each task's gradient apart, so a balancer
    weighs it per task but projects or normalises only on the shared ones.
    """
    params = [p for p in params if p.requires_grad]
    if shared is None:  # those more than one task's graph reaches (a walk of the graph: nothing computed yet)
        reach = reached(losses, params)
        shared_index = [j for j, p in enumerate(params) if sum(id(p) in r for r in reach) > 1]
    else:
        chosen = {id(p) for p in shared}
        shared_index = [j for j, p in enumerate(params) if id(p) in chosen]
    # One task's gradients at a time, their shared part written into its row and dropped: the K × n rows are the
    # one copy held (not the K gradients, their flattened rows and the stacked matrix at once).
    is_shared = set(shared_index)
    n = sum(params[j].numel() for j in shared_index)
    like = params[shared_index[0]] if shared_index else params[0]
    vectors = like.new_zeros(len(losses), n)
    own = []
    for task, loss in enumerate(losses):
        grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True, materialize_grads=False)
        offset = 0
        for j in shared_index:
            size = params[j].numel()
            if grads[j] is not None:
                vectors[task, offset : offset + size] = grads[j].reshape(-1)
            offset += size
        own += [(params[j], g, task) for j, g in enumerate(grads) if j not in is_shared and g is not None]
        del grads
    position = {id(p): j for j, p in enumerate(params)}
    own.sort(key=lambda item: position[id(item[0])])  # by parameter, then task (a stable sort), as before
    return TaskGradients([params[j] for j in shared_index], vectors, own)


def select_parameters(net: nn.Module, names: Sequence[str], key: str = "shared") -> list[nn.Parameter]:
    """The parameters of ``net`` whose names are, or start with, one of ``names`` (module paths: ``trunk.2``).

    Raises:
        ConfigError: ``names`` empty or not a list of strings, or a name that matches no parameter.
    """
    named = dict(net.named_parameters())
    require(
        isinstance(names, Sequence) and not isinstance(names, str) and len(names) > 0,
        key,
        names,
        "null (found: the parameters more than one task reaches) or a non-empty list of model.net's "
        "module or parameter names, e.g. [trunk]",
    )
    chosen: dict[int, nn.Parameter] = {}
    modules = sorted({n.rsplit(".", 1)[0] for n in named if "." in n})
    for name in names:
        hits = [p for n, p in named.items() if n == name or n.startswith(f"{name}.")]
        require(
            isinstance(name, str) and bool(hits),
            key,
            name,
            f"a name of model.net's modules or parameters: {', '.join(modules) or ', '.join(named)}",
            "it matches no parameter",
        )
        chosen.update((id(p), p) for p in hits)
    return list(chosen.values())


def pairwise_cosines(vectors: torch.Tensor) -> torch.Tensor:
    """(tasks, tasks) cosines between the rows of ``vectors`` (0 where a row is all zeros)."""
    unit = vectors / vectors.norm(dim=1, keepdim=True).clamp_min(torch.finfo(vectors.dtype).tiny)
    return unit @ unit.T


def gradient_surrogate(gradients: TaskGradients, shared_vector: torch.Tensor) -> torch.Tensor:
    """A scalar whose gradient is ``shared_vector`` on the shared parameters and each task's own gradient on the rest.

    Σ ⟨p, g⟩ with the g held constant: the recipe backwards it like any loss (``manual_backward``), so
    the combined gradient reaches ``.grad`` through autograd, where DDP's reducer (and its ``no_sync``
    under accumulation), AMP's loss scale and the accumulation's 1/k treat it as any other gradient.
    """
    surrogate = []
    offset = 0
    for p in gradients.shared:
        n = p.numel()
        surrogate.append((p * shared_vector[offset : offset + n].view_as(p).to(p.dtype).detach()).sum())
        offset += n
    surrogate += [(p * g.detach()).sum() for p, g, _ in gradients.own]
    if not surrogate:
        return shared_vector.new_zeros((), requires_grad=True)
    return torch.stack([widened(s) for s in surrogate]).sum()
