"""Recipe `multihead`: deep supervision — several classification heads on one network, one backward.

The first question a loss made of several heads' losses raises is where ``backward()`` goes.
Calling it once per head inside the loop raises

    RuntimeError: Trying to backward through the graph a second time ...

because the first call frees the trunk's saved tensors. ``retain_graph=True`` silences it at the
cost of keeping every graph alive until the last call. The right answer is the plain one: sum the
heads' losses and call backward once. The gradients are the same (autograd adds the heads'
contributions where they meet in the trunk; `tests/recipes/test_multihead.py` proves it against
both per-head alternatives with `multiloss.testing`) and the graph is walked once.

    python train.py recipe=multihead
    python train.py --config-dir my_configs recipe=multihead net=my_cnn
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from multiloss.building.checks import call_component, check_class_labels, describe_batch, describe_output
from multiloss.building.components import build_module, build_optimizer_factory, names_given_as_objects, to_plain
from multiloss.config import ConfigError, require
from multiloss.data.batches import require_keys
from multiloss.multitask.recipe import MultiTaskRecipe, mean_losses


class MultiHead(MultiTaskRecipe):
    """Deep supervision: several classification heads of one network, Σ wᵢ·CE(headᵢ), one backward.

    Components:
        net (group ``net``, default ``deep_mlp``: `multiloss.nets.DeepSupervisionMLP` on digits):
            ``forward(x)`` returns a list or tuple of logits, one per head, deepest last; each is
            ``(batch, classes, ...)``, what ``F.cross_entropy(logits, y)`` takes.
        optimizer (group ``optimizer``, default ``adam``): a ``_partial_`` optimizer config.
        balancer (group ``balancer``, default ``fixed``): how the heads' losses are weighed (the heads
            are the tasks); see `multiloss.balancers`.
        data: batches with ``x`` (the net's input) and ``y`` (class indices); ``(x, y)`` tuples too.

    The step (``training_step``, manual optimization): the heads' cross-entropies, their sum
    Σ wᵢ·CE(headᵢ, y) with ``head_weights`` (one per head; null = equal) or the balancer's weights —
    or, for a balancer that combines the heads' gradients itself (PCGrad & co.), its surrogate loss —
    one ``manual_backward`` of it divided by ``accumulate_grad_batches``, and on every k-th micro-batch
    (and an epoch's last) clipping (``gradient_clip_val``), the optimizer step, zeroing and the
    ``scheduler``. Under DDP the micro-batches that do not step skip the gradient all-reduce. Logs
    ``loss/head{i}`` and ``loss/total`` per step, ``val/loss/head{i}``, ``val/loss/total`` (the
    configured weighted sum) and ``val/acc/head{i}`` per validation, and ``val/acc`` (the last head's).

    The shipped net has no dropout or BatchNorm by default, so a batch split over micro-batches or
    ranks gives the same gradient; both are options (``model.net.dropout``, ``model.net.batch_norm``).

    Raises:
        ConfigError: ``head_weights`` negative, infinite or all zero; ``accumulate_grad_batches`` < 1;
            ``gradient_clip_val`` ≤ 0; ``trainer.accumulate_grad_batches`` ≠ 1 or
            ``trainer.gradient_clip_val`` set (use the model keys); at setup (before any step or write),
            ``head_weights`` not one per head, a net that does not return a sequence of logits tensors,
            or logits that ``F.cross_entropy`` cannot compare with the data's ``y``.
    """

    def __init__(
        self,
        net: Any,
        optimizer: Any = None,
        head_weights: list[float] | None = None,
        balancer: Any = None,
        **step_options: Any,  # the options of every recipe's step (multiloss.base.module.Recipe)
    ) -> None:
        super().__init__(balancer=balancer, **step_options)
        net, optimizer, balancer = to_plain(net), to_plain(optimizer), to_plain(balancer)
        # A plain list of floats, not Hydra's ListConfig: checkpoints must load with weights_only=True.
        head_weights = None if head_weights is None else [float(w) for w in head_weights]
        require(
            head_weights is None or (all(0 <= w < math.inf for w in head_weights) and sum(head_weights) > 0),
            "head_weights",
            head_weights,
            "null (equal weights) or non-negative finite numbers, one per head, not all zero",
        )
        self.save_hyperparameters(
            ignore=names_given_as_objects(net=net, optimizer=optimizer, balancer=balancer), logger=False
        )
        # The balancer needs the number of heads, which only the component check (or a checkpoint)
        # knows: built there (`multiloss.multitask.recipe.MultiTaskRecipe.set_tasks`).
        self.net = build_module(net, "net")
        self.optimizer_factory = build_optimizer_factory(optimizer, "optimizer")
        self.head_weights = head_weights
        # One accuracy per head, made when the component check has seen how many heads and classes.
        self.val_acc = nn.ModuleList()

    def check_components(self, batch: dict[str, Any]) -> None:
        require_keys(batch, ("x", "y"), "the net's input and the class of each example")
        net = self.component_name("net")
        given = describe_batch(batch)
        outputs = call_component("model.net", net, self.net, batch["x"], given=given)
        if not (isinstance(outputs, list | tuple) and outputs and all(isinstance(o, torch.Tensor) for o in outputs)):
            raise ConfigError(
                "model.net",
                net,
                "a network whose forward(x) returns a list or tuple of logits tensors, one per head, deepest last",
                f"it returned {describe_output(outputs)}",
            )
        for i, logits in enumerate(outputs):
            call_component(
                "model.net",
                net,
                F.cross_entropy,
                logits,
                batch["y"],
                given=f"head {i}: {describe_output(logits)}; {given}",
            )
        for logits in outputs:
            check_class_labels(self.attached_datamodule, logits.shape[1])
        n = len(outputs)
        require(
            self.head_weights is None or len(self.head_weights) == n,
            "model.head_weights",
            self.head_weights,
            f"one weight per head: {n} numbers (model.net has {n} heads), or null for equal weights",
            "wrong length",
        )
        self.set_tasks([f"head{i}" for i in range(n)])
        if len(self.val_acc) != n:
            classes = [logits.shape[1] for logits in outputs]
            self.val_acc = nn.ModuleList(MulticlassAccuracy(c, average="micro") for c in classes).to(outputs[0].device)

    def head_losses(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each head's cross-entropy, ``head0`` (shallowest) to the deepest."""
        return {f"head{i}": F.cross_entropy(logits, batch["y"]) for i, logits in enumerate(self.net(batch["x"]))}

    def forward(self, x: torch.Tensor) -> Any:
        return self.net(x)

    def configured_weights(self, names: list[str]) -> list[float]:
        return self.head_weights or [1.0] * len(names)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        batch = self.prepare_batch(batch)
        # The block steps on every k-th micro-batch (and an epoch's last): clipping, step, zeroing, schedule.
        with self.step_of(self.optimizers(), batch_idx) as step:
            draws = self.draws(batch, self.head_losses)  # SDMGrad, MoDo: 3 parts of the batch
            balanced = self.balance(draws)  # Σ wᵢ·CE(headᵢ): head_weights, or the balancer's weights
            per_head = mean_losses(draws)
            # One backward of the sum, loss / k: autograd adds the heads' contributions where they meet in the trunk.
            # (PCGrad & co.: a scalar whose gradient is their combination of the heads' gradients.)
            balanced.backward(step, as_sum=True)
            self.log_losses({**per_head, "total": balanced.total.detach()}, batch_size=len(batch["y"]))
        self.after_step(step, lambda: self.head_losses(batch))  # FAMO: the same batch's losses after the step

    # --- validation ---------------------------------------------------------------------------------------

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        batch = self.prepare_batch(batch)
        logits = self.net(batch["x"])
        losses = {f"head{i}": F.cross_entropy(out, batch["y"]) for i, out in enumerate(logits)}
        weights = self.head_weights or [1.0] * len(losses)
        total = sum(w * loss for w, loss in zip(weights, losses.values()))
        self.log_losses({**losses, "total": total}, prefix=f"{self.eval_prefix}/loss/", batch_size=len(batch["y"]))
        for i, (out, acc) in enumerate(zip(logits, self.val_acc)):
            acc(out, batch["y"])
            self.log(f"{self.eval_prefix}/acc/head{i}", acc, on_epoch=True)
        self.log(f"{self.eval_prefix}/acc", self.val_acc[-1], on_epoch=True, prog_bar=True)
