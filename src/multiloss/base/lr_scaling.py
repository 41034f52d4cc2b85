"""Learning-rate scaling with the effective batch size (gradient accumulation, many ranks).

One optimizer step of a run sees ``batch_size × accumulate × world_size`` examples: the per-rank
micro-batch, times the micro-batches accumulated per step, times the ranks whose gradients DDP
averages. The learning rate a user configures is the one tuned for ``base_batch_size`` examples
per step; when the effective batch grows, the gradient's noise shrinks and the step can grow:

- ``linear``: ``lr = base_lr × B / B₀``. Goyal et al. 2017, "Accurate, Large Minibatch SGD:
  Training ImageNet in 1 Hour" (arXiv:1706.02677): k times the batch, k times the LR, so k steps
  of batch b and one step of batch k·b move the weights by about the same amount (for SGD, while
  the weights change slowly; with a warm-up for very large k).
- ``sqrt``: ``lr = base_lr × √(B / B₀)``. Krizhevsky 2014, "One weird trick for parallelizing
  convolutional neural networks" (arXiv:1404.5997) and Hoffer et al. 2017, "Train longer,
  generalize better" (arXiv:1705.08741): keeps the variance of the update constant. It is the
  rule commonly used for Adam-type optimizers, whose update is already normalised by the
  gradient's scale (Malladi et al. 2022, "On the SDEs and Scaling Rules for Adaptive Gradient
  Algorithms", arXiv:2205.10287).
- ``none``: ``lr = base_lr`` whatever the batch.

A pure function, so a multi-device run, a test or a notebook computes exactly what training uses.
"""

from __future__ import annotations

import math
from typing import Literal

Rule = Literal["linear", "sqrt", "none"]
RULES: tuple[str, ...] = ("linear", "sqrt", "none")


def effective_batch_size(batch_size: int, accumulate: int = 1, world_size: int = 1) -> int:
    """Examples behind one optimizer step: per-rank batch × accumulated micro-batches × ranks."""
    for name, value in (("batch_size", batch_size), ("accumulate", accumulate), ("world_size", world_size)):
        if int(value) != value or value < 1:
            raise ValueError(f"{name} must be an integer ≥ 1, got {value!r}")
    return int(batch_size) * int(accumulate) * int(world_size)


def lr_factor(effective_batch: int, base_batch_size: int, rule: Rule = "linear") -> float:
    """The factor the base LR is multiplied by: ``B/B₀`` (linear), ``√(B/B₀)`` (sqrt) or 1 (none)."""
    if rule not in RULES:
        raise ValueError(f"rule must be one of {', '.join(RULES)}, got {rule!r}")
    if base_batch_size < 1:
        raise ValueError(f"base_batch_size must be ≥ 1, got {base_batch_size!r}")
    ratio = effective_batch / base_batch_size
    return {"linear": ratio, "sqrt": math.sqrt(ratio), "none": 1.0}[rule]


def scaled_lr(
    base_lr: float,
    batch_size: int,
    accumulate: int = 1,
    world_size: int = 1,
    base_batch_size: int = 64,
    rule: Rule = "linear",
) -> float:
    """The learning rate for a step of ``batch_size × accumulate × world_size`` examples.

    ``base_lr`` is the LR tuned for ``base_batch_size`` examples per step. Example: base_lr=0.1
    tuned at 64, a per-rank batch of 32, 4 micro-batches per step and 2 ranks make 256 examples
    per step: ``linear`` gives 0.1 × 256/64 = 0.4, ``sqrt`` 0.1 × √4 = 0.2, ``none`` 0.1.

    Raises:
        ValueError: an unknown ``rule``, or a batch size, ``accumulate`` or ``world_size`` < 1.
    """
    return base_lr * lr_factor(effective_batch_size(batch_size, accumulate, world_size), base_batch_size, rule)
