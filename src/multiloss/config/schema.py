"""Typed top-level keys of the composed config (Hydra structured config).

Registered in Hydra's ConfigStore as ``train_schema`` and listed first in ``configs/train.yaml``'s
defaults, so Hydra itself rejects ``seed=abc`` with the key and value before our code runs.
The component nodes (``data``, ``model``, ``trainer``, ...) stay free-form here: they are checked
against the signatures of their ``_target_`` classes by `multiloss.config.validate`, which
follows Lightning's own argument list instead of a hand-copied one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

# Config groups whose options belong under the recipe's node (`# @package model.<group>`).
COMPONENT_GROUPS = ("net", "generator", "discriminator", "tasks", "optimizer", "balancer", "scheduler")


@dataclass
class TrainSchema:
    seed: int = 0
    ckpt_path: str | None = None
    print_config: bool = True
    overwrite: bool = False
    nonfinite: str = "stop"
    collective_timeout: float = 1800.0
    rendezvous_timeout: float = 300.0
    # What a checkpoint may name beyond the shipped configs' targets: false, true (all: a checkpoint you would run as
    # code) or a list of packages (multiloss.saving.trust). Given on the command line only, never carried.
    trust_checkpoint: Any = False
    # The examples an optimizer step sees over all ranks: model.accumulate_grad_batches derived from it (null: set k).
    global_batch_size: int | None = None
    # A sweeper's objective (hparams_search): the final metric a run returns, as a float.
    optimized_metric: str | None = None
    data: Any = MISSING
    model: Any = MISSING
    trainer: Any = MISSING
    logger: Any = None
    callbacks: Any = None
    paths: Any = MISSING
    # Options of the component groups belong under `model` (`# @package model.<group>`); one whose
    # file lacks that header lands here, and `check_config` says what to add instead of Hydra's
    # "Key 'net' not in 'TrainSchema'".
    net: Any = None
    generator: Any = None
    discriminator: Any = None
    tasks: Any = None
    optimizer: Any = None
    balancer: Any = None
    scheduler: Any = None


def register() -> None:
    ConfigStore.instance().store(name="train_schema", node=TrainSchema)
