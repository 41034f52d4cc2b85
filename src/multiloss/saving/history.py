"""One training, one ``metrics.csv``: a resumed run's file starts with the rows of the run it resumes.

A checkpoint names the ``metrics.csv`` of the run that wrote it; resuming from it (``ckpt_path=``,
into a new run dir as by default) copies that file's rows up to the checkpoint's step into the new
run's file first. The file of a run resumed twice thus holds all three parts, and so does its loss
curve. (TensorBoard, MLflow and W&B get the new steps only: they keep runs apart by design.)
"""

from __future__ import annotations

import csv
from pathlib import Path

import lightning as L
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn


def csv_logger(trainer: L.Trainer) -> CSVLogger | None:
    """The run's first CSVLogger, if it has one."""
    return next((lg for lg in trainer.loggers if isinstance(lg, CSVLogger)), None)


def metrics_file(trainer: L.Trainer) -> str | None:
    """The absolute path of the run's ``metrics.csv`` (it may not be written yet), or None without a CSVLogger.

    None on ranks other than zero too: only rank zero writes the file (its logger's experiment
    is a stand-in elsewhere), and only rank zero's checkpoint is saved.
    """
    logger = csv_logger(trainer)
    if not trainer.is_global_zero:
        return None
    return str(Path(logger.experiment.metrics_file_path).resolve()) if logger is not None else None


def read_rows(path: str | Path) -> list[dict[str, str]]:
    with Path(path).open(newline="") as f:
        return list(csv.DictReader(f))


def history_entry(trainer: L.Trainer, last_step: int) -> dict[str, object] | None:
    """What a checkpoint keeps under `HISTORY_KEY`: this run's metrics.csv and the last step it covers."""
    path = metrics_file(trainer)
    return {"path": path, "last_step": int(last_step)} if path is not None else None


@rank_zero_only
def continue_history(trainer: L.Trainer, entry: dict[str, object] | None) -> None:
    """Copy the rows of a resumed checkpoint's metrics.csv, up to its last step, into this run's metrics.csv."""
    logger = csv_logger(trainer)
    if logger is None or not entry:
        return
    earlier, last_step = Path(str(entry["path"])), int(entry["last_step"])  # type: ignore[call-overload]
    if earlier.resolve() == Path(metrics_file(trainer) or "").resolve():
        return
    if not earlier.is_file():
        rank_zero_warn(
            f"the metrics.csv of the run this one resumes ({earlier}) is gone: this run's metrics.csv and "
            f"loss curves start after step {last_step}"
        )
        return
    for row in read_rows(earlier):
        step = int(float(row.pop("step")))
        if step <= last_step:  # later rows belong to a future the resumed run replaces
            logger.experiment.log_metrics({k: _number(v) for k, v in row.items() if v not in ("", None)}, step)
    logger.save()


def _number(text: str) -> int | float:
    # As it was written: Lightning's epoch column is an int, the values are floats.
    return int(text) if text.lstrip("-").isdigit() else float(text)
