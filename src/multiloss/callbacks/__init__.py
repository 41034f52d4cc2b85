"""Lightning callbacks multiloss adds to every run or offers in ``configs/callbacks``."""

from multiloss.callbacks.checkpoint import Checkpoint
from multiloss.callbacks.conflicts import ConflictMonitor
from multiloss.callbacks.leaks import GraphLeakDetector
from multiloss.callbacks.nonfinite import NonFiniteError, NonFiniteGuard
from multiloss.callbacks.plots import LossCurves, read_metrics
from multiloss.callbacks.progress import ProgressBar
from multiloss.callbacks.rng import RngState

__all__ = [
    "Checkpoint",
    "ConflictMonitor",
    "GraphLeakDetector",
    "LossCurves",
    "NonFiniteError",
    "NonFiniteGuard",
    "ProgressBar",
    "RngState",
    "read_metrics",
]
