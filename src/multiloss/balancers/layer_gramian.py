"""The tasks' Gramian on the shared layers, layer by layer, without any task's gradient of a weight (K × n never held).

A gradient rule that needs only Gᵢⱼ = gᵢ·gⱼ (PCGrad, GradNorm, UPGrad, MGDA, CAGrad, ... : ``gramian_rule``) does not
need the K task gradients of the shared parameters. For a ``nn.Linear`` layer with inputs X (N × d_in, the rows of
every call in the step) and task i's gradient Δᵢ of its outputs (N × d_out), task i's weight gradient is Δᵢᵀ·X, so

    gᵢ·gⱼ (weight) = Σ_{r,s} (Δᵢ Δⱼᵀ)_{rs} (X Xᵀ)_{rs},      gᵢ·gⱼ (bias) = (Σ_r Δᵢ,r)·(Σ_r Δⱼ,r)

— the trick torchjd's ``autogram.Engine`` uses for its batched Gramians (its per-sample losses; a task loss here is
a batch mean, so the K task losses are differentiated instead). The Δᵢ of every layer come from one backward of the
K losses vectorised over the tasks (``is_grads_batched``) to the layers' outputs only: no weight gradient is
computed, and what is held is K × N × d_out per layer, not K × d_out × d_in. A layer with more rows than inputs
(N > d_in: long sequences) takes its K weight gradients instead, one layer at a time (K × that layer's n).

The step's gradient is then one backward of Σᵢ αᵢ·Lᵢ (the rule's coefficients on the shared layers), each task's
own parameters (its head) corrected to their own coefficient βᵢ from their gradients (small: the heads'). Forward
hooks on the shared Linear layers record their inputs and outputs while gradients are on; a shared parameter
outside a Linear layer (a convolution, BatchNorm, an RNN, a bare parameter) leaves the rule on the K gradients,
said once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn


class LayerGramian:
    """Records the Linear layers of ``net`` in each forward with gradients on, and computes the tasks' Gramian on the
    shared parameters from them (`gramian`) when they cover those parameters (`covers`)."""

    def __init__(self, net: nn.Module) -> None:
        self.layers = [m for m in net.modules() if isinstance(m, nn.Linear)]
        self.calls: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # by the module's id, at its forward
        self._said = False
        self.steps = 0  # the steps whose Gramian came from the layers (what a test or a benchmark reads)
        self._ids = {id(m) for m in self.layers}
        # For the message when a shared parameter is not a Linear layer's: its name and its layer's kind.
        self._where = {
            id(p): (f"{name}.{pname}" if name else pname, type(m).__name__)
            for name, m in net.named_modules()
            for pname, p in m.named_parameters(recurse=False)
        }
        self._linear = {
            name: {id(p) for p in m.parameters(recurse=False)}
            for name, m in net.named_modules()
            if isinstance(m, nn.Linear)
        }
        self.handles = [layer.register_forward_hook(self._record) for layer in self.layers]

    def _record(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        recording = id(module) in self._ids and torch.is_grad_enabled()
        if recording and isinstance(output, torch.Tensor) and output.requires_grad:
            self.calls.setdefault(id(module), []).append((args[0], output))

    def clear(self) -> None:
        self.calls.clear()

    def remove(self) -> None:
        """Take the hooks off the layers and drop what they recorded."""
        for handle in self.handles:
            handle.remove()
        self.handles, self._ids = [], set()
        self.clear()

    def __deepcopy__(self, memo: dict) -> LayerGramian:
        # A deep copy of the net (an EMA copy, a user's snapshot) copies its hooks, and with them this recorder: the
        # copy's recorder records nothing (its layers are not these), and no recorded activation (a non-leaf tensor,
        # which cannot be deep-copied) is copied.
        inert = LayerGramian.__new__(LayerGramian)
        inert.layers, inert.calls, inert._said, inert.steps, inert._ids, inert.handles = [], {}, True, 0, set(), []
        return inert

    def covers(self, shared: Sequence[nn.Parameter]) -> bool:
        """Whether every shared parameter is a Linear layer's weight or bias (else say once which is not)."""
        # The layers' parameters as they are now (FSDP2 swaps in whole ones for a step held whole).
        owned = {id(p) for m in self.layers for p in m.parameters(recurse=False)}
        outside = [p for p in shared if id(p) not in owned]
        if outside and not self._said:
            name, kind = self._where.get(id(outside[0]), (f"a parameter {tuple(outside[0].shape)}", "another layer"))
            chosen = {id(p) for p in shared}
            linear = ", ".join(n for n, ids in self._linear.items() if ids & chosen) or "<Linear layers of model.net>"
            rank_zero_warn(
                f"model.balancer: the shared parameter {name} {tuple(outside[0].shape)} is a {kind}'s, not a Linear "
                f"layer's ({len(outside)} such): the rule takes the tasks' K gradients (K backward passes, the K "
                "gradients held) instead of the Gramian layer by layer. To keep it layer by layer, let the rule work "
                f"on Linear layers only: model.balancer.shared=[{linear}]"
                " (the other shared parameters then get the tasks' summed gradient); model.balancer.gramian=gradients "
                "takes the K gradients without this warning"
            )
            self._said = True
        return not outside

    def gramian(self, losses: torch.Tensor, shared: Sequence[nn.Parameter]) -> torch.Tensor:
        """The K × K Gramian of the gradients of ``losses`` (a vector, graph on, kept) on ``shared`` (Linear
        layers' parameters), in float32 or wider."""
        k = len(losses)
        chosen = {id(p) for p in shared}
        layers = [m for m in self.layers if any(id(p) in chosen for p in m.parameters(recurse=False))]
        recorded = [(m, x, out) for m in layers for x, out in self.calls.get(id(m), [])]
        dtype = torch.promote_types(losses.dtype, torch.float32)
        gramian = torch.zeros(k, k, dtype=dtype, device=losses.device)
        if recorded:
            eye = torch.eye(k, dtype=losses.dtype, device=losses.device)
            deltas = torch.autograd.grad(
                losses,
                [out for _, _, out in recorded],
                grad_outputs=eye,
                is_grads_batched=True,
                retain_graph=True,
                allow_unused=True,
            )
            for layer in layers:
                rows = [(x, d) for (m, x, _), d in zip(recorded, deltas) if m is layer and d is not None]
                if rows:
                    gramian += _layer_gramian(layer, rows, chosen, dtype)
        self.clear()
        self.steps += 1
        return gramian


def _layer_gramian(
    layer: nn.Linear, rows: list[tuple[torch.Tensor, torch.Tensor]], chosen: set[int], dtype: torch.dtype
) -> torch.Tensor:
    x = torch.cat([x.detach().reshape(-1, x.shape[-1]) for x, _ in rows]).to(dtype)  # N × d_in
    d = torch.cat([d.reshape(d.shape[0], -1, d.shape[-1]) for _, d in rows], dim=1).to(dtype)  # K × N × d_out
    k = d.shape[0]
    gramian = torch.zeros(k, k, dtype=dtype, device=d.device)
    if id(layer.weight) in chosen:
        if x.shape[0] <= x.shape[1]:  # the rows' Gramian: N × N
            mixed = torch.einsum("rs,ksd->krd", x @ x.T, d)
            gramian += torch.einsum("ird,jrd->ij", d, mixed)
        else:  # more rows than inputs: this layer's K weight gradients
            weights = torch.einsum("krd,ri->kdi", d, x).reshape(k, -1)
            gramian += weights @ weights.T
    if layer.bias is not None and id(layer.bias) in chosen:
        bias = d.sum(dim=1)
        gramian += bias @ bias.T
    return gramian


def reached(losses: Sequence[torch.Tensor], params: Sequence[nn.Parameter]) -> list[set[int]]:
    """For each loss, the ids of the ``params`` its graph reaches (a walk of the autograd graph: nothing computed)."""
    wanted = {id(p) for p in params}
    result = []
    for loss in losses:
        found, seen, stack = set(), set(), [loss.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            variable = getattr(node, "variable", None)
            if variable is not None and id(variable) in wanted:
                found.add(id(variable))
            stack.extend(next_node for next_node, _ in node.next_functions)
        result.append(found)
    return result
