"""Gradient balancers: the tasks' gradients on the shared layers combined by a rule (one backward per task).

- `PCGrad`: Yu et al. 2020, gradient surgery: each task's gradient on the shared parameters loses
  its component along any other task's gradient it conflicts with (negative dot product); the
  projected gradients are summed.
- `JacobianDescent`: any aggregator of torchjd (UPGrad, MGDA, ...) applied to the tasks' Jacobian on
  the shared parameters: a dependency (the ``torchjd`` extra), not a copy (exact MGDA:
  `multiloss.balancers.min_norm`).
- `GradNorm`: Chen et al. 2018, task weights trained so the tasks' gradient norms on the shared layers train
  at equal rates.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from multiloss.balancers.protocol import GradientBalancer, GramianRule, own_rank_state, pack_state, unpack_state
from multiloss.balancers.task_gradients import TaskGradients, gradient_surrogate
from multiloss.balancers.torchjd_state import has_state, load_state, state_of
from multiloss.base.precision import widened
from multiloss.config import require


class PCGrad(GradientBalancer):
    """Yu et al. 2020 (PCGrad): project each task's gradient off the tasks it conflicts with, then sum.

    For each task i, in a random order of the other tasks j (the paper's Algorithm 1; ``shuffle:
    false`` takes them in index order): if gᵢ·gⱼ < 0, gᵢ ← gᵢ - (gᵢ·gⱼ / ‖gⱼ‖²)·gⱼ, with gⱼ the
    original gradient of task j. Only the shared parameters are projected; a task's own head gets its
    own gradient. Tasks keep their configured weights (cᵢ·Lᵢ). The order's generator is in the
    checkpoint. Under DDP (and FSDP2, the net held whole for its step: `multiloss.parallel.sharding.LocalGradients`)
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
        gramian: str = "layers",
        rep_grad: str | None = None,
    ) -> None:
        super().__init__(tasks, base, shared, net, scope, gramian, rep_grad)
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
        gramian: str = "layers",
        convention: str = "torchjd",
        rep_grad: str | None = None,
    ) -> None:
        require(callable(aggregator), "aggregator", aggregator, "a torchjd aggregator, e.g. torchjd.aggregation.UPGrad")
        require(
            convention in CONVENTIONS,
            "convention",
            convention,
            "torchjd (torchjd's update, each head its own gradient) or libmtl (LibMTL's update: docs/balancers.md)",
        )
        if isinstance(aggregator, functools.partial):  # ``_partial_: true``: one that is told the number of tasks
            aggregator = aggregator(n_tasks=len(tasks))
        # Only an aggregator torchjd defines by a weighting of the Gramian can take it segment by segment.
        by_gramian = getattr(aggregator, "gramian_weighting", None) is not None
        # Not a submodule: its state (a stateful one's) is this balancer's extra state, kept per rank; as a
        # submodule DDP would broadcast rank zero's buffers over every rank's own at each forward.
        object.__setattr__(self, "aggregator", aggregator)
        super().__init__(tasks, base, shared, net, scope, gramian if by_gramian else "gradients", rep_grad)
        self.convention = convention
        self.shared_factor, self.heads_weighted, self.libmtl_weighting = (
            libmtl_form(aggregator, len(self.tasks)) if convention == "libmtl" else (1.0, False, None)
        )

    def __new__(cls, *args: Any, **kwargs: Any) -> JacobianDescent:
        aggregator = kwargs.get("aggregator", args[2] if len(args) > 2 else None)
        if cls is JacobianDescent and has_state(aggregator):
            cls = StatefulJacobianDescent  # its state in the checkpoint (extra state: a class-level hook of torch's)
        return super().__new__(cls)

    def _apply(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> JacobianDescent:
        if isinstance(self.aggregator, nn.Module):
            self.aggregator._apply(fn, *args, **kwargs)
        return super()._apply(fn, *args, **kwargs)

    def weights(self, losses: torch.Tensor) -> torch.Tensor:
        return self.base

    def combine(self, grads: TaskGradients, losses: Sequence[torch.Tensor]) -> torch.Tensor:
        if self.convention == "torchjd":
            return gradient_surrogate(grads, self.aggregator(grads.vectors))
        weighting, clip = self.aggregator.weighting, 0.0
        if self.libmtl_weighting is not None:  # LibMTL's own solver or tolerance, on the Gramian
            weighting = lambda matrix: self.libmtl_weighting(matrix @ matrix.T)  # noqa: E731
        if type(self.aggregator).__name__ == "NashMTL":
            # LibMTL weighs the heads by the unclipped α, then clips the shared parameters' gradient norm
            # (clip_grad_norm_, ``Nash_MTL.py`` 126-130); torchjd clips α itself.
            clip, weighting.max_norm = weighting.max_norm, 0.0
        try:
            weights = weighting(grads.vectors).to(grads.vectors.dtype)  # what the aggregator's forward does
        finally:
            if clip:
                weighting.max_norm = clip
        vector = self.shared_factor * (weights @ grads.vectors)
        if clip and (coefficient := clip / (float(vector.norm()) + 1e-6)) < 1:
            vector = vector * coefficient
        if self.heads_weighted:  # as the shared update: the method's weight times LibMTL's factor on it
            own = [(p, g * (self.shared_factor * weights[task]).to(g.dtype), task) for p, g, task in grads.own]
            grads = TaskGradients(grads.shared, grads.vectors, own)
        return gradient_surrogate(grads, vector)

    def gramian_rule(self, gramian: torch.Tensor, losses: Sequence[torch.Tensor]) -> GramianRule:
        coefficients = (self.libmtl_weighting or _gramian_weighting(self.aggregator))(gramian)
        own = self.shared_factor * coefficients if self.heads_weighted else torch.ones_like(coefficients)
        return GramianRule(self.shared_factor * coefficients, own)

    def check_rep_grad(self, rep_grad: str, scope: str) -> None:
        """On the representation: a Gramian weighting on either; a weighting of the matrix (Nash-MTL, ExcessMTL, ...)
        on the batch's sum, or every sample's on each rank's own; GradDrop on the batch's sum (LibMTL's and the
        paper's masks per feature, sign(Z) summed over the batch)."""
        name = type(self.aggregator).__name__
        if getattr(self.aggregator, "gramian_weighting", None) is not None:
            return
        from torchjd.aggregation._aggregator_bases import WeightedAggregator

        require(
            isinstance(self.aggregator, WeightedAggregator) or name == "GradDrop",
            "rep_grad",
            rep_grad,
            f"null for {name} (its update is no weighting of the tasks' gradients: it needs the parameters' own)",
        )
        require(
            rep_grad == "batch" or (scope == "rank" and name != "GradDrop"),
            "rep_grad",
            rep_grad,
            "batch for GradDrop (its masks are per feature, from the batch's sum) and, with scope=global, for a "
            "rule on the gradients themselves (the ranks' samples are not gathered)",
        )

    def representation_rule(
        self,
        matrix: torch.Tensor,
        gramian: torch.Tensor | None,
        per_task: torch.Tensor,
        rep: torch.Tensor,
        losses: Sequence[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if getattr(self.aggregator, "gramian_weighting", None) is not None:
            return super().representation_rule(matrix, gramian, per_task, rep, losses)
        ones = torch.ones(len(matrix), dtype=per_task.dtype, device=per_task.device)
        if type(self.aggregator).__name__ == "GradDrop":
            reduce = self._mean_over_ranks if self.scope == "global" else None
            return graddrop_representation(per_task, rep, self.aggregator.leak, reduce), ones, None
        weights = self.aggregator.weighting(matrix).to(per_task.dtype)
        alpha = self.shared_factor * weights
        own = alpha if self.heads_weighted else ones
        return alpha, own, None

    @classmethod
    def check_sharded_rule(cls, spec: Mapping[str, Any]) -> None:
        """Refuse, before the run starts, an aggregator the sharded rule (``scope=global`` under FSDP2) cannot run."""
        from hydra.utils import instantiate

        _gramian_weighting(instantiate(spec["aggregator"]))


CONVENTIONS = ("torchjd", "libmtl")


def graddrop_representation(
    per_task: torch.Tensor, rep: torch.Tensor, leak: Any, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> torch.Tensor:
    """GradDrop on the representation (Chen et al. 2020, as LibMTL's ``GradDrop.py`` 32-49 at 4336804): the tasks'
    gradients of Z (K × batch × ...) signed by Z and summed over the batch give each feature's sign purity P; one
    uniform draw per feature keeps the positive or the negative tasks' gradients there (every sample alike);
    ``leak`` (torchjd's GradDrop's: per task, None = 0) lets that much of a dropped gradient through. Returns the
    summed kept gradient of Z. ``reduce``: the ranks' mean (``scope=global``: the global batch's purity, every rank's
    masks alike given the same draw)."""
    k = len(per_task)
    signed = (per_task * rep.detach().sign().unsqueeze(0)).sum(1)
    if reduce is not None:
        signed = reduce(signed)
    purity = 0.5 * (1 + signed.sum(0) / (signed.abs().sum(0) + 1e-7))
    draw = torch.rand_like(purity)
    mask = purity.gt(draw).unsqueeze(0) * signed.gt(0) + purity.lt(draw).unsqueeze(0) * signed.lt(0)
    leak = torch.zeros(k) if leak is None else torch.as_tensor(leak)
    leak = leak.to(per_task.dtype).to(per_task.device).view(-1, *[1] * (per_task.dim() - 1))
    return (per_task * (leak + (1 - leak) * mask.unsqueeze(1).to(per_task.dtype))).sum(0)


def libmtl_form(aggregator: Any, k: int) -> tuple[float, bool, Callable[[torch.Tensor], torch.Tensor] | None]:
    """How LibMTL's update (median-research-group/LibMTL at 4336804) differs from torchjd's aggregate of the same
    weights: (its factor on the shared parameters' update, whether it weighs each head by the method's weight, its
    own weighting of the Gramian where it solves otherwise).

    CAGrad: ``rescale=1`` (LibMTL's default) divides the update by 1 + c² (``CAGrad.py`` 55-60). Aligned-MTL: α =
    B.sum(0) where torchjd's is B·(1/K)·1, its rank tolerance in float32's ε (`libmtl_aligned_mtl`). MGDA: LibMTL's
    Frank-Wolfe solver stopped at 1e-5 (`min_norm.libmtl_min_norm`), not the exact point. Nash-MTL, FairGrad:
    ``torch.sum(w * losses).backward()`` (``Nash_MTL.py`` 127, ``FairGrad.py`` 40), so each head gets wᵢ times its
    task's gradient. ExcessMTL: weights summing to K where torchjd's sum to 1, and Σ wᵢLᵢ backwarded (``ExcessMTL.py``
    47-52): K times the update, each head weighted by K·wᵢ. Every other aggregator: the same update, each head its own
    task's gradient (LibMTL's per-task ``backward`` before ``_reset_grad``).
    """
    from multiloss.balancers.min_norm import MinNormWeighting, libmtl_min_norm

    name = type(aggregator).__name__
    if name == "CAGrad":
        c = next(m.c for m in aggregator.modules() if hasattr(m, "c"))
        return 1.0 / (1.0 + float(c) ** 2), False, None
    if name == "AlignedMTL":
        return 1.0, False, libmtl_aligned_mtl
    if name == "ExcessMTL":  # weights summing to K (ExcessMTL.py 47), Σ wᵢLᵢ backwarded (51-52): heads weighted too
        return float(k), True, None
    if isinstance(getattr(aggregator, "gramian_weighting", None), MinNormWeighting):
        return 1.0, False, libmtl_min_norm
    return 1.0, name in ("NashMTL", "FairGrad"), None


def libmtl_aligned_mtl(gramian: torch.Tensor) -> torch.Tensor:
    """LibMTL's Aligned-MTL weights (``Aligned_MTL.py`` 18-38 at 4336804; torch.symeig is torch.linalg.eigh): α =
    B.sum(0), K times torchjd's α = B·(1/K)·1, and its rank tolerance max λ·K·ε with ε the default dtype's
    (``torch.finfo()``: float32's), where torchjd's takes the Gramian's (float64's on a float64 net)."""
    lmbda, v = torch.linalg.eigh(gramian.detach())
    tol = torch.max(lmbda) * max(gramian.shape[-2:]) * torch.finfo().eps
    rank = int(sum(lmbda > tol))
    order = torch.argsort(lmbda, dim=-1, descending=True)
    lmbda, v = lmbda[order][:rank], v[:, order][:, :rank]
    b = lmbda[-1].sqrt() * ((v @ torch.diag(1 / lmbda.sqrt())) @ v.t())
    return b.sum(0)


class IMTL(JacobianDescent):
    """IMTL (Liu et al. 2021, "Towards Impartial Multi-task Learning"), both halves, as LibMTL's ``IMTL.backward``:
    IMTL-L's learned scales sᵢ on the losses, e^sᵢ·cᵢLᵢ - sᵢ, and IMTL-G's weights of those losses' gradients (the
    update whose projections on every task's unit gradient are equal; torchjd's ``IMTLG``). Each head gets its own
    scaled loss's gradient; sᵢ its gradient e^sᵢ·cᵢLᵢ - 1, through the recipe's optimizer (in the checkpoint)."""

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
        from torchjd.aggregation import IMTLG

        super().__init__(tasks, base, IMTLG(), shared, net, scope, gramian, rep_grad=rep_grad)
        self.log_scale = nn.Parameter(torch.zeros(len(self.tasks)))

    def rule_losses(self, losses: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        scales = torch.exp(self.log_scale.detach())
        return [(s * c).to(loss.dtype) * loss for s, c, loss in zip(scales, self.base, losses)]

    def combine(self, grads: TaskGradients, losses: Sequence[torch.Tensor]) -> torch.Tensor:
        return super().combine(grads, losses) + self._scale_term(losses)

    def gramian_rule(self, gramian: torch.Tensor, losses: Sequence[torch.Tensor]) -> GramianRule:
        rule = super().gramian_rule(gramian, losses)
        return GramianRule(rule.shared, rule.own, self._scale_term(losses))

    def _scale_term(self, losses: Sequence[torch.Tensor]) -> torch.Tensor:
        """Σ e^sᵢ·cᵢLᵢ - sᵢ with the losses held constant: its backward is the scales' gradient."""
        values = torch.stack([widened(loss.detach()) for loss in losses]) * self.base
        return (torch.exp(self.log_scale) * values - self.log_scale).sum()


class StatefulJacobianDescent(JacobianDescent):
    """`JacobianDescent` with a stateful torchjd aggregator (GradVac's cosine EMA, NashMTL's last weights, ExcessMTL's
    gradient sums): that state in the checkpoint (`multiloss.balancers.torchjd_state`), so a resumed run goes on as
    the straight one. Chosen by `JacobianDescent` itself for such an aggregator."""

    state_per_rank = True

    def get_extra_state(self) -> dict[str, bytes]:
        return pack_state(state_of(self.aggregator))

    def set_extra_state(self, state: dict[str, bytes]) -> None:
        load_state(self.aggregator, own_rank_state(unpack_state(state)))


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
        gramian: str = "layers",
        rep_grad: str | None = None,
        convention: str = "paper",
    ) -> None:
        super().__init__(tasks, base, shared, net, scope, gramian, rep_grad)
        require(0 <= alpha < math.inf, "alpha", alpha, "a number ≥ 0 (the paper's 0.12 to 3)")
        require(0 < min_weight < 1, "min_weight", min_weight, "a number in (0, 1): the least weight a task keeps")
        require(
            convention in ("paper", "libmtl"),
            "convention",
            convention,
            "paper (the paper's GradNorm) or libmtl (LibMTL's GradNorm.py: docs/balancers.md)",
        )
        self.alpha, self.min_weight, self.convention = float(alpha), float(min_weight), convention
        self.task_weight = nn.Parameter(torch.ones(len(self.tasks)))
        self.initial_losses = torch.full((len(self.tasks),), math.nan)  # extra state: not broadcast by DDP
        # convention=libmtl: the first epoch's mean losses (LibMTL's train_loss_buffer[:, 0]), summed as it runs.
        self.first_epoch_sum, self.first_epoch_steps, self.epoch = torch.zeros(len(self.tasks)), 0, 0

    def start_epoch(self, epoch: int, reduce: Any) -> None:
        super().start_epoch(epoch, reduce)
        self.epoch = epoch

    def weights(self, losses: torch.Tensor) -> torch.Tensor:
        if self.convention == "libmtl":
            return self._libmtl_weights(losses)
        with torch.no_grad():  # positive, then the paper's renormalisation: Σ wᵢ = K after every update
            self.task_weight.clamp_(min=self.min_weight)
            self.task_weight.mul_(len(self.tasks) / self.task_weight.sum())
        return self.base * self.task_weight.detach()

    def _libmtl_weights(self, losses: torch.Tensor) -> torch.Tensor:
        """LibMTL's GradNorm (``GradNorm.py`` 24-50 at 4336804): weight 1 through the first epoch (whose losses are
        averaged: ``train_loss_buffer[:, 0]``), then K·softmax(s) of its parameters s."""
        if self.epoch == 0:
            values = (self.base * widened(losses.detach())).to(self.first_epoch_sum.device)
            if self.scope == "global" and self._mean_over_ranks is not None:
                values = self._mean_over_ranks(values)
            self.first_epoch_sum, self.first_epoch_steps = (
                self.first_epoch_sum + values.cpu(),
                self.first_epoch_steps + 1,
            )
            return self.base
        return self.base * self._libmtl_scale().detach()

    def _libmtl_scale(self) -> torch.Tensor:
        return len(self.tasks) * torch.softmax(self.task_weight, dim=-1)

    def _libmtl_rule(self, norms: torch.Tensor, losses: Sequence[torch.Tensor]) -> GramianRule:
        """LibMTL's: the shared layers get Σ wᵢ·gᵢ, the heads their own gradient; s the gradient of
        Σᵢ |wᵢ‖gᵢ‖ − Ḡ·rᵢ^α| (the target held constant) through w = K·softmax(s), from the second epoch."""
        ones = torch.ones(len(self.tasks), dtype=norms.dtype, device=norms.device)
        if self.epoch == 0:
            return GramianRule(ones, ones)
        scale = self._libmtl_scale()
        values = self.base * torch.stack([widened(loss.detach()) for loss in losses]).to(self.base.device)
        if self.scope == "global" and self._mean_over_ranks is not None:
            values = self._mean_over_ranks(values)
        first = (self.first_epoch_sum / max(self.first_epoch_steps, 1)).to(values.device)
        ratio = (values / first).to(norms.device)
        per_loss = scale * norms.detach().to(scale.dtype)
        target = (per_loss.mean() * (ratio / ratio.mean()) ** self.alpha).detach()
        return GramianRule(scale.detach().to(norms.dtype), ones, (per_loss - target.to(per_loss.dtype)).abs().sum())

    def combine(self, grads: TaskGradients, losses: Sequence[torch.Tensor]) -> torch.Tensor:
        if self.convention == "libmtl":
            rule = self._libmtl_rule(grads.vectors.norm(dim=1), losses)
            surrogate = gradient_surrogate(grads, rule.shared.to(grads.vectors.dtype) @ grads.vectors)
            return surrogate if rule.extra is None else surrogate + rule.extra
        own = self._own_term(widened(grads.vectors).norm(dim=1), losses)  # ‖∇_W cᵢLᵢ‖
        weighted = grads.scaled(self.task_weight.detach())
        # The net's gradient Σ wᵢ·∇(cᵢLᵢ), and the weights' own: the gradient of their loss, target held constant.
        return gradient_surrogate(weighted, weighted.vectors.sum(0)) + own

    def gramian_rule(self, gramian: torch.Tensor, losses: Sequence[torch.Tensor]) -> GramianRule:
        if self.convention == "libmtl":
            return self._libmtl_rule(gramian.diagonal().clamp_min(0).sqrt(), losses)
        own = self._own_term(widened(gramian.diagonal()).clamp_min(0).sqrt(), losses)
        w = self.task_weight.detach().to(gramian.dtype)
        return GramianRule(w, w, own)

    def _own_term(self, norms: torch.Tensor, losses: Sequence[torch.Tensor]) -> torch.Tensor:
        """The weights' loss for the shared gradients' norms ``norms``: its gradient is sign(Gᵢ - Ḡrᵢ^α)·normᵢ."""
        values = torch.stack([widened(loss.detach()) for loss in losses])
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
        return {
            "initial_losses": self.initial_losses.cpu(),
            "first_epoch_sum": self.first_epoch_sum.clone(),
            "first_epoch_steps": torch.tensor(self.first_epoch_steps),
        }

    def set_extra_state(self, state: dict[str, torch.Tensor]) -> None:
        self.initial_losses = state["initial_losses"].clone()
        if "first_epoch_sum" in state:  # checkpoints before convention=libmtl have none
            self.first_epoch_sum = state["first_epoch_sum"].clone()
            self.first_epoch_steps = int(state["first_epoch_steps"])
