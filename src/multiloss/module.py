"""`Recipe`: the base of every recipe — the contract the library reads, the step options, the tools of a step.

A recipe is a training loop over components chosen by config (`multiloss.components`), run under
Lightning's manual optimization: its ``training_step`` is the whole step as a plain PyTorch loop
writes it — forward, the losses, the recipe's backward, clipping, the optimizer step, zeroing, the
learning-rate schedule — and the Trainer supplies the loop, devices, precision, DDP, logging and
checkpoints. The step options are declared once, as the parameters of `Recipe.__init__` (a recipe
passes its ``**step_options`` on; ``configs/step_options/default.yaml`` gives them to every recipe
under ``model.``): ``accumulate_grad_batches`` (k micro-batches per optimizer step),
``gradient_clip_val`` / ``gradient_clip_algorithm``, ``scheduler`` and ``compile``. Lightning's
``trainer.accumulate_grad_batches`` / ``trainer.gradient_clip_val`` are refused with these keys named
(Lightning cannot apply them under manual optimization).
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal

import lightning as L
import torch
from torch.optim import Optimizer

from multiloss import lightning_internals as internals
from multiloss import precision, sharding
from multiloss.batches import as_dict, probe_batch
from multiloss.component_check import run_check
from multiloss.components import OptimizerFactory, compile_in_place, name_of, to_plain
from multiloss.config import ConfigError, require
from multiloss.learning_rate import RatePlan, apply_rule
from multiloss.metrics import EpochMeans
from multiloss.schedules import StepOnValidation, build_schedule
from multiloss.training_log import TrainingLog, TrainingLogWriter

_SYNC_AS_USUAL = contextlib.nullcontext()  # reusable: the block of a micro-batch that steps


class Recipe(L.LightningModule):
    """Base of the recipes: the contract, the step options and the step's tools, dict batches, loss logging.

    Subclasses build their components in ``__init__`` (single-optimizer recipes set
    ``self.optimizer_factory``) and pass ``**step_options`` to it, implement `check_components` and
    ``training_step``, and return the callbacks that write their own outputs from `output_callbacks`.
    """

    # --- the contract: everything multiloss's library reads of a recipe, with its default -------------
    components: ClassVar[tuple[str, ...]] = ("net",)  # networks model.compile=true compiles
    ddp_submodules: ClassVar[tuple[str, ...]] = ()  # networks DDP wraps one by one, each with its own optimizer
    passed_to_components: ClassVar[dict[str, tuple[str, ...]]] = {}  # arguments a component gets from the recipe
    accumulates_batches: ClassVar[bool] = True  # its micro-batches are training batches (tbptt's are chunks)
    validation_loss: ClassVar[str | None] = "val/loss/total"  # what scheduler=plateau watches by default
    validation_metrics: ClassVar[tuple[str, ...]] = ()  # without one: what a user may name instead (messages)
    shared_parameters: list[torch.nn.Parameter] | None = None  # the layers the tasks share, if named (else found)

    @property
    def built_at_setup(self) -> tuple[str, ...]:
        """State-dict prefixes of parts made at setup: a checkpoint may hold them before the module does."""
        return ()

    @classmethod
    def from_data(cls, datamodule: L.LightningDataModule) -> dict[str, Any]:
        """Arguments taken from the data module (tbptt: its vocabulary), as LightningCLI's ``link_arguments``."""
        return {}

    def check_components(self, batch: dict[str, Any]) -> None:
        """Raise `ConfigError` (key ``model.<component>``) if a component cannot serve this recipe on ``batch``."""

    def check_checkpoint(self, checkpoint: dict[str, Any], path: str) -> None:
        """Raise `ConfigError` (key ``ckpt_path``) if ``checkpoint`` cannot serve this recipe beyond its weights' shapes
        (tbptt: trained on another vocabulary). Runs before anything is written."""

    def output_callbacks(self) -> list[L.Callback]:
        """The callbacks that write this recipe's own outputs into the run dir (plots, samples)."""
        return []

    def held_whole(self, trainer: L.Trainer) -> tuple[str, ...]:
        """The components whose step differentiates their parameters more than once (a gradient balancer's per-task
        gradients, a gradient penalty): under FSDP2 held whole for their step (`multiloss.sharding.LocalGradients`)."""
        return ()

    def not_compilable(self, name: str) -> str:
        """Why component ``name`` must stay eager under ``compile=true`` ('' if it can be compiled)."""
        return ""

    def lr_rule(self, optimizer: Optimizer) -> tuple[float, dict[str, Any]]:
        """The recipe's factor on ``optimizer``'s configured rates, and what it was computed from (1: none)."""
        return 1.0, {}

    # --- the step options: declared here once, checked, kept ------------------------------------------

    def __init__(
        self,
        accumulate_grad_batches: int = 1,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: Literal["norm", "value"] = "norm",
        scheduler: Any = None,
        compile: bool = False,
        fsdp: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        require(
            isinstance(accumulate_grad_batches, int) and accumulate_grad_batches >= 1,
            "accumulate_grad_batches",
            accumulate_grad_batches,
            "an integer ≥ 1 (micro-batches per optimizer step; 1 = no accumulation)",
        )
        require(
            gradient_clip_val is None or gradient_clip_val > 0,
            "gradient_clip_val",
            gradient_clip_val,
            "a positive number (the largest gradient norm, or value, per step), or null for no clipping",
        )
        require(
            gradient_clip_algorithm in ("norm", "value"),
            "gradient_clip_algorithm",
            gradient_clip_algorithm,
            "norm or value",
        )
        self.automatic_optimization = False  # each step is the recipe's own training_step, visible end to end
        self.accumulate_grad_batches = accumulate_grad_batches
        self.gradient_clip_val, self.gradient_clip_algorithm = gradient_clip_val, gradient_clip_algorithm
        self.scheduler_spec = to_plain(scheduler)
        self.compile_components = bool(compile)
        self.fsdp = {"shard": None, "checkpoint": [], **to_plain(fsdp or {})}
        unknown = sorted(set(self.fsdp) - {"shard", "checkpoint"})
        require(not unknown, f"fsdp.{unknown[0] if unknown else ''}", self.fsdp, "shard and checkpoint", "unknown key")
        for key in ("shard", "checkpoint"):  # one name on the command line (fsdp.checkpoint=Block) is a list of one
            value = self.fsdp[key]
            value = [value] if isinstance(value, str) else value
            names = isinstance(value, list) and all(isinstance(v, str) for v in value)
            require(
                names or (value is None and key == "shard"),
                f"fsdp.{key}",
                value,
                "a class name or name pattern, or a list of them" + (" (null: each child)" if key == "shard" else ""),
            )
            self.fsdp[key] = value
        self.optimizer_factory: OptimizerFactory | None = None
        self.rate_plans: dict[str, RatePlan] = {}  # per optimizer config key, in configure_optimizers' order
        self.training_log = TrainingLog()  # training values between log rows; the non-finite guard reads it
        self.epoch_means = EpochMeans()  # validation losses, filled by log_losses
        self._log_names: dict[tuple[str, ...], tuple[str, ...]] = {}  # (prefix, *names) -> logged names
        self._rate_names: tuple[str, ...] | None = None  # the learning-rate columns, named as Lightning names them
        self._components_checked = False
        self._sharded = False  # configure_model has sharded the components (FSDP2)
        self._held: dict[str, sharding.LocalGradients] = {}  # the components held whole for their step, by name

    def __setattr__(self, name: str, value: Any) -> None:
        # Lightning sets _current_fx_name around every hook it calls, ~45 times per training step;
        # nn.Module.__setattr__ spends ~5 µs on each checking for parameters, buffers and modules,
        # which a str (or None) never is: a quarter of Lightning's own per-step cost on a small model.
        if name == "_current_fx_name":
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    @property
    def attached_trainer(self) -> L.Trainer | None:
        """The Trainer this module runs under, or None (built for a test, a notebook, inference)."""
        return internals.attached_trainer(self)

    @property
    def attached_datamodule(self) -> L.LightningDataModule | None:
        trainer = self.attached_trainer
        return trainer.datamodule if trainer is not None else None

    # --- before the first step ------------------------------------------------------------------------

    def configure_callbacks(self) -> list[L.Callback]:
        # The earliest hook Lightning calls on the module in fit(): before its own configuration checks
        # (bare MisconfigurationExceptions), before any training, before multiloss writes anything.
        trainer = self.attached_trainer
        if trainer is not None and trainer.state.fn == "fit":
            self.check_trainer(trainer)
        return [TrainingLogWriter(self.training_log), StepOnValidation(), *self.output_callbacks()]

    def check_trainer(self, trainer: L.Trainer) -> None:
        """Refuse the Trainer settings a recipe does itself, naming its own key."""
        moved = (
            ("accumulate_grad_batches", trainer.accumulate_grad_batches, 1),
            ("gradient_clip_val", trainer.gradient_clip_val, None),
            ("gradient_clip_algorithm", getattr(trainer.gradient_clip_algorithm, "value", None), None),
        )
        for key, value, unset in moved:
            if value != unset:
                with_value = " with model.gradient_clip_val=<max>" if key == "gradient_clip_algorithm" else ""
                raise ConfigError(
                    f"trainer.{key}",
                    value,
                    f"{unset if unset is not None else 'null'}; every recipe does this in its own step: "
                    f"model.{key}={value}{with_value}",
                    "Lightning cannot apply it under manual optimization",
                )

    def check_sharding(self, trainer: L.Trainer) -> None:
        """Refuse what sharded training (FSDP2) cannot do with this recipe's settings (`multiloss.train` asks before
        any process starts)."""
        sharding.check_policy(self, self.components, self.fsdp["shard"], self.fsdp["checkpoint"])

    def setup(self, stage: str) -> None:
        if stage == "fit" and self.accumulates_batches:
            # Lightning's loop then counts optimizer steps as this recipe takes them: its logging step,
            # its log rows and estimated_stepping_batches (Lightning's own GradientAccumulationScheduler
            # sets it at run time the same way). check_trainer has just seen it is 1.
            self.trainer.accumulate_grad_batches = self.accumulate_grad_batches
        precision.install(self.trainer.precision_plugin)  # 16-mixed: clipping on the true gradients
        if not self._components_checked and (batch := probe_batch(self.trainer)) is not None:
            self.run_component_check(batch)

    def teardown(self, stage: str) -> None:
        if stage == "fit" and self.attached_trainer is not None:
            self.trainer.accumulate_grad_batches = 1  # a Trainer fitted again passes check_trainer again

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """Lightning's, and a sharded run's checkpoint directory too (read whole into a temporary file first)."""
        from multiloss.run_dir import is_sharded_checkpoint

        if not is_sharded_checkpoint(checkpoint_path):
            return super().load_from_checkpoint(checkpoint_path, *args, **kwargs)
        from multiloss.checkpoints import consolidate

        with tempfile.TemporaryDirectory() as tmp:
            whole = consolidate(checkpoint_path, Path(tmp) / "whole.ckpt")
            return super().load_from_checkpoint(whole, *args, **kwargs)

    def configure_model(self) -> None:
        # Lightning's hook for building or wrapping the model once per fit, before the first step.
        trainer = self.attached_trainer
        if trainer is not None and sharding.is_sharded(trainer.strategy) and not self._sharded:
            self._held = sharding.shard_components(
                self,
                self.components,
                self.device_mesh["data_parallel"],
                shard=self.fsdp["shard"],
                checkpoint=self.fsdp["checkpoint"],
                mp_policy=sharding.mixed_precision_policy(trainer),
                held_whole=self.held_whole(trainer),
            )
            self._sharded = True
        if self.compile_components:
            compile_in_place(self, self.components, self.not_compilable)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        # FSDP2 reduces the gradients of the parameters it shards; any other (a balancer's) is averaged here,
        # as DDP would have averaged it.
        if self._sharded:
            sharding.average_unsharded_gradients(optimizer, self.mean_over_ranks)

    def run_component_check(self, batch: Any) -> None:
        run_check(self, self.check_components, batch)
        self._components_checked = True

    def component_name(self, key: str) -> str:
        """The ``_target_`` of component ``key`` (or the class of one given as an object), for messages."""
        return name_of(self.hparams.get(key, getattr(self, key, key)))

    # --- the step's tools, in the order a step uses them ----------------------------------------------

    def prepare_batch(self, batch: Any) -> dict[str, Any]:
        """``batch`` as a dict (`multiloss.batches.as_dict`); on the first, the component check; on a training batch
        that writes a log row, the learning rates it trains at. Each recipe's steps start with it."""
        batch = as_dict(batch)
        if not self._components_checked:
            self.run_component_check(batch)
        if self.training and internals.writes_log_row(self.trainer):
            self.log_learning_rates()
        return batch

    def ends_optimizer_step(self, batch_idx: int) -> bool:
        """Whether training batch ``batch_idx`` ends an optimizer step: every ``accumulate_grad_batches``-th of its
        epoch, and the epoch's last (no gradient is carried into the next epoch), as Lightning decides."""
        return (batch_idx + 1) % self.accumulate_grad_batches == 0 or internals.epoch_ends(self.trainer)

    def gradient_sync(self, stepping: bool) -> Any:
        """A block whose backward DDP all-reduces only when ``stepping``: micro-batches that do not step skip it.
        Under FSDP2, the components held whole hand their gradients over at its end (`whole_step`)."""
        block = _SYNC_AS_USUAL if stepping else self.without_gradient_sync()
        if not self._held:
            return block
        stack = contextlib.ExitStack()
        stack.enter_context(block)
        stack.enter_context(self.whole_step(stepping))
        return stack

    def without_gradient_sync(self) -> Any:
        """A block whose backward no rank reduces (DDP's ``no_sync``, FSDP2's ``set_requires_gradient_sync(False)``):
        its gradients stay in ``.grad`` and the next synced backward reduces their sum."""
        return internals.no_gradient_sync(self.trainer.strategy)

    def whole_step(self, stepping: bool, *names: str) -> Any:
        """A block around the forward and backward(s) of components ``names`` (all held whole when none is named):
        under FSDP2, their gradients are handed over at its end and averaged into the shards when ``stepping``
        (`multiloss.sharding.LocalGradients`); nothing otherwise."""
        held = [self._held[n] for n in names if n in self._held] if names else list(self._held.values())
        if not held:
            return _SYNC_AS_USUAL
        stack = contextlib.ExitStack()
        for component in held:
            stack.enter_context(component.step(stepping))
        return stack

    def clip_gradients(
        self,
        optimizer: Any,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Lightning's ``clip_gradients`` at ``model.gradient_clip_val`` (nothing when unset), on the true gradients
        under 16-mixed (`multiloss.precision`)."""
        value = self.gradient_clip_val if gradient_clip_val is None else gradient_clip_val
        if value is None:
            return
        precision.unscale_for_clipping(self.trainer.precision_plugin, optimizer)
        super().clip_gradients(optimizer, value, gradient_clip_algorithm or self.gradient_clip_algorithm)

    def step_lr_schedule(self, optimizer: Any, stepped: bool, batch_done: bool = True) -> None:
        """``optimizer``'s schedule: a step after each of its steps (interval step), one after an epoch's last batch
        (interval epoch: once ``batch_done``, tbptt's last chunk); a ``validation`` schedule steps when a validation
        ends (`StepOnValidation`)."""
        configs = self.trainer.lr_scheduler_configs
        if not configs:
            return
        raw = getattr(optimizer, "optimizer", optimizer)
        for config in configs:
            interval = getattr(config.scheduler, "interval", config.interval)  # ours say; torch's: Lightning's
            if config.scheduler.optimizer is raw and (
                (stepped and interval == "step")
                or (interval == "epoch" and batch_done and internals.epoch_ends(self.trainer))
            ):
                config.scheduler.step()

    # --- the optimizer and its schedule -----------------------------------------------------------------

    def configure_optimizers(self) -> Any:
        if self.optimizer_factory is None:
            raise ConfigError(
                "model.optimizer",
                None,
                "an optimizer config (optimizer=adam|adamw|sgd), or a callable params -> Optimizer",
                "this module was built without one (fine for inference, not for training)",
            )
        return self.with_schedule(self.optimizer_factory(self.parameters()))

    def with_schedule(self, optimizer: Optimizer, key: str = "model.optimizer") -> Any:
        """``optimizer`` (config key ``key``) at the recipe's rate rule, with its ``model.scheduler`` schedule, as
        ``configure_optimizers`` returns them; its `RatePlan` kept for checkpoints and resumes
        (`multiloss.learning_rate`). Outside a Trainer the optimizer alone, at its configured rates."""
        trainer = self.attached_trainer
        if trainer is None:
            return optimizer
        plan = apply_rule(optimizer, key, *self.lr_rule(optimizer))
        schedule, plan.schedule = build_schedule(self.scheduler_spec, optimizer, trainer)
        self.rate_plans[key] = plan
        return optimizer if schedule is None else {"optimizer": optimizer, "lr_scheduler": schedule}

    def total_optimizer_steps(self) -> int:
        """How many optimizer steps the run takes (a schedule's ``total_steps``): Lightning's estimate."""
        return int(self.trainer.estimated_stepping_batches)

    # --- logging ---------------------------------------------------------------------------------------

    @property
    def eval_prefix(self) -> str:
        """The prefix of evaluation metrics: ``test`` under ``trainer.test`` (``multiloss-eval``), else ``val``."""
        trainer = self.attached_trainer
        return "test" if trainer is not None and trainer.testing else "val"

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

    def log_learning_rates(self) -> None:
        """The rate each param group trains this step at, on the log row, named as Lightning's LearningRateMonitor
        names it (``lr-SGD``, ``lr-Adam/generator``): the recipe owns the rate, so it logs it (no per-batch hook)."""
        optimizers = [getattr(o, "optimizer", o) for o in self.trainer.optimizers]
        if self._rate_names is None:
            self._rate_names = tuple(n for names in internals.learning_rate_names(optimizers) for n in names)
        rates = [group["lr"] for optimizer in optimizers for group in optimizer.param_groups]
        self.training_log.add(
            self._rate_names, torch.tensor(rates, dtype=torch.float64), self.trainer.global_step, watched=False
        )

    @property
    def step_index(self) -> int:
        """The step every output of a run names (`multiloss.training_log.TrainingLog`)."""
        if self.training_log.step_index is not None:
            return self.training_log.step_index
        return max(internals.batches_that_stepped(self.trainer) - 1, 0)

    def mean_over_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` averaged over the ranks (itself on one device): a collective, every rank calls it."""
        return self.trainer.strategy.reduce(tensor, reduce_op="mean")

    def sum_over_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over the ranks (itself on one device): a collective, every rank calls it."""
        return self.trainer.strategy.reduce(tensor, reduce_op="sum")
