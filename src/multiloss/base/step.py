"""`OptimizerStep`: the one owner of what a plain training loop does around its backward, for every recipe.

A recipe writes its step as the hand-written loop reads — forward, losses, backward — inside
``with self.step_of(optimizer, batch_idx) as step:`` and calls ``step.backward(loss)``. The block
decides the rest, identically in all five recipes:

- whether this micro-batch ends an optimizer step (every ``accumulate_grad_batches``-th of its epoch,
  and the epoch's last: no gradient is carried into the next epoch, as Lightning decides);
- the gradient sync of the backward inside (DDP's ``no_sync`` / FSDP2's hand-over when it does not step;
  a component held whole under FSDP2 hands its gradients over at the block's end:
  `multiloss.parallel.parallelism`);
- the weight of each micro-batch's mean loss in its step (`multiloss.base.window`, ``model.accumulation_mean``): its
  examples' share of the step's on every rank (``examples``: W × b × k is one batch of the step's examples on every
  shape, an epoch's ragged last step included), or ``loss / k`` (``micro_batches``, the plain loop's; on a full
  window the two are the same to the bit);
- at the block's end, on a micro-batch that steps: the clean-up (``model.clean_gradients``), clipping
  (``model.gradient_clip_val``), the optimizer's
  step and ``zero_grad(set_to_none=True)``; then, on every micro-batch, the learning-rate schedule (interval
  step after a step, interval epoch after an epoch's last batch).

A multi-optimizer recipe (the GAN) takes one block per network (``toggle=True``: only that network's weights
require grad inside, Lightning's ``toggle_optimizer``), and a step of several micro-batches inside one
training batch (the GAN's generator) iterates ``step.micro_batches(k)``, each micro-batch in its own sync block.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from multiloss import lightning_internals as internals
from multiloss.base.window import MEANS, Window
from multiloss.config import ConfigError, require
from multiloss.parallel.parallelism import NOTHING


class OptimizerStep:
    """One micro-batch (or several, `micro_batches`) of ``optimizer``'s step; see the module's docstring.

    ``stepping``: whether the step is taken at the block's end; ``components``: the networks whose held-whole
    gradients (FSDP2) this block hands over (None: every one held whole); ``batch_done``: whether the training batch
    ends with this block (tbptt's last chunk), for an epoch-interval schedule; ``window``: the step's micro-batches
    and this block's place among them (`multiloss.base.window`), None for the plain ``loss / k``.
    ``counted=False``: an extra step that is not one of the run's (the GAN's lazy regularization step): taken
    through the strategy and precision plugin as any step (16-mixed's unscaling and skip), but not counted in
    ``trainer.global_step`` (so ``trainer.max_steps`` keeps its meaning) and moving no schedule.
    """

    def __init__(
        self,
        recipe: Any,  # a multiloss.base.module.Recipe
        optimizer: Any,
        stepping: bool,
        *,
        components: tuple[str, ...] | None = None,
        toggle: bool = False,
        batch_done: bool = True,
        counted: bool = True,
        window: tuple[Window, int] | None = None,
    ) -> None:
        self.recipe, self.optimizer, self.stepping = recipe, optimizer, stepping
        self.components, self.toggle, self.batch_done, self.counted = components, toggle, batch_done, counted
        self.k = recipe.accumulate_grad_batches
        self.window, self.position = window if window is not None else (None, 0)
        self.parallelism = recipe.parallelism
        self._open: list[Any] = []  # the blocks entered, exited in reverse (a step's few: no ExitStack per step)

    def __enter__(self) -> OptimizerStep:
        # The no-sync block first, then the toggle, as Lightning's toggle_model nests them; the held-whole block
        # innermost: its hand-over at the exit sees the gradients of every backward inside.
        if (block := self.parallelism.no_sync(active=not self.stepping)) is not NOTHING:
            block.__enter__()
            self._open.append(block)
        if self.toggle:
            self.recipe.toggle_optimizer(self.optimizer)
            self._open.append(self)  # (its own __exit__ below: the untoggle)
        if (block := self.parallelism.held_whole(self.stepping, self.components)) is not NOTHING:
            block.__enter__()
            self._open.append(block)
        return self

    def micro_batches(self, n: int) -> Iterator[int]:
        """``n`` micro-batches of this step inside one training batch (the GAN's generator): only the last one's forward
        and backward sync (on a block that steps), the others accumulate unsynced."""
        for i in range(n):
            with self.parallelism.no_sync(active=i < n - 1):
                yield i

    def micro_batch_weight(self, micro: int | None = None) -> float | None:
        """What multiplies a mean loss of this block's micro-batch (``micro``: the step's micro-batch ``micro`` instead,
        the GAN's generator's): its examples' share of the step's (`multiloss.base.window.Window.weight`); None for
        the plain ``loss / k``."""
        if self.window is None:
            return None
        return self.window.weight(self.position if micro is None else micro)

    def backward(
        self,
        loss: torch.Tensor,
        gradient: torch.Tensor | None = None,
        *,
        scaled: bool = False,
        sync: bool = True,
        micro: int | None = None,
    ) -> None:
        """Backward ``loss``, a mean over this micro-batch's examples, weighted in its step (`micro_batch_weight`:
        its examples' share, or / k); ``scaled``: ``loss`` carries its step's weighting already, nothing applied;
        ``micro``: the loss is of the step's micro-batch ``micro`` (the GAN's generator's, several in one block);
        ``gradient``: the seed of a vector of losses (``grad_tensors``); ``sync=False``: this backward does not sync
        even on a micro-batch that steps (a later one in the block syncs the sum: the DCGAN's real-then-fake)."""
        if not scaled:
            weight = self.micro_batch_weight(micro)
            if weight is not None:
                loss = loss * weight
            elif self.k > 1:
                loss = loss / self.k
        kwargs = {} if gradient is None else {"gradient": gradient}
        if sync:
            self.recipe.manual_backward(loss, **kwargs)
            return
        with self.parallelism.no_sync():
            self.recipe.manual_backward(loss, **kwargs)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        # The held-whole hand-over, the toggle undone, the sync restored: innermost first.
        while self._open:  # (none at all on one device, or on a micro-batch that steps under DDP)
            block = self._open.pop()
            if block is self:
                self.recipe.untoggle_optimizer(self.optimizer)
            else:
                block.__exit__(exc_type, exc, tb)
        if exc_type is not None:
            return False
        if self.stepping:
            self.recipe.cleaned_gradients(self.optimizer)  # model.clean_gradients (off: nothing)
            self.recipe.clip_gradients(self.optimizer)
            if self.counted:
                self.optimizer.step()
            else:  # the strategy's step of the torch optimizer: Lightning's wrapper is what counts a step
                self.recipe.trainer.strategy.optimizer_step(getattr(self.optimizer, "optimizer", self.optimizer), _none)
            self.optimizer.zero_grad(set_to_none=True)
        if not self.counted:
            return False
        step_schedules(self.recipe.trainer, self.optimizer, self.stepping, self.batch_done)
        return False


def _none() -> None:
    """The closure of a manual step: the backward has run already."""


def ends_optimizer_step(recipe: Any, batch_idx: int) -> bool:
    """Whether training batch ``batch_idx`` ends an optimizer step: every ``accumulate_grad_batches``-th of its epoch,
    and the epoch's last (no gradient is carried into the next epoch), as Lightning decides."""
    return (batch_idx + 1) % recipe.accumulate_grad_batches == 0 or internals.epoch_ends(recipe.trainer)


def step_schedules(trainer: Any, optimizer: Any, stepped: bool, batch_done: bool = True) -> None:
    """``optimizer``'s schedule: a step after each of its steps (interval step), one after an epoch's last batch
    (interval epoch: once ``batch_done``, tbptt's last chunk); a ``validation`` schedule steps when a validation
    ends (`multiloss.base.schedules.StepOnValidation`)."""
    configs = trainer.lr_scheduler_configs
    if not configs:
        return
    raw = getattr(optimizer, "optimizer", optimizer)
    for config in configs:
        interval = getattr(config.scheduler, "interval", config.interval)  # ours say; torch's: Lightning's
        if config.scheduler.optimizer is raw and (
            (stepped and interval == "step") or (interval == "epoch" and batch_done and internals.epoch_ends(trainer))
        ):
            config.scheduler.step()


def check_step_options(
    accumulate_grad_batches: Any,
    gradient_clip_val: Any,
    gradient_clip_algorithm: Any,
    accumulation_mean: Any = "examples",
) -> None:
    """Refuse a step option out of its range, naming its key (``model.<key>`` once Hydra's instantiation adds it)."""
    require(
        accumulation_mean in MEANS,
        "accumulation_mean",
        accumulation_mean,
        "examples (every example of a step weighs the same, across its micro-batches and ranks) or micro_batches "
        "(the plain loop's loss / k: each micro-batch's mean weighs 1/k)",
    )
    require(
        isinstance(accumulate_grad_batches, int) and accumulate_grad_batches >= 1,
        "accumulate_grad_batches",
        accumulate_grad_batches,
        "an integer ≥ 1 (micro-batches per optimizer step; 1 = no accumulation)",
    )
    require(
        gradient_clip_val is None or gradient_clip_val > 0,
        "gradient_clip_val",
        gradient_clip_val,
        "a positive number (the largest gradient norm, or value, per step), or null for no clipping",
    )
    require(
        gradient_clip_algorithm in ("norm", "value"),
        "gradient_clip_algorithm",
        gradient_clip_algorithm,
        "norm or value",
    )


def refuse_lightning_step_options(trainer: Any) -> None:
    """Refuse the Trainer settings a recipe's step does itself (Lightning cannot apply them under manual
    optimization), naming the recipe's own key."""
    moved = (
        ("accumulate_grad_batches", trainer.accumulate_grad_batches, 1),
        ("gradient_clip_val", trainer.gradient_clip_val, None),
        ("gradient_clip_algorithm", getattr(trainer.gradient_clip_algorithm, "value", None), None),
    )
    for key, value, unset in moved:
        if value != unset:
            with_value = " with model.gradient_clip_val=<max>" if key == "gradient_clip_algorithm" else ""
            raise ConfigError(
                f"trainer.{key}",
                value,
                f"{unset if unset is not None else 'null'}; every recipe does this in its own step: "
                f"model.{key}={value}{with_value}",
                "Lightning cannot apply it under manual optimization",
            )
