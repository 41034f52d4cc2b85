"""2-D Gaussian mixtures, the classic GAN mode-coverage toys: 8 modes on a ring, 25 on a grid.

A generator that collapses onto a few modes is easy to see (a scatter plot) and to count
(`multiloss.base.metrics.ModeCoverage`), which makes these the standard test of whether a GAN's
training loop is right before anything else is blamed. Generated, never downloaded.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from multiloss.config import require
from multiloss.data.arrays import ArrayDataModule


def mode_centers(layout: Literal["ring", "grid"], n_modes: int, scale: float) -> torch.Tensor:
    """The mixture's centers, shape (n_modes, 2): evenly on a circle of radius ``scale`` (``ring``), or a
    √n × √n lattice with spacing ``scale`` centred on the origin (``grid``: 25 modes at -2s..2s)."""
    if layout == "ring":
        angles = torch.arange(n_modes, dtype=torch.float64) * (2 * math.pi / n_modes)
        return (scale * torch.stack([angles.cos(), angles.sin()], dim=1)).float()
    side = math.isqrt(n_modes)
    ticks = (torch.arange(side, dtype=torch.float64) - (side - 1) / 2) * scale
    return torch.cartesian_prod(ticks, ticks).float()


class GaussianMixtureDataModule(ArrayDataModule):
    """``n_samples`` points ``x`` (shape 2) from an equal-weight mixture of isotropic Gaussians of std ``std``.

    ``layout=ring``: ``n_modes`` centers on a circle of radius ``scale`` (the 8-Gaussians ring);
    ``layout=grid``: a square lattice of ``n_modes`` centers spaced ``scale`` apart (the 25-Gaussians
    grid). Each point also carries its mode index ``y``. The points are a pure function of
    ``sample_seed`` (never of the training ``seed``), so every run sees the same data set.
    ``centers`` and ``std`` are what `multiloss.base.metrics.ModeCoverage` measures against.

    Raises:
        ConfigError: ``n_modes`` < 1 or (grid) not a perfect square; ``std`` or ``scale`` ≤ 0;
            ``n_samples`` < 2.
    """

    def __init__(
        self,
        layout: Literal["ring", "grid"] = "ring",
        n_modes: int = 8,
        scale: float = 2.0,
        std: float = 0.02,
        n_samples: int = 40960,
        sample_seed: int = 0,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        require(n_modes >= 1, "n_modes", n_modes, "an integer ≥ 1")
        require(
            layout != "grid" or math.isqrt(n_modes) ** 2 == n_modes,
            "n_modes",
            n_modes,
            "a perfect square with layout=grid (25 = the 5×5 grid)",
        )
        require(std > 0, "std", std, "a positive number (the modes' standard deviation)")
        require(scale > 0, "scale", scale, "a positive number (ring radius or grid spacing)")
        require(n_samples >= 2, "n_samples", n_samples, "an integer ≥ 2")
        self.layout, self.n_modes, self.scale, self.std = layout, n_modes, scale, std
        self.n_samples, self.sample_seed = n_samples, sample_seed
        self.centers = mode_centers(layout, n_modes, scale)

    def load(self) -> dict[str, torch.Tensor]:
        # A private generator: loading the data must not move the global stream the GAN's noise uses.
        gen = torch.Generator().manual_seed(self.sample_seed)
        y = torch.randint(self.n_modes, (self.n_samples,), generator=gen)
        x = self.centers[y] + self.std * torch.randn(self.n_samples, 2, generator=gen)
        return {"x": x, "y": y}
