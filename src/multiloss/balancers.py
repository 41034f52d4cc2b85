"""Loss balancers: the per-task weights of a multi-task recipe's one backward, fixed or adapted.

A balancer (config group ``balancer``, ``model.balancer``) turns a step's task losses into the
weights that seed the recipe's single backward (``grad_tensors``), and may add a term of its own
whose gradient trains its own parameters. It is an ``nn.Module`` of the recipe: its parameters are
in the recipe's optimizer, its state in the checkpoint, so a resumed run continues exactly.

- `Fixed` (default): the configured task weights, as before balancers existed (bit-identical).
- `Uncertainty`: Kendall, Gal & Cipolla 2018, homoscedastic uncertainty: the loss is
  Σ cᵢ·(exp(-sᵢ)·Lᵢ + sᵢ), sᵢ = log σᵢ² learned with the network's optimizer.
- `DynamicWeightAverage`: Liu, Johns & Davison 2019: wᵢ = K·exp(rᵢ/T) / Σⱼ exp(rⱼ/T), rᵢ the ratio of
  task i's mean training loss over the last two epochs; 1 for the first two epochs.

The configured weights cᵢ (``model.tasks.<task>.weight``) multiply every balancer's weights, so a
weight of 0 keeps a task off whatever the balancer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from multiloss.config import require

Reduce = Callable[[torch.Tensor], torch.Tensor]


class Balancer(nn.Module):
    """Maps a step's task losses to the weights of one backward, plus an optional term of its own.

    ``tasks``: the task names, in the order of the loss vector; ``base``: the configured weights cᵢ.
    """

    adaptive = True  # its weights change: the recipe logs them as weight/<task>

    def __init__(self, tasks: Sequence[str], base: Sequence[float]) -> None:
        super().__init__()
        self.tasks = tuple(tasks)
        # Not persistent: the configured weights come from the config, not from the checkpoint.
        self.register_buffer("base", torch.tensor([float(b) for b in base]), persistent=False)

    def weights(self, losses: torch.Tensor) -> torch.Tensor:
        """This step's weights (one per task) for the detached task losses ``losses``."""
        raise NotImplementedError

    def extra(self, losses: torch.Tensor) -> torch.Tensor | None:
        """A scalar added to the backward to train the balancer's own parameters (None: nothing)."""
        return None

    def start_epoch(self, epoch: int, reduce: Reduce) -> None:
        """Called before each training batch with the epoch it belongs to; ``reduce`` averages over the ranks.

        At a batch, not at an epoch's end: a checkpoint taken at an epoch's end is saved before the
        module's epoch-end hook runs, and a run resumed from it never calls that hook.
        """


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
        # All in the checkpoint: a run resumed mid-epoch continues the epoch's sums.
        self.register_buffer("epoch_sum", torch.zeros(n))
        self.register_buffer("epoch_count", torch.zeros(()))
        self.register_buffer("epoch_means", torch.full((2, n), math.nan))  # epochs t-2, t-1
        self.register_buffer("current", torch.ones(n))
        self.register_buffer("epoch", torch.tensor(-1))  # the epoch the sums are of (-1: none yet)
        self._host_epoch: int | None = None

    def weights(self, losses: torch.Tensor) -> torch.Tensor:
        self.epoch_sum += losses.detach().to(self.epoch_sum.dtype)  # on the device: no host sync
        self.epoch_count += 1
        return self.base * self.current

    def start_epoch(self, epoch: int, reduce: Reduce) -> None:
        if self._host_epoch is None:  # once, and after a checkpoint load: not a device read per batch
            self._host_epoch = int(self.epoch)
        if self._host_epoch == epoch:
            return
        if self._host_epoch >= 0 and bool(self.epoch_count > 0):
            mean = reduce(self.epoch_sum / self.epoch_count)
            self.epoch_means.copy_(torch.stack([self.epoch_means[1], mean]))
            self.current.copy_(dwa_weights(self.epoch_means[0], self.epoch_means[1], self.temperature))
        self.epoch_sum.zero_()
        self.epoch_count.zero_()
        self.epoch.fill_(epoch)
        self._host_epoch = epoch

    def _load_from_state_dict(self, *args: object, **kwargs: object) -> None:
        super()._load_from_state_dict(*args, **kwargs)  # type: ignore[arg-type]
        self._host_epoch = None


def dwa_weights(before_last: torch.Tensor, last: torch.Tensor, temperature: float) -> torch.Tensor:
    """DWA's weights from two epochs' mean losses (ones while ``before_last`` is unknown, i.e. NaN)."""
    if bool(torch.isnan(before_last).any()):
        return torch.ones_like(last)
    return len(last) * torch.softmax((last / before_last) / temperature, dim=0)
