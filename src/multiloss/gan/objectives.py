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
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from multiloss.base.precision import widened
from multiloss.config import ConfigError

# --- the losses: D's terms (summed into D's loss) and G's loss, from D's scores -----------------------------


class GANLoss:
    """The contract of an adversarial loss: D's terms and G's loss from D's scores. Subclass it in a module of your
    own and name it in ``model.loss: {_target_: mypkg.MyLoss, <its arguments>}`` (docs/extending.md); the shipped
    spellings (`LOSSES`) name the shipped subclasses.

    Hooks, each called by the GAN recipe (`multiloss.recipes.gan.GAN`) inside a step, on tensors with their graph:

    - `real_term` ``(d_real) -> Tensor`` and `fake_term` ``(d_fake) -> Tensor``: D's term on its scores of the reals
      and its term on its scores of the (detached) fakes — called by the default `discriminator_terms`. Override
      them for a loss whose two sides are separate (every shipped loss but ``relativistic``).
    - `discriminator_terms` ``(d_real, d_fake) -> {name: Tensor}``: D's loss as named terms (their sum is D's loss;
      each is logged as ``loss/<name>``), called once per D micro-batch after D scored its reals and fakes. Default:
      ``{"d_real": real_term(d_real), "d_fake": fake_term(d_fake)}``; a paired loss overrides it.
    - `generator_loss` ``(d_fake, d_real) -> Tensor``: G's loss, called once per G micro-batch after D (frozen for
      G's step) scored G's samples; ``d_real`` is D's scores of the paired reals when `paired`, else None.

    Every value is a mean over the micro-batch (the recipe weighs micro-batches by their examples). Scores are what D
    returns: one per sample, shape (b,) or (b, 1).

    Declared flags (class attributes) that change what the recipe does around the hooks:
    """

    # True: D's and G's losses pair each generated sample with the real sample in its row (RpGAN): G's step scores
    # the reals too (one more D forward), and ``model.g_reals=own_batch`` is allowed.
    paired: ClassVar[bool] = False
    # True: D returns probabilities in [0, 1] (a D ending in a Sigmoid), checked on a batch at setup; D's step then
    # backwards the reals' term before it scores the fakes (dcgan/main.py's order). Needs separate sides.
    probabilities: ClassVar[bool] = False
    # True: D is a critic that needs a penalty to stay Lipschitz (WGAN): ``model.penalty=none`` is refused.
    needs_penalty: ClassVar[bool] = False
    # How messages write it (its shipped spelling); "" takes the class's name.
    name: ClassVar[str] = ""

    def real_term(self, d_real: torch.Tensor) -> torch.Tensor:
        """D's term on its scores of the reals (a loss with separate sides)."""
        raise NotImplementedError(f"{type(self).__qualname__} defines neither real_term nor discriminator_terms")

    def fake_term(self, d_fake: torch.Tensor) -> torch.Tensor:
        """D's term on its scores of the detached fakes (a loss with separate sides)."""
        raise NotImplementedError(f"{type(self).__qualname__} defines neither fake_term nor discriminator_terms")

    def discriminator_terms(self, d_real: torch.Tensor, d_fake: torch.Tensor) -> dict[str, torch.Tensor]:
        """D's loss as named terms; default: ``d_real`` (`real_term`) and ``d_fake`` (`fake_term`)."""
        return {"d_real": self.real_term(d_real), "d_fake": self.fake_term(d_fake)}

    def generator_loss(self, d_fake: torch.Tensor, d_real: torch.Tensor | None = None) -> torch.Tensor:
        """G's loss from D's scores of G's samples (and, `paired`, of the paired reals)."""
        raise NotImplementedError(f"{type(self).__qualname__} defines no generator_loss")

    def __repr__(self) -> str:
        return type(self).__qualname__


class NonSaturating(GANLoss):
    """Goodfellow et al. 2014, on logits: D −log σ(D(x)) − log(1 − σ(D(G(z)))), G −log σ(D(G(z))) (softplus)."""

    name = "nonsaturating"

    def real_term(self, d_real: torch.Tensor) -> torch.Tensor:
        return F.softplus(-d_real).mean()

    def fake_term(self, d_fake: torch.Tensor) -> torch.Tensor:
        return F.softplus(d_fake).mean()

    def generator_loss(self, d_fake: torch.Tensor, d_real: torch.Tensor | None = None) -> torch.Tensor:
        return F.softplus(-d_fake).mean()


class BCE(GANLoss):
    """The non-saturating loss on probabilities (a D ending in a Sigmoid): ``nn.BCELoss`` against 1 and 0 (DCGAN's
    dcgan/main.py), D's reals backwarded before its fakes are scored."""

    name = "bce"

    probabilities = True

    def real_term(self, d_real: torch.Tensor) -> torch.Tensor:
        return bce(d_real, 1.0)

    def fake_term(self, d_fake: torch.Tensor) -> torch.Tensor:
        return bce(d_fake, 0.0)

    def generator_loss(self, d_fake: torch.Tensor, d_real: torch.Tensor | None = None) -> torch.Tensor:
        return bce(d_fake, 1.0)


class Wasserstein(GANLoss):
    """Arjovsky et al. 2017; Gulrajani et al. 2017 (``wgan-gp``): D(G(z)) − D(x), the critic's Wasserstein estimate;
    G −D(G(z)). Needs a penalty (``gp``, or r1/r2)."""

    name = "wgan-gp"

    needs_penalty = True

    def real_term(self, d_real: torch.Tensor) -> torch.Tensor:
        return -d_real.mean()

    def fake_term(self, d_fake: torch.Tensor) -> torch.Tensor:
        return d_fake.mean()

    def generator_loss(self, d_fake: torch.Tensor, d_real: torch.Tensor | None = None) -> torch.Tensor:
        return -d_fake.mean()


class Hinge(GANLoss):
    """Lim & Ye 2017; Miyato et al. 2018: max(0, 1 − D(x)) + max(0, 1 + D(G(z))); G −D(G(z))."""

    name = "hinge"

    def real_term(self, d_real: torch.Tensor) -> torch.Tensor:
        return F.relu(1 - d_real).mean()

    def fake_term(self, d_fake: torch.Tensor) -> torch.Tensor:
        return F.relu(1 + d_fake).mean()

    def generator_loss(self, d_fake: torch.Tensor, d_real: torch.Tensor | None = None) -> torch.Tensor:
        return -d_fake.mean()


class LeastSquares(GANLoss):
    """Mao et al. 2017 (``lsgan``, a = 0, b = c = 1): ½(D(x) − 1)² + ½D(G(z))²; G ½(D(G(z)) − 1)²."""

    name = "lsgan"

    def real_term(self, d_real: torch.Tensor) -> torch.Tensor:
        return 0.5 * (d_real - 1).square().mean()

    def fake_term(self, d_fake: torch.Tensor) -> torch.Tensor:
        return 0.5 * d_fake.square().mean()

    def generator_loss(self, d_fake: torch.Tensor, d_real: torch.Tensor | None = None) -> torch.Tensor:
        return 0.5 * (d_fake - 1).square().mean()


class Relativistic(GANLoss):
    """RpGAN (Jolicoeur-Martineau 2019; Huang et al. 2024, R3GAN): D softplus(D(G(z)) − D(x)), each generated sample
    paired with the real sample in its row (one term, ``d_pair``); G softplus(D(x) − D(G(z)))."""

    name = "relativistic"

    paired = True

    def discriminator_terms(self, d_real: torch.Tensor, d_fake: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"d_pair": F.softplus(d_fake - d_real).mean()}

    def generator_loss(self, d_fake: torch.Tensor, d_real: torch.Tensor | None = None) -> torch.Tensor:
        assert d_real is not None, "the relativistic loss pairs each generated sample with a real one"
        return F.softplus(d_real - d_fake).mean()


# The shipped spellings of ``model.loss`` (a `GANLoss` of your own: ``{_target_: ...}``).
LOSSES: dict[str, type[GANLoss]] = {
    "nonsaturating": NonSaturating,
    "bce": BCE,
    "wgan-gp": Wasserstein,
    "hinge": Hinge,
    "lsgan": LeastSquares,
    "relativistic": Relativistic,
}


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


# --- the penalties on ∇ₓD ---------------------------------------------------------------------------------


class GradientPenalty:
    """The contract of a penalty on D's input gradient ∇ₓD(x): where it is taken (`at`) and its value there
    (`value`). Subclass it and name it in ``model.penalty: {_target_: mypkg.MyPenalty}`` (or in a list beside the
    shipped spellings, `PENALTIES`); ``model.penalty_weight`` is its weight, ``model.penalty_every`` makes it lazy.

    The recipe computes ∇ₓ Σ D(x) at the points `at` names with ``create_graph=True`` (the double backward; under
    ``16-mixed`` with AMP's scale-then-unscale), calls `value` on it once per D micro-batch (or in the lazy step),
    multiplies by the weight and adds 0·ΣD(x) (stylegan2-ada's ``real_logits * 0``: D's last bias gets a zero gradient,
    DDP every gradient it waits for). A penalty needs each sample's own gradient: a D with BatchNorm is refused.
    """

    # Where ∇ₓD is taken: ``real`` (the data, R1: the scores D's loss was built from), ``fake`` (the detached
    # generated samples, R2: likewise) or ``interpolates`` (x̂ = ε·x + (1 − ε)·G(z), one ε per sample from the
    # training noise, WGAN-GP: one more D forward).
    at: ClassVar[str] = "real"
    # Its log key (``loss/<name>``) and its name in messages; "" takes the class's name in lower case.
    name: ClassVar[str] = ""

    def value(self, gradient: torch.Tensor) -> torch.Tensor:
        """The penalty from ∇ₓD at the points (shape of the samples, graph kept): a scalar, a mean over the samples,
        before its weight."""
        raise NotImplementedError(f"{type(self).__qualname__} defines no value")

    def key(self) -> str:
        return self.name or type(self).__name__.lower()

    def __repr__(self) -> str:
        return type(self).__qualname__


class WassersteinGP(GradientPenalty):
    """Gulrajani et al. 2017 (``gp``): E[(‖∇D(x̂)‖₂ − 1)²] at x̂ = ε·x + (1 − ε)·G(z)."""

    at, name = "interpolates", "gp"

    def value(self, gradient: torch.Tensor) -> torch.Tensor:
        return ((gradient.flatten(1).norm(2, dim=1) - 1) ** 2).mean()


class R1(GradientPenalty):
    """Mescheder et al. 2018 (``r1``): ½·E[‖∇D(x)‖²] on the data — so ``penalty_weight`` is the papers' γ
    (stylegan2-ada's ``r1_gamma``: its ``loss_Dr1 = r1_penalty * (r1_gamma / 2)``)."""

    at, name = "real", "r1"

    def value(self, gradient: torch.Tensor) -> torch.Tensor:
        return 0.5 * gradient.flatten(1).square().sum(dim=1).mean()


class R2(R1):
    """``r2``: ½·E[‖∇D(G(z))‖²] on the (detached) generated samples (R3GAN pairs it with R1)."""

    at, name = "fake", "r2"


# The shipped spellings of ``model.penalty`` (``none``: no penalty).
PENALTIES: dict[str, type[GradientPenalty]] = {"gp": WassersteinGP, "r1": R1, "r2": R2}
AT = ("real", "fake", "interpolates")


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


def penalty(
    term: GradientPenalty,
    critic: Callable[[torch.Tensor], torch.Tensor],
    real: torch.Tensor,
    fake: torch.Tensor,
    eps: torch.Tensor | None = None,
    scaler: Any = None,
    scores: torch.Tensor | None = None,
) -> torch.Tensor:
    """``term``'s value at its points (`GradientPenalty.at`), before its weight, plus 0·ΣD(x) (see `GradientPenalty`):
    ``scores``: D's scores already computed from ``real`` or ``fake`` (a leaf that requires grad), which R1 and R2
    differentiate instead of scoring again."""
    if term.at == "interpolates":
        assert eps is not None, "a penalty at interpolates needs ε"
        e = eps.view(-1, *[1] * (real.dim() - 1))  # one ε per sample, whatever the sample's shape
        x = (e * real + (1 - e) * fake).detach().requires_grad_(True)
        scores = None
    else:
        x = real if term.at == "real" else fake
        if scores is None:
            x = x.detach().requires_grad_(True)
    if scores is None:
        scores = critic(x)
    return term.value(scores_gradient(scores, x, scaler)) + 0 * scores.sum()


def discriminator_loss(
    loss: GANLoss,
    critic: Callable[[torch.Tensor], torch.Tensor],
    real: torch.Tensor,
    fake: torch.Tensor,
    eps: torch.Tensor | None,
    penalties: dict[str, float],
    terms: dict[str, GradientPenalty],
    scaler: Any = None,
    observe_real: Callable[[torch.Tensor], None] | None = None,
    side: str | None = None,
) -> dict[str, torch.Tensor]:
    """D's loss ``d`` and its terms (`GANLoss.discriminator_terms`), plus each of ``penalties`` (name → weight; its
    `GradientPenalty` in ``terms``) times its weight; ``observe_real``: told D's scores of the reals (ADA's r_t).

    A penalty at the reals or the fakes differentiates the very scores the loss is built from (stylegan2-ada's
    ``Dboth`` phase, R3GAN's step, which takes both: ``Trainer.py`` 28-42, γ/2·(R1 + R2)): one D forward of the reals
    and one of the fakes, so with augmentation on each penalty is taken at the augmentation D's loss saw, not at
    another draw. (A penalty at interpolates scores its own.)

    ``side``: ``real`` or ``fake`` for one side alone (its term, its penalties: those at the reals with the reals, the
    others with the fakes), so a loop can backward each side before scoring the other (dcgan/main.py's order, a
    `GANLoss.probabilities` loss).
    """
    if side is not None:
        penalties = {n: w for n, w in penalties.items() if (terms[n].at == "real") == (side == "real")}
    at = {terms[name].at for name in penalties}
    if "real" in at:
        real = real.detach().requires_grad_(True)
    if "fake" in at:
        fake = fake.detach().requires_grad_(True)
    d_real = critic(real) if side != "fake" else None
    if observe_real is not None and d_real is not None:
        observe_real(d_real)
    d_fake = critic(fake) if side != "real" else None
    if side is None:
        losses = loss.discriminator_terms(d_real, d_fake)
    else:
        losses = {"d_real": loss.real_term(d_real)} if side == "real" else {"d_fake": loss.fake_term(d_fake)}
    total = sum(losses.values())
    for name, weight in penalties.items():
        term = terms[name]
        scores = {"real": d_real, "fake": d_fake}.get(term.at)
        losses[name] = penalty(term, critic, real, fake, eps, scaler, scores)
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
