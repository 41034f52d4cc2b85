"""Recipe `multihead`: deep supervision — several classification heads on one trunk, one backward.

The seeds' first question: a loss made of several heads' losses, where does ``backward()`` go?
Calling it once per head inside the loop raises

    RuntimeError: Trying to backward through the graph a second time ...

because the first call frees the trunk's saved tensors. ``retain_graph=True`` silences it at the
cost of keeping every graph alive until the last call. The right answer is the plain one: sum the
heads' losses and call backward once. The gradients are the same (autograd adds the heads'
contributions where they meet in the trunk; `tests/recipes/test_multihead.py` proves it against
both per-head alternatives) and the graph is walked once.

    python train.py recipe=multihead
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from multiloss.config import require
from multiloss.module import OptimizerFactory, RecipeModule
from multiloss.nets import dense_block


class MultiHead(RecipeModule):
    """Deep supervision on digits: auxiliary heads at several depths plus a final head, one summed backward.

    A trunk of ``depth`` dense blocks; after block i a linear head i (heads 0..depth-2 auxiliary,
    GoogLeNet style; head depth-1 the final classifier). Loss = Σ wᵢ·CE(headᵢ), one backward
    (Lightning's automatic optimization). Logs ``loss/head{i}`` and ``loss/total`` per step,
    ``val/loss/head{i}`` and ``val/acc/head{i}`` per epoch, and ``val/acc`` (final head).

    No dropout or BatchNorm by default, so a batch split over micro-batches or ranks gives the
    same gradient; both are options (``model.dropout``, ``model.batch_norm``).

    Raises:
        ConfigError: ``depth`` or ``width`` < 1; ``head_weights`` not one non-negative number per
            head, or all zero; ``dropout`` outside [0, 1).
    """

    def __init__(
        self,
        optimizer: OptimizerFactory,
        in_features: int = 64,
        num_classes: int = 10,
        width: int = 128,
        depth: int = 3,
        head_weights: list[float] | None = None,
        dropout: float = 0.0,
        batch_norm: bool = False,
    ) -> None:
        super().__init__(optimizer)
        require(depth >= 1, "depth", depth, "an integer ≥ 1 (the number of blocks, and of heads)")
        require(width >= 1, "width", width, "an integer ≥ 1")
        require(0 <= dropout < 1, "dropout", dropout, "a probability in [0, 1)")
        # A plain list, not Hydra's ListConfig: checkpoints must load with weights_only=True.
        head_weights = None if head_weights is None else [float(w) for w in head_weights]
        weights = [1.0] * depth if head_weights is None else head_weights
        require(
            len(weights) == depth,
            "head_weights",
            head_weights,
            f"one weight per head: {depth} numbers (model.depth={depth})",
            "wrong length",
        )
        require(
            all(w >= 0 for w in weights) and sum(weights) > 0,
            "head_weights",
            head_weights,
            "non-negative numbers, not all zero",
        )
        # The optimizer factory stays out: checkpoints then load with torch.load(weights_only=True).
        self.save_hyperparameters(ignore=["optimizer"], logger=False)
        self.head_weights = weights

        sizes = [in_features] + [width] * depth
        self.blocks = nn.ModuleList(dense_block(a, b, dropout, batch_norm) for a, b in itertools.pairwise(sizes))
        self.heads = nn.ModuleList(nn.Linear(width, num_classes) for _ in range(depth))
        self.val_acc = nn.ModuleList(MulticlassAccuracy(num_classes, average="micro") for _ in range(depth))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Logits of every head, shallowest first (the last entry is the final classifier)."""
        logits = []
        for block, head in zip(self.blocks, self.heads):
            x = block(x)
            logits.append(head(x))
        return logits

    def losses(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each head's cross-entropy and their weighted sum ``total`` (the one tensor we backward)."""
        per_head = {f"head{i}": F.cross_entropy(logits, batch["y"]) for i, logits in enumerate(self(batch["x"]))}
        total = sum(w * loss for w, loss in zip(self.head_weights, per_head.values()))
        return {**per_head, "total": total}

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        losses = self.losses(batch)
        self.log_losses(losses, batch_size=len(batch["y"]))
        # Lightning calls backward on this once; autograd sums the heads' contributions in the trunk.
        return losses["total"]

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        logits = self(batch["x"])
        losses = {f"head{i}": F.cross_entropy(out, batch["y"]) for i, out in enumerate(logits)}
        self.log_losses(losses, prefix="val/loss/", batch_size=len(batch["y"]))
        for i, (out, acc) in enumerate(zip(logits, self.val_acc)):
            acc(out, batch["y"])
            self.log(f"val/acc/head{i}", acc, on_epoch=True)
        self.log("val/acc", self.val_acc[-1], on_epoch=True, prog_bar=True)
