"""What ``python train.py`` does with a composed config: run it, or print a user error cleanly."""

from __future__ import annotations

import rich.console
import rich.markup
from omegaconf import DictConfig

from multiloss.callbacks import NonFiniteError
from multiloss.checkpoints import CheckpointWriteError
from multiloss.config import ConfigError
from multiloss.training import train


def run(cfg: DictConfig) -> dict[str, float]:
    console = rich.console.Console(stderr=True, highlight=False)
    try:
        return train(cfg)
    except ConfigError as err:
        # A user error gets one message, not a traceback wall; exit code 2 like argparse.
        console.print(f"[bold red]multiloss: config error:[/] {rich.markup.escape(err.message)}", soft_wrap=True)
        raise SystemExit(2) from None
    except (CheckpointWriteError, NonFiniteError) as err:
        console.print(f"[bold red]multiloss: run stopped:[/] {rich.markup.escape(str(err))}", soft_wrap=True)
        raise SystemExit(1) from None
