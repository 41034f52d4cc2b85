"""Every use of a Lightning (or torch) name that is not public API, in one place, with the version it was read from.

Read from Lightning 2.6 (``lightning/pytorch/...``) and torch 2.13. An upgrade that moves one of these
fails `check_internals` (run by the test suite) with the name, instead of a recipe failing mid-run.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.loops.fit_loop import _FitLoop
from lightning.pytorch.loops.loop import _Loop
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop


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


def validation_follows(trainer: L.Trainer) -> bool:
    """Whether Lightning validates right after the training batch whose ``on_train_batch_end`` is running.

    ``_TrainingEpochLoop._should_check_val_fx`` (``loops/training_epoch_loop.py``, 2.6), the test its
    ``on_advance_end`` runs once the batch's hooks have returned.
    """
    loop = trainer.fit_loop.epoch_loop
    return not loop._skip_next_val and loop._should_check_val_fx(trainer.fit_loop._data_fetcher)


def process_group_store() -> Any:
    """The key-value store of the default process group (None without one): ``distributed_c10d._get_default_store``
    (torch 2.13), the store every rank of the job reaches without a collective."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.distributed_c10d._get_default_store()


def check_internals() -> list[str]:
    """The private Lightning names multiloss relies on that this Lightning no longer has (empty: all there)."""
    missing = []
    current = _FitLoop.__dict__.get("restarting")
    if not isinstance(current, property) or "_iteration_based_training" not in _FitLoop.__dict__:
        missing.append("lightning.pytorch.loops.fit_loop._FitLoop.restarting / _iteration_based_training")
    epoch_loop = _TrainingEpochLoop
    if not hasattr(epoch_loop, "_should_check_val_fx") or "_skip_next_val" not in _init_names(epoch_loop):
        missing.append("lightning.pytorch.loops.training_epoch_loop._TrainingEpochLoop._should_check_val_fx")
    import torch.distributed as dist

    if dist.is_available() and not hasattr(dist.distributed_c10d, "_get_default_store"):
        missing.append("torch.distributed.distributed_c10d._get_default_store")
    if "_data_fetcher" not in _init_names(_FitLoop):
        missing.append("lightning.pytorch.loops.fit_loop._FitLoop._data_fetcher")
    return missing


def _init_names(cls: type) -> set[str]:
    """The attribute names ``cls.__init__`` assigns (``self.<name> =``), read from its source."""
    import inspect
    import re

    return set(re.findall(r"self\.(\w+)\s*[:=]", inspect.getsource(cls.__init__)))
