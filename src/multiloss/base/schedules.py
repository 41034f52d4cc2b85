"""Learning-rate schedules: the ``scheduler`` group (``model.scheduler``), stepped in each recipe's training step.

Under manual optimization Lightning steps no scheduler, so each recipe's ``training_step`` does,
right after the optimizer step it belongs to (`multiloss.base.step.step_schedules`).
Each schedule says when it steps (its ``interval``): ``"step"`` after every optimizer step,
``"epoch"`` at each epoch's last batch (so a checkpoint taken at an epoch's end already holds the
next epoch's rate, and a resume from it continues exactly), ``"validation"`` when a validation
ends, on its monitored metric (`StepOnValidation`, before a checkpoint of that moment is written).
A recipe builds one schedule per optimizer from ``model.scheduler`` (a ``_partial_`` config),
passing what it knows of the run (``epochs``, ``total_steps``, the ``monitor``ed validation loss) to
a schedule that takes them and whose config leaves them out or null. Schedules are
``torch.optim.lr_scheduler`` classes, so their state goes into every checkpoint; a torch scheduler
named directly steps per optimizer step.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Literal

import lightning as L
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, ReduceLROnPlateau, StepLR

from multiloss.building.components import accepts, build_callable
from multiloss.callbacks.lean import LeanCallback
from multiloss.config import ConfigError, require

CONSTANT = "multiloss.base.schedules.Constant"


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

    def __init__(self, optimizer: Optimizer, epochs: int | None = None) -> None:
        require(
            isinstance(epochs, int) and epochs >= 1,
            "epochs",
            epochs,
            "a number of epochs ≥ 1 to decay over: the run's trainer.max_epochs (a run bounded by max_steps "
            "alone has no last epoch), or model.scheduler.epochs=<n>, or scheduler=constant",
        )
        self.epochs = epochs
        super().__init__(optimizer, functools.partial(_linear_decay, epochs=epochs))


class WarmupCosine(LambdaLR):
    """A linear warm-up to the configured rate over ``warmup_steps`` optimizer steps, then a cosine down to
    ``min_factor`` × that rate at ``total_steps`` (the run's optimizer steps, unless set)."""

    interval = "step"

    def __init__(
        self, optimizer: Optimizer, total_steps: int | None = None, warmup_steps: int = 0, min_factor: float = 0.0
    ) -> None:
        require(isinstance(warmup_steps, int) and warmup_steps >= 0, "warmup_steps", warmup_steps, "an integer ≥ 0")
        require(
            isinstance(total_steps, int) and total_steps > warmup_steps,
            "total_steps",
            total_steps,
            f"more optimizer steps than warmup_steps={warmup_steps}: the run's (trainer.max_steps or max_epochs), "
            "or model.scheduler.total_steps",
        )
        require(0 <= min_factor <= 1, "min_factor", min_factor, "a number in [0, 1]")
        self.total_steps, self.warmup_steps, self.min_factor = total_steps, warmup_steps, min_factor
        super().__init__(
            optimizer, functools.partial(_warmup_cosine, warmup=warmup_steps, total=total_steps, floor=min_factor)
        )


class ImagesCurve:
    """A value as a function of the images a run has trained on: R3GAN's ``cosine_decay_with_warmup``
    (brownvc/R3GAN ``training/training_loop.py`` 29-38) — a linear warm-up from ``warmup_value`` over
    ``warmup_nimg`` images, ``base_value`` held for ``hold_base_value_nimg`` more, then from ``base_value`` to
    ``final_value`` by ``total_nimg`` along half a cosine (``kind=cosine``) or a line (``kind=linear``), and
    ``final_value`` after. R3GAN's own key names, so its configs port by copy.

    Raises:
        ConfigError: ``total_nimg`` not above ``warmup_nimg + hold_base_value_nimg``; a negative length; ``kind``
            not cosine or linear (keys as given, under their owner's).
    """

    def __init__(
        self,
        base_value: float,
        final_value: float,
        total_nimg: float,
        kind: Literal["cosine", "linear"] = "cosine",
        warmup_value: float = 0.0,
        warmup_nimg: float = 0,
        hold_base_value_nimg: float = 0,
    ) -> None:
        require(kind in ("cosine", "linear"), "kind", kind, "cosine (R3GAN's) or linear")
        require(warmup_nimg >= 0, "warmup_nimg", warmup_nimg, "a number of images ≥ 0")
        require(hold_base_value_nimg >= 0, "hold_base_value_nimg", hold_base_value_nimg, "a number of images ≥ 0")
        require(
            total_nimg > warmup_nimg + hold_base_value_nimg,
            "total_nimg",
            total_nimg,
            f"more images than warmup_nimg + hold_base_value_nimg = {warmup_nimg + hold_base_value_nimg}",
        )
        self.base_value, self.final_value, self.total_nimg, self.kind = base_value, final_value, total_nimg, kind
        self.warmup_value, self.warmup_nimg, self.hold = warmup_value, warmup_nimg, hold_base_value_nimg

    def __call__(self, images: float) -> float:
        if images > self.total_nimg:
            return float(self.final_value)
        if self.warmup_nimg > 0 and images < self.warmup_nimg:
            return (self.base_value - self.warmup_value) / self.warmup_nimg * images + self.warmup_value
        if self.hold > 0 and images <= self.warmup_nimg + self.hold:
            return float(self.base_value)
        progress = (images - self.warmup_nimg - self.hold) / float(self.total_nimg - self.warmup_nimg - self.hold)
        remaining = 0.5 * (1 + math.cos(math.pi * progress)) if self.kind == "cosine" else 1 - progress
        return self.base_value + (1 - remaining) * (self.final_value - self.base_value)


def images_curve(spec: Any, key: str) -> ImagesCurve:
    """``spec`` (a mapping of `ImagesCurve`'s options) as a curve; `ConfigError` under ``key``."""
    require(isinstance(spec, dict), key, spec, "a mapping: {base_value, final_value, total_nimg, kind, warmup_...}")
    try:
        return ImagesCurve(**spec)
    except TypeError as err:
        raise ConfigError(key, spec, f"the options of {ImagesCurve.__name__}", str(err)) from None
    except ConfigError as err:
        raise err.under(key) from None


class OverImages(LambdaLR):
    """The learning rate as a function of the images trained on (`ImagesCurve`, R3GAN's cosine with warm-up): each
    param group's configured rate times the curve, whose values here are factors (R3GAN's 2e-4 → 5e-5 is
    ``base_value: 1, final_value: 0.25`` on an optimizer at lr 2e-4). Read from the recipe's count of images
    (``images_seen``, checkpointed with it) at the start of every training batch, as R3GAN sets its rates at the
    start of each iteration; for recipes that count images (gan).
    """

    interval = "images"

    def __init__(
        self,
        optimizer: Optimizer,
        total_nimg: float,
        final_value: float,
        base_value: float = 1.0,
        kind: Literal["cosine", "linear"] = "cosine",
        warmup_value: float = 0.0,
        warmup_nimg: float = 0,
        hold_base_value_nimg: float = 0,
        images_seen: Any = None,
    ) -> None:
        require(
            callable(images_seen),
            "_target_",
            "multiloss.base.schedules.OverImages",
            "a recipe that counts the images it trains on (recipe=gan), or a schedule over steps (warmup_cosine)",
            "this recipe counts no images",
        )
        curve = ImagesCurve(base_value, final_value, total_nimg, kind, warmup_value, warmup_nimg, hold_base_value_nimg)
        # In the closure only: a schedule's state (its __dict__) goes into checkpoints, which hold plain values.
        super().__init__(optimizer, lambda _: curve(images_seen()))


class StepDecay(StepLR):
    """The rate times ``gamma`` every ``step_size`` epochs."""

    interval = "epoch"

    def __init__(self, optimizer: Optimizer, step_size: int = 1, gamma: float = 0.1) -> None:
        require(isinstance(step_size, int) and step_size >= 1, "step_size", step_size, "an integer ≥ 1 (epochs)")
        require(0 < gamma <= 1, "gamma", gamma, "a factor in (0, 1]")
        super().__init__(optimizer, step_size=step_size, gamma=gamma)


class Plateau(ReduceLROnPlateau):
    """The rate times ``factor`` whenever the validation metric ``monitor`` has not improved for ``patience``
    validations (word_language_model's annealing: ÷ 4 as soon as the validation loss is not below its best).

    ``monitor``: a metric the recipe logs (null: its validation loss, e.g. ``val/loss/ce``), ``mode`` min
    or max. Stepped when a validation ends (`StepOnValidation`).
    """

    interval = "validation"

    def __init__(
        self,
        optimizer: Optimizer,
        monitor: str | None = None,
        mode: Literal["min", "max"] = "min",
        factor: float = 0.25,
        patience: int = 0,
        threshold: float = 0.0,
        min_lr: float = 0.0,
    ) -> None:
        require(
            isinstance(monitor, str) and len(monitor) > 0, "monitor", monitor, "a validation metric, e.g. val/loss/ce"
        )
        require(0 < factor < 1, "factor", factor, "a factor in (0, 1)")
        require(isinstance(patience, int) and patience >= 0, "patience", patience, "an integer ≥ 0 (validations)")
        self.monitor = monitor
        super().__init__(optimizer, mode=mode, factor=factor, patience=patience, threshold=threshold, min_lr=min_lr)


def factor_at(scheduler: LRScheduler, steps: int, group: int, default: float) -> float:
    """The factor ``scheduler`` gives param group ``group`` after ``steps`` of its steps; ``default`` where that is
    not a function of the steps alone (a plateau's depends on the metrics it has seen)."""
    if isinstance(scheduler, LambdaLR):
        return float(scheduler.lr_lambdas[group](steps))
    if isinstance(scheduler, StepLR):
        return float(scheduler.gamma ** (steps // scheduler.step_size))
    return default


class StepOnValidation(LeanCallback):
    """Steps every ``interval = "validation"`` schedule on its monitored metric when a validation ends.

    At ``on_validation_end``, after Lightning has computed the epoch's metrics and before the checkpoint
    callbacks (which Lightning orders last) save: a checkpoint of that moment holds the stepped schedule.
    """

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        for config in trainer.lr_scheduler_configs:
            scheduler = config.scheduler
            if getattr(scheduler, "interval", None) != "validation":
                continue
            value = trainer.callback_metrics.get(scheduler.monitor)
            require(
                value is not None,
                "model.scheduler.monitor",
                scheduler.monitor,
                f"a metric the recipe logs at validation: {', '.join(sorted(trainer.callback_metrics)) or 'none yet'}",
                "no such metric",
            )
            scheduler.step(float(value))


def _one(step: int) -> float:
    return 1.0


def _linear_decay(epoch: int, epochs: int) -> float:
    return max(0.0, 1 - epoch / epochs)


def _warmup_cosine(step: int, warmup: int, total: int, floor: float) -> float:
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def describe_schedule(spec: Any, resolved: dict[str, Any]) -> dict[str, Any]:
    """A schedule config as built: its ``_target_``, its options and the run lengths it was given."""
    if spec is None:
        return {"_target_": CONSTANT}
    if not isinstance(spec, dict):
        return {"_target_": f"{getattr(spec, '__module__', '')}.{getattr(spec, '__qualname__', type(spec).__name__)}"}
    options = {k: v for k, v in spec.items() if not k.startswith("_") and v is not None}
    return {"_target_": spec.get("_target_"), **options, **resolved}


def build_schedule(spec: Any, optimizer: Optimizer, trainer: L.Trainer) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """Lightning's ``lr_scheduler`` entry for ``optimizer`` from a ``_partial_`` schedule config (None for constant),
    and the schedule as built (`describe_schedule`: what a checkpoint keeps of it).

    Raises:
        ConfigError: the schedule's own checks, under ``model.scheduler`` (e.g. ``epochs`` < 1).
    """
    if spec is None or (isinstance(spec, dict) and spec.get("_target_") == CONSTANT):
        return None, describe_schedule(None, {})
    factory = build_callable(spec, "model.scheduler")
    target = spec.get("_target_") if isinstance(spec, dict) else None
    passed = {
        name: length(trainer)
        for name, length in _RUN_LENGTHS.items()
        if target is not None and spec.get(name) is None and accepts(target, name)
    }
    if "monitor" in passed and passed["monitor"] is None:
        metrics = getattr(trainer.lightning_module, "validation_metrics", ())
        raise ConfigError(
            "model.scheduler.monitor",
            None,
            f"a metric the recipe logs at validation: {', '.join(metrics) or 'one of its val/ metrics'}",
            f"{type(trainer.lightning_module).__name__} has no single validation loss to watch by default",
        )
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
    # Lightning keeps "step" or "epoch" (its LR monitor reads it); the recipe steps by the schedule's own.
    interval = "step" if getattr(scheduler, "interval", "step") == "step" else "epoch"
    kept = {name: value for name, value in passed.items() if not callable(value)}  # the clock is the run's, not kept
    return {"scheduler": scheduler, "interval": interval}, describe_schedule(spec, kept)


# What a recipe knows of its run and passes to a schedule that takes it (and whose config leaves it out or null).
_RUN_LENGTHS = {
    "epochs": lambda trainer: trainer.max_epochs,
    "total_steps": lambda trainer: trainer.lightning_module.total_optimizer_steps(),
    "monitor": lambda trainer: trainer.lightning_module.validation_loss,
    "images_seen": lambda trainer: getattr(trainer.lightning_module, "images_seen_clock", None),
}
