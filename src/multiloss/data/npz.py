"""The user's own arrays from a ``.npz`` file (or a pair of ``.npy`` files)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from multiloss.config import require
from multiloss.data.arrays import ArrayDataModule


class NpzDataModule(ArrayDataModule):
    """Arrays ``x_key`` (features, float) and ``y_key`` (integer labels) from ``path`` as ``x`` and ``y``.

    ``path`` is a ``.npz`` file, or a ``.npy`` file of features with ``y_path`` a ``.npy`` of labels.

    Raises:
        ConfigError: the file is missing, a key is not in it, or the arrays' lengths differ.
    """

    def __init__(self, path: str, x_key: str = "x", y_key: str = "y", y_path: str | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        require(Path(path).is_file(), "path", path, "an existing .npz (or .npy) file", "no such file")
        self.path, self.x_key, self.y_key, self.y_path = Path(path), x_key, y_key, y_path
        # Fail now, before training starts, rather than in setup() after outputs exist.
        x, y = self._arrays()
        require(len(x) == len(y), "path", path, f"arrays of the same length (x has {len(x)}, y has {len(y)})")

    def _arrays(self) -> tuple[np.ndarray, np.ndarray]:
        if self.path.suffix == ".npy":
            require(
                self.y_path is not None and Path(self.y_path).is_file(),
                "y_path",
                self.y_path,
                "an existing .npy file of labels (needed when path is a .npy of features)",
            )
            return np.load(self.path, mmap_mode="r"), np.load(self.y_path, mmap_mode="r")
        with np.load(self.path) as arrays:
            for key_name, key in (("x_key", self.x_key), ("y_key", self.y_key)):
                require(key in arrays.files, key_name, key, f"one of the arrays in {self.path}: {arrays.files}")
            return arrays[self.x_key], arrays[self.y_key]

    def load(self) -> dict[str, torch.Tensor]:
        x, y = self._arrays()
        return {
            "x": torch.as_tensor(np.asarray(x), dtype=torch.float32).flatten(1),
            "y": torch.as_tensor(np.asarray(y), dtype=torch.long),
        }
