"""The ranks meet before the process group is made, in a store that belongs to their run alone, with a bounded wait
of their own that says what it waits for.

Left to torch, a rank waits for the others inside ``init_process_group`` for the whole collective timeout (30 min by
default), in silence, and a node that was never started ends the run in a long ``DistStoreError`` traceback. Here
every rank announces itself in the job's store (the one the process group is then made on: nothing else to open),
rank zero's node says within seconds who is missing, where they must connect and how nodes are started, and after
``rendezvous_timeout`` seconds every rank stops with one message.

On a shared node the port may belong to someone else: another job given the same ``MASTER_PORT``, a port derived from
job ids that collide, a program that listens there. Rank zero writes the run's identity (`ports.run_identity`) into
the store it hosts, and every key of the rendezvous and of the process group lives under it, so a rank of another
run can neither count itself in nor read this run's keys. A rank that reaches a store of another run, a store that
is no multiloss rendezvous, or a listener that never answers as a store stops within seconds with one line saying
what it found; rank zero that cannot listen says the port is taken. Every wait here ends by ``rendezvous_timeout``
whatever the other side does (torch's own store client waits for ever on a peer that accepts and never answers).

A restart of ``torchrun --max-restarts`` joins a process group of its own (`join_this_torchrun_attempt`); under
torchrun without restarts its agent has already met the ranks, and torch's own rendezvous on the agent's store is
kept.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch

from multiloss import lightning_internals as internals
from multiloss.parallel import ports
from multiloss.parallel.stalls import CollectiveStalled

OWNER = "multiloss/owner"  # the one key outside a run's own keys: whose store this is
NOTICE_AFTER_S = 5.0  # a one-node job meets in well under this; past it, a rank is missing
NOTICE_EVERY_S = 60.0
DEFAULT_TIMEOUT_S = 300.0
# A store answers a connection at once (its own thread serves it): what has not answered in this long is no store.
HANDSHAKE_S = 10.0
# Rank zero names the store's run right after it listens: a store without a name after this long is no rendezvous.
OWNER_GRACE_S = 10.0
Result = TypeVar("Result")


class RendezvousIncomplete(CollectiveStalled):
    """The ranks did not meet: a rank missing after ``rendezvous_timeout``, a port another process holds, or a store
    that is not this run's. The run stopped before its process group, having written nothing."""


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
        ports.run_identity(env.world_size(), _command()),
    )
    # What Lightning's own setup (which now finds the group made) would have done around it: the address in the
    # environment, the device, and NCCL's group ended at exit (torch warns of one left undestroyed).
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = env.main_address, str(env.main_port)
    device, backend = strategy.root_device, internals.process_group_backend(strategy)
    make_group(
        store,
        backend,
        env.global_rank(),
        env.world_size(),
        device,
        internals.process_group_timeout(strategy),
        getattr(strategy, "rendezvous_timeout", DEFAULT_TIMEOUT_S),
    )
    if backend == "nccl":
        atexit.register(internals.destroy_process_group)


def make_group(
    store: torch.distributed.Store,
    backend: str,
    rank: int,
    world_size: int,
    device: torch.device,
    timeout: timedelta,
    bound_s: float,
) -> None:
    """The default process group on the keys of the ranks that met (`meet`), made within ``bound_s`` seconds or the
    process ends with one line.

    Every rank has joined by now, so the group is made in a moment; a rank that stopped in between (killed, out of
    memory) would leave the others waiting inside ``init_process_group`` (gloo's and NCCL's connection to each peer)
    for the collective timeout, 30 minutes by default. A watchdog ends that wait at ``bound_s`` (rendezvous_timeout).
    """

    def give_up() -> None:
        print(
            f"multiloss: run stopped: rank {rank}'s process group was not made within {bound_s:g} s "
            "(rendezvous_timeout) of every rank joining: a rank stopped in between (killed, or out of memory?)",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)  # the wait is inside torch's C++: nothing to unwind to

    watchdog = threading.Timer(bound_s, give_up)
    watchdog.daemon = True
    watchdog.start()
    try:
        torch.distributed.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            store=torch.distributed.PrefixStore("group", store),
            timeout=timeout,
            device_id=device if device.type != "cpu" else None,
        )
    finally:
        watchdog.cancel()


def _command() -> list[str]:
    """What every node of a run started by hand shares: the job's overrides as given (``sys.argv`` outside Hydra)."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return list(HydraConfig.get().overrides.task)
    return sys.argv[1:]


def meet(
    host: str,
    port: int,
    rank: int,
    world_size: int,
    local_rank: int,
    timeout_s: float,
    shape: str,
    run_id: str,
) -> torch.distributed.Store:
    """The run ``run_id``'s keys in the store at ``host:port`` (rank zero hosts it), once all ``world_size`` ranks
    have joined it.

    Raises:
        RendezvousIncomplete: after ``timeout_s`` seconds with a rank missing or the host unreachable as long; at
            once when rank zero cannot listen on ``port``, or when the store there is not this run's (another run's,
            no multiloss rendezvous, or no store at all).
    """
    speaks = local_rank == 0  # one voice a node, where every rank would say the same
    started = time.monotonic()
    deadline = started + timeout_s
    where = f"{host}:{port}"
    if rank == 0:
        store = _host(host, port, world_size, timeout_s)
        store.set(OWNER, run_id)  # before anyone is counted: a rank checks it first
    else:
        store = _reach(host, port, world_size, rank, deadline, timeout_s)
        _check_owner(store, where, rank, run_id, deadline)
    keys = torch.distributed.PrefixStore(f"multiloss/run/{run_id}", store)
    noticed_at = None
    try:
        joined = keys.add("joined", 1)
        while joined < world_size:
            waited = time.monotonic() - started
            if waited > timeout_s:
                raise _stopped(
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
            joined = keys.add("joined", 0)
    except torch.distributed.DistError as err:  # rank zero's store went away (its process ended) while we waited
        raise _stopped(
            f"rank {rank} lost rank 0's store at {where} before every rank joined (rank 0's process ended?): "
            f"{_said(err)}",
            True,
        ) from None
    return keys


def _host(host: str, port: int, world_size: int, timeout_s: float) -> torch.distributed.TCPStore:
    """Rank zero's store, listening on ``port`` (on the socket this process held for it, if it holds one)."""
    held = ports.take(port)
    try:
        return torch.distributed.TCPStore(
            host,
            port,
            world_size,
            is_master=True,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=held,
        )
    except (RuntimeError, TimeoutError) as err:  # DistNetworkError
        text = str(err)
        if "EADDRINUSE" in text or "address already in use" in text.lower():
            why = f"port {port} on this host is in use by another process: rank 0 cannot host this run's store there"
        else:
            why = f"rank 0 could not host this run's store on port {port}: {_said(err)}"
        # The ranks this process started stop with it (`HydraJobLauncher.note_failure`); those of other nodes, which
        # cannot hear from it, end by what they find at the port or by rendezvous_timeout.
        raise _stopped(f"{why}; {_ANOTHER_PORT}", True) from None


def _reach(
    host: str, port: int, world_size: int, rank: int, deadline: float, timeout_s: float
) -> torch.distributed.TCPStore:
    """A client of the store at ``host:port`` once something listens there and answers as a store.

    A refused or unreachable address is retried (rank zero may not be up yet) until ``deadline``. Something that
    accepts the connection gets `HANDSHAKE_S` to answer as a store: torch's client would wait for it for ever.
    """
    where = f"{host}:{port}"
    pause, last = 0.05, "nothing listened there"
    while (remaining := deadline - time.monotonic()) > 0:
        try:
            socket.create_connection((host, port), timeout=min(remaining, 5.0)).close()
        except OSError as err:  # refused, unreachable, unknown host: not up yet, or never
            last = _said(err)
            time.sleep(min(pause, max(deadline - time.monotonic(), 0)))
            pause = min(pause * 2, 1.0)
            continue
        bound = min(HANDSHAKE_S, remaining)
        try:
            store = _within(
                bound,
                lambda: torch.distributed.TCPStore(
                    host, port, world_size, is_master=False, timeout=timedelta(seconds=remaining)
                ),
            )
        except (RuntimeError, TimeoutError) as err:  # it closed the connection instead of answering
            raise _stopped(
                f"rank {rank} reached {where}, where something accepted the connection and closed it without "
                f"answering as a store ({_said(err)}): a program other than this run's rank 0 holds that port; "
                f"{_ANOTHER_PORT}",
                True,
            ) from None
        if store is None:
            raise _stopped(
                f"rank {rank} reached {where}, where something accepted the connection and did not answer as a "
                f"store in {bound:g} s: a program other than this run's rank 0 holds that port; {_ANOTHER_PORT}",
                True,
            )
        return store
    raise _stopped(
        f"rank {rank} could not reach rank 0's store at {where} in {timeout_s:g} s (rendezvous_timeout): {last}", True
    )


def _check_owner(store: torch.distributed.Store, where: str, rank: int, run_id: str, deadline: float) -> None:
    """Go on only in this run's own store: rank zero names it as soon as it listens."""
    named_by = min(time.monotonic() + OWNER_GRACE_S, deadline)
    try:
        while not store.check([OWNER]):
            if time.monotonic() > named_by:
                raise _stopped(
                    f"rank {rank} reached {where}, a key-value store that is no multiloss rendezvous (no run has "
                    f"named it its own): another program holds that port; {_ANOTHER_PORT}",
                    True,
                )
            time.sleep(0.05)
        owner = store.get(OWNER).decode(errors="replace")
    except torch.distributed.DistError as err:
        raise _stopped(f"rank {rank} lost the store at {where} while reading whose it is: {_said(err)}", True) from None
    if owner != run_id:
        raise _stopped(
            f"rank {rank} reached {where}, the store of another run (run id {owner!r}; this run is {run_id!r}): "
            f"another job holds that port, and this rank joins no other run; {_ANOTHER_PORT}",
            True,
        )


_ANOTHER_PORT = (
    "give this run a port of its own (MASTER_PORT=<another port> on every node; under SLURM, MASTER_PORT in the batch "
    "script), or on one node leave MASTER_PORT unset: multiloss then holds a free port of its own"
)


def _within(seconds: float, call: Callable[[], Result]) -> Result | None:
    """``call()``'s result if it returns within ``seconds``, else None (the call goes on in a daemon thread, which
    the process's exit abandons: torch's store client releases the GIL while it waits). An error it raises is
    raised here."""
    outcome: dict[str, Any] = {}

    def attempt() -> None:
        try:
            outcome["value"] = call()
        except BaseException as err:  # handed to the caller
            outcome["error"] = err

    thread = threading.Thread(target=attempt, name="multiloss-store-handshake", daemon=True)
    thread.start()
    thread.join(seconds)
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def _said(err: BaseException) -> str:
    return " ".join(str(err).split())[:200]


def _how_nodes_start(port: int) -> str:
    return (
        "every node must be started and reach that address and port: under SLURM, srun (or hydra/launcher=slurm) "
        "starts them all; otherwise run the same command on each node with NODE_RANK=<n> MASTER_ADDR=<rank 0's "
        f"address> MASTER_PORT={port} set, or torchrun --nnodes=<N> --node_rank=<n> --master_addr=<address> on "
        "each; on one machine, trainer.num_nodes=1 and trainer.devices=<processes>"
    )


def _stopped(message: str, speaks: bool) -> RendezvousIncomplete:
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
