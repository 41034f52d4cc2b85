"""ExcessMTL (He et al. 2024, "Robust Multi-Task Learning with Excess Risks") as its official code runs it.

torchjd's ``ExcessMTL`` updates the weights at the first call from the raw excess risks (its baseline is set there,
so the first update is exp(η·Êᵢ) unscaled); the official code (yifei-he/ExcessMTL, LibMTL/weighting/ExcessMTL.py,
which LibMTL's own at 4336804 reproduces: lines 30-48) sets the baseline at the first call and keeps the weights,
updating them from the next call on with Êᵢ/Êᵢ(0) — no ε in that ratio — at ``robust_step_size`` 1e-2 (LibMTL's
``config.py`` 69). `ExcessMTLWeighting` is torchjd's with that first call; ``update_first_step=True`` is torchjd's
(its ``n_warmup_steps`` also torchjd's: the paper's warm-up, Appendix C.1). Weights on the simplex (Σ = 1) as
torchjd's; LibMTL's sum to K (``convention=libmtl`` on `JacobianDescent`).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor
from torchjd.aggregation import ExcessMTLWeighting as TorchjdExcessMTLWeighting
from torchjd.aggregation._aggregator_bases import WeightedAggregator


class ExcessMTLWeighting(TorchjdExcessMTLWeighting):
    """torchjd's ExcessMTL weighting, its first call as the official code's: the baseline set, the weights kept."""

    def __init__(self, robust_step_size: float = 1e-2, n_warmup_steps: int = 0, update_first_step: bool = False):
        super().__init__(robust_step_size, n_warmup_steps)  # torchjd's checks: named by their key by the builder
        self.update_first_step = bool(update_first_step)

    def forward(self, matrix: Tensor, /) -> Tensor:
        if self.update_first_step or self.n_warmup_steps > 0:
            return super().forward(matrix)
        self._ensure_state(matrix)
        squares = matrix.detach() ** 2
        sums = cast(Tensor, self._sq_grad_sum)
        sums.add_(squares)
        excess = (squares / torch.sqrt(sums + 1e-7)).sum(dim=1)  # official: grad_i · (1/h_i) · grad_iᵀ
        self._n_steps += 1
        if self._initial_w is None:  # official: the first call's excess risk is the baseline, the weights stay
            self._initial_w = excess
            return cast(Tensor, self._weights)
        weights = torch.softmax(
            torch.log(cast(Tensor, self._weights)) + excess / self._initial_w * self.robust_step_size, 0
        )
        self._weights = weights
        return weights


class ExcessMTL(WeightedAggregator):
    """The aggregator of `ExcessMTLWeighting`: Σ wᵢ·gᵢ (as torchjd's ``ExcessMTL``)."""

    weighting: ExcessMTLWeighting

    def __init__(self, robust_step_size: float = 1e-2, n_warmup_steps: int = 0, update_first_step: bool = False):
        super().__init__(ExcessMTLWeighting(robust_step_size, n_warmup_steps, update_first_step))
