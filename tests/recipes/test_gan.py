"""`gan`: each step touches only its own network, the gradients equal a plain-PyTorch reference, the
penalty's double backward equals finite differences, and the classic pitfalls fail as documented.

The recipe's gradients are taken from its own training step under the real Trainer (captured just
before each optimizer step); the references are hand-written loops in plain PyTorch.
"""

from __future__ import annotations

import copy
import csv
import math

import lightning as L
import pytest
import torch
from hydra.utils import instantiate

from multiloss import ConfigError, testing, train
from multiloss.base.metrics import ModeCoverage
from multiloss.config import check_config
from multiloss.data.gaussians import GaussianMixtureDataModule, mode_centers
from multiloss.gan.objectives import WassersteinGP
from multiloss.gan.objectives import penalty as gan_penalty
from multiloss.nets import MLP
from multiloss.testing import assert_gradients_close, default_dtype
from tests.conftest import BARE, SMALL_GAN, load_weights
from tests.helpers import straight_and_resumed

BATCH = 64
EXACT = 1e-10  # float64: equal up to rounding, on any CPU (the proofs below run in 64-true)
F64 = ("trainer.precision=64-true",)
G_INDEX, D_INDEX = 0, 1  # configure_optimizers returns [opt_g, opt_d]
# Small and quiet: no validation, no artifacts.
QUICK = (
    "recipe=gan",
    *BARE,
    f"data.batch_size={BATCH}",
    *SMALL_GAN,
    "model.n_plot_samples=0",
)
# The two losses, one critic step per generator step (the shipped default is wgan-gp with n_critic=2).
NS = ("model.loss=nonsaturating", "model.penalty=none", "model.n_critic=1")
GP = ("model.loss=wgan-gp", "model.penalty_weight=0.5", "model.n_critic=1")
# SGD for D, so a reference can apply D's step by hand.
SGD_D = ("optimizer@model.d_optimizer=sgd",)


class Snapshots(L.Callback):
    """Before every optimizer step: which optimizer, every parameter's grad and value; after every batch: the values."""

    def __init__(self) -> None:
        self.steps: list[dict] = []
        self.batch_ends: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.steps.append(
            {
                "optimizer": next(i for i, o in enumerate(trainer.optimizers) if o is optimizer),
                "grads": {n: None if p.grad is None else p.grad.clone() for n, p in pl_module.named_parameters()},
                "weights": {n: p.detach().clone() for n, p in pl_module.named_parameters()},
            }
        )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.batch_ends.append({n: p.detach().clone() for n, p in pl_module.named_parameters()})


def _fit(make_cfg, *overrides, steps: int = 4):
    """A short run of the real Trainer; returns the snapshots, the module at its initial weights, the config."""
    cfg = make_cfg(*QUICK, f"trainer.max_steps={steps}", *overrides)
    check_config(cfg)
    L.seed_everything(cfg.seed)
    datamodule, model = testing.build(cfg)
    initial = copy.deepcopy(model.state_dict())
    snaps = Snapshots()
    trainer = instantiate(cfg.trainer, callbacks=[snaps], logger=False, enable_checkpointing=False)
    trainer.fit(model, datamodule=datamodule)
    model.load_state_dict(initial)
    return snaps, model, cfg


def _first_batch(cfg) -> torch.Tensor:
    return testing.first_batch(testing.build(cfg)[0])["x"]


def _part(tensors: dict, net: str) -> dict:
    return {n: t for n, t in tensors.items() if n.startswith(f"{net}.")}


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[n], b[n]) for n in a)


# --- each step touches only its own network -------------------------------------------------------


@pytest.mark.parametrize("loss", [NS, GP], ids=["nonsaturating", "wgan-gp"])
def test_each_step_touches_only_its_own_network(make_cfg, loss):
    snaps, _, _ = _fit(make_cfg, *loss, steps=4)
    assert [s["optimizer"] for s in snaps.steps] == [D_INDEX, G_INDEX, D_INDEX, G_INDEX]
    for batch in range(2):
        d_step, g_step, after = snaps.steps[2 * batch], snaps.steps[2 * batch + 1], snaps.batch_ends[batch]
        # D's backward filled D's gradients and none of G's.
        assert all(g is None for g in _part(d_step["grads"], "generator").values())
        # (Not each tensor nonzero: WGAN's critic loss D(fake) - D(real) gives its output bias exactly 0.)
        assert all(g is not None for g in _part(d_step["grads"], "discriminator").values())
        assert sum(g.abs().sum() for g in _part(d_step["grads"], "discriminator").values()) > 0
        # G's backward went through D to G's weights, and left D's gradients empty.
        assert all(g is None for g in _part(g_step["grads"], "discriminator").values())
        assert all(g is not None and g.abs().sum() > 0 for g in _part(g_step["grads"], "generator").values())
        # D's step left G's weights unchanged, G's step left D's unchanged ...
        assert _same(_part(d_step["weights"], "generator"), _part(g_step["weights"], "generator"))
        assert _same(_part(g_step["weights"], "discriminator"), _part(after, "discriminator"))
        # ... and each step did move its own network (the checks above are not vacuous).
        assert not _same(_part(d_step["weights"], "discriminator"), _part(g_step["weights"], "discriminator"))
        assert not _same(_part(g_step["weights"], "generator"), _part(after, "generator"))


# --- gradients == an independent plain-PyTorch reference -------------------------------------------


def _reference_d_loss(D, real, fake, eps, loss: str, gp_weight: float) -> torch.Tensor:
    """The hand-written loop, written out: -log σ(D(x)) - log(1 - σ(D(G(z)))), or the WGAN-GP critic loss."""
    if loss == "wgan-gp":
        total = D(fake).mean() - D(real).mean()
    else:
        total = -torch.log(torch.sigmoid(D(real))).mean() - torch.log(1 - torch.sigmoid(D(fake))).mean()
    if gp_weight:
        x_hat = eps * real + (1 - eps) * fake
        x_hat.requires_grad_(True)
        scores = D(x_hat)
        grad_x = torch.autograd.grad(scores, x_hat, grad_outputs=torch.ones_like(scores), create_graph=True)[0]
        total = total + gp_weight * ((torch.sqrt((grad_x**2).sum(dim=1)) - 1) ** 2).mean()
    return total


def _named_grads(loss: torch.Tensor, net: torch.nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    names = [f"{prefix}.{n}" for n, _ in net.named_parameters()]
    return dict(zip(names, torch.autograd.grad(loss, list(net.parameters()))))


@pytest.mark.parametrize("loss", [NS, GP], ids=["nonsaturating", "wgan-gp"])
def test_gradients_equal_plain_pytorch_reference(make_cfg, loss):
    """In float64 (the run in 64-true, the reference on float64 copies): D's and G's gradients to 1e-10."""
    lr = 0.05
    snaps, model, cfg = _fit(make_cfg, *loss, *SGD_D, f"model.d_optimizer.lr={lr}", *F64, steps=2)
    d_step, g_step = snaps.steps
    G, D = copy.deepcopy(model.generator).double(), copy.deepcopy(model.discriminator).double()
    real = _first_batch(cfg).double()
    latent = cfg.model.latent_dim

    # The recipe's noise: one row of latent_dim + 1 normals per sample; the last becomes ε = Φ(row). In float64,
    # as the 64-true step draws it (its default dtype float64).
    noise = torch.Generator().manual_seed(cfg.seed)  # the run's seed, which the config passes as noise_seed
    with default_dtype(torch.float64):
        rows = testing.gan_normals(BATCH, latent + 1, noise)
    z, eps = rows[:, :latent], 0.5 * (1 + torch.erf(rows[:, latent:] / math.sqrt(2)))
    with torch.no_grad():
        fake = G(z)
    gp_weight = cfg.model.penalty_weight if cfg.model.penalty == "gp" else 0.0
    d_loss = _reference_d_loss(D, real, fake, eps, cfg.model.loss, gp_weight)
    d_grads = _named_grads(d_loss, D, "discriminator")
    assert_gradients_close(_part(d_step["grads"], "discriminator"), d_grads, atol=EXACT, rtol=EXACT)

    # SGD step of D by hand, then G's loss through the updated D, on the next noise.
    with torch.no_grad():
        for p, g in zip(D.parameters(), d_grads.values()):
            p -= lr * g
    with default_dtype(torch.float64):
        z = testing.gan_normals(BATCH, latent + 1, noise)[:, :latent]
    d_out = D(G(z))
    g_loss = -d_out.mean() if cfg.model.loss == "wgan-gp" else -torch.log(torch.sigmoid(d_out)).mean()
    g_grads = _named_grads(g_loss, G, "generator")
    assert_gradients_close(_part(g_step["grads"], "generator"), g_grads, atol=EXACT, rtol=EXACT)


MODERN = {
    "hinge+r1": ("model.loss=hinge", "model.penalty=r1", "model.penalty_weight=0.7", "model.n_critic=1"),
    "lsgan+r2": ("model.loss=lsgan", "model.penalty=r2", "model.penalty_weight=0.3", "model.n_critic=1"),
    "relativistic+r1": ("model.loss=relativistic", "model.penalty=r1", "model.penalty_weight=2", "model.n_critic=1"),
    "nonsaturating+gp": ("model.loss=nonsaturating", "model.penalty=gp", "model.penalty_weight=.5", "model.n_critic=1"),
}


@pytest.mark.parametrize("loss", [NS, GP, *MODERN.values()], ids=["nonsaturating", "wgan-gp", *MODERN])
def test_multiloss_testing_references_prove_the_recipe(make_cfg, loss):
    """The public helpers a user proves their own generator/critic with: D's step on the recipe's
    noise == the reference (every loss, every penalty, written from the papers' formulas in
    `multiloss.testing`); then G's step through D after an SGD step by hand == the reference (the
    relativistic G's paired with the batch D saw). In float64 (the steps in 64-true: the module comes back
    float64), to 1e-10."""
    lr = 0.05
    cfg = make_cfg(*QUICK, *loss, *SGD_D, f"model.d_optimizer.lr={lr}")
    datamodule, model = testing.build(cfg)
    d_step, g_step = testing.step_gradients(model, datamodule, steps=2, precision="64-true")
    real = testing.first_batch(datamodule)["x"].double()
    with default_dtype(torch.float64):  # the noise as the 64-true step draws it
        (z, eps), (z_g, _) = testing.gan_noise(cfg.seed, BATCH, model.latent_dim, draws=2)
    with torch.no_grad():
        fake = model.generator(z)
    d_grads = testing.discriminator_gradients(
        model.discriminator, real, fake, model.hparams.loss, model.penalties, eps=eps
    )
    testing.assert_gradients_close(d_step, d_grads, atol=EXACT, rtol=EXACT)
    stepped_d = testing.sgd_step(model.discriminator, d_grads, lr, prefix="discriminator.")
    g_grads = testing.generator_gradients(model.generator, stepped_d, z_g, model.hparams.loss, real=real)
    testing.assert_gradients_close(g_step, g_grads, atol=EXACT, rtol=EXACT)


# --- the gradient penalty's double backward ----------------------------------------------------------


def _tiny_critic_and_batch():
    torch.manual_seed(0)
    critic = MLP(2, 1, width=6, depth=2).double()
    real, fake, eps = torch.randn(5, 2, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64), torch.rand(5, 1)
    return critic, real, fake, eps.double()


def test_gradient_penalty_gradient_matches_finite_differences():
    critic, real, fake, eps = _tiny_critic_and_batch()
    names = [n for n, _ in critic.named_parameters()]

    def penalty(*weights):
        params = dict(zip(names, weights))
        return gan_penalty(WassersteinGP(), lambda x: torch.func.functional_call(critic, params, (x,)), real, fake, eps)

    weights = tuple(p.detach().clone().requires_grad_(True) for p in critic.parameters())
    assert penalty(*weights) > 0
    # gradcheck: autograd's gradient w.r.t. every weight (through create_graph=True) vs central differences.
    # Approximate by nature, in float64: central differences err by h²/6·|f‴| (h = 1e-6: ~1e-13 on this O(1)
    # penalty, smooth but for LeakyReLU kinks, which no point within h of the weights crosses) plus rounding
    # 2⁻⁵³·|f|/h ≈ 1e-10: atol 1e-7 (rtol 1e-5 on O(1) entries) is 1000× that bound.
    assert torch.autograd.gradcheck(penalty, weights, eps=1e-6, atol=1e-7, rtol=1e-5)


def test_gradient_penalty_without_create_graph_gives_the_weights_no_gradient():
    """The failing alternative: without create_graph the penalty is a constant to autograd, silently."""
    critic, real, fake, eps = _tiny_critic_and_batch()
    x_hat = (eps * real + (1 - eps) * fake).requires_grad_(True)
    (grad,) = torch.autograd.grad(critic(x_hat).sum(), x_hat)  # create_graph=False
    flat = ((grad.norm(dim=1) - 1) ** 2).mean()
    assert flat > 0 and not flat.requires_grad  # a number with no graph back to the weights
    right = gan_penalty(WassersteinGP(), critic, real, fake, eps)
    grads = torch.autograd.grad(right, list(critic.parameters()), allow_unused=True)  # (the output bias: unused)
    assert sum(g.abs().sum() for g in grads if g is not None) > 0  # the real penalty does reach them
    torch.testing.assert_close(right, flat, atol=EXACT, rtol=EXACT)  # same value (float64), different gradient


# --- the classic pitfalls, on this module ------------------------------------------------------------


def _module_and_batch(make_cfg):
    datamodule, model = testing.build(make_cfg(*QUICK))
    opt_g, opt_d = model.configure_optimizers()
    return model, opt_g, opt_d, testing.first_batch(datamodule)["x"]


def test_without_detach_the_d_loss_fills_the_generators_gradients(make_cfg):
    model, _, _, real = _module_and_batch(make_cfg)
    fake = model.generator(torch.randn(BATCH, model.latent_dim))  # one fake for both steps, as in the seed

    model.discriminator_losses(real, fake.detach(), with_penalty=False)["d"].backward()
    assert all(p.grad is None for p in model.generator.parameters())  # with detach: G untouched

    model.discriminator_losses(real, fake, with_penalty=False)["d"].backward()  # the mistake
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.generator.parameters())
    # And G's own backward through the same fake now finds that part of the graph freed (the classic error).
    with pytest.raises(RuntimeError, match="Trying to backward through the graph a second time"):
        model.generator_loss(fake).backward()


def test_generator_loss_built_before_d_step_fails_in_place(make_cfg):
    model, opt_g, opt_d, real = _module_and_batch(make_cfg)
    fake = model.generator(torch.randn(BATCH, model.latent_dim))
    g_loss = model.generator_loss(fake)  # the mistake: G's loss through D, built before D's step
    model.discriminator_losses(real, fake.detach(), with_penalty=False)["d"].backward()
    opt_d.step()  # updates D's weights in place, under g_loss's graph
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        g_loss.backward()

    # The recipe's order: the same G loss built after opt_d.step() goes through.
    opt_g.zero_grad(set_to_none=True)
    model.generator_loss(fake).backward()
    assert all(p.grad is not None for p in model.generator.parameters())


# --- schedule, logs, artifacts, learning ---------------------------------------------------------------


def test_n_critic_discriminator_steps_per_generator_step(make_cfg):
    snaps, _, _ = _fit(make_cfg, "model.loss=wgan-gp", "model.n_critic=3", steps=8)
    assert [s["optimizer"] for s in snaps.steps] == [D_INDEX] * 3 + [G_INDEX] + [D_INDEX] * 3 + [G_INDEX]


def test_logs_losses_lrs_metrics_and_writes_samples(make_cfg, tmp_path):
    metrics = train(
        make_cfg(
            "recipe=gan",
            *GP,
            "trainer.accelerator=cpu",
            "trainer.max_epochs=2",
            "trainer.limit_train_batches=6",
            "trainer.limit_val_batches=2",
            *SMALL_GAN,
            output_dir=tmp_path,
        )
    )
    assert {"val/modes", "val/high_quality", "val/loss/d", "val/loss/g"} <= set(metrics)
    assert 0 <= metrics["val/modes"] <= 8 and 0 <= metrics["val/high_quality"] <= 1
    with next((tmp_path / "csv").rglob("metrics.csv")).open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert {"loss/d", "loss/d_real", "loss/d_fake", "loss/gp", "loss/g"} <= set(rows[0])
    # Two optimizers, both learning rates logged, told apart by their param-group names; the linear
    # schedule halves them for the second of two epochs.
    for column in ("lr-Adam/generator", "lr-Adam-1/discriminator"):
        assert {float(r[column]) for r in rows if r[column]} == {1e-3, 5e-4}
    for epoch in range(2):
        assert (tmp_path / f"samples/epoch_{epoch:03d}.png").stat().st_size > 5_000
    assert (tmp_path / "loss_curves.png").stat().st_size > 10_000
    assert (tmp_path / "checkpoints/last.ckpt").is_file()


def test_digits_option_writes_digit_grids(make_cfg, tmp_path):
    train(
        make_cfg(
            "recipe=gan",
            "data=digits",
            "model.data_dim=64",
            "model.latent_dim=8",
            *SMALL_GAN,
            "trainer.accelerator=cpu",
            "trainer.max_steps=6",
            "trainer.limit_val_batches=1",
            "~callbacks.loss_curves",
            output_dir=tmp_path,
        )
    )
    assert (tmp_path / "samples/epoch_000.png").stat().st_size > 5_000


def test_resume_mid_epoch_equals_straight_run(make_cfg, tmp_path):
    """The noise comes from the module's generator, whose state rides in the checkpoint, and the per-epoch LR
    schedule from the checkpoint: stopped mid-epoch 1 and resumed == straight through 3 epochs."""
    small = (
        "recipe=gan",
        *GP,
        "trainer.accelerator=cpu",
        "trainer.max_epochs=4",
        "trainer.limit_train_batches=4",  # 4 batches × (D + G) = 8 steps an epoch
        "trainer.limit_val_batches=0",
        "logger=none",
        "~callbacks.loss_curves",
        f"data.batch_size={BATCH}",
        *SMALL_GAN,
        "model.n_plot_samples=0",
    )
    runs = straight_and_resumed(make_cfg, tmp_path, small, stop="trainer.max_steps=12", end="trainer.max_steps=24")
    straight, first, resumed = (load_weights(run / "checkpoints/last.ckpt") for run in runs)
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    assert any(not torch.equal(first[k], straight[k]) for k in straight)
    # The schedule did move. It steps at each epoch's last batch, as a plain loop's `scheduler.step()` after
    # the epoch: the checkpoint taken when epoch 2 ended holds the rate epoch 3 trains at, 1 - 3/4.
    lrs = torch.load(runs[0] / "checkpoints/last.ckpt", weights_only=True)["optimizer_states"]
    assert [state["param_groups"][0]["lr"] for state in lrs] == pytest.approx([2.5e-4, 2.5e-4])


def test_resume_from_a_max_steps_stop_at_an_epoch_end_equals_straight_run(make_cfg, tmp_path):
    """A max_steps stop exactly at an epoch's last batch: stock Lightning resumes it an epoch too far (a whole
    epoch of data skipped) and a per-epoch schedule stepped at the epoch's end lags one step (7.7e-3 off)."""
    small = (
        "recipe=gan",
        *GP,
        "trainer.accelerator=cpu",
        "trainer.max_epochs=4",
        "trainer.limit_val_batches=0",
        "logger=none",
        "~callbacks.loss_curves",
        "data.n_samples=640",  # 576 training points: 9 batches × (D + G) = 18 steps an epoch
        f"data.batch_size={BATCH}",
        *SMALL_GAN,
        "model.n_plot_samples=0",
    )
    runs = straight_and_resumed(make_cfg, tmp_path, small, stop="trainer.max_steps=18", end="trainer.max_steps=45")
    straight, first, resumed = (load_weights(run / "checkpoints/last.ckpt") for run in runs)
    assert torch.load(runs[1] / "checkpoints/last.ckpt", weights_only=True)["global_step"] == 18
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    assert any(not torch.equal(first[k], straight[k]) for k in straight)


@pytest.mark.slow
def test_default_run_covers_most_modes(make_cfg, tmp_path):
    metrics = train(make_cfg("recipe=gan", "trainer.accelerator=cpu", output_dir=tmp_path))
    assert metrics["val/modes"] >= 6, metrics


# --- configuration ----------------------------------------------------------------------------------


def test_each_optimizer_is_chosen_from_the_optimizer_group(make_cfg):
    cfg = make_cfg("recipe=gan", *SGD_D)
    check_config(cfg)
    _, model = testing.build(cfg)
    opt_g, opt_d = model.configure_optimizers()
    assert isinstance(opt_g, torch.optim.Adam) and isinstance(opt_d, torch.optim.SGD)
    assert {id(p) for p in opt_d.param_groups[0]["params"]} == {id(p) for p in model.discriminator.parameters()}


def test_single_optimizer_key_is_rejected_naming_the_two(make_cfg):
    with pytest.raises(ConfigError) as err:
        check_config(make_cfg("recipe=gan", "optimizer=sgd"))
    assert err.value.key == "model.optimizer"
    assert "g_optimizer" in err.value.message and "d_optimizer" in err.value.message


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("model.n_critic=0", "model.n_critic"),
        ("model.penalty_weight=-1", "model.penalty_weight"),
        ("model.penalty=r3", "model.penalty"),
        ("model.penalty_every=0", "model.penalty_every"),
        ("model.penalty_every=1.5", "model.penalty_every"),
        ("model.accumulate_grad_batches=0", "model.accumulate_grad_batches"),
        ("model.loss=wgan", "model.loss"),
        ("trainer.gradient_clip_val=1.0", "trainer.gradient_clip_val"),  # manual optimization
    ],
)
def test_bad_settings_are_rejected_before_training(make_cfg, tmp_path, override, key):
    with pytest.raises(ConfigError) as err:
        train(make_cfg("recipe=gan", override, output_dir=tmp_path))
    assert err.value.key == key
    assert not (tmp_path / ".hydra").exists()


def test_wgan_gp_without_penalty_is_rejected(make_cfg, tmp_path):
    with pytest.raises(ConfigError) as err:
        train(make_cfg("recipe=gan", "model.loss=wgan-gp", "model.penalty=none", output_dir=tmp_path))
    assert err.value.key == "model.penalty" and "Lipschitz" in err.value.message
    with pytest.raises(ConfigError) as err:
        train(make_cfg("recipe=gan", "model.penalty_every=4", "model.penalty=none", "model.loss=hinge"))
    assert err.value.key == "model.penalty_every"
    with pytest.raises(ConfigError) as err:
        train(make_cfg("recipe=gan", "model.penalty=r1", "model.penalty_weight=0", output_dir=tmp_path))
    assert err.value.key == "model.penalty_weight"
    assert not (tmp_path / ".hydra").exists()


def test_generator_must_make_samples_of_the_datas_shape(make_cfg, tmp_path):
    with pytest.raises(ConfigError) as err:
        train(make_cfg("recipe=gan", "data=digits", "trainer.max_steps=1", output_dir=tmp_path))
    assert err.value.key == "model.generator"
    assert "sample shape (64,)" in err.value.message and "model.data_dim=64" in err.value.message
    assert not (tmp_path / ".hydra").exists()


def test_discriminator_must_give_one_score_per_sample(make_cfg, tmp_path):
    with pytest.raises(ConfigError) as err:
        train(make_cfg("recipe=gan", "model.discriminator.out_features=3", "trainer.max_steps=1", output_dir=tmp_path))
    assert err.value.key == "model.discriminator" and "one score per sample" in err.value.message
    assert not (tmp_path / ".hydra").exists()


# --- the mode-coverage metric ---------------------------------------------------------------------------


def test_mode_coverage_counts_modes_and_high_quality_share():
    data = GaussianMixtureDataModule(n_samples=4000)
    x = data.load()["x"]
    metric = ModeCoverage(data.centers, data.std)
    metric.update(x)
    scores = metric.compute()
    # Real data hits every mode, and 1 - exp(-9/2) = 98.9 % of a 2-D Gaussian lies within 3σ.
    assert scores["modes"] == 8
    # A statistic, not an equality: the share of 4000 draws has standard deviation √(p(1−p)/4000) ≈ 0.0017 for
    # p = 0.989, so 0.006 is 3.6σ (the draws are seeded: the same points every run; a point that one CPU's
    # float32 rounding moved across the 3σ circle shifts the share by 1/4000 = 0.00025).
    assert abs(scores["high_quality"] - (1 - math.exp(-4.5))) < 0.006

    collapsed = data.centers[[0, 1, 2]].repeat(100, 1) + 0.01 * torch.randn(300, 2)
    far = torch.zeros(100, 2)  # the ring's centre: near no mode
    metric = ModeCoverage(data.centers, data.std)
    metric.update(torch.cat([collapsed, far]))
    assert metric.compute()["modes"] == 3
    assert metric.compute()["high_quality"] == pytest.approx(0.75)

    # A mode with far less than its fair share is not "hit": 2 of 400 points near mode 5.
    metric.update(data.centers[[5, 5]])
    assert metric.compute()["modes"] == 3


def test_mode_coverage_states_add_up_across_ranks():
    """What DDP's reduction does (sum the states): two halves merged == the whole."""
    centers = mode_centers("grid", 25, 2.0)
    x = GaussianMixtureDataModule(layout="grid", n_modes=25, std=0.05, n_samples=3000).load()["x"]
    whole, first, second = (ModeCoverage(centers, 0.05) for _ in range(3))
    whole.update(x[:1700])
    first.update(x[:900])
    second.update(x[900:1700])
    first.merge_state(second)
    merged, expected = first.compute(), whole.compute()
    assert all(torch.equal(merged[k], expected[k]) for k in ("modes", "high_quality"))
    assert expected["modes"] == 25


def test_gaussian_data_does_not_depend_on_the_training_seed():
    a = GaussianMixtureDataModule(seed=0).load()["x"]
    b = GaussianMixtureDataModule(seed=1).load()["x"]
    assert torch.equal(a, b)
    assert not torch.equal(a, GaussianMixtureDataModule(sample_seed=1).load()["x"])
    grid = mode_centers("grid", 25, 2.0)
    assert grid.min() == -4 and grid.max() == 4 and len(grid) == 25
