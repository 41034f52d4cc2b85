"""`gan` as GAN researchers train today: R1/R2 penalties, stylegan2-ada's lazy regularization, the losses beyond
WGAN-GP (their gradients: tests/recipes/test_gan.py's reference test, every loss and penalty), and their resume.

The lazy penalty's reference is the plain loop below, its phases and formulas transcribed from
NVlabs/stylegan2-ada-pytorch at d72cc7d041b42ec8e806021a205ed9349f87c6a4:

- ``training/training_loop.py`` 197-208: with ``reg_interval`` N, D's optimizer is built with ``lr * mb_ratio``
  and betas ``beta ** mb_ratio``, ``mb_ratio = N / (N + 1)``; a ``Dmain`` phase every iteration and a ``Dreg``
  phase at interval N; 271-291: a phase runs when ``batch_idx % phase.interval == 0``, with ``gain =
  phase.interval``, each its own ``zero_grad`` … ``opt.step()``;
- ``training/loss.py`` 94-131: ``Dmain`` backwards softplus(D(G(z))) + softplus(−D(x)); ``Dreg`` backwards
  ``(r1_grads.square().sum() * (r1_gamma / 2)).mean().mul(gain)`` with ``r1_grads`` = ∇ₓΣD(x) on the same
  iteration's reals (``create_graph=True``).

Ours runs D's phases, then G's (stylegan2-ada runs G's first in an iteration: the same sequence of steps shifted
by one G step, which the loop's port in a later test accounts for); one round per phase (its ``batch_gpu`` =
the batch: stylegan2-ada sums the rounds' means where multiloss averages its micro-batches).
"""

from __future__ import annotations

import copy
import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate

from multiloss import ConfigError, testing, train
from multiloss.config import check_config
from multiloss.testing import default_dtype
from tests.conftest import BARE, SMALL_GAN, load_checkpoint, load_weights
from tests.helpers import straight_and_resumed
from tests.recipes.test_gan_stylegan2_ada import stylegan_ema_update

BATCH = 64
EXACT = 1e-10  # float64: equal up to rounding, on any CPU (the proofs below run in 64-true, or on float64 copies)
LAZY = (
    "recipe=gan",
    *BARE,
    f"data.batch_size={BATCH}",
    *SMALL_GAN,
    "model.n_plot_samples=0",
    "model.loss=nonsaturating",
    "model.penalty=r1",
    "model.penalty_weight=4.0",  # γ
    "model.penalty_every=4",
    "model.n_critic=1",
    "scheduler=constant",
)


# A run that writes checkpoints (straight_and_resumed): 3 epochs of 6 batches, no validation.
RESUMABLE = (
    "trainer.accelerator=cpu",
    "trainer.limit_val_batches=0",
    "logger=none",
    "~callbacks.loss_curves",
    "trainer.max_epochs=3",
    "trainer.limit_train_batches=6",
)


class Record(L.Callback):
    """Each training batch's real samples, and the weights after the run."""

    def __init__(self) -> None:
        self.reals: list[torch.Tensor] = []
        self.steps_taken = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.reals.append(batch["x"].clone())

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.steps_taken += 1


def _stylegan_lazy_r1_loop(G, D, reals, noise, g_opt, d_opt, gamma: float, interval: int):
    """The reference: D's main phase, its R1 phase every ``interval`` iterations (gain ``interval``), G's main."""
    mb_ratio = interval / (interval + 1)
    opt_g = torch.optim.Adam(G.parameters(), lr=g_opt["lr"], betas=g_opt["betas"])
    opt_d = torch.optim.Adam(
        D.parameters(), lr=d_opt["lr"] * mb_ratio, betas=[beta**mb_ratio for beta in d_opt["betas"]]
    )
    for batch_idx, real_img in enumerate(reals):
        (gen_z, _), (g_z, _) = noise[2 * batch_idx], noise[2 * batch_idx + 1]
        # Dmain
        opt_d.zero_grad(set_to_none=True)
        G.requires_grad_(False)
        gen_logits = D(G(gen_z))
        F.softplus(gen_logits).mean().backward()
        real_logits = D(real_img.detach())
        F.softplus(-real_logits).mean().backward()
        opt_d.step()
        # Dreg
        if batch_idx % interval == 0:
            opt_d.zero_grad(set_to_none=True)
            real_img_tmp = real_img.detach().requires_grad_(True)
            real_logits = D(real_img_tmp)
            (r1_grads,) = torch.autograd.grad([real_logits.sum()], [real_img_tmp], create_graph=True, only_inputs=True)
            r1_penalty = r1_grads.square().sum([1])
            loss_dr1 = r1_penalty * (gamma / 2)
            (real_logits * 0 + loss_dr1).mean().mul(interval).backward()
            opt_d.step()
        # Gmain (through the updated D, whose weights get no gradient)
        G.requires_grad_(True)
        D.requires_grad_(False)
        opt_g.zero_grad(set_to_none=True)
        F.softplus(-D(G(g_z))).mean().backward()
        opt_g.step()
        D.requires_grad_(True)


def test_lazy_r1_equals_stylegan2_adas_phases(make_cfg):
    """9 iterations (R1 phases at 0, 4 and 8) of the recipe == the reference loop, in float64 to 1e-10; the lazy
    steps are not counted in ``trainer.global_step`` (9 D + 9 G) though 11 D steps were taken."""
    iterations = 9
    cfg = make_cfg(*LAZY, f"trainer.max_steps={2 * iterations}", "trainer.precision=64-true")
    check_config(cfg)
    L.seed_everything(cfg.seed)
    datamodule, model = testing.build(cfg)
    G, D = copy.deepcopy(model.generator).double(), copy.deepcopy(model.discriminator).double()
    record = Record()
    trainer = instantiate(cfg.trainer, callbacks=[record], logger=False, enable_checkpointing=False)
    trainer.fit(model, datamodule=datamodule)
    assert trainer.global_step == 2 * iterations and record.steps_taken == 2 * iterations + 3
    assert len(record.reals) == iterations and model.d_steps == iterations

    with default_dtype(torch.float64):  # the noise as the 64-true step draws it
        noise = testing.gan_noise(cfg.seed, BATCH, cfg.model.latent_dim, draws=2 * iterations)
    reals = [real.double() for real in record.reals]
    _stylegan_lazy_r1_loop(
        G, D, reals, noise, cfg.model.g_optimizer, cfg.model.d_optimizer, cfg.model.penalty_weight, 4
    )
    for ours, ref in ((model.generator, G), (model.discriminator, D)):
        for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
            assert p.dtype == q.dtype == torch.float64
            torch.testing.assert_close(p.detach(), q.detach(), atol=EXACT, rtol=0, msg=name)
    # D's Adam corrected once, from the configured rate: lr × 4/5, betas ** (4/5).
    opt_d = trainer.optimizers[1]
    assert opt_d.param_groups[0]["lr"] == pytest.approx(cfg.model.d_optimizer.lr * 0.8)
    assert opt_d.param_groups[0]["betas"] == pytest.approx([b**0.8 for b in cfg.model.d_optimizer.betas])


@pytest.mark.parametrize(
    "options",
    [
        ("model.loss=relativistic", "model.penalty=r1", "model.penalty_every=3", "model.accumulate_grad_batches=2"),
        ("model.loss=hinge", "model.penalty=r2", "model.penalty_weight=0.5", "model.penalty_every=1"),
    ],
    ids=["relativistic+lazy_r1+k2", "hinge+r2"],
)
def test_resume_mid_run_equals_straight_run(make_cfg, tmp_path, options):
    """Stopped between two lazy steps (the D-step count rides in the checkpoint: the phase goes on) and resumed
    == straight through, 0.0 on every weight and Adam state."""
    common = (*(o for o in LAZY if o not in BARE), *RESUMABLE, *options)
    runs = straight_and_resumed(make_cfg, tmp_path, common, stop="trainer.max_steps=10", end="trainer.max_steps=22")
    straight, first, resumed = (load_weights(run / "checkpoints/last.ckpt") for run in runs)
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    assert any(not torch.equal(first[k], straight[k]) for k in straight)
    states = [torch.load(run / "checkpoints/last.ckpt", weights_only=True) for run in runs]
    for a, b in zip(states[0]["optimizer_states"], states[2]["optimizer_states"]):
        for key in a["state"]:
            assert all(torch.equal(a["state"][key][n], b["state"][key][n]) for n in a["state"][key])
    assert states[0]["gan_d_steps"] == states[2]["gan_d_steps"] > states[1]["gan_d_steps"]


def test_a_penalty_refuses_batch_norm_and_the_old_key_still_loads(make_cfg, tmp_path):
    """R1 with a BatchNorm critic: one message naming the discriminator, before a file is written. ``gp_weight``
    (older checkpoints' hyperparameters) still means penalty=gp at that weight, and not beside ``penalty``."""
    from multiloss.recipes.gan import GAN

    mlp = {"_target_": "multiloss.nets.MLP", "in_features": 2, "out_features": 2, "width": 8}
    critic = {"_target_": "multiloss.nets.MLP", "in_features": 2, "out_features": 1, "width": 8}
    old = GAN(generator=mlp, discriminator=critic, loss="wgan-gp", gp_weight=10.0)
    assert old.penalties == {"gp": 10.0}
    assert GAN(generator=mlp, discriminator=critic, gp_weight=0.0).penalties == {}
    assert GAN(generator=mlp, discriminator=critic, gp_weight=2.0, penalty="gp", penalty_weight=0.1).penalties == {
        "gp": 2
    }
    with pytest.raises(ConfigError) as err:
        GAN(generator=mlp, discriminator=critic, gp_weight=1.0, penalty="r1", penalty_weight=1.0)
    assert err.value.key == "gp_weight"
    with pytest.raises(ConfigError) as err:
        train(
            make_cfg(
                *LAZY,
                "trainer.max_steps=2",
                "discriminator=mlp",
                "+model.discriminator.batch_norm=true",
                output_dir=tmp_path / "run",
            )
        )
    assert err.value.key == "model.discriminator" and "penalty=r1" in err.value.message
    assert not (tmp_path / "run" / "checkpoints").exists()


# --- the generator EMA ---------------------------------------------------------------------------------------


def _studiogan_ema(G_ema, G, it: int, decay: float, start_iter: int) -> None:
    """POSTECH-CVLab/PyTorch-StudioGAN 947b35e ``src/utils/ema.py`` 27-40 (``Ema.update``), its parameters' part;
    its buffers are copied here (multiloss's convention; ``Ema`` averages them, see `multiloss.gan.ema`)."""
    decay = 0.0 if 0 <= it < start_iter else decay
    with torch.no_grad():
        for p_ema, p in zip(G_ema.parameters(), G.parameters()):
            p_ema.copy_(p.lerp(p_ema, decay))
        for b_ema, b in zip(G_ema.buffers(), G.buffers()):
            b_ema.copy_(b)


def test_the_ema_follows_both_references_and_copies_batch_norm():
    """Six updates of a generator with BatchNorm: the half-life convention == stylegan2-ada's (with and without its
    ramp-up), the decay convention == StudioGAN's (before and after its start step): weights to 0.0, buffers copied."""
    from multiloss.gan.ema import GeneratorEMA
    from multiloss.nets import MLP

    torch.manual_seed(0)
    G = MLP(3, 4, width=8, batch_norm=True)
    for kwargs, reference in (
        ({"half_life_images": 300.0, "rampup": 0.5}, lambda e, n, i: stylegan_ema_update(e, G, n, 64, 0.3, 0.5)),
        ({"half_life_images": 300.0}, lambda e, n, i: stylegan_ema_update(e, G, n, 64, 0.3, None)),
        ({"decay": 0.9, "start_step": 2}, lambda e, n, i: _studiogan_ema(e, G, i, 0.9, 2)),
    ):
        ema, ref = GeneratorEMA(G, **kwargs), copy.deepcopy(G)
        for i in range(6):
            with torch.no_grad():
                for p in G.parameters():
                    p.add_(torch.randn_like(p))
            G(torch.randn(16, 3))  # moves BatchNorm's running statistics
            ema.count(32)  # two D micro-batches of 32 since the last update
            ema.count(32)
            ema.update(G)
            reference(ref, 64 * i, i)
        for a, b in zip(ema.average.state_dict().values(), ref.state_dict().values()):
            assert torch.equal(a, b)
        assert int(ema.images) == 384 and int(ema.updates) == 6
        assert not torch.equal(next(ema.average.parameters()), next(G.parameters()))  # an average, not a copy
    with pytest.raises(ConfigError) as err:
        GeneratorEMA(G, half_life_images=10.0, decay=0.9)
    assert err.value.key == "g_ema"
    with pytest.raises(ConfigError) as err:
        GeneratorEMA(G, decay=1.0)
    assert err.value.key == "g_ema.decay"


EMA = (
    "recipe=gan",
    f"data.batch_size={BATCH}",
    *SMALL_GAN,
    "model.n_plot_samples=0",
    "model.n_critic=2",
    "+model.g_ema.half_life_images=500",
    "+model.g_ema.rampup=0.5",
    *RESUMABLE,
)


class GeneratorAfterSteps(L.Callback):
    """G's weights after each of its steps."""

    def __init__(self) -> None:
        self.weights: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if pl_module.generator_steps_after(batch_idx):
            self.weights.append({n: p.detach().clone() for n, p in pl_module.generator.state_dict().items()})


def test_the_recipes_ema_is_the_average_of_its_generators_steps(make_cfg):
    """In a real run (n_critic 2: each G step follows 2 × 64 images), G_ema == stylegan2-ada's update applied to G's
    weights after each of its steps; validation and ``forward`` sample from G_ema."""
    cfg = make_cfg(*(o for o in EMA if "callbacks" not in o), "trainer.max_steps=12", "callbacks=none")
    datamodule, model = testing.build(cfg)
    reference = copy.deepcopy(model.generator)
    after = GeneratorAfterSteps()
    trainer = instantiate(cfg.trainer, callbacks=[after], logger=False, enable_checkpointing=False)
    trainer.fit(model, datamodule=datamodule)
    assert len(after.weights) == 4
    G = copy.deepcopy(model.generator)
    for i, weights in enumerate(after.weights):
        G.load_state_dict(weights)
        stylegan_ema_update(reference, G, 128 * i, 128, 0.5, 0.5)
    for a, b in zip(model.generator_ema.average.state_dict().values(), reference.state_dict().values()):
        assert torch.equal(a, b)
    assert int(model.generator_ema.images) == 4 * 128
    z = torch.randn(5, cfg.model.latent_dim)
    assert torch.equal(model(z), reference(z)) and not torch.equal(model(z), model.generator(z))


def test_the_ema_resumes_exactly_and_loads_for_sampling(make_cfg, tmp_path):
    """Stopped mid-epoch and resumed == straight (G_ema's weights and image count, 0.0); ``load_from_checkpoint``
    samples from G_ema."""
    from multiloss.recipes.gan import GAN

    runs = straight_and_resumed(make_cfg, tmp_path, EMA, stop="trainer.max_steps=9", end="trainer.max_steps=27")
    straight, first, resumed = (load_weights(run / "checkpoints/last.ckpt") for run in runs)
    ema_keys = [k for k in straight if k.startswith("generator_ema.")]
    assert "generator_ema.images" in ema_keys and len(ema_keys) > 3
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    assert not torch.equal(first["generator_ema.images"], straight["generator_ema.images"])
    module = GAN.load_from_checkpoint(runs[0] / "checkpoints/last.ckpt", map_location="cpu", weights_only=False)
    z = torch.randn(4, module.latent_dim)
    assert torch.equal(module(z), module.generator_ema.average(z))


# --- augmentation: DiffAugment and ADA -----------------------------------------------------------------------


def _diffaugment_reference(x, policy: str, rand: list, randint: list):
    """mit-han-lab/data-efficient-gans 0b63395 ``DiffAugment_pytorch.py`` 9-76, as written there (its
    ``torch.rand``/``torch.randint`` calls answered from ``rand`` and ``randint`` in order)."""
    import torch.nn.functional as F

    def rand_brightness(x):
        return x + (rand.pop(0) - 0.5)

    def rand_saturation(x):
        x_mean = x.mean(dim=1, keepdim=True)
        return (x - x_mean) * (rand.pop(0) * 2) + x_mean

    def rand_contrast(x):
        x_mean = x.mean(dim=[1, 2, 3], keepdim=True)
        return (x - x_mean) * (rand.pop(0) + 0.5) + x_mean

    def rand_translation(x, ratio=0.125):
        translation_x, translation_y = randint.pop(0), randint.pop(0)
        grid_batch, grid_x, grid_y = torch.meshgrid(
            torch.arange(x.size(0), dtype=torch.long),
            torch.arange(x.size(2), dtype=torch.long),
            torch.arange(x.size(3), dtype=torch.long),
            indexing="ij",
        )
        grid_x = torch.clamp(grid_x + translation_x + 1, 0, x.size(2) + 1)
        grid_y = torch.clamp(grid_y + translation_y + 1, 0, x.size(3) + 1)
        x_pad = F.pad(x, [1, 1, 1, 1, 0, 0, 0, 0])
        return x_pad.permute(0, 2, 3, 1).contiguous()[grid_batch, grid_x, grid_y].permute(0, 3, 1, 2).contiguous()

    def rand_cutout(x, ratio=0.5):
        cutout_size = int(x.size(2) * ratio + 0.5), int(x.size(3) * ratio + 0.5)
        offset_x, offset_y = randint.pop(0), randint.pop(0)
        grid_batch, grid_x, grid_y = torch.meshgrid(
            torch.arange(x.size(0), dtype=torch.long),
            torch.arange(cutout_size[0], dtype=torch.long),
            torch.arange(cutout_size[1], dtype=torch.long),
            indexing="ij",
        )
        grid_x = torch.clamp(grid_x + offset_x - cutout_size[0] // 2, min=0, max=x.size(2) - 1)
        grid_y = torch.clamp(grid_y + offset_y - cutout_size[1] // 2, min=0, max=x.size(3) - 1)
        mask = torch.ones(x.size(0), x.size(2), x.size(3), dtype=x.dtype)
        mask[grid_batch, grid_x, grid_y] = 0
        return x * mask.unsqueeze(1)

    fns = {"color": [rand_brightness, rand_saturation, rand_contrast], "translation": [rand_translation]}
    fns["cutout"] = [rand_cutout]
    for p in policy.split(","):
        for f in fns[p]:
            x = f(x)
    return x.contiguous()


def test_diffaugment_equals_its_reference_and_is_differentiable():
    """Our transforms on given uniforms == DiffAugment's code given the same draws (exact); every integer draw in
    range, each value reached; the gradient flows to the input (G's step through the augmentation)."""
    from multiloss.gan.augment import Augment, _integers, diff_augment

    torch.manual_seed(0)
    x = torch.rand(256, 3, 8, 8, requires_grad=True)
    u = torch.rand(256, 7)
    ours = diff_augment(x, "color,translation,cutout", u)
    rand = [u[:, i].view(-1, 1, 1, 1) for i in range(3)]
    randint = [_integers(u[:, 3], -1, 2), _integers(u[:, 4], -1, 2), _integers(u[:, 5], 0, 9), _integers(u[:, 6], 0, 9)]
    assert sorted(randint[0].unique().tolist()) == [-1, 0, 1] and sorted(randint[2].unique().tolist()) == list(range(9))
    assert torch.equal(ours, _diffaugment_reference(x, "color,translation,cutout", rand, randint))
    ours.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    # p: each sample augmented with probability p (here half of them), the rest passed through unchanged.
    augment = Augment(policy="translation", p=0.5)
    augment.set_sample_shape((64,))  # the digits' 64 features as one 8 × 8 channel
    flat = torch.rand(1000, 64)
    draws = torch.rand(1000, augment.draws)
    out = augment(flat, draws)
    unchanged = (out == flat).all(dim=1)
    assert torch.equal(unchanged[draws[:, 0] >= 0.5], torch.ones(int((draws[:, 0] >= 0.5).sum()), dtype=torch.bool))
    assert 400 < int((~unchanged).sum()) < 600  # (a translation by (0, 0) leaves a sample as it was)
    with pytest.raises(ConfigError) as err:
        Augment(policy="color,zoom")
    assert err.value.key == "augment.policy"
    with pytest.raises(ConfigError) as err:
        Augment(policy="color").set_sample_shape((2,))
    assert err.value.key == "model.augment" and "(2,)" in err.value.message


def test_ada_moves_p_by_the_sign_of_r_t():
    """stylegan2-ada's update: r_t above the target raises p by interval images / (kimg · 1000); below lowers it,
    never under 0."""
    from multiloss.gan.augment import Augment

    ada = Augment(policy="color", p=0.0, ada_target=0.6, ada_interval=4, ada_kimg=2)
    ada.observe(ada.statistic(torch.tensor([1.0, 2.0, -1.0, 3.0])))  # r_t = 0.5 < 0.6: down, clamped at 0
    ada.adjust(images=256)
    assert float(ada.p) == 0.0 and ada.signs.sum() == 0
    ada.observe(ada.statistic(torch.tensor([1.0, 2.0, 1.0, -3.0, 5.0])))  # 0.6 … and one more positive: 4/6
    ada.observe(ada.statistic(torch.tensor([0.5])))
    ada.adjust(images=256)
    assert float(ada.p) == pytest.approx(256 / 2000)


ADA = (
    "recipe=gan",
    "data=digits",
    "model.data_dim=64",
    "model.latent_dim=8",
    "data.batch_size=32",
    *SMALL_GAN,
    "model.n_plot_samples=0",
    "model.loss=nonsaturating",
    "model.penalty=r1",
    "model.penalty_weight=0.1",
    "model.penalty_every=3",
    "+model.augment.policy=[color,translation,cutout]",
    "+model.augment.p=0.2",
    "+model.augment.ada_target=0.6",
    "+model.augment.ada_interval=2",
    "+model.augment.ada_kimg=1",
    "trainer.accelerator=cpu",
    "trainer.limit_val_batches=0",
    "logger=none",
    "~callbacks.loss_curves",
    "trainer.max_epochs=3",
    "trainer.limit_train_batches=8",
)


def test_ada_r_t_counts_the_lazy_r1_steps_reals(make_cfg, tmp_path):
    """r_t averages the signs of every real D scored in the interval, the lazy R1 step's too (stylegan2-ada's
    ``Dr1`` phase reports ``Loss/signs/real`` as ``Dmain`` does): with an interval longer than the run, the sums
    at the end hold each D step's 32 reals plus 32 for each of its lazy R1 steps (every 3rd, from the 0th)."""
    from multiloss.saving.saved_state import D_STEPS_KEY

    options = [o for o in ADA if not o.startswith("+model.augment.ada_interval")]
    train(make_cfg(*options, "+model.augment.ada_interval=1000", output_dir=tmp_path / "run"))
    checkpoint = load_checkpoint(tmp_path / "run/checkpoints/last.ckpt")
    d_steps, (signs, count) = checkpoint[D_STEPS_KEY], checkpoint["state_dict"]["augment.signs"].tolist()
    assert d_steps == 24
    assert count == sum(32 * (1 + (d % 3 == 0)) for d in range(d_steps)) and abs(signs) <= count


@pytest.mark.parametrize("kind", ["r1", "r2"])
def test_a_penalty_every_step_differentiates_the_scores_the_loss_saw(make_cfg, kind):
    """R1 (R2) every step, D's inputs augmented: D scores the reals and the fakes once each (stylegan2-ada's
    ``Dboth`` phase, R3GAN's step), and the penalty is ½·E‖∇ₓD(aug(x))‖² at the very augmentation draw its loss
    terms scored — the noise stream moves by the two batches' draws, not by a third for the penalty. In float64 (the
    module, the samples and, as in a 64-true step, the default dtype the draws come out in), to 1e-10."""
    cfg = make_cfg(
        *(o for o in ADA if "penalty" not in o and "augment" not in o),
        f"model.penalty={kind}",
        "model.penalty_weight=0.1",
        "+model.augment.policy=[color,translation,cutout]",
    )
    _, model = testing.build(cfg)
    model.double().augment.set_sample_shape((64,))
    with default_dtype(torch.float64):
        real, fake = torch.rand(16, 64, generator=torch.Generator().manual_seed(1)) * 2 - 1, torch.randn(16, 64)
        stream = torch.Generator().set_state(model._noise_generator().get_state())
        losses = model.discriminator_losses(real, fake)

        u_real, u_fake = (torch.special.ndtr(testing.gan_normals(16, model.augment.draws, stream)) for _ in "rf")
        assert torch.equal(stream.get_state(), model._noise_generator().get_state())
        x = (real if kind == "r1" else fake).clone().requires_grad_(True)
        d_real = model.discriminator(model.augment(x if kind == "r1" else real, u_real))
        d_fake = model.discriminator(model.augment(x if kind == "r2" else fake, u_fake))
        (grad,) = torch.autograd.grad((d_real if kind == "r1" else d_fake).sum(), x)
    expected = 0.5 * grad.square().sum(dim=1).mean()
    assert expected.dtype == losses[kind].dtype == torch.float64 and expected > 0
    torch.testing.assert_close(losses[kind], expected, rtol=EXACT, atol=0)
    terms = F.softplus(-d_real).mean() + F.softplus(d_fake).mean()
    torch.testing.assert_close(losses["d"], terms + 0.1 * expected, rtol=EXACT, atol=0)


def test_ada_resumes_exactly(make_cfg, tmp_path):
    """Augmented D (lazy R1 through the augmentation), adaptive p: stopped mid-epoch and resumed == straight (0.0:
    weights, p and the running sign sums); p did move."""
    runs = straight_and_resumed(make_cfg, tmp_path, ADA, stop="trainer.max_steps=11", end="trainer.max_steps=30")
    straight, first, resumed = (load_weights(run / "checkpoints/last.ckpt") for run in runs)
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    assert float(straight["augment.p"]) != pytest.approx(0.2) and float(first["augment.p"]) != float(
        straight["augment.p"]
    )


# --- offline quality metrics ----------------------------------------------------------------------------------


def test_the_shipped_digit_classifier_is_the_versioned_one_and_reads_digits():
    from multiloss.gan.digit_features import DIGEST, DigitFeatures, digits_split, weights_digest

    assert weights_digest() == DIGEST  # a retrained or edited file is a new VERSION
    features = DigitFeatures()
    _, _, x, y = digits_split()
    assert (features.classify(x.float()).squeeze(1) == y).float().mean() > 0.97
    stacked = DigitFeatures(3)
    three = torch.cat([x[:5], x[5:10], x[10:15]], dim=1).float()
    assert stacked(three).shape == (5, 192) and torch.equal(
        stacked.classify(three)[:, 1], features.classify(x[5:10].float())[:, 0]
    )


def test_fid_kid_prdc_and_modes_equal_their_definitions():
    """FID == ‖μ_r − μ_f‖² + Tr(Σ_r + Σ_f − 2(Σ_r Σ_f)^½) on the classifier's features (scipy); a set against itself:
    FID ≈ 0, precision = recall = coverage = 1; stacked digits from the data hit ~all 1,000 modes."""
    import numpy as np
    from scipy import linalg

    from multiloss.data import StackedDigitsDataModule
    from multiloss.gan.digit_features import DigitFeatures, digits_split
    from multiloss.gan.metrics import SampleQuality

    _, _, x, _ = digits_split()
    real, fake = x[:180].float(), (x[180:] * 0.7 + 0.1).float()
    quality = SampleQuality((64,))
    quality.update(real, real=True)
    quality.update(fake, real=False)
    scores = quality.compute()
    fr, ff = (DigitFeatures()(t).double().numpy() for t in (real, fake))
    mu_r, mu_f, cov_r, cov_f = fr.mean(0), ff.mean(0), np.cov(fr, rowvar=False), np.cov(ff, rowvar=False)
    covmean = linalg.sqrtm(cov_r @ cov_f).real
    reference = ((mu_r - mu_f) ** 2).sum() + np.trace(cov_r + cov_f - 2 * covmean)
    # Approximate by nature (two square-root algorithms, float64 features): Σ_rΣ_f (‖·‖ ≈ 2.3e3) has 11 zero eigenvalues
    # (dead features); a backward-stable eigensolver moves each by ≲ 64·2⁻⁵³·2.3e3 ≈ 3e-11, which √ turns into
    # ≈ 6e-6, ×2 ×11 ≈ 1.2e-4 absolute, 5e-6 of this FID (≈ 27), plus the float32 result's 6e-8; rel 1e-3 leaves 200×
    # for the non-symmetric product's eigenvector conditioning (measured: 1.6e-8).
    assert float(scores["fid"]) == pytest.approx(reference, rel=1e-3)
    assert 0 < float(scores["precision"]) < 1 and float(scores["kid"]) > 0
    quality.reset()
    quality.update(real, real=True)
    quality.update(real.clone(), real=False)
    same = quality.compute()
    # FID of a set against itself: 2·tr Σ − 2·Σ√λ(Σ²) with Σ² symmetric (‖Σ‖ ≈ 67): each of its 11 zero eigenvalues
    # comes out ≲ 64·2⁻⁵³·67² ≈ 6e-11, √ ≈ 8e-6, ×2 ×11 ≈ 2e-4, and 2·tr Σ (≈ 370) cancels to ≈ 1e-13: 1e-2 is 50×
    # that bound (measured: 7e-12).
    assert abs(float(same["fid"])) < 1e-2 and float(same["precision"]) == float(same["recall"]) == 1.0
    assert float(same["coverage"]) == 1.0
    stacked = StackedDigitsDataModule(val_fraction=0.0).load()
    assert stacked["x"].shape == (20000, 192) and int(stacked["y"].max()) < 1000
    quality = SampleQuality((192,))
    quality.update(stacked["x"][:4000], real=True)
    quality.update(stacked["x"][4000:], real=False)
    modes = quality.compute()
    assert float(modes["modes"]) > 990 and float(modes["kl_modes"]) < 0.1


def test_metrics_are_logged_and_stay_out_of_the_checkpoint(make_cfg, tmp_path):
    """A digits run with the metrics logs them per validation; the feature network is the shipped one, not the
    run's: no checkpoint key of it, and ``load_from_checkpoint`` builds the module as before."""
    from multiloss.recipes.gan import GAN

    overrides = (
        "recipe=gan",
        "data=digits",
        "model.data_dim=64",
        "model.latent_dim=8",
        "+model.metrics.feature=digits",
        "+model.metrics.kid_subset_size=20",
        "model.n_plot_samples=0",
        "trainer.max_steps=4",
        "trainer.val_check_interval=2",
        "trainer.limit_val_batches=2",
        "logger=csv",
    )
    metrics = train(make_cfg(*overrides, output_dir=tmp_path))
    assert all(f"val/{n}" in metrics for n in ("fid", "kid", "precision", "recall", "density", "coverage"))
    checkpoint = tmp_path / "checkpoints/last.ckpt"
    assert not any("quality" in k for k in torch.load(checkpoint, weights_only=True)["state_dict"])
    GAN.load_from_checkpoint(checkpoint, map_location="cpu", weights_only=False)


def test_metrics_need_digit_samples(make_cfg, tmp_path):
    """``feature=digits`` on the 2-D Gaussians: one message naming the key, before a file is written."""
    with pytest.raises(ConfigError) as err:
        train(make_cfg("recipe=gan", "+model.metrics.feature=digits", "trainer.max_steps=1", output_dir=tmp_path / "r"))
    assert err.value.key == "model.metrics.feature" and "(2,)" in err.value.message
    assert not (tmp_path / "r" / "checkpoints").exists()


def _inception_weights() -> str | None:
    """Why torchmetrics' Inception cannot be built here (torch-fidelity missing, its weights not downloadable), or
    None where it can."""
    from torchmetrics.image.fid import FrechetInceptionDistance

    try:
        FrechetInceptionDistance(feature=2048)
    except (ModuleNotFoundError, RuntimeError, OSError) as err:
        return f"{type(err).__name__}: {err}"
    return None


INCEPTION_MISSING = _inception_weights()


@pytest.mark.skipif(INCEPTION_MISSING is None, reason="Inception's weights are present: the other test runs")
def test_inception_without_its_weights_is_one_message_naming_the_key(make_cfg, tmp_path):
    """``feature=inception`` where torch-fidelity or its weights are missing: the key and why, before a file."""
    overrides = ("recipe=gan", "data=digits", "model.data_dim=64", "+model.metrics.feature=inception")
    with pytest.raises(ConfigError) as err:
        train(make_cfg(*overrides, "trainer.max_steps=1", output_dir=tmp_path / "r"))
    assert err.value.key == "model.metrics.feature" and "torch-fidelity" in err.value.message
    assert not (tmp_path / "r" / "checkpoints").exists()


@pytest.mark.skipif(INCEPTION_MISSING is not None, reason=f"no Inception here ({INCEPTION_MISSING})")
def test_inception_features_score_digits_where_its_weights_are():
    """``feature=inception``: torchmetrics' own network on the digits made images; the reals against themselves
    score FID ≈ 0, against noise far more."""
    from sklearn.datasets import load_digits

    from multiloss.gan.metrics import SampleQuality

    reals = torch.from_numpy(load_digits().data[:200]).float() / 16
    scores = {}
    for name, fakes in (("self", reals), ("noise", torch.rand(200, 64))):
        quality = SampleQuality((64,), feature="inception", kid_subset_size=50)
        quality.update(reals, real=True)
        quality.update(fakes, real=False)
        scores[name] = {k: float(v) for k, v in quality.compute().items()}
    # Not an equality: the self-FID of 200 samples of 2048 Inception features (rank ≤ 199: ≥ 1849 zero eigenvalues of
    # Σ², each moved by ≲ 2048·2⁻⁵³·‖Σ‖², √ ≈ 2e-6·‖Σ‖, ×2 ×1849 ≈ 1e-2·‖Σ‖ for ‖Σ‖ of order 1-10): < 1.0.
    assert abs(scores["self"]["fid"]) < 1.0 and scores["noise"]["fid"] > 10 * max(1.0, abs(scores["self"]["fid"]))
    assert scores["noise"]["precision"] < scores["self"]["precision"] == 1.0


# --- penalties under 16-mixed: AMP's gradient-penalty recipe --------------------------------------------------


class _Times(torch.nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


def _tiny_scores_critic(device: str) -> torch.nn.Module:
    """A critic whose scores are multiplied by 1e-8 at the end: the gradients below them are ~1e-9, under float16's
    smallest subnormal (6e-8) unless scaled (its weights themselves are ordinary, as float16 holds them)."""
    torch.manual_seed(0)
    layers = (torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1), _Times(1e-8))
    return torch.nn.Sequential(*layers).to(device)


def test_the_input_gradient_takes_a_scaler_as_amps_recipe_does():
    """Scaled scores, unscaled gradient: the same gradient as without a scaler (float32, CPU, bit for bit), and the
    penalty's gradient reaches D's weights through it."""
    from multiloss.gan.objectives import R1, input_gradient, penalty

    critic, x = _tiny_scores_critic("cpu"), torch.randn(32, 8)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    plain, _ = input_gradient(critic, x)
    scaled, _ = input_gradient(critic, x, scaler)
    # Bit for bit: the scale 2¹⁶, the mean's 1/32 and the unscaling 32/2¹⁶ are powers of two, so every value of the
    # scaled backward is the plain one's × 2¹¹ exactly (all normal float32 numbers, ~1e-9 and up), on any CPU.
    assert torch.equal(scaled, plain)
    value = penalty(R1(), critic, x, x, scaler=scaler)
    assert torch.autograd.grad(value, critic[0].weight)[0].abs().sum() > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="16-mixed needs a CUDA GPU (this machine has none)")
def test_penalties_under_16_mixed_on_a_gpu(make_cfg, tmp_path):
    """On a GPU under float16 autocast: without the scaler the R1 input gradient underflows to 0; with it (the
    recipe's path) it equals float32's to 7 % of its largest value (float16 subnormals). Then a 16-mixed run with
    lazy R1 and G_ema trains, finite."""
    from multiloss.gan.objectives import input_gradient

    critic, x = _tiny_scores_critic("cuda"), torch.randn(32, 8, device="cuda")
    reference, _ = input_gradient(critic, x)
    scaler = torch.amp.GradScaler("cuda")  # its default start, 2**16
    with torch.autocast("cuda", dtype=torch.float16):
        underflow, _ = input_gradient(critic, x)
        scaled, _ = input_gradient(critic, x, scaler)
    assert underflow.abs().max() == 0 and reference.abs().max() > 0
    # float16 behaviour: the scaled gradients (the scores' 2¹¹·1e-8 ≈ 2e-5, the input's ≲ 4.4e-6) are float16
    # subnormals, spaced 2⁻²⁴ ≈ 6e-8: two roundings of ≤ 3e-8 on each of the 16 hidden gradients, summed through W1
    # (Σ|W1| ≤ 3.9), plus the last one, ≲ 2.7e-7 ≈ 6 % of the largest input gradient: atol 7 % of it (+ rtol 5 %).
    torch.testing.assert_close(scaled.float(), reference, rtol=0.05, atol=0.07 * reference.abs().max().item())
    overrides = (
        "recipe=gan",
        "trainer.accelerator=gpu",
        "trainer.devices=1",
        "trainer.precision=16-mixed",
        "model.loss=nonsaturating",
        "model.penalty=r1",
        "model.penalty_weight=1.0",
        "model.penalty_every=4",
        "+model.g_ema.half_life_images=500",
        "model.n_plot_samples=0",
        "trainer.max_steps=24",
        "trainer.limit_val_batches=2",
    )
    metrics = train(make_cfg(*overrides, output_dir=tmp_path))
    assert all(math.isfinite(metrics[k]) for k in ("loss/d", "loss/g", "loss/r1")), metrics


def test_a_sigterm_mid_epoch_and_its_resume_equal_the_straight_run(make_cfg, tmp_path):
    """The modern options together (relativistic, lazy R1, G_ema, DiffAugment + ADA on the digits): a SIGTERM
    mid-epoch 1 (saved as the step it reached) and ``ckpt_path=last`` == the straight run, 0.0 on every weight and
    buffer — G_ema and its image count, p and the sign sums included."""
    from multiloss.callbacks import RunPreempted

    common = (
        *(o for o in ADA if o not in ("trainer.limit_train_batches=8",)),
        "model.loss=relativistic",
        "+model.g_ema.half_life_images=300",
        "+model.g_ema.rampup=0.5",
        "trainer.limit_train_batches=10",
    )
    straight, run = tmp_path / "straight", tmp_path / "run"
    train(make_cfg(*common, output_dir=straight))
    signal = ("+callbacks.signal._target_=tests.helpers.SignalAt", "+callbacks.signal.step=26")  # epoch 1, batch 3
    with pytest.raises(RunPreempted):
        train(make_cfg(*common, *signal, output_dir=run))
    stopped = torch.load(run / "checkpoints/last.ckpt", weights_only=True)
    # The step it reached: mid-epoch 1 (15 steps an epoch: 10 D steps and, n_critic 2, 5 G steps); G_ema has
    # counted every real image D saw.
    assert 15 < stopped["global_step"] < 30
    assert int(stopped["state_dict"]["generator_ema.images"]) == stopped["gan_d_steps"] * 32
    train(make_cfg(*common, "ckpt_path=last", output_dir=run))
    expected, got = (load_weights(r / "checkpoints/last.ckpt") for r in (straight, run))
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)


def test_the_gaussians25_experiment_is_the_measured_configuration(tmp_path):
    """``experiment=gaussians25`` composes to the line the README and docs/recipes.md measured (all 25 modes, ≥ 90 %
    within 3σ in 5 of 5 seeds): the same model and trainer nodes."""
    measured = (
        "recipe=gan",
        "data=gaussians25",
        "trainer.max_epochs=60",
        "model.loss=nonsaturating",
        "model.penalty=r1",
        "model.penalty_weight=0.1",
        "model.n_critic=1",
        "+model.g_ema.half_life_images=20000",
    )
    line = testing.compose(*measured, output_dir=tmp_path)
    experiment = testing.compose("experiment=gaussians25", output_dir=tmp_path)
    assert experiment.model == line.model and experiment.trainer == line.trainer and experiment.data == line.data
    assert experiment.model.g_ema == {"half_life_images": 20000} and experiment.trainer.max_epochs == 60
