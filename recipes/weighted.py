"""Recipe `weighted`: multi-task learning, several weighted losses through one backward with ``grad_tensors``.

One trunk, three task heads on the digits (the class, odd/even, the ink mass of the image), and a
weight per task. The tempting loop, one ``backward`` per task loss, fails on the second task with
the error every multi-loss loop meets sooner or later:

    RuntimeError: Trying to backward through the graph a second time, but the buffers have
    already been freed. Specify retain_graph=True when calling backward the first time.

because the first call frees the trunk's saved tensors; ``retain_graph=True`` on all but the last
makes it run, at the price of keeping the graph alive and walking the trunk once per task. And
stacking the losses and calling ``losses.backward()`` on the vector fails with torch's
``grad can be implicitly created only for scalar outputs``. The answer (the textbook
``grad_tensors`` example: y0=(x+w)(w+1), y1=(x+w)+(w+1), weights [1, 2] give dw = 1·5 + 2·2 = 9) is
to hand the vector of losses and the vector of weights to one backward::

    torch.autograd.backward(losses, grad_tensors=weights)    # == (weights * losses).sum().backward()

The weights are the vector-Jacobian product's seed: autograd starts the pass from ∂total/∂lossᵢ = wᵢ
and the trunk receives Σ wᵢ·∂lossᵢ/∂trunk in a single traversal, no retained graph.
`tests/recipes/test_weighted.py` proves it equals the backward of Σ wᵢ·lossᵢ, reproduces that
dw = 9 through the same function, and shows a zero weight leaves its head with a zero gradient.

    python train.py recipe=weighted                       # digit, parity, ink: weights 1, 1, 30
    python train.py recipe=weighted model.tasks.parity.weight=0     # parity switched off
    python train.py --config-dir my_configs recipe=weighted net=my_net tasks=my_tasks data=npz data.path=F
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning as L
import torch
from torch import nn

from multiloss.building.checks import call_component, describe_batch, describe_output
from multiloss.building.components import (
    build_module,
    build_optimizer_factory,
    name_of,
    names_given_as_objects,
    to_plain,
)
from multiloss.callbacks import LoggedCurvesPlot
from multiloss.config import ConfigError
from multiloss.data.batches import require_keys
from multiloss.multitask.recipe import MultiTaskRecipe, mean_losses
from multiloss.multitask.tasks import build_tasks, loss_modules


def weighted_backward(losses: torch.Tensor, weights: torch.Tensor, **kwargs: Any) -> None:
    """One backward pass of Σ weightsᵢ·lossesᵢ, for a 1-D tensor of losses: the recipe's only backward.

    ``torch.autograd.backward(losses, grad_tensors=weights)``: the weights seed the backward pass
    instead of a scalar 1, so the graph is walked once and freed once. ``kwargs`` go to
    ``torch.autograd.backward`` (``create_graph=`` for higher-order gradients).
    """
    torch.autograd.backward(losses, grad_tensors=weights.to(losses.dtype), **kwargs)


class WeightedMultiTask(MultiTaskRecipe):
    """Multi-task learning: one loss per task on one network, one backward weighted by each task's weight.

    Components:
        net (group ``net``, default ``multitask_mlp``: `multiloss.nets.MultiTaskMLP`, a trunk and one
            head per task): ``forward(x)`` returns a dict task name -> output, one entry per task.
        tasks (group ``tasks``, default ``digits``: the class (cross-entropy), odd/even (binary
            cross-entropy on one logit) and ink mass (MSE) of a digit): task name -> ``{loss, target,
            weight, metric}``, see `multiloss.multitask.tasks`. ``model.tasks.<name>.weight=…`` from the shell.
        optimizer (group ``optimizer``, default ``adam``): a ``_partial_`` optimizer config.
        balancer (group ``balancer``, default ``fixed``: the configured weights): `multiloss.balancers`.
        data: batches with ``x`` (the net's input) and every task's ``target`` key (digits: ``y``,
            ``parity``, ``ink``; an ``.npz``: each of its arrays).

    The step (``training_step``, manual optimization): the net's outputs, each task's loss, and one
    ``manual_backward`` of the vector of task losses seeded with the weights (`weighted_backward`: one
    pass, no ``retain_graph``) — the balancer's weights, the configured ones by default; a balancer with
    a term of its own (uncertainty) adds it to the vector with weight 1, and one that combines the
    tasks' gradients itself (PCGrad & co.) backwards its surrogate instead. The loss is divided by
    ``accumulate_grad_batches``; every k-th micro-batch (and an epoch's last) clips
    (``gradient_clip_val``), steps, zeroes and advances the ``scheduler``; under DDP the other
    micro-batches skip the all-reduce. Logs ``loss/<task>`` and ``loss/total`` (= Σ wᵢ·lossᵢ) per step,
    ``val/loss/<task>``, ``val/loss/total`` and, for a task with a metric,
    ``val/<metric_name>/<task>`` per validation, and plots those over the steps to ``task_metrics.png``
    in the run dir (`multiloss.callbacks.LoggedCurvesPlot`, from metrics.csv).

    The shipped net has no dropout or BatchNorm by default, so a batch split over micro-batches or
    ranks gives the same gradient; both are options (``model.net.dropout``, ``model.net.batch_norm``).

    Raises:
        ConfigError: a task without ``loss`` or ``target``, an unknown task key, a weight negative or
            infinite, every weight 0, a metric that is not a torchmetrics Metric; the step options'
            checks (`multiloss.base.module.Recipe`); at setup (before any step or write): a net that does not
            return a dict with one output per task, a task's ``target`` not in the batch, a loss that
            fails on its output and target or does not return a scalar, a metric that fails on them.
    """

    def __init__(
        self,
        net: Any,
        tasks: Any,
        optimizer: Any = None,
        balancer: Any = None,
        **step_options: Any,  # the options of every recipe's step (multiloss.base.module.Recipe)
    ) -> None:
        super().__init__(balancer=balancer, **step_options)
        net, tasks, optimizer, balancer = to_plain(net), to_plain(tasks), to_plain(optimizer), to_plain(balancer)
        self.save_hyperparameters(
            ignore=names_given_as_objects(net=net, optimizer=optimizer, balancer=balancer), logger=False
        )
        self.tasks = build_tasks(tasks)
        self.net = build_module(net, "net")
        # The weights of the one backward (multiloss.balancers): the configured ones by default. The tasks are
        # the config's, known now: the balancer is built at once (a gradient balancer's `shared` names the net's
        # layers), first among the modules (`multiloss.multitask.recipe`).
        self.set_tasks(list(self.tasks), key="balancer")
        self.optimizer_factory = build_optimizer_factory(optimizer, "optimizer")
        self.task_metrics = nn.ModuleDict({n: t.metric for n, t in self.tasks.items() if t.metric is not None})
        self.loss_modules = loss_modules(self.tasks)  # losses with state (pos_weight, ...) follow the device

    # --- the contract ----------------------------------------------------------------------------

    def check_components(self, batch: dict[str, Any]) -> None:
        require_keys(batch, ("x",), "the net's input")
        net, given = self.component_name("net"), describe_batch(batch)
        outputs = call_component("model.net", net, self.net, batch["x"], given=given)
        names = list(self.tasks)
        if not isinstance(outputs, dict):
            raise ConfigError(
                "model.net",
                net,
                f"a network whose forward(x) returns a dict task name -> output, for the tasks {names}",
                f"it returned {describe_output(outputs)}",
            )
        missing, extra = [n for n in names if n not in outputs], [n for n in outputs if n not in self.tasks]
        if missing or extra:
            raise ConfigError(
                "model.net" if missing else "model.tasks",
                net if missing else names,
                f"one output per task, named as the tasks: {names} (model.tasks) == the keys of the net's dict",
                f"the net returns {sorted(map(str, outputs))}"
                + (f"; no output for {missing}" if missing else "")
                + (f"; no task for {extra}" if extra else ""),
            )
        for name, task in self.tasks.items():
            key = f"model.tasks.{name}"
            if task.target not in batch:
                raise ConfigError(
                    f"{key}.target", task.target, f"one of the batch's keys: {sorted(batch)}", "not in the batch"
                )
            pair = f"output {describe_output(outputs[name])}, target {describe_output(batch[task.target])}"
            spec = self.hparams.tasks[name]
            with warnings.catch_warnings():
                # torch's mse/l1 losses only warn when output and target shapes differ, then broadcast
                # (B, 1) against (B,) into a (B, B) loss: a silent wrong gradient, so an error here.
                warnings.filterwarnings("error", message=".*target size.*different to the input size.*")
                loss = call_component(
                    f"{key}.loss", name_of(spec["loss"]), task.loss, outputs[name], batch[task.target], given=pair
                )
            if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point()):
                raise ConfigError(
                    f"{key}.loss",
                    name_of(spec["loss"]),
                    "a loss that returns the batch's mean as a floating-point scalar",
                    f"on {pair} it returned {describe_output(loss)} (reduction='none'?)",
                )
            if task.metric is not None:
                metric_input = self._metric_input(task, outputs[name])
                probe = task.metric.clone()  # a copy: the probe's update must not count in the first validation
                call_component(
                    f"{key}.metric", name_of(spec["metric"]), probe.update, metric_input, batch[task.target], given=pair
                )

    # --- training ----------------------------------------------------------------------------------

    def configured_weights(self, names: list[str]) -> list[float]:
        return [self.tasks[name].weight for name in names]

    def forward(self, x: torch.Tensor) -> Any:
        return self.net(x)

    def outputs_and_losses(
        self, batch: dict[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The net's outputs and each task's mean loss over the batch (mean, so batches and ranks average exactly)."""
        outputs = self.net(batch["x"])
        return outputs, {name: t.loss(outputs[name], batch[t.target]) for name, t in self.tasks.items()}

    def training_step(self, batch: Any, batch_idx: int) -> None:
        batch = self.prepare_batch(batch)
        # The block steps on every k-th micro-batch (and an epoch's last): clipping, step, zeroing, schedule.
        with self.step_of(self.optimizers(), batch_idx) as step:
            draws = self.draws(batch, lambda part: self.outputs_and_losses(part)[1])  # SDMGrad, MoDo: 3 parts
            balanced = self.balance(draws)  # the weights: the configured ones, or the balancer's
            per_task = mean_losses(draws)
            # One pass seeded with the weights (grad_tensors), loss / k: Σ wᵢ·∇lossᵢ, the graph walked once. (A
            # balancer's own term rides along with weight 1; PCGrad & co. backward their combination's surrogate.)
            balanced.backward(step)
            self.log_losses({**per_task, "total": balanced.total.detach()}, batch_size=len(batch["x"]))
        self.after_step(step, lambda: self.outputs_and_losses(batch)[1])  # FAMO: the same batch's losses after the step

    def backward(self, loss: torch.Tensor, *args: Any, gradient: torch.Tensor | None = None, **kwargs: Any) -> None:
        """The backward Lightning calls (``manual_backward``): a vector of task losses takes one pass seeded with
        ``gradient`` (the step's weights; the configured ones when none is given), a scalar its plain backward."""
        if loss.dim() == 0:
            super().backward(loss, *args, **kwargs)
        else:
            weighted_backward(loss, self.balancer.base if gradient is None else gradient, **kwargs)

    # --- validation --------------------------------------------------------------------------------

    @staticmethod
    def _metric_input(task, output: torch.Tensor) -> torch.Tensor:
        return task.activation(output) if task.activation is not None else output

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        batch = self.prepare_batch(batch)
        outputs, per_task = self.outputs_and_losses(batch)
        total = sum(t.weight * per_task[name] for name, t in self.tasks.items())
        self.log_losses({**per_task, "total": total}, prefix=f"{self.eval_prefix}/loss/", batch_size=len(batch["x"]))
        for name, metric in self.task_metrics.items():
            task = self.tasks[name]
            metric.update(self._metric_input(task, outputs[name]), batch[task.target])
            for log_name, member in task.logged():
                self.log(f"{self.eval_prefix}/{log_name}/{name}", member, on_epoch=True, prog_bar=True)

    def output_callbacks(self) -> list[L.Callback]:
        columns = [f"val/{log_name}/{name}" for name, t in self.tasks.items() for log_name, _ in t.logged()]
        weights = ", ".join(f"{n}={t.weight:g}" for n, t in self.tasks.items())
        return (
            [LoggedCurvesPlot("task_metrics.png", columns, f"validation per task (weights: {weights})")]
            if columns
            else []
        )
