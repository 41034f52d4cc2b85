"""OmegaConf resolvers the Hydra tree uses (registered when `multiloss` is imported)."""

from __future__ import annotations

import os
from datetime import datetime

from omegaconf import OmegaConf


def run_stamp(fmt: str = "%Y-%m-%d_%H-%M-%S") -> str:
    """The last part of a run dir: the time, or the launch's own id when an outside launcher started the ranks.

    Under torchrun (or srun with several tasks) every rank composes its own config; ranks that
    read the clock a second apart would each make a run dir. The launch id is the same on every
    rank, so they share one.
    """
    if run_id := os.environ.get("TORCHELASTIC_RUN_ID"):
        return f"torchrun-{run_id}"
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1 and (job := os.environ.get("SLURM_JOB_ID")):
        return f"slurm-{job}-{os.environ.get('SLURM_STEP_ID', '0')}"
    return datetime.now().strftime(fmt)


def register() -> None:
    if not OmegaConf.has_resolver("multiloss_run_stamp"):
        OmegaConf.register_new_resolver("multiloss_run_stamp", run_stamp, use_cache=True)
