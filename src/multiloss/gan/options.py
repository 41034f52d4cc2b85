"""The GAN recipe's options, checked together: each one's range, and the combinations no loop can run."""

from __future__ import annotations

from typing import Any

from multiloss.building.components import build_instance
from multiloss.config import require, require_options
from multiloss.gan.objectives import AT, LOSSES, PENALTIES, GANLoss, GradientPenalty, WassersteinGP
from multiloss.gan.path_length import PathLength

G_INPUTS = ("fresh", "same_fakes", "same_z")
G_STEPS_AFTER = ("last", "first", "before")


def penalty_of(
    penalty: Any, penalty_weight: Any, gp_weight: float | None
) -> tuple[dict[str, float], dict[str, GradientPenalty]]:
    """The penalties taken, each with its weight, in the order given, and each built (name → `GradientPenalty`):
    ``penalty`` one of `PENALTIES`, a ``{_target_: ...}`` config of a penalty of your own, or a list of them (R3GAN's
    ``[r1, r2]``), ``penalty_weight`` one number for each or a list as long (γ for r1/r2, λ for gp). Older runs'
    one-key form too: ``gp_weight=λ`` was ``penalty=gp`` at λ (0: none), read from their checkpoints'
    hyper-parameters.

    Raises:
        ConfigError: an unknown name, a target that is not a `GradientPenalty` (or is taken at no place it names), a
            penalty given twice, ``none`` beside another, a weight that is not a positive number (≥ 0 with none), a
            list of weights of another length.
    """
    if gp_weight is not None:
        require(
            penalty in ("gp", "none"),
            "gp_weight",
            gp_weight,
            f"unset with model.penalty={penalty} (gp_weight=<λ> is model.penalty=gp model.penalty_weight=<λ>)",
        )
        return ({"gp": float(gp_weight)}, {"gp": WassersteinGP()}) if gp_weight else ({}, {})
    entries = list(penalty) if isinstance(penalty, list | tuple) else [penalty]
    for entry in entries:
        require(
            not isinstance(entry, str) or entry in PENALTIES or entry == "none",
            "penalty",
            penalty,
            f"one of {', '.join(PENALTIES)}, none, {{_target_: <a GradientPenalty subclass>}}, or a list of them "
            "([r1, r2])",
        )
    if entries == ["none"] or not entries:
        require(_is_number(penalty_weight) and penalty_weight >= 0, "penalty_weight", penalty_weight, "a number ≥ 0")
        return {}, {}
    require("none" not in entries, "penalty", penalty, "none alone, or a list of penalties (gp, r1, r2, yours)")
    weights = list(penalty_weight) if isinstance(penalty_weight, list | tuple) else [penalty_weight] * len(entries)
    require(
        len(weights) == len(entries),
        "penalty_weight",
        penalty_weight,
        f"one number for every penalty, or a list of {len(entries)} (one per penalty in model.penalty={penalty})",
    )
    for weight in weights:
        require(
            _is_number(weight) and weight > 0,
            "penalty_weight",
            penalty_weight,
            f"a positive number with penalty={penalty} (λ for gp, γ for r1/r2: γ/2·E‖∇D‖²), or model.penalty=none",
        )
    built = [
        build_instance(entry, "penalty", GradientPenalty, PENALTIES, "multiloss.gan.objectives.GradientPenalty")
        for entry in entries
    ]
    terms = {term.key(): term for term in built}
    require(len(terms) == len(built), "penalty", penalty, "each penalty once")
    for term in built:
        require(
            term.at in AT,
            "penalty",
            penalty,
            f"penalties taken at {', '.join(AT)} ({type(term).__qualname__}.at is {term.at!r})",
        )
    return {name: float(weight) for name, weight in zip(terms, weights)}, terms


def build_loss(loss: Any) -> GANLoss:
    """``model.loss``: a shipped spelling (`LOSSES`), a ``{_target_: ...}`` config of a `GANLoss` of your own, or one
    given as is; anything else refused naming ``loss``."""
    return build_instance(loss, "loss", GANLoss, LOSSES, "multiloss.gan.objectives.GANLoss")


def loss_name(loss: GANLoss) -> str:
    """How messages write ``model.loss``: its shipped spelling, or its class."""
    return loss.name or type(loss).__qualname__


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def shown(penalties: dict[str, float]) -> str:
    """``model.penalty`` as the user would write it: r1, [r1,r2], none."""
    if not penalties:
        return "none"
    return next(iter(penalties)) if len(penalties) == 1 else "[" + ",".join(penalties) + "]"


def check_options(
    *,
    loss: GANLoss,
    n_critic: int,
    penalties: dict[str, float],
    penalty_every: int,
    g_reg_every: int,
    latent_dim: int,
    data_dim: int,
    n_plot_samples: int,
    g_input: str,
    g_step_after: str,
    accumulate_grad_batches: int,
    g_reals: str = "d_batch",
) -> None:
    """`ConfigError` naming the first option out of its range, or the option of a combination no loop runs."""
    for key, value in (
        ("n_critic", n_critic),
        ("latent_dim", latent_dim),
        ("data_dim", data_dim),
        ("penalty_every", penalty_every),
        ("g_reg_every", g_reg_every),
    ):
        require(isinstance(value, int) and value >= 1, key, value, "an integer ≥ 1")
    require(
        not loss.needs_penalty or bool(penalties),
        "penalty",
        "none",
        f"gp (or r1/r2) with loss={loss_name(loss)} (the Wasserstein critic needs a penalty to stay Lipschitz: "
        "model.penalty=gp model.penalty_weight=0.1), or another model.loss",
    )
    require(
        penalty_every == 1 or bool(penalties),
        "penalty_every",
        penalty_every,
        "1 with penalty=none (it is the lazy penalty's interval)",
    )
    require(n_plot_samples >= 0, "n_plot_samples", n_plot_samples, "an integer ≥ 0 (0 = no sample plots)")
    require(g_input in G_INPUTS, "g_input", g_input, "fresh, same_fakes or same_z")
    require(g_step_after in G_STEPS_AFTER, "g_step_after", g_step_after, "last, first or before")
    require(g_reals in ("d_batch", "own_batch"), "g_reals", g_reals, "d_batch or own_batch")
    require(
        g_reals == "d_batch"
        or (loss.paired and n_critic == 1 and accumulate_grad_batches == 1 and g_step_after == "last"),
        "g_reals",
        g_reals,
        "d_batch, or own_batch with model.loss=relativistic, model.n_critic=1, model.accumulate_grad_batches=1 and "
        "model.g_step_after=last (R3GAN's loop: D on one batch, then G on the next, its fakes paired with its reals)",
    )
    require(
        g_step_after != "before" or g_input == "fresh",
        "g_input",
        g_input,
        "fresh with g_step_after=before (G steps before D has drawn its noise or scored its fakes)",
    )
    require(
        g_input != "same_fakes" or accumulate_grad_batches == 1,
        "g_input",
        g_input,
        f"fresh or same_z with model.accumulate_grad_batches={accumulate_grad_batches} (same_z runs G again "
        "on each micro-batch's noise), or model.accumulate_grad_batches=1",
        "same_fakes keeps G's graph from D's micro-batch to G's step: k batches' graphs at once",
    )


def build_path_length(spec: dict[str, Any] | None, g_reg_every: int) -> PathLength | None:
    """``model.path_length`` (null: off) as a `PathLength`, taken every ``g_reg_every`` G steps."""
    if spec is None:
        return None
    require_options(spec, "path_length", ("weight", "decay", "batch_shrink"))
    return PathLength(**spec)
