"""Recipe `weighted`: multi-task learning, several weighted losses through one backward with ``grad_tensors``.

One trunk, three task heads on the digits (the class, odd/even, the ink mass of the image), and a
weight per task. The tempting loop, one ``backward`` per task loss, fails on the second task with
the error the seeds keep meeting:

    RuntimeError: Trying to backward through the graph a second time, but the buffers have
    already been freed. Specify retain_graph=True when calling backward the first time.

because the first call frees the trunk's saved tensors; ``retain_graph=True`` on all but the last
makes it run, at the price of keeping the graph alive and walking the trunk once per task. And
stacking the losses and calling ``losses.backward()`` on the vector fails with torch's
``grad can be implicitly created only for scalar outputs``. The seed's answer (its grad_tensors
example: y0=(x+w)(w+1), y1=(x+w)+(w+1), weights [1, 2] give dw = 1·5 + 2·2 = 9) is to hand the
vector of losses and the vector of weights to one backward::

    torch.autograd.backward(losses, grad_tensors=weights)    # == (weights * losses).sum().backward()

The weights are the vector-Jacobian product's seed: autograd starts the pass from ∂total/∂lossᵢ = wᵢ
and the trunk receives Σ wᵢ·∂lossᵢ/∂trunk in a single traversal, no retained graph.
`tests/recipes/test_weighted.py` proves it equals the backward of Σ wᵢ·lossᵢ, reproduces the seed's
dw = 9 through the same function, and shows a zero weight leaves its head with a zero gradient.

    python train.py recipe=weighted                       # digit, parity, ink: weights 1, 1, 30
    python train.py recipe=weighted model.tasks.parity.weight=0     # parity switched off
    python train.py --config-dir my_configs recipe=weighted net=my_net tasks=my_tasks data=npz data.path=F
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from multiloss.balancers import Fixed, save_balancer_state
from multiloss.batches import require_keys
from multiloss.components import build_module, build_optimizer_factory, name_of, objects_given, plain
from multiloss.config import ConfigError
from multiloss.module import Recipe, call_component, describe_batch, describe_output
from multiloss.tasks import build_tasks, loss_modules


def weighted_backward(losses: torch.Tensor, weights: torch.Tensor, **kwargs: Any) -> None:
    """One backward pass of Σ weightsᵢ·lossesᵢ, for a 1-D tensor of losses: the recipe's only backward.

    ``torch.autograd.backward(losses, grad_tensors=weights)``: the weights seed the backward pass
    instead of a scalar 1, so the graph is walked once and freed once. ``kwargs`` go to
    ``torch.autograd.backward`` (``create_graph=`` for higher-order gradients).
    """
    torch.autograd.backward(losses, grad_tensors=weights.to(losses.dtype), **kwargs)


class WeightedMultiTask(Recipe):
    """Multi-task learning: one loss per task on one network, one backward weighted by each task's weight.

    Components:
        net (group ``net``, default ``multitask_mlp``: `multiloss.nets.MultiTaskMLP`, a trunk and one
            head per task): ``forward(x)`` returns a dict task name -> output, one entry per task.
        tasks (group ``tasks``, default ``digits``: the class (cross-entropy), odd/even (binary
            cross-entropy on one logit) and ink mass (MSE) of a digit): task name -> ``{loss, target,
            weight, metric}``, see `multiloss.tasks`. ``model.tasks.<name>.weight=…`` from the shell.
        optimizer (group ``optimizer``, default ``adam``): a ``_partial_`` optimizer config.
        data: batches with ``x`` (the net's input) and every task's ``target`` key (digits: ``y``,
            ``parity``, ``ink``; an ``.npz``: each of its arrays).

    ``training_step`` returns the vector of task losses; ``backward`` is `weighted_backward` with
    the task weights: one pass, no ``retain_graph``. Automatic optimization, so
    ``trainer.accumulate_grad_batches``, ``gradient_clip_val``, mixed precision and DDP's skipped
    all-reduce all work as usual. Logs ``loss/<task>`` and ``loss/total`` (= Σ wᵢ·lossᵢ) per step,
    ``val/loss/<task>``, ``val/loss/total`` and, for a task with a metric,
    ``val/<metric_name>/<task>`` per validation, and plots the validation metrics over the steps to
    ``task_metrics.png`` in the run dir.

    The shipped net has no dropout or BatchNorm by default, so a batch split over micro-batches or
    ranks gives the same gradient; both are options (``model.net.dropout``, ``model.net.batch_norm``).

    Raises:
        ConfigError: a task without ``loss`` or ``target``, an unknown task key, a weight negative or
            infinite, every weight 0, a metric that is not a torchmetrics Metric; at setup (before
            any step or write): a net that does not return a dict with one output per task, a
            task's ``target`` not in the batch, a loss that fails on its output and target or does not
            return a scalar, a metric that fails on them.
    """

    # What the recipe gives its balancer itself (the config sets neither).
    passed_to_components: ClassVar[dict[str, tuple[str, ...]]] = {"balancer": ("tasks", "base", "net")}

    def __init__(
        self, net: Any, tasks: Any, optimizer: Any = None, balancer: Any = None, compile: bool = False
    ) -> None:
        super().__init__(compile=compile)
        net, tasks, optimizer, balancer = plain(net), plain(tasks), plain(optimizer), plain(balancer)
        self.save_hyperparameters(ignore=objects_given(net=net, optimizer=optimizer, balancer=balancer), logger=False)
        self.tasks = build_tasks(tasks)
        # The net is built first (a gradient-level balancer's `shared` names its layers) but registered
        # after the balancer, which keeps the parameters' order, hence the optimizer state's, as it was.
        network = build_module(net, "net")
        # The weights of the one backward (multiloss.balancers): the configured ones by default. A
        # module, so its weights follow the recipe to its device (and dtype under bf16-true), its
        # parameters join the optimizer and its state the checkpoint.
        names, weights = list(self.tasks), [t.weight for t in self.tasks.values()]
        self.balancer = (
            Fixed(names, weights)
            if balancer is None
            else build_module(balancer, "balancer", tasks=names, base=weights, net=network)
        )
        self._backward_weights: torch.Tensor | None = None  # set by each training_step
        self._step_losses: torch.Tensor | None = None  # the vector it returned (gradient-level balancers)
        self.net = network
        self.optimizer_factory = build_optimizer_factory(optimizer, "optimizer")
        self.task_metrics = nn.ModuleDict({n: t.metric for n, t in self.tasks.items() if t.metric is not None})
        self.loss_modules = loss_modules(self.tasks)  # losses with state (pos_weight, ...) follow the device
        # Validation metrics after each validation, for task_metrics.png; kept in the checkpoint so a
        # resumed run's plot continues the curves.
        self.history: list[dict[str, float]] = []

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

    def forward(self, x: torch.Tensor) -> Any:
        return self.net(x)

    def task_losses_of(self, batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The net's outputs and each task's mean loss over the batch (mean, so batches and ranks average exactly)."""
        outputs = self.net(batch["x"])
        return outputs, {name: t.loss(outputs[name], batch[t.target]) for name, t in self.tasks.items()}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        batch = self.named_batch(batch)
        _, per_task = self.task_losses_of(batch)
        self.task_losses = per_task  # for the conflict monitor (monitor=conflicts), until the backward
        losses = torch.stack(list(per_task.values()))
        weights = self.balancer.weights(losses.detach())
        extra = self.balancer.extra(losses)  # a balancer's own term (uncertainty's log-variances)
        total = (weights * losses.detach()).sum()
        if extra is not None:
            total = total + extra.detach()
        self.log_losses({**per_task, "total": total}, batch_size=len(batch["x"]))
        if self.balancer.adaptive:
            self.log_train_values(tuple(f"weight/{name}" for name in self.tasks), weights.detach())
        # The vector of task losses, not a scalar: Lightning divides it by accumulate_grad_batches
        # (and AMP scales it) element-wise, then hands it to `backward` below with these weights.
        if extra is None:
            self._backward_weights = weights
            self._step_losses = losses
            return losses
        self._backward_weights = torch.cat([weights, weights.new_ones(1)])
        return torch.cat([losses, extra.view(1).to(losses.dtype)])

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        # Why automatic optimization with this hook rather than manual optimization and
        # manual_backward(losses, gradient=w): everything Lightning does around the backward (loss
        # / accumulate_grad_batches, no DDP all-reduce on non-stepping micro-batches, AMP loss
        # scaling, gradient clipping, the optimizer step and zero_grad) stays Lightning's, and
        # `trainer.accumulate_grad_batches` keeps working; manual optimization rejects it and
        # gradient_clip_val at fit time. Only the backward call itself changes: one weighted pass.
        if self.balancer.combines_gradients:  # PCGrad & co.: one backward per task, then their own sum
            self.balancer.backward(self._scaled_task_losses(loss), list(self.net.parameters()))
            return
        # The weights this step's training_step chose; the configured ones for a backward called alone.
        weights = self._backward_weights if self._backward_weights is not None else self.balancer.base
        weighted_backward(loss, weights, **kwargs)

    def _scaled_task_losses(self, loss: torch.Tensor) -> list[torch.Tensor]:
        """Each task's own loss tensor, scaled as Lightning scaled the vector ``loss`` (1/k, AMP's scale).

        Not ``loss[i]``: a slice of the stacked vector reaches every task's graph (with zeros), so
        every head would look shared. The scale is d loss / d (the vector training_step returned).
        """
        raw = self._step_losses
        scale = torch.autograd.grad(loss, raw, torch.ones_like(loss), retain_graph=True)[0]
        assert self.task_losses is not None
        return [s * task_loss for s, task_loss in zip(scale, self.task_losses.values())]

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self.balancer.start_epoch(self.current_epoch, self.mean_over_ranks)

    # --- validation --------------------------------------------------------------------------------

    @staticmethod
    def _metric_input(task, output: torch.Tensor) -> torch.Tensor:
        return task.activation(output) if task.activation is not None else output

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        batch = self.named_batch(batch)
        outputs, per_task = self.task_losses_of(batch)
        total = sum(t.weight * per_task[name] for name, t in self.tasks.items())
        self.log_losses({**per_task, "total": total}, prefix=f"{self.stage}/loss/", batch_size=len(batch["x"]))
        for name, metric in self.task_metrics.items():
            task = self.tasks[name]
            metric(self._metric_input(task, outputs[name]), batch[task.target])
            self.log(f"{self.stage}/{task.metric_name}/{name}", metric, on_epoch=True, prog_bar=True)

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking or not self.task_metrics:
            return
        # compute() syncs over ranks (every rank calls it) and caches the value Lightning then logs.
        entry = {"step": float(self.step_index)}
        for name, metric in self.task_metrics.items():
            entry[f"{name} {self.tasks[name].metric_name}"] = metric.compute().item()
        self.history.append(entry)

    # --- artifacts ---------------------------------------------------------------------------------

    def on_train_epoch_end(self) -> None:
        self._write_plot()

    def on_train_end(self) -> None:
        super().on_train_end()
        # Also here: a run stopped by max_steps mid-epoch never reaches on_train_epoch_end.
        self._write_plot()

    def _write_plot(self) -> None:
        if self.trainer.is_global_zero and self.history:
            self._plot_history(Path(self.trainer.default_root_dir) / "task_metrics.png")

    def _plot_history(self, path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        steps = [h["step"] for h in self.history]
        names = [k for k in self.history[0] if k != "step"]
        fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.4), squeeze=False)
        for ax, name in zip(axes[0], names):
            values = [h.get(name, float("nan")) for h in self.history]
            ax.plot(steps, values, marker="o", markersize=3)
            ax.set_title(f"{name}: {values[-1]:.4g}")
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        weights = ", ".join(f"{n}={t.weight:g}" for n, t in self.tasks.items())
        fig.suptitle(f"validation per task (weights: {weights})")
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
        plt.close(fig)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["task_metrics_history"] = list(self.history)
        save_balancer_state(self.balancer, checkpoint, self.mean_over_ranks)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.history = list(checkpoint.get("task_metrics_history", []))
