"""Gradient accumulation for manual-optimization recipes (GAN, TBPTT).

Lightning's ``Trainer(accumulate_grad_batches=k)`` works only with automatic optimization; with
``automatic_optimization = False`` it raises. A manual recipe has to do the three things Lightning
would have done: divide each micro-batch's loss by k (so k micro-batches of b sum to the mean
gradient of one batch of k·b), step and zero only every k-th micro-batch, and keep DDP from
all-reducing the gradients of the micro-batches that do not step (one all-reduce per optimizer
step instead of k). The last one is ``LightningOptimizer.toggle_model(sync_grad=False)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import lightning as L
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer

from multiloss.config import require


class ManualAccumulation:
    """Accumulate ``every`` micro-batches per optimizer step inside a manual ``training_step``.

    Usage, once per optimizer per micro-batch::

        with self.accumulation.micro_batch(opt_d, index) as backward:
            loss_d = ...                  # forward inside: only opt_d's parameters require grad
            backward(loss_d)              # manual_backward(loss_d / every)
        # here opt_d has stepped and zeroed its gradients iff this was the every-th micro-batch

    ``index`` counts this optimizer's micro-batches (0, 1, 2, ...); the step happens when
    ``(index + 1) % every == 0`` or when ``last`` is true (end of an epoch, so no gradient is
    carried into the next one, as Lightning does). ``every=1`` is plain manual optimization.

    Raises:
        ConfigError: ``every`` < 1.
    """

    def __init__(self, module: L.LightningModule, every: int = 1, key: str = "accumulate_grad_batches") -> None:
        require(every >= 1, key, every, "an integer ≥ 1 (1 = step every micro-batch)")
        self.module, self.every = module, every

    def steps_on(self, index: int, last: bool = False) -> bool:
        return last or (index + 1) % self.every == 0

    @contextmanager
    def micro_batch(
        self,
        optimizer: LightningOptimizer,
        index: int,
        last: bool = False,
    ) -> Iterator[Callable[..., None]]:
        stepping = self.steps_on(index, last)
        if len(self.module.trainer.optimizers) == 1 and stepping:
            # One optimizer owns every trained weight and this micro-batch syncs anyway: toggling
            # would change nothing.
            yield self._backward
        else:
            # toggle_model: only this optimizer's parameters require grad inside the block (the other
            # network's weights get no gradient), and without sync_grad DDP skips the all-reduce.
            with optimizer.toggle_model(sync_grad=stepping):
                yield self._backward
        if stepping:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    def _backward(self, loss: torch.Tensor, **kwargs) -> None:
        # kwargs (gradient=, retain_graph=, ...) pass through to Tensor.backward.
        self.module.manual_backward(loss / self.every if self.every > 1 else loss, **kwargs)
