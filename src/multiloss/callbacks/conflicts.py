"""``monitor=conflicts``: how much the tasks' gradients disagree on the shared layers, as training goes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn

from multiloss import lightning_internals as internals
from multiloss.balancers.task_gradients import pairwise_cosines, task_gradients
from multiloss.callbacks.lean import LeanCallback
from multiloss.callbacks.plots import curves_figure, logged_curves


class TaskLossObserver(L.Callback):
    """A callback shown each training step's task losses (graph on) right before the recipe's backward."""

    def observe_task_losses(
        self, trainer: L.Trainer, pl_module: L.LightningModule, losses: dict[str, torch.Tensor]
    ) -> None:
        raise NotImplementedError


class ConflictMonitor(TaskLossObserver, LeanCallback):
    """On the steps that write a log row, the cosine between each pair of tasks' gradients on the shared parameters.

    Logs ``conflict/cos/<a>-<b>`` and ``conflict/negative/<a>-<b>`` (the share of monitored steps so
    far whose cosine was negative: the tasks pulled the shared layers apart), and plots the cosines
    over the steps to ``<dirpath>/<filename>`` when training ends. Works for a recipe that hands its
    step's task losses to its observers (`multiloss.multitask.recipe.MultiTaskRecipe`: multihead, weighted),
    whatever its balancer. Cost: one
    extra backward per task, on monitored steps only (every ``trainer.log_every_n_steps``); the
    gradients are computed apart from training's, which they do not change. Shared parameters: those
    that more than one task's loss reaches, or those a balancer's ``shared`` key names. Rank zero's
    own batch under DDP.
    """

    def __init__(self, dirpath: str, filename: str = "conflicts.png") -> None:
        self.path = Path(dirpath) / filename
        self.monitored = 0
        self.negative: dict[str, torch.Tensor] = {}

    def observe_task_losses(
        self, trainer: L.Trainer, pl_module: L.LightningModule, losses: dict[str, torch.Tensor]
    ) -> None:
        if len(losses) < 2 or not internals.writes_log_row(trainer):
            return
        if not trainer.is_global_zero:
            return
        params = [p for name, p in pl_module.named_parameters() if not name.startswith("balancer.")]
        # The layers a gradient-level balancer was told are shared (its `shared` key), else the found ones.
        shared = pl_module.shared_parameters
        grads = task_gradients(list(losses.values()), params, shared)
        if not grads.shared:
            return
        cos = pairwise_cosines(grads.vectors.float())
        names, values = [], []
        self.monitored += 1
        tasks = list(losses)
        for a in range(len(tasks)):
            for b in range(a + 1, len(tasks)):
                pair = f"{tasks[a]}-{tasks[b]}"
                self.negative[pair] = self.negative.get(pair, torch.zeros((), device=cos.device)) + (cos[a, b] < 0)
                names += [f"conflict/cos/{pair}", f"conflict/negative/{pair}"]
                values += [cos[a, b], self.negative[pair] / self.monitored]
        pl_module.log_train_values(tuple(names), torch.stack(values))

    def state_dict(self) -> dict[str, Any]:
        return {"monitored": self.monitored, "negative": {k: float(v) for k, v in self.negative.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.monitored = int(state_dict["monitored"])
        self.negative = {k: torch.tensor(v) for k, v in state_dict["negative"].items()}

    @rank_zero_only
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        curves = logged_curves(trainer, "conflict/cos/")
        if not curves:
            rank_zero_warn(f"ConflictMonitor: no conflict/cos/* values in a metrics.csv; {self.path} not written")
            return
        with curves_figure(self.path) as ax:
            for name in sorted(curves):
                ax.plot(*curves[name], label=name.removeprefix("conflict/cos/"), linewidth=1.2)
            ax.axhline(0.0, color="black", linewidth=0.8)
            ax.set(xlabel="step", ylabel="cosine of the tasks' gradients (shared layers)", ylim=(-1.05, 1.05))
