"""`train(cfg)`: one training run from a composed config, checked before anything is written."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning as L
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.fabric.utilities.exceptions import MisconfigurationException
from omegaconf import DictConfig, OmegaConf

from multiloss.callbacks import RngState
from multiloss.config import ConfigError, check_config
from multiloss.console import print_config_tree, save_run_config
from multiloss.distributed import resolve_strategy


def train(cfg: DictConfig) -> dict[str, float]:
    """Validate ``cfg``, build data, model, callbacks, loggers and trainer from it, fit, return final metrics.

    Every user error surfaces as `ConfigError` before the first file is written, so a rejected
    run leaves an earlier run's files in the same directory untouched.
    """
    check_config(cfg)
    L.seed_everything(cfg.seed, workers=True, verbose=False)

    datamodule = _build("data", cfg.data)
    model = _build("model", cfg.model)
    # RngState is not optional: exact resume is part of the contract of `ckpt_path=`.
    callbacks = [_build(f"callbacks.{k}", v) for k, v in (cfg.get("callbacks") or {}).items() if v] + [RngState()]
    loggers = [_build(f"logger.{k}", v) for k, v in (cfg.get("logger") or {}).items() if v]
    # Lightning's name "ddp" is built as multiloss's DDPStrategy (Hydra-job children, one wrapper
    # per network for multi-optimizer recipes); everything else goes to Lightning as given.
    trainer: L.Trainer = _build(
        "trainer",
        cfg.trainer,
        callbacks=callbacks,
        logger=loggers or False,
        **resolve_strategy(cfg.trainer.get("strategy")),
    )
    # Settings only the recipe can judge against the built Trainer (e.g. trainer.gradient_clip_val
    # under manual optimization): rejected here, before any file is written.
    if callable(check := getattr(model, "check_trainer", None)):
        check(trainer)

    save_run_config(cfg, cfg.paths.output_dir)
    if cfg.get("print_config", True):
        print_config_tree(cfg)
    for lg in trainer.loggers:
        lg.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))

    trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
    return {name: float(value) for name, value in trainer.callback_metrics.items()}


def _build(path: str, node: DictConfig, **kwargs: Any) -> Any:
    with _config_errors(path, node):
        return instantiate(node, **kwargs)


@contextmanager
def _config_errors(path: str, node: DictConfig) -> Iterator[None]:
    """Turn what a component rejects while being built into a `ConfigError` under ``path``."""
    try:
        yield
    except (ConfigError, InstantiationException, MisconfigurationException) as err:
        cause = err.__cause__ if isinstance(err, InstantiationException) and err.__cause__ else err
        if isinstance(cause, ConfigError):
            raise cause.under(path) from None
        if isinstance(cause, MisconfigurationException) or (path == "trainer" and isinstance(cause, ValueError)):
            raise _lightning_said(path, node, cause) from None
        raise


def _lightning_said(path: str, node: DictConfig, err: Exception) -> ConfigError:
    """Lightning's own check failed: name the key its message is about, and pass its words on."""
    text = str(err)
    keys = [str(k) for k in node if not str(k).startswith("_") and str(k) in text]
    key = max(keys, key=len) if keys else None  # the most specific name mentioned
    return ConfigError(
        f"{path}.{key}" if key else path,
        node[key] if key else OmegaConf.to_container(node),
        text,
        "rejected by Lightning",
    )
