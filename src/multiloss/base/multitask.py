"""`MultiTaskRecipe`: a recipe whose step weighs several task losses (multihead, weighted) — one balancer lifecycle.

The balancer (``model.balancer``, `multiloss.balancers`) is built once the recipe knows its tasks'
names and configured weights (`set_tasks`: by the component check, or by a checkpoint that names
them, `multiloss.saving.saved_state.TASKS_KEY`, before the weights load). It sits first among the recipe's
modules, so its parameters come first in the optimizer. A step hands its task losses to `balance`,
which shows them to the callbacks that watch them (`TaskLossObserver`: ``monitor=conflicts``), runs
the balancer protocol (`multiloss.balancers.balance`) and logs adaptive weights; the recipe then
backwards the result with ``balanced.backward(step)``, whatever the balancer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import lightning as L
import torch
from torch import nn

from multiloss.balancers import Balanced, Balancer, balance
from multiloss.balancers.build import build_balancer, check_sharded_balancer, rule_on_each_rank
from multiloss.balancers.protocol import save_balancer_state, shared_parameters
from multiloss.balancers.resume_check import check_saved_balancer
from multiloss.base.module import Recipe
from multiloss.components import to_plain
from multiloss.saving.saved_state import OLD_HEAD_COUNT_KEY, TASKS_KEY, is_sharded_checkpoint


class TaskLossObserver(L.Callback):
    """A callback shown each training step's task losses (graph on) right before the recipe's backward."""

    def observe_task_losses(
        self, trainer: L.Trainer, pl_module: MultiTaskRecipe, losses: dict[str, torch.Tensor]
    ) -> None:
        raise NotImplementedError


class MultiTaskRecipe(Recipe):
    """A recipe that weighs task losses with a balancer: its lifecycle, the step's protocol, the observers.

    Subclasses call `set_tasks` from their component check (or ``__init__``) and give `configured_weights`.
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
        # a task on each rank's own batch. Scope global runs its rule on the shards instead.
        observed = any(isinstance(c, TaskLossObserver) for c in trainer.callbacks)
        return ("net",) if rule_on_each_rank(self.balancer_spec) or observed else ()

    def check_sharding(self, trainer: L.Trainer) -> None:
        super().check_sharding(trainer)
        check_sharded_balancer(self.balancer_spec, self.accumulate_grad_batches)

    def configured_weights(self, names: list[str]) -> list[float]:
        """The configured weight of each task (``model.head_weights``, ``model.tasks.<name>.weight``)."""
        raise NotImplementedError

    @property
    def built_at_setup(self) -> tuple[str, ...]:
        return ("balancer.",) if self.balancer is None else ()

    @property
    def shared_parameters(self) -> list[nn.Parameter] | None:
        """The net's parameters the balancer's ``shared`` key names, or None (`multiloss.balancers.protocol`)."""
        return None if self.balancer is None else shared_parameters(self.balancer, self.net)

    def set_tasks(self, names: list[str], key: str = "model.balancer") -> None:
        """Build the balancer for the tasks ``names``, once (`multiloss.balancers.build.build_balancer`).

        ``key``: its config key in messages (``balancer`` from ``__init__``, which Hydra's instantiation names).
        """
        if self.balancer is None:
            self.balancer = build_balancer(self.balancer_spec, names, self.configured_weights(names), self.net, key)

    def balance(self, losses: dict[str, torch.Tensor]) -> Balanced:
        """This step's ``losses`` shown to the observers, weighed (`multiloss.balancers.balance`), weights logged."""
        if self._observers is None:
            self._observers = [c for c in self.trainer.callbacks if isinstance(c, TaskLossObserver)]
        for observer in self._observers:
            observer.observe_task_losses(self.trainer, self, losses)
        balancer = self.balancer
        assert balancer is not None, "set_tasks runs in the component check, before the first step"
        balanced = balance(
            balancer,
            losses,
            self.net,
            self.parallelism,
            self.current_epoch,
            self.mean_over_ranks,
            self.sum_over_ranks,
            self.manual_backward,
        )
        if balancer.adaptive:
            self.log_train_values(tuple(f"weight/{name}" for name in losses), balanced.weights)
        return balanced

    def after_step(self, step: Any, recompute: Callable[[], dict[str, torch.Tensor]]) -> None:
        """After ``step``'s block: a balancer that learns from the losses after the step (FAMO) gets them, recomputed
        on the same batch by ``recompute`` without a graph (one more forward, on the steps only)."""
        if step.stepping and self.balancer is not None and self.balancer.after_step_update:
            with torch.no_grad():
                self.balancer.after_step(torch.stack(list(recompute().values())))

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.balancer is not None:
            checkpoint[TASKS_KEY] = list(self.balancer.tasks)
            save_balancer_state(self.balancer, checkpoint, self.mean_over_ranks)

    def check_checkpoint(self, checkpoint: dict[str, Any], path: str) -> None:
        """The checkpoint's balancer state loads into the balancer this run builds for its tasks (a throwaway one:
        the run's own is built as the weights load)."""
        super().check_checkpoint(checkpoint, path)
        names = saved_task_names(checkpoint)
        if not names:
            return
        probe = build_balancer(self.balancer_spec, names, self.configured_weights(names), self.net, "model.balancer")
        try:
            check_saved_balancer(checkpoint, probe, self.balancer_spec, path, sharded=is_sharded_checkpoint(path))
        finally:
            probe.release()  # its hooks off the net: the run builds its own balancer

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Before the weights load: a balancer with state must exist to receive them.
        names = checkpoint.get(TASKS_KEY) or self._tasks_of_a_head_count(checkpoint)
        if names:
            self.set_tasks(list(names))

    def _tasks_of_a_head_count(self, checkpoint: dict[str, Any]) -> list[str]:
        """A checkpoint that names multihead's head count instead of its tasks (written before one lifecycle served
        both recipes), whose balancer was registered after the net: its optimizer state put in today's order."""
        if OLD_HEAD_COUNT_KEY not in checkpoint:
            return []
        names = saved_task_names(checkpoint)
        self.set_tasks(names)
        moved = len(list(self.balancer.parameters())) if self.balancer is not None else 0
        for state in checkpoint.get("optimizer_states", []) if moved else []:
            (group,) = state["param_groups"]  # the recipe's one optimizer, one group
            total = len(group["params"])
            # Index i of the old order (net, then balancer) is i + moved in today's (balancer, then net).
            state["state"] = {(i + moved) % total: v for i, v in state["state"].items()}
        return names


def saved_task_names(checkpoint: dict[str, Any]) -> list[str]:
    """The tasks a checkpoint's balancer was built for: named, or (older multihead checkpoints) ``head0`` … by count."""
    if names := checkpoint.get(TASKS_KEY):
        return list(names)
    return [f"head{i}" for i in range(int(checkpoint.get(OLD_HEAD_COUNT_KEY, 0)))]
