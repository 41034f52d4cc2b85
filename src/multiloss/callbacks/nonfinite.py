"""The non-finite guard: a NaN or inf loss component or gradient never trains on silently, never reaches a checkpoint.

Without it a diverging run (``lr=1e6``, an infinite head weight, a NaN in the data) exits 0 with NaN
weights in ``last.ckpt``, and ``detect_anomaly`` names an autograd op, never the loss component or
the step. ``nonfinite`` (a top-level key) chooses what happens:

- ``stop`` (default): the run stops with one message naming the first non-finite loss component (or
  gradient) and its optimizer step, and the last good checkpoint. No step is decided on the host:
  every training loss is already kept step by step on the device by the recipe's `TrainingLog`
  (which also writes the log rows), and each optimizer step's gradient norm goes into a row of its
  own here (one kernel); both are read every ``trainer.log_every_n_steps`` batches (when Lightning's
  logging reads the losses anyway), before every checkpoint save and at the end — so the run costs
  no extra host sync per step, stops at the next read, and no checkpoint with non-finite weights is
  ever written.
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

from multiloss.module import Recipe
from multiloss.training_log import StepRows

Mode = Literal["stop", "skip", "off"]


class NonFiniteError(RuntimeError):
    """Training produced a NaN or inf loss component or gradient (``nonfinite=stop``)."""


class NonFiniteGuard(L.Callback):
    """Judges every training loss component (the recipe's ``training_log``) and every gradient before its step."""

    def __init__(self, mode: Mode = "stop") -> None:
        if mode not in ("stop", "skip", "off"):
            raise ValueError(f"nonfinite must be stop, skip or off, not {mode!r}")
        self.mode = mode
        self.gradient_norms: dict[int, StepRows] = {}  # optimizer index -> one row per step: its gradient norm
        self.skipped = 0

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if self.mode == "off":
            return
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not grads:
            return
        # The 2-norm: one fused kernel per device (the ∞-norm is 4× slower on a CPU). NaN and inf
        # propagate into it; a finite norm past float32's range (≥ 1.8e19) also reads as inf, where
        # Adam's squared gradient overflows too.
        total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True).reshape(1)
        if self.mode == "skip":
            losses = pl_module.training_log.take_unjudged() if isinstance(pl_module, Recipe) else []
            checks = torch.cat([total.float(), *(v.reshape(-1).float() for v in losses)])
            if not bool(torch.isfinite(checks).all()):  # the per-step host read
                for group in optimizer.param_groups:
                    for p in group["params"]:
                        p.grad = None  # torch's optimizers skip a parameter without a gradient, state and all
                self.skipped += 1
                pl_module.log("nonfinite/skipped", float(self.skipped), on_step=True, on_epoch=False)
            return
        index = next((i for i, o in enumerate(trainer.optimizers) if o is optimizer), 0)
        rows = self.gradient_norms.get(index)
        if rows is None:
            rows = self.gradient_norms[index] = StepRows(1, total.device)
        rows.append(total, trainer.global_step)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.mode == "stop" and (batch_idx + 1) % max(1, trainer.log_every_n_steps) == 0:
            self.check(trainer, pl_module)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        if self.mode == "stop":
            self.check(trainer, pl_module)  # before a single byte of a non-finite model is written

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.mode == "stop":
            self.check(trainer, pl_module)

    # --- the verdict -----------------------------------------------------------------------------

    def check(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Raise `NonFiniteError` if anything was non-finite since the run began (host reads)."""
        found: list[tuple[int, bool, str]] = []
        if isinstance(pl_module, Recipe) and (losses := pl_module.training_log.first_nonfinite()) is not None:
            step, names = losses
            found += [(step, False, name) for name in names]
        for index, rows in self.gradient_norms.items():
            if (step := rows.settle()) is not None:
                found.append((step, True, f"gradient of optimizer {index}"))
        if not found:
            return
        # Earliest step first; at one step the loss components before the gradients they caused.
        found.sort()
        step = found[0][0]
        first = [name for s, _, name in found if s == step]
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
