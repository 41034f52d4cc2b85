"""torchmetrics metrics the recipes share (their states reduce across DDP ranks by themselves)."""

from __future__ import annotations

from collections.abc import Mapping

import lightning as L
import torch
from torch import nn
from torchmetrics import Metric
from torchmetrics.aggregation import MeanMetric


class EpochMeans(nn.ModuleDict):
    """Example-weighted means over an epoch and over every rank, one torchmetrics ``MeanMetric`` per name.

    Not ``self.log(..., on_epoch=True, sync_dist=True)``: Lightning keeps each rank's example count
    in an integer tensor and mean-reduces it across ranks, which floors it. With 180 and 179
    validation examples on two ranks every logged mean is divided by 358 instead of 359, 0.28 % too
    high (Lightning issue #21859, open for 2.6 and 2.7). A ``MeanMetric``'s states are float sums of
    value·n and of n, added up across ranks by torchmetrics: the logged value is the mean over all
    examples, the same on one rank and on many.

    A metric is made on the first value of its name (the recipes' loss components differ), on that
    value's device. Its states are not persistent, so checkpoints keep the same keys.
    """

    def log(
        self, module: L.LightningModule, values: Mapping[str, torch.Tensor], prefix: str, batch_size: int | torch.Tensor
    ) -> None:
        """Add this batch's ``values`` (means over ``batch_size`` examples) and log each as ``<prefix><name>``."""
        if not hasattr(self, "_path"):  # where the module holds it: Lightning finds logged metrics by path
            self._path = next(name for name, child in module.named_modules() if child is self)
        for name, value in values.items():
            if name not in self:
                self[name] = MeanMetric().to(value.device)
            self[name].update(value.detach(), weight=batch_size)
            # Lightning calls compute() (which syncs the ranks) at the epoch's end, then reset().
            module.log(
                f"{prefix}{name}", self[name], on_step=False, on_epoch=True, metric_attribute=f"{self._path}.{name}"
            )


class ModeCoverage(Metric):
    """How much of a Gaussian mixture a generator's samples cover: modes hit, and the high-quality share.

    A sample is *high quality* when it lies within ``n_std`` standard deviations of its nearest
    mode center (3σ holds 98.9 % of a 2-D isotropic Gaussian's own samples). A mode is *hit* when
    it receives at least ``min_fraction`` of its fair share of the samples (n / n_modes, at least
    one): with 2500 samples and 25 modes, 0.2 is PacGAN's "20 of 100". ``compute()`` returns
    ``{"modes": modes hit (out of n_modes), "high_quality": share of high-quality samples}``.

    The states are sums (per-mode counts and the sample count), so under DDP every rank updates
    with its own samples and ``compute()`` adds them up: the result is the one of all samples.
    """

    full_state_update = False
    higher_is_better = True
    is_differentiable = False

    def __init__(
        self,
        centers: torch.Tensor,
        std: float,
        n_std: float = 3.0,
        min_fraction: float = 0.2,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        if centers.ndim != 2 or len(centers) < 1:
            raise ValueError(f"centers must have shape (n_modes, dim), got {tuple(centers.shape)}")
        if std <= 0 or n_std <= 0 or not 0 <= min_fraction <= 1:
            raise ValueError(f"need std > 0, n_std > 0 and 0 ≤ min_fraction ≤ 1 (got {std}, {n_std}, {min_fraction})")
        # Not persistent: the centers come from the data, not from the checkpoint.
        self.register_buffer("centers", centers.detach().clone().float(), persistent=False)
        self.radius, self.min_fraction = n_std * std, min_fraction
        self.add_state("hits", default=torch.zeros(len(centers), dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("total", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    @property
    def n_modes(self) -> int:
        return len(self.centers)

    def update(self, samples: torch.Tensor) -> None:
        distance, nearest = torch.cdist(samples.float(), self.centers).min(dim=1)
        close = distance <= self.radius
        self.hits += torch.bincount(nearest[close], minlength=self.n_modes)
        self.total += len(samples)

    def compute(self) -> dict[str, torch.Tensor]:
        total = self.total.clamp(min=1)
        needed = max(1.0, self.min_fraction * float(total) / self.n_modes)
        return {
            "modes": (self.hits >= needed).sum().float(),
            "high_quality": self.hits.sum().float() / total,
        }


# A metric whose name says lower is better counts with its sign turned in Δp (the errors, the losses, the angles).
LOWER_IS_BETTER = ("mae", "mse", "loss", "err", "angle")


def delta_p(metrics: Mapping[str, float], single: Mapping[str, float], names: list[str]) -> float:
    """LibMTL's Δp in % (``LibMTL/utils.py`` ``count_improvement`` at 4336804, Maninis et al. 2019): for each task,
    the mean over its metrics of ±(M − M_single) / M_single (+ where the metric improves), then the mean over the
    tasks. ``names``: ``val/<metric>/<task>`` keys of both ``metrics`` and ``single`` (each task's run alone)."""
    by_task: dict[str, list[float]] = {}
    for name in names:
        sign = -1.0 if any(word in name.split("/")[-2] for word in LOWER_IS_BETTER) else 1.0
        by_task.setdefault(name.split("/")[-1], []).append(sign * (metrics[name] - single[name]) / single[name])
    return 100 * sum(sum(v) / len(v) for v in by_task.values()) / len(by_task)
