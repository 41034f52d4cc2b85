"""The base of every recipe: the contract the library reads, dict batches, the component check, the step's tools.

A recipe is a training loop over components chosen by config (`multiloss.components`), run under
Lightning's manual optimization: its ``training_step`` is the whole step as a plain PyTorch loop
writes it — forward, the losses, the recipe's backward, clipping, the optimizer step, zeroing, the
learning-rate schedule — and the Trainer supplies the loop, devices, precision, DDP, logging and
checkpoints. Every recipe takes the same step options: ``accumulate_grad_batches`` (k micro-batches
per optimizer step), ``gradient_clip_val`` / ``gradient_clip_algorithm`` and ``scheduler``; Lightning's
``trainer.accumulate_grad_batches`` / ``trainer.gradient_clip_val`` are refused with these keys named
(Lightning cannot apply them under manual optimization).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import lightning as L
import torch

from multiloss.batches import as_dict, probe_batch
from multiloss.component_check import run_check
from multiloss.components import OptimizerFactory, compile_in_place, name_of
from multiloss.config import ConfigError
from multiloss.manual_step import ManualStep
from multiloss.metrics import EpochMeans
from multiloss.schedules import StepOnValidation
from multiloss.training_log import TrainingLog, TrainingLogWriter


class Recipe(ManualStep):
    """Base of the recipes: the contract, dict batches, the component check, the step options, loss logging.

    Subclasses build their components in ``__init__`` (single-optimizer recipes set
    ``self.optimizer_factory``), implement `check_components` and ``training_step``, and return the
    callbacks that write their own outputs (plots, samples) from `output_callbacks`.
    """

    # --- the contract: everything multiloss's library reads of a recipe, with its default -------------
    components: ClassVar[tuple[str, ...]] = ("net",)  # networks model.compile=true compiles
    ddp_submodules: ClassVar[tuple[str, ...]] = ()  # networks DDP wraps one by one, each with its own optimizer
    passed_to_components: ClassVar[dict[str, tuple[str, ...]]] = {}  # arguments a component gets from the recipe
    accumulates_batches: ClassVar[bool] = True  # its micro-batches are training batches (tbptt's are chunks)
    built_at_setup: tuple[str, ...] = ()  # state-dict prefixes of parts made at setup: a checkpoint may hold them first
    task_losses: dict[str, torch.Tensor] | None = None  # this step's per-task losses, graph on (monitor=conflicts)
    shared_parameters: list[torch.nn.Parameter] | None = None  # the layers the tasks share, if named (else found)
    validation_loss: ClassVar[str | None] = "val/loss/total"  # what scheduler=plateau watches by default
    validation_metrics: ClassVar[tuple[str, ...]] = ()  # without one: what a user may name instead (messages)

    @classmethod
    def from_data(cls, datamodule: L.LightningDataModule) -> dict[str, Any]:
        """Arguments taken from the data module (tbptt: its vocabulary), as LightningCLI's ``link_arguments``."""
        return {}

    def check_components(self, batch: dict[str, Any]) -> None:
        """Raise `ConfigError` (key ``model.<component>``) if a component cannot serve this recipe on ``batch``."""

    def output_callbacks(self) -> list[L.Callback]:
        """The callbacks that write this recipe's own outputs into the run dir (plots, samples)."""
        return []

    def check_checkpoint(self, checkpoint: dict[str, Any], path: str) -> None:
        """Raise `ConfigError` (key ``ckpt_path``) if ``checkpoint`` cannot serve this recipe beyond its weights' shapes
        (tbptt: trained on another vocabulary). Runs before anything is written."""

    # ---------------------------------------------------------------------------------------------------

    def __init__(
        self,
        accumulate_grad_batches: int = 1,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: Literal["norm", "value"] = "norm",
        scheduler: Any = None,
        compile: bool = False,
    ) -> None:
        super().__init__()
        self.automatic_optimization = False  # each step is the recipe's own training_step, visible end to end
        self.set_step_options(accumulate_grad_batches, gradient_clip_val, gradient_clip_algorithm, scheduler)
        self.compile_components = bool(compile)
        self.optimizer_factory: OptimizerFactory | None = None
        self.training_log = TrainingLog()  # training values between log rows; the non-finite guard reads it
        self.epoch_means = EpochMeans()  # validation losses, filled by log_losses
        self._log_names: dict[tuple[str, ...], tuple[str, ...]] = {}  # (prefix, *names) -> logged names
        self._components_checked = False

    def __setattr__(self, name: str, value: Any) -> None:
        # Lightning sets _current_fx_name around every hook it calls, ~45 times per training step;
        # nn.Module.__setattr__ spends ~5 µs on each checking for parameters, buffers and modules,
        # which a str (or None) never is: a quarter of Lightning's own per-step cost on a small model.
        if name == "_current_fx_name":
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    # --- before the first step ---------------------------------------------------------------------

    def configure_callbacks(self) -> list[L.Callback]:
        # The earliest hook Lightning calls on the module in fit(): before its own configuration checks
        # (bare MisconfigurationExceptions) and before any training.
        if self._trainer is not None and self.trainer.state.fn == "fit":
            self.check_trainer(self.trainer)
        return [TrainingLogWriter(self.training_log), StepOnValidation(), *self.output_callbacks()]

    def setup(self, stage: str) -> None:
        if not self._components_checked and (batch := probe_batch(self.trainer)) is not None:
            self.run_component_check(batch)
        self.count_steps_in(self.trainer, stage)

    def configure_model(self) -> None:
        # Lightning's hook for building or wrapping the model once per fit, before the first step.
        if self.compile_components:
            compile_in_place(self, self.components, self.not_compilable)

    def not_compilable(self, name: str) -> str:
        """Why component ``name`` must stay eager under ``compile=true`` ('' if it can be compiled)."""
        return ""

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
        run_check(self, self.check_components, batch)
        self._components_checked = True

    def component_name(self, key: str) -> str:
        """The ``_target_`` of component ``key`` (or the class of one given as an object), for messages."""
        return name_of(self.hparams.get(key, getattr(self, key, key)))

    # --- the optimizer and its schedule (the step's own tools: multiloss.manual_step) -------------------

    def configure_optimizers(self) -> Any:
        if self.optimizer_factory is None:
            raise ConfigError(
                "model.optimizer",
                None,
                "an optimizer config (optimizer=adam|adamw|sgd), or a callable params -> Optimizer",
                "this module was built without one (fine for inference, not for training)",
            )
        return self.with_schedule(self.optimizer_factory(self.parameters()))

    # --- logging ------------------------------------------------------------------------------------------

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

    def log_losses(
        self, losses: Mapping[str, torch.Tensor], prefix: str = "loss/", batch_size: int | torch.Tensor | None = None
    ) -> None:
        """Log each loss component under its own name (``loss/head0``, ...) beside the total.

        Training values go to the `TrainingLog` (one kernel a step, written as means on Lightning's log
        rows, judged by the non-finite guard; under DDP rank zero's own micro-batches, as Lightning does
        without a collective per step). Validation values are logged per epoch, as the mean over every
        rank's examples (`multiloss.metrics.EpochMeans`).
        """
        if not self.training:
            self.epoch_means.log(self, losses, prefix, 1 if batch_size is None else batch_size)
            return
        key = (prefix, *losses)
        if (names := self._log_names.get(key)) is None:
            names = self._log_names[key] = tuple(f"{prefix}{name}" for name in losses)
        self.training_log.add(names, list(losses.values()), self.trainer.global_step)

    def log_train_values(self, names: tuple[str, ...], values: torch.Tensor) -> None:
        """Training values that are not losses (a 1-D tensor, one per name), logged as means on the log rows."""
        self.training_log.add(names, values.detach(), self.trainer.global_step, watched=False)

    @property
    def step_index(self) -> int:
        """The step every output of a run names (`multiloss.training_log.TrainingLog`)."""
        if self.training_log.step_index is not None:
            return self.training_log.step_index
        return max(self.trainer.fit_loop.epoch_loop._batches_that_stepped - 1, 0)

    def mean_over_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` averaged over the ranks (itself on one device): a collective, every rank calls it."""
        return self.trainer.strategy.reduce(tensor, reduce_op="mean")
