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
        # names -> the first optimizer step each was non-finite (-1: never), one vector per group of names
        self.first_bad: dict[tuple[str, ...], torch.Tensor] = {}
        self.skipped = 0
        self._pending_losses: list[torch.Tensor] = []  # this step's loss components (skip mode)

    # --- what the module reports -----------------------------------------------------------------

    def record(self, names: tuple[str, ...], values: torch.Tensor, step: int) -> None:
        """One training step's loss components (``values[i]`` is ``names[i]``), on their device, without a sync.

        Called by `Recipe.log_losses` / `Recipe.report_losses`.
        """
        if self.mode == "off":
            return
        self._fold(tuple(f"loss/{n}" for n in names), values, step)
        if self.mode == "skip":
            self._pending_losses.append(values)

    def _fold(self, names: tuple[str, ...], values: torch.Tensor, step: int) -> None:
        """Note ``step`` as the first non-finite step of each entry of ``values`` not already marked: 3 kernels."""
        first = self.first_bad.get(names)
        if first is None:
            first = self.first_bad[names] = torch.full(values.shape, -1, dtype=torch.long, device=values.device)
        first.masked_fill_(torch.isfinite(values).logical_or_(first >= 0).logical_not_(), step)

    # --- hooks -----------------------------------------------------------------------------------

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        pl_module._nonfinite_guard = self  # Recipe.log_losses reports here

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if self.mode == "off":
            return
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not grads:
            return
        # The 2-norm: one fused kernel per device (the ∞-norm is 4× slower on a CPU). NaN and inf
        # propagate into it; a finite norm past float32's range (≥ 1.8e19) also reads as inf, where
        # Adam's squared gradient overflows too.
        total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
        index = next((i for i, o in enumerate(trainer.optimizers) if o is optimizer), 0)
        self._fold((f"gradient of optimizer {index}",), total.reshape(1), trainer.global_step)
        if self.mode == "skip":
            checks = [total.reshape(1), *(v.reshape(-1) for v in self._pending_losses)]
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
        names = [name for group in self.first_bad for name in group]
        steps = torch.cat([first.cpu() for first in self.first_bad.values()]).tolist()
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
