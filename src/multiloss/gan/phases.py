"""The phases of a GAN's training batch: which batches step G, and what a D micro-batch keeps for what follows it
(G's step on ``same_z``, the relativistic pairing, the lazy penalty's own D step)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DMicroBatch:
    """What one micro-batch of D's step used: G's lazy-penalty step, same_z and the relativistic pairing reuse it."""

    z: torch.Tensor
    real: torch.Tensor
    fake: torch.Tensor  # detached
    eps: torch.Tensor
    examples: tuple[int, int] = (0, 0)  # its examples on this rank and on every rank (multiloss.base.window)


def generator_steps_after(batch_idx: int, k: int, n_critic: int, g_step_after: str, ends_d_step: bool) -> bool:
    """Whether G steps in training batch ``batch_idx``: after D's n_critic-th step of a group (``last``), after its
    first (``first``), or before the group's first D micro-batch (``before``: stylegan2-ada's Gmain before Dmain); D's
    steps counted from the epoch's start, ``k`` micro-batches each. ``ends_d_step``: the batch ends a D step (every
    k-th, and the epoch's last: a short last step counts as one, as the epoch's short last batch of k·b does)."""
    if g_step_after == "before":  # the batch that starts a group of n_critic D steps
        return batch_idx % (k * n_critic) == 0
    if not ends_d_step:
        return False
    d_step = batch_idx // k  # the D step this batch ends, from 0
    return (d_step + 1) % n_critic == 0 if g_step_after == "last" else d_step % n_critic == 0
