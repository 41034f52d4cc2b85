"""`train(cfg)`: one training run from a composed config, checked before anything is written — and everything a run
is built from (`build_data_and_model`, `build_trainer`, `run_callbacks`).

`multiloss.train` and `multiloss.evaluate` both build through here, and so does `multiloss.testing`: what a proof
builds is what ``python train.py`` trains. A component's own rejection while being built becomes a `ConfigError`
under its dotted key.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import lightning as L
import torch
from hydra.errors import InstantiationException
from hydra.utils import get_object, instantiate
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.plugins.precision import DoublePrecision
from omegaconf import DictConfig, OmegaConf, open_dict

from multiloss import lightning_internals as internals
from multiloss.base.module import Recipe
from multiloss.callbacks.run_record import RunRecord
from multiloss.config import ConfigError, check_config, require
from multiloss.config.errors import error_from_lightning
from multiloss.config.parallel import is_sharded
from multiloss.config.renamed import rename_targets
from multiloss.parallel.parallelism import engine, parallelism_of
from multiloss.parallel.stalls import explain_stall, is_stall, last_checkpoint
from multiloss.pitfalls import explain
from multiloss.saving.checkpoints import (
    AtomicCheckpointIO,
    refuse_a_bound_already_reached,
    verify_checkpoint,
    verify_position,
)
from multiloss.saving.run_dir import checkpoint_to_resume, claimed, launch_rank_zero
from multiloss.saving.saved_state import BATCHES_KEY


def build_trainer(
    cfg: DictConfig, purpose: Literal["train", "evaluate"] = "train", recipe: L.LightningModule | None = None
) -> L.Trainer:
    """The Trainer of ``cfg.trainer`` with its loggers and every callback of a run (`run_callbacks`); ``recipe``:
    the module it will train, checked against the engine (what FSDP2 cannot do in its step)."""
    loggers = [_build(f"logger.{k}", v) for k, v in (cfg.get("logger") or {}).items() if v]
    callbacks = run_callbacks(cfg, purpose, has_loggers=bool(loggers))
    # Checkpoints written atomically, failures loud, loads weights_only (multiloss.saving.checkpoints).
    plugins: dict[str, Any] = {} if cfg.trainer.get("plugins") else {"plugins": [AtomicCheckpointIO()]}
    if is_sharded(cfg.trainer) and str(cfg.trainer.get("precision")) in ("64-true", "64") and plugins:
        # Lightning's ModelParallelStrategy takes 32-true, bf16 and 16-true as a precision flag, not 64-true; FSDP2
        # trains in float64 all the same (the proofs of FSDP2 = DDP run in it): its DoublePrecision as a plugin.
        plugins = {"precision": None, "plugins": [*plugins["plugins"], DoublePrecision()]}
    # One device, DDP or FSDP2, decided here once (multiloss.parallel.parallelism.engine): whatever ends in Lightning's
    # DDP runs as multiloss's DDPStrategy (Hydra-job children, one wrapper per network), FSDP2 as its FSDPStrategy.
    trainer = engine(
        cfg,
        lambda **strategy: _build(
            "trainer", cfg.trainer, callbacks=callbacks, logger=loggers or False, **plugins, **strategy
        ),
        cuda_available=torch.cuda.is_available(),
        recipe=recipe,
    )
    internals.resume_epoch_ends_exactly(trainer)  # trainer.max_steps set or not
    return trainer


def run_callbacks(cfg: DictConfig, purpose: Literal["train", "evaluate"], has_loggers: bool = True) -> list[L.Callback]:
    """Every callback a run adds to the Trainer, decided here; the recipe's own outputs and loggers of its rows come
    from the recipe (`multiloss.base.module.Recipe.configure_callbacks`, Lightning's way for a module to carry them).

    First the epoch values' reduction on every rank (`EpochMetricsOnEveryRank`: no rank-zero-only reader may
    issue a collective), then the config's ``callbacks`` group, then what multiloss always adds to a training:
    RngState (exact resume is part of the contract of ``ckpt_path=``), RunRecord (the run's config copies and lock, once
    fit() has checked the components on a batch of the data), the non-finite guard (nothing NaN trains
    on silently or reaches a checkpoint), the graph-leak detector (a graph kept from step to step, over
    the first batches), Preemption (SIGTERM or Ctrl-C saves the step reached and stops the run with a
    non-zero exit), ReportOnce (an error every rank meets is printed once) and the resume rule (the
    config's optimizer settings apply to a resumed run; another optimizer is refused). An evaluation
    takes none of those, nor the configured callbacks that only training uses (a checkpoint callback
    would reload its state and warn about the training run's dir; the loss curves).
    """
    from multiloss.callbacks import GraphLeakDetector, LossCurves, NonFiniteGuard, Preemption, RngState
    from multiloss.callbacks.epoch_metrics import EpochMetricsOnEveryRank
    from multiloss.callbacks.report_once import ReportOnce
    from multiloss.callbacks.resume import ResumeRule
    from multiloss.callbacks.run_record import RunRecord

    configured = [_build(f"callbacks.{k}", v) for k, v in (cfg.get("callbacks") or {}).items() if v]
    if not has_loggers:  # logger=none: an LR monitor has nowhere to write (Lightning would stop the run)
        configured = [c for c in configured if not isinstance(c, LearningRateMonitor)]
    # First: an epoch's values are reduced on every rank before any callback (some read on rank zero only) reads them.
    first = [EpochMetricsOnEveryRank()]
    if purpose == "evaluate":
        kept = [c for c in configured if not isinstance(c, ModelCheckpoint | LearningRateMonitor | LossCurves)]
        return [*first, *kept]
    always = [RngState(), RunRecord(cfg), NonFiniteGuard(cfg.get("nonfinite", "stop")), GraphLeakDetector()]
    return [*first, *configured, *always, Preemption(), ReportOnce(), ResumeRule(cfg.get("ckpt_path"))]


def build_data_and_model(cfg: DictConfig) -> tuple[L.LightningDataModule, L.LightningModule]:
    """The data module and the recipe module of a composed config, as `train` builds them (seeded by ``seed``).

    A recipe may take arguments from the data module (tbptt: the data's vocabulary) through a
    ``from_data(datamodule)`` classmethod, as LightningCLI's ``link_arguments`` does; a value set in
    the config itself wins.
    """
    rename_targets(cfg)  # an earlier layout's dotted names, at their modules' current places (multiloss.config.renamed)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    datamodule = _build("data", cfg.data)
    with _config_errors("model", cfg.model):
        recipe = get_object(cfg.model._target_)
    links = recipe.from_data(datamodule) if isinstance(recipe, type) and issubclass(recipe, Recipe) else {}
    links = {k: v for k, v in links.items() if cfg.model.get(k) is None}
    if not links:
        return datamodule, _build("model", cfg.model)
    # Called, not merged into the config: a value from the data is data, never an interpolation.
    with _config_errors("model", cfg.model):
        return datamodule, instantiate(cfg.model, _partial_=True)(**links)


def _build(path: str, node: DictConfig, **kwargs: Any) -> Any:
    with _config_errors(path, node):
        return instantiate(node, **kwargs)


@contextmanager
def _config_errors(path: str, node: DictConfig) -> Iterator[None]:
    """Turn what a component rejects while being built into a `ConfigError` under ``path``."""
    try:
        yield
    except (ConfigError, InstantiationException, MisconfigurationException, ImportError) as err:
        cause = err.__cause__ if isinstance(err, InstantiationException) and err.__cause__ else err
        if isinstance(cause, ConfigError):
            raise cause.under(path) from None
        if path == "trainer" and isinstance(cause, RuntimeError) and "SLURM" in str(cause):
            # Lightning's SLURMEnvironment refuses a job whose tasks do not match the Trainer.
            raise ConfigError(
                "trainer.devices",
                node.get("devices"),
                "one task per device: sbatch/srun --ntasks-per-node=<trainer.devices> (not --ntasks), "
                "--nodes=<trainer.num_nodes>",
                f"rejected by Lightning under SLURM: {cause}",
            ) from None
        if isinstance(cause, ImportError):  # e.g. logger=wandb without the wandb package
            raise ConfigError(
                path,
                node.get("_target_", OmegaConf.to_container(node)),
                "its Python package installed (the config file's comment names the multiloss extra)",
                f"cannot be built: {cause}",
            ) from None
        if isinstance(cause, MisconfigurationException) or (path == "trainer" and isinstance(cause, ValueError)):
            raise error_from_lightning(path, node, cause) from None
        raise


log = logging.getLogger("multiloss")


def train(cfg: DictConfig) -> dict[str, float]:
    """Validate ``cfg``, build data, model, callbacks, loggers and trainer from it, fit, return final metrics.

    Every user error surfaces as `ConfigError` before the first file is written, so a rejected
    run leaves an earlier run's files in the same directory untouched.
    """
    check_config(cfg)
    checkpoint_to_resume(cfg)
    # The job's rank zero locks the run dir before anything is written: a second run started into the same dir at
    # the same instant is refused and touches nothing (whether the dir holds another run's checkpoints is judged
    # when training starts, by every rank: RunRecord, after the checks that name a mistake in the config).
    with claimed(cfg.paths.output_dir, claim=launch_rank_zero()):
        return _fit(cfg, *prepare(cfg))


def prepare(cfg: DictConfig) -> tuple[L.LightningDataModule, L.LightningModule, L.Trainer]:
    """The data module, the recipe and the Trainer of a checked config, and every check `train` makes of them before
    ``fit`` (the streams against the ranks, what sharding refuses, the checkpoint to resume)."""
    datamodule, model = build_data_and_model(cfg)
    trainer = build_trainer(cfg, "train", model)  # what FSDP2 cannot do in this recipe refused there
    if cfg.get("global_batch_size") is not None and _derive_accumulation(cfg, datamodule, trainer, model):
        # The recipe built with the k derived, and checked as the engine checked the first (FSDP2's refusals).
        datamodule, model = build_data_and_model(cfg)
        if hasattr(model, "check_sharding"):
            parallelism_of(trainer).check(model, trainer)
    if (streams := getattr(datamodule, "streams", None)) is not None:
        streams.check(trainer.world_size)  # every rank's token streams hold a window (the ranks counted)
    if cfg.get("ckpt_path"):
        checkpoint = verify_checkpoint(cfg.ckpt_path, model)
        refuse_a_bound_already_reached(checkpoint, trainer.max_steps, trainer.max_epochs)
        changes = verify_position(
            checkpoint,
            checkpoint.get(BATCHES_KEY),
            getattr(datamodule, "batch_size", None),
            trainer.world_size,
            streams=getattr(datamodule, "streams", None) is not None,
            order=(datamodule.seed, datamodule.shuffle) if hasattr(datamodule, "seed") else None,
        )
        for change in changes if trainer.is_global_zero else ():  # one line a run, not one a rank
            log.info("resuming with %s", change)
    return datamodule, model, trainer


def _derive_accumulation(
    cfg: DictConfig, datamodule: L.LightningDataModule, trainer: L.Trainer, model: L.LightningModule
) -> bool:
    """Set ``model.accumulate_grad_batches`` to k = global_batch_size / (data.batch_size × ranks), as torchtitan
    derives its accumulation from its global batch: the run's global batch stays what it says on any number of ranks
    or per-rank batch, a resume on another shape included. Whether k changed (the recipe is then built again)."""
    total, per_rank, world_size = cfg.global_batch_size, getattr(datamodule, "batch_size", None), trainer.world_size
    require(
        isinstance(per_rank, int),
        "global_batch_size",
        total,
        "null with a data module that has no data.batch_size (the per-rank batch it divides)",
    )
    require(
        isinstance(total, int) and total >= 1 and total % (per_rank * world_size) == 0,
        "global_batch_size",
        total,
        f"a multiple of data.batch_size × ranks = {per_rank} × {world_size} = {per_rank * world_size} (it is "
        "data.batch_size × ranks × model.accumulate_grad_batches), or null",
    )
    k = total // (per_rank * world_size)
    require(
        k == 1 or getattr(model, "accumulates_batches", True),
        "global_batch_size",
        total,
        f"data.batch_size × ranks = {per_rank * world_size}, or null: {type(model).__name__} accumulates the chunks of "
        "a batch (model.accumulate_grad_batches), not batches, so a global batch of several batches cannot be kept",
    )
    if trainer.is_global_zero:  # one line a run
        log.info(
            "global batch %d = %d a rank × %d rank(s) × model.accumulate_grad_batches=%d",
            total,
            per_rank,
            world_size,
            k,
        )
    if cfg.model.get("accumulate_grad_batches") == k:
        return False
    with open_dict(cfg):
        cfg.model.accumulate_grad_batches = k
    return True


def _fit(cfg: DictConfig, datamodule: L.LightningDataModule, model: L.LightningModule, trainer: L.Trainer) -> dict:
    record = next(c for c in trainer.callbacks if isinstance(c, RunRecord))

    try:
        trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"), weights_only=True)
    except RuntimeError as err:
        if (monitored := _unknown_monitor(cfg, err)) is not None:
            raise monitored from None
        if "could not create a primitive descriptor" in str(err) and "bf16" in str(trainer.precision):
            raise ConfigError(
                "trainer.precision",
                trainer.precision,
                "32-true on this CPU, or a GPU for bf16",
                f"oneDNN has no bf16 kernel for a layer of the model on this CPU ({str(err).splitlines()[0][:120]})",
            ) from None
        if is_stall(err):  # a collective not every rank reached: one message for the job, naming each rank's hook
            raise explain_stall(err, trainer, cfg.get("collective_timeout", 1800), last_checkpoint(trainer)) from None
        explain(err)  # an autograd pitfall gets its cause and fix under PyTorch's message
        raise
    except (MisconfigurationException, ValueError) as err:
        # Lightning judges some Trainer values only against the data, inside fit (val_check_interval
        # against the number of batches): before training started (and RunRecord wrote anything),
        # an error naming a Trainer argument is a config error.
        if "empty parameter list" in str(err):
            raise _without_parameters(cfg, model) from None
        named = any(str(k) in str(err) for k in cfg.trainer if not str(k).startswith("_"))
        if isinstance(err, ConfigError) or record.started or not named:
            raise
        raise error_from_lightning("trainer", cfg.trainer, err) from None
    return {name: float(value) for name, value in trainer.callback_metrics.items()}


def _unknown_monitor(cfg: DictConfig, err: RuntimeError) -> ConfigError | None:
    """Lightning's EarlyStopping on a metric the run never logs (found at the first validation): the key."""
    text = str(err)
    if "conditioned on metric" not in text:
        return None
    for name, node in (cfg.get("callbacks") or {}).items():
        monitor = node.get("monitor") if node else None
        if monitor and f"`{monitor}`" in text:
            available = text.split("Available metrics are:")[-1].strip().rstrip(".")
            return ConfigError(
                f"callbacks.{name}.monitor", monitor, f"a metric the run logs: {available}", "never logged"
            )
    return None


def _without_parameters(cfg: DictConfig, model: object) -> ConfigError:
    """An optimizer over no parameters: name the component that has none."""
    import torch

    for name, child in model.named_children() if isinstance(model, torch.nn.Module) else ():
        node = cfg.model.get(name) if name in ("net", "generator", "discriminator") else None
        if node is not None and not any(p.requires_grad for p in child.parameters()):
            target = node.get("_target_") if hasattr(node, "get") else node
            return ConfigError(f"model.{name}", target, "a network with trainable parameters", "it has none")
    return ConfigError("model", cfg.model.get("_target_"), "networks with trainable parameters", "none to optimize")
