"""`evaluate(cfg)`: a checkpoint's validation (and test) metrics, as ``multiloss-eval`` prints them.

The checkpoint carries the overrides of the run that wrote it (`RunRecord` stores them), so
``multiloss-eval ckpt_path=<file>`` rebuilds the same recipe, components and data without the user
repeating them; what the command line gives wins.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig

from multiloss.builders import build_data_and_model, build_trainer
from multiloss.config import ConfigError, check_config, require
from multiloss.saved_state import CONFIG_DIRS_KEY, OVERRIDES_KEY, SPLIT_KEY, is_sharded_checkpoint

log = logging.getLogger("multiloss")
# Overrides of the training run that never carry over to an evaluation of its checkpoint.
_NOT_CARRIED = ("ckpt_path", "overwrite", "hydra", "optimized_metric")


def with_training_overrides(args: Sequence[str]) -> list[str]:
    """``args`` (a command line's overrides) preceded by the training run's, for the keys ``args`` leaves unset.

    The training overrides come from the checkpoint named by ``ckpt_path=`` (or its run dir's
    ``.hydra/overrides.yaml``). Nothing is added when there is no such file: `evaluate` then names
    the problem with the key.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    given = [a for a in args if not a.startswith("-")]
    try:
        keys = {o.key_or_group.lstrip("+~") for o in parser.parse_overrides(given)}
    except Exception:  # Hydra reports a malformed override itself, with its own message
        return list(args)
    ckpt = next((o.split("=", 1)[1] for o in given if o.startswith("ckpt_path=")), None)
    if not ckpt:
        return list(args)
    stored = _stored(ckpt)  # one read of the checkpoint for both of its entries
    training = [
        o
        for o in parser.parse_overrides(_training_overrides(Path(ckpt), stored.get(OVERRIDES_KEY)))
        if o.key_or_group.lstrip("+~") not in keys and o.key_or_group.split(".")[0].split("/")[0] not in _NOT_CARRIED
    ]
    carried = [o.input_line for o in training if o.input_line]
    # The training run's own option dirs, unless this command line names its own.
    dirs = stored.get(CONFIG_DIRS_KEY)
    if dirs and not any(a.startswith(("--config-dir", "-cd", "hydra.searchpath")) for a in args):
        carried.insert(0, f"hydra.searchpath=[{','.join(map(str, dirs))}]")
    return carried + list(args)


def _stored(ckpt: Path | str) -> dict[str, Any]:
    """The checkpoint's top-level entries (memory-mapped), or none if it cannot be read."""
    import torch

    from multiloss.checkpoints import META

    if is_sharded_checkpoint(ckpt):  # a sharded checkpoint keeps its entries in meta.pt
        ckpt = Path(ckpt) / META
    try:
        checkpoint = torch.load(ckpt, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # not a readable checkpoint: `verify_checkpoint` says so, naming ckpt_path
        return {}
    return checkpoint if isinstance(checkpoint, dict) else {}


def _training_overrides(ckpt: Path, stored: object) -> list[str]:
    if stored is None and (beside := ckpt.parent.parent / ".hydra" / "overrides.yaml").is_file():
        from omegaconf import OmegaConf

        stored = OmegaConf.to_container(OmegaConf.load(beside))
    return [str(o) for o in stored or []]


def evaluate(cfg: DictConfig) -> dict[str, float]:
    """Validate the checkpoint ``cfg.ckpt_path`` (and test it when the data holds a test set); return the metrics.

    Checked like `multiloss.train` before anything is written: the config, then the checkpoint
    against the recipe it builds (a checkpoint of another recipe or shape is a `ConfigError` on
    ``ckpt_path``). The metrics are the loggers' (``metrics.csv`` in the eval run dir) too.
    """
    from multiloss.checkpoints import verify_checkpoint
    from multiloss.console import save_run_config
    from multiloss.run_dir import refuse_a_runs_dir
    from multiloss.run_log import open_run_log

    check_config(cfg)
    require(bool(cfg.get("ckpt_path")), "ckpt_path", cfg.get("ckpt_path"), "the checkpoint to evaluate (a .ckpt file)")
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
    trained = _stored(cfg.ckpt_path).get(SPLIT_KEY)
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
