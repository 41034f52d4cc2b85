"""Differentiable augmentation of what the discriminator sees: DiffAugment's policies, ADA's adaptive probability.

DiffAugment (Zhao et al. 2020; mit-han-lab/data-efficient-gans ``DiffAugment_pytorch.py`` at 0b63395, lines
22-76): ``color`` (brightness, saturation, contrast), ``translation`` (⅛ of the side, zero-padded) and ``cutout``
(a square of half the side), each sample with its own draw, applied alike to real and generated images and
differentiable (G's gradient flows through the augmentation). The transforms below are that file's, with one
change: their random numbers are passed in (drawn by the recipe from its checkpointed noise stream, for the whole
global batch and sharded like the data) instead of ``torch.rand``/``torch.randint`` on the global stream, so a
resumed run and 2 ranks × b draw what the straight run and 1 rank × 2b draw.

ADA (Karras et al. 2020; NVlabs/stylegan2-ada-pytorch ``training/training_loop.py`` 311-317): each sample is
augmented with probability p; every ``ada_interval`` D steps, p += sign(r_t − target) · (images in the interval)
/ (``ada_kimg`` · 1000), at least 0, where r_t = E[sign(D(x_real))] over the interval and the ranks (the lazy R1
step's reals included, as stylegan2-ada's ``Dr1`` phase reports them): each D micro-batch's (Σ sign, count) is
all-reduced as it is observed (two numbers, every rank at the same point), so
every rank holds the global sums and a checkpoint, written by rank 0, holds them whole. p and the sums are
buffers: checkpointed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from multiloss.building.components import build_callable
from multiloss.config import ConfigError, require, require_options

# policy -> how many random numbers per sample its transforms take (in the order DiffAugment draws them).
POLICIES = {"color": 3, "translation": 2, "cutout": 2}


def rand_brightness(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    return x + (r - 0.5)


def rand_saturation(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    x_mean = x.mean(dim=1, keepdim=True)
    return (x - x_mean) * (r * 2) + x_mean


def rand_contrast(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    x_mean = x.mean(dim=[1, 2, 3], keepdim=True)
    return (x - x_mean) * (r + 0.5) + x_mean


def rand_translation(x: torch.Tensor, translation_x: torch.Tensor, translation_y: torch.Tensor) -> torch.Tensor:
    grid_batch, grid_x, grid_y = torch.meshgrid(
        torch.arange(x.size(0), dtype=torch.long, device=x.device),
        torch.arange(x.size(2), dtype=torch.long, device=x.device),
        torch.arange(x.size(3), dtype=torch.long, device=x.device),
        indexing="ij",
    )
    grid_x = torch.clamp(grid_x + translation_x + 1, 0, x.size(2) + 1)
    grid_y = torch.clamp(grid_y + translation_y + 1, 0, x.size(3) + 1)
    x_pad = F.pad(x, [1, 1, 1, 1, 0, 0, 0, 0])
    return x_pad.permute(0, 2, 3, 1).contiguous()[grid_batch, grid_x, grid_y].permute(0, 3, 1, 2).contiguous()


def cutout_size(x: torch.Tensor, ratio: float = 0.5) -> tuple[int, int]:
    return int(x.size(2) * ratio + 0.5), int(x.size(3) * ratio + 0.5)


def rand_cutout(x: torch.Tensor, offset_x: torch.Tensor, offset_y: torch.Tensor) -> torch.Tensor:
    size = cutout_size(x)
    grid_batch, grid_x, grid_y = torch.meshgrid(
        torch.arange(x.size(0), dtype=torch.long, device=x.device),
        torch.arange(size[0], dtype=torch.long, device=x.device),
        torch.arange(size[1], dtype=torch.long, device=x.device),
        indexing="ij",
    )
    grid_x = torch.clamp(grid_x + offset_x - size[0] // 2, min=0, max=x.size(2) - 1)
    grid_y = torch.clamp(grid_y + offset_y - size[1] // 2, min=0, max=x.size(3) - 1)
    mask = torch.ones(x.size(0), x.size(2), x.size(3), dtype=x.dtype, device=x.device)
    mask[grid_batch, grid_x, grid_y] = 0
    return x * mask.unsqueeze(1)


def _integers(u: torch.Tensor, low: int, high: int) -> torch.Tensor:
    """Uniform integers in [low, high) from uniforms in [0, 1), shaped (N, 1, 1) as DiffAugment's ``randint``."""
    return (low + torch.floor(u * (high - low))).long().clamp(max=high - 1).view(-1, 1, 1)


def diff_augment(x: torch.Tensor, policy: str, u: torch.Tensor) -> torch.Tensor:
    """DiffAugment of images ``x`` (N, C, H, W) under ``policy`` ("color,translation,cutout"), each sample's random
    numbers the uniforms in its row of ``u`` (N, sum of the policies' counts), used in DiffAugment's order."""
    column = iter(u.T)
    for name in policy.split(","):
        if name == "color":
            for f in (rand_brightness, rand_saturation, rand_contrast):
                x = f(x, next(column).view(-1, 1, 1, 1).to(x.dtype))
        elif name == "translation":
            shift_x, shift_y = int(x.size(2) * 0.125 + 0.5), int(x.size(3) * 0.125 + 0.5)
            tx = _integers(next(column), -shift_x, shift_x + 1)
            ty = _integers(next(column), -shift_y, shift_y + 1)
            x = rand_translation(x, tx, ty)
        else:
            size = cutout_size(x)
            ox = _integers(next(column), 0, x.size(2) + (1 - size[0] % 2))
            oy = _integers(next(column), 0, x.size(3) + (1 - size[1] % 2))
            x = rand_cutout(x, ox, oy)
    return x.contiguous()


def image_shape(sample_shape: tuple[int, ...]) -> tuple[int, int, int] | None:
    """(C, H, W) of a sample: as it is, (H, W) as one channel, or a square number of features (the digits' 64)."""
    if len(sample_shape) == 3:
        return sample_shape  # type: ignore[return-value]
    if len(sample_shape) == 2:
        return (1, *sample_shape)
    if len(sample_shape) == 1 and math.isqrt(sample_shape[0]) ** 2 == sample_shape[0] and sample_shape[0] > 1:
        side = math.isqrt(sample_shape[0])
        return (1, side, side)
    return None


class Augment(nn.Module):
    """What D's inputs pass through in training: ``policy`` (DiffAugment's) or a ``transform`` of your own (a
    differentiable callable images -> images, by ``_target_``), applied to each sample with probability ``p``;
    ``ada_target`` r_t (stylegan2-ada: 0.6) makes p adaptive, every ``ada_interval`` D steps by at most
    ``interval images / (ada_kimg · 1000)``.

    Raises:
        ConfigError: both or neither of ``policy`` and ``transform``; a policy name not in ``POLICIES``; ``p``
            outside [0, 1]; ``ada_target`` outside (0, 1); ``ada_interval`` < 1; ``ada_kimg`` ≤ 0 (keys
            ``augment.<key>``).
    """

    def __init__(
        self,
        policy: str | None = "color,translation,cutout",
        transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
        p: float = 1.0,
        ada_target: float | None = None,
        ada_interval: int = 4,
        ada_kimg: float = 500,
    ) -> None:
        super().__init__()
        require(
            (policy is None) != (transform is None),
            "augment.policy",
            policy,
            "DiffAugment's policy (color,translation,cutout) or augment.transform (your callable), one of the two",
        )
        if policy is not None:
            unknown = [name for name in str(policy).split(",") if name not in POLICIES]
            require(not unknown, "augment.policy", policy, f"a comma-separated list of {', '.join(POLICIES)}")
        require(0 <= p <= 1, "augment.p", p, "a probability in [0, 1] (ADA starts from 0)")
        require(ada_target is None or 0 < ada_target < 1, "augment.ada_target", ada_target, "a number in (0, 1)")
        require(isinstance(ada_interval, int) and ada_interval >= 1, "augment.ada_interval", ada_interval, "≥ 1")
        require(ada_kimg > 0, "augment.ada_kimg", ada_kimg, "a positive number (thousands of images)")
        self.policy, self.transform = policy, transform
        self.ada_target, self.ada_interval, self.ada_kimg = ada_target, ada_interval, ada_kimg
        self.draws = 1 + (sum(POLICIES[name] for name in policy.split(",")) if policy else 0)
        self.shape: tuple[int, int, int] | None = None  # the images' (C, H, W): set at setup from the data
        # float32 as stylegan2-ada's ``augment_pipe.p`` (its AugmentPipe's buffer): p moves by float32 additions.
        self.register_buffer("p", torch.tensor(float(p), dtype=torch.float32))
        self.register_buffer("signs", torch.zeros(2, dtype=torch.float64))  # Σ sign(D(x_real)), their count

    def set_sample_shape(self, sample_shape: tuple[int, ...], key: str = "model.augment") -> None:
        shape = image_shape(sample_shape)
        if shape is None:
            raise ConfigError(
                key,
                self.policy or "transform",
                "images: samples of shape (C, H, W), (H, W) or a square number of features (the digits' 64)",
                f"the data's samples have shape {sample_shape}",
            )
        self.shape = shape

    def forward(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """``x`` augmented, each sample with probability p; ``u``: its row's uniforms (N, ``draws``)."""
        assert self.shape is not None, "set_sample_shape first (the recipe does at setup)"
        images = x.reshape(len(x), *self.shape)
        augmented = diff_augment(images, self.policy, u[:, 1:]) if self.policy else self.transform(images)
        keep = ((u[:, :1] < self.p) | (self.p >= 1)).to(x.dtype).view(-1, *[1] * (images.dim() - 1))
        return (keep * augmented + (1 - keep) * images).reshape(x.shape)

    @property
    def adaptive(self) -> bool:
        return self.ada_target is not None

    def statistic(self, real_scores: torch.Tensor) -> torch.Tensor:
        """(Σ sign, count) of D's scores of (augmented) real samples, for the recipe to sum over the ranks."""
        signs = real_scores.detach().sign().sum().double()
        return torch.stack([signs, signs.new_tensor(real_scores.numel())])

    def observe(self, summed: torch.Tensor) -> None:
        """Add a micro-batch's (Σ sign, count), summed over the ranks, to the interval's."""
        self.signs += summed

    def adjust(self, images: int) -> None:
        """stylegan2-ada's update at the interval's end, from its sums and its nominal ``images``."""
        r_t = self.signs[0] / self.signs[1].clamp(min=1)
        step = torch.sign(r_t - self.ada_target) * images / (self.ada_kimg * 1000)
        # stylegan2-ada adds a float64 numpy scalar to its float32 p: the sum is p's dtype (training_loop.py 316-317;
        # float64 under 64-true, as stylegan2-ada run in float64 would add it).
        self.p.copy_((self.p + step.to(self.p.dtype)).clamp(min=0))
        self.signs.zero_()

    def seen_by(self, critic: Callable[[torch.Tensor], Any], uniforms: Callable[[int, int], Any]) -> Callable:
        """``critic`` as D sees samples in training: through this augmentation, its random numbers ``uniforms(n,
        draws)`` (the recipe's: from its noise stream, drawn per call for the global batch, sharded like the noise)."""
        return lambda x: critic(self(x, uniforms(len(x), self.draws)))

    def observe_scores(self, scores: torch.Tensor, sum_over_ranks: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """ADA's r_t: these scores of (augmented) reals join the interval's sign sums, summed over the ranks (every
        rank reaches this at the same point: each D micro-batch, and each lazy R1 micro-batch)."""
        self.observe(sum_over_ranks(self.statistic(scores)))

    def observing(self, critic: Callable, sum_over_ranks: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
        """``critic`` whose scores also feed r_t: stylegan2-ada's ``Dr1`` phase reports the signs of the reals' logits
        it differentiates (``Loss/signs/real``) as its ``Dmain`` phase does, and its heuristic averages both."""

        def scored(x: torch.Tensor) -> Any:
            scores = critic(x)
            self.observe_scores(scores, sum_over_ranks)
            return scores

        return scored

    def adapt_after(self, d_steps: int, images_a_step: int) -> bool:
        """ADA after every ``ada_interval``-th D step (the interval's last: stylegan2-ada's ``batch_idx += 1`` comes
        before its ``batch_idx % ada_interval == 0``): p moves by the sign of r_t − target; whether it did."""
        if not self.adaptive or d_steps % self.ada_interval:
            return False
        self.adjust(images_a_step * self.ada_interval)
        return True

    def extra_repr(self) -> str:
        return f"policy={self.policy}, p={float(self.p):.4g}, ada_target={self.ada_target}"


def build_augment(spec: Any) -> Augment | None:
    """``model.augment`` (a mapping, its ``transform`` already built) as an `Augment`, or None when null."""
    if spec is None:
        return None
    require_options(spec, "augment", ("policy", "transform", "p", "ada_target", "ada_interval", "ada_kimg"))
    if isinstance(spec.get("policy"), list | tuple):  # [color, translation] from the shell (a comma is a sweep there)
        spec = {**spec, "policy": ",".join(map(str, spec["policy"]))}
    if spec.get("transform") is not None:
        spec = {**spec, "transform": build_callable(spec["transform"], "augment.transform"), "policy": None}
    return Augment(**spec)
