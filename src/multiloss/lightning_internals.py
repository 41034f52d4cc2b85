"""Every use of a Lightning (or torch) name that is not public API, behind one door, read from a stated version.

Read from Lightning 2.6 (``lightning/pytorch/...``, ``lightning/fabric/...``) and torch 2.13. The rest of
multiloss calls the functions here; no other module names a private Lightning attribute (a test reads
the source for one). `check_internals` lists what an installed Lightning no longer has, and the test
suite fails with those names, instead of a recipe failing mid-run after an upgrade.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import re
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import lightning as L
import torch
from lightning.fabric.strategies.launchers import subprocess_script as fabric_subprocess_script
from lightning.fabric.utilities import distributed as fabric_distributed
from lightning.fabric.utilities import seed as fabric_seed
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loops import utilities as loop_utilities
from lightning.pytorch.loops.fit_loop import _FitLoop
from lightning.pytorch.loops.loop import _Loop
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers import subprocess_script

# --- the loop ------------------------------------------------------------------------------------------


class _ResumableFitLoop(_FitLoop):
    """Lightning's fit loop, restarted from a checkpoint taken at an epoch's end the same way whatever bounds the run.

    ``_FitLoop.restarting`` (``loops/fit_loop.py``) is forced on for every run with ``max_steps`` set
    (``_iteration_based_training``), even when the checkpoint's epoch had finished: the restart then
    replays that epoch's end and counts it twice (a resumed run one epoch ahead of the straight run:
    another data order, and ``max_epochs`` reached with nothing trained). Here a finished epoch is not a
    restart whatever the bounds, as it already is without ``max_steps``.
    """

    @_Loop.restarting.setter  # type: ignore[attr-defined]
    def restarting(self, restarting: bool) -> None:
        current = self.epoch_progress.current
        epoch_unfinished = current.ready != current.processed or current.started != current.processed
        _Loop.restarting.fset(self, restarting and epoch_unfinished)


def resume_epoch_ends_exactly(trainer: L.Trainer) -> None:
    """Make ``trainer``'s fit loop restart from an epoch-end checkpoint into the next epoch (`_ResumableFitLoop`)."""
    if type(trainer.fit_loop) is _FitLoop:
        trainer.fit_loop.__class__ = _ResumableFitLoop  # same state, one property changed: no copy of the loop


def continue_epoch_at(trainer: L.Trainer, batches: int) -> None:
    """Count ``batches`` of the restored epoch as trained (``_TrainingEpochLoop.batch_progress.current``: its batch
    index, its last batch, its validation checks), the offsets between its counters (a save in
    ``on_train_batch_end`` has one batch processed and not completed) kept. Called while the fit loop loads its
    loader's state, before the epoch loop resets from these counters."""
    current = trainer.fit_loop.epoch_loop.batch_progress.current
    shift = batches - current.processed
    current.ready, current.started = current.ready + shift, current.started + shift
    current.processed, current.completed = current.processed + shift, current.completed + shift


def validation_follows(trainer: L.Trainer) -> bool:
    """Whether Lightning validates right after the training batch whose ``on_train_batch_end`` is running
    (``_TrainingEpochLoop._should_check_val_fx``, the test its ``on_advance_end`` runs after the batch's hooks)."""
    loop = trainer.fit_loop.epoch_loop
    return not loop._skip_next_val and loop._should_check_val_fx(trainer.fit_loop._data_fetcher)


def epoch_ends(trainer: L.Trainer) -> bool:
    """Whether the training batch being trained is its epoch's last (``_num_ready_batches_reached``)."""
    return trainer.fit_loop.epoch_loop._num_ready_batches_reached()


def batches_that_stepped(trainer: L.Trainer) -> int:
    """Lightning's logging step: training batches that ended an optimizer step so far (``_batches_that_stepped``)."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def writes_log_row(trainer: L.Trainer) -> bool:
    """Whether this training batch writes a log row (``_LoggerConnector.should_update_logs``; under accumulation,
    every micro-batch of the row's step)."""
    return trainer._logger_connector.should_update_logs


def ends_accumulation(trainer: L.Trainer) -> bool:
    """Whether this batch ends the optimizer step Lightning counts (``not _FitLoop._should_accumulate()``)."""
    return not trainer.fit_loop._should_accumulate()


@contextlib.contextmanager
def no_gradient_sync(strategy: Any) -> Iterator[None]:
    """A block whose backward DDP does not all-reduce (``loops.utilities._block_parallel_sync_behavior``)."""
    with loop_utilities._block_parallel_sync_behavior(strategy, block=True):
        yield


def attached_trainer(module: L.LightningModule) -> L.Trainer | None:
    """The Trainer ``module`` is attached to, or None (``LightningModule._trainer``; ``.trainer`` raises instead)."""
    return module._trainer


# --- callbacks: the checkpoint, the learning-rate names ------------------------------------------------


def saved_this_step(callback: ModelCheckpoint, trainer: L.Trainer) -> bool:
    """Whether ``callback`` has nothing to save now: this step saved already, or a sanity check, a fast dev run
    (``ModelCheckpoint._should_skip_saving_checkpoint``)."""
    return callback._should_skip_saving_checkpoint(trainer)


def save_last(callback: ModelCheckpoint, trainer: L.Trainer) -> None:
    """``callback``'s ``last.ckpt`` of this step (``_save_last_checkpoint`` with ``_monitor_candidates``)."""
    callback._save_last_checkpoint(trainer, callback._monitor_candidates(trainer))


def saves_periodically(callback: ModelCheckpoint) -> bool:
    """Whether ``callback`` saves every n training steps or every time interval (its batch-end saves)."""
    return bool(callback._every_n_train_steps) or callback._train_time_interval is not None


def last_saved(callback: ModelCheckpoint) -> str:
    """The newest file ``callback`` saved ('' if none): ``last_model_path``, else ``_last_checkpoint_saved``."""
    return callback.last_model_path or getattr(callback, "_last_checkpoint_saved", "")


def learning_rate_names(optimizers: list[Any]) -> list[list[str]]:
    """Each optimizer's param groups' column names as Lightning's `LearningRateMonitor` writes them
    (``lr-Adam``, ``lr-Adam/generator``, ``lr-Adam-1/discriminator``: ``_find_names_from_optimizers``)."""
    names, _ = LearningRateMonitor()._find_names_from_optimizers(optimizers, [], defaultdict(int))
    return names


# --- random streams, process groups, launchers ---------------------------------------------------------


def rng_states() -> dict[str, Any]:
    """torch's, numpy's, python's (and CUDA's) random states (``fabric.utilities.seed._collect_rng_states``)."""
    return fabric_seed._collect_rng_states(include_cuda=True)


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore what `rng_states` returned (``_set_rng_states``)."""
    fabric_seed._set_rng_states(states)


def destroy_process_group() -> None:
    """End this process's default process group, if it has one (``_destroy_dist_connection``).

    A garbage collection on each side: FSDP2's states and DDP's reducers hold the group in reference cycles, and a
    gloo group whose last reference goes only at the interpreter's exit joins worker threads that still hold tensors
    (torch's own abandoned fix, pytorch/pytorch#179291): ``terminate called without an active exception``, SIGABRT.
    The first frees the cycles before the group is ended, the second what held the group besides its registry. A
    process without a group (one device) skips both: a full collection of torch's heap is a second of CPU.
    """
    import gc

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    gc.collect()
    fabric_distributed._destroy_dist_connection()
    gc.collect()


def process_group_store() -> Any:
    """The key-value store of the default process group (None without one): ``distributed_c10d._get_default_store``
    (torch 2.13), the store every rank of the job reaches without a collective."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.distributed_c10d._get_default_store()


def ddp_settings(strategy: DDPStrategy) -> dict[str, Any]:
    """The arguments a Lightning `DDPStrategy` was built with (it keeps them private): start method, backend,
    timeout and DDP's own keyword arguments."""
    return {
        "start_method": strategy._start_method,
        "process_group_backend": strategy._process_group_backend,
        "timeout": strategy._timeout,
        **strategy._ddp_kwargs,
    }


def process_group_timeout(strategy: Any) -> Any:
    """The timeout a `DDPStrategy` or `ModelParallelStrategy` starts its process group with (``_timeout``)."""
    return strategy._timeout


def set_process_group_timeout(strategy: Any, timeout: Any) -> None:
    """Start ``strategy``'s process group with ``timeout`` (a `timedelta`): how long a collective waits for the other
    ranks (``_timeout``); nothing for a strategy without a process group."""
    if hasattr(strategy, "_timeout"):
        strategy._timeout = timeout


def process_group_backend(strategy: Any) -> str:
    """The backend ``strategy`` initialises its process group with (``_get_process_group_backend``)."""
    return strategy._get_process_group_backend()


def wrap_in_ddp(strategy: DDPStrategy, module: torch.nn.Module) -> torch.nn.Module:
    """``module`` in a DistributedDataParallel wrapper built as ``strategy`` builds its own (``_setup_model``),
    with the strategy's communication hook, if it has one."""
    wrapper = strategy._setup_model(module)
    if strategy._ddp_comm_hook is not None:
        wrapper.register_comm_hook(state=strategy._ddp_comm_state, hook=strategy._ddp_comm_hook)
    return wrapper


class ScriptLauncher(subprocess_script._SubprocessScriptLauncher):
    """Lightning's launcher of ranks > 0 as scripts, starting each with ``command(local_rank) -> (args, cwd)``.

    Lightning builds the child command in a module-level function (``_hydra_subprocess_cmd``); swapping it
    for the launch keeps all of Lightning's environment handling (MASTER_ADDR, LOCAL_RANK, ...).
    """

    command: Callable[[int], tuple[Any, str]]

    def _call_children_scripts(self) -> None:
        self.before_launch()
        original = subprocess_script._hydra_subprocess_cmd
        subprocess_script._hydra_subprocess_cmd = type(self).command
        try:
            super()._call_children_scripts()
        finally:
            subprocess_script._hydra_subprocess_cmd = original

    def before_launch(self) -> None:
        """Called in the launching process right before the children start."""

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        # Lightning's observer of the children (``_launch_process_observer``) SIGKILLs this process within 5 s of a
        # child's failure, even while this process is reporting the same error or ending by itself: the run's
        # message lost, exit -9. Its patient form gives this process a grace period first.
        original = subprocess_script._launch_process_observer
        subprocess_script._launch_process_observer = _launch_patient_observer
        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        finally:
            subprocess_script._launch_process_observer = original


class _PatientObserver(fabric_subprocess_script._ChildProcessObserver):
    """Lightning's observer, which after a child failed waits `GRACE_S` before killing this process and the other
    children: a process that ends by itself in that time (it reports the error every rank met, or the stall it
    detected) ends as it chose, its thread (a daemon) with it; one stuck in a collective is still killed."""

    GRACE_S = 15.0

    def _terminate_all(self) -> None:
        time.sleep(self.GRACE_S)
        super()._terminate_all()


def _launch_patient_observer(child_processes: list[Any]) -> None:
    _PatientObserver(child_processes=child_processes, main_pid=os.getpid()).start()


def watch_children(child_processes: list[Any]) -> None:
    """Watch ranks this process did not start through Lightning's launcher as Lightning watches those it starts
    (``_launch_process_observer``, the patient form): a rank that fails ends the job."""
    _launch_patient_observer(child_processes)


def use_launcher(strategy: DDPStrategy, launcher_class: type[ScriptLauncher]) -> None:
    """Give ``strategy`` a ``launcher_class`` where Lightning gave it its stock script launcher."""
    if type(strategy._launcher) is subprocess_script._SubprocessScriptLauncher:
        strategy._launcher = launcher_class(strategy.cluster_environment, strategy.num_processes, strategy.num_nodes)


def set_threads_per_rank(num_processes: int) -> None:
    """Give this rank the CPU threads Lightning's launchers give each of ``num_processes`` ranks (cores / ranks,
    unless OMP_NUM_THREADS is set: ``_set_num_threads_if_needed``)."""
    fabric_distributed._set_num_threads_if_needed(num_processes=num_processes)


def saves_distributed_checkpoint(strategy: Any) -> bool:
    """Whether a `ModelParallelStrategy` writes a directory of shards (``save_distributed_checkpoint=True``,
    ``_save_distributed_checkpoint``) rather than one gathered file."""
    return bool(strategy._save_distributed_checkpoint)


def use_data_parallel_world(strategy: Any) -> None:
    """Make a `ModelParallelStrategy` shard over every rank, no tensor parallelism (its ``"auto"`` sizes are the
    nodes and the devices of one node: ``_data_parallel_size``, ``_tensor_parallel_size``)."""
    if strategy._data_parallel_size == "auto":
        strategy._data_parallel_size = strategy.num_nodes * strategy.num_processes
    if strategy._tensor_parallel_size == "auto":
        strategy._tensor_parallel_size = 1


# --- torch's GradScaler (16-mixed) ------------------------------------------------------------------------


def grad_scaler_settings(scaler: Any) -> tuple[dict[str, Any], bool]:
    """The arguments ``scaler`` (a ``torch.amp.GradScaler``) was built with, and whether it has a scale yet."""
    settings = {
        "device": scaler._device,
        "init_scale": scaler._init_scale,
        "growth_factor": scaler._growth_factor,
        "backoff_factor": scaler._backoff_factor,
        "growth_interval": scaler._growth_interval,
        "enabled": scaler._enabled,
    }
    return settings, scaler._scale is not None


def unscaled_since_update(scaler: Any, optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``scaler`` unscaled ``optimizer``'s gradients since its last ``update`` (``_per_optimizer_states``)."""
    from torch.amp.grad_scaler import OptState

    return scaler._enabled and scaler._per_optimizer_states[id(optimizer)]["stage"] is OptState.UNSCALED


# --- torch: compiled modules, fused norms, a scheduler's progress ----------------------------------------

# The attribute Lightning sets around every hook it calls (``LightningModule._current_fx_name``).
HOOK_NAME = "_current_fx_name"
# The entries of a torch scheduler's ``state_dict`` that are its progress (every other entry is its configuration),
# and the one that holds the rates it last set.
SCHEDULER_LAST_RATES = "_last_lr"
SCHEDULER_PROGRESS = frozenset(
    {
        "last_epoch",
        "_step_count",
        SCHEDULER_LAST_RATES,
        "base_lrs",
        "best",
        "num_bad_epochs",
        "cooldown_counter",
        "_is_initial",
        "_get_lr_called_within_step",
        "lr_lambdas",
    }
)


def is_compiled(module: torch.nn.Module) -> bool:
    """Whether ``module.compile()`` has compiled ``module`` in place (``nn.Module._compiled_call_impl``)."""
    return module._compiled_call_impl is not None


def foreach_norm(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's 2-norm in one fused kernel (``torch._foreach_norm``: what ``clip_grad_norm_`` itself uses)."""
    return torch._foreach_norm(tensors)


# --- the check ------------------------------------------------------------------------------------------

# What this module reads, as "module:Owner.name" ("Owner()" when the class's methods assign it to instances).
READS = (
    "lightning.pytorch.loops.fit_loop:_FitLoop._iteration_based_training",
    "lightning.pytorch.loops.fit_loop:_FitLoop._should_accumulate",
    "lightning.pytorch.loops.fit_loop:_FitLoop()._data_fetcher",
    "lightning.pytorch.loops.training_epoch_loop:_TrainingEpochLoop._should_check_val_fx",
    "lightning.pytorch.loops.training_epoch_loop:_TrainingEpochLoop._num_ready_batches_reached",
    "lightning.pytorch.loops.training_epoch_loop:_TrainingEpochLoop()._skip_next_val",
    "lightning.pytorch.loops.training_epoch_loop:_TrainingEpochLoop()._batches_that_stepped",
    "lightning.pytorch.loops.training_epoch_loop:_TrainingEpochLoop().batch_progress",
    "lightning.pytorch.trainer.connectors.logger_connector.logger_connector:_LoggerConnector.should_update_logs",
    "lightning.pytorch.trainer.trainer:Trainer()._logger_connector",
    "lightning.pytorch.loops.utilities:_block_parallel_sync_behavior",
    "lightning.pytorch.core.module:LightningModule()._trainer",
    "lightning.pytorch.callbacks.model_checkpoint:ModelCheckpoint._should_skip_saving_checkpoint",
    "lightning.pytorch.callbacks.model_checkpoint:ModelCheckpoint._save_last_checkpoint",
    "lightning.pytorch.callbacks.model_checkpoint:ModelCheckpoint._monitor_candidates",
    "lightning.pytorch.callbacks.model_checkpoint:ModelCheckpoint()._every_n_train_steps",
    "lightning.pytorch.callbacks.model_checkpoint:ModelCheckpoint()._train_time_interval",
    "lightning.pytorch.callbacks.lr_monitor:LearningRateMonitor._find_names_from_optimizers",
    "lightning.fabric.utilities.seed:_collect_rng_states",
    "lightning.fabric.utilities.seed:_set_rng_states",
    "lightning.fabric.utilities.distributed:_destroy_dist_connection",
    "lightning.fabric.utilities.distributed:_set_num_threads_if_needed",
    "lightning.pytorch.strategies.ddp:DDPStrategy()._start_method",
    "lightning.pytorch.strategies.ddp:DDPStrategy()._process_group_backend",
    "lightning.pytorch.strategies.ddp:DDPStrategy()._timeout",
    "lightning.pytorch.strategies.model_parallel:ModelParallelStrategy()._timeout",
    "lightning.pytorch.strategies.ddp:DDPStrategy()._ddp_kwargs",
    "lightning.pytorch.strategies.ddp:DDPStrategy()._ddp_comm_hook",
    "lightning.pytorch.strategies.ddp:DDPStrategy()._ddp_comm_state",
    "lightning.pytorch.strategies.ddp:DDPStrategy._setup_model",
    "lightning.pytorch.strategies.ddp:DDPStrategy._get_process_group_backend",
    "lightning.pytorch.strategies.strategy:Strategy()._launcher",
    "lightning.pytorch.strategies.model_parallel:ModelParallelStrategy()._data_parallel_size",
    "lightning.pytorch.strategies.model_parallel:ModelParallelStrategy()._save_distributed_checkpoint",
    "lightning.pytorch.strategies.model_parallel:ModelParallelStrategy()._tensor_parallel_size",
    "lightning.pytorch.strategies.launchers.subprocess_script:_SubprocessScriptLauncher._call_children_scripts",
    "lightning.pytorch.strategies.launchers.subprocess_script:_hydra_subprocess_cmd",
    "lightning.pytorch.strategies.launchers.subprocess_script:_launch_process_observer",
    "lightning.fabric.strategies.launchers.subprocess_script:_ChildProcessObserver._terminate_all",
    "torch.distributed.distributed_c10d:_get_default_store",
    "torch.amp.grad_scaler:GradScaler()._per_optimizer_states",
    "torch.amp.grad_scaler:GradScaler()._init_scale",
    "torch.amp.grad_scaler:GradScaler()._growth_interval",
    "torch.amp.grad_scaler:OptState",
    "torch:_foreach_norm",
    "torch.nn.modules.module:Module()._compiled_call_impl",
    "torch.optim.lr_scheduler:LRScheduler()._step_count",
    "torch.optim.lr_scheduler:LRScheduler()._last_lr",
    "lightning.pytorch.core.module:LightningModule()._current_fx_name",
)


def check_internals() -> list[str]:
    """The names in `READS` that this Lightning (or torch) no longer has (empty: all there)."""
    return [read for read in READS if not _exists(read)]


def _exists(read: str) -> bool:
    module_name, path = read.split(":")
    try:
        owner: Any = importlib.import_module(module_name)
    except ImportError:
        return False
    *owners, name = path.split(".")
    for part in owners:
        assigned_in_init = part.endswith("()")
        owner = getattr(owner, part.removesuffix("()"), None)
        if owner is None:
            return False
        if assigned_in_init:
            return name in _instance_names(owner)
    return hasattr(owner, name)


def _instance_names(cls: type) -> set[str]:
    """The attribute names the methods of ``cls`` or a base assign (``self.<name> =``), read from their source."""
    names: set[str] = set()
    for klass in inspect.getmro(cls):
        with contextlib.suppress(TypeError, OSError):
            names |= set(re.findall(r"self\.(\w+)\s*[:=]", inspect.getsource(klass)))
    return names
