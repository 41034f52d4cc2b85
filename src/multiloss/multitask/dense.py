"""NYUv2's three dense tasks as LibMTL writes them: their losses and their metrics (the field's numbers).

LibMTL (median-research-group/LibMTL at 4336804, ``examples/nyu/utils.py``): segmentation — cross-entropy ignoring
label -1, mIoU and pixel accuracy from the epoch's confusion matrix; depth — L1 on the pixels whose depth is not 0,
absolute and relative error over every such pixel of the epoch; surface normals — 1 − cosine on the pixels whose
normal is not 0, the angle error's mean and median and the share of pixels within 11.25°, 22.5° and 30°. The losses
are plain functions (a task's ``loss`` in ``model.tasks``); the metrics are torchmetrics metrics (their states
reduce across ranks by themselves), one number each, grouped per task in a ``torchmetrics.MetricCollection``:
``val/<metric>/<task>``. The pixel accuracy is torchmetrics' own ``MulticlassAccuracy`` (micro, ignore -1); mIoU is
LibMTL's mean over all classes, here, because torchmetrics' ``MulticlassJaccardIndex`` counts a class absent from
both prediction and label as its ``zero_division`` (0) where LibMTL's is NaN (and so its mean): a number here equals
the tables' (and a NaN says a class never occurred).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torchmetrics import Metric
from torchmetrics.utilities import dim_zero_cat


def _valid(target: torch.Tensor) -> torch.Tensor:
    """LibMTL's mask: the pixels whose target, summed over its channels, is not 0 (B, 1, H, W)."""
    return (target.sum(dim=1) != 0).unsqueeze(1)


def segmentation_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the pixels, label -1 ignored (LibMTL's ``SegLoss``)."""
    return F.cross_entropy(output, target.long(), ignore_index=-1)


def depth_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean absolute error over the pixels with a depth (LibMTL's ``DepthLoss``)."""
    mask = _valid(target).to(output.dtype)
    return (torch.abs(output - target) * mask).sum() / mask.sum().clamp_min(1)


def normal_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """1 − the mean cosine between the predicted (normalised) and true unit normals over the pixels with a normal
    (LibMTL's ``NormalLoss``)."""
    mask = _valid(target).to(output.dtype)
    unit = output / output.norm(p=2, dim=1, keepdim=True)
    return 1 - (unit * target * mask).sum() / mask.sum().clamp_min(1)


class MeanIoU(Metric):
    """Mean intersection over union over all ``num_classes`` classes, from the confusion matrix of every pixel whose
    label lies in 0..num_classes-1 (LibMTL's ``SegMetric``: a class absent from both prediction and label is NaN,
    and so is the mean)."""

    higher_is_better = True
    full_state_update = False

    def __init__(self, num_classes: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.num_classes = int(num_classes)
        self.add_state("confusion", torch.zeros(num_classes, num_classes, dtype=torch.int64), dist_reduce_fx="sum")

    def update(self, output: torch.Tensor, target: torch.Tensor) -> None:
        pred = output.argmax(1).flatten()
        gt = target.long().flatten()
        keep = (gt >= 0) & (gt < self.num_classes)
        index = self.num_classes * gt[keep] + pred[keep]
        self.confusion += torch.bincount(index, minlength=self.num_classes**2).reshape(self.num_classes, -1)

    def compute(self) -> torch.Tensor:
        h = self.confusion.double()
        return (torch.diag(h) / (h.sum(1) + h.sum(0) - torch.diag(h))).mean().float()


class DepthError(Metric):
    """The absolute (``relative=False``) or relative error over every pixel with a depth, of the epoch (LibMTL's
    ``DepthMetric``: its batches' means weighted by their valid pixels)."""

    higher_is_better = False
    full_state_update = False

    def __init__(self, relative: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        self.relative = bool(relative)
        self.add_state("total", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, output: torch.Tensor, target: torch.Tensor) -> None:
        mask = _valid(target)
        pred, gt = output.masked_select(mask), target.masked_select(mask)
        error = torch.abs(pred - gt) / gt if self.relative else torch.abs(pred - gt)
        self.total += error.double().sum()
        self.count += mask.sum()

    def compute(self) -> torch.Tensor:
        return (self.total / self.count).float()


class NormalAngleError(Metric):
    """Over every pixel with a normal, of the epoch, the angle (degrees) between the normalised prediction and the
    truth: its ``mean`` or ``median``, or the share of pixels ``within`` ``degrees`` (LibMTL's ``NormalMetric``)."""

    full_state_update = False

    def __init__(self, statistic: str = "mean", degrees: float = 11.25, **kwargs) -> None:
        super().__init__(**kwargs)
        if statistic not in ("mean", "median", "within"):
            raise ValueError(f"statistic={statistic!r}: mean, median or within")
        self.statistic, self.degrees = statistic, float(degrees)
        self.add_state("angles", [], dist_reduce_fx="cat")

    def update(self, output: torch.Tensor, target: torch.Tensor) -> None:
        unit = output / output.norm(p=2, dim=1, keepdim=True)
        mask = target.sum(dim=1) != 0
        cosine = torch.clamp((unit * target).sum(1).masked_select(mask), -1, 1)
        self.angles.append(torch.rad2deg(torch.acos(cosine.double())))

    def compute(self) -> torch.Tensor:
        angles = dim_zero_cat(self.angles)
        if self.statistic == "mean":
            return angles.mean().float()
        if self.statistic == "median":  # numpy's median: the mean of the two middle values for an even count
            return torch.quantile(angles, 0.5, interpolation="midpoint").float()
        return (angles < self.degrees).double().mean().float()
