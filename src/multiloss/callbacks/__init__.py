"""Lightning callbacks multiloss adds to every run or offers in ``configs/callbacks``."""

from multiloss.callbacks.checkpoint import Checkpoint, LearningRateMonitor
from multiloss.callbacks.conflicts import ConflictMonitor
from multiloss.callbacks.json_record import JsonRecord
from multiloss.callbacks.leaks import GraphLeakDetector
from multiloss.callbacks.nonfinite import NonFiniteError, NonFiniteGuard
from multiloss.callbacks.plots import LoggedCurvesPlot, LossCurves, read_metrics
from multiloss.callbacks.preemption import Preemption, RunPreempted
from multiloss.callbacks.progress import ProgressBar
from multiloss.callbacks.rng import RngState
from multiloss.callbacks.samples import GeneratedSamplesPlot, TextSamples

__all__ = [
    "Checkpoint",
    "ConflictMonitor",
    "GeneratedSamplesPlot",
    "GraphLeakDetector",
    "JsonRecord",
    "LearningRateMonitor",
    "LoggedCurvesPlot",
    "LossCurves",
    "NonFiniteError",
    "NonFiniteGuard",
    "Preemption",
    "ProgressBar",
    "RngState",
    "RunPreempted",
    "TextSamples",
    "read_metrics",
]
