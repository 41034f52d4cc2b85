"""Loss-weighting balancers: the weights of the one backward from the task losses alone (no per-task gradient).

- `Fixed` (default): the configured task weights, as before balancers existed (bit-identical).
- `Uncertainty`: Kendall, Gal & Cipolla 2018, homoscedastic uncertainty: the loss is
  Σ cᵢ·(exp(-sᵢ)·Lᵢ + sᵢ), sᵢ = log σᵢ² learned with the network's optimizer.
- `DynamicWeightAverage`: Liu, Johns & Davison 2019: wᵢ = K·exp(rᵢ/T) / Σⱼ exp(rⱼ/T), rᵢ the ratio of
  task i's mean training loss over the last two epochs; 1 for the first two epochs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from multiloss.balancers.protocol import Balancer, Reduce
from multiloss.config import require


class Fixed(Balancer):
    """The configured task weights, unchanged: the recipe as it was before balancers."""

    adaptive = False

    def weights(self, losses: torch.Tensor) -> torch.Tensor:
        return self.base


class Uncertainty(Balancer):
    """Kendall, Gal & Cipolla 2018: Σ cᵢ·(exp(-sᵢ)·Lᵢ + sᵢ), with sᵢ = log σᵢ² learned.

    The network's gradient is Σ cᵢ·exp(-sᵢ)·∇Lᵢ (the weights seed the backward); sᵢ's is
    cᵢ·(1 - exp(-sᵢ)·Lᵢ), from `extra`, so sᵢ settles where exp(sᵢ) = Lᵢ: a task with a large loss
    (a noisy one) gets a small weight. ``init_log_variance``: sᵢ at the start (a number, or one per task).
    """

    def __init__(
        self, tasks: Sequence[str], base: Sequence[float], init_log_variance: float | list[float] = 0.0
    ) -> None:
        super().__init__(tasks, base)
        init = (
            [float(init_log_variance)] * len(self.tasks)
            if isinstance(init_log_variance, int | float)
            else [float(v) for v in init_log_variance]
        )
        require(
            len(init) == len(self.tasks) and all(math.isfinite(v) for v in init),
            "init_log_variance",
            init_log_variance,
            f"a finite number, or one per task ({len(self.tasks)}: {list(self.tasks)})",
        )
        self.log_variance = nn.Parameter(torch.tensor(init))

    def weights(self, losses: torch.Tensor) -> torch.Tensor:
        return self.base * torch.exp(-self.log_variance.detach())

    def extra(self, losses: torch.Tensor) -> torch.Tensor:
        s = self.log_variance
        return (self.base * (torch.exp(-s) * losses.detach().to(s.dtype) + s)).sum()


class DynamicWeightAverage(Balancer):
    """Liu, Johns & Davison 2019 (DWA): weights from how fast each task's training loss falls.

    wᵢ(t) = K·exp(rᵢ/T) / Σⱼ exp(rⱼ/T), rᵢ = L̄ᵢ(t-1) / L̄ᵢ(t-2), where L̄ᵢ(e) is task i's mean training
    loss over epoch e (every micro-batch, averaged over the ranks) and K the number of tasks; wᵢ = 1
    for the first two epochs. ``temperature`` T: larger is more even (the paper's 2).
    """

    def __init__(self, tasks: Sequence[str], base: Sequence[float], temperature: float = 2.0) -> None:
        super().__init__(tasks, base)
        require(0 < temperature < math.inf, "temperature", temperature, "a positive number (the paper's 2)")
        self.temperature = float(temperature)
        n = len(self.tasks)
        # All in the checkpoint: a run resumed mid-epoch continues the epoch's sums. The sums are this
        # rank's own, so not buffers: DDP broadcasts rank zero's buffers into every rank at each forward
        # (a checkpoint holds their mean over the ranks, `checkpoint_extra_state`).
        self.epoch_sum = torch.zeros(n)
        self.epoch_count = torch.zeros(())
        self.register_buffer("epoch_means", torch.full((2, n), math.nan))  # epochs t-2, t-1
        self.register_buffer("current", torch.ones(n))
        self.register_buffer("epoch", torch.tensor(-1))  # the epoch the sums are of (-1: none yet)
        self._host_epoch: int | None = None

    def weights(self, losses: torch.Tensor) -> torch.Tensor:
        dtype = torch.float64 if losses.dtype == torch.float64 else self.epoch_sum.dtype  # a 64-true run sums in it
        if self.epoch_sum.device != losses.device or self.epoch_sum.dtype != dtype:  # not buffers: follow the losses
            self.epoch_sum, self.epoch_count = (
                self.epoch_sum.to(losses.device, dtype),
                self.epoch_count.to(losses.device, dtype),
            )
        self.epoch_sum += losses.detach().to(self.epoch_sum.dtype)  # on the device: no host sync
        self.epoch_count += 1
        return self.base * self.current

    def start_epoch(self, epoch: int, reduce: Reduce) -> None:
        if self._host_epoch is None:  # once, and after a checkpoint load: not a device read per batch
            self._host_epoch = int(self.epoch)
        if self._host_epoch == epoch:
            return
        if self._host_epoch >= 0 and bool(self.epoch_count > 0):
            # Sum over the ranks, then divide (equal counts): a resume from the ranks' mean sum gives the same bits.
            mean = reduce(self.epoch_sum) / self.epoch_count
            self.epoch_means.copy_(torch.stack([self.epoch_means[1], mean]))
            self.current.copy_(dwa_weights(self.epoch_means[0], self.epoch_means[1], self.temperature))
        self.epoch_sum.zero_()
        self.epoch_count.zero_()
        self.epoch.fill_(epoch)
        self._host_epoch = epoch

    def get_extra_state(self) -> dict[str, torch.Tensor]:
        # In the buffers' dtype (float64 under 64-true): a sharded load copies the saved sums into these very tensors.
        dtype = self.epoch_means.dtype
        return {"epoch_sum": self.epoch_sum.to(dtype).cpu(), "epoch_count": self.epoch_count.to(dtype).cpu()}

    def checkpoint_extra_state(self, reduce: Reduce) -> dict[str, torch.Tensor]:
        # The ranks' mean of the running sums: every rank resumes with it, and as the epoch's mean is
        # averaged over the ranks (equal counts), mean(partial) + each rank's rest gives the same mean
        # as each rank's own partial sum would have. Exact mid-epoch resume under DDP too.
        return {"epoch_sum": reduce(self.epoch_sum.clone()).cpu(), "epoch_count": self.epoch_count.cpu()}

    def set_extra_state(self, state: dict[str, torch.Tensor]) -> None:
        self.epoch_sum, self.epoch_count = state["epoch_sum"].clone(), state["epoch_count"].clone()

    def _load_from_state_dict(self, *args: object, **kwargs: object) -> None:
        super()._load_from_state_dict(*args, **kwargs)  # type: ignore[arg-type]
        self._host_epoch = None


def dwa_weights(before_last: torch.Tensor, last: torch.Tensor, temperature: float) -> torch.Tensor:
    """DWA's weights from two epochs' mean losses (ones while ``before_last`` is unknown, i.e. NaN)."""
    if bool(torch.isnan(before_last).any()):
        return torch.ones_like(last)
    return len(last) * torch.softmax((last / before_last) / temperature, dim=0)
