"""Methods of one's own, each written against its base class's contract (docs/extending.md) and named from a
``--config-dir`` by ``_target_``: nothing in multiloss is edited for them.

- `InverseLoss`: a weighting balancer (`multiloss.balancers.Balancer`): each task weighed by 1/Lᵢ, normalised so the
  weights sum to the number of tasks (every task then moves its loss by the same fraction).
- `EqualNorms`: a gradient-combining balancer (`multiloss.balancers.GradientBalancer`) defined by its Gramian alone:
  each task's gradient on the shared layers rescaled to the tasks' mean norm, then summed.
- `DriftWasserstein`: a GAN loss (`multiloss.gan.objectives.GANLoss`): the Wasserstein critic plus ProGAN's drift
  term ε·E[D(x)²] (Karras et al. 2018), which keeps the critic's scores near zero.
- `LipschitzPenalty`: a penalty on ∇ₓD (`multiloss.gan.objectives.GradientPenalty`): WGAN-LP's one-sided
  E[max(0, ‖∇D(x̂)‖ − 1)²] at the interpolates (Petzka et al. 2018).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from multiloss.balancers import Balancer, GradientBalancer
from multiloss.balancers.protocol import GramianRule
from multiloss.gan.objectives import GANLoss, GradientPenalty


class InverseLoss(Balancer):
    """wᵢ = K·(1/Lᵢ) / Σⱼ(1/Lⱼ) on the detached losses of the global batch (``eps`` keeps a zero loss finite)."""

    def __init__(self, tasks: Sequence[str], base: Sequence[float], eps: float = 1e-8) -> None:
        super().__init__(tasks, base)  # tasks and base: injected by the recipe
        self.eps = eps

    def weights(self, losses: torch.Tensor) -> torch.Tensor:
        # The global batch's losses (the mean over the ranks, which start_epoch handed over): every rank and every
        # shape of the global batch then weighs alike. On one device: the losses themselves.
        inverse = 1.0 / (self.over_ranks(losses) + self.eps)
        return len(inverse) * inverse / inverse.sum()


class EqualNorms(GradientBalancer):
    """αᵢ = mean(‖g‖) / ‖gᵢ‖ on the shared layers, from the Gramian's diagonal; each head keeps its own gradient."""

    def weights(self, losses: torch.Tensor) -> torch.Tensor:
        return self.base  # what the recipe logs as weight/<task>: the configured weights (the rule is in the gradient)

    def gramian_rule(self, gramian: torch.Tensor, losses: Sequence[torch.Tensor]) -> GramianRule:
        norms = gramian.diagonal().clamp(min=0).sqrt()
        alpha = norms.mean() / norms.clamp(min=1e-12)
        return GramianRule(shared=alpha, own=torch.ones_like(alpha))


class DriftWasserstein(GANLoss):
    """D: D(G(z)) − D(x) + ``drift``·D(x)²; G: −D(G(z)). A Wasserstein critic: it needs a penalty."""

    needs_penalty = True

    def __init__(self, drift: float = 0.001) -> None:
        self.drift = drift

    def real_term(self, d_real: torch.Tensor) -> torch.Tensor:
        return -d_real.mean() + self.drift * d_real.square().mean()

    def fake_term(self, d_fake: torch.Tensor) -> torch.Tensor:
        return d_fake.mean()

    def generator_loss(self, d_fake: torch.Tensor, d_real: torch.Tensor | None = None) -> torch.Tensor:
        return -d_fake.mean()


class LipschitzPenalty(GradientPenalty):
    """E[max(0, ‖∇D(x̂)‖₂ − 1)²] at x̂ = ε·x + (1 − ε)·G(z): only gradients steeper than 1 are penalised."""

    at, name = "interpolates", "lp"

    def value(self, gradient: torch.Tensor) -> torch.Tensor:
        return (gradient.flatten(1).norm(2, dim=1) - 1).clamp(min=0).square().mean()
