"""Convolutional GAN networks for images, sized by ``resolution`` (a power of two ≥ 8: 32 and 64 are the ones
measured): the ``generator`` group's ``dcgan`` and ``stylegan2``, the ``discriminator`` group's ``dcgan`` and
``resnet``.

- `DCGANGenerator` / `DCGANDiscriminator`: pytorch/examples ``dcgan/main.py`` (77f55b9, ``Generator`` 126-159,
  ``Discriminator`` 169-200, ``weights_init`` 116-123), with the number of stride-2 stages following the resolution
  (64 × 64: the script's own four), the final Sigmoid optional (``loss=bce`` wants it; the other losses take
  logits) and D's BatchNorm optional (a gradient penalty needs each sample's own gradient: off).
- `StyleGAN2Generator`: StyleGAN2's generator made small (Karras et al. 2020; NVlabs/stylegan2-ada-pytorch
  ``training/networks.py``): a ``mapping`` network (z normalised, an MLP with a 0.01 learning-rate multiplier, w
  shared by every layer), a ``synthesis`` network (``width`` channels up to 16 × 16, halved at each resolution
  above) from a learned 4 × 4 constant through modulated 3 × 3
  convolutions (weights scaled by the style of w, then demodulated), a noise input per layer with a learned
  strength, and skip ``to_rgb`` outputs summed across resolutions; equalized learning rate throughout. It exposes
  ``mapping`` and ``synthesis``, so path length (``model.path_length``) differentiates w as stylegan2-ada does.
- `ResNetDiscriminator`: StyleGAN2's residual discriminator made small: ``from_rgb``, blocks of two 3 × 3
  convolutions and an average-pool downsampling with a 1 × 1 skip (summed at 1/√2), an optional minibatch
  standard deviation (``mbstd_group_size``; off by default: it mixes a batch's samples, so R1/R2 are no longer
  each sample's own gradient and k micro-batches stop being one batch), then a dense head to one logit.

Samples are (C, H, W) images; a flat sample of C·H·W values (``data.flatten=true``) is reshaped on the way in.
No dataset-specific range is assumed: the generators end in ``output`` (``tanh`` for data in [-1, 1], ``sigmoid``
for [0, 1], ``none``).

Noise inputs (StyleGAN2's ``noise_mode``): ``random`` draws fresh noise every training forward from the module's
own generator, seeded from ``noise_seed`` and a call count kept as a buffer (so a resumed run draws what the
straight run drew) and the rank (each rank its own noise: 2 ranks × b then draw other noise than 1 × 2b, the one
thing that keeps this generator's DDP runs from equalling one rank's); ``const`` uses a fixed draw (a buffer, made
at construction), which evaluation always uses; ``none`` adds none.
"""

from __future__ import annotations

import itertools
import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from multiloss.config import require
from multiloss.nets import check_sizes

OUTPUTS = {"tanh": torch.tanh, "sigmoid": torch.sigmoid, "none": lambda x: x}


def _stages(resolution: int) -> int:
    """Stride-2 stages from 4 × 4 to ``resolution`` (a power of two ≥ 8)."""
    require(
        isinstance(resolution, int) and resolution >= 8 and resolution & (resolution - 1) == 0,
        "resolution",
        resolution,
        "a power of two ≥ 8 (32, 64)",
    )
    return int(math.log2(resolution)) - 2


def channels_at(size: int, width: int) -> int:
    """A layer's channels at ``size`` × ``size``: ``width`` up to 16 × 16, halved at each doubling after (StyleGAN's
    ``min(channel_base // res, channel_max)`` with channel_base = 16 · width): most of the compute is at the top."""
    return max(1, min(width, width * 16 // size))


def _as_images(x: torch.Tensor, channels: int, resolution: int) -> torch.Tensor:
    return x if x.dim() == 4 else x.reshape(len(x), channels, resolution, resolution)


def dcgan_weights_init(m: nn.Module) -> None:
    """dcgan/main.py's ``weights_init`` (116-123): conv weights N(0, 0.02), BatchNorm's N(1, 0.02) and bias 0."""
    classname = m.__class__.__name__
    if classname.find("Conv") != -1:
        nn.init.normal_(m.weight, 0.0, 0.02)
    elif classname.find("BatchNorm") != -1:
        nn.init.normal_(m.weight, 1.0, 0.02)
        nn.init.zeros_(m.bias)


class DCGANGenerator(nn.Module):
    """z (latent_dim) → a (channels, resolution, resolution) image: a 4 × 4 transposed convolution, then stride-2
    transposed convolutions halving the width (``width`` · 2^(stages−1) down to ``width``), BatchNorm (the script's;
    ``batch_norm=false``: none, so k micro-batches are one batch and 2 ranks × b one rank × 2b) and ReLU between,
    ``output`` last (the script's Tanh)."""

    def __init__(
        self,
        latent_dim: int = 100,
        channels: int = 3,
        resolution: int = 64,
        width: int = 64,
        output: Literal["tanh", "sigmoid", "none"] = "tanh",
        batch_norm: bool = True,
    ) -> None:
        super().__init__()
        check_sizes(latent_dim=latent_dim, channels=channels, width=width)
        require(output in OUTPUTS, "output", output, ", ".join(OUTPUTS))
        stages = _stages(resolution)
        widths = [width * 2 ** (stages - 1 - i) for i in range(stages)]  # 64 × 64, width 64: 512, 256, 128, 64
        layers: list[nn.Module] = [nn.ConvTranspose2d(latent_dim, widths[0], 4, 1, 0, bias=False)]
        for w_in, w_out in zip(widths, [*widths[1:], channels]):
            norm = [nn.BatchNorm2d(w_in)] if batch_norm else []
            layers += [*norm, nn.ReLU(True), nn.ConvTranspose2d(w_in, w_out, 4, 2, 1, bias=False)]
        self.main = nn.Sequential(*layers)
        self.latent_dim, self.output = latent_dim, output
        self.apply(dcgan_weights_init)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return OUTPUTS[self.output](self.main(z.view(-1, self.latent_dim, 1, 1)))


class DCGANDiscriminator(nn.Module):
    """A (channels, resolution, resolution) image → one score: stride-2 convolutions doubling the width from
    ``width`` (LeakyReLU 0.2; BatchNorm after all but the first when ``batch_norm``), a 4 × 4 convolution to one
    value, and a Sigmoid when ``sigmoid`` (``loss=bce``: the script's probabilities; else a logit)."""

    def __init__(
        self, channels: int = 3, resolution: int = 64, width: int = 64, batch_norm: bool = False, sigmoid: bool = False
    ) -> None:
        super().__init__()
        check_sizes(channels=channels, width=width)
        stages = _stages(resolution)
        widths = [width * 2**i for i in range(stages)]
        layers: list[nn.Module] = []
        for i, (w_in, w_out) in enumerate(zip([channels, *widths[:-1]], widths)):
            layers.append(nn.Conv2d(w_in, w_out, 4, 2, 1, bias=False))
            if batch_norm and i > 0:
                layers.append(nn.BatchNorm2d(w_out))
            layers.append(nn.LeakyReLU(0.2, inplace=True))
        layers.append(nn.Conv2d(widths[-1], 1, 4, 1, 0, bias=False))
        if sigmoid:
            layers.append(nn.Sigmoid())
        self.main = nn.Sequential(*layers)
        self.channels, self.resolution = channels, resolution
        self.apply(dcgan_weights_init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.main(_as_images(x, self.channels, self.resolution)).view(-1, 1)


# --- StyleGAN2's pieces, small -------------------------------------------------------------------------------


class EqualLinear(nn.Module):
    """A dense layer with StyleGAN's equalized learning rate: weights N(0, 1/lr_mul²) scaled at run time by
    lr_mul/√fan_in, the bias by lr_mul (networks.py ``FullyConnectedLayer``)."""

    def __init__(self, in_features: int, out_features: int, bias_init: float = 0.0, lr_mul: float = 1.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_features, in_features) / lr_mul)
        self.bias = nn.Parameter(torch.full((out_features,), float(bias_init) / lr_mul))
        self.weight_gain, self.bias_gain = lr_mul / math.sqrt(in_features), lr_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight * self.weight_gain, self.bias * self.bias_gain)


class MappingNetwork(nn.Module):
    """z → w: z normalised to unit second moment, ``layers`` equalized dense layers (LeakyReLU 0.2, √2 gain) at a
    learning-rate multiplier of 0.01 (networks.py ``MappingNetwork``, no truncation or w averaging)."""

    def __init__(self, latent_dim: int, w_dim: int, layers: int = 4, lr_mul: float = 0.01) -> None:
        super().__init__()
        dims = [latent_dim] + [w_dim] * layers
        self.fcs = nn.ModuleList(EqualLinear(a, b, lr_mul=lr_mul) for a, b in itertools.pairwise(dims))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        x = z * (z.square().mean(dim=1, keepdim=True) + 1e-8).rsqrt()
        for fc in self.fcs:
            x = F.leaky_relu(fc(x), 0.2) * math.sqrt(2)
        return x


class ModulatedConv(nn.Module):
    """A 3 × 3 (or 1 × 1) convolution whose weights each sample's style scales per input channel (styles =
    affine(w), bias 1), demodulated to unit output variance when ``demodulate`` (networks.py
    ``modulated_conv2d``)."""

    def __init__(self, in_channels: int, out_channels: int, w_dim: int, kernel: int = 3, demodulate: bool = True):
        super().__init__()
        self.affine = EqualLinear(w_dim, in_channels, bias_init=1.0)
        self.weight = nn.Parameter(torch.randn(out_channels, in_channels, kernel, kernel))
        self.bias = nn.Parameter(torch.zeros(out_channels))
        self.demodulate, self.padding = demodulate, kernel // 2
        self.weight_gain = 1 / math.sqrt(in_channels * kernel * kernel)

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # stylegan2-ada's non-fused form (``fused_modconv=False``): the input scaled by the styles, one shared
        # convolution, the output scaled by the demodulation coefficients — the same function as the grouped
        # convolution of per-sample weights, several times faster on a CPU.
        styles = self.affine(w) * self.weight_gain  # (N, in)
        out = F.conv2d(x * styles[:, :, None, None], self.weight, padding=self.padding)
        if self.demodulate:
            weight = self.weight.unsqueeze(0) * styles[:, None, :, None, None]  # (N, out, in, k, k)
            out = out * (weight.square().sum(dim=(2, 3, 4)) + 1e-8).rsqrt()[:, :, None, None]
        return out + self.bias.view(1, -1, 1, 1)


class NoiseInput(nn.Module):
    """Per-pixel noise times a learned strength (0 at first): drawn (``random``), fixed (``const``) or none."""

    def __init__(self, resolution: int) -> None:
        super().__init__()
        self.strength = nn.Parameter(torch.zeros(1))  # (1,), not a scalar: fully_shard refuses 0-d parameters
        self.register_buffer("const", torch.randn(1, 1, resolution, resolution))

    def forward(self, x: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        return x + (self.const if noise is None else noise) * self.strength


class SynthesisLayer(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, w_dim: int, resolution: int, up: bool = False):
        super().__init__()
        self.conv = ModulatedConv(in_channels, out_channels, w_dim)
        self.noise = NoiseInput(resolution)
        self.up, self.resolution = up, resolution

    def forward(self, x: torch.Tensor, w: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        if self.up:
            x = F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)
        x = self.noise(self.conv(x, w), noise)
        return F.leaky_relu(x, 0.2) * math.sqrt(2)


class SynthesisNetwork(nn.Module):
    """w → the image: a learned 4 × 4 constant, two modulated convolutions per resolution (the first upsampling),
    each with its noise, and a ``to_rgb`` (1 × 1, not demodulated) per resolution summed into the upsampled image
    (StyleGAN2's skip architecture)."""

    def __init__(
        self,
        w_dim: int,
        channels: int,
        resolution: int,
        width: int,
        noise_mode: Literal["random", "const", "none"] = "random",
        noise_seed: int = 0,
    ) -> None:
        super().__init__()
        require(noise_mode in ("random", "const", "none"), "noise_mode", noise_mode, "random, const or none")
        stages = _stages(resolution)
        self.const = nn.Parameter(torch.randn(width, 4, 4))
        self.layers = nn.ModuleList([SynthesisLayer(width, width, w_dim, 4)])
        self.to_rgb = nn.ModuleList([ModulatedConv(width, channels, w_dim, kernel=1, demodulate=False)])
        for stage in range(1, stages + 1):
            size = 4 * 2**stage
            c_in, c_out = channels_at(size // 2, width), channels_at(size, width)
            self.layers.append(SynthesisLayer(c_in, c_out, w_dim, size, up=True))
            self.layers.append(SynthesisLayer(c_out, c_out, w_dim, size))
            self.to_rgb.append(ModulatedConv(c_out, channels, w_dim, kernel=1, demodulate=False))
        self.noise_mode, self.noise_seed = noise_mode, noise_seed
        self.register_buffer("noise_calls", torch.zeros((), dtype=torch.long))  # training forwards: the noise's seed
        self._calls: int | None = 0  # its host copy (a GPU buffer read every forward would wait for the device)

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self._calls = None  # read back from the loaded buffer at the next draw

    def noises(self, n: int, device: torch.device) -> list[torch.Tensor | None]:
        """Each layer's noise for ``n`` samples: drawn in training (``random``), the fixed draw else (None)."""
        if self.noise_mode == "none":
            return [torch.zeros((), device=device)] * len(self.layers)
        if self.noise_mode == "const" or not self.training:
            return [None] * len(self.layers)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        calls = int(self.noise_calls) if self._calls is None else self._calls
        self._calls = calls + 1
        self.noise_calls.fill_(calls + 1)
        seed = (self.noise_seed * 1_000_003 + calls) * 4_099 + rank  # one stream a (seed, call, rank)
        generator = torch.Generator(device=device).manual_seed(seed % 2**63)
        return [
            torch.randn(n, 1, layer.resolution, layer.resolution, generator=generator, device=device)
            for layer in self.layers
        ]

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        noises = self.noises(len(w), w.device)
        x = self.const.unsqueeze(0).expand(len(w), -1, -1, -1)
        x = self.layers[0](x, w, noises[0])
        img = self.to_rgb[0](x, w)
        for stage in range(1, len(self.to_rgb)):
            x = self.layers[2 * stage - 1](x, w, noises[2 * stage - 1])
            x = self.layers[2 * stage](x, w, noises[2 * stage])
            img = F.interpolate(img, scale_factor=2, mode="bilinear", align_corners=False) + self.to_rgb[stage](x, w)
        return img


class StyleGAN2Generator(nn.Module):
    """z (latent_dim) → a (channels, resolution, resolution) image through ``mapping`` (z → w) and ``synthesis``
    (w → image), ``output`` last. See the module's docstring."""

    def __init__(
        self,
        latent_dim: int = 64,
        channels: int = 3,
        resolution: int = 32,
        width: int = 64,
        w_dim: int = 64,
        mapping_layers: int = 4,
        noise_mode: Literal["random", "const", "none"] = "random",
        noise_seed: int = 0,
        output: Literal["tanh", "sigmoid", "none"] = "none",
    ) -> None:
        super().__init__()
        check_sizes(latent_dim=latent_dim, channels=channels, width=width, w_dim=w_dim, mapping_layers=mapping_layers)
        require(output in OUTPUTS, "output", output, ", ".join(OUTPUTS))
        self.mapping = MappingNetwork(latent_dim, w_dim, mapping_layers)
        self.synthesis = SynthesisNetwork(w_dim, channels, resolution, width, noise_mode, noise_seed)
        self.output = output

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return OUTPUTS[self.output](self.synthesis(self.mapping(z)))


class EqualConv(nn.Module):
    """A convolution with StyleGAN's equalized learning rate (networks.py ``Conv2dLayer``, no resampling filter)."""

    def __init__(self, in_channels: int, out_channels: int, kernel: int, bias: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_channels, in_channels, kernel, kernel))
        self.bias = nn.Parameter(torch.zeros(out_channels)) if bias else None
        self.weight_gain, self.padding = 1 / math.sqrt(in_channels * kernel * kernel), kernel // 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.weight * self.weight_gain, self.bias, padding=self.padding)


class ResidualBlock(nn.Module):
    """Two 3 × 3 convolutions (LeakyReLU 0.2, √2 gain), a 2 × 2 average pool; plus the pooled input through a 1 × 1
    convolution without bias; the sum times 1/√2 (networks.py ``DiscriminatorBlock``, ``architecture='resnet'``)."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.conv0, self.conv1 = EqualConv(in_channels, in_channels, 3), EqualConv(in_channels, out_channels, 3)
        self.skip = EqualConv(in_channels, out_channels, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.skip(F.avg_pool2d(x, 2))
        x = F.leaky_relu(self.conv0(x), 0.2) * math.sqrt(2)
        x = F.avg_pool2d(F.leaky_relu(self.conv1(x), 0.2) * math.sqrt(2), 2)
        return (x + skip) / math.sqrt(2)


class ResNetDiscriminator(nn.Module):
    """A (channels, resolution, resolution) image → one logit. See the module's docstring."""

    def __init__(self, channels: int = 3, resolution: int = 32, width: int = 64, mbstd_group_size: int = 0) -> None:
        super().__init__()
        check_sizes(channels=channels, width=width)
        require(
            isinstance(mbstd_group_size, int) and mbstd_group_size >= 0,
            "mbstd_group_size",
            mbstd_group_size,
            "an integer ≥ 0 (0: off; StyleGAN2: 4)",
        )
        stages = _stages(resolution)
        sizes = [resolution // 2**i for i in range(stages + 1)]  # the blocks' input sizes, then 4
        self.from_rgb = EqualConv(channels, channels_at(resolution, width), 1)
        self.blocks = nn.Sequential(
            *(ResidualBlock(channels_at(a, width), channels_at(b, width)) for a, b in itertools.pairwise(sizes))
        )
        self.mbstd_group_size = mbstd_group_size
        self.conv = EqualConv(width + (1 if mbstd_group_size else 0), width, 3)
        self.fc = EqualLinear(width * 16, width)
        self.out = EqualLinear(width, 1)
        self.channels, self.resolution = channels, resolution

    def minibatch_std(self, x: torch.Tensor) -> torch.Tensor:
        """networks.py ``MinibatchStdLayer`` (one channel): each group's standard deviation, averaged, appended."""
        n, c, h, w = x.shape
        g = min(self.mbstd_group_size, n)
        y = x.reshape(g, -1, c, h, w)
        y = (y - y.mean(dim=0)).square().mean(dim=0).add(1e-8).sqrt().mean(dim=(1, 2, 3))
        return torch.cat([x, y.reshape(-1, 1, 1, 1).repeat(g, 1, h, w)], dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.leaky_relu(self.from_rgb(_as_images(x, self.channels, self.resolution)), 0.2) * math.sqrt(2)
        x = self.blocks(x)
        if self.mbstd_group_size:
            x = self.minibatch_std(x)
        x = F.leaky_relu(self.conv(x), 0.2) * math.sqrt(2)
        x = F.leaky_relu(self.fc(x.flatten(1)), 0.2) * math.sqrt(2)
        return self.out(x)
