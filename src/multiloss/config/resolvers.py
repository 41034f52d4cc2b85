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
    if job := os.environ.get("SLURM_JOB_ID"):
        # Also for one task: a job SLURM requeues keeps its id, so it finds its own run dir (and
        # last.ckpt) again, where the clock would give it a new one.
        array = os.environ.get("SLURM_ARRAY_JOB_ID")
        job = f"{array}_{os.environ.get('SLURM_ARRAY_TASK_ID')}" if array else job
        return f"slurm-{job}-{os.environ.get('SLURM_STEP_ID', 'batch')}"
    return datetime.now().strftime(fmt)


def outside_rank() -> int:
    """This process's rank when torchrun or srun started the ranks (each composes its own config), else 0."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return int(os.environ.get("RANK", "0"))
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return int(os.environ.get("SLURM_PROCID", "0"))
    return 0


def job_name(name: str) -> str:
    """``name`` for rank zero, ``name_rank<k>`` for rank k of a torchrun or srun launch: one log file each."""
    rank = outside_rank()
    return f"{name}_rank{rank}" if rank else name


def gpus_per_node(accelerator: object, devices: object) -> object:
    """SLURM's ``--gpus-per-node`` for a Trainer: its devices when the accelerator names a GPU, else none.

    ``auto`` asks for none: a node without GPUs refuses a job that requests them (``Invalid generic
    resource``), and a job that wants them says so (``trainer=ddp`` / ``trainer=gpu``)."""
    return devices if str(accelerator) in ("gpu", "cuda") else None


def register() -> None:
    if not OmegaConf.has_resolver("multiloss_run_stamp"):
        OmegaConf.register_new_resolver("multiloss_run_stamp", run_stamp, use_cache=True)
    if not OmegaConf.has_resolver("multiloss_job_name"):
        OmegaConf.register_new_resolver("multiloss_job_name", job_name)
    if not OmegaConf.has_resolver("multiloss_cpus_per_task"):
        OmegaConf.register_new_resolver("multiloss_cpus_per_task", lambda workers: int(workers or 0) + 1)
    if not OmegaConf.has_resolver("multiloss_gpus_per_node"):
        OmegaConf.register_new_resolver("multiloss_gpus_per_node", gpus_per_node)
