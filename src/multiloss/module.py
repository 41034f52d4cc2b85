"""What every recipe's LightningModule shares: batches as dicts, components checked before the first step, logging.

A recipe is a training loop over components chosen by config (`multiloss.components`). It cannot
know a user's network before seeing it run, so each recipe states its components' contract in
``check_components(batch)``: called once on a tiny batch (two examples, no gradient, eval mode, the
random streams restored afterwards) at ``setup``, before any training or validation step and before
`multiloss.train` writes anything into the run dir; or, when no batch can be had that early, on the
first batch that arrives (`Recipe.named_batch`). A component that breaks the contract is a `ConfigError` naming its key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.optim import Optimizer

from multiloss.batches import as_dict, dataset_tensors, probe_batch, take
from multiloss.components import OptimizerFactory, name_of
from multiloss.config import ConfigError, require
from multiloss.metrics import EpochMeans


class Recipe(L.LightningModule):
    """Base of the recipes: dict batches, the component check, ``check_trainer``, loss logging, one optimizer.

    Subclasses build their components in ``__init__``, implement `check_components` and, where
    Lightning cannot honour a Trainer setting for them, `check_trainer`. Single-optimizer recipes
    set ``self.optimizer_factory``; the GAN overrides ``configure_optimizers``.
    """

    # The attributes holding the components built from config: what ``compile=true`` compiles.
    components: ClassVar[tuple[str, ...]] = ("net",)

    def __init__(self, compile: bool = False) -> None:
        super().__init__()
        self.compile_components = bool(compile)
        self.optimizer_factory: OptimizerFactory | None = None
        self.epoch_means = EpochMeans()  # validation losses, filled by log_losses
        self._components_checked = False
        self._windows: dict[tuple[str, ...], _Window] = {}  # training values between two log rows
        self._step_index: int | None = None  # see step_index
        # A multi-task recipe's per-task losses of the current step, graph attached, from its
        # training_step to the end of its backward: what the conflict monitor differentiates.
        self.task_losses: dict[str, torch.Tensor] | None = None

    def __setattr__(self, name: str, value: Any) -> None:
        # Lightning sets _current_fx_name around every hook it calls, ~45 times per training step;
        # nn.Module.__setattr__ spends ~5 µs on each checking for parameters, buffers and modules,
        # which a str (or None) never is: a quarter of Lightning's own per-step cost on a small model.
        if name == "_current_fx_name":
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    # --- contracts ---------------------------------------------------------------------------

    def check_components(self, batch: dict[str, Any]) -> None:
        """Raise `ConfigError` (key ``model.<component>``) if a component cannot serve this recipe on ``batch``."""

    def check_trainer(self, trainer: L.Trainer) -> None:
        """Reject Trainer settings this recipe cannot honour (raise `ConfigError` with ``trainer.*`` keys).

        `multiloss.train` calls it after building the Trainer and before writing anything; it runs
        again as the first hook of ``fit`` for a Trainer built by hand.
        """

    def configure_callbacks(self) -> list[L.Callback]:
        # The earliest hook Lightning calls on the module in fit(): before its own configuration checks
        # (bare MisconfigurationExceptions) and before any training.
        self.check_trainer(self.trainer)
        return []

    def setup(self, stage: str) -> None:
        if not self._components_checked and (batch := probe_batch(self.trainer)) is not None:
            self.run_component_check(batch)

    def configure_model(self) -> None:
        # Lightning's hook for building or wrapping the model once per fit, before the first step.
        if self.compile_components:
            self.compile_in_place()

    def compile_in_place(self) -> dict[str, str]:
        """``torch.compile`` each of `components` that `not_compilable` lets through (``nn.Module.compile``).

        In place: names, state_dict keys and checkpoints stay as without it. Returns what was not
        compiled and why (also said once on the console).
        """
        skipped = {name: why for name in self.components if (why := self.not_compilable(name))}
        for name in self.components:
            module = getattr(self, name)
            if name not in skipped and module._compiled_call_impl is None:
                module.compile()
        if skipped:
            rank_zero_info(
                "model.compile: left eager: " + "; ".join(f"model.{name} ({why})" for name, why in skipped.items())
            )
        return skipped

    def not_compilable(self, name: str) -> str:
        """Why component ``name`` must stay eager under ``compile=true`` ('' if it can be compiled)."""
        return ""

    # --- evaluation: the test stage is the validation step on the test set ---------------------

    @property
    def stage(self) -> str:
        """The prefix of evaluation metrics: ``test`` under ``trainer.test`` (``multiloss-eval``), else ``val``."""
        return "test" if self._trainer is not None and self._trainer.testing else "val"

    def test_step(self, batch: Any, batch_idx: int) -> Any:
        return self.validation_step(batch, batch_idx)

    def on_test_epoch_start(self) -> None:
        self.on_validation_epoch_start()

    def on_test_epoch_end(self) -> None:
        self.on_validation_epoch_end()

    def named_batch(self, batch: Any) -> dict[str, Any]:
        """``batch`` as a dict (`multiloss.batches.as_dict`), checked against the components if that has not happened.

        Each recipe's steps start with it. (Not ``on_after_batch_transfer``: a data module that
        overrides that hook replaces the module's.)
        """
        batch = as_dict(batch)
        if not self._components_checked:
            self.run_component_check(batch)
        return batch

    def run_component_check(self, batch: Any) -> None:
        """`check_components` on two examples of ``batch``; weights, BatchNorm statistics and RNGs stay as they were."""
        # As given: at setup the weights are still float32 (a "bf16-true" Trainer converts them later),
        # and a batch reaching a step has already been converted by Lightning's loop.
        batch = take(as_dict(batch), 2)
        was_training = self.training
        # The batch's device, not self.device: at setup Lightning already reports the target device
        # while the weights (and the probe batch) are still on the CPU.
        cuda = {v.device for v in batch.values() if isinstance(v, torch.Tensor) and v.device.type == "cuda"}
        with torch.random.fork_rng(devices=sorted(cuda, key=str)), torch.no_grad():
            self.eval()
            try:
                self.check_components(batch)
            finally:
                self.train(was_training)
        self._components_checked = True

    def check_class_labels(self, classes: int, key: str = "y") -> None:
        """Every integer label of the data in [0, ``classes``): all of it, where the data module holds it in
        memory (the component check sees only two examples)."""
        datamodule = self.trainer.datamodule if self._trainer is not None else None
        for labels in dataset_tensors(datamodule, key):
            if labels.is_floating_point() or labels.numel() == 0:
                continue
            low, high = int(labels.min()), int(labels.max())
            require(
                low >= 0 and high < classes,
                "data",
                f"<labels {low}..{high} in {key!r}>",
                f"class ids 0..{classes - 1}: the net gives {classes} logits (model.net)",
                "labels out of range",
            )

    def component_name(self, key: str) -> str:
        """The ``_target_`` of component ``key`` (or the class of one given as an object), for messages."""
        return name_of(self.hparams.get(key, getattr(self, key, key)))

    # --- optimization and logging ------------------------------------------------------------------

    def configure_optimizers(self) -> Optimizer:
        if self.optimizer_factory is None:
            raise ConfigError(
                "model.optimizer",
                None,
                "an optimizer config (optimizer=adam|adamw|sgd), or a callable params -> Optimizer",
                "this module was built without one (fine for inference, not for training)",
            )
        return self.optimizer_factory(self.parameters())

    def configure_gradient_clipping(
        self, optimizer: Optimizer, gradient_clip_val: float | None = None, gradient_clip_algorithm: str | None = None
    ) -> None:
        # Lightning calls this every optimizer step; with no clipping value anywhere, nothing can change.
        if gradient_clip_val is None and self.trainer.gradient_clip_val is None:
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def report_losses(self, losses: Mapping[str, torch.Tensor]) -> None:
        """Hand this training step's loss components to the non-finite guard (`log_losses` does it too).

        Call it before the backward of a step whose losses are logged only after their optimizer
        stepped (the GAN), so ``nonfinite=skip`` judges a step by its own losses.
        """
        self._report(tuple(losses), _stacked(losses.values()))

    def _report(self, names: tuple[str, ...], values: torch.Tensor) -> None:
        guard = getattr(self, "_nonfinite_guard", None)
        if guard is not None and self._trainer is not None:
            guard.record(names, values, self.trainer.global_step)

    def log_losses(
        self,
        losses: Mapping[str, torch.Tensor],
        prefix: str = "loss/",
        batch_size: int | torch.Tensor | None = None,
        report: bool = True,
    ) -> None:
        """Log each component under its own name (``loss/head0``, ...) beside the total.

        Training values are summed on the device at every step and logged as their mean over the
        steps since the last log row, on the rows Lightning writes (every ``trainer.log_every_n_steps``
        optimizer steps; `log_train_values`): no host sync and no logging work in between.
        (Under DDP, rank zero's own micro-batches, as Lightning does without a collective per step.)
        A subclass that overrides ``on_train_batch_start``, ``on_train_batch_end`` or ``on_train_end``
        calls the base's too.
        Validation values are logged per epoch, as the mean over every rank's examples
        (`multiloss.metrics.EpochMeans`).
        Training values also go to the non-finite guard, unless ``report`` is false (already reported).
        """
        if not self.training:
            self.epoch_means.log(self, losses, prefix, 1 if batch_size is None else batch_size)
            return
        names = tuple(f"{prefix}{name}" for name in losses)
        values = _stacked(losses.values())
        if report:
            self._report(tuple(losses), values)
        self.log_train_values(names, values)

    def log_train_values(self, names: tuple[str, ...], values: torch.Tensor) -> None:
        """Add this step's ``values`` (a 1-D tensor, one per name) to their window, logged as means on log rows."""
        window = self._windows.get(names)
        if window is None:
            self._windows[names] = _Window(values)
        else:
            window.add(values)

    @property
    def step_index(self) -> int:
        """The step every output of a run names: ``step`` in metrics.csv (and every logger), the loss
        curves, the GAN's and tbptt's sample headers, weighted's task-metric plot.

        It is Lightning's logging step: the index, from 0, of the model's optimizer step — for
        recipes that step by hand (gan, tbptt), of the training batch — that the values belong to.
        (``trainer.max_steps``, ``global_step`` and checkpoint names count every ``optimizer.step()``
        call instead: a GAN batch makes 1 + 1/n_critic of them, a tbptt batch one per chunk.)
        """
        if self._step_index is not None:
            return self._step_index
        return max(self.trainer.fit_loop.epoch_loop._batches_that_stepped - 1, 0)

    def mean_over_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` averaged over the ranks (itself on one device): a collective, every rank calls it."""
        return self.trainer.strategy.reduce(tensor, reduce_op="mean")

    def on_after_backward(self) -> None:
        self.task_losses = None  # the graph is freed: nothing to hold on to

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # Lightning counts this batch's step only after the batch (and a validation it runs) is over.
        self._step_index = self.trainer.fit_loop.epoch_loop._batches_that_stepped

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        # The last hook before Lightning writes a log row: every window (the GAN's generator loss
        # too, which has values on generator steps only) goes into that row.
        connector = self.trainer._logger_connector
        accumulating = self.automatic_optimization and self.trainer.fit_loop._should_accumulate()
        if connector.should_update_logs and not accumulating:
            self._log_windows()

    def on_train_end(self) -> None:
        # The steps since the last row (a run shorter than log_every_n_steps has no other row).
        self._log_windows()

    def _log_windows(self) -> None:
        """Every window's means as one row to each logger, and into ``trainer.callback_metrics``.

        Written the way Lightning's LearningRateMonitor writes its rates (``logger.log_metrics`` at
        Lightning's row step), not through ``self.log``: its per-value bookkeeping costs ~2,000 Python
        calls a value, which on a small model outweighs the training step. One host read per row.
        """
        names: list[str] = []
        means: list[torch.Tensor] = []
        for window_names, window in self._windows.items():
            if window.count:
                names += window_names
                means.append(window.take())
        if not names:
            return
        trainer = self.trainer
        values = torch.cat(means).tolist()  # the row's one host sync
        # For callbacks that monitor a training loss (ModelCheckpoint(monitor=...), EarlyStopping), as
        # self.log would leave them.
        trainer.callback_metrics.update(zip(names, torch.tensor(values).unbind()))
        row = {**dict(zip(names, values)), "epoch": float(trainer.current_epoch)}
        for logger in trainer.loggers:
            logger.log_metrics(row, step=self.step_index)


def describe_batch(batch: Mapping[str, Any]) -> str:
    """``x: a tensor float32 (2, 64), y: a tensor int64 (2,)``: what a component was given, for error messages."""
    return ", ".join(f"{key}: {describe_output(value)}" for key, value in batch.items())


def describe_output(value: Any) -> str:
    """A short reading of what a network returned: ``tensor float32 (2, 10)``, ``list of 3 tensors``, ..."""
    if isinstance(value, torch.Tensor):
        return f"a tensor {str(value.dtype).removeprefix('torch.')} {tuple(value.shape)}"
    if isinstance(value, Mapping):
        return "a dict {" + ", ".join(f"{k!r}: {describe_output(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return f"a {type(value).__name__} of {len(value)}: [" + ", ".join(describe_output(v) for v in value) + "]"
    return f"a {type(value).__name__}"


def call_component(key: str, target: str, fn: Any, *args: Any, given: str = "") -> Any:
    """``fn(*args)``, with any exception turned into a `ConfigError` under ``key`` saying what it was given."""
    try:
        return fn(*args)
    except ConfigError:
        raise
    except Exception as err:
        raise ConfigError(
            key,
            target,
            f"a component that runs on the data ({given})" if given else "a component that runs",
            f"it failed: {type(err).__name__}: {err}",
        ) from None


class _Window:
    """Training values summed on their device since the last log row (no host sync until it is logged)."""

    def __init__(self, values: torch.Tensor) -> None:
        self.total, self.count = values.clone(), 1

    def add(self, values: torch.Tensor) -> None:
        if self.count == 0:
            self.total.copy_(values)
        else:
            self.total.add_(values)
        self.count += 1

    def take(self) -> torch.Tensor:
        mean, self.count = self.total / self.count, 0
        return mean


def _stacked(values: Any) -> torch.Tensor:
    """Scalar tensors as one detached float32 vector: one tensor to sum, check and log per step."""
    return torch.stack([v.detach().reshape(()).float() for v in values])
