"""Batches as the recipes read them: a dict of named tensors, whatever the data module yields.

multiloss's own data modules yield dicts (``batch["x"]``, ``batch["y"]``, every array of an
``.npz`` under its own name). A user's DataModule may yield ``(x, y)`` tuples, as most PyTorch
datasets do; `as_dict` names them ``x`` and ``y``. Recipes call it once per batch, in
``on_after_batch_transfer``, so a recipe's step always sees a dict.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import lightning as L
import torch
from torch.utils.data import Dataset, IterableDataset

from multiloss.config import ConfigError

_POSITIONAL = ("x", "y")


def as_dict(batch: Any) -> dict[str, Any]:
    """``batch`` as a dict: a mapping as is, a namedtuple by its fields, ``(x, y)``, ``(x,)`` or a tensor by position.

    Raises:
        ConfigError: a sequence of more than two items (which is which cannot be guessed).
    """
    if isinstance(batch, Mapping):
        return batch if isinstance(batch, dict) else dict(batch)
    if isinstance(batch, torch.Tensor):
        return {"x": batch}
    if isinstance(batch, tuple) and hasattr(batch, "_asdict"):
        return dict(batch._asdict())
    if isinstance(batch, Sequence) and not isinstance(batch, str) and 1 <= len(batch) <= len(_POSITIONAL):
        return dict(zip(_POSITIONAL, batch))
    raise ConfigError(
        "data",
        f"<a batch of type {type(batch).__name__}"
        + (f" with {len(batch)} items>" if hasattr(batch, "__len__") else ">"),
        "batches that are a dict of named tensors, an (x, y) or (x,) tuple, a namedtuple or a tensor",
        "cannot tell which item is which",
    )


def take(batch: dict[str, Any], n: int) -> dict[str, Any]:
    """The first ``n`` examples of every tensor in ``batch`` (other values as they are)."""
    return {k: v[:n] if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in batch.items()}


def probe_batch(trainer: L.Trainer, size: int = 2) -> dict[str, Any] | None:
    """A small training batch, collated from the first ``size`` examples, before any training; None if unknown.

    Built from the training loader's dataset and collate function rather than by iterating the
    loader: no worker processes start, no sampler or random stream moves, and the data the run will
    train on is exactly what it would have been. Loaders over iterable datasets (or given to
    ``fit`` without a datamodule) have no such shortcut; the recipe then checks the first real batch.
    """
    datamodule = trainer.datamodule
    if datamodule is None or not hasattr(datamodule, "train_dataloader"):
        return None
    loader = datamodule.train_dataloader()
    dataset, collate = getattr(loader, "dataset", None), getattr(loader, "collate_fn", None)
    if collate is None or not isinstance(dataset, Dataset) or isinstance(dataset, IterableDataset):
        return None
    try:
        if loader.batch_size is None and loader.batch_sampler is None:  # every item already is a batch (streams)
            return take(as_dict(dataset[0]), size) if len(dataset) else None
        n = min(size, len(dataset))
        items = [dataset[i] for i in range(n)]
    except Exception:  # a dataset indexed otherwise (by a batch sampler, ...): the first real batch is checked
        return None
    return as_dict(collate(items)) if items else None


def require_keys(batch: Mapping[str, Any], needed: Sequence[str], why: str) -> None:
    """Raise `ConfigError` (key ``data``) unless ``batch`` holds every key in ``needed``."""
    missing = [k for k in needed if k not in batch]
    if missing:
        raise ConfigError(
            "data",
            f"<batches with keys {sorted(batch)}>",
            f"batches with {', '.join(map(repr, needed))} ({why}); an (x, y) tuple gives 'x' and 'y'",
            f"no {', '.join(map(repr, missing))} in the batch",
        )


def dataset_tensors(datamodule: Any, key: str) -> list[torch.Tensor]:
    """The whole training and validation tensors of batch key ``key``, where the data module holds them
    in memory (multiloss's own data modules: ``StackDataset``s of named tensors) or can read them at little cost
    (a lazily read ``.npy`` column of at most 64 MiB: labels); else nothing."""
    from multiloss.data.columns import NpyRows

    found = []
    for name in ("train_set", "val_set"):
        datasets = getattr(getattr(datamodule, name, None), "datasets", None)
        column = datasets.get(key) if isinstance(datasets, dict) else None
        if isinstance(column, NpyRows) and column.numel() * column.np_dtype.itemsize <= 64 << 20:
            column = column.whole()
        if isinstance(column, torch.Tensor):
            found.append(column)
    return found
