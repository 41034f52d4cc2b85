"""Scalarizations of the task losses: the step's gradient is that of one scalar S(c₁L₁, …, c_K·L_K) of them.

`Scalarized` takes any torchjd scalarizer (``torchjd.scalarization``: GeometricMean (GLS), Random (RLW), STCH,
IMTLL (IMTL-L), FAMO, UW, ...) and hands the recipe its weights wᵢ = cᵢ·∂S/∂(cᵢLᵢ), taken at the detached losses:
by the chain rule one backward of Σ wᵢ·Lᵢ is ∇S — the reference loop's ``S(losses).backward()`` — while the recipe
keeps its one backward seeded with the weights (``grad_tensors``), its logging of the weights, and its
accumulation and sync. A scalarizer's own parameters (IMTL-L's scales) are trained by the recipe's optimizer
through the balancer's own term; FAMO's logits by its own Adam, after the step, from the same batch's losses
recomputed (`Balancer.after_step`). `LogSum` is DB-MTL's loss part, Σ log(cᵢLᵢ + ε).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from multiloss.balancers.protocol import Balancer, Reduce, pack_state, unpack_state
from multiloss.balancers.torchjd_state import load_state, state_of
from multiloss.config import require


class Scalarized(Balancer):
    """A torchjd scalarizer S of the tasks' losses cᵢ·Lᵢ (``scalarizer``: its config, ``_target_:
    torchjd.scalarization.GeometricMean``; one that takes a ``shape`` is given the number of tasks).

    The step's gradient is ∇S, through the weights wᵢ = cᵢ·∂S/∂(cᵢLᵢ) at this step's losses (logged as
    ``weight/<task>``). A scalarizer that learns with the net (IMTL-L's, UW's scales) is a submodule: its parameters
    are in the recipe's optimizer and checkpoint, their gradient the backward of S with the losses held constant.
    One that updates itself after the step (FAMO: ``update`` with the same batch's losses recomputed) is not: its
    logits and its own optimizer are this balancer's extra state; on several ranks it sees the losses averaged over
    the ranks (the global batch's), so every rank keeps the same logits.
    """

    def __init__(
        self,
        tasks: Sequence[str],
        base: Sequence[float],
        scalarizer: Any,
        convention: str = "torchjd",
        warmup_epochs: int = 4,
    ) -> None:
        super().__init__(tasks, base)
        require(
            convention in ("torchjd", "libmtl"),
            "convention",
            convention,
            "torchjd (torchjd's scalarizer) or libmtl (LibMTL's form: STCH's warm-up and nadir; the others alike)",
        )
        self.convention = convention
        if convention == "libmtl" and _is_torchjd_stch(scalarizer):
            mu = scalarizer.keywords.get("mu", 1.0)
            require(isinstance(mu, int | float) and mu > 0, "scalarizer.mu", mu, "a positive smoothing (LibMTL's 1.0)")
            scalarizer = functools.partial(LibMTLSTCH, mu=float(mu), warmup_epochs=warmup_epochs)
        if isinstance(scalarizer, functools.partial):  # ``_partial_: true``: told the number of tasks
            # A vector from the config (STCH's weights and reference, FAMO's min_losses) as the tensor torchjd takes.
            lists = {k: torch.tensor([float(x) for x in v]) for k, v in scalarizer.keywords.items() if _is_list(v)}
            scalarizer = functools.partial(scalarizer.func, *scalarizer.args, **{**scalarizer.keywords, **lists})
            try:
                takes_shape = "shape" in inspect.signature(scalarizer.func).parameters
            except (TypeError, ValueError):  # a builtin: no signature to read
                takes_shape = False
            scalarizer = scalarizer(shape=len(self.tasks)) if takes_shape else scalarizer()
        require(
            isinstance(scalarizer, nn.Module) and callable(scalarizer),
            "scalarizer",
            scalarizer,
            "a torchjd scalarizer (a module mapping the vector of task losses to one scalar), "
            "e.g. torchjd.scalarization.GeometricMean",
        )
        self.after_step_update = callable(getattr(scalarizer, "update", None))
        if self.after_step_update:  # outside the module tree: DDP must not see its logits as the net's parameters
            object.__setattr__(self, "scalarizer", scalarizer)
        else:
            self.scalarizer = scalarizer
        self._own_term: torch.Tensor | None = None
        self._mean_over_ranks: Reduce | None = None

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> Scalarized:
        # A scalarizer outside the module tree (FAMO's logits and their optimizer) is cast with the balancer: a 64-true
        # run's .double() reaches it before its optimizer holds any state (or loads a checkpoint's, in its dtype).
        if self.after_step_update:
            self.scalarizer._apply(fn, *args, **kwargs)
        return super()._apply(fn, *args, **kwargs)

    def start_epoch(self, epoch: int, reduce: Reduce) -> None:
        self._mean_over_ranks = reduce
        if isinstance(self.scalarizer, LibMTLSTCH):
            self.scalarizer.epoch = epoch

    def weights(self, losses: torch.Tensor) -> torch.Tensor:
        if self.after_step_update:
            self.scalarizer.to(losses.device)  # not moved with the recipe: not a submodule
        scaled = self.base * losses.detach().to(self.base.dtype)
        if self._mean_over_ranks is not None:
            # The global batch's losses: every rank then weighs alike, and DDP's average of Σ wᵢ·∇Lᵢ is ∇S of the
            # global batch (2 ranks × b = 1 rank × 2b). One all-reduce of K numbers a step.
            scaled = self._mean_over_ranks(scaled)
        scaled = scaled.requires_grad_(True)
        learns = any(p.requires_grad for p in self.scalarizer.parameters()) and not self.after_step_update
        with torch.enable_grad():
            value = self.scalarizer(scaled)
            (slope,) = torch.autograd.grad(value, scaled, retain_graph=learns)
        # S with the losses held constant: its backward trains the scalarizer's own parameters.
        self._own_term = value if learns else None
        return self.base * slope

    def extra(self, losses: torch.Tensor) -> torch.Tensor | None:
        term, self._own_term = self._own_term, None
        return term

    def after_step(self, losses: torch.Tensor) -> None:
        """FAMO's update from this step's losses ``losses`` recomputed on the same batch after the step (averaged over
        the ranks, as the losses it saw before the step: the global batch's)."""
        if not self.after_step_update:
            return
        before = self.scalarizer._prev_losses
        after = (self.base * losses.detach().to(self.base.dtype)).to(before.device)
        if self._mean_over_ranks is not None:
            before, after = self._mean_over_ranks(torch.stack([before, after])).unbind()
        self.scalarizer._prev_losses = before
        self.scalarizer.update(after)

    def get_extra_state(self) -> dict[str, bytes]:
        return pack_state(state_of(self.scalarizer) if self.after_step_update else {})

    def set_extra_state(self, state: dict[str, bytes]) -> None:
        if self.after_step_update:
            load_state(self.scalarizer, unpack_state(state))


def _is_list(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str | torch.Tensor)


class LogSum(nn.Module):
    """DB-MTL's loss part (Lin et al. 2023, "Dual-Balancing for Multi-Task Learning", eq. 3): Σᵢ log(ℓᵢ + ε), whose
    gradient weighs each task by 1/(ℓᵢ + ε) — scale-free in each task's loss. A scalarizer for `Scalarized`."""

    def __init__(self, eps: float = 1e-8) -> None:
        super().__init__()
        require(eps > 0, "eps", eps, "a positive number (LibMTL's 1e-8)")
        self.eps = float(eps)

    def forward(self, values: torch.Tensor) -> torch.Tensor:
        return torch.log(values + self.eps).sum()


def _is_torchjd_stch(scalarizer: Any) -> bool:
    func = scalarizer.func if isinstance(scalarizer, functools.partial) else type(scalarizer)
    return getattr(func, "__name__", "") == "STCH" and getattr(func, "__module__", "").startswith("torchjd")


class LibMTLSTCH(nn.Module):
    """LibMTL's STCH (median-research-group/LibMTL at 4336804, ``LibMTL/weighting/STCH.py`` 25-55, after the official
    Xi-L/STCH ``STCH_MTL``), a scalarizer for `Scalarized` (``balancer=stch model.balancer.convention=libmtl``).

    For the first ``warmup_epochs`` epochs and the one after (LibMTL's ``epoch < warmup`` and ``== warmup``) Σᵢ
    log(ℓᵢ + 1e-20) — DB-MTL's loss part; during that last warm-up epoch the losses are averaged into the nadir
    point; from then on μ·K·log Σᵢ exp(log(ℓᵢ/nadirᵢ + 1e-20)/μ). torchjd's STCH is μ·log Σᵢ exp(λᵢ(ℓᵢ - zᵢ)/μ)
    on the raw losses from the first step. The epoch comes from the balancer (`Scalarized.start_epoch`); the
    nadir's sums are buffers, in the checkpoint (a resumed run goes on as the straight one).
    """

    def __init__(self, shape: int, mu: float = 1.0, warmup_epochs: int = 4) -> None:
        super().__init__()
        require(mu > 0, "mu", mu, "a positive smoothing (LibMTL's STCH_mu: 1.0)")
        require(
            isinstance(warmup_epochs, int) and warmup_epochs >= 0,
            "warmup_epochs",
            warmup_epochs,
            "a whole number of epochs ≥ 0 (LibMTL's STCH_warmup_epoch: 4)",
        )
        self.mu, self.warmup_epochs, self.epoch = float(mu), warmup_epochs, 0
        self.register_buffer("loss_sum", torch.zeros(shape, dtype=torch.float64))
        self.register_buffer("loss_count", torch.zeros((), dtype=torch.float64))

    def forward(self, values: torch.Tensor) -> torch.Tensor:
        if self.epoch <= self.warmup_epochs:
            if self.epoch == self.warmup_epochs:  # the nadir: this epoch's mean loss (STCH.py 36-40)
                self.loss_sum += values.detach().to(self.loss_sum.dtype)
                self.loss_count += 1
            return torch.log(values + 1e-20).sum()
        if float(self.loss_count) == 0:  # resumed past the warm-up without its sums: LibMTL would divide by 0 too
            raise RuntimeError(
                "model.balancer: STCH (convention=libmtl) is past its warm-up without a nadir point: "
                "the warm-up's last epoch was not run in this run or its checkpoint"
            )
        nadir = (self.loss_sum / self.loss_count).to(values.dtype)
        logs = torch.log(values / nadir + 1e-20)
        return self.mu * torch.logsumexp(logs / self.mu, dim=0) * len(values)
