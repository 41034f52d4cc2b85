"""The GAN's two networks checked on two real samples before the first step: shapes, scores, what the loss needs."""

from __future__ import annotations

import torch
from torch import nn

from multiloss.building.checks import call_component, describe_output
from multiloss.config import ConfigError
from multiloss.gan.objectives import GANLoss
from multiloss.gan.options import loss_name, shown

_BATCH_NORMS = (
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.SyncBatchNorm,
    nn.LazyBatchNorm1d,
    nn.LazyBatchNorm2d,
    nn.LazyBatchNorm3d,
)


def batch_norms(module: nn.Module) -> list[str]:
    """The names of ``module``'s BatchNorm layers."""
    return [name or "(itself)" for name, m in module.named_modules() if isinstance(m, _BATCH_NORMS)]


def check_networks(
    generator: nn.Module,
    discriminator: nn.Module,
    names: tuple[str, str],
    real: torch.Tensor,
    latent_dim: int,
    loss: GANLoss,
    penalties: dict[str, float],
) -> None:
    """`ConfigError` naming ``model.generator`` or ``model.discriminator`` (``names``: their configs' names) when G's
    samples are not shaped like ``real``, D does not give one score a sample, D's scores are not probabilities under
    ``loss=bce``, or D has BatchNorm under a penalty."""
    gen, critic = names
    # On the data's device: at setup Lightning reports the target device while the weights are still on the CPU.
    z = torch.randn(len(real), latent_dim, generator=torch.Generator().manual_seed(0)).to(real.device)
    fake = call_component("model.generator", gen, generator, z, given=f"z: {describe_output(z)}")
    if not isinstance(fake, torch.Tensor) or fake.shape != real.shape:
        raise ConfigError(
            "model.generator",
            gen,
            f"a generator whose samples have the data's sample shape {tuple(real.shape[1:])} "
            f"(from z of model.latent_dim={latent_dim}); with the shipped mlp, set model.data_dim="
            f"{real[0].numel()} (e.g. python train.py recipe=gan data=digits model.data_dim=64)",
            f"for {len(real)} latent vectors it returned {describe_output(fake)}",
        )
    for what, x in (("real", real), ("generated", fake)):
        scores = call_component(
            "model.discriminator", critic, discriminator, x, given=f"{what} samples {describe_output(x)}"
        )
        if not isinstance(scores, torch.Tensor) or scores.numel() != len(x) or scores.shape[0] != len(x):
            raise ConfigError(
                "model.discriminator",
                critic,
                "a discriminator that returns one score per sample, shape (batch,) or (batch, 1)",
                f"for {what} samples {describe_output(x)} it returned {describe_output(scores)}",
            )
        if loss.probabilities and not bool(((scores >= 0) & (scores <= 1)).all()):
            raise ConfigError(
                "model.discriminator",
                critic,
                f"a discriminator that ends in a Sigmoid (probabilities in [0, 1]) with model.loss={loss_name(loss)}, "
                "or model.loss=nonsaturating for one that returns logits (the same loss, on logits)",
                f"for {what} samples its scores reach {float(scores.min()):.3g}..{float(scores.max()):.3g}",
            )
    if penalties and (norms := batch_norms(discriminator)):
        raise ConfigError(
            "model.discriminator",
            critic,
            f"a discriminator without BatchNorm with model.penalty={shown(penalties)} (the penalty needs each "
            "sample's own gradient ∇D(x), and BatchNorm mixes a batch's samples), or model.penalty=none (DCGAN's loop)",
            f"it has BatchNorm: {', '.join(norms[:3])}",
        )
