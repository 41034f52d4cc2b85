"""A recipe of one's own, written against `multiloss.base.module.Recipe` and named by ``model._target_`` from a
``--config-dir`` (examples/configs/recipe/double_backprop.yaml; docs/extending.md): nothing in multiloss is edited.

`DoubleBackprop` (Drucker & LeCun 1992): a classifier's cross-entropy plus λ times the squared norm of its input
gradient, E‖∇ₓ CE‖² — the step differentiates a gradient, so that gradient is taken with ``create_graph=True`` (without
it the penalty is a constant to autograd and the weights silently get no gradient from it: the seeds' pitfall).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from multiloss.base.module import Recipe
from multiloss.building.components import build_module, build_optimizer_factory, names_given_as_objects, to_plain
from multiloss.config import require
from multiloss.data.batches import require_keys


class DoubleBackprop(Recipe):
    """``net(x)`` → logits; each step backwards CE + ``weight``·E‖∇ₓ CEᵢ‖² (a mean over the examples, so the recipe's
    step options — accumulation, ranks, ``global_batch_size`` — weigh it as any mean loss)."""

    def __init__(self, net: Any, optimizer: Any = None, weight: float = 0.1, **step_options: Any) -> None:
        super().__init__(**step_options)  # the step options every recipe takes (model.accumulate_grad_batches, ...)
        require(isinstance(weight, int | float) and weight >= 0, "weight", weight, "a number ≥ 0")
        net, optimizer = to_plain(net), to_plain(optimizer)
        # Configs, not built objects, are the checkpoint's hyper-parameters: it loads with weights_only=True.
        self.save_hyperparameters(ignore=names_given_as_objects(net=net, optimizer=optimizer), logger=False)
        self.net = build_module(net, "net")
        self.optimizer_factory = build_optimizer_factory(optimizer, "optimizer")
        self.weight = weight

    def held_whole(self, trainer: Any) -> tuple[str, ...]:
        # The step differentiates the net twice (the input gradient, then the loss through it): under FSDP2 the net is
        # held whole for the step and its gradients handed to the shards at its end, as the GAN's penalty does.
        return ("net",)

    def not_compilable(self, name: str) -> str:
        return "the step differentiates its gradient, a double backward torch.compile does not support"

    def check_components(self, batch: dict[str, Any]) -> None:
        require_keys(batch, ("x", "y"), "the net's input and the class of each example")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def losses(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The cross-entropy, the penalty and their weighted sum, each a mean over the batch (graph on)."""
        x = batch["x"].detach().requires_grad_(True)
        per_example = F.cross_entropy(self(x), batch["y"], reduction="none")
        # ∇ₓ Σᵢ CEᵢ is each example's own gradient (no BatchNorm across the batch); create_graph keeps its graph.
        (gradient,) = torch.autograd.grad(per_example.sum(), x, create_graph=True)
        ce, penalty = per_example.mean(), gradient.flatten(1).square().sum(dim=1).mean()
        return {"ce": ce, "input_gradient": penalty, "total": ce + self.weight * penalty}

    def training_step(self, batch: Any, batch_idx: int) -> None:
        batch = self.prepare_batch(batch)
        # The block is the optimizer step: the backward (weighed in its step by its examples), clipping, the step,
        # zeroing, the schedule; under DDP only the micro-batch that steps all-reduces.
        with self.step_of(self.optimizers(), batch_idx) as step:
            losses = self.losses(batch)
            step.backward(losses["total"])
            self.log_losses(losses, batch_size=len(batch["y"]))

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        batch = self.prepare_batch(batch)
        with torch.enable_grad():  # the penalty differentiates even in validation
            losses = self.losses(batch)
        self.log_losses(losses, prefix=f"{self.eval_prefix}/loss/", batch_size=len(batch["y"]))
