"""The GAN's objectives: its adversarial losses and the gradient penalties on the discriminator's input.

Each loss is a pair of functions of D's scores (logits unless said otherwise), D's and G's, with the paper's
formula; the recipe picks one by ``model.loss``. A penalty is a function of ∇ₓD(x) at some points x — the data
(R1), the generated samples (R2) or random interpolates between the two (WGAN-GP) — so it is a double backward:
``torch.autograd.grad(..., create_graph=True)`` keeps that gradient's graph for the penalty's own backward.
Under ``16-mixed`` the input gradient follows PyTorch's AMP recipe for gradient penalties ("Gradient penalty",
AMP examples): the scores' mean is scaled by the GradScaler before ``autograd.grad`` (so small gradients do not
underflow in float16) and the gradient unscaled before the penalty is formed. Should it overflow all the same,
the penalty is inf, D's gradients with it, and the GradScaler skips that step and lowers its scale, as it does
for any overflow; the non-finite guard (``nonfinite=stop``) stops on the inf loss, ``nonfinite=skip`` lets the
scaler's skip stand.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from multiloss.base.precision import widened
from multiloss.config import ConfigError

# --- the losses: D's terms (summed into D's loss) and G's loss, from D's scores -----------------------------

LOSSES = ("nonsaturating", "bce", "wgan-gp", "hinge", "lsgan", "relativistic")
# The losses whose G loss needs D's scores on real data too (one more D forward in G's step).
PAIRED = ("relativistic",)


def bce(probabilities: torch.Tensor, label: float) -> torch.Tensor:
    """``nn.BCELoss()(probabilities, <label everywhere>)``, the form dcgan/main.py computes (its label tensor filled
    with 1 or 0), outside autocast (BCE on probabilities is not autocast-safe: fp32 here under mixed precision).
    Scores outside [0, 1]: a config error naming ``model.loss`` (a D that returns logits wants ``nonsaturating``)."""
    with torch.autocast(probabilities.device.type, enabled=False):
        p = widened(probabilities)
        try:
            return F.binary_cross_entropy(p, torch.full_like(p, label))
        except RuntimeError as err:  # torch's own range check: no extra host read a step
            if "between 0 and 1" not in str(err):
                raise
            raise ConfigError(
                "model.loss",
                "bce",
                "a discriminator that ends in a Sigmoid (probabilities) with loss=bce, or model.loss=nonsaturating "
                "for one that returns logits (the same loss, on logits)",
                "the discriminator's scores left [0, 1]",
            ) from None


def discriminator_terms(loss: str, d_real: torch.Tensor, d_fake: torch.Tensor) -> dict[str, torch.Tensor]:
    """D's loss as named terms (their sum is D's loss), from its scores on real and (detached) fake samples.

    - ``nonsaturating`` (Goodfellow et al. 2014): −log σ(D(x)) − log(1 − σ(D(G(z)))), written with softplus.
    - ``bce``: the same on probabilities (a D ending in a Sigmoid), ``nn.BCELoss`` against 1 and 0 (DCGAN).
    - ``wgan-gp`` (Arjovsky et al. 2017; Gulrajani et al. 2017): D(G(z)) − D(x), the critic's Wasserstein estimate.
    - ``hinge`` (Lim & Ye 2017; Miyato et al. 2018): max(0, 1 − D(x)) + max(0, 1 + D(G(z))).
    - ``lsgan`` (Mao et al. 2017, a = 0, b = c = 1): ½(D(x) − 1)² + ½D(G(z))².
    - ``relativistic`` (RpGAN: Jolicoeur-Martineau 2019; Huang et al. 2024, R3GAN): softplus(D(G(z)) − D(x)), each
      generated sample paired with the real sample in its row (one term, ``d_pair``).
    All terms are means over the batch.
    """
    if loss == "wgan-gp":
        return {"d_real": -d_real.mean(), "d_fake": d_fake.mean()}
    if loss == "bce":
        return {"d_real": bce(d_real, 1.0), "d_fake": bce(d_fake, 0.0)}
    if loss == "hinge":
        return {"d_real": F.relu(1 - d_real).mean(), "d_fake": F.relu(1 + d_fake).mean()}
    if loss == "lsgan":
        return {"d_real": 0.5 * (d_real - 1).square().mean(), "d_fake": 0.5 * d_fake.square().mean()}
    if loss == "relativistic":
        return {"d_pair": F.softplus(d_fake - d_real).mean()}
    return {"d_real": F.softplus(-d_real).mean(), "d_fake": F.softplus(d_fake).mean()}


def generator_loss(loss: str, d_fake: torch.Tensor, d_real: torch.Tensor | None = None) -> torch.Tensor:
    """G's loss from D's scores on its samples (and, ``relativistic``, on the paired real samples).

    ``nonsaturating``: −log σ(D(G(z))); ``bce``: BCELoss of D's probability against 1; ``wgan-gp`` and ``hinge``:
    −D(G(z)); ``lsgan``: ½(D(G(z)) − 1)²; ``relativistic``: softplus(D(x) − D(G(z))). Means over the batch.
    """
    if loss == "bce":
        return bce(d_fake, 1.0)
    if loss in ("wgan-gp", "hinge"):
        return -d_fake.mean()
    if loss == "lsgan":
        return 0.5 * (d_fake - 1).square().mean()
    if loss == "relativistic":
        assert d_real is not None, "the relativistic loss pairs each generated sample with a real one"
        return F.softplus(d_real - d_fake).mean()
    return F.softplus(-d_fake).mean()


# --- the penalties on ∇ₓD ---------------------------------------------------------------------------------

PENALTIES = ("gp", "r1", "r2", "none")


def input_gradient(
    critic: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, scaler: Any = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """∇ₓ Σ critic(x) at ``x`` (a leaf made here), with its graph kept (``create_graph``) for a backward through it;
    and the scores.

    Summing the scores is exact when each score depends on its own sample only (no BatchNorm in the critic).
    ``scaler``: a GradScaler under ``16-mixed`` (AMP's gradient-penalty recipe: scale, differentiate, unscale).
    """
    x = x.detach().requires_grad_(True)
    scores = critic(x)
    return scores_gradient(scores, x, scaler), scores


def scores_gradient(scores: torch.Tensor, x: torch.Tensor, scaler: Any = None) -> torch.Tensor:
    """∇ₓ Σ ``scores`` for scores already computed from ``x`` (a leaf that requires grad), graph kept; ``scaler`` as
    in `input_gradient`."""
    if scaler is None:
        (grad,) = torch.autograd.grad(scores.sum(), x, create_graph=True)
        return grad
    # The scaled *mean* (a loss, as the recipe scales one): each score's gradient is scale / n, not the scale itself,
    # which float16 cannot hold at GradScaler's starting 2**16.
    n = scores.numel()
    (grad,) = torch.autograd.grad(scaler.scale(scores.sum() / n), x, create_graph=True)
    return grad * (n / scaler.get_scale())


def squared_norm_penalty(scores: torch.Tensor, x: torch.Tensor, scaler: Any = None) -> torch.Tensor:
    """R1's and R2's value from scores already computed from ``x`` (a leaf that requires grad): ½·E[‖∇ₓD‖²] + 0·ΣD
    (see `penalty`)."""
    grad = scores_gradient(scores, x, scaler)
    return 0.5 * grad.flatten(1).square().sum(dim=1).mean() + 0 * scores.sum()


def penalty(
    kind: str,
    critic: Callable[[torch.Tensor], torch.Tensor],
    real: torch.Tensor,
    fake: torch.Tensor,
    eps: torch.Tensor | None = None,
    scaler: Any = None,
) -> torch.Tensor:
    """The penalty's value, before its weight (the recipe multiplies by ``penalty_weight`` and the lazy gain).

    - ``gp`` (Gulrajani et al. 2017): E[(‖∇D(x̂)‖₂ − 1)²] at x̂ = ε·x + (1 − ε)·G(z), one ε per sample.
    - ``r1`` (Mescheder et al. 2018): ½·E[‖∇D(x)‖²] on the data — so that ``penalty_weight`` is the papers' γ
      (stylegan2-ada's ``r1_gamma``: its ``loss_Dr1 = r1_penalty * (r1_gamma / 2)``).
    - ``r2``: ½·E[‖∇D(G(z))‖²] on the (detached) generated samples (R3GAN pairs it with R1).

    Plus 0·ΣD(x), stylegan2-ada's ``real_logits * 0``: D's last bias (which ∇ₓD does not depend on) gets a zero
    gradient instead of none, so a step of the penalty alone (the lazy one) moves every weight by Adam's momentum
    as stylegan2-ada's does, and DDP finds every gradient it waits for.
    """
    if kind == "gp":
        assert eps is not None, "the gradient penalty needs ε"
        e = eps.view(-1, *[1] * (real.dim() - 1))  # one ε per sample, whatever the sample's shape
        x_hat = e * real + (1 - e) * fake
        grad, scores = input_gradient(critic, x_hat, scaler)
        return ((grad.flatten(1).norm(2, dim=1) - 1) ** 2).mean() + 0 * scores.sum()
    x = (real if kind == "r1" else fake).detach().requires_grad_(True)
    return squared_norm_penalty(critic(x), x, scaler)


def discriminator_loss(
    loss: str,
    critic: Callable[[torch.Tensor], torch.Tensor],
    real: torch.Tensor,
    fake: torch.Tensor,
    eps: torch.Tensor | None,
    penalties: dict[str, float],
    scaler: Any = None,
    observe_real: Callable[[torch.Tensor], None] | None = None,
    side: str | None = None,
) -> dict[str, torch.Tensor]:
    """D's loss ``d`` and its terms (`discriminator_terms`), plus each of ``penalties`` (gp, r1, r2 → its weight)
    times its weight; ``observe_real``: told D's scores of the reals (ADA's r_t).

    R1 and R2 differentiate the very scores the loss is built from (stylegan2-ada's ``Dboth`` phase, R3GAN's step,
    which takes both: ``Trainer.py`` 28-42, γ/2·(R1 + R2)): one D forward of the reals and one of the fakes, so with
    augmentation on each penalty is taken at the augmentation D's loss saw, not at another draw. (GP scores its own
    interpolates.)

    ``side``: ``real`` or ``fake`` for one side alone (its terms, its penalties: R1 the reals', GP and R2 the
    fakes'), so a loop can backward each side before scoring the other (dcgan/main.py's order, ``loss=bce``).
    """
    if side is not None:
        assert loss == "bce", "one side at a time is the two-term BCE's (the other losses pair the sides)"
        penalties = {n: w for n, w in penalties.items() if (n == "r1") == (side == "real")}
    if "r1" in penalties:
        real = real.detach().requires_grad_(True)
    if "r2" in penalties:
        fake = fake.detach().requires_grad_(True)
    d_real = critic(real) if side != "fake" else None
    if observe_real is not None and d_real is not None:
        observe_real(d_real)
    d_fake = critic(fake) if side != "real" else None
    if side is None:
        losses = discriminator_terms(loss, d_real, d_fake)
    else:
        losses = {"d_real": bce(d_real, 1.0)} if side == "real" else {"d_fake": bce(d_fake, 0.0)}
    total = sum(losses.values())
    for name, weight in penalties.items():
        if name == "gp":
            losses["gp"] = penalty("gp", critic, real, fake, eps, scaler)
        else:
            scores, x = (d_real, real) if name == "r1" else (d_fake, fake)
            losses[name] = squared_norm_penalty(scores, x, scaler)
        total = total + weight * losses[name]
    return {**losses, "d": total}


def lazy_ratio(every: int) -> float:
    """stylegan2-ada's correction for a regularizer taken every ``every`` steps as an extra optimizer step of its own
    (``training/training_loop.py``: ``mb_ratio = reg_interval / (reg_interval + 1)``, then ``lr * mb_ratio`` and each
    beta ``** mb_ratio``): so the optimizer moves per ``every`` main steps as far as it would without the extra one."""
    return every / (every + 1)


def correct_betas(optimizer: torch.optim.Optimizer, ratio: float) -> None:
    """Each param group's betas raised to ``ratio`` (`lazy_ratio`), in place; groups without betas are left alone.
    (The learning rate's share of the correction is the recipe's rate rule: `multiloss.base.learning_rate`.)"""
    for group in optimizer.param_groups:
        if "betas" in group:
            group["betas"] = tuple(beta**ratio for beta in group["betas"])
