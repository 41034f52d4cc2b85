"""In-memory tensors served by loaders that make runs reproducible, shardable and resumable.

Why not a plain ``DataLoader``: Lightning's automatic ``DistributedSampler`` always shuffles the
training set (``data.shuffle=false`` is silently ignored under DDP) and neither it nor a
``RandomSampler`` restores its order on resume. Here the training order is a pure function of
(seed, epoch), the same on every number of ranks, honouring ``shuffle``, and the loader keeps the run's place in
it in samples (`multiloss.data.order`), so ``ckpt_path=`` continues mid-epoch on exactly the next examples — on
the ranks and batch size it was saved with or on others. The trainer runs with ``use_distributed_sampler=False``
so Lightning keeps its hands off.
"""

from __future__ import annotations

import lightning as L
import numpy as np
import torch
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from lightning.pytorch.trainer.states import TrainerStatus
from torch.utils.data import DataLoader, StackDataset

from multiloss import lightning_internals as internals
from multiloss.config import ConfigError, require
from multiloss.data.order import EpochOrder, PositionedLoader
from multiloss.data.streams import TokenStreams


class ArrayDataModule(L.LightningDataModule):
    """Base for data that fits in memory: subclasses implement `load` and return named tensors.

    Batches are dicts of those names (``batch["x"]``, ``batch["y"]``). ``batch_size`` is per rank.
    ``val_batch_size`` is the validation and test batch (null: ``batch_size``). ``test_fraction``
    holds examples out for ``multiloss-eval``'s test (default 0: no test set); they come off the
    training examples' end of a fixed permutation, so the validation set and, at 0, the training set
    stay what they were. A subclass serving token streams (`multiloss.data.streams.TokenStreams`) sets
    ``streams``; its loaders then serve those.

    Raises:
        ConfigError: ``batch_size`` or ``val_batch_size`` < 1, ``num_workers`` < 0, ``val_fraction`` or
            ``test_fraction`` outside [0, 1), or the two leaving no training example.
    """

    def __init__(
        self,
        batch_size: int = 64,
        shuffle: bool = True,
        num_workers: int = 0,
        val_fraction: float = 0.2,
        seed: int = 0,
        split_seed: int = 0,
        drop_last: bool = False,
        test_fraction: float = 0.0,
        val_batch_size: int | None = None,
    ) -> None:
        super().__init__()
        require(batch_size >= 1, "batch_size", batch_size, "an integer ≥ 1")
        require(
            val_batch_size is None or val_batch_size >= 1, "val_batch_size", val_batch_size, "an integer ≥ 1, or null"
        )
        require(num_workers >= 0, "num_workers", num_workers, "an integer ≥ 0 (0 loads in the main process)")
        require(0 <= val_fraction < 1, "val_fraction", val_fraction, "a number in [0, 1)")
        require(
            0 <= test_fraction < 1 - val_fraction,
            "test_fraction",
            test_fraction,
            f"a number in [0, {1 - val_fraction:g}) (1 - val_fraction: some examples must be left to train on)",
        )
        self.test_fraction = test_fraction
        self.batch_size, self.shuffle, self.num_workers = batch_size, shuffle, num_workers
        self.val_batch_size = val_batch_size or batch_size
        self.streams: TokenStreams | None = None  # set by token data read as streams
        self.val_fraction, self.seed, self.split_seed, self.drop_last = val_fraction, seed, split_seed, drop_last
        self.train_set: StackDataset | None = None
        self.val_set: StackDataset | None = None
        self.test_set: StackDataset | None = None

    def load(self) -> dict[str, torch.Tensor]:
        """All examples as named tensors sharing their first dimension (or `multiloss.data.columns.LazyColumn`s:
        examples read from disk when drawn)."""
        raise NotImplementedError

    def load_parts(self) -> dict[str, dict[str, torch.Tensor]]:
        """The examples by part: ``"train"``, and ``"val"`` / ``"test"`` where the data has files of its own for them
        (a part it lacks is cut at random off the training examples: ``val_fraction``, ``test_fraction``)."""
        return {"train": self.load()}

    def given_parts(self, val: str | None, test: str | None) -> None:
        """Refuse a fraction for a part that has its own files (``val``/``test``: their paths, or None)."""
        for part, given in (("val", val), ("test", test)):
            fraction = getattr(self, f"{part}_fraction")
            require(
                given is None or not fraction,
                f"{part}_fraction",
                fraction,
                f"0 (or null) with {given} as the {part} set: it is that data, not a fraction of the training data",
            )

    def training_examples(self, train: StackDataset) -> StackDataset:
        """The training set as the sampler draws from it (the image folders' x-flip doubles it)."""
        return train

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        parts = dict(self.load_parts())
        arrays = parts.pop("train")
        n = len(next(iter(arrays.values())))
        n_val = 0 if "val" in parts else round(n * self.val_fraction)
        n_test = 0 if "test" in parts else round(n * self.test_fraction)
        if not parts or n_val or n_test:  # one set of examples is always permuted (ports reproduce this order)
            # The split never depends on the training seed: changing `seed` must not change the val set.
            order = torch.from_numpy(np.random.default_rng(self.split_seed).permutation(n))
            self.val_index, self.train_index = order[:n_val], order[n_val : n - n_test]
            self.test_index = order[n - n_test :] if n_test else order[:0]
            # An index of a tensor copies those examples; of a LazyColumn it is a view that reads nothing.
            cut = {"train": self.train_index, "val": self.val_index, "test": self.test_index}
            parts = {part: {k: v[index] for k, v in arrays.items()} for part, index in cut.items()} | parts
        else:
            parts["train"] = arrays  # files for validation and test, nothing cut off: the examples in their order
        empty = {k: v[:0] for k, v in arrays.items()}
        self.train_set = self.training_examples(StackDataset(**parts["train"]))
        self.val_set = StackDataset(**parts.get("val", empty))
        self.test_set = StackDataset(**parts.get("test", empty))

    def _trainer_epoch(self) -> int | None:
        """The epoch the trainer is training; None outside its run (a loader made after ``fit``, as
        `multiloss.testing.first_batch` makes one, serves epoch 0 as a fresh run's would)."""
        trainer = self.trainer
        running = trainer is not None and trainer.state.status == TrainerStatus.RUNNING
        return trainer.current_epoch if running else None

    def _ranks(self) -> tuple[int, int]:
        trainer = self.trainer
        return (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)

    def train_dataloader(self) -> DataLoader:
        world_size, rank = self._ranks()
        if self.streams is not None:
            return self.streams.loader("train", world_size, rank)
        if self.drop_last and len(self.train_set) // world_size < self.batch_size:
            raise ConfigError(
                "data.drop_last",
                True,
                f"false, or data.batch_size ≤ the {len(self.train_set) // world_size} training examples a rank has",
                f"with data.batch_size={self.batch_size} every batch would be dropped: an epoch of 0 steps",
            )
        order = EpochOrder(
            len(self.train_set),
            world_size=world_size,
            rank=rank,
            batch_size=self.batch_size,
            shuffle=self.shuffle,
            seed=self.seed,
            drop_last=self.drop_last,
            epoch=self._trainer_epoch,
        )
        return PositionedLoader(
            self.train_set,
            batch_size=self.batch_size,
            sampler=order,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            # Its own generator, so creating an iterator never draws from the global RNG that the
            # model's noise and dropout use (that would break exact resume).
            generator=torch.Generator().manual_seed(self.seed),
            on_resume=self._continue_epoch_at,
        )

    def _continue_epoch_at(self, batches: int) -> None:
        """A resume's loader starts ``batches`` (of this run's shape) into the epoch: the trainer counts them done."""
        if self.trainer is not None:
            internals.continue_epoch_at(self.trainer, batches)

    def val_dataloader(self) -> DataLoader:
        return self._evaluation_loader(self.val_set, "val")

    def test_dataloader(self) -> DataLoader:
        return self._evaluation_loader(self.test_set, "test")

    def _evaluation_loader(self, dataset: StackDataset, part: str) -> DataLoader:
        world_size, rank = self._ranks()
        if self.streams is not None:
            return self.streams.loader(part, world_size, rank)
        # Unrepeated: every example is seen exactly once across ranks (no padding).
        sampler = (
            UnrepeatedDistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False)
            if world_size > 1
            else None
        )
        return DataLoader(
            dataset,
            batch_size=self.val_batch_size,
            sampler=sampler,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            generator=torch.Generator().manual_seed(self.seed),
        )


def check_like_training(arrays: dict[str, torch.Tensor], train: dict[str, torch.Tensor], key: str, path: str) -> None:
    """A validation or test file (or folder) holds the training data's batch keys, examples shaped and typed alike."""
    require(
        set(arrays) == set(train),
        key,
        path,
        f"the training data's batch keys: {sorted(train)}",
        f"it holds {sorted(arrays)}",
    )
    for name, t in arrays.items():
        ref = train[name]
        require(
            t.shape[1:] == ref.shape[1:] and t.is_floating_point() == ref.is_floating_point(),
            key,
            path,
            f"array {name!r} shaped and typed like the training data's: (n, {', '.join(map(str, ref.shape[1:]))}) "
            f"{ref.dtype}",
            f"it is {tuple(t.shape)} {t.dtype}",
        )
