"""The non-finite guard: a NaN or inf loss component or gradient never trains on silently, never reaches a checkpoint.

Without it a diverging run (``lr=1e6``, an infinite head weight, a NaN in the data) exits 0 with NaN
weights in ``last.ckpt``, and ``detect_anomaly`` names an autograd op, never the loss component or
the step. ``nonfinite`` (a top-level key) chooses what happens:

- ``stop`` (default): the run stops with one message naming the first non-finite loss component and
  its optimizer step (or, when the losses stayed finite, the weights a non-finite gradient reached),
  and the last good checkpoint. Nothing is decided on the host per step: every training loss is kept
  step by step on the device by the recipe's `TrainingLog` anyway, and the log row it writes every
  ``trainer.log_every_n_steps`` batches notes the first step that held a NaN or inf; the guard
  stops the run at the batch after that row. Before every checkpoint save and at the end it also
  reads the rows not yet written and the weights themselves — so it costs nothing per step, and no
  checkpoint with non-finite weights is ever written. (A non-finite gradient makes the weights it
  reaches non-finite at its step, and the next step's losses with them.)
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
from torch.distributed.tensor import DTensor

from multiloss import lightning_internals as internals
from multiloss.callbacks.lean import LeanCallback
from multiloss.saving.saved_state import checkpoint_exists

Mode = Literal["stop", "skip", "off"]


class NonFiniteError(RuntimeError):
    """Training produced a NaN or inf loss component or gradient (``nonfinite=stop``)."""


class NonFiniteGuard(LeanCallback):
    """Judges every training loss component (the recipe's ``training_log``), and the gradients or the weights."""

    def __init__(self, mode: Mode = "stop") -> None:
        if mode not in ("stop", "skip", "off"):
            raise ValueError(f"nonfinite must be stop, skip or off, not {mode!r}")
        self.mode = mode
        self.skipped = 0
        # Lightning skips a hook that is None (multiloss.callbacks.lean): only skip judges each step.
        if mode != "skip":
            self.on_before_optimizer_step = None
        if mode == "off":
            self.on_train_batch_end = None

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not grads:
            return
        # The 2-norm: one fused kernel per device. NaN and inf propagate into it; a finite norm past
        # float32's range (≥ 1.8e19) also reads as inf, where Adam's squared gradient overflows too.
        total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True).reshape(1)
        losses = pl_module.training_log.pop_new_loss_rows() if _is_recipe(pl_module) else []
        checks = torch.cat([total.float(), *(v.reshape(-1).float() for v in losses)])
        if not bool(torch.isfinite(checks).all()):  # the per-step host read
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None  # torch's optimizers skip a parameter without a gradient, state and all
            self.skipped += 1
            pl_module.log("nonfinite/skipped", float(self.skipped), on_step=True, on_epoch=False)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.mode == "stop":
            self.check(trainer, pl_module, read=False)  # what the last log row saw: no device work

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        if self.mode == "stop":
            self.check(trainer, pl_module)  # before a single byte of a non-finite model is written

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.mode == "stop":
            self.check(trainer, pl_module)

    # --- the verdict -----------------------------------------------------------------------------

    def check(self, trainer: L.Trainer, pl_module: L.LightningModule, read: bool = True) -> None:
        """Raise `NonFiniteError` if a loss or a weight is, or was, non-finite since the run began.

        ``read``: also read the loss rows not yet written and the weights (host reads); else only what
        the written log rows showed.
        """
        losses = pl_module.training_log.first_nonfinite(scan=read) if _is_recipe(pl_module) else None
        if losses is not None:
            step, names = losses
            what = f"{' and '.join(names)} became NaN/inf at global step {step}"
        elif not read:
            return
        else:
            weights = nonfinite_weights(pl_module)
            if not weights:
                return
            more = f" and {len(weights) - 3} more" if len(weights) > 3 else ""
            what = (
                f"the weights {', '.join(weights[:3])}{more} became NaN/inf by global step {trainer.global_step} "
                "(a gradient was, while the losses were finite)"
            )
        last_good = _last_checkpoint(trainer)
        raise NonFiniteError(
            f"{what}; training stopped (last good checkpoint: {last_good or 'none saved yet'}). Likely causes: a "
            "learning rate too high for this loss, an infinite or huge loss weight, NaN/inf in the data; "
            "nonfinite=skip skips such steps instead, debug=anomaly names the operation."
        )


def nonfinite_weights(module: torch.nn.Module) -> list[str]:
    """The names of ``module``'s floating-point parameters holding a NaN or inf (one fused pass, one host read).

    Sharded parameters (FSDP2) are judged shard by shard, the ranks' verdicts combined (a collective): every rank
    names the same ones.
    """
    named = [(n, p) for n, p in module.named_parameters() if p.is_floating_point() and p.numel()]
    if not named:
        return []
    local = [p.to_local() if isinstance(p, DTensor) else p for _, p in named]
    norms = internals.foreach_norm([t.detach() for t in local])
    bad = torch.stack([n.float() for n in norms]).isfinite().logical_not()
    if any(isinstance(p, DTensor) for _, p in named):
        bad = bad.int()
        torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
    return [name for (name, _), is_bad in zip(named, bad.tolist()) if is_bad]


def _last_checkpoint(trainer: L.Trainer) -> str | None:
    """The newest checkpoint on disk of finite weights: this run's last save, else the one it resumed from."""
    for callback in trainer.callbacks:
        if isinstance(callback, ModelCheckpoint):
            path = internals.last_saved(callback)
            if path and checkpoint_exists(path):
                return str(path)
    resumed = trainer.ckpt_path
    return str(resumed) if resumed and checkpoint_exists(resumed) else None


def _is_recipe(module: object) -> bool:
    """Whether ``module`` is a multiloss recipe (imported here: the recipes' base imports the callbacks package)."""
    from multiloss.base.module import Recipe

    return isinstance(module, Recipe)
