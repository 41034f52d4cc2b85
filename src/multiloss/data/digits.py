"""scikit-learn's handwritten digits: 1797 8×8 grey images in 10 classes, shipped with the package."""

from __future__ import annotations

import torch
from sklearn.datasets import load_digits

from multiloss.data.arrays import ArrayDataModule


class DigitsDataModule(ArrayDataModule):
    """Digits as named tensors; nothing downloads.

    Batch keys: ``x`` (64 pixels scaled to [0, 1], float32), ``y`` (the class 0-9, int64) and two
    targets derived from them for multi-task models (the weighted recipe's default tasks):
    ``parity`` (1.0 for an odd digit, 0.0 for an even one, float32) and ``ink`` (the image's mean
    pixel intensity, float32).
    """

    def load(self) -> dict[str, torch.Tensor]:
        digits = load_digits()
        x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
        y = torch.tensor(digits.target, dtype=torch.long)
        return {"x": x, "y": y, "parity": (y % 2).float(), "ink": x.mean(dim=1)}
