"""`evaluate(cfg)`: a checkpoint's validation (and test) metrics, as ``multiloss-eval`` prints them.

The checkpoint carries the overrides of the run that wrote it (`RunRecord` stores them), so
``multiloss-eval ckpt_path=<file>`` rebuilds the same recipe, components and data without the user
repeating them; what the command line gives wins.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence

import lightning as L
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig

from multiloss.config import ConfigError, check_config, require
from multiloss.saving.run_dir import require_checkpoint, run_overrides, stored_entries
from multiloss.saving.saved_state import SPLIT_KEY
from multiloss.training import build_data_and_model, build_trainer

log = logging.getLogger("multiloss")


def with_training_overrides(args: Sequence[str]) -> list[str]:
    """``args`` preceded by the training run's overrides for the keys ``args`` leaves unset (`run_overrides`)."""
    return run_overrides(args)[0]


def evaluate(cfg: DictConfig) -> dict[str, float]:
    """Validate the checkpoint ``cfg.ckpt_path`` (and test it when the data holds a test set); return the metrics.

    Checked like `multiloss.train` before anything is written: the config, then the checkpoint
    against the recipe it builds (a checkpoint of another recipe or shape is a `ConfigError` on
    ``ckpt_path``). The metrics are the loggers' (``metrics.csv`` in the eval run dir) too.
    """
    from multiloss.console.config_tree import save_run_config
    from multiloss.saving.checkpoints import verify_checkpoint
    from multiloss.saving.run_dir import refuse_a_runs_dir
    from multiloss.saving.run_log import open_run_log

    check_config(cfg)
    require(bool(cfg.get("ckpt_path")), "ckpt_path", cfg.get("ckpt_path"), "the checkpoint to evaluate (a .ckpt file)")
    require_checkpoint(cfg.ckpt_path)
    if rank_zero_only.rank == 0:  # ranks started for this evaluation find the dir rank zero made
        refuse_a_runs_dir(cfg.paths.output_dir)
    datamodule, model = build_data_and_model(cfg)
    trainer = build_trainer(cfg, "evaluate")
    verify_checkpoint(cfg.ckpt_path, model)
    _check_split(cfg)
    if trainer.is_global_zero:
        save_run_config(cfg, cfg.paths.output_dir)
    open_run_log()
    log.info("evaluating %s from %s into %s", type(model).__name__, cfg.ckpt_path, cfg.paths.output_dir)
    stages = [trainer.validate] + ([trainer.test] if _has_test_set(datamodule) else [])
    metrics: dict[str, float] = {}
    with warnings.catch_warnings():
        # Lightning asks for the training callbacks whose state the checkpoint holds: only resuming
        # training needs them.
        warnings.filterwarnings("ignore", message=".*callbacks used to create the checkpoint need to be provided")
        for stage in stages:
            for results in stage(
                model, datamodule=datamodule, ckpt_path=cfg.ckpt_path, weights_only=True, verbose=False
            ):
                metrics.update(results)
    return {name: float(value) for name, value in metrics.items()}


def _check_split(cfg: DictConfig) -> None:
    """A validation or test example the checkpoint was trained on would flatter it: refuse another split."""
    trained = stored_entries(cfg.ckpt_path).get(SPLIT_KEY)
    if not isinstance(trained, dict):
        return
    for key, value in trained.items():
        now = cfg.data.get(key)
        if now is not None and now != value:
            raise ConfigError(
                f"data.{key}",
                now,
                f"{value}, the split the checkpoint was trained with (a different split evaluates on "
                "examples it trained on); to hold out a test set, train with data.test_fraction=<f>",
                "not the training run's split",
            )


def _has_test_set(datamodule: L.LightningDataModule) -> bool:
    streams = getattr(datamodule, "streams", None)
    if streams is not None:  # token streams (data.layout=streams): a test corpus or none
        return len(streams.ids.get("test", ())) > 0
    datamodule.setup("test")
    test_set = getattr(datamodule, "test_set", None)
    return test_set is not None and len(test_set) > 0
