"""The run dir's log file (``train.log``), written only by a run that was accepted.

Hydra opens its job's log file in the run dir before the task starts, and anything logged while the
config is still being checked went into it: a rejected run aimed at an earlier run's dir appended
Hydra's own error line ("Error getting object at ...") to that run's ``train.log``. `RunLogFile`
(Hydra's file handler, ``configs/hydra/default.yaml``) holds what is logged until the run is
accepted (`open_run_log`, when training or an evaluation starts), then writes it and everything
after; a run refused before that leaves the file as it was, or no file at all.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

_HELD_AT_MOST = 1000  # records held before the run starts: a config check logs a few


class RunLogFile(logging.FileHandler):
    """`logging.FileHandler` that holds its records until `open_run_log`, and never opens a file before."""

    def __init__(self, filename: str, mode: str = "a", encoding: str | None = None, **kwargs: Any) -> None:
        kwargs.pop("delay", None)
        super().__init__(filename, mode, encoding, delay=True, **kwargs)
        self.held: list[logging.LogRecord] | None = []  # None once the run is accepted

    def emit(self, record: logging.LogRecord) -> None:
        if self.held is None:
            super().emit(record)
        elif len(self.held) < _HELD_AT_MOST:
            self.held.append(record)

    def open(self, rank: int | None = None) -> None:
        """The run is accepted: write what was held, and from now on every record as it comes.

        ``rank``: this process's global rank, known only now. The file is ``<name>.log`` on rank zero and
        ``<name>_rank<rank>.log`` on the others, whatever the name composed at start-up said (a node's launching
        process of a multi-node run was named as rank zero, its ranks by their local rank: two nodes sharing a run
        dir would write into the same files)."""
        if rank is not None and self.held is not None:
            path = Path(self.baseFilename)
            stem = re.sub(r"_rank\d+$", "", path.stem)
            self.baseFilename = str(path.with_name(f"{stem}{f'_rank{rank}' if rank else ''}{path.suffix}"))
        held, self.held = self.held or [], None
        for record in held:
            super().emit(record)


def open_run_log(rank: int | None = None) -> None:
    """Accept this process's run (of global rank ``rank``): its `RunLogFile` handlers write from now on (a no-op
    without one)."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, RunLogFile):
            handler.open(rank)
