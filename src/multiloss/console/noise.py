"""Known third-party noise, silenced where it is emitted, one message at a time; every other warning stays.

A run used to open with three lines no user can act on: Lightning's advertisement for its cloud
logger (and, with checkpointing, for its model registry), torchdata's call of torch's deprecated
``set_vital``, and Lightning's pytree shim tripping torch's ``LeafSpec`` deprecation; ``balancer=nash_mtl`` added
cvxpy's "not DPP" (what it means: below). Each is
matched by its own text, so a new or real warning from the same packages still shows.
"""

from __future__ import annotations

import logging
import warnings

# (message regex, category) of warnings that say nothing about the user's run.
KNOWN_WARNINGS = (
    (r"'set_vital' is deprecated", UserWarning),  # torchdata's StatefulDataLoader calls torch.set_vital
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", Warning),  # lightning.pytorch.utilities._pytree
    # torchjd's NashMTL solves a cvxpy problem whose parameters multiply each other (GᵀG·α), so cvxpy cannot cache
    # its compiled form between steps ("not DPP"): each step's solve compiles it again, the same answer, slower.
    (r"You are solving a parameterized problem that is not DPP", UserWarning),
)
# Lightning's rank-zero info lines that advertise its products ("💡 Tip: ... litlogger / litmodels").
TIP_PREFIX = "💡 Tip:"


class _NoTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(TIP_PREFIX)


def silence_known_noise() -> None:
    """Install the filters (idempotent): the warnings above, and Lightning's product tips."""
    for message, category in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NoTips) for f in logger.filters):
            logger.addFilter(_NoTips())
