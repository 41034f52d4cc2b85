"""scikit-learn's handwritten digits: 1797 8×8 grey images in 10 classes, shipped with the package."""

from __future__ import annotations

import torch
from sklearn.datasets import load_digits

from multiloss.data.arrays import ArrayDataModule


class DigitsDataModule(ArrayDataModule):
    """Digits as ``x`` (64 pixels scaled to [0, 1]) and ``y`` (class 0-9); nothing downloads."""

    def load(self) -> dict[str, torch.Tensor]:
        digits = load_digits()
        x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
        y = torch.tensor(digits.target, dtype=torch.long)
        return {"x": x, "y": y}
