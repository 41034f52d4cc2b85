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
from multiloss.building.components import to_plain
from multiloss.callbacks.conflicts import TaskLossObserver
from multiloss.config import ConfigError, require
from multiloss.saving.saved_state import OLD_HEAD_COUNT_KEY, TASKS_KEY, is_sharded_checkpoint


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

    def setup(self, stage: str) -> None:
        super().setup(stage)
        if stage == "fit":
            self._check_draws(self.trainer)

    def _check_draws(self, trainer: L.Trainer) -> None:
        """A balancer that splits each batch into draws (SDMGrad, MoDo) needs a batch of at least that many examples,
        and no smaller last batch: refused here, before any step or write."""
        from hydra.utils import get_class

        target = self.balancer_spec.get("_target_") if isinstance(self.balancer_spec, dict) else None
        cls = (
            type(self.balancer) if self.balancer is not None else get_class(target) if isinstance(target, str) else None
        )
        parts = cls.batches_per_step if isinstance(cls, type) and issubclass(cls, Balancer) else 1
        data = getattr(trainer, "datamodule", None)
        size, drop_last = getattr(data, "batch_size", None), getattr(data, "drop_last", True)
        if parts > 1 and isinstance(size, int):
            require(
                size >= parts,
                "data.batch_size",
                size,
                f"{parts} or more: model.balancer splits each batch into {parts} draws",
            )
            train_set = getattr(data, "train_set", None)
            if not drop_last and train_set is not None:
                last = len(train_set) // max(trainer.world_size, 1) % size
                require(
                    last == 0 or last >= parts,
                    "data.drop_last",
                    drop_last,
                    f"true: an epoch's last batch holds {last} example(s) on each rank, fewer than the {parts} draws "
                    "model.balancer splits each batch into",
                )

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

    def draws(
        self, batch: dict[str, torch.Tensor], losses_of: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
    ) -> dict[str, torch.Tensor] | list[dict[str, torch.Tensor]]:
        """The task losses ``losses_of`` gives for ``batch``; for a balancer that sees several independent draws a
        step (SDMGrad, MoDo: ``batches_per_step`` 3, LibMTL's three batches), the batch split into that many equal
        parts along its first dimension, each part's losses (a mean over its own examples)."""
        parts = self.balancer.batches_per_step
        if parts == 1:
            return losses_of(batch)
        size = len(next(iter(batch.values())))
        if size < parts:
            raise ConfigError(
                "data.batch_size",
                size,
                f"at least {parts} examples a batch (model.balancer draws {parts} parts of each), and "
                "data.drop_last=true where an epoch's last batch is smaller",
            )
        split = {key: torch.tensor_split(value, parts) for key, value in batch.items()}
        return [losses_of({key: chunks[i] for key, chunks in split.items()}) for i in range(parts)]

    def balance(self, losses: dict[str, torch.Tensor] | list[dict[str, torch.Tensor]]) -> Balanced:
        """This step's ``losses`` (a list: one per draw) shown to the observers (their mean), weighed
        (`multiloss.balancers.balance`), weights logged."""
        if self._observers is None:
            self._observers = [c for c in self.trainer.callbacks if isinstance(c, TaskLossObserver)]
        for observer in self._observers:
            observer.observe_task_losses(self.trainer, self, mean_losses(losses))
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
            self.log_train_values(tuple(f"weight/{name}" for name in mean_losses(losses)), balanced.weights)
        return balanced

    def after_step(self, step: Any, recompute: Callable[[], dict[str, torch.Tensor]]) -> None:
        """After ``step``'s block: a balancer that learns from the losses after the step (FAMO) gets them, recomputed
        on the same batch by ``recompute`` without a graph (one more forward, on the steps only)."""
        if step.stepping and self.balancer is not None and self.balancer.after_step_update:
            with torch.no_grad():
                self.balancer.after_step(torch.stack(list(recompute().values())))

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
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
        super().on_load_checkpoint(checkpoint)
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


def mean_losses(losses: dict[str, torch.Tensor] | list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The task losses of a step, or the mean over its draws (`MultiTaskRecipe.draws`) of each task's."""
    if isinstance(losses, dict):
        return losses
    return {name: torch.stack([draw[name] for draw in losses]).mean() for name in losses[0]}
