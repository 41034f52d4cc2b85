"""An optimizer step's examples: what weighs each micro-batch's mean loss in its step (``model.accumulation_mean``).

One step of W ranks × k micro-batches of b trains the examples of its *window*: W·b·k of them, except at an epoch's
end, where the last global batch is short (the data does not divide) and the last window may hold fewer than k
micro-batches. Two ways to average them:

- ``examples`` (the default): every example of the window weighs the same, across its micro-batches and its ranks.
  Micro-batch i's mean loss is multiplied by nᵢ·W / N (nᵢ its examples on this rank, N the window's on every rank;
  DDP's mean over the ranks takes the W back out), so the step is the gradient of the mean loss over its N examples —
  one batch of N. W × b × k is then the same step on every shape (1 × 32 × k 2 = 2 × 32 = 1 × 64 = 1 × 16 × k 4), an
  epoch's ragged last step included, which is what ``global_batch_size`` and an elastic resume rely on.
- ``micro_batches``: the plain loop's ``loss / k`` (the seeds', Lightning's own accumulation, Lightning #20350): each
  micro-batch's mean weighs 1/k and each rank's 1/W whatever their examples, so a short micro-batch's examples weigh
  more than a full one's, and a short last window (k′ < k micro-batches) steps on k′/k of a mean.

On a full window the two are the same step to the bit (``Window.weight`` is None there: the division by k itself).
The counts come from the training loader: exactly from multiloss's `multiloss.data.order.EpochOrder` (every shipped
data module; a rank's own share of a ragged global batch, a rank that only repeats an example to take the step
weighing 0), from a sampler's length and the loader's ``batch_size`` otherwise (every rank assumed alike, as torch's
``DistributedSampler`` pads them); a loader that says neither keeps ``micro_batches``, said once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MEANS: tuple[str, ...] = ("examples", "micro_batches")

Counts = Callable[[int], tuple[int, int]]  # training batch -> (this rank's examples, every rank's)


@dataclass(frozen=True)
class Window:
    """The micro-batches of one optimizer step: each one's examples on this rank and on every rank."""

    counts: tuple[tuple[int, int], ...]
    world_size: int
    k: int

    @property
    def examples(self) -> int:
        """The step's examples on every rank (N)."""
        return sum(everyone for _, everyone in self.counts)

    def weight(self, i: int) -> float | None:
        """What multiplies micro-batch ``i``'s mean loss: nᵢ·W / N; None where that is 1/k (a full window: the plain
        loop's ``loss / k``, kept to the bit)."""
        mine, total = self.counts[i][0], self.examples
        if mine * self.world_size * self.k == total:
            return None
        return mine * self.world_size / total if total else 0.0


def example_counts(trainer: Any) -> Counts | None:
    """How many examples each training batch of the epoch holds, from ``trainer``'s training loader; None if it does
    not say (an iterable dataset, a batch sampler of its own)."""
    from multiloss.data.order import EpochOrder

    loader = getattr(trainer, "train_dataloader", None)
    sampler = getattr(loader, "sampler", None)
    if isinstance(sampler, EpochOrder):
        return sampler.examples
    size = getattr(loader, "batch_size", None)
    if not isinstance(size, int) or not hasattr(sampler, "__len__"):
        return None
    per_rank, world_size, drop_last = len(sampler), trainer.world_size, bool(getattr(loader, "drop_last", False))
    full, tail = divmod(per_rank, size)

    def counts(batch: int) -> tuple[int, int]:
        mine = tail if batch >= full and tail and not drop_last else size
        return mine, mine * world_size

    return counts


def window_of(trainer: Any, batch_idx: int, k: int, counts: Counts) -> tuple[Window, int]:
    """The window of training batch ``batch_idx`` (every k-th batch of its epoch ends one, and the epoch's last) and
    its place in it."""
    first = batch_idx // k * k
    batches = trainer.num_training_batches
    last = first + k if batches == float("inf") else min(first + k, int(batches))
    last = max(last, batch_idx + 1)
    window = Window(tuple(counts(j) for j in range(first, last)), trainer.world_size, k)
    return window, batch_idx - first


def count_exact_as_mean(count_exact: bool | None, accumulation_mean: str) -> str:
    """The ``accumulation_mean`` that ``model.count_exact`` of earlier versions (accumulation, tbptt; their checkpoints'
    hyper-parameters hold it) says: true is ``examples``, false ``micro_batches``, said once; None:
    ``accumulation_mean`` itself."""
    if count_exact is None:
        return accumulation_mean
    from lightning.pytorch.utilities import rank_zero_warn

    mean = "examples" if count_exact else "micro_batches"
    rank_zero_warn(f"model.count_exact={str(bool(count_exact)).lower()} is model.accumulation_mean={mean} now")
    return mean
