"""A node shared with other jobs: no rank joins a stranger's run, no wait outlives its bound, no rank outlives its run.

The faults of a port that belongs to someone else, each met by real ranks (``python train.py`` processes, gloo):
a listener that accepts and never answers (two nodes started by hand on one machine), a bare key-value store and one
that holds an older multiloss rendezvous's keys, another run's store, two runs started at once on one port, and a
rank 0 killed right after it hosts the store. Each ends every process of the run within seconds with one line each;
none trains in another run's process group. Then the ports themselves (held from the choice until the store listens,
never bound, closed and hoped for), the run's identity, and the ranks that end with the process that started them
(the test pool's ranks included).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from multiloss.parallel import ports, rendezvous
from multiloss.parallel.ports import RUN_ID as MULTILOSS_RUN_ID
from tests.conftest import QUIET, ROOT

pytestmark = pytest.mark.distributed

RUN = (*QUIET, "~callbacks.loss_curves", "logger=csv", "trainer=ddp_cpu")
# Ports these tests give MASTER_PORT themselves: derived from the test worker's pid, below the kernel's ephemeral
# range (where a port bound to 0 comes from) and apart from the SLURM tests' (tests/test_slurm.py, slurm_cluster.py).
OWN_PORTS = range(25000, 26000)


def _own_port(offset: int) -> int:
    return OWN_PORTS[(os.getpid() * 8 + offset) % len(OWN_PORTS)]


def _start(out: Path, *overrides: str, env: dict[str, str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *RUN, *overrides, f"hydra.run.dir={out}"],
        cwd=cwd,
        env={**os.environ, "HYDRA_FULL_ERROR": "0", "PYTHONWARNINGS": "ignore", **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _said(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("multiloss:")]


def _processes_naming(text: str) -> list[int]:
    """The pids of the processes whose command line holds ``text`` (a run dir: every rank of that run)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


class SilentListener:
    """A program that holds a port, accepts every connection and never answers."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.append(conn)

    def close(self) -> None:
        for conn in self.accepted:
            conn.close()
        self.sock.close()


def test_a_listener_that_never_answers_ends_both_nodes_in_seconds_with_one_line_a_rank(tmp_path):
    """Two nodes started by hand (NODE_RANK=0 and 1, 2 ranks each) with a MASTER_PORT a silent program holds: rank 0
    says the port is taken, the three others that they reached something that is no store; every process ends within
    seconds (torch's store client alone waits for ever there), nothing is written."""
    listener = SilentListener()
    try:
        started = time.monotonic()
        nodes = [
            _start(
                tmp_path / f"node{n}",
                "trainer.num_nodes=2",
                env={"NODE_RANK": str(n), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(listener.port)},
                cwd=tmp_path,
            )
            for n in (0, 1)
        ]
        outcome = [node.communicate(timeout=240) for node in nodes]
        took = time.monotonic() - started
    finally:
        listener.close()
    assert [node.returncode for node in nodes] == [1, 1], outcome[0][1][-3000:] + outcome[1][1][-3000:]
    assert took < 120, took  # start-up on a busy 2-core machine + the 10 s handshake, not rendezvous_timeout (300)
    port = listener.port
    # Each node's launching process says why; the rank it started stops with it, its own line only if it found the
    # port's holder first. Sorted: "port ..." before "rank ...", rank 2 before rank 3.
    lines = [sorted(_said(stderr)) for _, stderr in outcome]
    assert len(lines[0]) in (1, 2) and len(lines[1]) in (1, 2), lines
    assert lines[0][0].startswith(f"multiloss: run stopped: port {port} on this host is in use by another process")
    silent = f"reached 127.0.0.1:{port}, where something accepted the connection and did not answer as a store"
    assert all(line.startswith("multiloss: run stopped: rank 1 " + silent) for line in lines[0][1:])
    assert all(
        line.startswith(f"multiloss: run stopped: rank {r} {silent}") for r, line in zip((2, 3), lines[1], strict=False)
    ), lines[1]
    for said in (*lines[0], *lines[1]):
        assert "MASTER_PORT=<another port>" in said
    assert all("Traceback" not in stderr for _, stderr in outcome)
    assert not (tmp_path / "node0").exists() and not (tmp_path / "node1").exists()


@pytest.mark.parametrize("found", ["an older rendezvous's keys", "another run's store"])
def test_a_store_that_is_not_this_runs_is_named_and_nobody_is_counted_into_it(tmp_path, found):
    """A key-value store on the port: one holding the keys of an older multiloss rendezvous (the count its ranks met at,
    2 of 2: how a rank used to believe it had met everyone and went on into a stranger's process group), or one another
    run has named its own. A rank 1 started by hand (as torchrun or a scheduler starts one) says whose store it found,
    within seconds, and adds nothing to it. (Rank 0 on such a port: the listener's test and the unit test below.)"""
    foreign = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    if found == "another run's store":
        foreign.set(rendezvous.OWNER, "someone-elses-run")
        foreign.add("multiloss/run/someone-elses-run/joined", 2)
    else:
        foreign.add("multiloss/rendezvous/joined", 2)
    keys_before = foreign.num_keys()
    started = time.monotonic()
    run_id = f"test-{os.getpid()}"
    env = {"MASTER_PORT": str(foreign.port), MULTILOSS_RUN_ID: run_id, "WORLD_SIZE": "2", "NODE_RANK": "0"}
    rank_1 = _start(tmp_path / "run", env={**env, "LOCAL_RANK": "1"}, cwd=tmp_path)
    _, stderr = rank_1.communicate(timeout=240)
    took = time.monotonic() - started
    assert rank_1.returncode == 1, stderr[-3000:]
    assert took < 60, took  # seconds after start-up, not rendezvous_timeout (300)
    (reached,) = _said(stderr)
    assert reached.startswith(f"multiloss: run stopped: rank 1 reached 127.0.0.1:{foreign.port}")
    if found == "another run's store":
        assert f"the store of another run (run id 'someone-elses-run'; this run is '{run_id}')" in reached
        assert foreign.add("multiloss/run/someone-elses-run/joined", 0) == 2
    else:
        assert "a key-value store that is no multiloss rendezvous" in reached
        assert foreign.add("multiloss/rendezvous/joined", 0) == 2
    assert "MASTER_PORT=<another port>" in reached
    # Nothing of the run's written into it: the one key more is torch's own, its client's registration on connecting.
    assert foreign.num_keys() == keys_before + 1 and not foreign.check([f"multiloss/run/{run_id}/joined"])
    assert "Traceback" not in stderr and not (tmp_path / "run").exists()


def _trained_alone(out: Path, steps: int) -> bool:
    """Whether ``out`` holds a run whose two ranks trained there, each its own (no stranger's rank in its group)."""
    from tests.conftest import load_checkpoint

    logs = {rank: out / name for rank, name in ((0, "train.log"), (1, "train_rank1.log"))}
    for rank, log in logs.items():
        if not log.is_file() or f"on rank {rank} of 2 into {out}" not in log.read_text():
            return False
    return load_checkpoint(out / "checkpoints" / "last.ckpt")["global_step"] == steps


def test_two_runs_started_at_once_on_one_port_each_train_alone_or_one_is_refused(tmp_path):
    """Two 2-rank runs given the same MASTER_PORT at the same moment (one with the ranks multiloss starts before the
    imports, one with Lightning's own launcher): the port goes to one rank 0; the other run's rank 0 says it is taken
    and its rank 1 that it found another run's store. No rank trains in the other run; every process ends."""
    port = _own_port(0)
    runs = {
        name: _start(
            tmp_path / name,
            "trainer.max_steps=4",
            f"seed={seed}",
            env={"MASTER_PORT": str(port), "MULTILOSS_EARLY_RANKS": early},
            cwd=tmp_path,
        )
        for name, seed, early in (("a", 1, "1"), ("b", 2, "0"))
    }
    outcome = {name: run.communicate(timeout=300) for name, run in runs.items()}
    trained = []
    for name, run in runs.items():
        stderr = outcome[name][1]
        if run.returncode == 0:
            assert _trained_alone(tmp_path / name, 4), stderr[-3000:]
            trained.append(name)
            continue
        assert run.returncode == 1, stderr[-3000:]
        # Rank 0's line, for its run; rank 1's own only if it found the other run's store before rank 0 stopped it.
        lines = sorted(_said(stderr))
        assert lines[0].startswith(f"multiloss: run stopped: port {port} on this host is in use by another process")
        assert lines[1:] in ([], [line for line in lines[1:] if "the store of another run" in line]), lines
        assert len(lines) <= 2, lines
        assert "Traceback" not in stderr and not (tmp_path / name).exists()
    assert trained, {name: out[1][-2000:] for name, out in outcome.items()}
    print(f"trained alone: {trained}; refused: {sorted(set(runs) - set(trained))}")
    assert not _processes_naming(str(tmp_path))  # no rank of either run outlived it


def test_rank_0_killed_right_after_hosting_the_store_ends_the_other_rank_in_seconds(tmp_path):
    """Ranks started by hand (as torchrun or a scheduler starts them), 3 of them expected and 2 started: once both have
    joined rank 0's store, rank 0 is killed. Rank 1, waiting for the third, loses the store and stops at once with one
    line, long before rendezvous_timeout. (The two share no run id: each derives it from the command they share.)"""
    port = _own_port(1)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NODE_RANK": "0", "WORLD_SIZE": "3"}
    ranks = [
        _start(tmp_path / "run", "trainer.devices=3", env={**env, "LOCAL_RANK": str(r)}, cwd=tmp_path) for r in (0, 1)
    ]
    try:
        store = dist.TCPStore("127.0.0.1", port, 3, is_master=False, timeout=timedelta(seconds=120))
        store.wait([rendezvous.OWNER], timedelta(seconds=120))
        run_id = store.get(rendezvous.OWNER).decode()
        assert run_id.startswith("command-")  # no MULTILOSS_RUN_ID given: the command the ranks share
        deadline = time.monotonic() + 120
        while store.add(f"multiloss/run/{run_id}/joined", 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert store.add(f"multiloss/run/{run_id}/joined", 0) == 2
        ranks[0].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        _, stderr = ranks[1].communicate(timeout=60)
        took = time.monotonic() - killed
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
            rank.communicate()
    assert ranks[1].returncode == 1, stderr[-3000:]
    assert took < 10, took
    (line,) = _said(stderr)
    assert line.startswith(f"multiloss: run stopped: rank 1 lost rank 0's store at 127.0.0.1:{port} before every rank")
    assert "Traceback" not in stderr


_JOIN_THEN_GO = """
import os, sys, time
from datetime import timedelta
import torch
from multiloss.parallel import rendezvous
rank, port = int(sys.argv[1]), int(sys.argv[2])
store = rendezvous.meet("127.0.0.1", port, rank, 2, rank, 120.0, "2 processes", "join-then-go")
if rank == 1:
    os._exit(0)  # joined, then gone before the process group is made
rendezvous.make_group(store, "gloo", 0, 2, torch.device("cpu"), timedelta(seconds=1800), 5.0)
print("made", flush=True)
"""


def test_a_rank_gone_between_joining_and_the_process_group_ends_the_wait_at_rendezvous_timeout():
    """Both ranks join; rank 1 ends before the process group is made: rank 0, inside init_process_group (gloo waits
    for its peer for the whole collective timeout, here 1800 s), stops at rendezvous_timeout (5 s) with one line."""
    port = _own_port(2)
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", _JOIN_THEN_GO, str(rank), str(port)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    assert ranks[1].wait(timeout=120) == 0, ranks[1].communicate()[1][-2000:]
    gone = time.monotonic()
    stdout, stderr = ranks[0].communicate(timeout=120)
    took = time.monotonic() - gone
    assert ranks[0].returncode == 1 and "made" not in stdout, stderr[-2000:]
    assert 4 < took < 20, took
    (line,) = _said(stderr)
    assert line == (
        "multiloss: run stopped: rank 0's process group was not made within 5 s (rendezvous_timeout) of every rank "
        "joining: a rank stopped in between (killed, or out of memory?)"
    )


def test_a_rank_ends_when_the_process_that_started_it_is_killed(tmp_path):
    """Rank 0 of a one-node run (the process that started rank 1) is killed mid-training: rank 1 ends within a second
    or two with one line, instead of waiting in its next collective for the whole collective timeout."""
    out = tmp_path / "run"
    run = _start(out, "trainer.max_steps=100000", env={}, cwd=tmp_path)
    log = out / "train_rank1.log"
    deadline = time.monotonic() + 180
    while not (log.is_file() and "training" in log.read_text()) and time.monotonic() < deadline:
        assert run.poll() is None, run.communicate()[1][-3000:]
        time.sleep(0.2)
    children = Path(f"/proc/{run.pid}/task/{run.pid}/children").read_text().split()
    assert len(children) == 1, children
    rank_1 = int(children[0])
    run.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    while Path(f"/proc/{rank_1}").exists() and time.monotonic() - killed < 30:
        time.sleep(0.05)
    took = time.monotonic() - killed
    _, stderr = run.communicate(timeout=30)  # rank 1 held the same pipes until it ended
    # Seconds, not the collective timeout (1800 s) a rank left behind would wait: the watch looks every 0.5 s; alone
    # here it ends in ~1 s, and once took 5.1 s in a full suite (2 workers and their ranks on 2 cores): bound 10 s.
    assert took < 10, took
    # Rank 1's one line: its parent gone, or (when gloo noticed first) the collective its peer left.
    said = _said(stderr)
    assert len(said) == 1, stderr[-3000:]
    (line,) = said
    assert (
        f"the process that started this rank (pid {run.pid}, its rank 0) has ended" in line
        or "a collective on rank 1 did not complete: another rank left it" in line
    ), stderr[-3000:]
    assert not _processes_naming(str(out))


def test_a_pool_rank_ends_when_its_test_worker_does(tmp_path):
    """The test suite's pool of ranks (tests/rank_pool.py): its worker killed, both ranks end (they used to poll for
    their next job for hours, their directory deleted)."""
    starter = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from tests.rank_pool import RankPool; "
            "pool = RankPool(Path(sys.argv[1])); print(*[p.pid for p in pool.procs], flush=True); time.sleep(600)",
            str(tmp_path / "pool"),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    pids = [int(pid) for pid in starter.stdout.readline().split()]
    assert len(pids) == 2
    starter.send_signal(signal.SIGKILL)
    starter.wait()
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{pid}").exists() for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)


# --- the ports and the run's identity, in this process -----------------------------------------------------------


def test_a_held_port_is_nobody_elses_until_the_store_listens_on_it():
    port = ports.hold()
    try:
        other = socket.socket()
        with pytest.raises(OSError):  # bound by nobody else, whatever they try
            other.bind(("", port))
        other.close()
        with pytest.raises(ConnectionRefusedError):  # not listening: an early rank is refused and retries
            socket.create_connection(("127.0.0.1", port), timeout=2)
        store = rendezvous._host("127.0.0.1", port, 1, 10.0)  # rank 0's store takes the socket over
        assert store.port == port and ports.take(port) is None
        store.set("k", "v")
        client = dist.TCPStore("127.0.0.1", port, 1, is_master=False, timeout=timedelta(seconds=10))
        assert client.get("k") == b"v"
    finally:
        ports.release(port)


def test_a_port_another_process_holds_is_named_as_such_for_rank_0():
    other = socket.socket()
    other.bind(("", 0))
    port = other.getsockname()[1]
    try:
        with pytest.raises(rendezvous.RendezvousIncomplete, match=f"port {port} on this host is in use by another"):
            rendezvous._host("127.0.0.1", port, 2, 10.0)
    finally:
        other.close()


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"MULTILOSS_RUN_ID": "mine", "SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0"}, "mine"),
        ({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_RESTART_COUNT": "2"}, "slurm-7.0.2"),
        ({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "1"}, "slurm-7.1.0"),
        ({"TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_RESTART_COUNT": "1"}, "torchrun-abc.1"),
    ],
)
def test_the_run_identity_comes_from_what_every_rank_of_the_run_shares(monkeypatch, env, expected):
    for name in ("MULTILOSS_RUN_ID", "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_RESTART_COUNT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert ports.run_identity(2, ["recipe=gan"]) == expected


def test_nodes_started_by_hand_share_the_identity_of_their_command_and_no_other(monkeypatch):
    for name in ("MULTILOSS_RUN_ID", "SLURM_JOB_ID", "SLURM_STEP_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's static rendezvous names every run so
    same = ports.run_identity(4, ["recipe=gan", "seed=1"])
    assert same == ports.run_identity(4, ["recipe=gan", "seed=1"])
    assert same != ports.run_identity(4, ["recipe=gan", "seed=2"]) != ports.run_identity(2, ["recipe=gan", "seed=1"])
