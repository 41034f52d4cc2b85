"""A collective the ranks did not all reach: the run ends with one message naming each rank's hook, never hangs.

A distributed run hangs when one rank issues a collective (an all-reduce, a barrier) that another never issues,
or issues a different one first: each waits for the other. torch ends the wait after the process group's timeout
(``collective_timeout``, `multiloss.training.build_trainer`), and under ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (how the
test suite runs) at once, when the ranks' calls differ. Either way each rank gets a ``RuntimeError`` out of gloo
or torch's collective checker, raised wherever its own collective was issued. `explain_stall` turns it into
`CollectiveStalled`: which hook of which class issued which collective on this rank, and what the other ranks
say of themselves through the process group's store (which outlives a stuck collective); the first rank there
reports for all, the others stay quiet.
"""

from __future__ import annotations

import time
from types import TracebackType
from typing import Any

import lightning as L

from multiloss import lightning_internals as internals

# What gloo (a timed-out send or receive; a peer that gave up or died first), torch's collective checker (DETAIL) and
# NCCL's watchdog say.
_MARKS = (
    "Timed out waiting",
    "timed out",
    "Detected mismatch between collectives",
    "Watchdog caught collective",
    "Connection closed by peer",
    "Connection reset by peer",
)
_WAIT_FOR_OTHERS_S = 10.0  # the ranks time out within moments of each other: this long for their own words
_KEY = "multiloss/stalled"


class CollectiveStalled(RuntimeError):
    """A collective that not every rank reached (or reached in another order): the run stopped, nothing hangs."""

    reported_elsewhere = False


def is_stall(err: BaseException) -> bool:
    """Whether ``err`` is torch's word for a collective not every rank completed (one of ours already says it all)."""
    if isinstance(err, CollectiveStalled):
        return False
    return isinstance(err, RuntimeError) and any(mark in str(err) for mark in _MARKS)


def note_stall(err: BaseException, trainer: L.Trainer) -> None:
    """Called on every failing rank while the job's store is still up (`multiloss.callbacks.report_once.ReportOnce`, a
    callback's ``on_exception``, before Lightning tears anything down): post where this rank's collective was issued;
    the first rank there gathers the others' words for `explain_stall`."""
    err._multiloss_stall = _share(trainer.global_rank, where(err.__traceback__), trainer.world_size)  # type: ignore[attr-defined]


def explain_stall(
    err: BaseException, trainer: L.Trainer, timeout_s: float, checkpoint: str | None
) -> CollectiveStalled:
    """``err`` (a stalled collective, `is_stall`) as one message for the whole job: each rank's hook and collective."""
    rank = trainer.global_rank
    here = where(err.__traceback__)
    reports, first = getattr(err, "_multiloss_stall", None) or ({rank: here}, True)
    text = str(err)
    if "Detected mismatch between collectives" in text:
        why = "the ranks issued different collectives (torch's checker, TORCH_DISTRIBUTED_DEBUG=DETAIL, compared them)"
    elif "Connection closed by peer" in text or "Connection reset by peer" in text:
        why = "another rank left it (it gave up waiting, or its process ended)"
    else:
        why = f"it waited {timeout_s:g} s (collective_timeout) and not every rank joined it"
    lines = [
        f"rank {r}: {reports.get(r, 'no word (still working elsewhere, or gone)')}" for r in range(trainer.world_size)
    ]
    saved = f"last.ckpt is the last step saved: {checkpoint}" if checkpoint else "no checkpoint was saved yet"
    stalled = CollectiveStalled(
        f"a collective on rank {rank} did not complete: {why}.\n  "
        + "\n  ".join(lines)
        + "\n  A collective that one rank issues alone (a rank-zero-only callback, logger or check that reduces or"
        " waits), or a rank that stopped or is far slower; raise collective_timeout if a rank legitimately works"
        f" that long alone. {saved}"
    )
    stalled.reported_elsewhere = not first
    return stalled


def where(tb: TracebackType | None) -> str:
    """ "<collective> from <Class>.<hook>" for the traceback of a failed collective (the outermost Lightning hook of a
    callback or the module, the innermost torch.distributed call)."""
    hook, collective = None, None
    while tb is not None:
        frame = tb.tb_frame
        name, owner = frame.f_code.co_name, frame.f_locals.get("self")
        if hook is None and isinstance(owner, L.Callback | L.LightningModule) and _is_hook(name):
            hook = f"{type(owner).__name__}.{name}"
        if frame.f_code.co_filename.endswith("distributed_c10d.py"):
            collective = collective or name  # the first c10d function: the public call (barrier, all_reduce, ...)
        tb = tb.tb_next
    return f"{collective or 'a collective'} from {hook or 'outside any Lightning hook'}"


def _is_hook(name: str) -> bool:
    return (hasattr(L.Callback, name) or hasattr(L.LightningModule, name)) and (
        name.startswith("on_") or name.endswith("_step") or name in ("setup", "teardown", "configure_model")
    )


def _share(rank: int, here: str, world_size: int) -> tuple[dict[int, str], bool]:
    """Post this rank's words in the job's store; the first rank to post waits a moment for the others' and
    reports. Without a store (gone, or never made) this rank reports what it knows."""
    store = internals.process_group_store()
    if store is None:
        return {rank: here}, True
    try:
        store.set(f"{_KEY}/{rank}", here)
        first = store.add(_KEY, 1) == 1
        reports = {rank: here}
        deadline = time.monotonic() + (_WAIT_FOR_OTHERS_S if first else 0)
        while first and len(reports) < world_size and time.monotonic() < deadline:
            for other in range(world_size):
                if other not in reports and store.check([f"{_KEY}/{other}"]):
                    reports[other] = store.get(f"{_KEY}/{other}").decode()
            time.sleep(0.1)
        return reports, first
    except Exception:  # the store is gone (its rank's process ended): say what this rank knows
        return {rank: here}, True


def last_checkpoint(trainer: Any) -> str | None:
    """The path of the newest ``last.ckpt`` the run's checkpoint callback saved, if any."""
    callback = getattr(trainer, "checkpoint_callback", None)
    path = internals.last_saved(callback) if callback is not None else ""
    return path or None
