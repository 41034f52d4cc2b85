"""scikit-learn's handwritten digits (1797 8×8 grey images, 10 classes; shipped with the package), and pairs of them."""

from __future__ import annotations

import numpy as np
import torch
from sklearn.datasets import load_digits

from multiloss.config import require
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


class DigitPairsDataModule(ArrayDataModule):
    """Two digits in one image, MultiMNIST-style (Sener & Koltun 2018): a multi-task set whose tasks compete.

    Example i overlays digit image i (top left) and image ``π(i)`` (bottom right, π a fixed
    permutation drawn from ``pair_seed``) on a 12×12 canvas, shifted by ``offset`` pixels on both
    axes; where they overlap a pixel is the brighter of the two. Batch keys: ``x`` (144 pixels in
    [0, 1], float32), ``left`` and ``right`` (the two classes, int64). One trunk must keep both digits
    apart in the shared pixels, so the two tasks compete for it (``experiment=digit_pairs`` with
    ``monitor=conflicts``: their trunk gradients disagree on 46 % of the steps, mean cosine 0.10).

    Raises:
        ConfigError: ``offset`` outside [0, 4] (the canvas is 8 + 4 pixels wide); the base class's checks.
    """

    def __init__(self, offset: int = 3, pair_seed: int = 0, **kwargs) -> None:
        super().__init__(**kwargs)
        require(0 <= offset <= 4, "offset", offset, "an integer in [0, 4] (0 = the two digits fully overlaid)")
        self.offset, self.pair_seed = offset, pair_seed

    def load(self) -> dict[str, torch.Tensor]:
        digits = load_digits()
        images = torch.tensor(digits.images, dtype=torch.float32) / 16.0
        labels = torch.tensor(digits.target, dtype=torch.long)
        partner = torch.from_numpy(np.random.default_rng(self.pair_seed).permutation(len(labels)))
        canvas = torch.zeros(len(labels), 12, 12)
        canvas[:, :8, :8] = images
        o = self.offset
        canvas[:, o : o + 8, o : o + 8] = torch.maximum(canvas[:, o : o + 8, o : o + 8], images[partner])
        return {"x": canvas.flatten(1), "left": labels, "right": labels[partner]}


class StackedDigitsDataModule(ArrayDataModule):
    """Stacked digits, the StackedMNIST of GAN papers (Metz et al. 2017) from the shipped digits: each sample is
    ``digits`` 8 × 8 digit images side by side (``x``: ``digits`` · 64 values in [0, 1], float32), so 10^digits
    modes (1,000 for 3); ``y`` the mode (the classes read as one number, int64). ``n_samples`` samples, their
    digits drawn uniformly from the 1,797 images by ``sample_seed`` alone (never by the training ``seed``).
    ``resolution`` N (a multiple of 8): each sample an image of ``digits`` channels, N × N, each digit enlarged
    by repeating its pixels (for the convolutional nets; the metrics' classifier averages them back to 8 × 8).

    Raises:
        ConfigError: ``digits`` < 1, ``n_samples`` < 2, ``resolution`` not a multiple of 8; the base class's checks.
    """

    def __init__(
        self, digits: int = 3, n_samples: int = 20000, sample_seed: int = 0, resolution: int | None = None, **kwargs
    ) -> None:
        super().__init__(**kwargs)
        require(digits >= 1, "digits", digits, "an integer ≥ 1 (3 = the 1,000-mode StackedMNIST)")
        require(n_samples >= 2, "n_samples", n_samples, "an integer ≥ 2")
        require(
            resolution is None or (isinstance(resolution, int) and resolution >= 8 and resolution % 8 == 0),
            "resolution",
            resolution,
            "null (flat samples of digits · 64 values) or a multiple of 8 (32: images for the conv nets)",
        )
        self.digits, self.n_samples, self.sample_seed, self.resolution = digits, n_samples, sample_seed, resolution

    def load(self) -> dict[str, torch.Tensor]:
        digits = load_digits()
        x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
        labels = torch.tensor(digits.target, dtype=torch.long)
        pick = torch.from_numpy(
            np.random.default_rng(self.sample_seed).integers(len(x), size=(self.n_samples, self.digits))
        )
        powers = 10 ** torch.arange(self.digits - 1, -1, -1)
        samples = x[pick].flatten(1)
        if self.resolution is not None:
            factor = self.resolution // 8
            images = samples.view(-1, self.digits, 8, 8)
            samples = images.repeat_interleave(factor, dim=2).repeat_interleave(factor, dim=3).contiguous()
        return {"x": samples, "y": (labels[pick] * powers).sum(dim=1)}
