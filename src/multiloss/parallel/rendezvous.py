"""The ranks meet before the process group is made, with a bounded wait of their own that says what it waits for.

Left to torch, a rank waits for the others inside ``init_process_group`` for the whole collective timeout (30 min by
default), in silence, and a node that was never started ends the run in a long ``DistStoreError`` traceback. Here
every rank announces itself in the job's store (the one the process group is then made on: nothing else to open),
rank zero's node says within seconds who is missing, where they must connect and how nodes are started, and after
``rendezvous_timeout`` seconds every rank stops with one message.

A restart of ``torchrun --max-restarts`` joins a process group of its own (`join_this_torchrun_attempt`); under
torchrun without restarts its agent has already met the ranks, and torch's own rendezvous on the agent's store is
kept.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch

from multiloss import lightning_internals as internals
from multiloss.parallel.stalls import CollectiveStalled

JOINED = "multiloss/rendezvous/joined"
NOTICE_AFTER_S = 5.0  # a one-node job meets in well under this; past it, a rank is missing
NOTICE_EVERY_S = 60.0
DEFAULT_TIMEOUT_S = 300.0


class RendezvousIncomplete(CollectiveStalled):
    """Not every rank of the job joined within ``rendezvous_timeout``: the run stopped before its process group."""


def start_process_group(strategy: Any) -> None:
    """``strategy``'s process group made on a store the ranks met in first (`meet`); the strategy's own setup then
    finds it made. Under torchrun, the agent's store (`join_this_torchrun_attempt`)."""
    if torch.distributed.is_initialized():  # made already (a process that runs several jobs in one group)
        return
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        join_this_torchrun_attempt(strategy)
        return
    strategy.set_world_ranks()
    env = strategy.cluster_environment
    assert env is not None
    store = meet(
        env.main_address,
        env.main_port,
        env.global_rank(),
        env.world_size(),
        strategy.local_rank,
        getattr(strategy, "rendezvous_timeout", DEFAULT_TIMEOUT_S),
        f"trainer.num_nodes={strategy.num_nodes} × {strategy.num_processes} processes",
    )
    # What Lightning's own setup (which now finds the group made) would have done around it: the address in the
    # environment, the device, and NCCL's group ended at exit (torch warns of one left undestroyed).
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = env.main_address, str(env.main_port)
    device, backend = strategy.root_device, internals.process_group_backend(strategy)
    torch.distributed.init_process_group(
        backend,
        rank=env.global_rank(),
        world_size=env.world_size(),
        store=torch.distributed.PrefixStore("multiloss/group", store),
        timeout=internals.process_group_timeout(strategy),
        device_id=device if device.type != "cpu" else None,
    )
    if backend == "nccl":
        atexit.register(internals.destroy_process_group)


def meet(
    host: str, port: int, rank: int, world_size: int, local_rank: int, timeout_s: float, shape: str
) -> torch.distributed.TCPStore:
    """The job's store at ``host:port`` (rank zero hosts it) once all ``world_size`` ranks have joined it.

    Raises:
        RendezvousIncomplete: after ``timeout_s`` seconds with a rank missing, or the host unreachable as long.
    """
    speaks = local_rank == 0  # one voice a node
    started = time.monotonic()
    where = f"{host}:{port}"
    try:
        store = torch.distributed.TCPStore(
            host, port, world_size, is_master=rank == 0, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
        )
    except (RuntimeError, TimeoutError) as err:  # DistNetworkError / DistStoreError: RuntimeErrors
        raise _incomplete(
            f"rank {rank} could not reach rank 0's store at {where} in {timeout_s:g} s (rendezvous_timeout): "
            f"{' '.join(str(err).split())[:200]}",
            speaks,
        ) from None
    joined = store.add(JOINED, 1)
    noticed_at = None
    while joined < world_size:
        waited = time.monotonic() - started
        if waited > timeout_s:
            raise _incomplete(
                f"{joined} of {world_size} ranks ({shape}) joined at {where} in {timeout_s:g} s "
                f"(rendezvous_timeout); {_how_nodes_start(port)}",
                speaks,
            )
        due = NOTICE_AFTER_S if noticed_at is None else noticed_at + NOTICE_EVERY_S
        if speaks and waited >= due:
            noticed_at = waited
            print(
                f"multiloss: waiting for the other ranks: {joined} of {world_size} ({shape}) have joined at "
                f"{where} after {waited:.0f} s; {_how_nodes_start(port)}; giving up after {timeout_s:g} s "
                "(rendezvous_timeout)",
                file=sys.stderr,
                flush=True,
            )
        time.sleep(0.1)
        joined = store.add(JOINED, 0)
    return store


def _how_nodes_start(port: int) -> str:
    return (
        "every node must be started and reach that address and port: under SLURM, srun (or hydra/launcher=slurm) "
        "starts them all; otherwise run the same command on each node with NODE_RANK=<n> MASTER_ADDR=<rank 0's "
        f"address> MASTER_PORT={port} set, or torchrun --nnodes=<N> --node_rank=<n> --master_addr=<address> on "
        "each; on one machine, trainer.num_nodes=1 and trainer.devices=<processes>"
    )


def _incomplete(message: str, speaks: bool) -> RendezvousIncomplete:
    err = RendezvousIncomplete(message)
    err.reported_elsewhere = not speaks
    return err


def join_this_torchrun_attempt(strategy: Any) -> None:
    """Under a restart of ``torchrun --max-restarts``, start ``strategy``'s process group on keys of its own.

    torchrun keeps one store (its agent's) for every restart of the workers, while the process
    group's rendezvous assumes a fresh store per attempt: a restarted rank could read the address a
    dead rank of the last attempt published, and fail or hang ("Gloo connectFullMesh failed ...
    Connection refused"). Each attempt's keys get a prefix of their own. Nothing happens outside a restart.
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
