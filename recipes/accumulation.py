"""Recipe `accumulation`: gradient accumulation, and the learning rate scaled with the effective batch.

The seeds' memory-saving loop divides each batch's loss by ``accumulation_steps``, calls
``backward()`` every batch and steps every ``accumulation_steps`` batches, instead of summing k
batches' losses into one tensor and calling backward once. Both give the same gradient, but the
summed version keeps k graphs alive until its single backward, and the tempting middle ground
(``loss += ...; loss.backward()`` inside the loop) walks the first graph twice:

    RuntimeError: Trying to backward through the graph a second time, but the buffers have
    already been freed. Specify retain_graph=True when calling backward the first time.

The seed also warns that the learning rate "should be scaled up accordingly" (学习率也要适当放大)
without saying by how much. Here Lightning does the loop (``trainer.accumulate_grad_batches=k``
divides the loss by k, steps every k micro-batches and, under DDP, skips the all-reduce on the
micro-batches that do not step), and the LR is scaled by a stated rule from the effective batch
``data.batch_size × k × world_size`` against ``model.base_batch_size`` (`multiloss.lr_scaling`).
`tests/recipes/test_accumulation.py` proves k micro-batches of b == one batch of k·b == the seed's
hand-written loop, that the LR in the optimizer is the rule's, and where the equivalence breaks.

    python train.py recipe=accumulation
    python train.py --config-dir my_configs recipe=accumulation net=my_mlp data=npz data.path=F
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info
from torch.optim import Optimizer
from torchmetrics.classification import MulticlassAccuracy

from multiloss.batches import require_keys
from multiloss.components import build_module, build_optimizer_factory, objects_given, plain
from multiloss.config import ConfigError, require
from multiloss.lr_scaling import effective_batch_size, lr_factor
from multiloss.module import Recipe, call_component, describe_batch, describe_output


class Accumulation(Recipe):
    """Gradient accumulation: k micro-batches per step, LR scaled by the effective batch (linear/sqrt/none).

    Components:
        net (group ``net``, default ``mlp``: `multiloss.nets.MLP`, a digits classifier): any
            classifier, ``forward(x)`` -> logits ``(batch, classes, ...)`` for ``F.cross_entropy``.
        optimizer (group ``optimizer``, default ``sgd``): a ``_partial_`` optimizer config.
        data: batches with ``x`` and ``y`` (class indices); ``(x, y)`` tuples too. The data module
            must have ``batch_size`` (the LR rule needs it).

    Lightning's automatic optimization with ``trainer.accumulate_grad_batches = k``. The optimizer's
    configured LR (``model.optimizer.lr``) is the LR for ``base_batch_size`` examples per step; at
    fit start each param group's LR is multiplied by the ``lr_scaling`` rule's factor for the
    effective batch ``data.batch_size × k × world_size``: ``linear`` (B/B₀, Goyal et al. 2017, for
    SGD), ``sqrt`` (√(B/B₀), for Adam-type optimizers) or ``none``. The scaled LR sits in the
    optimizer, so LearningRateMonitor's ``lr-<Optimizer>`` column shows it; the rule's inputs are
    logged as ``scaling/*`` and written to ``lr_scaling.json`` in the run dir.
    Logs ``loss/total`` (cross-entropy) per micro-batch, ``val/loss/total`` and ``val/acc``.

    The shipped net has no dropout or BatchNorm by default: with either, k micro-batches of b stop
    being one batch of k·b (BatchNorm normalises each micro-batch by its own statistics, dropout
    draws other masks). Both stay available (``model.net.batch_norm``, ``model.net.dropout``).

    Raises:
        ConfigError: ``base_batch_size`` < 1; ``trainer.accumulate_grad_batches`` < 1 (at fit start,
            before the first step); at setup, a net whose output ``F.cross_entropy`` cannot compare
            with the data's ``y``.
    """

    def __init__(
        self,
        net: Any,
        optimizer: Any = None,
        lr_scaling: Literal["linear", "sqrt", "none"] = "linear",
        base_batch_size: int = 64,
        count_exact: bool = False,
        compile: bool = False,
    ) -> None:
        super().__init__(compile=compile)
        require(
            base_batch_size >= 1,
            "base_batch_size",
            base_batch_size,
            "an integer ≥ 1: the examples per optimizer step that model.optimizer.lr was tuned for",
        )
        net, optimizer = plain(net), plain(optimizer)
        self.save_hyperparameters(ignore=objects_given(net=net, optimizer=optimizer), logger=False)
        self.net = build_module(net, "net")
        self.optimizer_factory = build_optimizer_factory(optimizer, "optimizer")
        self.lr_scaling, self.base_batch_size = lr_scaling, base_batch_size
        self.count_exact = bool(count_exact)
        self.scaling: dict[str, float | int | str] = {}
        self.scaled_lrs: list[float] = []
        self.val_acc: MulticlassAccuracy | None = None  # made by the component check: the class count is the net's

    def check_components(self, batch: dict[str, Any]) -> None:
        require_keys(batch, ("x", "y"), "the net's input and the class of each example")
        net, given = self.component_name("net"), describe_batch(batch)
        logits = call_component("model.net", net, self.net, batch["x"], given=given)
        if not isinstance(logits, torch.Tensor):
            raise ConfigError(
                "model.net",
                net,
                "a classifier whose forward(x) returns one logits tensor",
                f"it returned {describe_output(logits)}",
            )
        call_component(
            "model.net", net, F.cross_entropy, logits, batch["y"], given=f"logits {describe_output(logits)}; {given}"
        )
        self.check_class_labels(logits.shape[1])
        if self.val_acc is None or self.val_acc.num_classes != logits.shape[1]:
            self.val_acc = MulticlassAccuracy(logits.shape[1], average="micro").to(logits.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def configure_optimizers(self) -> Optimizer:
        # Called once the trainer knows its world size and the datamodule its batch size, so the
        # effective batch is known exactly here, for one device or many.
        trainer = self.trainer
        batch_size = getattr(trainer.datamodule, "batch_size", None)
        if batch_size is None:
            raise ConfigError(
                "data",
                type(trainer.datamodule).__name__,
                "a data module with a `batch_size` attribute (the LR rule scales by data.batch_size × k × world size)",
                "no batch_size",
            )
        accumulate, world_size = trainer.accumulate_grad_batches, trainer.world_size
        # Lightning itself accepts 0 here and fails later on a modulo by zero.
        require(
            isinstance(accumulate, int) and accumulate >= 1,
            "trainer.accumulate_grad_batches",
            accumulate,
            "an integer ≥ 1 (micro-batches per optimizer step; 1 = no accumulation)",
        )
        effective = effective_batch_size(batch_size, accumulate, world_size)
        factor = lr_factor(effective, self.base_batch_size, self.lr_scaling)

        optimizer = super().configure_optimizers()
        base_lr = optimizer.param_groups[0]["lr"]
        # The LR goes into the param groups themselves (not a scaled loss or a scheduler), so the
        # optimizer, the checkpoint and LearningRateMonitor's `lr-<Optimizer>` column all hold the
        # rule's result. Every group keeps its own base LR, scaled by the same factor.
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * factor
        self.scaled_lrs = [group["lr"] for group in optimizer.param_groups]
        self.scaling = {
            "rule": self.lr_scaling,
            "base_lr": base_lr,
            "base_batch_size": self.base_batch_size,
            "batch_size": batch_size,
            "accumulate_grad_batches": accumulate,
            "world_size": world_size,
            "effective_batch_size": effective,
            "factor": factor,
            "lr": optimizer.param_groups[0]["lr"],
        }
        rank_zero_info(
            f"LR scaling ({self.lr_scaling}): effective batch {batch_size} × {accumulate} × {world_size} = "
            f"{effective} vs base {self.base_batch_size} -> lr {base_lr:g} × {factor:g} = {self.scaling['lr']:g}"
        )
        return optimizer

    def on_train_start(self) -> None:
        # A resumed run restores the optimizer's state, LRs included, after configure_optimizers:
        # put back the LRs for *this* run's effective batch (a resume on more ranks, or with
        # another k, scales again instead of keeping the old run's LR).
        for opt in self.trainer.optimizers:
            for group, lr in zip(opt.param_groups, self.scaled_lrs):
                group["lr"] = lr
        # Not `lr*` names: the contract's "column starting with lr" is the LR actually used.
        self.log_dict(
            {
                "scaling/factor": float(self.scaling["factor"]),
                "scaling/effective_batch_size": float(self.scaling["effective_batch_size"]),
                "scaling/base_lr": float(self.scaling["base_lr"]),
            },
            on_step=False,
            on_epoch=True,
            sync_dist=True,  # the same on every rank; keeps Lightning's DDP epoch-logging check quiet
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        batch = self.named_batch(batch)
        if self.count_exact:
            return self._count_exact_loss(batch, batch_idx)
        loss = F.cross_entropy(self(batch["x"]), batch["y"])
        self.log_losses({"total": loss}, batch_size=len(batch["y"]))
        # The micro-batch's mean loss; Lightning divides it by k before backward, so k micro-batches
        # of b sum to the gradient of the mean over k·b examples (the seeds' `loss / accumulation_steps`).
        return loss

    def _count_exact_loss(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        """The micro-batch's summed loss over the examples of its whole optimizer step (every rank's).

        Returned times k · world size, which Lightning's 1/k and DDP's mean over ranks take back
        out: the step's gradient is the mean over all its examples, each weighing the same, also
        when a micro-batch is short (an epoch's last) or the step has fewer than k of them.
        """
        summed = F.cross_entropy(self(batch["x"]), batch["y"], reduction="sum")
        self.log_losses({"total": summed.detach() / len(batch["y"])}, batch_size=len(batch["y"]))
        trainer = self.trainer
        return summed * (trainer.accumulate_grad_batches * trainer.world_size / self.examples_in_step(batch_idx))

    def examples_in_step(self, batch_idx: int) -> int:
        """How many examples, over every rank, the optimizer step that micro-batch ``batch_idx`` belongs to sees.

        From the loader's sampler (examples per rank: equal on every rank, DistributedSampler pads),
        its batch size and ``drop_last``, and the epoch's micro-batch count: all full but an epoch's
        last, and Lightning closes an epoch's last step with whatever micro-batches are left.
        """
        trainer = self.trainer
        loader = trainer.train_dataloader
        per_rank, size = len(loader.sampler), loader.batch_size
        require(
            isinstance(size, int),
            "count_exact",
            True,
            "a training loader with a batch_size and a sampler (not a batch_sampler), or count_exact=false",
        )
        in_epoch = per_rank // size if loader.drop_last else -(-per_rank // size)
        used = min(int(trainer.num_training_batches), in_epoch)
        k = trainer.accumulate_grad_batches
        first = (batch_idx // k) * k
        sizes = [
            size if i < in_epoch - 1 or loader.drop_last else per_rank - (in_epoch - 1) * size
            for i in range(first, min(first + k, used))
        ]
        return sum(sizes) * trainer.world_size

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        batch = self.named_batch(batch)
        logits = self(batch["x"])
        self.log_losses(
            {"total": F.cross_entropy(logits, batch["y"])}, prefix=f"{self.stage}/loss/", batch_size=len(batch["y"])
        )
        self.val_acc(logits, batch["y"])
        self.log(f"{self.stage}/acc", self.val_acc, on_epoch=True, prog_bar=True)

    def on_train_epoch_end(self) -> None:
        if self.trainer.is_global_zero and self.scaling:
            path = Path(self.trainer.default_root_dir) / "lr_scaling.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(self.scaling, indent=2) + "\n")
