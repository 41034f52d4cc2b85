"""stylegan2-ada's path-length regularization of the generator (``model.path_length``), taken lazily.

NVlabs/stylegan2-ada-pytorch ``training/loss.py`` 77-92 (d72cc7d): on ``batch // pl_batch_shrink`` latents, the
gradient of Σ G(w)·n / √(H·W) (n standard normal, one per value of the image) with respect to the mapping's output
w, its length per sample ‖∇‖ (``square().sum(2).mean(1).sqrt()`` over w's layers), a running mean
``pl_mean.lerp(mean length, pl_decay)`` — through which the penalty is differentiated too — and the penalty
(length − mean)² × ``pl_weight``. The recipe takes it as stylegan2-ada's ``Greg`` phase: a G step of its own every
``g_reg_every`` G steps (from the first), at gain ``g_reg_every``, with G's Adam corrected as for D's lazy penalty.

w is the mapping's output when the generator has a ``mapping`` and a ``synthesis`` network (what it returns, caught
on the way: the generator is called whole, through its DDP wrapper), else z itself.

Across ranks: the mean length is the global batch's (one all-reduce of two numbers), so every rank keeps the same
running mean and 2 ranks × b train as 1 × 2b. Its gradient (the path through ``pl_mean``) is the global batch's
too, by a term of value 0 whose gradient is that of the mean: stylegan2-ada's own mean is each GPU's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from multiloss.config import require


class PathLength(nn.Module):
    """The options and the running mean (a buffer: in every checkpoint) of the path-length penalty.

    Raises:
        ConfigError: ``weight`` ≤ 0, ``decay`` outside (0, 1], ``batch_shrink`` not an integer ≥ 1 (keys
            ``path_length.<key>``).
    """

    def __init__(self, weight: float = 2.0, decay: float = 0.01, batch_shrink: int = 2) -> None:
        super().__init__()
        require(weight > 0, "path_length.weight", weight, "a positive number (stylegan2-ada's pl_weight: 2)")
        require(0 < decay <= 1, "path_length.decay", decay, "a number in (0, 1] (stylegan2-ada's pl_decay: 0.01)")
        require(
            isinstance(batch_shrink, int) and batch_shrink >= 1,
            "path_length.batch_shrink",
            batch_shrink,
            "an integer ≥ 1 (stylegan2-ada's pl_batch_shrink: 2)",
        )
        self.weight, self.decay, self.batch_shrink = weight, decay, batch_shrink
        self.register_buffer("pl_mean", torch.zeros(()))

    def loss(
        self,
        generator: nn.Module,
        call: Callable[[torch.Tensor], torch.Tensor],
        z: torch.Tensor,
        normals: Callable[[int, int], torch.Tensor],
        sum_over_ranks: Callable[[torch.Tensor], torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The weighted penalty to backward (a mean over this rank's samples) and its unweighted mean, for latents
        ``z``; ``call``: the generator as this step calls it (its DDP wrapper); ``normals(n, width)``: the image
        noise's standard normals; ``sum_over_ranks``: the strategy's all-reduce."""
        img, ws = _through_mapping(generator, call, z)
        pl_noise = normals(len(img), img[0].numel()).view_as(img) / math.sqrt(_pixels(img))
        (pl_grads,) = torch.autograd.grad((img * pl_noise).sum(), ws, create_graph=True)
        squares = pl_grads.square()
        lengths = (squares.sum(2).mean(1) if squares.dim() == 3 else squares.flatten(1).sum(1)).sqrt()
        total = sum_over_ranks(torch.stack([lengths.detach().sum(), lengths.new_tensor(len(lengths))]))
        mean_all = total[0] / total[1]
        pl_mean = self.pl_mean.lerp(mean_all, self.decay)
        self.pl_mean.copy_(pl_mean)
        penalty = (lengths - pl_mean).square()
        # d penalty.mean() / d pl_mean = -2·mean(lengths - pl_mean) over the global batch, times d pl_mean / d length
        # = decay / n: carried by a term of value 0 on this rank's lengths.
        through_mean = -2 * (mean_all - pl_mean) * self.decay * (lengths.mean() - lengths.mean().detach())
        loss = (img.flatten(1)[:, 0] * 0 + penalty * self.weight).mean() + self.weight * through_mean
        return loss, penalty.detach().mean()


def _through_mapping(
    generator: nn.Module, call: Callable[[torch.Tensor], torch.Tensor], z: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """G's samples for ``z`` and the tensor path length differentiates: the mapping's output, else z."""
    mapping = getattr(generator, "mapping", None)
    if not (isinstance(mapping, nn.Module) and isinstance(getattr(generator, "synthesis", None), nn.Module)):
        z = z.detach().requires_grad_(True)
        return call(z), z
    caught: list[Any] = []
    handle = mapping.register_forward_hook(lambda module, args, out: caught.append(out))
    try:
        img = call(z)
    finally:
        handle.remove()
    return img, caught[-1]


def _pixels(img: torch.Tensor) -> int:
    """H·W of images (N, C, H, W); of flat samples, their values (one channel of that many pixels)."""
    return img.shape[-2] * img.shape[-1] if img.dim() == 4 else img[0].numel()
