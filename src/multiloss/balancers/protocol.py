"""The balancer protocol: what a balancer is (`Balancer`, `GradientBalancer`), and one step of it (`balance`).

A step hands its task losses to `balance`, which runs the protocol in the order it must run — the
epoch the batch belongs to, the weights for the detached losses, the balancer's own term, a gradient
balancer's combined gradient — on the path the run's parallelism needs: a gradient rule on each rank's
whole gradients (one device, DDP, FSDP2 with the net held whole), or on the shards (FSDP2,
``scope=global``: `multiloss.balancers.sharded_rule`). It returns `Balanced`, which the recipe backwards
with `Balanced.backward` whatever the balancer's kind.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from multiloss.balancers.layer_gramian import LayerGramian, reached
from multiloss.balancers.sharded_rule import apply_sharded_rule
from multiloss.balancers.task_gradients import TaskGradients, gradient_surrogate, select_parameters, task_gradients
from multiloss.config import require

Reduce = Callable[[torch.Tensor], torch.Tensor]


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


REP_GRAD = (None, "batch", "samples")


class Balancer(nn.Module):
    """Maps a step's task losses to the weights of one backward, plus an optional term of its own — or, a gradient
    balancer (``combines_gradients``, most easily a `GradientBalancer`), combines the tasks' gradients itself.

    Write your own as a subclass in a module of your own and name it in ``model.balancer: {_target_: ...}`` from a
    ``--config-dir`` (docs/extending.md). The multi-task recipes run the hooks below in this order each step
    (`balance`): `start_epoch`, `weights`, `extra`, then for a gradient balancer `surrogate` (or `draw_surrogate`);
    after the optimizer step `after_step`; at a checkpoint `checkpoint_extra_state`.

    Constructor arguments the recipe injects (each given only where your ``__init__`` takes it and the config leaves
    it out; `multiloss.multitask.recipe.MultiTaskRecipe.passed_to_components`):

    - ``tasks``: the task names, in the order of the loss vector (``model.tasks``' keys);
    - ``base``: the configured weights cᵢ, one per task (``model.head_weights``, or 1);
    - ``net``: the recipe's network (``model.net`` built), for a rule that hooks its layers or resolves names.

    Every other argument comes from the config node. A ``require(...)`` in ``__init__`` names a bad value as
    ``model.balancer.<argument>`` before any step or write. State: parameters and buffers are checkpointed as any
    module's; state that is not a tensor goes through ``get_extra_state``/``set_extra_state``.
    """

    # --- declared flags: each changes what the recipe does around the hooks ---------------------------------------
    adaptive = True  # its weights change: the recipe logs them as weight/<task>
    combines_gradients = False  # True: the recipe backwards its `surrogate` instead of the weighted losses
    shared: list[str] | None = None  # the names of the layers its rule works on (None: found)
    after_step_update = False  # True: it learns from the step's losses recomputed after the step (`after_step`)
    batches_per_step = 1  # > 1: its rule sees that many independent draws of each batch (`draw_surrogate`)
    weights_set_by_rule = False  # True: its gradient rule updates the weights it reports (MoCo's λ): read after it
    rep_grad: str | None = None  # a gradient rule on the representation's gradients (`GradientBalancer`), not weights'

    def release(self) -> None:
        """Let go of the net (hooks a rule put on it): a balancer built only to check a checkpoint's state."""

    def __init__(self, tasks: Sequence[str], base: Sequence[float]) -> None:
        super().__init__()
        self.tasks = tuple(tasks)
        # Not persistent: the configured weights come from the config, not from the checkpoint.
        self._base_values = [float(b) for b in base]
        self.register_buffer("base", torch.tensor(self._base_values), persistent=False)
        self.over_ranks: Reduce = _same  # the mean over the ranks, handed over by `start_epoch` (one device: itself)

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> Balancer:
        # Cast to float64 (a 64-true run), the configured weights are made again from the config's numbers: a float32
        # buffer widened would keep float32's rounding of 0.7.
        module = super()._apply(fn, *args, **kwargs)
        if self.base.dtype == torch.float64:
            self.base = torch.tensor(self._base_values, dtype=torch.float64, device=self.base.device)
        return module

    def weights(self, losses: torch.Tensor) -> torch.Tensor:
        """This step's weights (one per task) for the detached task losses ``losses``."""
        raise NotImplementedError

    def extra(self, losses: torch.Tensor) -> torch.Tensor | None:
        """A scalar added to the backward to train the balancer's own parameters (None: nothing)."""
        return None

    def surrogate(
        self,
        losses: Sequence[torch.Tensor],
        params: Sequence[nn.Parameter],
        shared: Sequence[nn.Parameter] | None = None,
    ) -> torch.Tensor:
        """A scalar whose gradient on ``params`` is this step's combined gradient (``combines_gradients`` balancers).

        ``losses``: each task's own loss tensor (not slices of one stacked vector: a slice's graph
        reaches every task). ``shared``: the parameters ``shared`` names, as the net holds them now (None:
        found). The recipe backwards the result as its one loss.
        """
        raise NotImplementedError

    def draw_surrogate(
        self,
        draws: Sequence[Sequence[torch.Tensor]],
        params: Sequence[nn.Parameter],
        shared: Sequence[nn.Parameter] | None = None,
    ) -> torch.Tensor:
        """`surrogate` of a rule that sees ``batches_per_step`` > 1 independent draws of the batch (SDMGrad, MoDo):
        ``draws`` holds each draw's K task losses (the batch split in that many equal parts). Called instead of
        `surrogate` every step; required where ``batches_per_step`` > 1."""
        raise NotImplementedError(f"{type(self).__qualname__} sets batches_per_step > 1 and defines no draw_surrogate")

    @classmethod
    def check_sharded_rule(cls, spec: Mapping[str, Any]) -> None:
        """Refuse (`multiloss.config.require`), before the run starts, a config of this balancer that the rule on the
        shards (``scope=global`` under FSDP2: `multiloss.balancers.sharded_rule`) cannot run. Called with the
        balancer's config node for a gradient balancer at ``scope=global`` under FSDP2; default: accepts."""

    def after_step(self, losses: torch.Tensor) -> None:
        """Called after an optimizer step (on every rank) with the step's last micro-batch's task losses recomputed by
        the stepped net (``after_step_update`` balancers: FAMO)."""

    def start_epoch(self, epoch: int, reduce: Reduce) -> None:
        """Called before each training batch with the epoch it belongs to; ``reduce`` averages over the ranks.

        At a batch, not at an epoch's end: a checkpoint taken at an epoch's end is saved before the
        module's epoch-end hook runs, and a run resumed from it never calls that hook. Default: keeps ``reduce`` as
        ``self.over_ranks``, so that `weights` can take the global batch's losses (``self.over_ranks(losses)``: one
        all-reduce of K numbers) and be the same on every rank and every shape.
        """
        self.over_ranks = reduce

    def checkpoint_extra_state(self, reduce: Reduce) -> dict[str, torch.Tensor] | None:
        """The extra state a checkpoint should hold instead of this rank's own (None: this rank's).

        Called on every rank while a checkpoint is saved (a collective is allowed); the file holds
        rank zero's copy, which every rank loads on resume.
        """
        return None


PER_RANK = "per_rank"  # a checkpoint's extra state holding every rank's own (`GradientBalancer.checkpoint_extra_state`)


PACKED = "packed"


def pack_state(state: Any) -> dict[str, bytes]:
    """A state whose structure changes as it runs (None until a first step, a K × n average after) as one bytes entry
    (``torch.save``): FSDP2's sharded checkpoint loads each entry into the structure the fresh module's own state
    has, which a None-then-tensor entry breaks; bytes stay bytes. Loads with ``weights_only=True`` as before."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return {PACKED: buffer.getvalue()}


def unpack_state(packed: dict[str, bytes]) -> Any:
    return torch.load(io.BytesIO(packed[PACKED]), map_location="cpu", weights_only=True)


def own_rank_state(state: Any) -> Any:
    """This rank's state from a checkpoint that holds every rank's (rank zero's where the run has more ranks than the
    checkpoint had), or ``state`` itself."""
    if not (isinstance(state, dict) and PER_RANK in state):
        return state
    states = state[PER_RANK]
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return states[rank] if rank < len(states) else states[0]


def save_balancer_state(balancer: Balancer, checkpoint: dict, reduce: Reduce, prefix: str = "balancer.") -> None:
    """Put ``balancer.checkpoint_extra_state`` into ``checkpoint`` (a recipe's ``on_save_checkpoint``, every rank)."""
    state = balancer.checkpoint_extra_state(reduce)
    if state is not None:
        checkpoint["state_dict"][f"{prefix}_extra_state"] = state


@dataclass
class Balanced:
    """One step's task losses, weighed by a balancer: what a recipe backwards (`backward`) and what it logs."""

    losses: torch.Tensor  # the task losses, stacked (graph on)
    weights: torch.Tensor  # this step's weights, one per task (no graph)
    extra: torch.Tensor | None  # the balancer's own term, backwarded with weight 1 (graph on), or None
    surrogate: torch.Tensor | None  # a gradient balancer's scalar to backward instead of the weighted losses
    total: torch.Tensor  # Σ wᵢ·Lᵢ (+ the balancer's term): the step's total, graph on (detach it to log it)
    backwarded: bool = False  # the step's gradient is in .grad already (the sharded rule): nothing left to backward

    def backward(self, step: Any, as_sum: bool = False) -> None:
        """This step's gradient, through ``step`` (`multiloss.base.step.OptimizerStep`: its division by k, its sync),
        whatever the balancer: a gradient balancer's surrogate; else the task losses seeded with the weights in one
        pass (``grad_tensors``; the balancer's own term with weight 1) — or, ``as_sum``, the backward of the scalar
        total Σ wᵢ·Lᵢ; nothing when the sharded rule has written the gradient already."""
        if self.backwarded:
            return
        if self.surrogate is not None:
            step.backward(self.surrogate)
        elif as_sum:
            step.backward(self.total)
        elif self.extra is None:
            step.backward(self.losses, gradient=self.weights)
        else:
            seeded = torch.cat([self.losses, self.extra.view(1)])
            weights = torch.cat([self.weights, self.weights.new_ones(1)])
            step.backward(seeded, gradient=weights)


@dataclass
class GramianRule:
    """A gradient balancer's step as coefficients of the tasks' gradients gᵢ (of cᵢ·Lᵢ), from their Gramian: the shared
    parameters get Σᵢ ``shared[i]``·gᵢ, every other parameter Σᵢ ``own[i]``·gᵢ; ``extra``: a term whose backward
    trains the balancer's own parameters (GradNorm's weights), or None."""

    shared: torch.Tensor
    own: torch.Tensor
    extra: torch.Tensor | None = None


def shared_parameters(balancer: Balancer, net: nn.Module) -> list[nn.Parameter] | None:
    """The parameters of ``net`` that ``balancer``'s ``shared`` key names, as the net holds them now (sharded, or whole
    during a step under FSDP2), or None (found: those more than one task reaches)."""
    return None if balancer.shared is None else select_parameters(net, balancer.shared)


def _balance_draws(
    balancer: Balancer, draws: list[Mapping[str, torch.Tensor]], net: nn.Module, shared: list | None
) -> Balanced:
    """`balance` of a rule on several draws: their losses' mean is what is logged, the rule's surrogate what is
    backwarded (each rank's own draws; under FSDP2 the net held whole for the step, as any ``scope=rank`` rule)."""
    stacked = torch.stack([torch.stack(list(d.values())) for d in draws]).mean(0)
    weights = balancer.weights(stacked.detach())
    balanced = Balanced(stacked, weights, None, None, (weights.to(stacked.dtype) * stacked).sum())
    balanced.surrogate = balancer.draw_surrogate([list(d.values()) for d in draws], list(net.parameters()), shared)
    return balanced


def balance(
    balancer: Balancer,
    losses: Mapping[str, torch.Tensor] | Sequence[Mapping[str, torch.Tensor]],
    net: nn.Module,
    parallelism: Any,
    epoch: int,
    mean_over_ranks: Reduce,
    sum_over_ranks: Reduce,
    backward: Callable[..., None],
) -> Balanced:
    """The balancer protocol of one training step, in the order it must run: the epoch it belongs to, the weights
    for the detached losses, the balancer's own term, and a gradient balancer's combined gradient of ``net`` —
    as a surrogate loss on each rank's whole gradients, or (FSDP2 with ``scope=global``: the net not held whole)
    written into the shards' ``.grad`` by `multiloss.balancers.sharded_rule` through ``backward`` (the recipe's
    ``manual_backward``)."""
    balancer.start_epoch(epoch, mean_over_ranks)
    if not isinstance(losses, Mapping):  # several independent draws of the batch (SDMGrad, MoDo): the rule sees each
        return _balance_draws(balancer, list(losses), net, shared_parameters(balancer, net))
    stacked = torch.stack(list(losses.values()))
    weights = balancer.weights(stacked.detach())
    extra = balancer.extra(stacked)
    total = (weights.to(stacked.dtype) * stacked).sum()
    balanced = Balanced(stacked, weights, extra, None, total if extra is None else total + extra)
    if not balancer.combines_gradients:
        return balanced
    shared = shared_parameters(balancer, net)
    on_representation = balancer.rep_grad is not None  # no parameter's gradient: shards as they are
    if parallelism.sharded and "net" not in parallelism.held and not on_representation:  # the rule on the shards
        apply_sharded_rule(net, balancer, list(losses.values()), backward, sum_over_ranks, shared)
        balanced.backwarded = True
    else:  # read after the forward: under FSDP2 the net then holds its whole weights
        balanced.surrogate = balancer.surrogate(list(losses.values()), list(net.parameters()), shared)
    if balancer.weights_set_by_rule:  # MoCo's λ: this step's, as its rule just updated it (not the step before's)
        balanced.weights = balancer.weights(stacked.detach())
        balanced.total = (balanced.weights.to(stacked.dtype) * stacked).sum() + (0 if extra is None else extra)
    return balanced


class GradientBalancer(Balancer):
    """A balancer that combines the tasks' gradients itself: one gradient per task, then its own combination.

    ``shared``: the shared parameters its rule works on, as names of ``model.net``'s modules or
    parameters (``[trunk.1]``: the shipped trunk's last layer, GradNorm's "last shared layer"); null
    finds them (those more than one task's loss reaches). Any other parameter gets each task's
    weighted gradient, summed. ``net``: the recipe's network, passed by the recipe to resolve the names.

    ``scope``: whose gradients the rule sees on several ranks. ``rank`` (default): each rank's own batch's, the
    results then averaged — DDP's way, and the papers' code on one device's batch. ``global``: each task's gradient
    of the whole global batch (averaged over the ranks first: one all-reduce of the task gradients a step), so the
    rule is the one a single device would apply to the global batch whatever the number of ranks; under FSDP2 the
    rule then runs on the shards (`multiloss.balancers.sharded_rule`: the net is not held whole). One device: the same.
    """

    adaptive = False
    combines_gradients = True

    def __init__(
        self,
        tasks: Sequence[str],
        base: Sequence[float],
        shared: Sequence[str] | None = None,
        net: nn.Module | None = None,
        scope: str = "rank",
        gramian: str = "layers",
        rep_grad: str | None = None,
    ) -> None:
        super().__init__(tasks, base)
        require(shared is None or net is not None, "shared", shared, "null, unless the recipe passes its net")
        require(
            rep_grad in REP_GRAD,
            "rep_grad",
            rep_grad,
            "null (the rule on the shared parameters' gradients), batch (on the representation's gradients summed over "
            "the batch: LibMTL's rep_grad) or samples (on every sample's representation gradient: MGDA-UB's code)",
        )
        require(
            rep_grad is None or shared is None,
            "shared",
            shared,
            "null with model.balancer.rep_grad (the rule works on the representation, where the tasks' paths meet)",
        )
        require(rep_grad is None or net is not None, "rep_grad", rep_grad, "null, unless the recipe passes its net")
        require(
            gramian in ("layers", "gradients"),
            "gramian",
            gramian,
            "layers (the tasks' Gramian segment by segment, the K gradients of one layer or block held at a time) "
            "or gradients (the K task gradients)",
        )
        require(
            scope in ("rank", "global"),
            "scope",
            scope,
            "rank (each rank's own gradients, then averaged: DDP's way) or global (the global batch's gradients)",
        )
        self.scope = scope
        # Names, judged now: the net's parameter objects change when FSDP2 shards it (and gathers it for a step).
        self.shared = None if shared is None else list(shared)
        self._shared_built = None if shared is None else select_parameters(net, shared)
        self._mean_over_ranks: Reduce | None = None
        self.rep_grad = rep_grad
        if rep_grad is not None:
            self.check_rep_grad(rep_grad, scope)
        # The Gramian segment by segment (`layer_gramian`): for a rule that needs only the Gramian, each rank's own;
        # the representation's gradients (rep_grad) are read from the same records.
        uses_layers = gramian == "layers" and net is not None and scope == "rank" and self.rule_is_gramian()
        self._layers = LayerGramian(net, keep_outputs=True) if rep_grad else LayerGramian(net) if uses_layers else None

    def release(self) -> None:
        if self._layers is not None:
            self._layers.remove()

    state_per_rank = False  # True: with scope rank, each rank's state is its own (the stateful rules' averages)

    def checkpoint_extra_state(self, reduce: Reduce) -> dict[str, bytes] | None:
        """Every rank's own state (``state_per_rank`` rules at ``scope=rank`` on several ranks: one all-gather at a
        save), so that each rank resumes with its own — exact where rank zero's alone would not be."""
        if not (self.state_per_rank and self.scope == "rank" and dist.is_available() and dist.is_initialized()):
            return None
        if dist.get_world_size() == 1:
            return None
        states: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(states, unpack_state(self.get_extra_state()))
        return pack_state({PER_RANK: states})

    def rule_is_gramian(self) -> bool:
        """Whether this balancer's rule needs only the tasks' Gramian (it defines `gramian_rule`)."""
        return type(self).gramian_rule is not GradientBalancer.gramian_rule

    def start_epoch(self, epoch: int, reduce: Reduce) -> None:
        self._mean_over_ranks = reduce

    def surrogate(
        self,
        losses: Sequence[torch.Tensor],
        params: Sequence[nn.Parameter],
        shared: Sequence[nn.Parameter] | None = None,
    ) -> torch.Tensor:
        """Each task's gradient of cᵢ·Lᵢ (the configured weight), combined by `combine` into a surrogate loss.

        Outside autocast: the step's forward runs under mixed precision, but the rule's own arithmetic
        (projections, norms, a QP's Gramian) is done in the gradients' precision, as a backward would.
        """
        weighted = self.rule_losses(losses)
        shared = shared if shared is not None else self._shared_built
        with torch.autocast(weighted[0].device.type, enabled=False):
            if self.rep_grad is not None:
                return self._surrogate_from_representation(weighted, losses)
            if self._layers is not None:
                surrogate = self._surrogate_from_gramian(
                    weighted, losses, [p for p in params if p.requires_grad], shared
                )
                if surrogate is not None:
                    return surrogate
            grads = task_gradients(weighted, params, shared)
            if self.scope == "global" and self._mean_over_ranks is not None:
                grads = grads.averaged(self._mean_over_ranks)  # the global batch's: every rank then agrees
            return self.combine(grads, losses)

    def _surrogate_from_gramian(
        self,
        weighted: list[torch.Tensor],
        losses: Sequence[torch.Tensor],
        params: list[nn.Parameter],
        shared: Sequence[nn.Parameter] | None,
    ) -> torch.Tensor | None:
        """The rule from the Gramian segment by segment (`layer_gramian`), as the loss Σᵢ αᵢ·cᵢLᵢ whose one backward is
        the step's gradient — each task's own parameters corrected to their coefficient βᵢ; None where the vectorised
        backward cannot run over the shared parameters (the rule then takes the K gradients)."""
        layers = self._layers
        assert layers is not None
        reach = reached(weighted, params)
        if shared is None:
            shared = [p for p in params if sum(id(p) in r for r in reach) > 1]
        stacked = torch.stack(weighted)
        gramian = layers.gramian(stacked, shared)
        if gramian is None:
            return None
        rule = self.gramian_rule(gramian, losses)
        alpha, beta = rule.shared.to(stacked.dtype).detach(), rule.own.to(stacked.dtype).detach()
        total = (alpha * stacked).sum()
        chosen = {id(p) for p in shared}
        own = [p for p in params if id(p) not in chosen and any(id(p) in r for r in reach)]
        if own and not torch.equal(alpha, beta):
            eye = torch.eye(len(stacked), dtype=stacked.dtype, device=stacked.device)
            grads = torch.autograd.grad(
                stacked, own, grad_outputs=eye, is_grads_batched=True, retain_graph=True, allow_unused=True
            )
            change = beta - alpha
            for p, g in zip(own, grads):
                if g is not None:  # a head: its task's gradient times βᵢ - αᵢ, added to the αᵢ the backward gives
                    total = total + (p * (change.view(-1, *[1] * p.dim()) * g).sum(0).detach()).sum()
        return total if rule.extra is None else total + rule.extra

    def _surrogate_from_representation(
        self, weighted: list[torch.Tensor], losses: Sequence[torch.Tensor]
    ) -> torch.Tensor:
        """``rep_grad``: the rule on the tasks' gradients of the representation Z (LibMTL's ``rep_grad``, MGDA-UB),
        as a loss whose backward gives each head its own coefficient's gradient βᵢ·∇Lᵢ and the shared layers below Z
        the rule's combination D of the K gradients of Z (Σαᵢ·∇_Z Lᵢ, or GradDrop's masked sum), pulled back through
        Z: ⟨Z, D⟩ + Σ ⟨headᵢ, βᵢ·∇_headᵢ Lᵢ⟩ with the brackets' right sides held constant. One backward per task
        through its own head (Z's and the head's gradients at once), then one through the layers below Z."""
        layers = self._layers
        assert layers is not None
        rep, per_task, heads, _ = layers.representation(weighted)
        k = len(weighted)
        if self.rep_grad == "batch":  # LibMTL's: summed over the batch (abstract_weighting.py 90)
            matrix = per_task.reshape(k, per_task.shape[1], -1).sum(1) if per_task.dim() > 2 else per_task
            if self.scope == "global" and self._mean_over_ranks is not None:
                matrix = self._mean_over_ranks(matrix)  # the global batch's sum (each rank's loss a mean of its own)
            gramian = None
        else:  # every sample's gradient, flattened (MGDA-UB): the ranks' samples are other coordinates
            matrix = per_task.reshape(k, -1)
            wide = matrix.double() if matrix.dtype == torch.float64 else matrix.float()
            gramian = wide @ wide.T
            if self.scope == "global" and self._mean_over_ranks is not None:
                ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
                gramian = self._mean_over_ranks(gramian) / ranks
        combination, own, extra = self.representation_rule(matrix, gramian, per_task, rep, losses)
        own = own.detach()
        flat = per_task.reshape(k, -1)
        # Coefficients αᵢ of the K gradients of Z (one pass over them), or the combined gradient D itself (GradDrop's).
        direction = (combination.to(flat.dtype) @ flat).view_as(rep) if combination.dim() == 1 else combination
        if heads is None:  # FSDP2 sharded: Σβᵢ·Lᵢ through the heads again, Z's part corrected to the direction
            stacked = torch.stack(weighted)
            kept = (own.to(flat.dtype) @ flat).view_as(rep)
            total = (own.to(stacked.dtype) * stacked).sum() + (rep * (direction - kept).to(rep.dtype).detach()).sum()
        else:  # each head its own task's gradient × βᵢ (taken with Z's: the heads run once), Z's pulled back below
            total = (rep * direction.to(rep.dtype).detach()).sum()
            for p, g, task in heads:
                total = total + (p * (own[task].to(g.dtype) * g).detach()).sum()
        return total if extra is None else total + extra

    def check_rep_grad(self, rep_grad: str, scope: str) -> None:
        """Refuse, at construction, a ``rep_grad`` this rule cannot run (a rule on the Gramian runs on either)."""
        require(
            self.rule_is_gramian(),
            "rep_grad",
            rep_grad,
            "null for this method (it needs each shared parameter's gradient)",
        )

    def representation_rule(
        self,
        matrix: torch.Tensor,
        gramian: torch.Tensor | None,
        per_task: torch.Tensor,
        rep: torch.Tensor,
        losses: Sequence[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The rule on the representation's gradients: (its coefficients α of the K gradients of Z — or, a tensor
        shaped as Z, the combined gradient D itself —, the heads' coefficients β, the balancer's own term). A Gramian
        rule's coefficients α on ``matrix``'s Gramian (``gramian`` where given: the samples')."""
        if gramian is None:
            wide = matrix.double() if matrix.dtype == torch.float64 else matrix.float()
            gramian = wide @ wide.T
        rule = self.gramian_rule(gramian, losses)
        return rule.shared, rule.own, rule.extra

    def rule_losses(self, losses: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The losses whose gradients the rule combines: cᵢ·Lᵢ (IMTL: its learned scales too)."""
        return [c.to(loss.dtype) * loss for c, loss in zip(self.base, losses)]

    def combine(self, grads: TaskGradients, losses: Sequence[torch.Tensor]) -> torch.Tensor:
        """The surrogate loss (`task_gradients.gradient_surrogate`) of this step's tasks' gradients, called each step
        where the rule takes the K gradients themselves (``gramian=gradients``, ``scope=global`` on whole gradients,
        or a rule that needs more than their Gramian). Default: `gramian_rule` on the K gradients' Gramian — so a
        rule that needs only the Gramian defines `gramian_rule` alone."""
        if not self.rule_is_gramian():
            raise NotImplementedError(f"{type(self).__qualname__} defines neither combine nor gramian_rule")
        wide = grads.vectors.double() if grads.vectors.dtype == torch.float64 else grads.vectors.float()
        rule = self.gramian_rule(wide @ wide.T, losses)
        vector = rule.shared.to(grads.vectors.dtype).detach() @ grads.vectors
        own = rule.own.detach()
        scaled = [(p, g * own[task].to(g.dtype), task) for p, g, task in grads.own]
        surrogate = gradient_surrogate(TaskGradients(grads.shared, vector, scaled), vector)
        return surrogate if rule.extra is None else surrogate + rule.extra

    def gramian_rule(self, gramian: torch.Tensor, losses: Sequence[torch.Tensor]) -> GramianRule:
        """This step's rule from the tasks' Gramian on the shared parameters (gᵢ·gⱼ): what `combine` does, as
        coefficients of the tasks' gradients (the sharded rule: the gradients themselves are spread over the ranks)."""
        raise NotImplementedError
