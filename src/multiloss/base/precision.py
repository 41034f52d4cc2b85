"""Mixed precision under manual optimization: gradients clipped at their true size.

With ``precision=16-mixed`` the backward produces gradients multiplied by the GradScaler's scale.
Clipping must see them divided back (``scaler.unscale_(optimizer)`` first, as PyTorch's AMP recipe
writes it), but Lightning's manual optimization offers no place for that: its ``clip_gradients``
clips the scaled gradients, and its optimizer step unscales unconditionally, so unscaling before it
raises "unscale_() has already been called" (Lightning issue #18089, open). A recipe's
``clip_gradients`` unscales first (`unscale_for_clipping`), and the scaler Lightning holds is this
one, whose second ``unscale_`` in the same step is a no-op.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.amp.grad_scaler import GradScaler

from multiloss import lightning_internals as internals


class UnscaleOnceGradScaler(GradScaler):
    """A ``GradScaler`` whose ``unscale_`` leaves an optimizer already unscaled since the last ``update`` alone."""

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if internals.unscaled_since_update(self, optimizer):
            return
        super().unscale_(optimizer)


def install(precision_plugin: Any) -> None:
    """Give a Lightning precision plugin holding a stock ``GradScaler`` an `UnscaleOnceGradScaler` with its settings."""
    scaler = getattr(precision_plugin, "scaler", None)
    if type(scaler) is not GradScaler:
        return
    settings, stepped = internals.grad_scaler_settings(scaler)
    replacement = UnscaleOnceGradScaler(**settings)
    if stepped:  # a scaler that has stepped already: keep its scale and growth tracker
        replacement.load_state_dict(scaler.state_dict())
    precision_plugin.scaler = replacement


def grad_scaler(precision_plugin: Any) -> GradScaler | None:
    """The GradScaler of ``16-mixed`` (None under any other precision): what a gradient penalty scales its scores by."""
    return getattr(precision_plugin, "scaler", None)


def unscale_for_clipping(precision_plugin: Any, optimizer: Any) -> None:
    """Divide ``optimizer``'s gradients by the loss scale, when there is one (16-mixed), before they are clipped."""
    scaler = getattr(precision_plugin, "scaler", None)
    if scaler is not None:
        # The torch optimizer, not Lightning's wrapper: the scaler keys its per-optimizer state by identity.
        scaler.unscale_(getattr(optimizer, "optimizer", optimizer))


def widened(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in float32 at least: half precision widened for a balancer's or a loss's arithmetic, float64 kept (a
    ``64-true`` run stays float64 end to end, as its proofs need)."""
    return tensor if tensor.dtype == torch.float64 else tensor.float()
