"""Gradient balancers that keep a moving average of each task's gradient on the shared parameters (K × n state).

- `DBMTL`: Lin et al. 2023 ("Dual-Balancing Multi-Task Learning"): each task's gradient of its log-loss
  log(cᵢLᵢ + ε), averaged over the steps; the averages rescaled to the largest one's norm and summed.
- `MoCo`: Fernando et al. 2023 ("Mitigating Gradient Bias in Multi-objective Learning", ICLR): a tracked
  gradient per task (each step's normalised to its loss), and task weights λ on the simplex updated against
  the tracked gradients' Gramian; the update is Σ λᵢ·yᵢ.

Both as LibMTL writes them (``LibMTL/weighting/DB_MTL.py``, ``MoCo.py`` at 4336804; their parity tests carry the
lines): each task's own head gets its own task's gradient (LibMTL's per-task ``backward`` before it replaces the
shared parameters' gradients). The averages are in the checkpoint. With ``scope=rank`` each rank keeps its own;
``scope=global`` averages the tasks' gradients over the ranks first, so every rank keeps the global batch's.
They need the gradients themselves, not their Gramian: under FSDP2 the net is held whole for their step
(``scope=rank``); ``scope=global`` there is refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from multiloss.balancers.protocol import GradientBalancer, own_rank_state, pack_state, unpack_state
from multiloss.balancers.task_gradients import TaskGradients, gradient_surrogate
from multiloss.base.precision import widened
from multiloss.config import require


class _MovingAverage(GradientBalancer):
    """The shared state of the two: the step count and the K × n averages, made at the first step (n is known then)."""

    def __init__(
        self,
        tasks: Sequence[str],
        base: Sequence[float],
        shared: Sequence[str] | None = None,
        net: nn.Module | None = None,
        scope: str = "rank",
    ) -> None:
        super().__init__(tasks, base, shared, net, scope)
        self.steps = 0
        self.average: torch.Tensor | None = None

    def weights(self, losses: torch.Tensor) -> torch.Tensor:
        return self.base

    def _averages_like(self, vectors: torch.Tensor) -> torch.Tensor:
        """The averages so far (zeros before the first step), where this step's ``vectors`` are."""
        if self.average is None or self.average.shape != vectors.shape:
            return torch.zeros_like(vectors)
        return self.average.to(vectors.device, vectors.dtype)

    def _loss_values(self, losses: Sequence[torch.Tensor]) -> torch.Tensor:
        """The tasks' cᵢLᵢ, detached: the global batch's (averaged over the ranks) with ``scope=global``, as the
        gradients are."""
        values = torch.stack([widened((c * loss).detach()) for c, loss in zip(self.base, losses)])
        if self.scope == "global" and self._mean_over_ranks is not None:
            values = self._mean_over_ranks(values)
        return values

    state_per_rank = True

    def get_extra_state(self) -> dict[str, bytes]:
        average = None if self.average is None else self.average.cpu()
        return pack_state({"steps": self.steps, "average": average, **self._more()})

    def set_extra_state(self, state: dict[str, bytes]) -> None:
        state = own_rank_state(unpack_state(state))
        self.steps = int(state["steps"])
        self.average = None if state["average"] is None else state["average"].clone()
        self._load_more(state)

    def _more(self) -> dict[str, Any]:
        return {}

    def _load_more(self, state: dict[str, Any]) -> None:
        pass

    @classmethod
    def check_sharded_rule(cls, spec: Mapping[str, Any]) -> None:
        require(
            False,
            "model.balancer.scope",
            "global",
            "rank under FSDP2 (the net held whole for the step) for this balancer",
            "its moving averages are of the tasks' gradients, which the rule on the shards never holds whole",
        )


class DBMTL(_MovingAverage):
    """DB-MTL (Lin et al. 2023), as LibMTL's ``DB_MTL.backward``: gᵢ = ∇ log(cᵢLᵢ + 1e-8) on the shared parameters;
    yᵢ ← gᵢ + (β / tᵝˢ)·(yᵢ - gᵢ) at step t (``beta``, ``beta_sigma``: LibMTL's 0.9 and 0); the update
    Σᵢ (max‖y‖ / (‖yᵢ‖ + 1e-8))·yᵢ."""

    def __init__(
        self,
        tasks: Sequence[str],
        base: Sequence[float],
        beta: float = 0.9,
        beta_sigma: float = 0.0,
        shared: Sequence[str] | None = None,
        net: nn.Module | None = None,
        scope: str = "rank",
    ) -> None:
        super().__init__(tasks, base, shared, net, scope)
        require(0 <= beta <= 1, "beta", beta, "a number in [0, 1] (LibMTL's 0.9)")
        require(beta_sigma >= 0, "beta_sigma", beta_sigma, "a number ≥ 0 (LibMTL's 0)")
        self.beta, self.beta_sigma = float(beta), float(beta_sigma)

    def combine(self, grads: TaskGradients, losses: Sequence[torch.Tensor]) -> torch.Tensor:
        self.steps += 1
        log_grads = grads.scaled(1 / (self._loss_values(losses) + 1e-8))  # ∇ log(cL + ε) = ∇(cL) / (cL + ε)
        g = log_grads.vectors
        self.average = average = g + (self.beta / self.steps**self.beta_sigma) * (self._averages_like(g) - g)
        norms = average.norm(dim=-1)
        alpha = norms.max() / (norms + 1e-8)
        return gradient_surrogate(log_grads, (alpha[:, None] * average).sum(0))


class MoCo(_MovingAverage):
    """MoCo (Fernando et al. 2023), as LibMTL's ``MoCo.backward``: gᵢ = ∇(cᵢLᵢ) on the shared parameters scaled to
    cᵢLᵢ/(‖gᵢ‖ + 1e-8); y ← y - (β/t^βσ)·(y - g); λ ← softmax(λ - (γ/t^γσ)·(yyᵀ + ρI)·λ) from λ = 1/K; the update
    yᵀλ. ``beta``, ``beta_sigma``, ``gamma``, ``gamma_sigma``, ``rho``: LibMTL's 0.5, 0.5, 0.1, 0.5, 0."""

    weights_set_by_rule = True  # λ is updated by the rule: the logged weights are this step's

    adaptive = True  # λ: logged as weight/<task> (times cᵢ)

    def __init__(
        self,
        tasks: Sequence[str],
        base: Sequence[float],
        beta: float = 0.5,
        beta_sigma: float = 0.5,
        gamma: float = 0.1,
        gamma_sigma: float = 0.5,
        rho: float = 0.0,
        shared: Sequence[str] | None = None,
        net: nn.Module | None = None,
        scope: str = "rank",
    ) -> None:
        super().__init__(tasks, base, shared, net, scope)
        for key, value in (("beta", beta), ("gamma", gamma)):
            require(0 < value <= 1, key, value, "a number in (0, 1] (LibMTL's beta 0.5, gamma 0.1)")
        for key, value in (("beta_sigma", beta_sigma), ("gamma_sigma", gamma_sigma), ("rho", rho)):
            require(value >= 0, key, value, "a number ≥ 0 (LibMTL's 0.5, 0.5 and 0)")
        self.beta, self.beta_sigma, self.gamma, self.gamma_sigma, self.rho = map(
            float, (beta, beta_sigma, gamma, gamma_sigma, rho)
        )
        # float64 until the first step casts it to the gradients' dtype: 1/K as exact as a 64-true run needs.
        self.lambd = torch.full((len(self.tasks),), 1 / len(self.tasks), dtype=torch.float64)

    def weights(self, losses: torch.Tensor) -> torch.Tensor:
        return self.base * self.lambd.to(self.base)

    def combine(self, grads: TaskGradients, losses: Sequence[torch.Tensor]) -> torch.Tensor:
        self.steps += 1
        values = self._loss_values(losses).to(grads.vectors.dtype)
        g = grads.vectors / (grads.vectors.norm(dim=1, keepdim=True) + 1e-8) * values[:, None]
        y = self._averages_like(g)
        self.average = y = y - (self.beta / self.steps**self.beta_sigma) * (y - g)
        lambd = self.lambd.to(y.device, y.dtype)
        eye = torch.eye(len(lambd), dtype=y.dtype, device=y.device)
        self.lambd = torch.softmax(
            lambd - (self.gamma / self.steps**self.gamma_sigma) * (y @ y.T + self.rho * eye) @ lambd, -1
        )
        return gradient_surrogate(grads, y.T @ self.lambd)

    def _more(self) -> dict[str, Any]:
        return {"lambd": self.lambd.cpu()}

    def _load_more(self, state: dict[str, Any]) -> None:
        self.lambd = state["lambd"].clone()
