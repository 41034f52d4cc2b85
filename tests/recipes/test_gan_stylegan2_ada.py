"""stylegan2-ada-pytorch's training loop, its phases written out in plain PyTorch, against ``recipe=gan``.

The reference transcribes NVlabs/stylegan2-ada-pytorch at d72cc7d041b42ec8e806021a205ed9349f87c6a4:

- ``training/training_loop.py`` 197-208 (the phases: ``Gmain``; ``Dmain`` and ``Dreg`` at ``D_reg_interval`` 16,
  D's Adam built with ``lr * mb_ratio`` and ``beta ** mb_ratio``; ``G_reg_interval=None`` here: no path-length
  phase, G's Adam as configured), 270-291 (each phase: ``zero_grad``, ``requires_grad_(True)`` on its module only,
  its loss's backward with ``gain = phase.interval``, ``opt.step()``; a phase runs when ``batch_idx %
  phase.interval == 0``), 296-308 (G_ema: ``ema_nimg = min(ema_kimg * 1000, cur_nimg * ema_rampup)``, ``ema_beta
  = 0.5 ** (batch_size / ema_nimg)``, ``p_ema.copy_(p.lerp(p_ema, ema_beta))``, buffers copied; then ``cur_nimg +=
  batch_size``);
- ``training/loss.py`` 57-131 (``accumulate_gradients``: Gmain softplus(−D(G(z))); Dmain softplus(D(G(z))) then
  softplus(−D(x)), two backward calls; Dreg ``r1_penalty * (r1_gamma / 2)`` on ∇ₓΣD(x) with ``create_graph``,
  ``(real_logits * 0 + loss_Dr1).mean().mul(gain)``; ``training_stats.report('Loss/signs/real', ...)`` in Dmain
  and Dreg); style mixing, the augment pipe's transforms and path length left out (the recipe's options for
  augmentation: ``model.augment``; path length is not ported);
- ``training/training_loop.py`` 311-317 (the ADA heuristic, after ``batch_idx += 1``: every ``ada_interval``
  batches, p += sign(mean of the reported signs − ``ada_target``) · batch · interval / (``ada_kimg`` · 1000), at
  least 0), run with an augmentation that leaves the images unchanged, so that the nets stay the loop's.

One round per phase (stylegan2-ada's ``batch_gpu`` = the batch); the noise is the recipe's (drawn as
`multiloss.testing.gan_noise` draws it) where stylegan2-ada draws ``torch.randn`` per phase.

The recipe's options that make this loop: ``model.loss=nonsaturating model.penalty=r1
model.penalty_weight=<r1_gamma> model.penalty_every=16 model.g_step_after=before model.n_critic=1
+model.g_ema.half_life_images=<ema_kimg·1000> +model.g_ema.rampup=<ema_rampup>``, Adam with betas (0, 0.99)
and eps 1e-8 for both, ``scheduler=constant``.
"""

from __future__ import annotations

import copy

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from torch import nn

from multiloss import testing
from multiloss.config import check_config
from tests.conftest import BARE

BATCH, LATENT, ITERATIONS = 32, 16, 34
R1_GAMMA, D_REG_INTERVAL, EMA_KIMG, EMA_RAMPUP, LR = 0.5, 16, 0.4, 0.05, 0.0025


class ConvGenerator(nn.Module):
    """z → 16 × 2 × 2 → two transposed convolutions → an 8 × 8 digit, returned flat (64 values)."""

    def __init__(self, latent_dim: int = LATENT) -> None:
        super().__init__()
        self.fc = nn.Linear(latent_dim, 16 * 2 * 2)
        self.up = nn.Sequential(
            nn.LeakyReLU(0.2), nn.ConvTranspose2d(16, 8, 4, 2, 1), nn.LeakyReLU(0.2), nn.ConvTranspose2d(8, 1, 4, 2, 1)
        )

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.up(self.fc(z).view(-1, 16, 2, 2)).flatten(1)


class ConvDiscriminator(nn.Module):
    """A flat digit as 1 × 8 × 8 → two strided convolutions → one logit."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 8, 3, 2, 1), nn.LeakyReLU(0.2), nn.Conv2d(8, 16, 3, 2, 1), nn.LeakyReLU(0.2), nn.Flatten()
        )
        self.out = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.net(x.view(-1, 1, 8, 8)))


RECIPE = (
    "recipe=gan",
    *BARE,
    "data=digits",
    f"data.batch_size={BATCH}",
    f"model.latent_dim={LATENT}",
    "model.data_dim=64",
    "model.n_plot_samples=0",
    "~model.generator",
    "~model.discriminator",
    f"+model.generator={{_target_: {__name__}.ConvGenerator}}",
    f"+model.discriminator={{_target_: {__name__}.ConvDiscriminator}}",
    "model.loss=nonsaturating",
    "model.penalty=r1",
    f"model.penalty_weight={R1_GAMMA}",
    f"model.penalty_every={D_REG_INTERVAL}",
    "model.n_critic=1",
    "model.g_step_after=before",
    f"+model.g_ema.half_life_images={EMA_KIMG * 1000}",
    f"+model.g_ema.rampup={EMA_RAMPUP}",
    "optimizer@model.g_optimizer=adam",
    "optimizer@model.d_optimizer=adam",
    f"model.g_optimizer.lr={LR}",
    f"model.d_optimizer.lr={LR}",
    "model.g_optimizer.betas=[0.0,0.99]",
    "model.d_optimizer.betas=[0.0,0.99]",
    "+model.g_optimizer.eps=1e-8",
    "+model.d_optimizer.eps=1e-8",
    "scheduler=constant",
    f"trainer.max_steps={2 * ITERATIONS}",
)


def _accumulate_gradients(phase, G, D, real_img, gen_z, gain, signs=None):
    """training/loss.py ``StyleGAN2Loss.accumulate_gradients``, the phases used here; ``signs``: where its
    ``training_stats.report('Loss/signs/real', real_logits.sign())`` goes (Dmain's and Dreg's)."""
    do_Gmain = phase in ["Gmain", "Gboth"]
    do_Dmain = phase in ["Dmain", "Dboth"]
    do_Dr1 = phase in ["Dreg", "Dboth"] and R1_GAMMA != 0
    if do_Gmain:
        gen_logits = D(G(gen_z))
        loss_Gmain = F.softplus(-gen_logits)  # -log(sigmoid(gen_logits))
        loss_Gmain.mean().mul(gain).backward()
    loss_Dgen = 0
    if do_Dmain:
        gen_logits = D(G(gen_z))
        loss_Dgen = F.softplus(gen_logits)  # -log(1 - sigmoid(gen_logits))
        loss_Dgen.mean().mul(gain).backward()
    if do_Dmain or do_Dr1:
        real_img_tmp = real_img.detach().requires_grad_(do_Dr1)
        real_logits = D(real_img_tmp)
        if signs is not None:
            signs.append(real_logits.detach().sign())
        loss_Dreal = 0
        if do_Dmain:
            loss_Dreal = F.softplus(-real_logits)  # -log(sigmoid(real_logits))
        loss_Dr1 = 0
        if do_Dr1:
            r1_grads = torch.autograd.grad(
                outputs=[real_logits.sum()], inputs=[real_img_tmp], create_graph=True, only_inputs=True
            )[0]
            r1_penalty = r1_grads.square().sum([1])
            loss_Dr1 = r1_penalty * (R1_GAMMA / 2)
        (real_logits * 0 + loss_Dreal + loss_Dr1).mean().mul(gain).backward()


def stylegan_ema_update(G_ema, G, cur_nimg: int, batch_size: int, ema_kimg: float, ema_rampup: float | None) -> None:
    """training/training_loop.py 296-304 (``Gema``), as written there."""
    with torch.no_grad():
        ema_nimg = ema_kimg * 1000
        if ema_rampup is not None:
            ema_nimg = min(ema_nimg, cur_nimg * ema_rampup)
        ema_beta = 0.5 ** (batch_size / max(ema_nimg, 1e-8))
        for p_ema, p in zip(G_ema.parameters(), G.parameters()):
            p_ema.copy_(p.lerp(p_ema, ema_beta))
        for b_ema, b in zip(G_ema.buffers(), G.buffers()):
            b_ema.copy_(b)


def _stylegan2_ada_loop(G, D, reals, noise, ada=None):
    """training/training_loop.py, the phases and the G_ema update, one round per phase; ``noise[i]``: the i-th
    phase's z. ``ada`` = (p, target, interval, kimg): its heuristic after each batch (with an augment pipe that
    leaves the images as they are), the p after each batch returned as well."""
    G_ema = copy.deepcopy(G).eval()
    G.requires_grad_(False)
    D.requires_grad_(False)
    opt_g = torch.optim.Adam(
        G.parameters(), lr=LR, betas=[0.0, 0.99], eps=1e-8
    )  # ([0,0.99] there: torch 2.13 wants floats)
    phases = [{"name": "Gmain", "module": G, "opt": opt_g, "interval": 1}]
    mb_ratio = D_REG_INTERVAL / (D_REG_INTERVAL + 1)
    opt = torch.optim.Adam(D.parameters(), lr=LR * mb_ratio, betas=[beta**mb_ratio for beta in [0.0, 0.99]], eps=1e-8)
    phases += [{"name": "Dmain", "module": D, "opt": opt, "interval": 1}]
    phases += [{"name": "Dreg", "module": D, "opt": opt, "interval": D_REG_INTERVAL}]
    cur_nimg, signs, p_after = 0, [], []
    for batch_idx, real_img in enumerate(reals):
        gen_z = {"Gmain": noise[2 * batch_idx], "Dmain": noise[2 * batch_idx + 1], "Dreg": None}
        for phase in phases:
            if batch_idx % phase["interval"] != 0:
                continue
            phase["opt"].zero_grad(set_to_none=True)
            phase["module"].requires_grad_(True)
            z = gen_z[phase["name"]]
            _accumulate_gradients(phase["name"], G, D, real_img, z, gain=phase["interval"], signs=signs)
            phase["module"].requires_grad_(False)
            for param in phase["module"].parameters():
                if param.grad is not None:
                    torch.nan_to_num(param.grad, nan=0, posinf=1e5, neginf=-1e5, out=param.grad)
            phase["opt"].step()
        stylegan_ema_update(G_ema, G, cur_nimg, BATCH, EMA_KIMG, EMA_RAMPUP)
        cur_nimg += BATCH
        if ada is not None:  # 311-317, after ``batch_idx += 1``; ada_stats.update(): the mean since the last one
            p, target, interval, kimg = ada
            if (batch_idx + 1) % interval == 0:
                r_t = torch.cat(signs).mean().item()
                adjust = np.sign(r_t - target) * (BATCH * interval) / (kimg * 1000)
                ada = (max(p + adjust, 0.0), target, interval, kimg)
                signs = []
            p_after.append(ada[0])
    return G_ema, phases[0]["opt"], opt, (p_after, torch.cat(signs) if signs else torch.zeros(0))


def unchanged(images: torch.Tensor) -> torch.Tensor:
    """An augmentation that leaves the images as they are: ADA's p moves, what D sees does not."""
    return images


class _Record(L.Callback):
    """Each batch's reals, every z G is called on (its own step's, then D's), and ADA's p after the batch."""

    def __init__(self) -> None:
        self.reals: list[torch.Tensor] = []
        self.zs: list[torch.Tensor] = []
        self.p: list[float] = []

    def on_fit_start(self, trainer, pl_module) -> None:
        pl_module.generator.register_forward_pre_hook(lambda module, args: self.zs.append(args[0].detach().clone()))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.reals.append(batch["x"].clone())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if pl_module.augment is not None:
            self.p.append(float(pl_module.augment.p))


def _recipe_and_reference(make_cfg, *options: str, ada=None) -> tuple:
    """The recipe trained for ``ITERATIONS`` batches (the module, its trainer, what `_Record` saw), and the
    reference loop run from its initial weights on its reals and its z (G, D, G_ema, the two Adams, p after each
    batch)."""
    cfg = make_cfg(*RECIPE, *options)
    check_config(cfg)
    datamodule, model = testing.build(cfg)
    G, D = copy.deepcopy(model.generator), copy.deepcopy(model.discriminator)
    record = _Record()
    trainer = instantiate(cfg.trainer, callbacks=[record], logger=False, enable_checkpointing=False)
    trainer.fit(model, datamodule=datamodule)
    assert len(record.reals) == ITERATIONS and model.d_steps == ITERATIONS and len(record.zs) == 2 * ITERATIONS
    return model, trainer, record, (G, D, *_stylegan2_ada_loop(G, D, record.reals, record.zs, ada))


def _assert_equal_nets(model, trainer, G, D, G_ema, opt_g, opt_d) -> float:
    """G, D, G_ema and both Adam states equal to 1e-6; the largest weight difference."""
    worst = 0.0
    for ours, ref in ((model.generator, G), (model.discriminator, D), (model.generator_ema.average, G_ema)):
        for (name, p), q in zip(ours.named_parameters(), ref.parameters(), strict=True):
            worst = max(worst, (p.detach() - q.detach()).abs().max().item())
            torch.testing.assert_close(p.detach(), q.detach(), atol=1e-6, rtol=0, msg=name)
    for ours, ref in zip(trainer.optimizers, (opt_g, opt_d), strict=True):
        ours_state, ref_state = ours.state_dict()["state"], ref.state_dict()["state"]
        assert ours_state.keys() == ref_state.keys()
        for key in ref_state:
            assert int(ours_state[key]["step"]) == int(ref_state[key]["step"])
            for moment in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(ours_state[key][moment], ref_state[key][moment], atol=1e-6, rtol=0)
    assert int(opt_d.state_dict()["state"][0]["step"]) == ITERATIONS + 3  # D: 34 main steps and the 3 lazy ones
    return worst


def test_the_recipe_equals_stylegan2_adas_loop(make_cfg):
    """34 iterations (Dreg at 0, 16 and 32) on the digits with conv nets: G, D, G_ema and both Adam states equal
    the reference's to 1e-6."""
    model, trainer, record, (G, D, G_ema, opt_g, opt_d, _) = _recipe_and_reference(make_cfg)
    # Per batch the recipe draws G's noise (its step comes first), then D's (z, ε): the z G was called on.
    noise = testing.gan_noise(model.noise_seed, BATCH, LATENT, draws=2 * ITERATIONS)
    assert all(torch.equal(z, drawn) for z, (drawn, _) in zip(record.zs, noise, strict=True))
    worst = _assert_equal_nets(model, trainer, G, D, G_ema, opt_g, opt_d)
    print(f"stylegan2-ada loop vs recipe, {ITERATIONS} iterations: largest weight difference {worst:.2g}")


ADA = (0.0, 0.6, 4, 1)  # stylegan2-ada's p = 0 start, ada_target, ada_interval; ada_kimg 1: steps of 0.128


def test_adas_heuristic_equals_stylegan2_adas(make_cfg):
    """ADA on the same loop, its augmentation one that leaves images unchanged (so the nets are the loop's as
    above): p after every batch equals stylegan2-ada's heuristic (training_loop.py 311-317) fed the signs its
    ``Dmain`` and ``Dreg`` phases report — 8 moves, after batches 4, 8, …, 32 — and it did move; the sums kept for
    the next move are the reference's signs since its last (batch 33's Dmain and Dreg, batch 34's: 96)."""
    p, target, interval, kimg = ADA
    options = (
        f"+model.augment.transform={__name__}.unchanged",
        f"+model.augment.p={p}",
        f"+model.augment.ada_target={target}",
        f"+model.augment.ada_interval={interval}",
        f"+model.augment.ada_kimg={kimg}",
    )
    model, trainer, record, (G, D, G_ema, opt_g, opt_d, ada) = _recipe_and_reference(make_cfg, *options, ada=ADA)
    _assert_equal_nets(model, trainer, G, D, G_ema, opt_g, opt_d)
    p_ref, pending = ada
    assert record.p == pytest.approx(p_ref, abs=1e-12)
    assert model.augment.signs.tolist() == [pending.sum().item(), len(pending)] and len(pending) == 3 * BATCH
    assert len(set(p_ref)) > 2 and p_ref[:3] == [p] * 3  # moved, and not before the 4th batch
