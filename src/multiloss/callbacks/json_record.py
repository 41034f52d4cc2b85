"""A recipe's record of a decision, written into the run dir as JSON (accumulation's ``lr_scaling.json``)."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
from lightning.pytorch.utilities import rank_zero_only

from multiloss.callbacks.lean import LeanCallback


class JsonRecord(LeanCallback):
    """Writes the module's dict attribute ``attribute`` to ``<run dir>/<filename>`` at every epoch end (rank zero)."""

    def __init__(self, filename: str, attribute: str) -> None:
        self.filename, self.attribute = filename, attribute

    @rank_zero_only
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        record = getattr(pl_module, self.attribute, None)
        if record:
            path = Path(trainer.default_root_dir) / self.filename
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(record, indent=2) + "\n")
