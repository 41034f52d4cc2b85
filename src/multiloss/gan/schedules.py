"""The GAN's hyper-parameters over the images trained on (``model.schedules``): R3GAN's per-iteration values.

R3GAN (brownvc/R3GAN ``training/training_loop.py`` 307-314, 329-331, 351) computes at the start of every iteration,
from the images shown so far (``cur_nimg``), the learning rate, Adam's β2, the penalties' γ, the G_ema half-life and
the augmentation probability, each along its own `multiloss.base.schedules.ImagesCurve`. Here the learning rate is
the ``scheduler`` group's (``scheduler=images``: the one owner of the rate) and the others are ``model.schedules``:

- ``gamma``: every penalty's weight (R3GAN's γ of γ/2·(R1 + R2));
- ``beta2`` (both optimizers), ``g_beta2``, ``d_beta2``: Adam's β2 (β1 as configured), raised to the lazy correction's
  N/(N+1) where a lazy regularization corrects that optimizer;
- ``ema_half_life``: G_ema's half-life in images (R3GAN's ``ema_scheduler``, from 0: a copy at first);
- ``augment_p``: the augmentation's probability (R3GAN schedules it instead of adapting it).

All read one clock, the recipe's count of images D has trained on (all ranks, every micro-batch), kept in every
checkpoint: a resumed run computes the same values at the same batch.
"""

from __future__ import annotations

from typing import Any

from multiloss.base.schedules import ImagesCurve, images_curve
from multiloss.config import require, require_options

SCHEDULED = ("gamma", "beta2", "g_beta2", "d_beta2", "ema_half_life", "augment_p")


def build_schedules(spec: dict[str, Any] | None) -> dict[str, ImagesCurve]:
    """``model.schedules`` (null: none) as curves by name; `ConfigError` naming ``schedules.<name>.<key>``."""
    if not spec:
        return {}
    require_options(spec, "schedules", SCHEDULED)
    given = {name for name, value in spec.items() if value is not None}
    require(
        not ("beta2" in given and given & {"g_beta2", "d_beta2"}),
        "schedules.beta2",
        spec.get("beta2"),
        "beta2 (both optimizers) or g_beta2 / d_beta2 (one each), not both",
    )
    return {name: images_curve(value, f"schedules.{name}") for name, value in spec.items() if value is not None}


def check_schedules(curves: dict[str, ImagesCurve], *, penalties: bool, ema: Any, augment: Any) -> None:
    """`ConfigError` for a schedule of something the run does not have: γ without a penalty, a half-life without
    G_ema on the half-life convention, p without an augmentation or beside ADA's adaptive p."""
    require(
        "gamma" not in curves or penalties,
        "schedules.gamma",
        "set",
        "null with model.penalty=none (γ is the penalties' weight)",
    )
    require(
        "ema_half_life" not in curves or (ema is not None and ema.decay is None),
        "schedules.ema_half_life",
        "set",
        "null, or with model.g_ema.half_life_images (the half-life convention: R3GAN's)",
    )
    require(
        "augment_p" not in curves or (augment is not None and not augment.adaptive),
        "schedules.augment_p",
        "set",
        "null, or with model.augment and no ada_target (a scheduled p is R3GAN's; ADA adapts its own)",
    )


def beta2_schedule(curves: dict[str, ImagesCurve], network: str) -> tuple[str, ImagesCurve] | None:
    """``(name, curve)`` of Adam's β2 for ``network`` (generator, discriminator): ``beta2`` or its own
    ``g_beta2`` / ``d_beta2``; None when it is not scheduled."""
    name = next((n for n in ("beta2", f"{network[0]}_beta2") if n in curves), None)
    return None if name is None else (name, curves[name])
