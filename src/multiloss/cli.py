"""The commands: ``multiloss-train`` (= ``python train.py``) and ``multiloss-eval`` (= ``python eval.py``).

Both compose the config tree that ships inside the package (``pkg://multiloss.configs``: the
repository's ``configs/``), so they work from any directory; ``--config-dir`` adds a user's own
options. Torch and Lightning are imported inside `run`, once Hydra has a config to run: ``--help``,
``--cfg job`` and config errors found while composing never pay for them. A finished run ends with
a summary: every final value and where the outputs are (rank zero only).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from pathlib import Path

from omegaconf import DictConfig

CONFIGS = "pkg://multiloss.configs"


def train_main() -> None:
    """``multiloss-train [overrides]``: what ``python train.py`` does."""
    _hydra_main("train", train_task)()


def eval_main() -> None:
    """``multiloss-eval ckpt_path=<file> [overrides]``: validate (and test) a checkpoint, print its metrics.

    The training run's own overrides (stored in the checkpoint, or in its run dir's
    ``.hydra/overrides.yaml``) come first, so ``recipe=``, ``net=``, ``data=`` need not be repeated;
    what the command line gives wins.
    """
    from multiloss.evaluation import with_training_overrides

    sys.argv = [sys.argv[0], *with_training_overrides(sys.argv[1:])]
    _hydra_main("eval", eval_task)()


def _hydra_main(config_name: str, task: Callable[[DictConfig], object]) -> Callable[[], object]:
    import hydra

    return hydra.main(version_base="1.3", config_path=CONFIGS, config_name=config_name)(task)


def train_task(cfg: DictConfig) -> dict[str, float] | float:
    """One Hydra job of ``multiloss-train``: the final metrics, or ``optimized_metric``'s value for a sweeper."""
    from multiloss.training import train

    metrics = run(train, cfg)
    return optimized_value(metrics, cfg.get("optimized_metric"))


def eval_task(cfg: DictConfig) -> dict[str, float]:
    from multiloss.evaluation import evaluate

    return run(evaluate, cfg)


def optimized_value(metrics: dict[str, float], name: str | None) -> dict[str, float] | float:
    """``metrics[name]`` as a float (what Hydra's Optuna sweeper needs), or every metric when no name is set."""
    if name is None:
        return metrics
    if name not in metrics:
        from multiloss.config import ConfigError

        # Known only once the run has logged: the checkpoints are kept, the sweep learns why.
        err = ConfigError("optimized_metric", name, f"one of the run's final metrics: {', '.join(sorted(metrics))}")
        _print_error("config error", err.message)
        raise SystemExit(2)
    return float(metrics[name])


def run(task: Callable[[DictConfig], dict[str, float]], cfg: DictConfig) -> dict[str, float]:
    """``task(cfg)`` quietly, a user's mistake as one line (exit 2), and the end-of-run summary."""
    import logging

    from multiloss.quiet import silence_known_noise

    silence_known_noise()  # before Lightning and torchdata are imported: some warn at import or first use
    from multiloss.callbacks import NonFiniteError
    from multiloss.checkpoints import CheckpointWriteError
    from multiloss.config import ConfigError

    # Imported after Hydra set up logging, Lightning does not add its own console handler and its
    # lines go through Hydra's (into a run dir's train.log, even a rejected run's): set it up as
    # Lightning does when imported first.
    for name in ("lightning.pytorch", "lightning.fabric"):
        lightning_log = logging.getLogger(name)
        if not lightning_log.handlers:
            lightning_log.addHandler(logging.StreamHandler())
            lightning_log.propagate = False

    try:
        metrics = task(cfg)
    except ConfigError as err:
        # A user error gets one message, not a traceback wall; exit code 2 like argparse.
        _print_error("config error", err.message)
        _remove_if_empty(cfg)
        raise SystemExit(2) from None
    except (CheckpointWriteError, NonFiniteError) as err:
        _print_error("run stopped", str(err))
        raise SystemExit(1) from None
    from lightning.pytorch.utilities import rank_zero_only

    if rank_zero_only.rank == 0:
        print_summary(metrics, cfg)
    return metrics


def _remove_if_empty(cfg: DictConfig) -> None:
    """A rejected run leaves no trace: Hydra made its run dir before the config was checked, and a
    check at setup (the component contracts) comes after the logger made its version dir. Only
    empty directories go; a dir with any file in it (an earlier run's) stays as it is."""
    root = Path(cfg.paths.output_dir)
    with contextlib.suppress(Exception):  # not made: nothing to do
        for folder in sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            with contextlib.suppress(OSError):  # not empty
                folder.rmdir()
        root.rmdir()


def _print_error(kind: str, message: str) -> None:
    import rich.console
    import rich.markup

    console = rich.console.Console(stderr=True, highlight=False)
    console.print(f"[bold red]multiloss: {kind}:[/] {rich.markup.escape(message)}", soft_wrap=True)


def print_summary(metrics: dict[str, float], cfg: DictConfig) -> None:
    """The end of a run: every final value (the last row's training losses, the last validation) and the run dir."""
    import rich.console
    import rich.table

    table = rich.table.Table(show_edge=False, box=None)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name in sorted(metrics, key=lambda n: (not n.startswith("loss/"), n)):
        table.add_row(name, f"{metrics[name]:.4g}")
    out = Path(cfg.paths.output_dir)
    console = rich.console.Console(highlight=False)
    if metrics:
        console.print("multiloss: final values")  # not the table's title: rich wraps that to the table's width
        console.print(table)
    last = out / "checkpoints" / "last.ckpt"
    resume = f"; resume: ckpt_path={last}" if last.is_file() else ""
    console.print(f"multiloss: outputs in {out}{resume}", soft_wrap=True)
