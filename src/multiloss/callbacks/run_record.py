"""The run's record: its config copies, and what every checkpoint keeps about the run that wrote it.

`RunRecord` claims the run dir, writes the ``.hydra/`` copies and logs the config when training
starts; into every checkpoint it writes the overrides, the config dirs, the data split and the
metrics.csv of the run (`multiloss-eval` rebuilds the recipe from them, a resumed run continues the
metrics file). Their checkpoint keys are declared in `multiloss.saving.saved_state`; this callback writes them.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning as L
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from multiloss import lightning_internals as internals
from multiloss.callbacks.lean import LeanCallback
from multiloss.console.config_tree import print_config_tree, save_run_config
from multiloss.saving.history import continue_history, history_entry
from multiloss.saving.run_dir import check_run_dir
from multiloss.saving.run_log import open_run_log
from multiloss.saving.saved_state import BATCHES_KEY, CONFIG_DIRS_KEY, HISTORY_KEY, OVERRIDES_KEY, SPLIT_KEY

log = logging.getLogger("multiloss")

SPLIT_KEYS = ("val_fraction", "test_fraction", "split_seed")


class RunRecord(LeanCallback):
    """Writes the run's ``.hydra/`` config copies, prints the config tree and logs it.

    At the start of training, not before: ``fit`` first runs the recipe's component check on a batch
    of the data (at setup), restores ``ckpt_path`` and checks the Trainer's values against the data
    (``val_check_interval``); a run rejected there must leave an earlier run's files untouched, and its message
    must be about the mistake, not about the dir: only then does every rank check that the dir holds no other
    run's checkpoints. Its lock was taken before anything was built (`multiloss.saving.run_dir.claimed`,
    `multiloss.train`).
    """

    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        # Stored in every checkpoint: `multiloss-eval ckpt_path=...` rebuilds the same recipe from them.
        self.overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
        sources = HydraConfig.get().runtime.config_sources if HydraConfig.initialized() else []
        self.config_dirs = [s.path for s in sources if s.schema == "file" and s.provider != "main"]
        self.started = False  # training began: errors from here on are not about the config
        self.resumed_history: dict[str, Any] | None = None  # the metrics.csv a resumed checkpoint's run wrote

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.started = True
        # Every rank reaches the same verdict (reads only): refused, they stop together, none left waiting.
        check_run_dir(self.cfg.paths.output_dir, self.cfg.get("ckpt_path"), self.cfg.get("overwrite", False))
        save_run_config(self.cfg, self.cfg.paths.output_dir)
        open_run_log(trainer.global_rank)
        continue_history(trainer, self.resumed_history)  # a resumed run's metrics.csv starts with the earlier rows
        # Through Python's logging: under Hydra, also in this rank's <run dir>/train.log (written only from
        # now on, so a run rejected earlier leaves no log behind: multiloss.saving.run_log).
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
        last_step = pl_module.step_index if _is_recipe(pl_module) else internals.batches_that_stepped(trainer)
        checkpoint[HISTORY_KEY] = history_entry(trainer, last_step)
        checkpoint[CONFIG_DIRS_KEY] = self.config_dirs
        checkpoint[SPLIT_KEY] = {k: self.cfg.data[k] for k in SPLIT_KEYS if k in self.cfg.data}
        checkpoint[BATCHES_KEY] = {
            "batch_size": getattr(trainer.datamodule, "batch_size", None),
            "world_size": trainer.world_size,
        }

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        self.resumed_history = checkpoint.get(HISTORY_KEY)


def _is_recipe(module: object) -> bool:
    """Whether ``module`` is a multiloss recipe (imported here: the recipes' base imports the callbacks package)."""
    from multiloss.base.module import Recipe

    return isinstance(module, Recipe)
