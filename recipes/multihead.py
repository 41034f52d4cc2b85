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
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from multiloss.balancers import Balancer, save_balancer_state
from multiloss.batches import require_keys
from multiloss.component_check import call_component, check_class_labels, describe_batch, describe_output
from multiloss.components import build_module, build_optimizer_factory, objects_given, plain
from multiloss.config import ConfigError, require
from multiloss.module import Recipe


class MultiHead(Recipe):
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

    # What the recipe gives its balancer itself (the config sets neither).
    passed_to_components: ClassVar[dict[str, tuple[str, ...]]] = {"balancer": ("tasks", "base", "net")}

    def __init__(
        self,
        net: Any,
        optimizer: Any = None,
        head_weights: list[float] | None = None,
        balancer: Any = None,
        accumulate_grad_batches: int = 1,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: Literal["norm", "value"] = "norm",
        scheduler: Any = None,
        compile: bool = False,
    ) -> None:
        super().__init__(accumulate_grad_batches, gradient_clip_val, gradient_clip_algorithm, scheduler, compile)
        net, optimizer, balancer = plain(net), plain(optimizer), plain(balancer)
        # A plain list of floats, not Hydra's ListConfig: checkpoints must load with weights_only=True.
        head_weights = None if head_weights is None else [float(w) for w in head_weights]
        require(
            head_weights is None or (all(0 <= w < math.inf for w in head_weights) and sum(head_weights) > 0),
            "head_weights",
            head_weights,
            "null (equal weights) or non-negative finite numbers, one per head, not all zero",
        )
        self.save_hyperparameters(ignore=objects_given(net=net, optimizer=optimizer, balancer=balancer), logger=False)
        # The balancer needs the number of heads, which only the component check (or a checkpoint)
        # knows: built there (`_build_balancer`); None until then, and always None for `fixed`.
        self.balancer_spec = balancer
        self.balancer: Balancer | None = None
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
            check_class_labels(self.trainer.datamodule if self._trainer is not None else None, logits.shape[1])
        n = len(outputs)
        require(
            self.head_weights is None or len(self.head_weights) == n,
            "model.head_weights",
            self.head_weights,
            f"one weight per head: {n} numbers (model.net has {n} heads), or null for equal weights",
            "wrong length",
        )
        self._build_balancer(n)
        if len(self.val_acc) != n:
            classes = [logits.shape[1] for logits in outputs]
            self.val_acc = nn.ModuleList(MulticlassAccuracy(c, average="micro") for c in classes).to(outputs[0].device)

    def head_losses(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each head's cross-entropy, ``head0`` (shallowest) to the deepest."""
        return {f"head{i}": F.cross_entropy(logits, batch["y"]) for i, logits in enumerate(self.net(batch["x"]))}

    def forward(self, x: torch.Tensor) -> Any:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        batch, opt, k = self.named_batch(batch), self.optimizers(), self.accumulate_grad_batches
        stepping = self.steps_on(batch_idx)  # every accumulate_grad_batches-th micro-batch, and an epoch's last
        with self.gradient_sync(stepping):  # DDP all-reduces only the backward of a micro-batch that steps
            per_head = self.head_losses(batch)
            self.task_losses = per_head  # monitor=conflicts reads them at the backward
            total, loss = self.weighted_sum(per_head)
            # One backward: autograd sums the heads' contributions where they meet in the trunk.
            self.manual_backward(loss if k == 1 else loss / k)
        self.task_losses = None
        self.log_losses({**per_head, "total": total}, batch_size=len(batch["y"]))
        if stepping:
            self.clip_gradients(opt)
            opt.step()
            opt.zero_grad(set_to_none=True)
        self.step_lr_schedule(opt, stepping)

    # --- the heads' weights: head_weights, or a balancer other than `fixed` (multiloss.balancers) ----

    def weighted_sum(self, per_head: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's total (logged) and the loss its backward takes: the same, but for a gradient balancer."""
        if self.balancer is None:
            if self.head_weights is None:  # equal weights: the plain sum
                total = sum(per_head.values())
            else:
                total = sum(w * loss for w, loss in zip(self.head_weights, per_head.values()))
            return total, total
        self.balancer.start_epoch(self.current_epoch, self.mean_over_ranks)
        losses = torch.stack(list(per_head.values()))
        weights = self.balancer.weights(losses.detach())
        extra = self.balancer.extra(losses)
        total = (weights.to(losses.dtype) * losses).sum() + (0 if extra is None else extra)
        if self.balancer.adaptive:
            self.log_train_values(tuple(f"weight/{name}" for name in per_head), weights)
        if self.balancer.combines_gradients:  # PCGrad & co.: a scalar whose gradient is their combination
            return total, self.balancer.surrogate(list(per_head.values()), list(self.net.parameters()))
        return total, total

    @property
    def shared_parameters(self) -> list[nn.Parameter] | None:
        return None if self.balancer is None else self.balancer.shared_parameters

    @property
    def built_at_setup(self) -> tuple[str, ...]:
        """State-dict prefixes this module makes only at setup: a checkpoint may hold them before."""
        return ("balancer.",) if self.balancer is None and self.balancer_spec is not None else ()

    def _build_balancer(self, n_heads: int) -> None:
        spec = self.balancer_spec
        if spec is None or self.balancer is not None or spec.get("_target_") == "multiloss.balancers.Fixed":
            return  # fixed: the recipe's own weighted sum, exactly as without balancers
        names = [f"head{i}" for i in range(n_heads)]
        weights = self.head_weights or [1.0] * n_heads
        # Built at setup, outside the model's instantiation: its errors name the full key.
        self.balancer = build_module(spec, "model.balancer", tasks=names, base=weights, net=self.net)
        # The net's device: at setup Lightning already reports the target device while weights are on CPU.
        self.balancer.to(next(self.net.parameters()).device)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.balancer is not None:
            checkpoint["multihead_heads"] = len(self.balancer.tasks)
            save_balancer_state(self.balancer, checkpoint, self.mean_over_ranks)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Before the weights load: a balancer with state must exist to receive it.
        if "multihead_heads" in checkpoint:
            self._build_balancer(int(checkpoint["multihead_heads"]))

    # --- validation ---------------------------------------------------------------------------------------

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        batch = self.named_batch(batch)
        logits = self.net(batch["x"])
        losses = {f"head{i}": F.cross_entropy(out, batch["y"]) for i, out in enumerate(logits)}
        weights = self.head_weights or [1.0] * len(losses)
        total = sum(w * loss for w, loss in zip(weights, losses.values()))
        self.log_losses({**losses, "total": total}, prefix=f"{self.stage}/loss/", batch_size=len(batch["y"]))
        for i, (out, acc) in enumerate(zip(logits, self.val_acc)):
            acc(out, batch["y"])
            self.log(f"{self.stage}/acc/head{i}", acc, on_epoch=True)
        self.log(f"{self.stage}/acc", self.val_acc[-1], on_epoch=True, prog_bar=True)
