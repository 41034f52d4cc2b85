"""Everything a run is built from, from a composed config: the data module, the recipe module, the Trainer.

`multiloss.train` and `multiloss.evaluate` both build through here, and so does `multiloss.testing`:
what a proof builds is what ``python train.py`` trains. A component's own rejection while being built
becomes a `ConfigError` under its dotted key.
"""

from __future__ import annotations

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
from omegaconf import DictConfig, OmegaConf

from multiloss import lightning_internals as internals
from multiloss.base.module import Recipe
from multiloss.config import ConfigError
from multiloss.config.errors import error_from_lightning
from multiloss.config.parallel import is_sharded
from multiloss.config.renamed import rename_targets
from multiloss.parallel.parallelism import engine
from multiloss.saving.checkpoints import AtomicCheckpointIO


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
    from multiloss.callbacks.resume import ResumeRule
    from multiloss.callbacks.run_record import RunRecord
    from multiloss.parallel.ddp import ReportOnce

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
