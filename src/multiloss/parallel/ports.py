"""The port of a one-node run's store, held by rank 0's process from the moment it is chosen until the store listens.

The usual way to pick a port (Lightning's ``find_free_network_port``, torch's tests: bind to port 0, read the number,
close) leaves it free for anyone between the close and the store's own bind. On a shared node another job, or a test
worker next door, takes it in that moment: rank 0 then cannot listen (EADDRINUSE) and its ranks reach a stranger's
store. Here the socket stays bound, but not listening, from the choice until rank 0's ``TCPStore`` takes it over
(``master_listen_fd``): nobody else can bind it, and a rank that connects early is refused (and retries) rather than
queued at a store that does not exist yet. Nothing here imports torch: `hold` runs before the imports
(`multiloss.parallel.early_ranks`).
"""

from __future__ import annotations

import contextlib
import os
import socket
import uuid

RUN_ID = "MULTILOSS_RUN_ID"  # the run's identity, the same on every rank (`run_identity`)

_held: dict[int, socket.socket] = {}


def hold() -> int:
    """A port of this host bound now and held by this process until `take` (or `release`); its number."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("", 0))  # the kernel's choice among the ports nobody holds; held from here on
    port = int(sock.getsockname()[1])
    _held[port] = sock
    return port


def take(port: int) -> int | None:
    """The file descriptor of ``port``'s held socket, handed over to the caller (a store that will listen on it);
    None when this process does not hold ``port``."""
    sock = _held.pop(port, None)
    return None if sock is None else sock.detach()


def release(port: int | None = None) -> None:
    """Close the held socket of ``port`` (every held socket when None): the run that held it will not host a store."""
    for held in list(_held) if port is None else [port]:
        sock = _held.pop(held, None)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()


def new_run_id() -> str:
    """A run id nobody else has: for the ranks one process starts itself."""
    return uuid.uuid4().hex[:16]


def run_identity(world_size: int, command: list[str] | None = None) -> str:
    """Who this run is, the same on each of its ``world_size`` ranks and on no other run's: the key every rendezvous
    key and process-group key lives under.

    ``MULTILOSS_RUN_ID`` when set (the ranks a multiloss process starts itself get a random one, and a user may set
    one for nodes started by hand); under SLURM the job, the step and the attempt (a requeue is a new rendezvous);
    under torchrun its run id and restart; otherwise the command each node was started with (``command``: the job's
    overrides), which is all that nodes started by hand share.
    """
    if os.environ.get(RUN_ID):
        return os.environ[RUN_ID]
    if os.environ.get("SLURM_JOB_ID") and os.environ.get("SLURM_STEP_ID"):
        attempt = os.environ.get("SLURM_RESTART_COUNT", "0")
        return f"slurm-{os.environ['SLURM_JOB_ID']}.{os.environ['SLURM_STEP_ID']}.{attempt}"
    elastic = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if elastic and elastic != "none":  # torchrun's static rendezvous calls every run "none"
        return f"torchrun-{elastic}.{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    import hashlib
    import json

    said = json.dumps([command or [], world_size])
    return f"command-{hashlib.sha1(said.encode()).hexdigest()[:16]}"


__all__ = ["RUN_ID", "hold", "new_run_id", "release", "run_identity", "take"]
