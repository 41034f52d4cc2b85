"""R3GAN's loss and training loop, written out in plain PyTorch, against ``recipe=gan``.

The reference transcribes brownvc/R3GAN at 19a7ddf (github.com/brownvc/R3GAN):

- ``R3GAN/Trainer.py`` 9-44 (``ZeroCenteredGradientPenalty``: ‖∇ₓΣD‖² per sample over dims [1, 2, 3];
  ``AccumulateGeneratorGradients``: softplus(−(D(G(z)) − D(x))); ``AccumulateDiscriminatorGradients``: reals and
  fakes made leaves that require grad, softplus(−(D(x) − D(G(z)))) + γ/2·(R1 + R2), ``(Scale * loss.mean())
  .backward()``);
- ``training/training_loop.py`` 29-38 (``cosine_decay_with_warmup``), 217-227 (the phases: D, then G, each its own
  Adam with betas (0, ·) and eps 1e-8: ``train.py`` 159-160), 307-314 (lr, β2, γ, the EMA's half-life and the
  augmentation's p computed from ``cur_nimg`` at each iteration's start, p copied into the pipe), 317-343 (per
  phase: ``zero_grad``, ``requires_grad_(True)``, the loss, ``requires_grad_(False)``, every group's ``lr`` and
  ``betas = (0, β2)`` set, ``opt.step()``), 349-358 (G_ema: ``0.5 ** (batch_size / max(cur_ema_nimg, 1e-8))``,
  ``p.lerp(p_ema, beta)``, buffers copied; ``cur_nimg += batch_size``).

R3GAN's G phase pairs its fakes with a second real batch (``G_img``, lines 290-291): ``model.g_reals=own_batch``, D on
batch 2i and G on batch 2i + 1 (the recipe's default pairs G's fakes with D's reals). One difference, stated in
docs/recipes.md: R3GAN's augment pipe is stylegan2-ada's (18 transforms), here one x-flip drawn with probability p
(the recipe's ``augment.transform``). The random numbers (z, the augmentation's draws) are the recipe's, recorded.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn as nn
from hydra.utils import instantiate

from multiloss import ConfigError, testing, train
from multiloss.base.schedules import ImagesCurve
from multiloss.config import check_config
from multiloss.gan.objectives import R1, R2, Relativistic, discriminator_loss
from multiloss.testing import default_dtype
from tests.conftest import BARE, load_weights
from tests.helpers import straight_and_resumed
from tests.recipes.test_gan_modern import RESUMABLE
from tests.recipes.test_gan_stylegan2_ada import Draws, _Record, conv_digits, xflip

BATCH, LATENT, ITERATIONS = 16, 16, 34  # 68 batches of 16: inside one epoch of the digits' 1,437
LR = 2e-3
EXACT = 1e-10  # float64: equal up to rounding, on any CPU (the recipe in 64-true, R3GAN's code on float64 copies)

# --- R3GAN/Trainer.py, as written there -------------------------------------------------------------------


class AdversarialTraining:
    def __init__(self, Generator, Discriminator):
        self.Generator = Generator
        self.Discriminator = Discriminator

    @staticmethod
    def ZeroCenteredGradientPenalty(Samples, Critics):
        (Gradient,) = torch.autograd.grad(outputs=Critics.sum(), inputs=Samples, create_graph=True)
        return Gradient.square().sum([1, 2, 3])

    def AccumulateGeneratorGradients(self, Noise, RealSamples, Conditions, Scale=1, Preprocessor=lambda x: x):
        FakeSamples = self.Generator(Noise, Conditions)
        RealSamples = RealSamples.detach()

        FakeLogits = self.Discriminator(Preprocessor(FakeSamples), Conditions)
        RealLogits = self.Discriminator(Preprocessor(RealSamples), Conditions)

        RelativisticLogits = FakeLogits - RealLogits
        AdversarialLoss = nn.functional.softplus(-RelativisticLogits)

        (Scale * AdversarialLoss.mean()).backward()

        return [x.detach() for x in [AdversarialLoss, RelativisticLogits]]

    def AccumulateDiscriminatorGradients(
        self, Noise, RealSamples, Conditions, Gamma, Scale=1, Preprocessor=lambda x: x
    ):
        RealSamples = RealSamples.detach().requires_grad_(True)
        FakeSamples = self.Generator(Noise, Conditions).detach().requires_grad_(True)

        RealLogits = self.Discriminator(Preprocessor(RealSamples), Conditions)
        FakeLogits = self.Discriminator(Preprocessor(FakeSamples), Conditions)

        R1Penalty = AdversarialTraining.ZeroCenteredGradientPenalty(RealSamples, RealLogits)
        R2Penalty = AdversarialTraining.ZeroCenteredGradientPenalty(FakeSamples, FakeLogits)

        RelativisticLogits = RealLogits - FakeLogits
        AdversarialLoss = nn.functional.softplus(-RelativisticLogits)

        DiscriminatorLoss = AdversarialLoss + (Gamma / 2) * (R1Penalty + R2Penalty)
        (Scale * DiscriminatorLoss.mean()).backward()

        return [x.detach() for x in [AdversarialLoss, RelativisticLogits, R1Penalty, R2Penalty]]


# --- training/training_loop.py 29-38, as written there -------------------------------------------------------


def cosine_decay_with_warmup(
    cur_nimg, base_value, total_nimg, final_value=0.0, warmup_value=0.0, warmup_nimg=0, hold_base_value_nimg=0
):
    decay = 0.5 * (
        1
        + np.cos(
            np.pi
            * (cur_nimg - warmup_nimg - hold_base_value_nimg)
            / float(total_nimg - warmup_nimg - hold_base_value_nimg)
        )
    )
    cur_value = base_value + (1 - decay) * (final_value - base_value)
    if hold_base_value_nimg > 0:
        cur_value = np.where(cur_nimg > warmup_nimg + hold_base_value_nimg, cur_value, base_value)
    if warmup_nimg > 0:
        slope = (base_value - warmup_value) / warmup_nimg
        warmup_v = slope * cur_nimg + warmup_value
        cur_value = np.where(cur_nimg < warmup_nimg, warmup_v, cur_value)
    return float(np.where(cur_nimg > total_nimg, final_value, cur_value))


# --- item 1: the loss ------------------------------------------------------------------------------------------


class ImageCritic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1), nn.LeakyReLU(0.2), nn.Flatten(), nn.Linear(8 * 4 * 4, 1))

    def forward(self, x, c=None):
        return self.net(x)


@pytest.mark.parametrize("gamma", [0.05, 2.0])
def test_both_penalties_equal_r3gans_discriminator_loss(gamma):
    """``model.penalty=[r1,r2] model.penalty_weight=γ`` with ``loss=relativistic``: D's gradients equal R3GAN's
    ``AccumulateDiscriminatorGradients`` at ``Gamma=γ``, in float64 to 1e-10 (3 × 8 × 8 images, a conv critic)."""
    torch.manual_seed(0)
    D = ImageCritic().double()
    real, fake = torch.randn(16, 3, 8, 8, dtype=torch.float64), torch.randn(16, 3, 8, 8, dtype=torch.float64)
    reference = copy.deepcopy(D)
    AdversarialTraining(lambda z, c: fake, reference).AccumulateDiscriminatorGradients(None, real, None, gamma)
    terms = {"r1": R1(), "r2": R2()}
    losses = discriminator_loss(Relativistic(), D, real, fake, None, {"r1": gamma, "r2": gamma}, terms)
    losses["d"].backward()
    for (name, p), q in zip(D.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=EXACT, rtol=0, msg=name)
    assert losses["r1"] > 0 and losses["r2"] > 0 and max(p.grad.abs().max() for p in D.parameters()) > 1e-4


def test_penalties_with_their_own_weights_and_the_errors(make_cfg, tmp_path):
    """A weight per penalty (a list as long as the penalties), and the mistakes named before a file is written."""
    from multiloss.recipes.gan import GAN

    mlp = {"_target_": "multiloss.nets.MLP", "in_features": 2, "out_features": 2, "width": 8}
    critic = {"_target_": "multiloss.nets.MLP", "in_features": 2, "out_features": 1, "width": 8}
    model = GAN(generator=mlp, discriminator=critic, penalty=["r1", "r2"], penalty_weight=[0.5, 2.0])
    assert model.penalties == {"r1": 0.5, "r2": 2.0}
    for overrides, key in (
        (("model.penalty=[r1,r3]",), "model.penalty"),
        (("model.penalty=[r1,r1]",), "model.penalty"),
        (("model.penalty=[r1,none]",), "model.penalty"),
        (("model.penalty=[r1,r2]", "model.penalty_weight=[1,2,3]"), "model.penalty_weight"),
        (("model.penalty=[r1,r2]", "model.penalty_weight=[1,-2]"), "model.penalty_weight"),
    ):
        with pytest.raises(ConfigError) as err:
            train(make_cfg("recipe=gan", "model.loss=relativistic", *overrides, output_dir=tmp_path / "run"))
        assert err.value.key == key, overrides
    assert not (tmp_path / "run").exists()


# --- item 2: the schedules and the loop ------------------------------------------------------------------------

WARMUP, TOTAL = 10 * BATCH, 30 * BATCH  # a warm-up, a cosine, and the final value, all inside 34 iterations
LR_SCHEDULE = {
    "base_value": LR,
    "final_value": LR / 4,
    "total_nimg": TOTAL,
    "warmup_value": LR / 10,
    "warmup_nimg": WARMUP,
}
SCHEDULES = {
    "gamma": {"base_value": 2.0, "final_value": 0.2, "total_nimg": TOTAL, "hold_base_value_nimg": 5 * BATCH},
    "beta2": {"base_value": 0.9, "final_value": 0.99, "total_nimg": TOTAL},
    "ema_half_life": {"base_value": 0, "final_value": 500, "total_nimg": TOTAL},
    "augment_p": {"base_value": 0, "final_value": 0.6, "total_nimg": TOTAL, "warmup_nimg": WARMUP},
}


def _override(name: str, spec: dict) -> str:
    return f"+model.schedules.{name}={{{', '.join(f'{k}: {v}' for k, v in spec.items())}}}"


R3GAN = (
    *conv_digits(BATCH),
    "model.loss=relativistic",
    "model.penalty=[r1,r2]",
    "model.penalty_weight=2.0",
    "model.n_critic=1",
    "model.g_reals=own_batch",
    "+model.g_ema.half_life_images=1",  # (the schedule sets it every batch)
    "+model.augment.transform=tests.recipes.test_gan_stylegan2_ada.xflip",
    "optimizer@model.g_optimizer=adam",
    "optimizer@model.d_optimizer=adam",
    f"model.g_optimizer.lr={LR}",
    f"model.d_optimizer.lr={LR}",
    "model.g_optimizer.betas=[0.0,0.9]",
    "model.d_optimizer.betas=[0.0,0.9]",
    "+model.g_optimizer.eps=1e-8",
    "+model.d_optimizer.eps=1e-8",
    "scheduler=images",
    f"model.scheduler.total_nimg={TOTAL}",
    "model.scheduler.final_value=0.25",
    f"model.scheduler.warmup_nimg={WARMUP}",
    "model.scheduler.warmup_value=0.1",
    *(_override(name, spec) for name, spec in SCHEDULES.items()),
)


def _preprocessor(draws: Draws, p: float):
    """The augment pipe: each image x-flipped with probability p (its uniform the recipe's)."""

    def augment(x: torch.Tensor) -> torch.Tensor:
        u = torch.special.ndtr(draws.next(1))
        keep = ((u < p) | (p >= 1)).to(x.dtype).view(-1, 1, 1, 1)
        return keep * xflip(x) + (1 - keep) * x

    return augment


def _r3gan_loop(G, D, reals, zs, draws):
    """training/training_loop.py 284-358 on the recipe's reals (D's batch, then G's: ``D_img``, ``G_img``) and random
    numbers; the values each iteration used."""
    G_ema = copy.deepcopy(G).eval()
    G.requires_grad_(False)
    D.requires_grad_(False)
    trainer = AdversarialTraining(lambda z, c: G(z).view(-1, 1, 8, 8), lambda x, c: D(x))
    phases = [
        {"name": name, "module": module, "opt": torch.optim.Adam(module.parameters(), betas=[0.0, 0.0], eps=1e-8)}
        for name, module in (("D", D), ("G", G))
    ]
    cur_nimg, used, zs = 0, [], list(zs)
    for d_img, g_img in zip(reals[0::2], reals[1::2], strict=True):
        d_img, g_img = d_img.view(-1, 1, 8, 8), g_img.view(-1, 1, 8, 8)
        cur_lr = cosine_decay_with_warmup(cur_nimg, **LR_SCHEDULE)
        cur_beta2 = cosine_decay_with_warmup(cur_nimg, **SCHEDULES["beta2"])
        cur_gamma = cosine_decay_with_warmup(cur_nimg, **SCHEDULES["gamma"])
        cur_ema_nimg = cosine_decay_with_warmup(cur_nimg, **SCHEDULES["ema_half_life"])
        cur_aug_p = cosine_decay_with_warmup(cur_nimg, **SCHEDULES["augment_p"])
        # augment_pipe.p.copy_(misc.constant(cur_aug_p)): misc.constant's dtype is torch's default (float32 in R3GAN's
        # runs; float64 here, the loop run in float64).
        p = torch.tensor(cur_aug_p, dtype=torch.get_default_dtype())
        used.append({"lr": cur_lr, "beta2": cur_beta2, "gamma": cur_gamma, "ema": cur_ema_nimg, "p": p.item()})
        for phase in phases:
            phase["opt"].zero_grad(set_to_none=True)
            phase["module"].requires_grad_(True)
            z = zs.pop(0)
            if phase["name"] == "D":
                trainer.AccumulateDiscriminatorGradients(z, d_img, None, cur_gamma, 1, _preprocessor(draws, p))
            else:  # (the recipe scores the reals first: their draw comes first)
                u_real = draws.next(1)
                draws.queues[1].insert(1, u_real)
                trainer.AccumulateGeneratorGradients(z, g_img, None, 1, _preprocessor(draws, p))
            phase["module"].requires_grad_(False)
            for g in phase["opt"].param_groups:
                g["lr"] = cur_lr
                g["betas"] = (0, cur_beta2)
            phase["opt"].step()
        with torch.no_grad():
            ema_beta = 0.5 ** (BATCH / max(cur_ema_nimg, 1e-8))
            for p_ema, p_ in zip(G_ema.parameters(), G.parameters()):
                p_ema.copy_(p_.lerp(p_ema, ema_beta))
            for b_ema, b in zip(G_ema.buffers(), G.buffers()):
                b_ema.copy_(b)
        cur_nimg += BATCH
    assert not zs
    return G_ema, phases[1]["opt"], phases[0]["opt"], used


class _Values(_Record):
    """`_Record`, and the values the recipe trained each batch with."""

    def __init__(self) -> None:
        super().__init__()
        self.used: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        opt_g, opt_d = (o.param_groups[0] for o in trainer.optimizers)
        assert opt_g["lr"] == opt_d["lr"] and opt_g["betas"] == opt_d["betas"]
        self.used.append(
            {
                "lr": opt_g["lr"],
                "beta2": opt_g["betas"][1],
                "gamma": pl_module.penalties["r2"],
                "ema": pl_module.generator_ema.half_life_images,
                "p": pl_module.augment.p.item(),
            }
        )


def test_the_recipe_equals_r3gans_loop_with_its_schedules(make_cfg):
    """34 iterations of R3GAN's loop (D on one batch, then G on the next, γ/2·(R1 + R2), relativistic, Adam β1 0:
    68 batches) with every schedule
    R3GAN has — the rate (a warm-up, the cosine, the final value), β2, γ (held, then the cosine), the EMA's half-life
    from 0, the augmentation's p (a warm-up) — on a real augmentation: every value used equals R3GAN's to 1e-9 at
    every batch; G, D, G_ema and both Adam states, in float64 (the recipe in 64-true, the loop on float64 copies with
    float64 as torch's default dtype), to 1e-10."""
    cfg = make_cfg(*R3GAN, *BARE, f"trainer.max_steps={2 * ITERATIONS}", "trainer.precision=64-true")
    check_config(cfg)
    datamodule, model = testing.build(cfg)
    G, D = copy.deepcopy(model.generator).double(), copy.deepcopy(model.discriminator).double()
    record = _Values()
    trainer = instantiate(cfg.trainer, callbacks=[record], logger=False, enable_checkpointing=False)
    trainer.fit(model, datamodule=datamodule)
    assert len(record.reals) == 2 * ITERATIONS and model.images_seen == ITERATIONS * BATCH
    assert all(real.dtype == torch.float64 for real in record.reals) and model.augment.p.dtype == torch.float64
    with default_dtype(torch.float64):
        G_ema, opt_g, opt_d, used = _r3gan_loop(G, D, record.reals, record.zs, Draws(record.draws))
    assert record.used[0::2] == record.used[1::2]  # an iteration's values: set at its D batch, kept for its G batch
    for ours, theirs in zip(record.used[1::2], used, strict=True):
        assert ours == pytest.approx(theirs, rel=1e-9, abs=1e-12)
    lrs = [u["lr"] for u in used]
    assert lrs[0] == pytest.approx(LR / 10) and max(lrs) == pytest.approx(LR, rel=1e-3) and lrs[-1] == LR / 4
    for ours, ref in ((model.generator, G), (model.discriminator, D), (model.generator_ema.average, G_ema)):
        for (name, p), q in zip(ours.named_parameters(), ref.parameters(), strict=True):
            assert p.dtype == q.dtype == torch.float64
            torch.testing.assert_close(p.detach(), q.detach(), atol=EXACT, rtol=0, msg=name)
    for ours, ref in zip(trainer.optimizers, (opt_g, opt_d), strict=True):
        for key, state in ref.state_dict()["state"].items():
            for moment in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(ours.state_dict()["state"][key][moment], state[moment], atol=EXACT, rtol=0)


def test_the_curve_is_r3gans_and_linear_is_a_line():
    """`ImagesCurve` (cosine) equals ``cosine_decay_with_warmup`` at every image count around each edge; linear
    goes from base to final along a straight line."""
    for spec in (LR_SCHEDULE, *SCHEDULES.values()):
        curve = ImagesCurve(**spec)
        for images in (0, 1, 31, 159, 160, 161, 319, 320, 321, 500, 959, 960, 961, 5000):
            assert curve(images) == pytest.approx(cosine_decay_with_warmup(images, **spec), rel=1e-12, abs=1e-15)
    line = ImagesCurve(base_value=1.0, final_value=0.0, total_nimg=100, kind="linear")
    assert [line(i) for i in (0, 25, 50, 100, 101)] == pytest.approx([1.0, 0.75, 0.5, 0.0, 0.0])


def test_schedules_resume_exactly(make_cfg, tmp_path, caplog):
    """Stopped inside the warm-up, between a D batch and its G batch, and resumed == straight through, 0.0 on every
    weight (the clock rides in the checkpoint; each value is recomputed from it), with path length on as well; the
    scheduled β2 is not reported as a change of the config's betas."""
    common = (
        *R3GAN,
        *RESUMABLE,
        "model.g_reg_every=2",
        "+model.path_length.weight=2",
    )
    with caplog.at_level("INFO", logger="multiloss"):
        # Stopped after D's 7th step and G's 6th: the resumed run starts on G's own batch (the turn rides in the
        # step counts), mid-epoch.
        runs = straight_and_resumed(make_cfg, tmp_path, common, stop="trainer.max_steps=13", end="trainer.max_steps=18")
    straight, first, resumed = (load_weights(run / "checkpoints/last.ckpt") for run in runs)
    assert all(torch.equal(straight[k], resumed[k]) for k in straight), [
        k for k in straight if not torch.equal(straight[k], resumed[k])
    ]
    assert any(not torch.equal(first[k], straight[k]) for k in straight)
    assert "path_length.pl_mean" in straight and straight["path_length.pl_mean"] > 0
    ckpt = torch.load(runs[2] / "checkpoints/last.ckpt", weights_only=True)
    assert ckpt["gan_images_seen"] == 9 * BATCH and ckpt["gan_d_steps"] == ckpt["gan_g_steps"] == 9
    assert "resuming with" not in caplog.text


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (("+model.schedules.gamma={base_value: 1, final_value: 0.1, total_nimg: 100}",), "model.schedules.gamma"),
        (("+model.schedules.beta={base_value: 1, final_value: 0.1, total_nimg: 100}",), "model.schedules.beta"),
        (
            ("+model.schedules.beta2={base_value: 0.9, final_value: 0.99, total_nimg: 0}",),
            "model.schedules.beta2.total_nimg",
        ),
        (
            ("+model.schedules.augment_p={base_value: 0, final_value: 0.5, total_nimg: 100}",),
            "model.schedules.augment_p",
        ),
        (
            ("+model.schedules.ema_half_life={base_value: 0, final_value: 9, total_nimg: 100}",),
            "model.schedules.ema_half_life",
        ),
        (("scheduler=images", "recipe=multihead"), "model.scheduler._target_"),
        (("+model.path_length.weight=-1",), "model.path_length.weight"),
        (("model.g_reg_every=0",), "model.g_reg_every"),
        (
            (
                "+model.schedules.g_beta2={base_value: 0.9, final_value: 0.99, total_nimg: 9}",
                "optimizer@model.g_optimizer=sgd",
            ),
            "model.schedules.g_beta2",
        ),
        (("model.clean_gradients=maybe",), "model.clean_gradients"),
    ],
)
def test_schedule_and_regularization_mistakes_are_named(make_cfg, tmp_path, overrides, key):
    """γ without a penalty, an unknown schedule, a bad length, p without an augmentation, a half-life without G_ema,
    an images schedule on a recipe that counts no images, a bad path-length option: one message naming the key."""
    base = (
        ("recipe=gan", "model.loss=nonsaturating", "model.penalty=none") if "recipe=multihead" not in overrides else ()
    )
    with pytest.raises(ConfigError) as err:
        train(make_cfg(*base, *overrides, "trainer.max_steps=2", output_dir=tmp_path / "run"))
    assert err.value.key == key
    assert not (tmp_path / "run").exists()
