"""Recipe `accumulation`: gradient accumulation, and the learning rate scaled with the effective batch.

The memory-saving loop divides each batch's loss by ``accumulation_steps``, calls ``backward()``
every batch and steps every ``accumulation_steps`` batches, instead of summing k batches' losses
into one tensor and calling backward once. Both give the same gradient, but the summed version keeps
k graphs alive until its single backward, and the tempting middle ground (``loss += ...;
loss.backward()`` inside the loop) walks the first graph twice:

    RuntimeError: Trying to backward through the graph a second time, but the buffers have
    already been freed. Specify retain_graph=True when calling backward the first time.

The usual advice that the learning rate "should be scaled up accordingly" does not say by how much.
Here the step is that loop (each micro-batch's loss divided by ``model.accumulate_grad_batches`` = k,
a step every k micro-batches, and under DDP no gradient all-reduce on the micro-batches that do not
step), and the LR is scaled by a stated rule from the effective batch ``data.batch_size × k ×
world_size`` against ``model.base_batch_size`` (`multiloss.base.lr_scaling`).
`tests/recipes/test_accumulation.py` proves k micro-batches of b == one batch of k·b == the
hand-written loop, that the LR in the optimizer is the rule's, and where the equivalence breaks.

    python train.py recipe=accumulation
    python train.py --config-dir my_configs recipe=accumulation net=my_mlp data=npz data.path=F
"""

from __future__ import annotations

from typing import Any, Literal

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info
from torchmetrics.classification import MulticlassAccuracy

from multiloss.base.lr_scaling import effective_batch_size, lr_factor
from multiloss.base.module import Recipe
from multiloss.base.window import count_exact_as_mean
from multiloss.building.checks import call_component, check_class_labels, describe_batch, describe_output
from multiloss.building.components import build_module, build_optimizer_factory, names_given_as_objects, to_plain
from multiloss.callbacks import JsonRecord
from multiloss.config import ConfigError, require
from multiloss.data.batches import require_keys


class Accumulation(Recipe):
    """Gradient accumulation: k micro-batches per step, LR scaled by the effective batch (linear/sqrt/none).

    Components:
        net (group ``net``, default ``mlp``: `multiloss.nets.MLP`, a digits classifier): any
            classifier, ``forward(x)`` -> logits ``(batch, classes, ...)`` for ``F.cross_entropy``.
        optimizer (group ``optimizer``, default ``sgd``): a ``_partial_`` optimizer config.
        data: batches with ``x`` and ``y`` (class indices); ``(x, y)`` tuples too. The data module
            must have ``batch_size`` (the LR rule needs it).

    The step (``training_step``, manual optimization): the micro-batch's cross-entropy, weighted in its
    step, one ``manual_backward``; on every k-th micro-batch (and an epoch's last, which may close a step
    of fewer than k micro-batches) clipping (``gradient_clip_val``), the optimizer step, zeroing and the
    ``scheduler``. Under DDP only the micro-batch that steps all-reduces its gradient. The weight
    (``accumulation_mean``, `multiloss.base.window`): ``examples`` (the default) multiplies the
    micro-batch's mean by its share of the step's examples on every rank, so a short step (an epoch's
    last) is the mean over its examples, each weighing as much as a full step's; ``micro_batches`` is
    the seed's loop, the mean divided by k (a short micro-batch's examples weigh more; a short last
    step of k′ < k micro-batches moves k′/k as far). On a full step the two are the same to the bit.

    The optimizer's configured LR (``model.optimizer.lr``) is the LR for ``base_batch_size`` examples
    per step; when the optimizer is built each param group's LR is multiplied by the ``lr_scaling``
    rule's factor for the effective batch ``data.batch_size × k × world_size``: ``linear`` (B/B₀, Goyal
    et al. 2017, for SGD), ``sqrt`` (√(B/B₀), for Adam-type optimizers) or ``none``; the ``scheduler``
    then starts from that rate (a warm-up warms up to it). The rate a step uses is always configured LR
    × rule × the schedule's factor (`multiloss.base.learning_rate`): a resume with another batch size, k or
    world size applies the rule for the new effective batch from the schedule's point, and says so.
    The scaled LR sits in the optimizer, so LearningRateMonitor's ``lr-<Optimizer>`` column shows it;
    the rule's inputs are logged as ``scaling/*`` and written to ``lr_scaling.json`` in the run dir.
    Logs ``loss/total`` (cross-entropy) per micro-batch, ``val/loss/total`` and ``val/acc``.

    The shipped net has no dropout or BatchNorm by default: with either, k micro-batches of b stop
    being one batch of k·b (BatchNorm normalises each micro-batch by its own statistics, dropout
    draws other masks). Both stay available (``model.net.batch_norm``, ``model.net.dropout``).

    Raises:
        ConfigError: ``base_batch_size`` < 1; the step options' checks (`multiloss.base.module.Recipe`);
            at setup, a net whose output ``F.cross_entropy`` cannot compare with the data's ``y``.
    """

    def __init__(
        self,
        net: Any,
        optimizer: Any = None,
        lr_scaling: Literal["linear", "sqrt", "none"] = "linear",
        base_batch_size: int = 64,
        count_exact: bool | None = None,  # earlier versions' key: model.accumulation_mean
        **step_options: Any,  # the options of every recipe's step (multiloss.base.module.Recipe)
    ) -> None:
        super().__init__(**step_options)
        self.accumulation_mean = count_exact_as_mean(count_exact, self.accumulation_mean)
        require(
            base_batch_size >= 1,
            "base_batch_size",
            base_batch_size,
            "an integer ≥ 1: the examples per optimizer step that model.optimizer.lr was tuned for",
        )
        net, optimizer = to_plain(net), to_plain(optimizer)
        self.save_hyperparameters(ignore=names_given_as_objects(net=net, optimizer=optimizer), logger=False)
        self.net = build_module(net, "net")
        self.optimizer_factory = build_optimizer_factory(optimizer, "optimizer")
        self.lr_scaling, self.base_batch_size = lr_scaling, base_batch_size
        self.scaling: dict[str, float | int | str] = {}
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
        check_class_labels(self.attached_datamodule, logits.shape[1])
        if self.val_acc is None or self.val_acc.num_classes != logits.shape[1]:
            self.val_acc = MulticlassAccuracy(logits.shape[1], average="micro").to(logits.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def lr_rule(self, optimizer: Any) -> tuple[float, dict[str, Any]]:
        # Called once the trainer knows its world size and the datamodule its batch size, so the
        # effective batch is known exactly here, for one device or many. The factor multiplies each
        # group's configured rate once, before the schedule takes it as its base (multiloss.base.learning_rate).
        trainer = self.trainer
        batch_size = getattr(trainer.datamodule, "batch_size", None)
        if batch_size is None:
            raise ConfigError(
                "data",
                type(trainer.datamodule).__name__,
                "a data module with a `batch_size` attribute (the LR rule scales by data.batch_size × k × world size)",
                "no batch_size",
            )
        accumulate, world_size = self.accumulate_grad_batches, trainer.world_size
        effective = effective_batch_size(batch_size, accumulate, world_size)
        factor = lr_factor(effective, self.base_batch_size, self.lr_scaling)
        base_lr = optimizer.param_groups[0]["lr"]
        self.scaling = {
            "rule": self.lr_scaling,
            "base_lr": base_lr,
            "base_batch_size": self.base_batch_size,
            "batch_size": batch_size,
            "accumulate_grad_batches": accumulate,
            "world_size": world_size,
            "effective_batch_size": effective,
            "factor": factor,
            "lr": base_lr * factor,
        }
        rank_zero_info(
            f"LR scaling ({self.lr_scaling}): effective batch {batch_size} × {accumulate} × {world_size} = "
            f"{effective} vs base {self.base_batch_size} -> lr {base_lr:g} × {factor:g} = {self.scaling['lr']:g}"
        )
        inputs = {"lr_scaling": self.lr_scaling, "effective_batch_size": effective}
        return factor, {**inputs, "base_batch_size": self.base_batch_size}

    def output_callbacks(self) -> list[L.Callback]:
        return [JsonRecord("lr_scaling.json", "scaling")]

    def on_train_start(self) -> None:
        # Not `lr*` names: the contract's "column starting with lr" is the LR actually used.
        self.log_dict(
            {
                "scaling/factor": float(self.scaling["factor"]),
                "scaling/effective_batch_size": float(self.scaling["effective_batch_size"]),
                "scaling/base_lr": float(self.scaling["base_lr"]),
            },
            on_step=False,
            on_epoch=True,
            # The same on every rank: nothing to reduce. rank_zero_only turns Lightning's reduction (a collective issued
            # by whichever rank reads the value first) into a no-op, and sync_dist its "use sync_dist" warning off;
            # every rank still logs it.
            sync_dist=True,
            rank_zero_only=True,
        )

    def training_step(self, batch: Any, batch_idx: int) -> None:
        batch = self.prepare_batch(batch)
        # The block steps on every k-th micro-batch (and an epoch's last): clipping, step, zeroing, schedule; under
        # DDP only that micro-batch's backward all-reduces. Its backward weighs the mean loss in the step (/ k on a full
        # one; by its examples' share on a short one, model.accumulation_mean=examples).
        with self.step_of(self.optimizers(), batch_idx) as step:
            logits = self(batch["x"])
            loss = F.cross_entropy(logits, batch["y"])
            step.backward(loss)
            self.log_losses({"total": loss}, batch_size=len(batch["y"]))

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        batch = self.prepare_batch(batch)
        logits = self(batch["x"])
        self.log_losses(
            {"total": F.cross_entropy(logits, batch["y"])},
            prefix=f"{self.eval_prefix}/loss/",
            batch_size=len(batch["y"]),
        )
        self.val_acc(logits, batch["y"])
        self.log(f"{self.eval_prefix}/acc", self.val_acc, on_epoch=True, prog_bar=True)
