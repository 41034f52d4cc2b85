"""Every use of a Lightning name that is not public API, in one place, each with the version it was read from.

Read from Lightning 2.6 (``lightning/pytorch/...``). A Lightning upgrade that moves one of these fails
`check_internals` (run by the test suite) with the name, instead of a recipe failing mid-run.
"""

from __future__ import annotations

import lightning as L
from lightning.pytorch.loops.fit_loop import _FitLoop
from lightning.pytorch.loops.loop import _Loop


class _ResumableFitLoop(_FitLoop):
    """Lightning's fit loop, restarted from a checkpoint taken at an epoch's end the same way whatever bounds the run.

    ``_FitLoop.restarting`` (``loops/fit_loop.py``, 2.6) is forced on for every run with
    ``max_steps`` set (``_iteration_based_training``), even when the checkpoint's epoch had finished:
    the restart then replays that epoch's end and counts it twice (a resumed run one epoch ahead
    of the straight run: another data order, and ``max_epochs`` reached with nothing trained).
    Here a finished epoch is not a restart whatever the bounds, as it already is without ``max_steps``.
    """

    @_Loop.restarting.setter  # type: ignore[attr-defined]
    def restarting(self, restarting: bool) -> None:
        current = self.epoch_progress.current
        epoch_unfinished = current.ready != current.processed or current.started != current.processed
        _Loop.restarting.fset(self, restarting and epoch_unfinished)


def resume_epoch_ends_exactly(trainer: L.Trainer) -> None:
    """Make ``trainer``'s fit loop restart from an epoch-end checkpoint into the next epoch (`_ResumableFitLoop`)."""
    if type(trainer.fit_loop) is _FitLoop:
        trainer.fit_loop.__class__ = _ResumableFitLoop  # same state, one property changed: no copy of the loop


def check_internals() -> list[str]:
    """The private Lightning names multiloss relies on that this Lightning no longer has (empty: all there)."""
    missing = []
    current = _FitLoop.__dict__.get("restarting")
    if not isinstance(current, property) or "_iteration_based_training" not in _FitLoop.__dict__:
        missing.append("lightning.pytorch.loops.fit_loop._FitLoop.restarting / _iteration_based_training")
    return missing
