"""Learning-rate schedules: the ``scheduler`` group (``model.scheduler``), stepped in each recipe's training step.

Under manual optimization Lightning steps no scheduler, so each recipe's ``training_step`` does,
right after the optimizer step it belongs to (`multiloss.module.Recipe.step_lr_schedule`). Each
schedule says when it steps, as Lightning's ``interval``: ``"step"`` after every optimizer step,
``"epoch"`` at each epoch's last batch (so a checkpoint taken at an epoch's end already holds the
next epoch's rate, and a resume from it continues exactly). A recipe builds one schedule per
optimizer from ``model.scheduler`` (a ``_partial_`` config), passing what it knows of the run
(``epochs``, ``total_steps``) to a schedule that takes them and whose config leaves them out.
Schedules are ``torch.optim.lr_scheduler`` classes, so their state goes into every checkpoint.
"""

from __future__ import annotations

import functools
from typing import Any

import lightning as L
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from multiloss.components import accepts, build_callable
from multiloss.config import ConfigError, require

CONSTANT = "multiloss.schedules.Constant"


class Constant(LambdaLR):
    """The configured learning rate throughout (the default of every recipe but the GAN). Never stepped."""

    interval = "step"

    def __init__(self, optimizer: Optimizer) -> None:
        super().__init__(optimizer, _one)


class LinearDecay(LambdaLR):
    """Each param group's rate falls linearly from its configured value to 0 by the end of epoch ``epochs``.

    One step per epoch; ``epochs`` is the run's ``trainer.max_epochs`` unless set. The GAN's default: a
    two-player game at a constant rate keeps circling its equilibrium, and a shrinking step lets it
    settle where it is instead of wherever the last step happened to land.
    """

    interval = "epoch"

    def __init__(self, optimizer: Optimizer, epochs: int) -> None:
        require(
            isinstance(epochs, int) and epochs >= 1,
            "epochs",
            epochs,
            "a number of epochs ≥ 1 to decay over: the run's trainer.max_epochs (a run bounded by max_steps "
            "alone has no last epoch), or model.scheduler.epochs=<n>, or scheduler=constant",
        )
        self.epochs = epochs
        super().__init__(optimizer, functools.partial(_linear_decay, epochs=epochs))


def _one(step: int) -> float:
    return 1.0


def _linear_decay(epoch: int, epochs: int) -> float:
    return max(0.0, 1 - epoch / epochs)


def build_schedule(spec: Any, optimizer: Optimizer, trainer: L.Trainer) -> dict[str, Any] | None:
    """Lightning's ``lr_scheduler`` entry for ``optimizer`` from a ``_partial_`` schedule config; None for constant.

    Raises:
        ConfigError: the schedule's own checks, under ``model.scheduler`` (e.g. ``epochs`` < 1).
    """
    if spec is None or (isinstance(spec, dict) and spec.get("_target_") == CONSTANT):
        return None
    factory = build_callable(spec, "model.scheduler")
    target = spec.get("_target_") if isinstance(spec, dict) else None
    passed = {
        name: length(trainer)
        for name, length in _RUN_LENGTHS.items()
        if target is not None and name not in spec and accepts(target, name)
    }
    try:
        scheduler = factory(optimizer, **passed)
    except ConfigError as err:
        raise err.under("model.scheduler") from None
    require(
        isinstance(scheduler, LRScheduler),
        "model.scheduler._target_",
        target,
        "a torch.optim.lr_scheduler class (with _partial_: true)",
        f"it built a {type(scheduler).__name__}",
    )
    return {"scheduler": scheduler, "interval": getattr(scheduler, "interval", "step")}


# What a recipe knows of its run and passes to a schedule that takes it (and whose config leaves it out).
_RUN_LENGTHS = {
    "epochs": lambda trainer: trainer.max_epochs,
    "total_steps": lambda trainer: int(trainer.estimated_stepping_batches),
}
