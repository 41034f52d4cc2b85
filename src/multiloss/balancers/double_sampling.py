"""The rules that see several independent draws of the batch each step: SDMGrad and MoDo (three draws, as LibMTL's
Trainer samples them: ``trainer.py`` 256, three consecutive batches for these two methods).

The recipe splits each batch into ``batches_per_step`` equal parts (`multiloss.multitask.recipe.MultiTaskRecipe.draws`)
and hands the balancer each part's task losses; the rule takes each part's K task gradients on the shared
parameters (3 × K × n held) and torchjd's weighting (``SDMGradWeighting``, ``MoDoWeighting``) of the product J₁J₂ᵀ of
two parts' (two independent draws keep its estimate unbiased), the update on the third. The heads get their own
task's gradients as LibMTL gives them: summed over the three draws for SDMGrad (its ``_compute_grad`` accumulates
them), averaged for MoDo (``MoDo.py`` 52-55 divides them by 3).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from multiloss.balancers.protocol import GradientBalancer, own_rank_state, pack_state, unpack_state
from multiloss.balancers.task_gradients import TaskGradients, gradient_surrogate, task_gradients
from multiloss.balancers.torchjd_state import load_state, state_of
from multiloss.config import require


class _Draws(GradientBalancer):
    """A rule on three independent draws' task gradients; its torchjd weighting's state (the weights it iterates)
    in the checkpoint, each rank's own."""

    batches_per_step = 3
    state_per_rank = True
    heads_mean = False  # the heads' gradients: summed over the draws (False) or averaged (True)

    def __init__(
        self,
        tasks: Sequence[str],
        base: Sequence[float],
        weighting: nn.Module,
        shared: Sequence[str] | None = None,
        net: nn.Module | None = None,
        scope: str = "rank",
    ) -> None:
        require(scope == "rank", "scope", scope, "rank (each rank's own three draws; their rule, then DDP's average)")
        object.__setattr__(self, "weighting", weighting)  # not a submodule: its state is this balancer's extra state
        super().__init__(tasks, base, shared, net, scope, "gradients")

    def weights(self, losses: torch.Tensor) -> torch.Tensor:
        return self.base

    def draw_surrogate(
        self,
        draws: Sequence[Sequence[torch.Tensor]],
        params: Sequence[nn.Parameter],
        shared: Sequence[nn.Parameter] | None = None,
    ) -> torch.Tensor:
        """The surrogate loss of the rule on the draws' task losses ``draws`` (three lists of K losses)."""
        require(len(draws) == self.batches_per_step, "batches_per_step", len(draws), str(self.batches_per_step))
        shared = shared if shared is not None else self._shared_built
        with torch.autocast(draws[0][0].device.type, enabled=False):
            grads = [task_gradients(self.rule_losses(losses), params, shared) for losses in draws]
            coefficients, update = self.rule([g.vectors for g in grads])
            vector = coefficients.to(grads[update].vectors.dtype) @ grads[update].vectors
            scale = 1.0 / len(draws) if self.heads_mean else 1.0
            own = [(p, g * scale, task) for drawn in grads for p, g, task in drawn.own]
            return gradient_surrogate(TaskGradients(grads[update].shared, vector, own), vector)

    def rule(self, vectors: list[torch.Tensor]) -> tuple[torch.Tensor, int]:
        """The coefficients of the tasks' gradients of one draw, and which draw they apply to."""
        raise NotImplementedError

    def combine(self, grads: TaskGradients, losses: Sequence[torch.Tensor]) -> torch.Tensor:
        raise RuntimeError(f"{type(self).__name__} needs {self.batches_per_step} draws a step (draw_surrogate)")

    def get_extra_state(self) -> dict[str, bytes]:
        return pack_state(state_of(self.weighting))

    def set_extra_state(self, state: dict[str, bytes]) -> None:
        load_state(self.weighting, own_rank_state(unpack_state(state)))

    def _apply(self, fn, *args, **kwargs):
        self.weighting._apply(fn, *args, **kwargs)
        return super()._apply(fn, *args, **kwargs)


class SDMGrad(_Draws):
    """SDMGrad (Xiao et al. 2023, "Direction-oriented Multi-objective Learning"): torchjd's ``SDMGradWeighting`` of
    A = J₂J₃ᵀ (draws 2 and 3: LibMTL's ``xi_grads1``, ``xi_grads2``), the update Σᵢ wᵢ·g₁ᵢ on draw 1 (``zeta``),
    w = (w_SGD + λ·w̃)/(1 + λ); the inner SGD's w kept between steps. ``lr`` 5 and ``momentum`` 0.5 are LibMTL's and
    the official code's inner SGD (``SDMGrad.py`` 55: torchjd's default lr is 10), ``n_iter`` 20, ``lambda_`` 0.3."""

    def __init__(
        self,
        tasks: Sequence[str],
        base: Sequence[float],
        lr: float = 5.0,
        momentum: float = 0.5,
        n_iter: int = 20,
        lambda_: float = 0.3,
        shared: Sequence[str] | None = None,
        net: nn.Module | None = None,
        scope: str = "rank",
    ) -> None:
        from torchjd.aggregation import SDMGradWeighting

        super().__init__(tasks, base, SDMGradWeighting(lr, momentum, n_iter, lambda_), shared, net, scope)

    def rule(self, vectors: list[torch.Tensor]) -> tuple[torch.Tensor, int]:
        return self.weighting(vectors[1] @ vectors[2].T), 0


class MoDo(_Draws):
    """MoDo (Chen et al. 2023/2024, "Three-Way Trade-Off in Multi-Objective Learning"): torchjd's ``MoDoWeighting`` of
    A = J₁J₂ᵀ (draws 1 and 2), λ ← Π_Δ(λ − γ(Aλ + ρλ)), the update Σᵢ λᵢ·g₃ᵢ on draw 3, the heads' gradients averaged
    over the draws. ``gamma`` 1e-3 and ``rho`` 0.1 are LibMTL's (``config.py``; torchjd's default gamma is 0.1)."""

    heads_mean = True

    def __init__(
        self,
        tasks: Sequence[str],
        base: Sequence[float],
        gamma: float = 1e-3,
        rho: float = 0.1,
        shared: Sequence[str] | None = None,
        net: nn.Module | None = None,
        scope: str = "rank",
    ) -> None:
        from torchjd.aggregation import MoDoWeighting

        super().__init__(tasks, base, MoDoWeighting(gamma, rho), shared, net, scope)

    def rule(self, vectors: list[torch.Tensor]) -> tuple[torch.Tensor, int]:
        return self.weighting(vectors[0] @ vectors[1].T), 2
