"""The GAN recipe's options, checked together: each one's range, and the combinations no loop can run."""

from __future__ import annotations

from multiloss.config import require
from multiloss.gan.objectives import LOSSES, PENALTIES

G_INPUTS = ("fresh", "same_fakes", "same_z")
G_STEPS_AFTER = ("last", "first", "before")


def penalty_of(penalty: str, penalty_weight: float, gp_weight: float | None) -> tuple[str, float]:
    """``(penalty, penalty_weight)``, from older runs' one-key form too: ``gp_weight=λ`` was ``penalty=gp`` at λ (0:
    none), read from their checkpoints' hyper-parameters."""
    if gp_weight is None:
        return penalty, penalty_weight
    require(
        penalty in ("gp", "none"),
        "gp_weight",
        gp_weight,
        f"unset with model.penalty={penalty} (gp_weight=<λ> is model.penalty=gp model.penalty_weight=<λ>)",
    )
    return ("gp" if gp_weight else "none"), gp_weight


def check_options(
    *,
    loss: str,
    n_critic: int,
    penalty: str,
    penalty_weight: float,
    penalty_every: int,
    latent_dim: int,
    data_dim: int,
    n_plot_samples: int,
    g_input: str,
    g_step_after: str,
    accumulate_grad_batches: int,
) -> None:
    """`ConfigError` naming the first option out of its range, or the option of a combination no loop runs."""
    for key, value in (
        ("n_critic", n_critic),
        ("latent_dim", latent_dim),
        ("data_dim", data_dim),
        ("penalty_every", penalty_every),
    ):
        require(isinstance(value, int) and value >= 1, key, value, "an integer ≥ 1")
    require(loss in LOSSES, "loss", loss, ", ".join(LOSSES))
    require(penalty in PENALTIES, "penalty", penalty, ", ".join(PENALTIES))
    require(
        penalty_weight > 0 if penalty != "none" else penalty_weight >= 0,
        "penalty_weight",
        penalty_weight,
        f"a positive number with penalty={penalty} (λ for gp, γ for r1/r2), or model.penalty=none",
    )
    require(
        loss != "wgan-gp" or penalty != "none",
        "penalty",
        penalty,
        "gp (or r1/r2) with loss=wgan-gp (the Wasserstein critic needs a penalty to stay Lipschitz: "
        "model.penalty=gp model.penalty_weight=0.1), or another model.loss",
    )
    require(
        penalty_every == 1 or penalty != "none",
        "penalty_every",
        penalty_every,
        "1 with penalty=none (it is the lazy penalty's interval)",
    )
    require(n_plot_samples >= 0, "n_plot_samples", n_plot_samples, "an integer ≥ 0 (0 = no sample plots)")
    require(g_input in G_INPUTS, "g_input", g_input, "fresh, same_fakes or same_z")
    require(g_step_after in G_STEPS_AFTER, "g_step_after", g_step_after, "last, first or before")
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
