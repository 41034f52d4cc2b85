"""Exact resume, part two: the random streams (part one is the stateful loader in `multiloss.data`)."""

from __future__ import annotations

from typing import Any

import lightning as L
import numpy as np
import torch

from multiloss import lightning_internals as internals
from multiloss.callbacks.lean import LeanCallback


class RngState(LeanCallback):
    """Stores the torch / numpy / python (and CUDA) RNG states in every checkpoint, restores them on resume.

    Lightning checkpoints the weights, optimizers and loops but not the random streams, so noise
    (GAN latents) and dropout masks after ``ckpt_path=`` differ from an uninterrupted run. The
    states are applied at ``on_train_start``, after the sanity-check validation, because nothing
    between the checkpoint and the next training batch draws from them in an uninterrupted run
    either (the loaders carry their own generators). Stored as tensors and plain tuples so the
    checkpoint still loads with ``torch.load(weights_only=True)``.
    """

    def __init__(self) -> None:
        self._pending: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        states = internals.rng_states()
        kind, keys, pos, has_gauss, cached = states["numpy"]
        states["numpy"] = (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached)
        return {"rng": states}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending = state_dict.get("rng")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._pending is None:
            return
        states = dict(self._pending)
        kind, keys, pos, has_gauss, cached = states["numpy"]
        states["numpy"] = (kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached)
        internals.set_rng_states(states)
        self._pending = None
