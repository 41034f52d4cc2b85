"""A small digits classifier whose hidden layer is the feature space of the GAN's offline quality metrics.

FID, KID and precision/recall/density/coverage need a feature space; Inception's weights cannot be
downloaded here, and a network trained on ImageNet says little about 8 × 8 digits anyway. So the project
trains its own once, on scikit-learn's shipped digits (deterministic: full-batch Adam from a fixed seed,
float64), and ships the weights, versioned: ``assets/digit_features_v<VERSION>.pt``. Numbers computed in
this space compare with numbers computed in the same version only (say the version with them).

    python -m multiloss.gan.digit_features    # retrain and write the weights (a new VERSION for other weights)
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn

VERSION = 1
WEIGHTS = Path(__file__).parents[1] / "assets" / f"digit_features_v{VERSION}.pt"  # multiloss/assets
DIGEST = "d20907687b466eea"  # sha256 (16 hex) of VERSION's weights, as `main` wrote them (twice alike, torch 2.13 CPU)
FEATURES = 64  # the hidden layer's width: the metrics' feature space
PIXELS = 64  # one 8 × 8 digit


def classifier() -> nn.Sequential:
    """64 pixels → 128 → 64 (the features) → 10 classes."""
    return nn.Sequential(
        nn.Linear(PIXELS, 128), nn.ReLU(), nn.Linear(128, FEATURES), nn.ReLU(), nn.Linear(FEATURES, 10)
    )


def digits_split(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The shipped digits in [0, 1] (float64), 80 % to train on, 20 % held out: x_train, y_train, x_held, y_held."""
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float64) / 16.0
    y = torch.tensor(digits.target)
    order = torch.from_numpy(np.random.default_rng(seed).permutation(len(y)))
    cut = int(0.8 * len(y))
    return x[order[:cut]], y[order[:cut]], x[order[cut:]], y[order[cut:]]


def train_classifier(steps: int = 400, seed: int = 0) -> nn.Sequential:
    """Full-batch Adam (lr 1e-2, weight decay 1e-4) on the training 80 %, float64, from ``torch.manual_seed(seed)``."""
    x, y, _, _ = digits_split(seed)
    gen = torch.Generator().manual_seed(seed)
    net = classifier().double()
    with torch.no_grad():
        for p in net.parameters():  # its own draws: the global stream is left alone
            p.copy_((torch.rand(p.shape, generator=gen, dtype=torch.float64) * 2 - 1) / p.shape[-1] ** 0.5)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2, weight_decay=1e-4)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    return net.float().eval()


def weights_digest(path: Path = WEIGHTS) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


class DigitFeatures(nn.Module):
    """The shipped classifier's hidden layer as a frozen feature extractor (torchmetrics' ``feature=`` module).

    Takes samples of k digits (k · 64 values in [0, 1]: ``(N, 64)``, ``(N, 1, 8, 8)``, stacked digits ``(N, 192)``
    or ``(N, 3, 8, 8)``, or enlarged ``(N, k, 8m, 8m)``: averaged back to 8 × 8) and returns each digit's 64
    features side by side, ``(N, k · 64)``; `classify` returns each digit's class ``(N, k)``. ``num_features``:
    k · 64, for torchmetrics.
    """

    def __init__(self, digits_per_sample: int = 1, path: Path = WEIGHTS) -> None:
        super().__init__()
        self.net = classifier()
        self.net.load_state_dict(torch.load(path, weights_only=True))
        self.net.requires_grad_(False).eval()
        self.digits_per_sample = digits_per_sample
        self.num_features = FEATURES * digits_per_sample

    def train(self, mode: bool = True) -> DigitFeatures:  # always in eval mode: a fixed feature space
        return super().train(False)

    def _digits(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 4 and x.shape[-1] > 8:  # enlarged digits (data.resolution): averaged back to 8 × 8
            x = torch.nn.functional.avg_pool2d(x, x.shape[-1] // 8)
        return x.reshape(-1, PIXELS).to(self.net[0].weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net[:4](self._digits(x)).reshape(len(x), -1)

    def classify(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(self._digits(x)).argmax(dim=1).reshape(len(x), -1)


def main() -> None:
    net = train_classifier()
    WEIGHTS.parent.mkdir(exist_ok=True)
    torch.save(net.state_dict(), WEIGHTS)
    _, _, x, y = digits_split()
    accuracy = (net(x.float()).argmax(1) == y).float().mean().item()
    print(f"wrote {WEIGHTS} (sha256 {weights_digest()}): held-out accuracy {accuracy:.3f}")


if __name__ == "__main__":
    main()
