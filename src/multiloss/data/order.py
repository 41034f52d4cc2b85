"""The training order and a run's place in it, in samples: what lets a run stopped on W ranks × b continue on W′ × b′.

Each epoch's order is one permutation of the training examples drawn from (seed, epoch) — torch's
``DistributedSampler`` draw, so a run's order is what it was — the same on every world size. The ranks train it in
*global batches* of W × b consecutive examples of that permutation, rank r taking every W-th from the r-th on (as the
strided ``DistributedSampler`` split gives them; the GAN's noise rows are split alike). So the place in the epoch is
one number, the examples the global batches have consumed: the loader counts the batches it has handed to the
training loop (not what its workers prefetched), and a resume on any W′ × b′ continues from that count, splitting
the rest as a fresh run on W′ × b′ would.

The epoch's last global batch keeps what is left (no example repeated to even the ranks, as ``DistributedSampler``
pads), except where fewer examples are left than there are ranks: a rank cannot skip a step the others take, so each
rank without one repeats one of the epoch's first examples. ``drop_last`` drops the last global batch when it is
short, of the shape that trains it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler

from multiloss.config import ConfigError
from multiloss.saving.saved_state import POSITION


class EpochOrder(Sampler[int]):
    """This rank's examples of the epoch, from the run's place in it on (`continue_at`).

    Args:
        n: the training examples. ``world_size``, ``rank``, ``batch_size`` (per rank): the shape that trains.
        epoch: the epoch being trained (the trainer's ``current_epoch``), or None outside a trainer (then
            ``set_epoch``'s).
    """

    def __init__(
        self,
        n: int,
        *,
        world_size: int,
        rank: int,
        batch_size: int,
        shuffle: bool,
        seed: int,
        drop_last: bool,
        epoch: Callable[[], int | None] = lambda: None,
    ) -> None:
        self.n, self.world_size, self.rank, self.batch_size = n, world_size, rank, batch_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self._trainer_epoch = epoch
        self._set_epoch = 0
        self._resume: tuple[int | None, int] | None = None  # (epoch or None: the next one iterated, consumed)
        self.start = 0  # examples of this epoch's order consumed before this iteration began

    @property
    def global_batch(self) -> int:
        return self.world_size * self.batch_size

    def set_epoch(self, epoch: int) -> None:
        # Lightning's count, one too high after a restart from an epoch's end: the trainer's epoch wins where there is
        # one (the one being trained).
        self._set_epoch = epoch

    def epoch(self) -> int:
        current = self._trainer_epoch()
        return self._set_epoch if current is None else current

    def permutation(self, epoch: int) -> torch.Tensor:
        """The epoch's order of all ``n`` examples, whatever the shape that trains it."""
        if not self.shuffle:
            return torch.arange(self.n)
        generator = torch.Generator()
        generator.manual_seed(self.seed + epoch)
        return torch.randperm(self.n, generator=generator)

    def batches(self, start: int = 0) -> int:
        """The global batches that train the epoch's examples from ``start`` on."""
        left = max(self.n - start, 0)
        return left // self.global_batch if self.drop_last else -(-left // self.global_batch)

    def consumed(self, start: int, batches: int) -> int:
        """The examples consumed once ``batches`` global batches from ``start`` have trained."""
        return min(self.n, start + batches * self.global_batch)

    def continue_at(self, consumed: int, epoch: int | None) -> None:
        """Start the iteration of ``epoch`` (None: the next one iterated) at ``consumed`` examples into its order."""
        self._resume = (epoch, consumed)

    def _start_of(self, epoch: int) -> int:
        if self._resume is None:
            return 0
        resumed_epoch, consumed = self._resume
        self._resume = None  # once: the epochs after it start at their beginning
        return consumed if resumed_epoch in (None, epoch) else 0

    def __iter__(self) -> Iterator[int]:
        epoch = self.epoch()
        self.start = self._start_of(epoch)
        yield from self.indices(self.permutation(epoch), self.start).tolist()

    def indices(self, order: torch.Tensor, start: int) -> torch.Tensor:
        """This rank's examples of ``order`` from ``start`` on, global batch after global batch."""
        rest = order[start:]
        full = len(rest) // self.global_batch
        whole = rest[: full * self.global_batch].view(full, self.batch_size, self.world_size)[:, :, self.rank]
        tail = rest[full * self.global_batch :]
        if self.drop_last or not len(tail):
            return whole.reshape(-1)
        if self.rank < len(tail):
            mine = tail[self.rank :: self.world_size]
        else:  # fewer examples left than ranks: one of the epoch's first, so that this rank takes the step too
            mine = order[(self.rank - len(tail)) % self.n :][:1]
        return torch.cat([whole.reshape(-1), mine])

    def examples(self, batch: int) -> tuple[int, int]:
        """The examples of the epoch's training batch ``batch`` (Lightning's ``batch_idx``: counted from the epoch's
        start on this shape, a resume's batches behind it included): this rank's, and every rank's together.

        A rank that repeats one of the epoch's first examples only to take the step (fewer examples left than ranks)
        has 0 of its own; a batch before this iteration's start (a window begun before a resume) counts as full.
        """
        behind = self.batches(0) - self.batches(self.start)
        begin = self.start + (batch - behind) * self.global_batch
        if batch < behind or begin + self.global_batch <= self.n or self.drop_last:
            return self.batch_size, self.global_batch
        everyone = max(0, self.n - begin)
        return len(range(self.rank, everyone, self.world_size)), everyone

    def __len__(self) -> int:
        # A whole epoch's count on this shape, resumed or not: Lightning counts the epoch's batches from its start
        # (`multiloss.lightning_internals.continue_epoch_at` sets its count of those already trained).
        full = self.n // self.global_batch
        tail = self.n - full * self.global_batch
        if self.drop_last or not tail:
            return full * self.batch_size
        return full * self.batch_size + max(1, len(range(self.rank, tail, self.world_size)))  # a padded rank: 1


class PositionedLoader(DataLoader):
    """A training loader whose state is the run's place in the epoch (`EpochOrder`), for Lightning's checkpoint.

    Lightning saves a loader's ``state_dict`` with its loops and hands it back before the first batch of a resume;
    ``on_resume`` (the data module's) is then told how many of the epoch's batches, on this shape, are behind it.
    """

    def __init__(self, *args: Any, on_resume: Callable[[int], None] = lambda batches: None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.on_resume = on_resume
        self._returned = 0  # batches handed to the training loop in this iteration

    @property
    def order(self) -> EpochOrder:
        assert isinstance(self.sampler, EpochOrder)
        return self.sampler

    def __iter__(self) -> Iterator[Any]:
        self._returned = 0
        for batch in super().__iter__():
            self._returned += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        order = self.order
        return {
            POSITION: {
                "epoch": order.epoch(),
                "consumed": order.consumed(order.start, self._returned),
                "examples": order.n,
                "seed": order.seed,
                "shuffle": order.shuffle,
            }
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        order = self.order
        if POSITION not in state:  # torchdata's StatefulDataLoader (checkpoints of earlier versions): its batches
            self._continue(order.consumed(0, int(state.get("_num_yielded", 0))), None)  # on this shape: it is kept
            return
        position = state[POSITION]
        if position["consumed"] >= position["examples"]:
            return  # saved at its epoch's end: the next epoch starts at its beginning, on whatever data
        # Seed and shuffle are checked before the run writes anything; the examples only now, the data loaded.
        if (position["examples"], position["seed"], position["shuffle"]) != (order.n, order.seed, order.shuffle):
            raise ConfigError(
                "data",
                f"{order.n} training examples",
                f"the data the checkpoint's run trained on, {position['examples']} training examples, until its epoch "
                "ends; or resume from a checkpoint taken at an epoch's end",
                "the checkpoint was saved mid-epoch, its place a count of that data's examples in its order",
            )
        self._continue(position["consumed"], position["epoch"])

    def _continue(self, consumed: int, epoch: int | None) -> None:
        order = self.order
        if consumed < order.n:
            order.continue_at(consumed, epoch)
            self.on_resume(order.batches() - order.batches(consumed))  # the epoch's batches behind it, on this shape
