"""A corpus read as continuous streams: the truncated BPTT of language modelling (``data.layout=streams``).

The token ids are cut into B contiguous streams (word_language_model's ``batchify``: the first
``n · B`` tokens as B rows of n, the remainder dropped); batch t is the t-th window of ``seq_len``
tokens of every stream, ``y`` the next tokens (across window boundaries: the last target of one
window is the first input of the next), and the last window of an epoch is shorter where
``seq_len`` does not divide n - 1, as that script's ``get_batch`` makes it. The windows are served in
order, so a recipe that carries its recurrent state from one batch into the next reads every stream
from its start to its end. Under DDP the corpus is cut into world size × B streams and rank r reads
streams r·B to (r+1)·B - 1: a contiguous share of the corpus each, the same number of windows on every
rank, and the world reads exactly the streams one process would with world size × B.
"""

from __future__ import annotations

import math

import torch
from torch.utils.data import DataLoader, Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from multiloss.config import ConfigError, require


def batchify(ids: torch.Tensor, streams: int) -> torch.Tensor:
    """``ids`` as ``streams`` contiguous rows of equal length, the remainder dropped: ``(streams, n)``."""
    n = len(ids) // streams
    return ids[: n * streams].view(streams, n)


class StreamWindows(Dataset):
    """Item t: the t-th window of every stream, ``{"x": (B, L), "y": (B, L)}`` (the last one shorter)."""

    def __init__(self, streams: torch.Tensor, seq_len: int) -> None:
        self.streams, self.seq_len = streams, seq_len

    def __len__(self) -> int:
        return math.ceil((self.streams.shape[1] - 1) / self.seq_len) if self.streams.shape[1] > 1 else 0

    def __getitem__(self, t: int) -> dict[str, torch.Tensor]:
        if not 0 <= t < len(self):
            raise IndexError(t)
        start = t * self.seq_len
        length = min(self.seq_len, self.streams.shape[1] - 1 - start)
        return {
            "x": self.streams[:, start : start + length],
            "y": self.streams[:, start + 1 : start + 1 + length],
        }


def rank_streams(ids: torch.Tensor, per_rank: int, world_size: int, rank: int) -> torch.Tensor:
    """This rank's ``per_rank`` streams of the world's ``world_size × per_rank``."""
    return batchify(ids, per_rank * world_size)[rank * per_rank : (rank + 1) * per_rank]


def check_streams(ids: torch.Tensor, per_rank: int, part: str, key: str = "batch_size", world_size: int = 1) -> None:
    """Raise `ConfigError` unless ``ids`` give every one of the ``world_size × per_rank`` streams at least one
    window (a rank left with empty streams would train or validate on nothing, silently)."""
    most = len(ids) // 2 // world_size
    ranks = f" a rank ({world_size} ranks)" if world_size > 1 else ""
    require(
        len(ids) // (per_rank * world_size) >= 2,
        key,
        per_rank,
        f"at most {most} streams{ranks}: the {part} text holds {len(ids)} tokens, and each of the "
        f"{per_rank * world_size} streams needs 2 (an input and its next token); lower data.{key}",
        f"too many {part} streams",
    )


class TokenStreams:
    """A data module's training, validation and test token ids, served as streams (`stream_loader`).

    ``batch_size`` streams per rank for training, ``val_batch_size`` for validation and test.
    """

    def __init__(self, ids: dict[str, torch.Tensor], batch_size: int, val_batch_size: int, seq_len: int) -> None:
        self.ids, self.seq_len = ids, seq_len
        self.per_rank = {"train": batch_size, "val": val_batch_size, "test": val_batch_size}
        for part, part_ids in ids.items():
            check_streams(part_ids, self.per_rank[part], part, "batch_size" if part == "train" else "val_batch_size")

    def check(self, world_size: int) -> None:
        """Every part's streams of every rank hold a window (`check_streams` over the ``world_size`` ranks)."""
        try:
            for part, part_ids in self.ids.items():
                key = "batch_size" if part == "train" else "val_batch_size"
                check_streams(part_ids, self.per_rank[part], part, key, world_size)
        except ConfigError as err:  # asked by the run, not while the data module is built: its keys in full
            raise err.under("data") from None

    def loader(self, part: str, world_size: int, rank: int) -> DataLoader:
        """The windows of this rank's ``part`` streams, in order: resumable mid-epoch for training (torchdata)."""
        ids = self.ids.get(part, torch.zeros(0, dtype=torch.long))
        streams = rank_streams(ids, self.per_rank[part], world_size, rank) if len(ids) else ids.view(0, 0)
        windows = StreamWindows(streams, self.seq_len)
        # batch_size=None: every item already is a batch, one window of every stream.
        return StatefulDataLoader(windows, batch_size=None) if part == "train" else DataLoader(windows, batch_size=None)
