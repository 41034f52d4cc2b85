"""`MultiTaskRecipe`: a recipe whose step weighs several task losses (multihead, weighted) — one balancer lifecycle.

The balancer (``model.balancer``, `multiloss.balancers`) is built once the recipe knows its tasks'
names and configured weights: `set_tasks`, called by the component check (multihead's tasks are the
net's heads, weighted's the config's) or by a checkpoint that names them (`TASKS_KEY`), before the
weights load. It sits first among the recipe's modules, so its parameters come first in the
optimizer. A step hands its task losses to `balance`, which runs the balancer protocol
(`multiloss.balancers.balance`), shows the losses to the callbacks that watch them (`TaskLossObserver`:
``monitor=conflicts``) and logs adaptive weights; the recipe then backwards `Balanced` its own way.
"""

from __future__ import annotations

from typing import Any, ClassVar

import lightning as L
import torch
from hydra.utils import get_object
from torch import nn

from multiloss.balancers import Balanced, Balancer, Fixed, balance, save_balancer_state
from multiloss.components import build_module, to_plain
from multiloss.config import require
from multiloss.module import Recipe
from multiloss.sharded_rule import apply_sharded_rule
from multiloss.task_gradients import select_parameters

TASKS_KEY = "multiloss_balanced_tasks"  # the task names a checkpoint's balancer was built for
_FIXED = "multiloss.balancers.Fixed"


class TaskLossObserver(L.Callback):
    """A callback shown each training step's task losses (graph on) right before the recipe's backward."""

    def observe_task_losses(
        self, trainer: L.Trainer, pl_module: MultiTaskRecipe, losses: dict[str, torch.Tensor]
    ) -> None:
        raise NotImplementedError


class MultiTaskRecipe(Recipe):
    """A recipe that weighs task losses with a balancer: its lifecycle, the step's protocol, the observers.

    Subclasses call `set_tasks` from their component check and give `configured_weights`.
    """

    passed_to_components: ClassVar[dict[str, tuple[str, ...]]] = {"balancer": ("tasks", "base", "net")}

    def __init__(self, balancer: Any = None, **step_options: Any) -> None:
        super().__init__(**step_options)
        self.balancer_spec = to_plain(balancer)
        self.register_module("balancer", None)  # its place, first among the modules: made by set_tasks
        self.balancer: Balancer | None
        self._observers: list[TaskLossObserver] | None = None

    def held_whole(self, trainer: L.Trainer) -> tuple[str, ...]:
        # Each task's gradient of the net (a gradient balancer of scope rank, the conflict monitor): one autograd.grad
        # a task on each rank's own batch. Scope global runs its rule on the shards instead (multiloss.sharded_rule).
        rank_rule = self._combines_gradients() and (self.balancer_spec or {}).get("scope", "rank") == "rank"
        observed = any(isinstance(c, TaskLossObserver) for c in trainer.callbacks)
        return ("net",) if rank_rule or observed else ()

    def check_sharding(self, trainer: L.Trainer) -> None:
        super().check_sharding(trainer)
        scope = (self.balancer_spec or {}).get("scope")
        require(
            not (self._combines_gradients() and scope == "global" and self.accumulate_grad_batches > 1),
            "model.balancer.scope",
            scope,
            f"rank with model.accumulate_grad_batches={self.accumulate_grad_batches} under sharded training, or "
            "model.accumulate_grad_batches=1",
            "the sharded rule reduce-scatters each task's gradient of a micro-batch that steps; micro-batches that "
            "do not step keep whole gradients",
        )
        if scope == "global" and self._combines_gradients():  # what the rule on the shards cannot compute
            check = getattr(get_object(self.balancer_spec["_target_"]), "check_sharded_rule", None)
            if check is not None:
                check(self.balancer_spec)

    def _combines_gradients(self) -> bool:
        target = (self.balancer_spec or {}).get("_target_")
        return target is not None and getattr(get_object(target), "combines_gradients", False)

    def configured_weights(self, names: list[str]) -> list[float]:
        """The configured weight of each task (``model.head_weights``, ``model.tasks.<name>.weight``)."""
        raise NotImplementedError

    @property
    def built_at_setup(self) -> tuple[str, ...]:
        return ("balancer.",) if self.balancer is None else ()

    @property
    def shared_parameters(self) -> list[nn.Parameter] | None:
        """The net's parameters a balancer's ``shared`` key names, as the net holds them now (sharded, or whole
        during a step under FSDP2), or None (found: those more than one task reaches)."""
        names = None if self.balancer is None else self.balancer.shared
        return None if names is None else select_parameters(self.net, names)

    def set_tasks(self, names: list[str], key: str = "model.balancer") -> None:
        """Build the balancer for the tasks ``names`` (once; ``fixed``, the default: the configured weights).

        ``key``: its config key in messages (``balancer`` from ``__init__``, which Hydra's instantiation names).
        """
        if self.balancer is not None:
            return
        weights, spec = self.configured_weights(names), self.balancer_spec
        if spec is None or spec.get("_target_") == _FIXED:
            balancer: Balancer = Fixed(names, weights)
        else:
            balancer = build_module(spec, key, tasks=names, base=weights, net=self.net)
        # The net's device: at setup Lightning already reports the target device while weights are on the CPU.
        weight = next(self.net.parameters(), None)
        self.balancer = balancer if weight is None else balancer.to(weight.device)

    def balance(self, losses: dict[str, torch.Tensor]) -> Balanced:
        """This step's ``losses`` weighed (`multiloss.balancers.balance`), shown to the observers, weights logged."""
        if self._observers is None:
            self._observers = [c for c in self.trainer.callbacks if isinstance(c, TaskLossObserver)]
        for observer in self._observers:
            observer.observe_task_losses(self.trainer, self, losses)
        balancer = self.balancer
        assert balancer is not None, "set_tasks runs in the component check, before the first step"
        shared = self.shared_parameters if balancer.combines_gradients else None
        if self._sharded and balancer.combines_gradients and "net" not in self._held:  # scope global under FSDP2
            balanced = balance(balancer, losses, [], self.current_epoch, self.mean_over_ranks, with_surrogate=False)
            apply_sharded_rule(
                self.net, balancer, list(losses.values()), self.manual_backward, self.sum_over_ranks, shared
            )
            balanced.backwarded = True
        else:
            # Only a surrogate needs them; read after the forward: under FSDP2 the net then holds its whole weights.
            params = list(self.net.parameters()) if balancer.combines_gradients else []
            balanced = balance(balancer, losses, params, self.current_epoch, self.mean_over_ranks, shared)
        if balancer.adaptive:
            self.log_train_values(tuple(f"weight/{name}" for name in losses), balanced.weights)
        return balanced

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.balancer is not None:
            checkpoint[TASKS_KEY] = list(self.balancer.tasks)
            save_balancer_state(self.balancer, checkpoint, self.mean_over_ranks)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Before the weights load: a balancer with state must exist to receive them.
        names = checkpoint.get(TASKS_KEY) or self._tasks_before_issue_26(checkpoint)
        if names:
            self.set_tasks(list(names))

    def _tasks_before_issue_26(self, checkpoint: dict[str, Any]) -> list[str]:
        """A checkpoint written before one lifecycle served both recipes: multihead named its head count (and
        registered its balancer after the net: the optimizer's state is put in today's parameter order)."""
        if "multihead_heads" not in checkpoint:
            return []
        names = [f"head{i}" for i in range(int(checkpoint["multihead_heads"]))]
        self.set_tasks(names)
        moved = len(list(self.balancer.parameters())) if self.balancer is not None else 0
        for state in checkpoint.get("optimizer_states", []) if moved else []:
            (group,) = state["param_groups"]  # the recipe's one optimizer, one group
            total = len(group["params"])
            # Index i of the old order (net, then balancer) is i + moved in today's (balancer, then net).
            state["state"] = {(i + moved) % total: v for i, v in state["state"].items()}
        return names
