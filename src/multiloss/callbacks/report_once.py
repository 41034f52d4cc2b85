"""One report of an error every rank of a job meets (`ReportOnce`), gathered through the job's store."""

from __future__ import annotations

import lightning as L

from multiloss import lightning_internals as internals
from multiloss.callbacks.lean import LeanCallback
from multiloss.parallel.stalls import is_stall, note_stall


class ReportOnce(LeanCallback):
    """The ranks of a job that stop on the same error agree on one to report it: the user reads it once.

    Each failing rank adds to one counter per message in the job's store (the process group's, served
    by rank zero's process, which lives until its children have exited), before Lightning tears the
    job down; the first to get there reports, the others mark the error ``reported_elsewhere`` and
    exit with the same code, silently. An error only one rank meets is reported by that rank.
    """

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if trainer.world_size > 1 and is_stall(exception):  # each rank's words differ: gathered, one reports
            note_stall(exception, trainer)
        elif trainer.world_size > 1 and not _first_to_report(str(exception)):
            exception.reported_elsewhere = True  # type: ignore[attr-defined]


def _first_to_report(message: str) -> bool:
    import hashlib

    store = internals.process_group_store()
    if store is None:
        return True
    try:
        return store.add("multiloss/reported/" + hashlib.sha1(message.encode()).hexdigest(), 1) == 1
    except Exception:  # the store is gone (rank zero's process ended): report, rather than stay silent
        return True
