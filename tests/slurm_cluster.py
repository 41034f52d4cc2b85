"""A real SLURM cluster for the tests: munge, slurmctld and slurmd of this machine's packages.

`start_cluster` installs the Debian packages when they are missing (as root, with apt-get), writes
a ``slurm.conf`` (each node the CPUs and memory ``slurmd -C`` reports, a default partition, no
cgroups, no accounting) into a directory of its own, with its own munge key and socket and ports of
its own (derived from this process's id, outside the kernel's ephemeral range: `DAEMON_PORTS`), so
it never touches a cluster the machine may already run; starts the daemons in the foreground, each
in a session of its own, and waits for every node to be idle.

One node is this host. Several (``nodes=2``) are network namespaces of this host (`NodeNetwork`):
each node has its own address, hostname and ``/etc/hosts``, a slurmd of its own, and reaches the
others and slurmctld (on this host) over a bridge, so a job's ranks on two nodes rendezvous and talk
gloo over a real network link, by node name, as on a cluster.

`Cluster.stop` cancels its jobs and ends exactly the processes it started (by PID; on several nodes,
every process inside the namespaces it made), then removes the namespaces and the bridge it
made. Anything the machine cannot do raises `Unavailable` with the reason (the tests skip with it).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "slurm-wlm-basic-plugins", "munge")
BINARIES = ("slurmctld", "slurmd", "sbatch", "srun", "squeue", "scontrol", "munged")


class Unavailable(Exception):
    """This machine cannot run the cluster; the message says why."""


@dataclass
class NodeNetwork:
    """Nodes as network namespaces of this host, on a bridge: node i is ``names[i]`` at ``addresses[i]`` in the
    namespace ``namespaces[i]``, with ``hosts`` as its ``/etc/hosts``; slurmctld listens on this host at
    ``host_address``."""

    bridge: str
    host_address: str
    hosts: Path
    names: list[str] = field(default_factory=list)
    addresses: list[str] = field(default_factory=list)
    namespaces: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)  # this host's ends of the namespaces' veth pairs

    def run_in(self, node: int, args: list[str]) -> list[str]:
        """``args`` as a command run on ``node``: in its network namespace, under its own hostname and hosts file
        (a mount namespace of its own: this host's mounts, /sys's cgroups included, are otherwise kept)."""
        inner = f"mount --bind {self.hosts} /etc/hosts && hostname {self.names[node]} && exec {' '.join(args)}"
        netns = f"--net=/run/netns/{self.namespaces[node]}"
        return ["nsenter", netns, "unshare", "--mount", "--uts", "--propagation", "private", "sh", "-c", inner]

    def stop(self) -> None:
        for namespace in self.namespaces:
            # Everything inside is this cluster's: the slurmd and whatever its jobs left.
            deadline = time.monotonic() + 15
            while (pids := _ip("netns", "pids", namespace, check=False).stdout.split()) and time.monotonic() < deadline:
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError, ValueError):
                        os.kill(int(pid), signal.SIGKILL)
                time.sleep(0.1)
            _ip("netns", "del", namespace, check=False)
        for link in (*self.links, self.bridge):  # gone with their namespaces, unless a process still held one
            if link:
                _ip("link", "del", link, check=False)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise Unavailable(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def _node_network(nodes: int, host: str, root: Path) -> NodeNetwork:
    """Make ``nodes`` namespaces on a bridge of their own, in a 10.77.x.0/24 no route of this machine uses."""
    tools = ("ip", "nsenter", "unshare", "mount")
    if not sys.platform.startswith("linux") or os.geteuid() != 0 or not all(map(shutil.which, tools)):
        raise Unavailable(f"several nodes on one machine need root, Linux and {', '.join(tools)}")
    tag = os.getpid() % 100000
    used = _ip("-4", "route").stdout + _ip("-4", "addr").stdout
    free = (f"10.77.{k}" for k in (*range(tag % 150 + 100, 250), *range(100, 250)) if f"10.77.{k}." not in used)
    if (subnet := next(free, None)) is None:
        raise Unavailable("every 10.77.x.0/24 this cluster could use for its nodes is taken on this machine")
    network = NodeNetwork(bridge="", host_address=f"{subnet}.254", hosts=root / "hosts")
    try:
        # Each name added to `network` once made here: a failure undoes exactly what this call made.
        _ip("link", "add", f"mlbr{tag}", "type", "bridge")
        network.bridge = f"mlbr{tag}"
        _ip("addr", "add", f"{network.host_address}/24", "dev", network.bridge)
        _ip("link", "set", network.bridge, "up")
        network.names = [f"mlnode{i + 1}" for i in range(nodes)]
        network.addresses = [f"{subnet}.{i + 1}" for i in range(nodes)]
        hosts = ["127.0.0.1 localhost", f"{network.host_address} {host}"]
        network.hosts.write_text("\n".join(hosts + [f"{a} {n}" for a, n in zip(network.addresses, network.names)]))
        for i, (name, address) in enumerate(zip(network.names, network.addresses, strict=True)):
            namespace, outside = f"multiloss-{tag}-{name}", f"ml{tag}n{i + 1}"
            _ip("netns", "add", namespace)
            network.namespaces.append(namespace)
            _ip("link", "add", outside, "type", "veth", "peer", "name", "mlnic", "netns", namespace)
            network.links.append(outside)
            _ip("link", "set", outside, "master", network.bridge, "up")
            _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", "mlnic")
            _ip("-n", namespace, "link", "set", "mlnic", "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
    except BaseException:
        network.stop()
        raise
    return network


@dataclass
class Cluster:
    root: Path
    env: dict[str, str]
    procs: list[subprocess.Popen] = field(default_factory=list)
    submitted: list[str] = field(default_factory=list)
    network: NodeNetwork | None = None  # several nodes: the namespaces they are

    def run(self, *args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run(args, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(args)}: {done.stderr or done.stdout}")
        return done

    def sbatch(self, script: str, cwd: Path) -> str:
        path = cwd / f"job-{time.monotonic_ns()}.sh"
        path.write_text(script)
        out = self.run("sbatch", "--parsable", f"--chdir={cwd}", str(path)).stdout.strip()
        job_id = out.split(";")[0]
        self.submitted.append(job_id)
        return job_id

    def cancel_unfinished(self) -> list[str]:
        """Cancel every job of this cluster still queued or running (a test that failed left it): the next test
        must never queue behind it. The ids cancelled."""
        left = self._job_ids()
        if left:
            self.run("scancel", "--quiet", "--signal=KILL", "--full", *left, check=False)
            self.run("scancel", "--quiet", *left, check=False)
            deadline = time.monotonic() + 60
            while self._job_ids() and time.monotonic() < deadline:
                time.sleep(0.5)
        return left

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (a finished job stays known for MinJobAge, 300 s)."""
        text = self.run("scontrol", "show", "job", "-o", job_id, check=False).stdout
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait(self, job_id: str, timeout: float = 300, states: tuple[str, ...] = ("COMPLETED", "FAILED")) -> str:
        """Wait until the job reaches one of ``states`` (or any end state); its state."""
        ends = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED"}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.job(job_id).get("JobState", "")
            if state in states or (state in ends and state not in ("PREEMPTED",)):
                return state
            time.sleep(0.5)
        state = self.job(job_id).get("JobState")
        self.run("scancel", "--quiet", job_id, check=False)  # never left to hold the node for the next test
        raise TimeoutError(f"job {job_id} still {state} after {timeout} s (cancelled)")

    def wait_held_after_requeue(self, job_id: str, timeout: float = 300) -> None:
        """Wait until the job, requeued held (``scontrol requeuehold``), waits for ``scontrol release``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.job(job_id)
            if job.get("Restarts") == "1" and job.get("JobState") == "PENDING":
                return
            if job.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED"):
                break
            time.sleep(0.5)
        self.run("scancel", "--quiet", job_id, check=False)
        raise TimeoutError(f"job {job_id} was not requeued held within {timeout} s: {self.job(job_id)} (cancelled)")

    def stop(self) -> None:
        if jobs := self._job_ids():
            with contextlib.suppress(Exception):
                self.run("scancel", "--quiet", *jobs, check=False)
        _stop_processes(list(reversed(self.procs)))  # slurmd, slurmctld, munged: only the processes started here
        self.procs.clear()
        if self.network is not None:
            self.network.stop()
            self.network = None

    def _job_ids(self) -> list[str]:
        try:
            out = self.run("squeue", "-h", "-o", "%i", check=False, timeout=10).stdout
        except (OSError, subprocess.TimeoutExpired):
            return []
        return out.split()


# The daemons' ports: a pair derived from this process's id, below the kernel's ephemeral range (where every port
# bound to 0 and every outgoing connection draws from) and apart from the jobs' MASTER_PORTs (tests/test_slurm.py:
# 20000-23999 and Lightning's 15000-19999),
# so nothing the suite does can take them between the choice and the daemons' bind; a pair another program of the
# machine holds fails the daemon's start, and the next pair is tried.
DAEMON_PORTS = range(24000, 25000, 2)
DAEMON_PORT_TRIES = 5


def _daemon_ports(attempt: int, nodes: int) -> tuple[int, int]:
    # A one-node and a two-node cluster of one test process: half the range apart (on no attempt the same pair).
    first = DAEMON_PORTS[(os.getpid() + attempt * 97 + (nodes - 1) * len(DAEMON_PORTS) // 2) % len(DAEMON_PORTS)]
    return first, first + 1


def _stop_processes(procs: list[subprocess.Popen]) -> None:
    """End each of ``procs`` (each leads a session of its own: with what it started), SIGKILL after 15 s."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)


def ensure_packages() -> None:
    if all(shutil.which(b) or Path("/usr/sbin", b).exists() for b in BINARIES):
        return
    if not sys.platform.startswith("linux") or os.geteuid() != 0 or not shutil.which("apt-get"):
        raise Unavailable("SLURM is not installed, and installing it needs root and apt-get (Debian/Ubuntu)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES]
    try:
        if subprocess.run(install, env=env, capture_output=True, timeout=600).returncode != 0:
            subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=600)
            done = subprocess.run(install, env=env, capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                raise Unavailable(f"apt-get install {' '.join(PACKAGES)} failed: {done.stderr[-300:]}")
    except subprocess.TimeoutExpired as err:
        raise Unavailable(f"apt-get took too long: {err}") from None


def _node_facts() -> tuple[str, int, int]:
    slurmd = shutil.which("slurmd") or "/usr/sbin/slurmd"
    text = subprocess.run([slurmd, "-C"], capture_output=True, text=True, timeout=30).stdout
    facts = dict(re.findall(r"(\w+)=(\S+)", text))
    if "CPUs" not in facts:
        raise Unavailable(f"slurmd -C did not describe this node: {text!r}")
    return socket.gethostname().split(".")[0], int(facts["CPUs"]), int(facts.get("RealMemory", "1000"))


def _start(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    with log.open("wb") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _wait_for(check, what: str, procs: list[subprocess.Popen], root: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            break
        time.sleep(0.2)
    logs = "; ".join(f"{p.name}: {p.read_text()[-400:]!r}" for p in sorted(root.glob("log/*")))
    raise Unavailable(f"{what} did not come up ({logs})")


def _slurm_conf(
    root: Path, host: str, cpus: int, memory: int, sock: Path, ports: tuple[int, int], network: NodeNetwork | None
) -> str:
    if network is None:
        controller, nodes = "127.0.0.1", [f"NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory}"]
    else:  # each namespace's node a share of the memory, every CPU (they are the same CPUs)
        controller = network.host_address
        nodes = [
            f"NodeName={name} NodeAddr={address} CPUs={cpus} RealMemory={memory // len(network.names)}"
            for name, address in zip(network.names, network.addresses, strict=True)
        ]
    return "\n".join(
        [
            "ClusterName=multiloss-test",
            f"SlurmctldHost={host}({controller})",
            f"SlurmctldPort={ports[0]}",
            f"SlurmdPort={ports[1]}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire: also how long a requeued job waits before it starts again (default 120 s)
            f"AuthInfo=socket={sock},cred_expire=10",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={root / 'state'}",
            f"SlurmdSpoolDir={root / 'spool' / '%n'}",
            f"SlurmctldPidFile={root / 'slurmctld.pid'}",
            f"SlurmdPidFile={root / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={root / 'log/slurmctld.log'}",
            f"SlurmdLogFile={root / 'log/slurmd-%n.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "JobCompType=jobcomp/none",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "MpiDefault=none",
            "ReturnToService=2",
            "JobRequeue=1",
            "KillWait=30",
            "InactiveLimit=0",
            "MinJobAge=600",
            "SchedulerType=sched/backfill",
            *(f"{node} State=UNKNOWN" for node in nodes),
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
            "",
        ]
    )


def start_cluster(root: Path, nodes: int = 1) -> Cluster:
    """Bring a cluster of ``nodes`` nodes up under ``root``; `Unavailable` if this machine cannot."""
    ensure_packages()
    host, cpus, memory = _node_facts()
    network = _node_network(nodes, host, root) if nodes > 1 else None
    for sub in ("state", "log", "munge", *(f"spool/{name}" for name in (network.names if network else [host]))):
        (root / sub).mkdir(parents=True, exist_ok=True)
    (root / "munge").chmod(0o711)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(128))
    key.chmod(0o400)
    sock = root / "munge" / "munge.sock"
    conf = root / "slurm.conf"
    env = {**os.environ, "SLURM_CONF": str(conf)}
    for name in [n for n in env if n.startswith(("SLURM_", "SBATCH_", "SRUN_")) and n != "SLURM_CONF"]:
        del env[name]  # a job of ours must not look like a step of the job running these tests
    cluster = Cluster(root, env, network=network)
    munged = shutil.which("munged") or "/usr/sbin/munged"
    cluster.procs.append(
        _start(
            [
                munged,
                "--foreground",
                "--force",
                f"--socket={sock}",
                f"--key-file={key}",
                f"--pid-file={root / 'munge/munged.pid'}",
                f"--seed-file={root / 'munge/munged.seed'}",
                f"--log-file={root / 'log/munged.log'}",
            ],
            root / "log/munged.out",
            env,
        )
    )

    def idle() -> bool:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() == "idle"

    try:
        _wait_for(sock.exists, "munged", cluster.procs, root)
        for attempt in range(DAEMON_PORT_TRIES):
            conf.write_text(_slurm_conf(root, host, cpus, memory, sock, _daemon_ports(attempt, nodes), network))
            slurmctld, slurmd = (shutil.which(d) or f"/usr/sbin/{d}" for d in ("slurmctld", "slurmd"))
            daemons = [_start([slurmctld, "-D", "-f", str(conf)], root / "log/slurmctld.out", env)]
            if network is None:
                daemons.append(_start([slurmd, "-D", "-f", str(conf)], root / "log/slurmd.out", env))
            for i, name in enumerate(network.names if network else ()):
                command = network.run_in(i, [slurmd, "-D", "-N", name, "-f", str(conf)])
                daemons.append(_start(command, root / f"log/slurmd-{name}.out", env))
            cluster.procs.extend(daemons)
            try:
                _wait_for(idle, "the node (sinfo: idle)", [*cluster.procs], root)
                break
            except Unavailable:
                logs = " ".join(p.read_text(errors="replace") for p in root.glob("log/slurm*"))
                if "Address already in use" not in logs or attempt + 1 == DAEMON_PORT_TRIES:
                    raise
                _stop_processes(daemons)  # another program holds that pair: the next one
                cluster.procs = [p for p in cluster.procs if p not in daemons]
                for log in root.glob("log/slurm*"):
                    log.unlink()
    except BaseException:
        cluster.stop()
        raise
    return cluster
