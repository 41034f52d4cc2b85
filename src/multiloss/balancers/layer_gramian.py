"""The tasks' Gramian on the shared layers, one segment of the net at a time: the K task gradients never held at once.

A gradient rule that needs only Gᵢⱼ = gᵢ·gⱼ (PCGrad, GradNorm, UPGrad, MGDA, CAGrad, ... : ``gramian_rule``) does not
need the K task gradients of all the shared parameters together: G is a sum over the parameters, so each part of the
net can give its K gradients, add their Gramian, and drop them before the next part's are computed.

The parts are cut at *boundaries*: the outputs of the net's modules (a Linear, a Conv2d, a BatchNorm, a whole residual
block) through which every path from the losses to what lies before them passes. One backward of the K losses,
vectorised over the tasks (``is_grads_batched``), runs down the net a segment at a time: from a boundary's K
gradients (the tasks' gradients of that output, K × its size) to the next boundary's and to the K gradients of the
segment's parameters, which are folded into G and dropped. What is held is one segment's K gradients and one
boundary's, not K × n — a Sequential trunk of Conv2d + BatchNorm + ReLU is one layer a segment; a ResNet, one block.
A Linear layer whose output is a boundary gives its Gramian from its inputs X (N × d_in) and its outputs' K
gradients Δᵢ (N × d_out) without its weight gradients (K × d_out × d_in), where N ≤ d_in:

    gᵢ·gⱼ (weight) = Σ_{r,s} (Δᵢ Δⱼᵀ)_{rs} (X Xᵀ)_{rs},      gᵢ·gⱼ (bias) = (Σ_r Δᵢ,r)·(Σ_r Δⱼ,r)

— the trick torchjd's ``autogram.Engine`` uses for its batched Gramians (its per-sample losses; a task loss here is
a batch mean, so the K task losses are differentiated instead).

The step's gradient is then one backward of Σᵢ αᵢ·Lᵢ (the rule's coefficients on the shared layers), each task's
own parameters (its head) corrected to their own coefficient βᵢ from their gradients (small: the heads'). Forward
hooks on the net's modules record where their outputs sit in the graph (``GradientEdge``: a later in-place op does
not move it) while gradients are on. Where the vectorised backward cannot run (an operation without a batching rule
that raises), the rule takes the K gradients instead, said once with the parameters concerned.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.distributed.fsdp import FSDPModule


@dataclass
class _Cut:
    """A module output in the step's graph: a candidate boundary, the calls that returned it."""

    edge: GradientEdge
    calls: list[tuple[nn.Module, torch.Tensor | None, torch.Size]] = field(default_factory=list)  # module, X, shape


@dataclass
class _Segment:
    """The part of the graph from ``top`` (a cut, None: the losses) down to ``bottom`` (None: the graph's end)."""

    top: int | None
    bottom: int | None
    parameters: list[nn.Parameter]  # the shared ones it reaches
    by_rows: list[tuple[nn.Module, torch.Tensor, torch.Size]]  # a Linear whose Gramian its rows give
    wanted: list[nn.Parameter]  # the rest: their K gradients taken


def walk(starts: list, stops: Any = ()) -> tuple[list[torch.Tensor], list[Any]]:
    """The leaves (parameters, in the order met) the autograd graph reaches from the nodes ``starts``, and the nodes
    of ``stops`` (a container of node ids) met on the way, not gone past. Nothing is computed."""
    leaves, stopped, seen, stack = [], [], set(), list(starts)
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if id(node) in stops:
            stopped.append(node)
            continue
        variable = getattr(node, "variable", None)
        if variable is not None:
            leaves.append(variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return leaves, stopped


def each_task(losses: torch.Tensor, inputs: list) -> tuple[torch.Tensor | None, ...]:
    """The K gradients of ``inputs`` (tensors or graph edges), one task's backward at a time into one K × shape
    tensor per input: above the representation each loss reaches its own head only, where a backward vectorised
    over the tasks would run every head for every task (K² heads' work)."""
    if not inputs:
        return ()
    rows: list[torch.Tensor | None] = [None] * len(inputs)
    k = len(losses)
    for task in range(k):
        grads = torch.autograd.grad(losses[task], inputs, retain_graph=True, allow_unused=True)
        for i, g in enumerate(grads):
            if g is None:
                continue
            if rows[i] is None:
                rows[i] = g.new_zeros(k, *g.shape)
            rows[i][task] = g
    return tuple(rows)


def _cheapest_switch(plan: list[_Segment], cuts: list[_Cut], k: int) -> tuple[int, int]:
    """Where to stop carrying the K gradients of the boundaries and take the rest task by task, holding the least:
    (the first segment taken task by task — ``len(plan)``: none —, the numbers held at the peak).

    Carried through a segment: K × (its top's and bottom's outputs + its parameters); task by task from a segment
    down: K × (its top's output + every parameter below). Activations larger than parameters (a convolution on a
    large image) make the K gradients of the parameters the smaller; wide Linear layers, the carried ones.
    """

    def size(i: int | None) -> int:
        return 1 if i is None else max(shape.numel() for _, _, shape in cuts[i].calls)

    carried = [
        k * (size(s.top) + (size(s.bottom) if s.bottom is not None else 0) + sum(p.numel() for p in s.wanted))
        for s in plan
    ]
    below = [sum(p.numel() for s in plan[i:] for p in s.parameters) for i in range(len(plan))]
    options = [
        (max([*carried[:switch], k * (size(plan[switch].top) + below[switch]) if switch < len(plan) else 0]), switch)
        for switch in range(len(plan) + 1)
    ]
    held, switch = min(options, key=lambda option: (option[0], -option[1]))  # a tie: carry (one vectorised pass)
    return switch, held


def _task_by_task(
    output: torch.Tensor | GradientEdge, delta: torch.Tensor, params: list[nn.Parameter], dtype: torch.dtype
) -> torch.Tensor:
    """The Gramian of the K gradients of ``params`` from ``output`` seeded with each row of ``delta`` in turn, each
    task's written into its row of one K × n matrix (the one copy held) and dropped."""
    k = len(delta)
    n = sum(p.numel() for p in params)
    rows = delta.new_zeros(k, n, dtype=params[0].dtype if params else delta.dtype)
    for task in range(k):
        grads = torch.autograd.grad(output, params, grad_outputs=delta[task], retain_graph=True, allow_unused=True)
        offset = 0
        for p, g in zip(params, grads):
            if g is not None:
                rows[task, offset : offset + p.numel()] = g.reshape(-1)
            offset += p.numel()
        del grads
    rows = rows.to(dtype)
    return rows @ rows.T


class LayerGramian:
    """Records where the outputs of ``net``'s modules sit in each forward with gradients on, and computes the tasks'
    Gramian on the shared parameters from the graph, segment by segment (`gramian`)."""

    def __init__(self, net: nn.Module, keep_outputs: bool = False) -> None:
        self.layers = list(net.modules())
        # ``rep_grad``: the modules' outputs themselves (the representation is one; its value and its place in the
        # graph are read at the step), with their version at the forward (an in-place op after it would change it).
        self.keep_outputs = keep_outputs
        self.outputs: dict[int, tuple[torch.Tensor, int]] = {}
        self.cuts: dict[int, _Cut] = {}  # by the graph node of a module's output, in the order of the forward
        self._said = False
        self.steps = 0  # the steps whose Gramian came from the segments (what a test or a benchmark reads)
        self.held = 0  # the most task-gradient numbers held at once, as last planned (what a test or benchmark reads)
        self.switched = 0  # the steps whose lower part was taken task by task (its activations outweighing it)
        self.by_gradients = 0  # the steps left to the K gradients: all of it task by task, nothing carried
        self._names = {id(p): name for name, p in net.named_parameters()}
        self._module_names = {id(m): name or "model.net" for name, m in net.named_modules()}
        self.handles = [layer.register_forward_hook(self._record) for layer in self.layers]

    def _record(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if isinstance(output, tuple | list) and output and isinstance(output[0], torch.Tensor):
            output = output[0]  # a module's main output (a max-pool's beside its indices, an LSTM's beside its state)
        if not (torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.grad_fn is not None):
            return
        edge = get_gradient_edge(output)
        cut = self.cuts.setdefault(id(edge.node), _Cut(edge))
        if cut.edge.output_nr != edge.output_nr:  # two outputs of one node: neither can be a boundary alone
            cut.edge = GradientEdge(edge.node, -1)
        x = args[0] if isinstance(module, nn.Linear) and args and isinstance(args[0], torch.Tensor) else None
        cut.calls.append((module, x, output.shape))
        if self.keep_outputs:
            self.outputs[id(edge.node)] = (output, output._version)

    def clear(self) -> None:
        self.cuts, self.outputs = {}, {}

    def representation(
        self, losses: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor, int]] | None, str]:
        """The representation — the first boundary from the losses: the output of the module where every task's path
        meets (the encoder's, LibMTL's ``rep``) —, its K gradients (K × its shape), each task's gradient of the
        parameters it reaches above it (its head: ``(parameter, gradient, task)``; None under FSDP2's sharding), and
        the name of the module that returned it. One backward per task, through its own head only."""
        stacked = torch.stack(list(losses))
        cuts = [c for c in self.cuts.values() if c.edge.output_nr >= 0]
        outputs = self.outputs
        self.clear()
        boundaries = _CutGraph(stacked, cuts).boundaries()
        names = (
            [self._module_names.get(id(m), type(m).__name__) for m, _, _ in cuts[boundaries[0]].calls]
            if boundaries
            else []
        )
        kept = outputs.get(id(cuts[boundaries[0]].edge.node)) if boundaries else None
        if kept is None or kept[0]._version != kept[1]:
            raise RuntimeError(
                "model.balancer.rep_grad: no representation found — "
                + (
                    f"the output of {' / '.join(names)} is where the tasks meet, but it is changed in place after "
                    "its module (e.g. a ReLU(inplace=True) after it): make that op out of place"
                    if kept is not None
                    else "no module's output lies on every task's path (each task its own trunk, or the tasks meet "
                    "outside a module of model.net)"
                )
                + "; or set model.balancer.rep_grad=null (the rule on the shared parameters' gradients)"
            )
        rep, edge = kept[0], cuts[boundaries[0]].edge
        per_task = torch.zeros(len(losses), *rep.shape, dtype=rep.dtype, device=rep.device)
        aboves = [walk([loss.grad_fn], {id(edge.node)})[0] for loss in losses]
        # FSDP2 frees a unit's whole weights after its forward and gathers them again for its backward: they cannot be
        # read here. None then: the heads' gradients come from the step's backward.
        heads: list | None = None if any(isinstance(m, FSDPModule) for m in self.layers) else []
        for task, (loss, above) in enumerate(zip(losses, aboves, strict=True)):
            wanted = [edge, *above] if heads is not None else [edge]
            grads = torch.autograd.grad(loss, wanted, retain_graph=True, allow_unused=True)
            if grads[0] is not None:
                per_task[task] = grads[0]
            if heads is not None:
                heads += [(p, g, task) for p, g in zip(above, grads[1:]) if g is not None]
        self.steps += 1
        return rep, per_task, heads, " / ".join(names)

    def remove(self) -> None:
        """Take the hooks off the modules and drop what they recorded."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self.clear()

    def __deepcopy__(self, memo: dict) -> LayerGramian:
        # A deep copy of the net (an EMA copy, a user's snapshot) copies its hooks, and with them this recorder: the
        # copy's recorder records nothing (its modules are not these), and nothing of a step's graph is copied.
        inert = LayerGramian.__new__(LayerGramian)
        inert.layers, inert.cuts, inert._said, inert.steps, inert.handles = [], {}, True, 0, []
        inert.held, inert.switched, inert.by_gradients, inert._names, inert._module_names = 0, 0, 0, {}, {}
        inert.keep_outputs, inert.outputs = False, {}
        return inert

    def gramian(self, losses: torch.Tensor, shared: Sequence[nn.Parameter]) -> torch.Tensor | None:
        """The K × K Gramian of the gradients of ``losses`` (a vector, graph on, kept) on ``shared``, in float32 or
        wider. None where the rule should take the K gradients instead: where they are what the cheapest way holds
        anyway (nothing to carry: the shared parameters' K gradients outweigh no boundary's), or (said once) where the
        vectorised backward cannot run."""
        chosen = {id(p) for p in shared}
        cuts = [c for c in self.cuts.values() if c.edge.output_nr >= 0]
        self.clear()
        graph = _CutGraph(losses, cuts)
        calls = Counter(id(module) for cut in cuts for module, _, _ in cut.calls)
        k = len(losses)
        boundaries = graph.boundaries()
        plan = []
        for top, bottom in zip([None, *boundaries], [*boundaries, None]):
            segment = [p for p in graph.segment_parameters(top, bottom) if id(p) in chosen]
            by_rows = _rows_layers(cuts[top], chosen, graph.only_from(top, bottom), calls) if top is not None else []
            rows = {id(p) for module, _, _ in by_rows for p in _own(module)}
            plan.append(_Segment(top, bottom, segment, by_rows, [p for p in segment if id(p) not in rows]))
        switch, self.held = _cheapest_switch(plan, cuts, k)
        if not any(segment.parameters for segment in plan[:switch]):
            # Nothing carried: the K gradients hold as much and save the rule's backward (a conv trunk on images).
            self.by_gradients += 1
            return None
        dtype = torch.promote_types(losses.dtype, torch.float32)
        gramian = torch.zeros(k, k, dtype=dtype, device=losses.device)
        delta: torch.Tensor | None = torch.eye(k, dtype=losses.dtype, device=losses.device)
        for segment in plan[:switch]:
            try:
                delta = self._carry(segment, losses, cuts, delta, gramian, chosen)
            except RuntimeError as error:
                self._say(cuts, segment.top, segment.bottom, segment.parameters, error)
                return None
            if delta is None:  # nothing of the losses reaches below here
                break
        if switch < len(plan) and delta is not None:
            below = [p for segment in plan[switch:] for p in segment.parameters]
            top = plan[switch].top
            gramian += _task_by_task(losses if top is None else cuts[top].edge, delta, below, dtype)
            self.switched += 1
        self.steps += 1
        return gramian

    def _carry(
        self,
        segment: _Segment,
        losses: torch.Tensor,
        cuts: list[_Cut],
        delta: torch.Tensor,
        gramian: torch.Tensor,
        chosen: set[int],
    ) -> torch.Tensor | None:
        """One segment, vectorised over the tasks: its parameters' K gradients (or a Linear's rows) added to
        ``gramian``, and the K gradients of its bottom boundary returned (None at the graph's end)."""
        k = len(delta)
        inputs = ([cuts[segment.bottom].edge] if segment.bottom is not None else []) + segment.wanted
        if segment.top is None:  # from the losses: each through its own head (vectorised, K × K heads' work)
            grads = each_task(losses, inputs)
        else:
            grads = (
                torch.autograd.grad(
                    cuts[segment.top].edge,
                    inputs,
                    grad_outputs=delta,
                    is_grads_batched=True,
                    retain_graph=True,
                    allow_unused=True,
                )
                if inputs
                else ()
            )
        for module, x, shape in segment.by_rows:
            gramian += _rows_gramian(module, x, delta.reshape(k, *shape), chosen, gramian.dtype)
        for g in grads[len(inputs) - len(segment.wanted) :]:
            if g is not None:
                flat = g.reshape(k, -1).to(gramian.dtype)
                gramian += flat @ flat.T
        return grads[0] if segment.bottom is not None else None

    def _say(
        self, cuts: list[_Cut], top: int | None, bottom: int | None, params: list[nn.Parameter], error: Exception
    ) -> None:
        if self._said:
            return

        def where(i: int | None, end: str) -> str:
            modules = (
                [self._module_names.get(id(m), type(m).__name__) for m, _, _ in cuts[i].calls] if i is not None else []
            )
            return f"the output of {' / '.join(modules) or 'a module'}" if modules else end

        names = [self._names.get(id(p), f"a parameter {tuple(p.shape)}") for p in params]
        shared = (
            f" (shared parameters there: {', '.join(names[:4])}{' ...' if len(names) > 4 else ''})" if names else ""
        )
        rank_zero_warn(
            f"model.balancer: the tasks' Gramian could not be taken segment by segment: the tasks' backward vectorised "
            f"from {where(top, 'the losses')} to {where(bottom, 'the inputs')}{shared} failed "
            f"({str(error).splitlines()[0][:200]}). The rule takes the tasks' K gradients instead (K backward passes, "
            "the K gradients held). An operation there has no batching rule for torch.vmap: a custom "
            "autograd.Function takes one with generate_vmap_rule=True or a vmap staticmethod; or let the rule work "
            "on the layers below it (model.balancer.shared=[<module names of model.net>]); "
            "model.balancer.gramian=gradients takes the K gradients without this warning"
        )
        self._said = True


class _CutGraph:
    """The step's graph as seen from its cuts: for the losses and each cut, which cuts and parameters it reaches
    before any other cut (a walk of the autograd graph: nothing computed)."""

    def __init__(self, losses: torch.Tensor, cuts: list[_Cut]) -> None:
        self.index = {id(c.edge.node): i for i, c in enumerate(cuts)}
        self.params: dict[int, nn.Parameter] = {}
        self.reach: list[set[int]] = []  # cuts reached first, for the losses (at -1 … stored last) and each cut
        self.own: list[set[int]] = []
        for cut in cuts:
            self._walk([next_node for next_node, _ in cut.edge.node.next_functions])
        self._walk([losses.grad_fn])  # the losses' own, last: index -1

    def _walk(self, starts: list) -> None:
        leaves, stopped = walk(starts, self.index)
        self.params.update((id(v), v) for v in leaves)
        self.reach.append({self.index[id(node)] for node in stopped})
        self.own.append({id(v) for v in leaves})

    def _closure(self, start: int, avoid: int | None = None) -> set[int]:
        """The cuts reachable from ``start`` (a cut, or -1: the losses), itself included, not passing ``avoid``."""
        found, stack = {start}, [start]
        while stack:
            for j in self.reach[stack.pop()]:
                if j != avoid and j not in found:
                    found.add(j)
                    stack.append(j)
        return found

    def _parameters_of(self, cuts: set[int]) -> set[int]:
        return set().union(*(self.own[c] for c in cuts)) if cuts else set()

    def boundaries(self) -> list[int]:
        """The cuts the losses reach that every path from the losses to what lies before them passes (and no parameter
        is reached from both sides of), from the losses down: the segments' ends, each below the one before."""
        found, reached_cuts = [], self._closure(-1)
        for d in sorted(reached_cuts - {-1}, reverse=True):
            above = self._closure(-1, avoid=d)
            if any(c < d for c in above - {-1}):  # a path to an earlier cut around d
                continue
            if not (self._parameters_of(above) & self._parameters_of(self._closure(d))):
                found.append(d)
        return found

    def only_from(self, top: int, bottom: int | None) -> set[int]:
        """The parameters ``top`` reaches before any cut that no other cut of its segment reaches."""
        others = self._closure(top, avoid=bottom) - {top}
        return self.own[top] - self._parameters_of(others)

    def segment_parameters(self, top: int | None, bottom: int | None) -> list[nn.Parameter]:
        """The parameters reached from ``top`` (None: the losses) before ``bottom`` (None: to the graph's end)."""
        hit = self._parameters_of(self._closure(-1 if top is None else top, avoid=bottom))
        return [p for i, p in self.params.items() if i in hit]


def _own(module: nn.Module) -> list[nn.Parameter]:
    return list(module.parameters(recurse=False))


def _rows_layers(
    cut: _Cut, chosen: set[int], own: set[int], calls: Counter
) -> list[tuple[nn.Module, torch.Tensor, torch.Size]]:
    """The Linear layer that returned this boundary, called once in the step, its parameters reached from here
    only (``own``), its rows no more than its inputs: its Gramian from its inputs and its outputs' K gradients."""
    with_parameters = [call for call in cut.calls if _own(call[0])]
    if len(with_parameters) != 1:
        return []
    module, x, _ = with_parameters[0]
    if x is None or calls[id(module)] != 1 or not any(id(p) in chosen for p in _own(module)):
        return []
    if not all(id(p) in own for p in _own(module)) or x.numel() // x.shape[-1] > x.shape[-1]:
        return []
    return [with_parameters[0]]


def _rows_gramian(
    layer: nn.Module, x: torch.Tensor, delta: torch.Tensor, chosen: set[int], dtype: torch.dtype
) -> torch.Tensor:
    x = x.detach().reshape(-1, x.shape[-1]).to(dtype)  # N × d_in
    d = delta.reshape(delta.shape[0], -1, delta.shape[-1]).to(dtype)  # K × N × d_out
    k = d.shape[0]
    gramian = torch.zeros(k, k, dtype=dtype, device=d.device)
    if id(layer.weight) in chosen:
        mixed = torch.einsum("rs,ksd->krd", x @ x.T, d)
        gramian += torch.einsum("ird,jrd->ij", d, mixed)
    if layer.bias is not None and id(layer.bias) in chosen:
        bias = d.sum(dim=1)
        gramian += bias @ bias.T
    return gramian


def reached(losses: Sequence[torch.Tensor], params: Sequence[nn.Parameter]) -> list[set[int]]:
    """For each loss, the ids of the ``params`` its graph reaches (a walk of the autograd graph: nothing computed)."""
    wanted = {id(p) for p in params}
    return [{id(v) for v in walk([loss.grad_fn])[0]} & wanted for loss in losses]
