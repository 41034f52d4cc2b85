"""The generator's exponential moving average (G_ema): what a GAN's samples and metrics come from.

Two conventions, one class:

- **half-life in images** (NVlabs/stylegan2-ada-pytorch ``training/training_loop.py`` 296-304; StudioGAN's
  ``EmaStylegan2``): after each G step, β = 0.5 ** (images / max(h, 1e-8)), with ``images`` the real images the
  run showed D since the last update (all ranks, all micro-batches, every D step of an ``n_critic`` group) and h =
  ``half_life_images``, ramped up (``rampup`` r) as min(h, images_before · r) where ``images_before`` is the
  count at the last update (stylegan2-ada's ``cur_nimg``, taken before its iteration's images: β = 0 at the first
  update, a copy);
- **a decay from a start step** (POSTECH-CVLab/PyTorch-StudioGAN ``src/utils/ema.py`` ``Ema``, called after
  each G step with the step's index): β = ``decay`` from the ``start_step``-th update on, 0 (a copy) before.

Then each weight p_ema ← lerp(p, p_ema, β) (stylegan2-ada's ``p.lerp(p_ema, ema_beta)``, the same float
operations). Buffers (BatchNorm's running statistics) are **copied** from G, as stylegan2-ada and StudioGAN's
``EmaStylegan2`` do: G_ema's weights are an average, but statistics averaged over past weights describe none
of them, and a copy keeps G_ema's normalisation that of the generator it is closest to (StudioGAN's ``Ema``
averages them instead, except ``num_batches_tracked``). The counts are buffers, so they ride in every
checkpoint with the averaged weights.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from multiloss.config import require, require_options


class GeneratorEMA(nn.Module):
    """A frozen copy of ``generator`` kept as its moving average; ``forward`` is the averaged generator's.

    Give ``half_life_images`` (and optionally ``rampup``) or ``decay`` (and optionally ``start_step``), not both.

    Raises:
        ConfigError: neither or both conventions; ``half_life_images`` ≤ 0; ``rampup`` ≤ 0; ``decay`` outside
            [0, 1); ``start_step`` < 0 (keys ``g_ema.<key>``).
    """

    def __init__(
        self,
        generator: nn.Module,
        half_life_images: float | None = None,
        rampup: float | None = None,
        decay: float | None = None,
        start_step: int = 0,
    ) -> None:
        super().__init__()
        require(
            (half_life_images is None) != (decay is None),
            "g_ema",
            {"half_life_images": half_life_images, "decay": decay},
            "one of half_life_images (stylegan2-ada: 10000 images) or decay (StudioGAN: 0.9999), or g_ema=null",
        )
        require(
            half_life_images is None or half_life_images > 0,
            "g_ema.half_life_images",
            half_life_images,
            "a positive number of images",
        )
        require(
            rampup is None or rampup > 0, "g_ema.rampup", rampup, "a positive number (stylegan2-ada: 0.05), or null"
        )
        require(
            rampup is None or half_life_images is not None,
            "g_ema.rampup",
            rampup,
            "null with decay (the ramp-up is the half-life convention's)",
        )
        require(decay is None or 0 <= decay < 1, "g_ema.decay", decay, "a number in [0, 1)")
        require(isinstance(start_step, int) and start_step >= 0, "g_ema.start_step", start_step, "an integer ≥ 0")
        self.half_life_images, self.rampup, self.decay, self.start_step = half_life_images, rampup, decay, start_step
        self.average = copy.deepcopy(generator).requires_grad_(False)
        self.register_buffer("images", torch.zeros((), dtype=torch.long))  # real images shown to D so far
        self.register_buffer("images_at_update", torch.zeros((), dtype=torch.long))
        self.register_buffer("updates", torch.zeros((), dtype=torch.long))
        # The counts as host integers, the buffers written from them (a write does not wait for the device; reading
        # a GPU buffer every G step would). Read back from the buffers once after a checkpoint loads them.
        self._counts: list[int] | None = [0, 0, 0]  # images, images at the last update, updates

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self._counts = None

    def counts(self) -> list[int]:
        if self._counts is None:
            self._counts = [int(self.images), int(self.images_at_update), int(self.updates)]
        return self._counts

    @classmethod
    def from_options(cls, generator: nn.Module, options: dict | None) -> GeneratorEMA | None:
        """``model.g_ema`` (null: off) for ``generator``."""
        if options is None:
            return None
        require_options(options, "g_ema", ("half_life_images", "rampup", "decay", "start_step"))
        return cls(generator, **options)

    def forward(self, *args, **kwargs):
        return self.average(*args, **kwargs)

    def count(self, images: int) -> None:
        """``images`` more real images shown to D (a D micro-batch: its batch times the ranks)."""
        counts = self.counts()
        counts[0] += images
        self.images.fill_(counts[0])

    def beta(self) -> float:
        """The weight of the old average in this update."""
        images, before, updates = self.counts()
        if self.decay is not None:
            return 0.0 if updates < self.start_step else self.decay
        half_life = self.half_life_images
        if self.rampup is not None:
            half_life = min(half_life, before * self.rampup)
        return 0.5 ** ((images - before) / max(half_life, 1e-8))

    @torch.no_grad()
    def update(self, generator: nn.Module) -> None:
        """After a G step: the average moves toward ``generator``'s weights; its buffers are copied."""
        beta = self.beta()
        for p_ema, p in zip(self.average.parameters(), generator.parameters(), strict=True):
            p_ema.copy_(p.detach().lerp(p_ema, beta))
        for b_ema, b in zip(self.average.buffers(), generator.buffers(), strict=True):
            b_ema.copy_(b)
        counts = self.counts()
        counts[1], counts[2] = counts[0], counts[2] + 1
        self.images_at_update.fill_(counts[1])
        self.updates.fill_(counts[2])
