"""The non-finite guard: a NaN or inf loss component or gradient never trains on silently, never reaches a checkpoint.

Without it a diverging run (``lr=1e6``, an infinite head weight, a NaN in the data) exits 0 with NaN
weights in ``last.ckpt``, and ``detect_anomaly`` names an autograd op, never the loss component or
the step. ``nonfinite`` (a top-level key) chooses what happens:

- ``stop`` (default): the run stops with one message naming the first non-finite loss component (or
  gradient) and its optimizer step, and the last good checkpoint. No step is decided on the host:
  each step folds "first bad step" into small tensors on the device, read every
  ``trainer.log_every_n_steps`` steps (when Lightning's logging reads the losses anyway), before
  every checkpoint save and at the end — so the run costs no extra host sync per step, stops at the
  next read, and no checkpoint with non-finite weights is ever written.
- ``skip``: a step whose gradients (or this step's losses) are not finite is not taken: its
  gradients are dropped before ``optimizer.step`` (torch's optimizers then leave those parameters
  and their state alone) and the skips are counted (``nonfinite/skipped`` in the logs). This reads
  one flag on the host per step.
- ``off``: nothing is checked.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

Mode = Literal["stop", "skip", "off"]


class NonFiniteError(RuntimeError):
    """Training produced a NaN or inf loss component or gradient (``nonfinite=stop``)."""


class NonFiniteGuard(L.Callback):
    """Watches every training loss component (``Recipe.log_losses``) and every gradient before its optimizer step."""

    def __init__(self, mode: Mode = "stop") -> None:
        if mode not in ("stop", "skip", "off"):
            raise ValueError(f"nonfinite must be stop, skip or off, not {mode!r}")
        self.mode = mode
        self.first_bad: dict[str, torch.Tensor] = {}  # name -> first optimizer step it was non-finite (-1: never)
        self.skipped = 0
        self._pending_losses: list[torch.Tensor] = []  # this step's loss components (skip mode)

    # --- what the module reports -----------------------------------------------------------------

    def record_losses(self, losses: dict[str, torch.Tensor], step: int) -> None:
        """Called by `Recipe.log_losses` for every training step's components (device tensors, no sync)."""
        if self.mode == "off":
            return
        for name, value in losses.items():
            self._fold(f"loss/{name}", value, step)
        if self.mode == "skip":
            self._pending_losses.extend(v.detach() for v in losses.values())

    def _fold(self, name: str, value: torch.Tensor, step: int) -> None:
        bad = ~torch.isfinite(value.detach()).all()
        first = self.first_bad.get(name)
        if first is None:
            first = self.first_bad[name] = torch.full((), -1, dtype=torch.long, device=value.device)
        first.masked_fill_(bad & (first < 0), step)

    # --- hooks -----------------------------------------------------------------------------------

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        pl_module._nonfinite_guard = self  # Recipe.log_losses reports here

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if self.mode == "off":
            return
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not grads:
            return
        largest = torch.nn.utils.get_total_norm(grads, norm_type=math.inf)  # NaN propagates, inf is inf
        index = next((i for i, o in enumerate(trainer.optimizers) if o is optimizer), 0)
        self._fold(f"gradient of optimizer {index}", largest, trainer.global_step)
        if self.mode == "skip":
            checks = [largest.reshape(1), *(v.reshape(-1) for v in self._pending_losses)]
            self._pending_losses.clear()
            if not bool(torch.isfinite(torch.cat([c.float() for c in checks])).all()):  # the per-step host read
                for group in optimizer.param_groups:
                    for p in group["params"]:
                        p.grad = None  # torch's optimizers skip a parameter without a gradient, state and all
                self.skipped += 1
                pl_module.log("nonfinite/skipped", float(self.skipped), on_step=True, on_epoch=False)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.mode == "stop" and (batch_idx + 1) % max(1, trainer.log_every_n_steps) == 0:
            self.check(trainer)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        if self.mode == "stop":
            self.check(trainer)  # before a single byte of a non-finite model is written

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.mode == "stop":
            self.check(trainer)

    # --- the verdict -----------------------------------------------------------------------------

    def check(self, trainer: L.Trainer) -> None:
        """Raise `NonFiniteError` if anything was non-finite since the run began (one host read)."""
        if not self.first_bad:
            return
        names = list(self.first_bad)
        steps = torch.stack([self.first_bad[n].cpu() for n in names]).tolist()
        # Earliest step first; at one step the loss components before the gradients they caused.
        found = sorted((s, n.startswith("gradient"), n) for s, n in zip(steps, names) if s >= 0)
        if not found:
            return
        step = found[0][0]
        first = [n for s, _, n in found if s == step]
        last_good = _last_checkpoint(trainer)
        raise NonFiniteError(
            f"{' and '.join(first)} became NaN/inf at global step {step}; training stopped "
            f"(last good checkpoint: {last_good or 'none saved yet'}). Likely causes: a learning rate "
            "too high for this loss, an infinite or huge loss weight, NaN/inf in the data; "
            "nonfinite=skip skips such steps instead, debug=anomaly names the operation."
        )


def _last_checkpoint(trainer: L.Trainer) -> str | None:
    for callback in trainer.callbacks:
        if isinstance(callback, ModelCheckpoint):
            path = callback.last_model_path or getattr(callback, "_last_checkpoint_saved", "")
            if path:
                return str(path)
    return None
