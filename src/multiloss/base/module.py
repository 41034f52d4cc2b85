"""`Recipe`: the base of every recipe — the contract the library reads, the step options, the tools of a step.

A recipe is a training loop over components chosen by config (`multiloss.building.components`), run under
Lightning's manual optimization: its ``training_step`` is the whole step as a plain PyTorch loop
writes it — forward, the losses, the recipe's backward, clipping, the optimizer step, zeroing, the
learning-rate schedule — and the Trainer supplies the loop, devices, precision, DDP, logging and
checkpoints. The step options are declared once, as the parameters of `Recipe.__init__` (a recipe
passes its ``**step_options`` on; ``configs/recipe_common/default.yaml`` gives them to every recipe
under ``model.``): ``accumulate_grad_batches`` (k micro-batches per optimizer step), ``accumulation_mean``
(how a step averages its micro-batches and ranks: `multiloss.base.window`), ``gradient_clip_val`` /
``gradient_clip_algorithm``, ``scheduler`` and ``compile``. Lightning's
``trainer.accumulate_grad_batches`` / ``trainer.gradient_clip_val`` are refused with these keys named
(Lightning cannot apply them under manual optimization).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import lightning as L
import torch

from multiloss import lightning_internals as internals
from multiloss.base import precision
from multiloss.base.logging import RecipeLogging
from multiloss.base.optimizers import RecipeOptimizers
from multiloss.base.schedules import StepOnValidation
from multiloss.base.step import OptimizerStep, check_step_options, ends_optimizer_step, refuse_lightning_step_options
from multiloss.base.training_log import TrainingLogWriter
from multiloss.base.window import Counts, Window, example_counts, window_of
from multiloss.building.checks import run_check
from multiloss.building.components import compile_in_place, name_of, to_plain
from multiloss.config import require
from multiloss.data.batches import as_dict, probe_batch
from multiloss.parallel import sharding
from multiloss.parallel.parallelism import Parallelism, parallelism_of
from multiloss.saving.saved_state import STEP_KEY


class Recipe(RecipeOptimizers, RecipeLogging):
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
        gradients, a gradient penalty): under FSDP2 held whole for their step
        (`multiloss.parallel.sharding.LocalGradients`)."""
        return ()

    def not_compilable(self, name: str) -> str:
        """Why component ``name`` must stay eager under ``compile=true`` ('' if it can be compiled)."""
        return ""

    # --- the step options: declared here once, checked, kept ------------------------------------------

    def __init__(
        self,
        accumulate_grad_batches: int = 1,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: Literal["norm", "value"] = "norm",
        clean_gradients: bool = False,
        scheduler: Any = None,
        compile: bool = False,
        fsdp: dict[str, Any] | None = None,
        accumulation_mean: Literal["examples", "micro_batches"] = "examples",
    ) -> None:
        super().__init__()
        check_step_options(accumulate_grad_batches, gradient_clip_val, gradient_clip_algorithm, accumulation_mean)
        self.automatic_optimization = False  # each step is the recipe's own training_step, visible end to end
        self.accumulate_grad_batches = accumulate_grad_batches
        self.accumulation_mean = accumulation_mean  # how a step averages its micro-batches and ranks (base.window)
        self._counts: Counts | bool | None = False  # the loader's example counts, looked up at the first step
        self._said_uncounted = False  # a loader without counts under accumulation_mean=examples: said once
        self.gradient_clip_val, self.gradient_clip_algorithm = gradient_clip_val, gradient_clip_algorithm
        require(isinstance(clean_gradients, bool), "clean_gradients", clean_gradients, "true or false")
        self.clean_gradients = clean_gradients
        self.scheduler_spec = to_plain(scheduler)  # (the optimizer and its schedule: `RecipeOptimizers`)
        self.compile_components = bool(compile)
        self.fsdp = sharding.fsdp_options(fsdp)  # model.fsdp: shard, checkpoint (activation recomputation)
        self._components_checked = False
        self._parallelism: Parallelism | None = None  # the running Trainer's, from setup to teardown

    def __setattr__(self, name: str, value: Any) -> None:
        # Lightning sets _current_fx_name around every hook it calls, ~45 times per training step;
        # nn.Module.__setattr__ spends ~5 µs on each checking for parameters, buffers and modules,
        # which a str (or None) never is: a quarter of Lightning's own per-step cost on a small model.
        if name == internals.HOOK_NAME:
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
            refuse_lightning_step_options(trainer)  # the step options are the recipe's keys
        return [TrainingLogWriter(self.training_log), StepOnValidation(), *self.output_callbacks()]

    def check_sharding(self, trainer: L.Trainer) -> None:
        """Refuse what sharded training (FSDP2) cannot do with this recipe's settings (`multiloss.train` asks before
        any process starts)."""
        sharding.check_policy(self, self.components, self.fsdp["shard"], recompute=self.fsdp["checkpoint"])

    def setup(self, stage: str) -> None:
        self._parallelism = parallelism_of(self.trainer)  # looked up once a run, read by every step
        if stage == "fit" and self.accumulates_batches:
            # Lightning's loop then counts optimizer steps as this recipe takes them: its logging step,
            # its log rows and estimated_stepping_batches (Lightning's own GradientAccumulationScheduler
            # sets it at run time the same way). check_trainer has just seen it is 1.
            self.trainer.accumulate_grad_batches = self.accumulate_grad_batches
        precision.install(self.trainer.precision_plugin)  # 16-mixed: clipping on the true gradients
        if not self._components_checked and (batch := probe_batch(self.trainer)) is not None:
            self.run_component_check(batch)  # before any step or write; else the first batch met (on_*_batch_start)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """What the step's options cannot say from the config alone (a subclass that saves more calls this too)."""
        checkpoint[STEP_KEY] = {"accumulation_mean": self.accumulation_mean}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """An earlier version's checkpoint (no `STEP_KEY`) continues with the step it trained with: each micro-batch's
        mean / k (``model.accumulation_mean=micro_batches``) unless its ``count_exact`` was on. Said once."""
        if STEP_KEY in checkpoint or self.accumulation_mean != "examples":
            return
        hyper_parameters = checkpoint.get("hyper_parameters") or {}
        mean = "examples" if hyper_parameters.get("count_exact") else "micro_batches"
        if mean != self.accumulation_mean:
            from lightning.pytorch.utilities import rank_zero_info

            rank_zero_info(
                "multiloss: the checkpoint is an earlier version's, whose step weighed each micro-batch 1/k: it "
                "continues so (model.accumulation_mean=micro_batches)"
            )
            self.accumulation_mean = mean

    def teardown(self, stage: str) -> None:
        self._parallelism = None
        self._counts = False  # another fit, another loader
        if stage == "fit" and self.attached_trainer is not None:
            self.trainer.accumulate_grad_batches = 1  # a Trainer fitted again passes check_trainer again

    @classmethod
    def load_from_checkpoint(  # type: ignore[override]
        cls, checkpoint_path: Any, *args: Any, trust_checkpoint: bool | list[str] = False, **kwargs: Any
    ) -> Any:
        """Lightning's, and a sharded run's checkpoint directory too (read whole first).

        The checkpoint is data: every ``_target_`` its hyper-parameters name must be one the shipped configs use,
        or one ``trust_checkpoint`` allows (a list of your packages, ``["mypkg"]``; ``True``: all, for a checkpoint
        you would run as code); Lightning's own ``_instantiator`` / ``_class_path`` are refused whatever is trusted
        (`multiloss.saving.trust`). A `ConfigError` names the key and the target, before anything is imported.
        """
        from multiloss.saving.checkpoints import whole_checkpoint_file
        from multiloss.saving.trust import check_hyper_parameters

        with whole_checkpoint_file(checkpoint_path) as path:
            # One read: refused names, and those an earlier layout wrote (multiloss.config.renamed) at their current
            # places, given as the arguments they are over the checkpoint's own (a keyword the caller passes wins).
            renamed = check_hyper_parameters(path, trust_checkpoint, f"the checkpoint {checkpoint_path}")
            return super().load_from_checkpoint(path, *args, **{**renamed, **kwargs})

    @property
    def parallelism(self) -> Parallelism:
        """How the ranks share the work (one device, DDP, FSDP2): the one answer to "sharded?"."""
        return self._parallelism if self._parallelism is not None else parallelism_of(self.attached_trainer)

    def configure_model(self) -> None:
        # Lightning's hook for building or wrapping the model once per fit, before the first step.
        self.parallelism.prepare(self)
        if self.compile_components:
            compile_in_place(self, self.components, self.not_compilable)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.parallelism.before_optimizer_step(optimizer, self.mean_over_ranks)

    def run_component_check(self, batch: Any) -> None:
        run_check(self, self.check_components, batch)
        self._components_checked = True

    def _check_components_once(self, batch: Any) -> None:
        if not self._components_checked:
            self.run_component_check(batch)

    def component_name(self, key: str) -> str:
        """The ``_target_`` of component ``key`` (or the class of one given as an object), for messages."""
        return name_of(self.hparams.get(key, getattr(self, key, key)))

    # --- the step's tools, in the order a step uses them ----------------------------------------------

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if not self._components_checked:
            self.run_component_check(batch)
        if internals.writes_log_row(self.trainer):  # the rates this batch trains at, on its log row
            self.log_learning_rates()

    def on_validation_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._check_components_once(batch)  # (a run without a probe batch at setup: the first batch it meets)

    def on_test_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._check_components_once(batch)

    def prepare_batch(self, batch: Any) -> dict[str, Any]:
        """``batch`` as a dict (``(x, y)`` tuples too: `multiloss.data.batches.as_dict`); every step starts with it."""
        return as_dict(batch)

    def step_of(
        self,
        optimizer: Any,
        batch_idx: int | None = None,
        *,
        stepping: bool | None = None,
        components: tuple[str, ...] | None = None,
        toggle: bool = False,
        batch_done: bool = True,
        counted: bool = True,
    ) -> OptimizerStep:
        """``with self.step_of(opt, batch_idx) as step: ... step.backward(loss)``: this micro-batch of ``optimizer``'s
        step, which steps on every ``accumulate_grad_batches``-th training batch and an epoch's last (``stepping``: the
        recipe decides, tbptt's chunks); the sync, the division by k, clipping, the step, zeroing and the schedule are
        the block's (`multiloss.base.step.OptimizerStep`)."""
        if stepping is None:
            stepping = ends_optimizer_step(self, batch_idx)
        return OptimizerStep(
            self,
            optimizer,
            stepping,
            components=components,
            toggle=toggle,
            batch_done=batch_done,
            counted=counted,
            window=self.window(batch_idx) if batch_idx is not None and counted else None,
        )

    def window(self, batch_idx: int) -> tuple[Window, int] | None:
        """The optimizer step training batch ``batch_idx`` belongs to (its micro-batches' examples, on this rank and on
        every rank) and the batch's place in it, under ``model.accumulation_mean=examples``; None where a step weighs
        its micro-batches 1/k each (``micro_batches``, or a loader that does not say how many examples its batches
        hold: said once; `multiloss.base.window`)."""
        if self.accumulation_mean != "examples" or self.attached_trainer is None:
            return None
        counts = self.example_counts()
        if counts is None:
            if not self._said_uncounted and (self.accumulate_grad_batches > 1 or self.trainer.world_size > 1):
                from lightning.pytorch.utilities import rank_zero_warn

                loader = type(getattr(self.trainer, "train_dataloader", None)).__name__
                rank_zero_warn(
                    f"model.accumulation_mean=examples: the training loader ({loader}) does not say how many examples "
                    "its batches hold (no sampler with a length and a batch_size), so each micro-batch of a step "
                    "weighs 1/k and each rank 1/world size (model.accumulation_mean=micro_batches)"
                )
            self._said_uncounted = True
            return None
        return window_of(self.trainer, batch_idx, self.accumulate_grad_batches, counts)

    def example_counts(self) -> Counts | None:
        """The training loader's examples a batch, on this rank and on every rank (`multiloss.base.window`), looked up
        once a fit; None if it does not say."""
        if self._counts is False:
            self._counts = example_counts(self.trainer) if self.attached_trainer is not None else None
        return self._counts  # type: ignore[return-value]

    def step_examples(self, batch_idx: int, rows: int) -> list[tuple[int, int]]:
        """The micro-batches of training batch ``batch_idx``'s optimizer step: each one's examples on this rank and on
        every rank, as the loader says them (``rows`` a micro-batch, alike on every rank, k of them, where it does
        not: `example_counts`)."""
        counts = self.example_counts()
        if counts is None:
            return [(rows, rows * self.trainer.world_size)] * self.accumulate_grad_batches
        window, _ = window_of(self.trainer, batch_idx, self.accumulate_grad_batches, counts)
        return list(window.counts)

    def cleaned_gradients(self, optimizer: Any) -> None:
        """``model.clean_gradients``: stylegan2-ada's clean-up before every step (NVlabs/stylegan2-ada-pytorch
        ``training/training_loop.py`` 289-291: ``nan_to_num(grad, nan=0, posinf=1e5, neginf=-1e5)`` in place) — NaN
        to 0, ±inf to ±1e5, finite values kept (``misc.nan_to_num`` is ``torch.nan_to_num`` on torch ≥ 1.8; its
        fallback for older torch, ``torch_utils/misc.py`` 49-56, also clamps finite values) — on the true gradients
        under 16-mixed (unscaled first; the GradScaler
        has already seen an inf there and skips that step as it would). Off: a non-finite gradient reaches the step,
        and the non-finite guard (``nonfinite``) judges the loss."""
        if not self.clean_gradients:
            return
        precision.unscale_for_clipping(self.trainer.precision_plugin, optimizer)
        for group in getattr(optimizer, "optimizer", optimizer).param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    torch.nan_to_num(param.grad, nan=0, posinf=1e5, neginf=-1e5, out=param.grad)

    def clip_gradients(
        self,
        optimizer: Any,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Lightning's ``clip_gradients`` at ``model.gradient_clip_val`` (nothing when unset), on the true gradients
        under 16-mixed (`multiloss.base.precision`)."""
        value = self.gradient_clip_val if gradient_clip_val is None else gradient_clip_val
        if value is None:
            return
        precision.unscale_for_clipping(self.trainer.precision_plugin, optimizer)
        super().clip_gradients(optimizer, value, gradient_clip_algorithm or self.gradient_clip_algorithm)

    def test_step(self, batch: Any, batch_idx: int) -> Any:
        return self.validation_step(batch, batch_idx)

    def on_test_epoch_start(self) -> None:
        self.on_validation_epoch_start()

    def on_test_epoch_end(self) -> None:
        self.on_validation_epoch_end()
