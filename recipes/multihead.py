"""Recipe `multihead`: deep supervision — several classification heads on one network, one backward.

The seeds' first question: a loss made of several heads' losses, where does ``backward()`` go?
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
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from multiloss.balancers import Balancer, save_balancer_state
from multiloss.batches import require_keys
from multiloss.components import build_module, build_optimizer_factory, objects_given, plain
from multiloss.config import ConfigError, require
from multiloss.module import Recipe, call_component, describe_batch, describe_output


class MultiHead(Recipe):
    """Deep supervision: several classification heads of one network, Σ wᵢ·CE(headᵢ), one backward.

    Components:
        net (group ``net``, default ``deep_mlp``: `multiloss.nets.DeepSupervisionMLP` on digits):
            ``forward(x)`` returns a list or tuple of logits, one per head, deepest last; each is
            ``(batch, classes, ...)``, what ``F.cross_entropy(logits, y)`` takes.
        optimizer (group ``optimizer``, default ``adam``): a ``_partial_`` optimizer config.
        data: batches with ``x`` (the net's input) and ``y`` (class indices); ``(x, y)`` tuples too.

    Loss = Σ wᵢ·CE(headᵢ, y) with ``head_weights`` (one per head; null = equal), one backward
    (Lightning's automatic optimization, so accumulation, clipping, AMP and DDP work as usual). Logs
    ``loss/head{i}`` and ``loss/total`` per step, ``val/loss/head{i}`` and ``val/acc/head{i}`` per
    validation, and ``val/acc`` (the last head's).

    The shipped net has no dropout or BatchNorm by default, so a batch split over micro-batches or
    ranks gives the same gradient; both are options (``model.net.dropout``, ``model.net.batch_norm``).

    Raises:
        ConfigError: ``head_weights`` negative, infinite or all zero; at setup (before any step or
            write), ``head_weights`` not one per head, a net that does not return a sequence of logits
            tensors, or logits that ``F.cross_entropy`` cannot compare with the data's ``y``.
    """

    # What the recipe gives its balancer itself (the config sets neither).
    passed_to_components: ClassVar[dict[str, tuple[str, ...]]] = {"balancer": ("tasks", "base", "net")}

    def __init__(
        self,
        net: Any,
        optimizer: Any = None,
        head_weights: list[float] | None = None,
        balancer: Any = None,
        compile: bool = False,
    ) -> None:
        super().__init__(compile=compile)
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
            self.check_class_labels(logits.shape[1])
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

    def losses(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each head's cross-entropy and their weighted sum ``total`` (the one tensor we backward)."""
        per_head = {f"head{i}": F.cross_entropy(logits, batch["y"]) for i, logits in enumerate(self.net(batch["x"]))}
        weights = self.head_weights or [1.0] * len(per_head)
        total = sum(w * loss for w, loss in zip(weights, per_head.values()))
        return {**per_head, "total": total}

    def forward(self, x: torch.Tensor) -> Any:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        batch = self.named_batch(batch)
        if self.balancer is not None:
            return self._balanced_step(batch)
        losses = self.losses(batch)
        self.task_losses = {name: loss for name, loss in losses.items() if name != "total"}  # monitor=conflicts
        self.log_losses(losses, batch_size=len(batch["y"]))
        # Lightning calls backward on this once; autograd sums the heads' contributions in the trunk.
        return losses["total"]

    # --- a balancer other than `fixed` (multiloss.balancers) -------------------------------------

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
        # The net's device: at setup Lightning already reports the target device while weights are on CPU.
        # Built at setup, outside the model's instantiation: its errors name the full key.
        self.balancer = build_module(spec, "model.balancer", tasks=names, base=weights, net=self.net)
        self.balancer.to(next(self.net.parameters()).device)

    def _balanced_step(self, batch: dict[str, Any]) -> torch.Tensor:
        per_head = {f"head{i}": F.cross_entropy(out, batch["y"]) for i, out in enumerate(self.net(batch["x"]))}
        self.task_losses = per_head
        losses = torch.stack(list(per_head.values()))
        weights = self.balancer.weights(losses.detach())
        extra = self.balancer.extra(losses)
        total = (weights.to(losses.dtype) * losses).sum() + (0 if extra is None else extra)
        self.log_losses({**per_head, "total": total.detach()}, batch_size=len(batch["y"]))
        if self.balancer.adaptive:
            self.log_train_values(tuple(f"weight/{name}" for name in per_head), weights.detach())
        self._step_total = total
        return total

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        if self.balancer is None or not self.balancer.combines_gradients:
            super().backward(loss, *args, **kwargs)
            return
        # PCGrad & co. get each head's own loss, scaled as Lightning scaled the total (1/k, AMP).
        scale = torch.autograd.grad(loss, self._step_total, torch.ones_like(loss), retain_graph=True)[0]
        assert self.task_losses is not None
        self.balancer.backward([scale * h for h in self.task_losses.values()], list(self.net.parameters()))

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self.balancer is not None:
            self.balancer.start_epoch(self.current_epoch, self.mean_over_ranks)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.balancer is not None:
            checkpoint["multihead_heads"] = len(self.balancer.tasks)
            save_balancer_state(self.balancer, checkpoint, self.mean_over_ranks)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Before the weights load: a balancer with state must exist to receive it.
        if "multihead_heads" in checkpoint:
            self._build_balancer(int(checkpoint["multihead_heads"]))

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        batch = self.named_batch(batch)
        logits = self.net(batch["x"])
        losses = {f"head{i}": F.cross_entropy(out, batch["y"]) for i, out in enumerate(logits)}
        self.log_losses(losses, prefix=f"{self.stage}/loss/", batch_size=len(batch["y"]))
        for i, (out, acc) in enumerate(zip(logits, self.val_acc)):
            acc(out, batch["y"])
            self.log(f"{self.stage}/acc/head{i}", acc, on_epoch=True)
        self.log(f"{self.stage}/acc", self.val_acc[-1], on_epoch=True, prog_bar=True)
