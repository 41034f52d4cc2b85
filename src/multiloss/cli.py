"""What ``python train.py`` does with a composed config: run it, or print a user error cleanly.

Torch and Lightning are imported inside `run`, once Hydra has a config to run: ``--help``,
``--cfg job`` and config errors found while composing never pay for them. A finished run ends with
a summary: every final value and where the outputs are (rank zero only).
"""

from __future__ import annotations

from omegaconf import DictConfig


def run(cfg: DictConfig) -> dict[str, float]:
    import logging

    import rich.console
    import rich.markup

    from multiloss.quiet import silence_known_noise

    silence_known_noise()  # before Lightning and torchdata are imported: some warn at import or first use
    from multiloss.callbacks import NonFiniteError
    from multiloss.checkpoints import CheckpointWriteError
    from multiloss.config import ConfigError
    from multiloss.training import train

    # Imported after Hydra set up logging, Lightning does not add its own console handler and its
    # lines go through Hydra's (into a run dir's train.log, even a rejected run's): set it up as
    # Lightning does when imported first.
    for name in ("lightning.pytorch", "lightning.fabric"):
        lightning_log = logging.getLogger(name)
        if not lightning_log.handlers:
            lightning_log.addHandler(logging.StreamHandler())
            lightning_log.propagate = False

    console = rich.console.Console(stderr=True, highlight=False)
    try:
        metrics = train(cfg)
    except ConfigError as err:
        # A user error gets one message, not a traceback wall; exit code 2 like argparse.
        console.print(f"[bold red]multiloss: config error:[/] {rich.markup.escape(err.message)}", soft_wrap=True)
        raise SystemExit(2) from None
    except (CheckpointWriteError, NonFiniteError) as err:
        console.print(f"[bold red]multiloss: run stopped:[/] {rich.markup.escape(str(err))}", soft_wrap=True)
        raise SystemExit(1) from None
    from lightning.pytorch.utilities import rank_zero_only

    if rank_zero_only.rank == 0:
        print_summary(metrics, cfg)
    return metrics


def print_summary(metrics: dict[str, float], cfg: DictConfig) -> None:
    """The end of a run: every final value (the last row's training losses, the last validation) and the run dir."""
    from pathlib import Path

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
