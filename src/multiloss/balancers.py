"""Loss balancers: the per-task weights of a multi-task recipe's one backward, fixed or adapted.

A balancer (config group ``balancer``, ``model.balancer``) turns a step's task losses into the
weights that seed the recipe's single backward (``grad_tensors``), and may add a term of its own
whose gradient trains its own parameters. It is an ``nn.Module`` of the recipe: its parameters are
in the recipe's optimizer, its state in the checkpoint, so a resumed run continues exactly.

- `Fixed` (default): the configured task weights, as before balancers existed (bit-identical).
- `Uncertainty`: Kendall, Gal & Cipolla 2018, homoscedastic uncertainty: the loss is
  Σ cᵢ·(exp(-sᵢ)·Lᵢ + sᵢ), sᵢ = log σᵢ² learned with the network's optimizer.
- `DynamicWeightAverage`: Liu, Johns & Davison 2019: wᵢ = K·exp(rᵢ/T) / Σⱼ exp(rⱼ/T), rᵢ the ratio of
  task i's mean training loss over the last two epochs; 1 for the first two epochs.
- `PCGrad`: Yu et al. 2020, gradient surgery: each task's gradient on the shared parameters loses
  its component along any other task's gradient it conflicts with (negative dot product); the
  projected gradients are summed. Costs one backward per task (`multiloss.task_gradients`).
- `JacobianDescent`: any aggregator of torchjd (UPGrad, MGDA, ...) applied to the tasks' Jacobian on
  the shared parameters: a dependency (the ``torchjd`` extra), not a copy.

The configured weights cᵢ (``model.tasks.<task>.weight``) multiply every balancer's weights, so a
weight of 0 keeps a task off whatever the balancer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from multiloss.config import require
from multiloss.task_gradients import TaskGradients, gradient_surrogate, select_parameters, task_gradients

Reduce = Callable[[torch.Tensor], torch.Tensor]


class Balancer(nn.Module):
    """Maps a step's task losses to the weights of one backward, plus an optional term of its own.

    ``tasks``: the task names, in the order of the loss vector; ``base``: the configured weights cᵢ.
    """

    adaptive = True  # its weights change: the recipe logs them as weight/<task>
    combines_gradients = False  # True: the recipe backwards its `surrogate` instead of the weighted losses
    shared: list[str] | None = None  # the names of the layers its rule works on (None: found)

    def __init__(self, tasks: Sequence[str], base: Sequence[float]) -> None:
        super().__init__()
        self.tasks = tuple(tasks)
        # Not persistent: the configured weights come from the config, not from the checkpoint.
        self.register_buffer("base", torch.tensor([float(b) for b in base]), persistent=False)

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

    def start_epoch(self, epoch: int, reduce: Reduce) -> None:
        """Called before each training batch with the epoch it belongs to; ``reduce`` averages over the ranks.

        At a batch, not at an epoch's end: a checkpoint taken at an epoch's end is saved before the
        module's epoch-end hook runs, and a run resumed from it never calls that hook.
        """

    def checkpoint_extra_state(self, reduce: Reduce) -> dict[str, torch.Tensor] | None:
        """The extra state a checkpoint should hold instead of this rank's own (None: this rank's).

        Called on every rank while a checkpoint is saved (a collective is allowed); the file holds
        rank zero's copy, which every rank loads on resume.
        """
        return None


def save_balancer_state(balancer: Balancer, checkpoint: dict, reduce: Reduce, prefix: str = "balancer.") -> None:
    """Put ``balancer.checkpoint_extra_state`` into ``checkpoint`` (a recipe's ``on_save_checkpoint``, every rank)."""
    state = balancer.checkpoint_extra_state(reduce)
    if state is not None:
        checkpoint["state_dict"][f"{prefix}_extra_state"] = state


@dataclass
class Balanced:
    """One step's task losses, weighed by a balancer: what a recipe backwards and what it logs."""

    losses: torch.Tensor  # the task losses, stacked (graph on)
    weights: torch.Tensor  # this step's weights, one per task (no graph)
    extra: torch.Tensor | None  # the balancer's own term, backwarded with weight 1 (graph on), or None
    surrogate: torch.Tensor | None  # a gradient balancer's scalar to backward instead of the weighted losses
    total: torch.Tensor  # Σ wᵢ·Lᵢ (+ the balancer's term): the step's total, graph on (detach it to log it)
    backwarded: bool = False  # the step's gradient is in .grad already (the sharded rule): the recipe backwards nothing


@dataclass
class GramianRule:
    """A gradient balancer's step as coefficients of the tasks' gradients gᵢ (of cᵢ·Lᵢ), from their Gramian: the shared
    parameters get Σᵢ ``shared[i]``·gᵢ, every other parameter Σᵢ ``own[i]``·gᵢ; ``extra``: a term whose backward
    trains the balancer's own parameters (GradNorm's weights), or None."""

    shared: torch.Tensor
    own: torch.Tensor
    extra: torch.Tensor | None = None


def balance(
    balancer: Balancer,
    losses: Mapping[str, torch.Tensor],
    params: Sequence[nn.Parameter],
    epoch: int,
    reduce: Reduce,
    shared: Sequence[nn.Parameter] | None = None,
    with_surrogate: bool = True,
) -> Balanced:
    """The balancer protocol of one training step, in the order it must run: the epoch it belongs to, the weights
    for the detached losses, the balancer's own term, and a gradient balancer's surrogate of ``params``' gradient
    (``shared``: the parameters its ``shared`` key names; ``with_surrogate=False``: the caller applies the rule
    itself, `multiloss.sharded_rule`)."""
    balancer.start_epoch(epoch, reduce)
    stacked = torch.stack(list(losses.values()))
    weights = balancer.weights(stacked.detach())
    extra = balancer.extra(stacked)
    combines = balancer.combines_gradients and with_surrogate
    surrogate = balancer.surrogate(list(losses.values()), params, shared) if combines else None
    total = (weights.to(stacked.dtype) * stacked).sum()
    return Balanced(stacked, weights, extra, surrogate, total if extra is None else total + extra)


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
    rule then runs on the shards (`multiloss.sharded_rule`: the net is not held whole). One device: the same.
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
    ) -> None:
        super().__init__(tasks, base)
        require(shared is None or net is not None, "shared", shared, "null, unless the recipe passes its net")
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
        weighted = [c.to(loss.dtype) * loss for c, loss in zip(self.base, losses)]
        with torch.autocast(weighted[0].device.type, enabled=False):
            grads = task_gradients(weighted, params, shared if shared is not None else self._shared_built)
            if self.scope == "global" and self._mean_over_ranks is not None:
                grads = grads.averaged(self._mean_over_ranks)  # the global batch's: every rank then agrees
            return self.combine(grads, losses)

    def combine(self, grads: TaskGradients, losses: Sequence[torch.Tensor]) -> torch.Tensor:
        """The surrogate loss (`multiloss.task_gradients.gradient_surrogate`) of this step's tasks' gradients."""
        raise NotImplementedError

    def gramian_rule(self, gramian: torch.Tensor, losses: Sequence[torch.Tensor]) -> GramianRule:
        """This step's rule from the tasks' Gramian on the shared parameters (gᵢ·gⱼ): what `combine` does, as
        coefficients of the tasks' gradients (the sharded rule: the gradients themselves are spread over the ranks)."""
        raise NotImplementedError


class Fixed(Balancer):
    """The configured task weights, unchanged: the recipe as it was before balancers."""

    adaptive = False

    def weights(self, losses: torch.Tensor) -> torch.Tensor:
        return self.base


class Uncertainty(Balancer):
    """Kendall, Gal & Cipolla 2018: Σ cᵢ·(exp(-sᵢ)·Lᵢ + sᵢ), with sᵢ = log σᵢ² learned.

    The network's gradient is Σ cᵢ·exp(-sᵢ)·∇Lᵢ (the weights seed the backward); sᵢ's is
    cᵢ·(1 - exp(-sᵢ)·Lᵢ), from `extra`, so sᵢ settles where exp(sᵢ) = Lᵢ: a task with a large loss
    (a noisy one) gets a small weight. ``init_log_variance``: sᵢ at the start (a number, or one per task).
    """

    def __init__(
        self, tasks: Sequence[str], base: Sequence[float], init_log_variance: float | list[float] = 0.0
    ) -> None:
        super().__init__(tasks, base)
        init = (
            [float(init_log_variance)] * len(self.tasks)
            if isinstance(init_log_variance, int | float)
            else [float(v) for v in init_log_variance]
        )
        require(
            len(init) == len(self.tasks) and all(math.isfinite(v) for v in init),
            "init_log_variance",
            init_log_variance,
            f"a finite number, or one per task ({len(self.tasks)}: {list(self.tasks)})",
        )
        self.log_variance = nn.Parameter(torch.tensor(init))

    def weights(self, losses: torch.Tensor) -> torch.Tensor:
        return self.base * torch.exp(-self.log_variance.detach())

    def extra(self, losses: torch.Tensor) -> torch.Tensor:
        s = self.log_variance
        return (self.base * (torch.exp(-s) * losses.detach().to(s.dtype) + s)).sum()


class DynamicWeightAverage(Balancer):
    """Liu, Johns & Davison 2019 (DWA): weights from how fast each task's training loss falls.

    wᵢ(t) = K·exp(rᵢ/T) / Σⱼ exp(rⱼ/T), rᵢ = L̄ᵢ(t-1) / L̄ᵢ(t-2), where L̄ᵢ(e) is task i's mean training
    loss over epoch e (every micro-batch, averaged over the ranks) and K the number of tasks; wᵢ = 1
    for the first two epochs. ``temperature`` T: larger is more even (the paper's 2).
    """

    def __init__(self, tasks: Sequence[str], base: Sequence[float], temperature: float = 2.0) -> None:
        super().__init__(tasks, base)
        require(0 < temperature < math.inf, "temperature", temperature, "a positive number (the paper's 2)")
        self.temperature = float(temperature)
        n = len(self.tasks)
        # All in the checkpoint: a run resumed mid-epoch continues the epoch's sums. The sums are this
        # rank's own, so not buffers: DDP broadcasts rank zero's buffers into every rank at each forward
        # (a checkpoint holds their mean over the ranks, `checkpoint_extra_state`).
        self.epoch_sum = torch.zeros(n)
        self.epoch_count = torch.zeros(())
        self.register_buffer("epoch_means", torch.full((2, n), math.nan))  # epochs t-2, t-1
        self.register_buffer("current", torch.ones(n))
        self.register_buffer("epoch", torch.tensor(-1))  # the epoch the sums are of (-1: none yet)
        self._host_epoch: int | None = None

    def weights(self, losses: torch.Tensor) -> torch.Tensor:
        if self.epoch_sum.device != losses.device:  # not buffers: they follow the losses
            self.epoch_sum, self.epoch_count = self.epoch_sum.to(losses.device), self.epoch_count.to(losses.device)
        self.epoch_sum += losses.detach().to(self.epoch_sum.dtype)  # on the device: no host sync
        self.epoch_count += 1
        return self.base * self.current

    def start_epoch(self, epoch: int, reduce: Reduce) -> None:
        if self._host_epoch is None:  # once, and after a checkpoint load: not a device read per batch
            self._host_epoch = int(self.epoch)
        if self._host_epoch == epoch:
            return
        if self._host_epoch >= 0 and bool(self.epoch_count > 0):
            # Sum over the ranks, then divide (equal counts): a resume from the ranks' mean sum gives the same bits.
            mean = reduce(self.epoch_sum) / self.epoch_count
            self.epoch_means.copy_(torch.stack([self.epoch_means[1], mean]))
            self.current.copy_(dwa_weights(self.epoch_means[0], self.epoch_means[1], self.temperature))
        self.epoch_sum.zero_()
        self.epoch_count.zero_()
        self.epoch.fill_(epoch)
        self._host_epoch = epoch

    def get_extra_state(self) -> dict[str, torch.Tensor]:
        return {"epoch_sum": self.epoch_sum.cpu(), "epoch_count": self.epoch_count.cpu()}

    def checkpoint_extra_state(self, reduce: Reduce) -> dict[str, torch.Tensor]:
        # The ranks' mean of the running sums: every rank resumes with it, and as the epoch's mean is
        # averaged over the ranks (equal counts), mean(partial) + each rank's rest gives the same mean
        # as each rank's own partial sum would have. Exact mid-epoch resume under DDP too.
        return {"epoch_sum": reduce(self.epoch_sum.clone()).cpu(), "epoch_count": self.epoch_count.cpu()}

    def set_extra_state(self, state: dict[str, torch.Tensor]) -> None:
        self.epoch_sum, self.epoch_count = state["epoch_sum"].clone(), state["epoch_count"].clone()

    def _load_from_state_dict(self, *args: object, **kwargs: object) -> None:
        super()._load_from_state_dict(*args, **kwargs)  # type: ignore[arg-type]
        self._host_epoch = None


def dwa_weights(before_last: torch.Tensor, last: torch.Tensor, temperature: float) -> torch.Tensor:
    """DWA's weights from two epochs' mean losses (ones while ``before_last`` is unknown, i.e. NaN)."""
    if bool(torch.isnan(before_last).any()):
        return torch.ones_like(last)
    return len(last) * torch.softmax((last / before_last) / temperature, dim=0)


class PCGrad(GradientBalancer):
    """Yu et al. 2020 (PCGrad): project each task's gradient off the tasks it conflicts with, then sum.

    For each task i, in a random order of the other tasks j (the paper's Algorithm 1; ``shuffle:
    false`` takes them in index order): if gᵢ·gⱼ < 0, gᵢ ← gᵢ - (gᵢ·gⱼ / ‖gⱼ‖²)·gⱼ, with gⱼ the
    original gradient of task j. Only the shared parameters are projected; a task's own head gets its
    own gradient. Tasks keep their configured weights (cᵢ·Lᵢ). The order's generator is in the
    checkpoint. Under DDP (and FSDP2, the net held whole for its step: `multiloss.sharding.LocalGradients`)
    each rank projects its own per-task gradients before they are averaged (as the paper's code does on
    one device); averaging the per-task gradients first would cost one all-reduce per task.
    """

    def __init__(
        self,
        tasks: Sequence[str],
        base: Sequence[float],
        shuffle: bool = True,
        seed: int = 0,
        shared: Sequence[str] | None = None,
        net: nn.Module | None = None,
        scope: str = "rank",
    ) -> None:
        super().__init__(tasks, base, shared, net, scope)
        self.shuffle = bool(shuffle)
        self.generator = torch.Generator().manual_seed(int(seed))

    def weights(self, losses: torch.Tensor) -> torch.Tensor:
        return self.base

    def combine(self, grads: TaskGradients, losses: Sequence[torch.Tensor]) -> torch.Tensor:
        return gradient_surrogate(grads, pcgrad(grads.vectors, self.orders(len(self.tasks))))

    def gramian_rule(self, gramian: torch.Tensor, losses: Sequence[torch.Tensor]) -> GramianRule:
        coefficients = pcgrad_coefficients(gramian, self.orders(len(self.tasks)))
        return GramianRule(coefficients, torch.ones_like(coefficients))

    def orders(self, n: int) -> list[list[int]]:
        """For each task, the other tasks in the order they are projected against."""
        if not self.shuffle:
            return [[j for j in range(n) if j != i] for i in range(n)]
        return [[j for j in torch.randperm(n, generator=self.generator).tolist() if j != i] for i in range(n)]

    def get_extra_state(self) -> dict[str, torch.Tensor]:
        return {"generator": self.generator.get_state()}

    def set_extra_state(self, state: dict[str, torch.Tensor]) -> None:
        self.generator.set_state(state["generator"])


def pcgrad_coefficients(gramian: torch.Tensor, orders: Sequence[Sequence[int]]) -> torch.Tensor:
    """Σᵢ PCGrad(gᵢ) as coefficients of the gᵢ, from their Gramian alone: `pcgrad`'s projections, each gᵢ kept as
    its coefficients a (gᵢ = Σₘ aₘ·gₘ, so gᵢ·gⱼ = (a·G)ⱼ)."""
    n = len(gramian)
    total = gramian.new_zeros(n)
    tiny = torch.finfo(gramian.dtype).tiny
    for i, order in enumerate(orders):
        a = gramian.new_zeros(n)
        a[i] = 1.0
        for j in order:
            a[j] = a[j] - torch.clamp(a @ gramian[:, j], max=0) / gramian[j, j].clamp_min(tiny)
        total = total + a
    return total


def pcgrad(vectors: torch.Tensor, orders: Sequence[Sequence[int]]) -> torch.Tensor:
    """Σᵢ PCGrad(gᵢ) for the rows gᵢ of ``vectors``, each projected against the rows ``orders[i]`` in turn.

    Without a host sync: a projection that does not apply (gᵢ·gⱼ ≥ 0) has coefficient 0.
    """
    total = torch.zeros_like(vectors[0])
    tiny = torch.finfo(vectors.dtype).tiny
    for i, order in enumerate(orders):
        g = vectors[i].clone()
        for j in order:
            other = vectors[j]
            g = g - (torch.clamp(g @ other, max=0) / (other @ other).clamp_min(tiny)) * other
        total = total + g
    return total


class JacobianDescent(GradientBalancer):
    """A torchjd aggregator (``torchjd.aggregation``: UPGrad, MGDA, ...) of the tasks' Jacobian on shared parameters.

    The Jacobian's rows are the tasks' gradients cᵢ·∇Lᵢ on the shared parameters (found, as for
    PCGrad); torchjd aggregates them into the update (UPGrad, Quinton & Rey 2024: each row projected
    onto the dual cone of all rows, so the update conflicts with no task; MGDA, Désidéri 2012: the
    minimum-norm point of their convex hull); each task's own head gets its own gradient. One
    backward per task. ``aggregator``: a torchjd aggregator (its config, ``_target_:
    torchjd.aggregation.UPGrad``). Needs the ``torchjd`` extra.
    """

    def __init__(
        self,
        tasks: Sequence[str],
        base: Sequence[float],
        aggregator: Callable[[torch.Tensor], torch.Tensor],
        shared: Sequence[str] | None = None,
        net: nn.Module | None = None,
        scope: str = "rank",
    ) -> None:
        super().__init__(tasks, base, shared, net, scope)
        require(callable(aggregator), "aggregator", aggregator, "a torchjd aggregator, e.g. torchjd.aggregation.UPGrad")
        self.aggregator = aggregator

    def weights(self, losses: torch.Tensor) -> torch.Tensor:
        return self.base

    def combine(self, grads: TaskGradients, losses: Sequence[torch.Tensor]) -> torch.Tensor:
        return gradient_surrogate(grads, self.aggregator(grads.vectors))

    def gramian_rule(self, gramian: torch.Tensor, losses: Sequence[torch.Tensor]) -> GramianRule:
        coefficients = _gramian_weighting(self.aggregator)(gramian)
        return GramianRule(coefficients, torch.ones_like(coefficients))

    @staticmethod
    def check_sharded_rule(spec: dict[str, Any]) -> None:
        """Refuse, before the run starts, an aggregator the sharded rule (``scope=global`` under FSDP2) cannot run."""
        from hydra.utils import instantiate

        _gramian_weighting(instantiate(spec["aggregator"]))


def _gramian_weighting(aggregator: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """torchjd's Gramian-weighted aggregators (UPGrad, MGDA, ...) are a weighting of the Gramian: J ↦ Jᵀ·w(JJᵀ)."""
    weighting = getattr(aggregator, "gramian_weighting", None)
    require(
        weighting is not None,
        "model.balancer.aggregator",
        type(aggregator).__name__,
        "an aggregator torchjd defines by a Gramian weighting (UPGrad, MGDA, ...) for scope=global under FSDP, "
        "or model.balancer.scope=rank",
        "the sharded rule sees the tasks' Gramian, not their gradients",
    )
    return weighting


class GradNorm(GradientBalancer):
    """Chen et al. 2018 (GradNorm): task weights trained so the tasks' gradient norms train at equal rates.

    Gᵢ = ‖∇_W wᵢ·Lᵢ‖ on the shared parameters W (found, as for PCGrad; the paper's last shared layer
    with ``shared: [<its name>]``), Ḡ their mean, rᵢ = (Lᵢ/Lᵢ(0)) / mean over tasks of the same. The weights wᵢ (in
    the optimizer and checkpoint) get the gradient of Σᵢ |Gᵢ - Ḡ·rᵢ^α| with the target held constant,
    i.e. sign(Gᵢ - Ḡrᵢ^α)·‖∇_W Lᵢ‖; the network gets Σ cᵢ·wᵢ·∇Lᵢ. Before each step the weights are
    kept positive (one pushed to ``min_weight`` or below is raised to it: a weight ≤ 0 would turn its
    task's gradient around, and the sign of its own rule with it) and renormalised to sum to the number
    of tasks. ``alpha``: the restoring force (the paper's 0.12–3;
    1.5 for its NYUv2 runs). One backward per task. Lᵢ(0): the first step's losses, averaged over the ranks.
    """

    adaptive = True

    def __init__(
        self,
        tasks: Sequence[str],
        base: Sequence[float],
        alpha: float = 1.5,
        min_weight: float = 1e-3,
        shared: Sequence[str] | None = None,
        net: nn.Module | None = None,
        scope: str = "rank",
    ) -> None:
        super().__init__(tasks, base, shared, net, scope)
        require(0 <= alpha < math.inf, "alpha", alpha, "a number ≥ 0 (the paper's 0.12 to 3)")
        require(0 < min_weight < 1, "min_weight", min_weight, "a number in (0, 1): the least weight a task keeps")
        self.alpha, self.min_weight = float(alpha), float(min_weight)
        self.task_weight = nn.Parameter(torch.ones(len(self.tasks)))
        self.initial_losses = torch.full((len(self.tasks),), math.nan)  # extra state: not broadcast by DDP

    def weights(self, losses: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():  # positive, then the paper's renormalisation: Σ wᵢ = K after every update
            self.task_weight.clamp_(min=self.min_weight)
            self.task_weight.mul_(len(self.tasks) / self.task_weight.sum())
        return self.base * self.task_weight.detach()

    def combine(self, grads: TaskGradients, losses: Sequence[torch.Tensor]) -> torch.Tensor:
        own = self._own_term(grads.vectors.float().norm(dim=1), losses)  # ‖∇_W cᵢLᵢ‖
        weighted = grads.scaled(self.task_weight.detach())
        # The net's gradient Σ wᵢ·∇(cᵢLᵢ), and the weights' own: the gradient of their loss, target held constant.
        return gradient_surrogate(weighted, weighted.vectors.sum(0)) + own

    def gramian_rule(self, gramian: torch.Tensor, losses: Sequence[torch.Tensor]) -> GramianRule:
        own = self._own_term(gramian.diagonal().float().clamp_min(0).sqrt(), losses)
        w = self.task_weight.detach().to(gramian.dtype)
        return GramianRule(w, w, own)

    def _own_term(self, norms: torch.Tensor, losses: Sequence[torch.Tensor]) -> torch.Tensor:
        """The weights' loss for the shared gradients' norms ``norms``: its gradient is sign(Gᵢ - Ḡrᵢ^α)·normᵢ."""
        values = torch.stack([loss.detach().float() for loss in losses])
        if self.scope == "global" and self._mean_over_ranks is not None:
            values = self._mean_over_ranks(values)  # the global batch's losses, as its gradients
        if self.initial_losses.device != values.device:
            self.initial_losses = self.initial_losses.to(values.device)
        if bool(torch.isnan(self.initial_losses).any()):
            # The ranks' mean: the same Lᵢ(0) on every rank, so a resumed run (which loads rank
            # zero's) goes on as the straight one would.
            self.initial_losses = self._mean_over_ranks(values.clone()) if self._mean_over_ranks else values.clone()
        g = self.task_weight.detach() * norms
        ratio = values / self.initial_losses
        target = g.mean() * (ratio / ratio.mean()) ** self.alpha
        weight_grad = torch.sign(g - target) * norms
        return (self.task_weight * weight_grad.to(self.task_weight.dtype).detach()).sum()

    def get_extra_state(self) -> dict[str, torch.Tensor]:
        return {"initial_losses": self.initial_losses.cpu()}

    def set_extra_state(self, state: dict[str, torch.Tensor]) -> None:
        self.initial_losses = state["initial_losses"].clone()
