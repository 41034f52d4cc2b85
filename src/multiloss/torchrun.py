"""A restart of ``torchrun --max-restarts`` joins a process group of its own."""

from __future__ import annotations

import os
from typing import Any

import torch

from multiloss import lightning_internals as internals


def join_this_torchrun_attempt(strategy: Any) -> None:
    """Under a restart of ``torchrun --max-restarts``, start ``strategy``'s process group on keys of its own.

    torchrun keeps one store (its agent's) for every restart of the workers, while the process
    group's rendezvous assumes a fresh store per attempt: a restarted rank could read the address a
    dead rank of the last attempt published, and fail or hang ("Gloo connectFullMesh failed ...
    Connection refused"). Each attempt's keys get a prefix of their own; the strategy's own
    group setup then finds the group made (called before it: DDP's ``setup_distributed``, FSDP's
    ``setup_environment``). Nothing happens outside a restart.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt == "0" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    strategy.set_world_ranks()
    env = strategy.cluster_environment
    assert env is not None
    timeout = internals.process_group_timeout(strategy)
    store = torch.distributed.TCPStore(
        env.main_address, env.main_port, world_size=env.world_size(), is_master=False, timeout=timeout
    )
    torch.distributed.init_process_group(
        internals.process_group_backend(strategy),
        rank=env.global_rank(),
        world_size=env.world_size(),
        store=torch.distributed.PrefixStore(f"multiloss/attempt_{attempt}", store),
        timeout=timeout,
    )
