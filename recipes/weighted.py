"""Recipe `weighted`: multi-task learning, several weighted losses through one backward with ``grad_tensors``.

One trunk, three task heads on the digits (the class, odd/even, the ink mass of the image), and a
weight per task. The tempting loop, one ``backward`` per task loss, fails on the second task with
the error the seeds keep meeting:

    RuntimeError: Trying to backward through the graph a second time, but the buffers have
    already been freed. Specify retain_graph=True when calling backward the first time.

because the first call frees the trunk's saved tensors; ``retain_graph=True`` on all but the last
makes it run, at the price of keeping the graph alive and walking the trunk once per task. And
stacking the losses and calling ``losses.backward()`` on the vector fails with torch's
``grad can be implicitly created only for scalar outputs``. The seed's answer (its grad_tensors
example: y0=(x+w)(w+1), y1=(x+w)+(w+1), weights [1, 2] give dw = 1·5 + 2·2 = 9) is to hand the
vector of losses and the vector of weights to one backward::

    torch.autograd.backward(losses, grad_tensors=weights)    # == (weights * losses).sum().backward()

The weights are the vector-Jacobian product's seed: autograd starts the pass from ∂total/∂lossᵢ = wᵢ
and the trunk receives Σ wᵢ·∂lossᵢ/∂trunk in a single traversal, no retained graph.
`tests/recipes/test_weighted.py` proves it equals the backward of Σ wᵢ·lossᵢ, reproduces the seed's
dw = 9 through the same function, and shows a zero weight leaves its head with a zero gradient.

    python train.py recipe=weighted                                # weights [1, 1, 30]
    python train.py recipe=weighted model.loss_weights=[1,0,30]    # parity switched off
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import MeanAbsoluteError
from torchmetrics.classification import BinaryAccuracy, MulticlassAccuracy

from multiloss.config import require
from multiloss.module import OptimizerFactory, RecipeModule
from multiloss.nets import dense_block

TASKS = ("digit", "parity", "ink")


def weighted_backward(losses: torch.Tensor, weights: torch.Tensor, **kwargs: Any) -> None:
    """One backward pass of Σ weightsᵢ·lossesᵢ, for a 1-D tensor of losses: the recipe's only backward.

    ``torch.autograd.backward(losses, grad_tensors=weights)``: the weights seed the backward pass
    instead of a scalar 1, so the graph is walked once and freed once. ``kwargs`` go to
    ``torch.autograd.backward`` (``create_graph=`` for higher-order gradients).
    """
    torch.autograd.backward(losses, grad_tensors=weights.to(losses.dtype), **kwargs)


class WeightedMultiTask(RecipeModule):
    """Multi-task digits: class, parity and ink-mass heads on one trunk, one backward weighted by loss_weights.

    A trunk of ``depth`` dense blocks and three heads: ``digit`` (10-way cross-entropy), ``parity``
    (odd/even, binary cross-entropy on one logit) and ``ink`` (the image's mean pixel intensity,
    in [0, 1], mean squared error). ``training_step`` returns the vector of the three losses;
    ``backward`` is `weighted_backward` with ``loss_weights``, one pass, no ``retain_graph``.
    Logs ``loss/{digit,parity,ink}`` and ``loss/total`` (= Σ wᵢ·lossᵢ) per step, ``val/loss/<task>``
    and ``val/acc/digit``, ``val/acc/parity``, ``val/mae/ink`` per validation (``val/acc`` is the digit
    accuracy), and plots the three validation metrics over the steps to ``task_metrics.png`` in the run dir.

    Automatic optimization, so ``trainer.accumulate_grad_batches``, ``gradient_clip_val``, mixed
    precision and DDP's skipped all-reduce all work as usual. No dropout or BatchNorm by default,
    so a batch split over micro-batches or ranks gives the same gradient; both are options
    (``model.dropout``, ``model.batch_norm``).

    Raises:
        ConfigError: ``loss_weights`` not one number per task (3: digit, parity, ink), negative, or
            all zero; ``depth`` or ``width`` < 1; ``num_classes`` < 2; ``dropout`` outside [0, 1).
    """

    def __init__(
        self,
        optimizer: OptimizerFactory,
        loss_weights: list[float] | None = None,
        in_features: int = 64,
        num_classes: int = 10,
        width: int = 128,
        depth: int = 2,
        dropout: float = 0.0,
        batch_norm: bool = False,
    ) -> None:
        super().__init__(optimizer)
        # A plain list (Hydra passes a ListConfig): save_hyperparameters stores it in every
        # checkpoint, which must load with torch.load(weights_only=True).
        loss_weights = [1.0] * len(TASKS) if loss_weights is None else [float(w) for w in loss_weights]
        require(
            len(loss_weights) == len(TASKS),
            "loss_weights",
            loss_weights,
            f"one weight per task: {len(TASKS)} numbers, for {', '.join(TASKS)}",
            "wrong length",
        )
        require(
            all(w >= 0 for w in loss_weights) and sum(loss_weights) > 0,
            "loss_weights",
            loss_weights,
            "non-negative numbers, not all zero (0 switches a task off)",
        )
        require(depth >= 1, "depth", depth, "an integer ≥ 1 (the number of dense blocks in the trunk)")
        require(width >= 1, "width", width, "an integer ≥ 1")
        require(num_classes >= 2, "num_classes", num_classes, "an integer ≥ 2")
        require(0 <= dropout < 1, "dropout", dropout, "a probability in [0, 1)")
        # The optimizer factory stays out: checkpoints then load with torch.load(weights_only=True).
        self.save_hyperparameters(ignore=["optimizer"], logger=False)
        self.loss_weights = loss_weights
        # A buffer, so the weights follow the module to its device (and its dtype under
        # precision="bf16-true"); not persistent: they come from the config, not the checkpoint.
        self.register_buffer("task_weights", torch.tensor(loss_weights), persistent=False)

        sizes = [in_features] + [width] * depth
        self.trunk = nn.Sequential(*(dense_block(a, b, dropout, batch_norm) for a, b in itertools.pairwise(sizes)))
        self.heads = nn.ModuleDict(
            {"digit": nn.Linear(width, num_classes), "parity": nn.Linear(width, 1), "ink": nn.Linear(width, 1)}
        )
        self.val_digit_acc = MulticlassAccuracy(num_classes, average="micro")
        self.val_parity_acc = BinaryAccuracy()
        self.val_ink_mae = MeanAbsoluteError()
        # (step, metrics) after each validation, for task_metrics.png; kept in the checkpoint so a
        # resumed run's plot continues the curves.
        self.history: list[dict[str, float]] = []

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each task's raw output: digit logits (B, C), parity logit (B,), ink mass (B,)."""
        h = self.trunk(x)
        return {
            "digit": self.heads["digit"](h),
            "parity": self.heads["parity"](h).squeeze(-1),
            "ink": self.heads["ink"](h).squeeze(-1),
        }

    @staticmethod
    def targets(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The three tasks' targets, all derived from the digits batch: class, odd (1) / even (0), mean ink."""
        return {"digit": batch["y"], "parity": (batch["y"] % 2).float(), "ink": batch["x"].mean(dim=1)}

    def losses(self, outputs: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each task's mean loss over the batch, in TASKS order (mean, so batches and ranks average exactly)."""
        return {
            "digit": F.cross_entropy(outputs["digit"], targets["digit"]),
            "parity": F.binary_cross_entropy_with_logits(outputs["parity"], targets["parity"]),
            "ink": F.mse_loss(outputs["ink"], targets["ink"]),
        }

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        per_task = self.losses(self(batch["x"]), self.targets(batch))
        losses = torch.stack([per_task[name] for name in TASKS])
        total = (self.task_weights * losses.detach()).sum()
        self.log_losses({**per_task, "total": total}, batch_size=len(batch["y"]))
        # The vector of task losses, not a scalar: Lightning divides it by accumulate_grad_batches
        # (and AMP scales it) element-wise, then hands it to `backward` below.
        return losses

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        # Why automatic optimization with this hook rather than manual optimization and
        # manual_backward(losses, gradient=w): everything Lightning does around the backward (loss
        # / accumulate_grad_batches, no DDP all-reduce on non-stepping micro-batches, AMP loss
        # scaling, gradient clipping, the optimizer step and zero_grad) stays Lightning's, and
        # `trainer.accumulate_grad_batches` keeps working; manual optimization rejects it and
        # gradient_clip_val at fit time. Only the backward call itself changes: one weighted pass.
        weighted_backward(loss, self.task_weights, **kwargs)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        outputs, targets = self(batch["x"]), self.targets(batch)
        per_task = self.losses(outputs, targets)
        total = sum(w * per_task[name] for w, name in zip(self.loss_weights, TASKS))
        self.log_losses({**per_task, "total": total}, prefix="val/loss/", batch_size=len(batch["y"]))
        self.val_digit_acc(outputs["digit"], targets["digit"])
        # Probabilities, not logits: BinaryAccuracy would take a batch of logits that happen to lie
        # in [0, 1] for probabilities.
        self.val_parity_acc(torch.sigmoid(outputs["parity"]), targets["parity"].long())
        self.val_ink_mae(outputs["ink"], targets["ink"])
        self.log("val/acc/digit", self.val_digit_acc, on_epoch=True)
        self.log("val/acc/parity", self.val_parity_acc, on_epoch=True)
        self.log("val/mae/ink", self.val_ink_mae, on_epoch=True)
        self.log("val/acc", self.val_digit_acc, on_epoch=True, prog_bar=True)

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:
            return
        # compute() syncs over ranks (every rank calls it) and caches the value Lightning then logs.
        self.history.append(
            {
                "step": float(self.global_step),
                "digit accuracy": self.val_digit_acc.compute().item(),
                "parity accuracy": self.val_parity_acc.compute().item(),
                "ink-mass MAE": self.val_ink_mae.compute().item(),
            }
        )

    def on_train_epoch_end(self) -> None:
        self._write_plot()

    def on_train_end(self) -> None:
        # Also here: a run stopped by max_steps mid-epoch never reaches on_train_epoch_end.
        self._write_plot()

    def _write_plot(self) -> None:
        if self.trainer.is_global_zero and self.history:
            self._plot_history(Path(self.trainer.default_root_dir) / "task_metrics.png")

    def _plot_history(self, path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        steps = [h["step"] for h in self.history]
        names = [k for k in self.history[0] if k != "step"]
        fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.4))
        for ax, name in zip(axes, names):
            values = [h[name] for h in self.history]
            ax.plot(steps, values, marker="o", markersize=3)
            ax.set_title(f"{name}: {values[-1]:.4g}")
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        weights = ", ".join(f"{n}={w:g}" for n, w in zip(TASKS, self.loss_weights))
        fig.suptitle(f"validation per task (loss_weights: {weights})")
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
        plt.close(fig)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["task_metrics_history"] = list(self.history)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.history = list(checkpoint.get("task_metrics_history", []))
