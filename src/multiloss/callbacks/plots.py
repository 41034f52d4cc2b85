"""Pictures written into the run dir when training ends."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn

from multiloss.callbacks.lean import LeanCallback
from multiloss.saving.history import csv_logger, read_rows


def logged_curves(trainer: L.Trainer, prefix: str) -> dict[str, tuple[list[float], list[float]]]:
    """Every column of the run's metrics.csv whose name starts with ``prefix``: name -> (steps, values)."""
    return curves_of(read_metrics(trainer), prefix)


def curves_in(path: str | Path, prefix: str = "") -> dict[str, tuple[list[float], list[float]]]:
    """Every column of the metrics.csv at ``path`` whose name starts with ``prefix``: name -> (steps, values)."""
    return curves_of(read_rows(path), prefix)


def curves_of(rows: list[dict[str, str]], prefix: str) -> dict[str, tuple[list[float], list[float]]]:
    curves: dict[str, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for row in rows:
        for name, value in row.items():
            if name != "step" and name.startswith(prefix) and value not in ("", None):
                curves[name][0].append(float(row["step"]))
                curves[name][1].append(float(value))
    return dict(curves)


def read_metrics(trainer: L.Trainer) -> list[dict[str, str]]:
    """The rows of the run's ``metrics.csv`` (flushed first; a resumed run's holds the earlier runs' too)."""
    logger = csv_logger(trainer)
    if logger is None:
        return []
    logger.save()
    path = Path(logger.experiment.metrics_file_path)
    return read_rows(path) if path.is_file() else []


class LossCurves(LeanCallback):
    """At the end of fit, plots every logged column starting with ``prefix`` (one line each) to a PNG.

    Reads the CSVLogger's ``metrics.csv`` rather than keeping a second copy of the history.
    """

    def __init__(self, dirpath: str, filename: str = "loss_curves.png", prefix: str = "loss/") -> None:
        self.path = Path(dirpath) / filename
        self.prefix = prefix

    @rank_zero_only
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        curves = logged_curves(trainer, self.prefix)
        if not curves:
            rank_zero_warn(f"LossCurves: no '{self.prefix}*' columns in a metrics.csv; {self.path} not written")
            return
        with curves_figure(self.path) as ax:
            for name in sorted(curves):
                steps, values = curves[name]
                ax.plot(steps, values, label=name, linewidth=2.2 if name.endswith("total") else 1.2)
            if all(v > 0 and math.isfinite(v) for _, vs in curves.values() for v in vs):
                ax.set_yscale("log")
            ax.set_xlabel("step")
            ax.set_ylabel("loss")
            ax.set_title(f"{type(pl_module).__name__}: loss components")
            ax.grid(alpha=0.3)


class LoggedCurvesPlot(LeanCallback):
    """Plots logged ``columns`` over the steps, one panel each, to ``<run dir>/<filename>`` at every epoch end
    and when training ends (a run stopped by ``max_steps`` mid-epoch never reaches an epoch end).

    Reads the run's ``metrics.csv`` — a resumed run's holds the earlier rows too, so the curves go on —
    rather than a copy of the metrics kept in the module or its checkpoints. ``plotted`` holds the
    curves last drawn (column -> (steps, values)).
    """

    def __init__(self, filename: str, columns: list[str], title: str = "") -> None:
        self.filename, self.columns, self.title = filename, list(columns), title
        self.plotted: dict[str, tuple[list[float], list[float]]] = {}

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.draw(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.draw(trainer)

    @rank_zero_only
    def draw(self, trainer: L.Trainer) -> None:
        curves = {name: curve for name, curve in logged_curves(trainer, "").items() if name in self.columns}
        if not curves:
            return
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        names = [c for c in self.columns if c in curves]
        fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.4), squeeze=False)
        try:
            for ax, name in zip(axes[0], names):
                steps, values = curves[name]
                ax.plot(steps, values, marker="o", markersize=3)
                ax.set_title(f"{name}: {values[-1]:.4g}", fontsize=9)
                ax.set_xlabel("step")
                ax.grid(alpha=0.3)
            fig.suptitle(self.title)
            fig.tight_layout()
            path = Path(trainer.default_root_dir) / self.filename
            path.parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(path, dpi=100)
        finally:
            plt.close(fig)
        self.plotted = curves


@contextmanager
def curves_figure(path: Path) -> Iterator[Any]:
    """One axes to draw logged curves on; with a legend, saved to ``path`` (its folder made) and closed after.

    Matplotlib's Agg backend, imported here: a run that draws nothing never imports it.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    try:
        yield ax
        ax.legend(fontsize=8)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
