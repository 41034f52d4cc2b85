"""The shipped convolutional GAN networks (`multiloss.gan.nets`): the DCGAN pair is pytorch/examples', the StyleGAN2
generator's modulated convolution is stylegan2-ada's, its noise resumes, and each pair trains from the shell on
stacked digits as images and on an image folder.

References: the DCGAN transcription in ``tests/recipes/gan_references.py`` (pytorch/examples ``dcgan/main.py`` at
77f55b9, lines 116-200); ``modulated_conv2d`` below transcribes NVlabs/stylegan2-ada-pytorch ``training/networks.py``
at d72cc7d, lines 27-76, with ``conv2d_resample`` (no resampling, no filter) as ``torch.nn.functional.conv2d``.
"""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest
import torch
from PIL import Image

from multiloss import ConfigError, train
from multiloss.gan.nets import (
    DCGANDiscriminator,
    DCGANGenerator,
    ModulatedConv,
    ResNetDiscriminator,
    StyleGAN2Generator,
)
from tests.recipes.gan_references import DCGANDiscriminator as ScriptDiscriminator
from tests.recipes.gan_references import DCGANGenerator as ScriptGenerator

EXACT = 1e-10  # float64: equal up to rounding, on any CPU


def test_the_dcgan_pair_at_64_is_pytorch_examples():
    """At 64 × 64 with BatchNorm and the Sigmoid, the shipped pair is the script's layer for layer: its weights load
    into the transcription (strict), the outputs agree (in float64, to 1e-10), and dcgan's ``weights_init`` gave the
    same distribution."""
    torch.manual_seed(0)
    ours_g = DCGANGenerator(latent_dim=8, channels=1, resolution=64, width=8).double()
    ours_d = DCGANDiscriminator(channels=1, resolution=64, width=8, batch_norm=True, sigmoid=True).double()
    theirs_g = ScriptGenerator(nz=8, ngf=8, nc=1).double()
    theirs_d = ScriptDiscriminator(ndf=8, nc=1, sigmoid=True).double()
    theirs_g.load_state_dict(ours_g.state_dict())
    theirs_d.load_state_dict(ours_d.state_dict())
    z = torch.randn(6, 8, dtype=torch.float64)
    torch.testing.assert_close(ours_g(z), theirs_g(z), atol=EXACT, rtol=EXACT)
    x = ours_g(z)
    torch.testing.assert_close(ours_d(x).view(-1), theirs_d(x), atol=EXACT, rtol=EXACT)
    conv = ours_g.main[0].weight
    # A statistic of 8 · 64 · 4 · 4 = 8192 draws of N(0, 0.02²) (seeded): the standard errors of their std and mean
    # are 0.02/√(2·8192) ≈ 1.6e-4 and 0.02/√8192 ≈ 2.2e-4, so 0.002 is ≥ 9 of them.
    assert abs(conv.std().item() - 0.02) < 0.002 and abs(conv.mean().item()) < 0.002


@pytest.mark.parametrize("resolution", [8, 32, 64])
def test_every_net_gives_the_resolutions_images_and_one_score(resolution):
    z = torch.randn(3, 16)
    for g in (
        DCGANGenerator(latent_dim=16, resolution=resolution, width=8),
        StyleGAN2Generator(latent_dim=16, resolution=resolution, width=8, w_dim=8),
    ):
        assert g(z).shape == (3, 3, resolution, resolution)
    x = torch.randn(3, 3, resolution, resolution)
    for d in (DCGANDiscriminator(resolution=resolution, width=8), ResNetDiscriminator(resolution=resolution, width=8)):
        assert d(x).shape == (3, 1)
        assert torch.equal(d(x), d(x.flatten(1)))  # flat samples are reshaped on the way in


def modulated_conv2d(x, weight, styles, demodulate=True, padding=0, fused_modconv=True):
    """training/networks.py ``modulated_conv2d`` (27-76), fp32, no noise, up = down = 1, no resample filter."""
    batch_size = x.shape[0]
    _out_channels, in_channels, kh, kw = weight.shape
    w = None
    dcoefs = None
    if demodulate or fused_modconv:
        w = weight.unsqueeze(0)  # [NOIkk]
        w = w * styles.reshape(batch_size, 1, -1, 1, 1)  # [NOIkk]
    if demodulate:
        dcoefs = (w.square().sum(dim=[2, 3, 4]) + 1e-8).rsqrt()  # [NO]
    if demodulate and fused_modconv:
        w = w * dcoefs.reshape(batch_size, -1, 1, 1, 1)  # [NOIkk]
    if not fused_modconv:
        x = x * styles.to(x.dtype).reshape(batch_size, -1, 1, 1)
        x = torch.nn.functional.conv2d(x, weight.to(x.dtype), padding=padding)
        if demodulate:
            x = x * dcoefs.to(x.dtype).reshape(batch_size, -1, 1, 1)
        return x
    x = x.reshape(1, -1, *x.shape[2:])
    w = w.reshape(-1, in_channels, kh, kw)
    x = torch.nn.functional.conv2d(x, w.to(x.dtype), padding=padding, groups=batch_size)
    return x.reshape(batch_size, -1, *x.shape[2:])


@pytest.mark.parametrize("demodulate", [True, False])
@pytest.mark.parametrize("fused", [True, False])
def test_the_modulated_convolution_is_stylegan2_adas(demodulate, fused):
    """Both of stylegan2-ada's forms (fused: a grouped convolution of per-sample weights; not: the input scaled, one
    convolution, the output scaled) equal the shipped layer, in float64 to 1e-10, gradients with respect to w as
    well."""
    torch.manual_seed(0)
    layer = ModulatedConv(8, 5, 6, kernel=3, demodulate=demodulate).double()
    x, w = torch.randn(4, 8, 7, 7, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    ours = layer(x, w)
    styles = layer.affine(w) * layer.weight_gain
    theirs = modulated_conv2d(x, layer.weight, styles, demodulate, padding=1, fused_modconv=fused)
    theirs = theirs + layer.bias.view(1, -1, 1, 1)
    torch.testing.assert_close(ours, theirs, atol=EXACT, rtol=EXACT)
    (g_ours,) = torch.autograd.grad(ours.square().sum(), w)
    (g_theirs,) = torch.autograd.grad(theirs.square().sum(), w)
    assert g_ours.abs().max() > 1e-4
    torch.testing.assert_close(g_ours, g_theirs, atol=EXACT, rtol=EXACT)


def test_stylegan2_noise_is_fresh_resumable_and_fixed_in_evaluation():
    """``random``: two training forwards draw other noise (once the strengths are not 0), a copy loaded from the
    state dict draws what the original draws next (the call count is a buffer); evaluation uses the fixed draw; and
    the forward is synthesis(mapping(z)) — what path length differentiates."""
    torch.manual_seed(0)
    g = StyleGAN2Generator(latent_dim=8, resolution=16, width=8, w_dim=8)
    with torch.no_grad():
        for layer in g.synthesis.layers:
            layer.noise.strength.fill_(0.5)
    z = torch.randn(2, 8)
    first, second = g(z), g(z)
    assert not torch.equal(first, second)
    copy = StyleGAN2Generator(latent_dim=8, resolution=16, width=8, w_dim=8)
    copy.load_state_dict(g.state_dict())
    assert torch.equal(copy(z), g(z)) and int(g.synthesis.noise_calls) == 3
    g.eval()
    assert torch.equal(g(z), g(z))
    assert torch.equal(g(z), g.synthesis(g.mapping(z)))


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("model.generator.resolution=48", "model.generator.resolution"),
        ("model.discriminator.mbstd_group_size=-1", "model.discriminator.mbstd_group_size"),
        ("model.generator.output=relu", "model.generator.output"),
        ("data.resolution=12", "data.resolution"),
    ],
)
def test_bad_net_options_are_named(make_cfg, tmp_path, override, key):
    with pytest.raises(ConfigError) as err:
        train(make_cfg(*STACKED, "generator=stylegan2", "discriminator=resnet", override, output_dir=tmp_path / "r"))
    assert err.value.key == key
    assert not (tmp_path / "r").exists()


# Stacked digits as (3, 16, 16) images: each digit enlarged, the metrics' classifier averaging them back.
STACKED = (
    "recipe=gan",
    "data=stacked_digits",
    "data.resolution=16",
    "data.n_samples=512",
    "data.batch_size=32",
    "model.latent_dim=16",
    "model.n_plot_samples=16",
    "model.loss=relativistic",
    "model.penalty=[r1,r2]",
    "model.penalty_weight=0.05",
    "model.n_critic=1",
    "+model.metrics.feature=digits",
    "+model.metrics.kid_subset_size=20",
    "trainer.max_epochs=1",
    "trainer.limit_train_batches=6",
    "trainer.limit_val_batches=2",
    "trainer.num_sanity_val_steps=0",
    "logger=csv",
)


@pytest.mark.parametrize(
    "nets",
    [
        (
            "generator=stylegan2",
            "discriminator=resnet",
            "model.generator.output=sigmoid",
            "model.generator.width=16",
            "model.generator.w_dim=16",
            "model.discriminator.width=16",
            "model.g_reg_every=4",
            "+model.path_length.weight=2",
        ),
        ("generator=dcgan", "discriminator=dcgan", "model.generator.output=sigmoid", "model.generator.width=8"),
    ],
    ids=["stylegan2-resnet", "dcgan"],
)
def test_the_conv_nets_train_on_stacked_digits_from_the_shell(make_cfg, tmp_path, nets):
    """Each pair at 16 × 16 from the launch line's options (resolution set for both nets): trains, logs the digit
    metrics and the mode count, writes its sample grid."""
    res = ("model.generator.resolution=16", "model.discriminator.resolution=16", "model.discriminator.width=8")
    metrics = train(make_cfg(*STACKED, *nets, *res, "+model.g_ema.half_life_images=500", output_dir=tmp_path))
    assert math.isfinite(metrics["loss/d"]) and metrics["val/modes"] >= 1 and math.isfinite(metrics["val/fid"])
    assert list(tmp_path.rglob("samples/epoch_000.png"))
    if "+model.path_length.weight=2" in nets:
        assert "loss/path_length" in next(csv.reader(next(tmp_path.rglob("metrics.csv")).open()))


def _image_folder(root, n: int = 96, size: int = 16) -> None:
    """Generated RGB images: a disc of a random colour at a random place on a dark background."""
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[:size, :size]
    root.mkdir()
    for i in range(n):
        cy, cx, r = [*rng.uniform(4, size - 4, 2).tolist(), rng.uniform(2, 5)]
        colour = rng.integers(80, 256, 3)
        img = np.zeros((size, size, 3), np.uint8) + 20
        img[(yy - cy) ** 2 + (xx - cx) ** 2 < r**2] = colour
        Image.fromarray(img).save(root / f"{i:03d}.png")


def test_the_conv_nets_train_from_an_image_folder(make_cfg, tmp_path):
    """``data=images`` (PNGs in a folder, values in [-1, 1]) with the StyleGAN2 generator and the residual D at
    their resolution: trains, G_ema on, a sample grid written."""
    _image_folder(tmp_path / "images")
    metrics = train(
        make_cfg(
            "recipe=gan",
            "data=images",
            f"data.path={tmp_path / 'images'}",
            "data.value_range=[-1,1]",
            "data.batch_size=16",
            "generator=stylegan2",
            "discriminator=resnet",
            "model.generator.resolution=16",
            "model.discriminator.resolution=16",
            "model.generator.width=16",
            "model.discriminator.width=16",
            "model.latent_dim=16",
            "model.loss=relativistic",
            "model.penalty=[r1,r2]",
            "model.penalty_weight=0.1",
            "model.n_critic=1",
            "model.n_plot_samples=16",
            "+model.g_ema.half_life_images=200",
            "trainer.max_epochs=1",
            "trainer.limit_val_batches=1",
            "trainer.num_sanity_val_steps=0",
            output_dir=tmp_path / "run",
        )
    )
    assert math.isfinite(metrics["loss/d"]) and math.isfinite(metrics["loss/g"])
    assert list((tmp_path / "run").rglob("samples/epoch_000.png"))


@pytest.mark.parametrize("experiment", ["r3gan", "stylegan2_ada"])
def test_the_loops_experiments_train_from_an_image_folder(make_cfg, tmp_path, experiment):
    """``experiment=r3gan`` and ``experiment=stylegan2_ada`` (the loops' own defaults) on an image folder, made small
    from the shell (8 × 8, narrow nets): every phase runs (R1 + R2 and the schedules; Greg and Dreg), the losses
    finite."""
    _image_folder(tmp_path / "images")
    small = ("model.generator.width=8", "model.generator.w_dim=8", "model.discriminator.width=8")
    metrics = train(
        make_cfg(
            f"experiment={experiment}",
            f"data.path={tmp_path / 'images'}",
            "data.resolution=8",
            "data.batch_size=8",
            "model.latent_dim=8",
            *small,
            "model.n_plot_samples=0",
            "trainer.max_steps=36",
            "trainer.limit_val_batches=0",
            "trainer.num_sanity_val_steps=0",
            output_dir=tmp_path / "run",
        )
    )
    assert math.isfinite(metrics["loss/d"]) and math.isfinite(metrics["loss/g"])
    names = next(csv.reader(next((tmp_path / "run").rglob("metrics.csv")).open()))
    expected = ("loss/r1", "loss/r2") if experiment == "r3gan" else ("loss/r1", "loss/path_length")
    assert set(expected) <= set(names), names


def test_the_stylegan2_pair_with_random_noise_resumes_exactly(make_cfg, tmp_path):
    """The shipped StyleGAN2 G (random noise: its draws counted in a buffer) and residual D, R1 + R2, path length:
    stopped mid-epoch and resumed == straight through, 0.0 on every weight and buffer."""
    from tests.conftest import load_weights
    from tests.helpers import straight_and_resumed
    from tests.recipes.test_gan_modern import RESUMABLE

    common = (
        *(o for o in STACKED if not o.startswith(("trainer.", "logger=", "+model.metrics", "data.resolution"))),
        "data.resolution=8",
        "generator=stylegan2",
        "discriminator=resnet",
        "model.generator.resolution=8",
        "model.generator.width=8",
        "model.generator.w_dim=8",
        "model.discriminator.resolution=8",
        "model.discriminator.width=8",
        "model.g_reg_every=2",
        "+model.path_length.weight=2",
        "+model.g_ema.half_life_images=100",
        "model.n_plot_samples=0",
        *RESUMABLE,
    )
    runs = straight_and_resumed(make_cfg, tmp_path, common, stop="trainer.max_steps=14", end="trainer.max_steps=30")
    straight, first, resumed = (load_weights(run / "checkpoints/last.ckpt") for run in runs)
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    assert any(not torch.equal(first[k], straight[k]) for k in straight)
    assert int(straight["generator.synthesis.noise_calls"]) > 15  # every training forward drew its noise
