"""`train(cfg)`: one training run from a composed config, checked before anything is written."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning as L
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.utils import get_object, instantiate
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import LearningRateMonitor
from omegaconf import DictConfig, OmegaConf

from multiloss.callbacks import GraphLeakDetector, NonFiniteGuard, RngState
from multiloss.checkpoints import AtomicCheckpointIO, verify_checkpoint
from multiloss.config import ConfigError, check_config
from multiloss.console import print_config_tree, save_run_config
from multiloss.distributed import multiloss_ddp
from multiloss.evaluation import CONFIG_DIRS_KEY, OVERRIDES_KEY, SPLIT_KEY, SPLIT_KEYS
from multiloss.history import HISTORY_KEY, continue_history, history_entry
from multiloss.pitfalls import explain
from multiloss.run_dir import acquire_lock, check_run_dir, release_lock

log = logging.getLogger("multiloss")


def train(cfg: DictConfig) -> dict[str, float]:
    """Validate ``cfg``, build data, model, callbacks, loggers and trainer from it, fit, return final metrics.

    Every user error surfaces as `ConfigError` before the first file is written, so a rejected
    run leaves an earlier run's files in the same directory untouched.
    """
    check_config(cfg)
    datamodule, model = build_data_and_model(cfg)
    # Besides the config's callbacks, always there: RngState (exact resume is part of the contract of
    # `ckpt_path=`), RunRecord (the run's config copies, once fit() has checked the components on a
    # batch of the data), the non-finite guard (nothing NaN trains on silently or reaches a
    # checkpoint), the graph-leak detector (a graph kept from step to step, over the first batches).
    record = RunRecord(cfg)
    trainer = build_trainer(
        cfg, [RngState(), record, NonFiniteGuard(cfg.get("nonfinite", "stop")), GraphLeakDetector()]
    )
    # Settings only the recipe can judge against the built Trainer (e.g. trainer.gradient_clip_val
    # under manual optimization): rejected here, before any file is written.
    if callable(check := getattr(model, "check_trainer", None)):
        check(trainer)
    if cfg.get("ckpt_path"):
        verify_checkpoint(cfg.ckpt_path, model)

    try:
        trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"), weights_only=True)
    except RuntimeError as err:
        explain(err)  # an autograd pitfall gets its cause and fix under PyTorch's message
        raise
    except (MisconfigurationException, ValueError) as err:
        # Lightning judges some Trainer values only against the data, inside fit (val_check_interval
        # against the number of batches): before training started (and RunRecord wrote anything),
        # an error naming a Trainer argument is a config error.
        named = any(str(k) in str(err) for k in cfg.trainer if not str(k).startswith("_"))
        if isinstance(err, ConfigError) or record.started or not named:
            raise
        raise _lightning_said("trainer", cfg.trainer, err) from None
    return {name: float(value) for name, value in trainer.callback_metrics.items()}


def build_trainer(
    cfg: DictConfig, callbacks: list[L.Callback], leave_out: tuple[type[L.Callback], ...] = ()
) -> L.Trainer:
    """The Trainer of ``cfg.trainer`` with the config's callbacks (but those of a ``leave_out`` type) and loggers."""
    configured = [_build(f"callbacks.{k}", v) for k, v in (cfg.get("callbacks") or {}).items() if v]
    callbacks = [c for c in configured if not isinstance(c, leave_out)] + callbacks
    loggers = [_build(f"logger.{k}", v) for k, v in (cfg.get("logger") or {}).items() if v]
    if not loggers:  # logger=none: the LR monitor has nowhere to write (Lightning would stop the run)
        callbacks = [c for c in callbacks if not isinstance(c, LearningRateMonitor)]
    # Checkpoints written atomically, failures loud, loads weights_only (multiloss.checkpoints).
    plugins = {} if cfg.trainer.get("plugins") else {"plugins": [AtomicCheckpointIO()]}
    trainer: L.Trainer = _build("trainer", cfg.trainer, callbacks=callbacks, logger=loggers or False, **plugins)
    # Whatever ends in Lightning's DDP (strategy=ddp, an alias, or auto with several devices) runs as
    # multiloss's DDPStrategy: Hydra-job children, one wrapper per network for multi-optimizer recipes.
    if (ddp := multiloss_ddp(trainer, cfg.trainer.get("strategy"))) is not None:
        trainer = _build("trainer", cfg.trainer, callbacks=callbacks, logger=loggers or False, strategy=ddp, **plugins)
    return trainer


def build_data_and_model(cfg: DictConfig) -> tuple[L.LightningDataModule, L.LightningModule]:
    """The data module and the recipe module of a composed config, as `train` builds them (seeded by ``seed``).

    A recipe may take arguments from the data module (tbptt: the data's vocabulary) through a
    ``from_data(datamodule)`` classmethod, as LightningCLI's ``link_arguments`` does; a value set in
    the config itself wins.
    """
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    datamodule = _build("data", cfg.data)
    with _config_errors("model", cfg.model):
        recipe = get_object(cfg.model._target_)
    links = recipe.from_data(datamodule) if callable(getattr(recipe, "from_data", None)) else {}
    links = {k: v for k, v in links.items() if cfg.model.get(k) is None}
    if not links:
        return datamodule, _build("model", cfg.model)
    # Called, not merged into the config: a value from the data is data, never an interpolation.
    with _config_errors("model", cfg.model):
        return datamodule, instantiate(cfg.model, _partial_=True)(**links)


class RunRecord(L.Callback):
    """Claims the run dir, writes the run's ``.hydra/`` config copies, prints the config tree and logs it.

    At the start of training, not before: ``fit`` first runs the recipe's component check on a batch
    of the data (at setup), restores ``ckpt_path`` and checks the Trainer's values against the data
    (``val_check_interval``); a run rejected there must leave an earlier run's files untouched, and
    its message must be about the mistake, not about the dir. Rank zero claims
    the dir (`multiloss.run_dir`: no other run's checkpoints unless resuming or ``overwrite``, a
    lock while training); ranks started for this run share it.
    """

    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        # Stored in every checkpoint: `multiloss-eval ckpt_path=...` rebuilds the same recipe from them.
        self.overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
        sources = HydraConfig.get().runtime.config_sources if HydraConfig.initialized() else []
        self.config_dirs = [s.path for s in sources if s.schema == "file" and s.provider != "main"]
        self.lock: Path | None = None
        self.started = False  # training began: errors from here on are not about the config
        self.resumed_history: dict[str, Any] | None = None  # the metrics.csv a resumed checkpoint's run wrote

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.started = True
        if trainer.global_rank == 0:
            out = self.cfg.paths.output_dir
            check_run_dir(out, self.cfg.get("ckpt_path"), self.cfg.get("overwrite", False))
            self.lock = acquire_lock(out)
        save_run_config(self.cfg, self.cfg.paths.output_dir)
        continue_history(trainer, self.resumed_history)  # a resumed run's metrics.csv starts with the earlier rows
        # Through Python's logging: under Hydra, also the first line of this rank's <run dir>/train.log
        # (opened only now, so a run rejected earlier leaves no log behind).
        log.info(
            "training %s on rank %d of %d into %s",
            type(pl_module).__name__,
            trainer.global_rank,
            trainer.world_size,
            self.cfg.paths.output_dir,
        )
        if self.cfg.get("print_config", True):
            print_config_tree(self.cfg)
        for lg in trainer.loggers:
            lg.log_hyperparams(OmegaConf.to_container(self.cfg, resolve=True))

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        checkpoint[OVERRIDES_KEY] = self.overrides
        last_step = getattr(pl_module, "step_index", trainer.fit_loop.epoch_loop._batches_that_stepped)
        checkpoint[HISTORY_KEY] = history_entry(trainer, last_step)
        checkpoint[CONFIG_DIRS_KEY] = self.config_dirs
        checkpoint[SPLIT_KEY] = {k: self.cfg.data[k] for k in SPLIT_KEYS if k in self.cfg.data}

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        self.resumed_history = checkpoint.get(HISTORY_KEY)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        release_lock(self.lock)
        self.lock = None

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.teardown(trainer, pl_module, "fit")


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
        if isinstance(cause, ImportError):  # e.g. logger=wandb without the wandb package
            raise ConfigError(
                path,
                node.get("_target_", OmegaConf.to_container(node)),
                "its Python package installed (the config file's comment names the multiloss extra)",
                f"cannot be built: {cause}",
            ) from None
        if isinstance(cause, MisconfigurationException) or (path == "trainer" and isinstance(cause, ValueError)):
            raise _lightning_said(path, node, cause) from None
        raise


def _lightning_said(path: str, node: DictConfig, err: Exception) -> ConfigError:
    """Lightning's own check failed: name the key its message is about, and pass its words on."""
    text = str(err)
    keys = [str(k) for k in node if not str(k).startswith("_") and str(k) in text]
    key = min(keys, key=lambda k: (text.find(k), -len(k))) if keys else None  # the first named, most specific
    return ConfigError(
        f"{path}.{key}" if key else path,
        node[key] if key else OmegaConf.to_container(node),
        text,
        "rejected by Lightning",
    )
