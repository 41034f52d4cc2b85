"""stylegan2-ada-pytorch's training loop, its phases written out in plain PyTorch, against ``recipe=gan``.

The reference transcribes NVlabs/stylegan2-ada-pytorch at d72cc7d041b42ec8e806021a205ed9349f87c6a4:

- ``training/training_loop.py`` 197-208 (the phases: ``Gmain`` and ``Greg`` at ``G_reg_interval`` (None: ``Gboth``
  without path length, G's Adam as configured; 4: G's Adam corrected, with or without path length), ``Dmain`` and
  ``Dreg`` at ``D_reg_interval`` 16, each lazy module's Adam built with ``lr * mb_ratio`` and ``beta ** mb_ratio``),
  270-292 (each phase: ``zero_grad``, ``requires_grad_(True)`` on its module only, its loss's backward with ``gain =
  phase.interval``, the gradients' ``nan_to_num``, ``opt.step()``; a phase runs when ``batch_idx % phase.interval
  == 0``), 296-308 (G_ema: ``ema_nimg = min(ema_kimg * 1000, cur_nimg * ema_rampup)``, ``ema_beta
  = 0.5 ** (batch_size / ema_nimg)``, ``p_ema.copy_(p.lerp(p_ema, ema_beta))``, buffers copied; then ``cur_nimg +=
  batch_size``);
- ``training/loss.py`` 38-131 (``run_G``: mapping then synthesis, style mixing off; ``run_D`` through the augment
  pipe; ``accumulate_gradients``: Gmain softplus(−D(G(z))); Gpl 77-92, path length on the mapping's output with
  ``pl_batch_shrink``, ``pl_decay``, ``pl_weight``; Dmain softplus(D(G(z))) then softplus(−D(x)), two backward
  calls; Dreg ``r1_penalty * (r1_gamma / 2)`` on ∇ₓΣD(x) with ``create_graph``, ``(real_logits * 0 +
  loss_Dr1).mean().mul(gain)``; ``training_stats.report('Loss/signs/real', ...)`` in Dmain and Dreg); the augment
  pipe is one transform here (a left-right flip of each image drawn with probability p, the recipe's
  ``model.augment.transform``), where stylegan2-ada's AugmentPipe chains 18 with p each;
- ``training/training_loop.py`` 311-317 (the ADA heuristic, after ``batch_idx += 1``: every ``ada_interval``
  batches, p += sign(mean of the reported signs − ``ada_target``) · batch · interval / (``ada_kimg`` · 1000), at
  least 0; p a float32 tensor as ``augment_pipe.p``).

One round per phase (stylegan2-ada's ``batch_gpu`` = the batch); the random numbers are the recipe's (each phase's
z, the path-length noise, the augmentation's draws, recorded from its noise stream) where stylegan2-ada draws
``torch.randn`` per phase.

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
from multiloss.testing import default_dtype
from tests.conftest import BARE

BATCH, LATENT, ITERATIONS = 32, 16, 34
R1_GAMMA, D_REG_INTERVAL, EMA_KIMG, EMA_RAMPUP, LR = 0.5, 16, 0.4, 0.05, 0.0025
PL_WEIGHT, PL_DECAY, PL_BATCH_SHRINK = 2.0, 0.01, 2  # stylegan2-ada's defaults (loss.py 24)
EXACT = 1e-10  # float64: equal up to rounding, on any CPU (the recipe in 64-true, the loop on float64 copies)


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


class MappedGenerator(nn.Module):
    """StyleGAN's split: ``mapping`` z → w (an MLP), ``synthesis`` w → the image (`ConvGenerator` on w)."""

    def __init__(self, latent_dim: int = LATENT) -> None:
        super().__init__()
        self.mapping = nn.Sequential(nn.Linear(latent_dim, 16), nn.LeakyReLU(0.2), nn.Linear(16, 16))
        self.synthesis = ConvGenerator(16)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.synthesis(self.mapping(z))


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


def conv_digits(batch: int, latent: int = LATENT) -> tuple[str, ...]:
    """The GAN on the digits with the conv nets above (the transcribed loops' setting)."""
    return (
        "recipe=gan",
        "data=digits",
        f"data.batch_size={batch}",
        f"model.latent_dim={latent}",
        "model.data_dim=64",
        "model.n_plot_samples=0",
        "~model.generator",
        "~model.discriminator",
        f"+model.generator={{_target_: {__name__}.ConvGenerator}}",
        f"+model.discriminator={{_target_: {__name__}.ConvDiscriminator}}",
    )


RECIPE = (
    *conv_digits(BATCH),
    *BARE,
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


def xflip(images: torch.Tensor) -> torch.Tensor:
    """A real augmentation: each image mirrored left-right (what D sees changes with p)."""
    return images.flip(-1)


class Draws:
    """The recipe's random numbers in the order it drew them, by width: z rows (LATENT + 1), the augmentation's
    uniforms (1), the path-length noise (64)."""

    def __init__(self, recorded: list[tuple[int, torch.Tensor]]) -> None:
        self.queues = {}
        for width, rows in recorded:
            self.queues.setdefault(width, []).append(rows)

    def next(self, width: int) -> torch.Tensor:
        return self.queues[width].pop(0)


def _run_D(D, img, draws, p):
    """loss.py ``run_D``: through the augment pipe (an x-flip with probability p, its uniform the recipe's)."""
    if draws is None or p is None:
        return D(img)
    u = torch.special.ndtr(draws.next(1))
    images = img.view(-1, 1, 8, 8)
    keep = ((u < p) | (p >= 1)).to(img.dtype).view(-1, 1, 1, 1)
    return D((keep * xflip(images) + (1 - keep) * images).reshape(img.shape))


def _run_G(G, z):
    """loss.py ``run_G`` 38-48, style mixing off: (img, ws); ws = z for a generator without mapping."""
    if isinstance(G, MappedGenerator):
        ws = G.mapping(z).unsqueeze(1)  # (N, num_ws = 1, w_dim), the layout loss.py reads
        return G.synthesis(ws[:, 0]), ws
    return G(z), None


def _accumulate_gradients(phase, G, D, real_img, gen_z, gain, state):
    """training/loss.py ``StyleGAN2Loss.accumulate_gradients`` 57-131, the phases used here; ``state``: the signs
    reported (``Loss/signs/real``), ``pl_mean``, the draws and ADA's p."""
    draws, p = state["draws"], state["p"]
    do_Gmain = phase in ["Gmain", "Gboth"]
    do_Dmain = phase in ["Dmain", "Dboth"]
    do_Gpl = phase in ["Greg", "Gboth"] and state["pl_weight"] != 0
    do_Dr1 = phase in ["Dreg", "Dboth"] and R1_GAMMA != 0
    if do_Gmain:
        gen_img, _gen_ws = _run_G(G, gen_z)
        gen_logits = _run_D(D, gen_img, draws, p)
        loss_Gmain = F.softplus(-gen_logits)  # -log(sigmoid(gen_logits))
        loss_Gmain.mean().mul(gain).backward()
    if do_Gpl:
        batch_size = gen_z.shape[0]  # (the recipe's Greg draws gen_z[:batch // pl_batch_shrink] itself)
        gen_img, gen_ws = _run_G(G, gen_z[:batch_size])
        gen_img = gen_img.view(-1, 1, 8, 8)
        pl_noise = draws.next(64).view_as(gen_img) / np.sqrt(gen_img.shape[2] * gen_img.shape[3])
        pl_grads = torch.autograd.grad(
            outputs=[(gen_img * pl_noise).sum()], inputs=[gen_ws], create_graph=True, only_inputs=True
        )[0]
        pl_lengths = pl_grads.square().sum(2).mean(1).sqrt()
        pl_mean = state["pl_mean"].lerp(pl_lengths.mean(), PL_DECAY)
        state["pl_mean"].copy_(pl_mean.detach())
        pl_penalty = (pl_lengths - pl_mean).square()
        loss_Gpl = pl_penalty * state["pl_weight"]
        (gen_img[:, 0, 0, 0] * 0 + loss_Gpl).mean().mul(gain).backward()
    if do_Dmain:  # (the recipe scores the reals first: their draws come first)
        u_real = draws.next(1) if draws is not None and p is not None else None
        gen_img, _ = _run_G(G, gen_z)
        gen_logits = _run_D(D, gen_img, draws, p)
        loss_Dgen = F.softplus(gen_logits)  # -log(1 - sigmoid(gen_logits))
        loss_Dgen.mean().mul(gain).backward()
        if u_real is not None:
            draws.queues[1].insert(0, u_real)
    if do_Dmain or do_Dr1:
        real_img_tmp = real_img.detach().requires_grad_(do_Dr1)
        real_logits = _run_D(D, real_img_tmp, draws, p)
        state["signs"].append(real_logits.detach().sign())
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


def _stylegan2_ada_loop(G, D, reals, zs, draws=None, ada=None, G_reg_interval=None, pl_weight=0.0):
    """training/training_loop.py, the phases and the G_ema update, one round per phase; ``zs``: every z G was called
    on, in the recipe's order (Gmain's, Greg's, Dmain's). ``ada`` = (p, target, interval, kimg): its heuristic
    after each batch, D seeing x-flipped images with probability p; p after each batch returned as well."""
    G_ema = copy.deepcopy(G).eval()
    G.requires_grad_(False)
    D.requires_grad_(False)
    phases = []
    for name, module, reg_interval in [("G", G, G_reg_interval), ("D", D, D_REG_INTERVAL)]:
        if reg_interval is None:  # ([0,0.99] there: torch 2.13 wants floats)
            opt = torch.optim.Adam(module.parameters(), lr=LR, betas=[0.0, 0.99], eps=1e-8)
            phases += [{"name": name + "both", "module": module, "opt": opt, "interval": 1}]
        else:  # Lazy regularization.
            mb_ratio = reg_interval / (reg_interval + 1)
            betas = [beta**mb_ratio for beta in [0.0, 0.99]]
            opt = torch.optim.Adam(module.parameters(), lr=LR * mb_ratio, betas=betas, eps=1e-8)
            phases += [{"name": name + "main", "module": module, "opt": opt, "interval": 1}]
            phases += [{"name": name + "reg", "module": module, "opt": opt, "interval": reg_interval}]
    p = None if ada is None else torch.tensor(ada[0])  # augment_pipe.p: a buffer of the default dtype (float64 here)
    state = {"signs": [], "pl_mean": torch.zeros([]), "draws": draws, "p": p, "pl_weight": pl_weight}
    cur_nimg, p_after, zs = 0, [], list(zs)
    for batch_idx, real_img in enumerate(reals):
        for phase in phases:
            if batch_idx % phase["interval"] != 0:
                continue
            runs_g = not (phase["name"] == "Dreg" or (phase["name"] == "Greg" and pl_weight == 0))
            z = zs.pop(0) if runs_g else None  # (a phase that runs no G: the recipe draws no z for it)
            phase["opt"].zero_grad(set_to_none=True)
            phase["module"].requires_grad_(True)
            _accumulate_gradients(phase["name"], G, D, real_img, z, gain=phase["interval"], state=state)
            phase["module"].requires_grad_(False)
            for param in phase["module"].parameters():
                if param.grad is not None:
                    torch.nan_to_num(param.grad, nan=0, posinf=1e5, neginf=-1e5, out=param.grad)
            phase["opt"].step()
        stylegan_ema_update(G_ema, G, cur_nimg, BATCH, EMA_KIMG, EMA_RAMPUP)
        cur_nimg += BATCH
        if ada is not None:  # 311-317, after ``batch_idx += 1``; ada_stats.update(): the mean since the last one
            _, target, interval, kimg = ada
            if (batch_idx + 1) % interval == 0:
                r_t = torch.cat(state["signs"]).mean().item()
                adjust = np.sign(r_t - target) * (BATCH * interval) / (kimg * 1000)
                state["p"] = (state["p"] + adjust).max(torch.tensor(0.0))
                state["signs"] = []
            p_after.append(state["p"].item())
    assert not zs, "every z the recipe drew was used"
    pending = torch.cat(state["signs"]) if state["signs"] else torch.zeros(0)
    return G_ema, phases[0]["opt"], phases[-1]["opt"], {"p": p_after, "pending": pending, "pl_mean": state["pl_mean"]}


class _Record(L.Callback):
    """Each batch's reals, every z G is called on, every draw from the noise stream (width, rows), ADA's p after
    the batch."""

    def __init__(self) -> None:
        self.reals: list[torch.Tensor] = []
        self.zs: list[torch.Tensor] = []
        self.draws: list[tuple[int, torch.Tensor]] = []
        self.p: list[float] = []

    def on_fit_start(self, trainer, pl_module) -> None:
        pl_module.generator.register_forward_pre_hook(lambda module, args: self.zs.append(args[0].detach().clone()))
        rows = pl_module._rows

        def recorded(n: int, width: int, everyone: int | None = None) -> torch.Tensor:
            out = rows(n, width, everyone)
            self.draws.append((width, out.clone()))
            return out

        pl_module._rows = recorded

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.reals.append(batch["x"].clone())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if pl_module.augment is not None:
            self.p.append(pl_module.augment.p.item())


def _recipe_and_reference(
    make_cfg, *options: str, ada=None, G_reg_interval=None, pl_weight=0.0, dtype=torch.float64
) -> tuple:
    """The recipe trained for ``ITERATIONS`` batches (the module, its trainer, what `_Record` saw), and the
    reference loop run from its initial weights on its reals and its random numbers (G, D, G_ema, the two Adams, p
    after each batch). In float64 (``trainer.precision=64-true``; the loop on float64 copies, with float64 as torch's
    default dtype, as stylegan2-ada's ``torch.zeros([])`` and ``torch.ones([])`` read it), or ``dtype`` float32."""
    cfg = make_cfg(*RECIPE, *options, *(["trainer.precision=64-true"] if dtype == torch.float64 else []))
    check_config(cfg)
    datamodule, model = testing.build(cfg)
    G, D = copy.deepcopy(model.generator).to(dtype), copy.deepcopy(model.discriminator).to(dtype)
    record = _Record()
    trainer = instantiate(cfg.trainer, callbacks=[record], logger=False, enable_checkpointing=False)
    trainer.fit(model, datamodule=datamodule)
    assert len(record.reals) == ITERATIONS and model.d_steps == ITERATIONS
    assert all(real.dtype == dtype for real in record.reals) and next(model.parameters()).dtype == dtype
    draws = Draws(record.draws)
    with default_dtype(dtype):
        reference = _stylegan2_ada_loop(G, D, record.reals, record.zs, draws, ada, G_reg_interval, pl_weight)
    return model, trainer, record, (G, D, *reference)


def _assert_equal_nets(model, trainer, G, D, G_ema, opt_g, opt_d, g_steps=ITERATIONS) -> float:
    """G, D, G_ema and both Adam states equal: to 1e-10 in float64; in float32 (the ADA test, see there) to 1e-6, a
    bound not derived (both sides run the same operations in the same order: 0.0 measured); the largest weight
    difference."""
    worst = 0.0
    atol = EXACT if next(model.parameters()).dtype == torch.float64 else 1e-6
    for ours, ref in ((model.generator, G), (model.discriminator, D), (model.generator_ema.average, G_ema)):
        for (name, p), q in zip(ours.named_parameters(), ref.parameters(), strict=True):
            assert p.dtype == q.dtype, f"{name}: {p.dtype} vs {q.dtype}"
            worst = max(worst, (p.detach() - q.detach()).abs().max().item())
            torch.testing.assert_close(p.detach(), q.detach(), atol=atol, rtol=0, msg=name)
    for ours, ref in zip(trainer.optimizers, (opt_g, opt_d), strict=True):
        ours_state, ref_state = ours.state_dict(), ref.state_dict()
        assert ours_state["param_groups"][0]["lr"] == pytest.approx(ref_state["param_groups"][0]["lr"], rel=1e-12)
        assert ours_state["param_groups"][0]["betas"] == pytest.approx(ref_state["param_groups"][0]["betas"])
        assert ours_state["state"].keys() == ref_state["state"].keys()
        for key in ref_state["state"]:
            assert int(ours_state["state"][key]["step"]) == int(ref_state["state"][key]["step"])
            for moment in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(
                    ours_state["state"][key][moment], ref_state["state"][key][moment], atol=atol, rtol=0
                )
    assert int(opt_d.state_dict()["state"][0]["step"]) == ITERATIONS + 3  # D: 34 main steps and the 3 lazy ones
    assert int(opt_g.state_dict()["state"][0]["step"]) == g_steps
    return worst


def test_the_recipe_equals_stylegan2_adas_loop(make_cfg):
    """34 iterations (Dreg at 0, 16 and 32) on the digits with conv nets: G, D, G_ema and both Adam states equal
    the reference's, in float64 to 1e-10."""
    model, trainer, record, (G, D, G_ema, opt_g, opt_d, _) = _recipe_and_reference(make_cfg)
    # Per batch the recipe draws G's noise (its step comes first), then D's (z, ε): the z G was called on.
    with default_dtype(torch.float64):  # the noise as the 64-true step draws it
        noise = testing.gan_noise(model.noise_seed, BATCH, LATENT, draws=2 * ITERATIONS)
    assert all(torch.equal(z, drawn) for z, (drawn, _) in zip(record.zs, noise, strict=True))
    worst = _assert_equal_nets(model, trainer, G, D, G_ema, opt_g, opt_d)
    print(f"stylegan2-ada loop vs recipe, {ITERATIONS} iterations: largest weight difference {worst:.2g}")


PATH_LENGTH = (
    "model.g_reg_every=4",
    f"+model.path_length.weight={PL_WEIGHT}",
    f"+model.path_length.decay={PL_DECAY}",
    f"+model.path_length.batch_shrink={PL_BATCH_SHRINK}",
    "~model.generator",
    f"+model.generator={{_target_: {__name__}.MappedGenerator}}",
)


def test_path_length_equals_stylegan2_adas_greg_phase(make_cfg):
    """stylegan2-ada's four phases (Gmain, Greg every 4 on the mapping's output w, Dmain, Dreg every 16), 34
    iterations: G, D, G_ema, both Adams (G's at lr·4/5, betas^(4/5): 34 main steps and 9 Greg steps) and pl_mean
    equal the reference's, in float64 to 1e-10; pl_mean moved."""
    model, trainer, record, (G, D, G_ema, opt_g, opt_d, kept) = _recipe_and_reference(
        make_cfg, *PATH_LENGTH, G_reg_interval=4, pl_weight=PL_WEIGHT
    )
    assert [len(z) for z in record.zs[:3]] == [BATCH, BATCH // PL_BATCH_SHRINK, BATCH]  # Gmain, Greg, Dmain
    worst = _assert_equal_nets(model, trainer, G, D, G_ema, opt_g, opt_d, g_steps=ITERATIONS + 9)
    assert model.path_length.pl_mean.dtype == kept["pl_mean"].dtype == torch.float64
    assert model.path_length.pl_mean.item() == pytest.approx(kept["pl_mean"].item(), rel=0, abs=EXACT)
    assert model.path_length.pl_mean.item() > 0
    print(f"stylegan2-ada with path length vs recipe: largest weight difference {worst:.2g}")


def test_g_reg_every_alone_corrects_gs_adam_as_stylegan2_adas_cifar_config(make_cfg):
    """``G_reg_interval=4`` with ``pl_weight=0`` (stylegan2-ada's cifar config): its Greg phase takes no gradient, but
    G's Adam runs at lr·4/5 and betas^(4/5). ``model.g_reg_every=4`` alone: equal in float64 to 1e-10, no hand-made
    Adam."""
    model, trainer, _, (G, D, G_ema, opt_g, opt_d, _) = _recipe_and_reference(
        make_cfg, "model.g_reg_every=4", G_reg_interval=4, pl_weight=0.0
    )
    assert opt_g.param_groups[0]["lr"] == pytest.approx(LR * 4 / 5)
    _assert_equal_nets(model, trainer, G, D, G_ema, opt_g, opt_d)


ADA = (0.0, 0.6, 4, 1)  # stylegan2-ada's p = 0 start, ada_target, ada_interval; ada_kimg 1: steps of 0.128


def test_adas_heuristic_equals_stylegan2_adas(make_cfg):
    """ADA on the same loop, D seeing each image x-flipped with probability p (a real augmentation: p feeds back
    into what D sees and so into the signs that move p): p after every batch equals its heuristic (training_loop.py
    311-317) fed the signs its ``Dmain`` and ``Dreg`` phases report, 8 moves after batches 4, 8, …, 32, and the nets
    equal the reference's to 1e-10; the sums kept for the next move are the reference's signs since its last (batch
    33's Dmain and Dreg, batch 34's: 96). In float64 (64-true: p a float64 buffer, the step added in p's dtype, as
    stylegan2-ada run in float64 adds it); stylegan2-ada's own float32 p is the same arithmetic in float32."""
    p, target, interval, kimg = ADA
    options = (
        f"+model.augment.transform={__name__}.xflip",
        f"+model.augment.p={p}",
        f"+model.augment.ada_target={target}",
        f"+model.augment.ada_interval={interval}",
        f"+model.augment.ada_kimg={kimg}",
    )
    model, trainer, record, (G, D, G_ema, opt_g, opt_d, ada) = _recipe_and_reference(make_cfg, *options, ada=ADA)
    _assert_equal_nets(model, trainer, G, D, G_ema, opt_g, opt_d)
    p_ref, pending = ada["p"], ada["pending"]
    assert model.augment.p.dtype == torch.float64
    assert record.p == p_ref  # float64 values, bit for bit
    assert model.augment.signs.tolist() == [pending.sum().item(), len(pending)] and len(pending) == 3 * BATCH
    assert len(set(p_ref)) > 2 and p_ref[:3] == [p] * 3  # moved, and not before the 4th batch
    assert max(p_ref) > 0  # so D saw flipped images in some batches
