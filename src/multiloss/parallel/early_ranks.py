"""The other ranks of a one-node DDP or FSDP2 run, started as soon as the config is checked, before the imports.

Lightning starts ranks > 0 inside ``fit``, once the launching process has imported torch and Lightning and built
the data, the recipe and the Trainer: a 2-rank run paid the whole start-up twice in a row. Here `start` launches
them right after `multiloss.config.early` accepted the config, so every rank imports and builds at the same time;
the strategy's launcher (`multiloss.parallel.ddp.HydraJobLauncher`) takes them over at ``fit``, as if it had started
them itself (the same command, the same environment: `job_command`), and watches them from there.

Only where it is sure what Lightning will do: the one-node runs of multiloss's DDP and FSDP2 strategies with a
number of devices the config says (``trainer=ddp_cpu``, ``fsdp_cpu``; on GPUs the devices this machine shows).
Anything else (torchrun, srun, several nodes, ``devices=auto``, a strategy of one's own) starts as before. Should
the Trainer then want other ranks than those started (`settle`), they are stopped before they do anything and
Lightning starts its own.

Until the ranks share a process group, a config error they all meet is printed once: each process claims the
message in a directory they share (`report_once`), as `multiloss.callbacks.report_once` does through the group's
store afterwards.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from multiloss.parallel import ports
from multiloss.parallel.child_command import PARENT

# Lightning's DDP aliases that start their processes as scripts (`multiloss.parallel.ddp.multiloss_ddp` builds them as
# multiloss's DDPStrategy); the strategies named by `_target_` that launch Hydra jobs.
_DDP_NAMES = {"ddp", "ddp_find_unused_parameters_false", "ddp_find_unused_parameters_true"}
_STRATEGY_TARGETS = {"multiloss.parallel.fsdp.FSDPStrategy", "multiloss.parallel.ddp.DDPStrategy"}
# Set where another launcher started this process (torchrun, srun, Lightning's own launcher, MPI, LSF).
_LAUNCHED_ELSEWHERE = (
    "LOCAL_RANK",
    "RANK",
    "NODE_RANK",
    "SLURM_NTASKS",
    "SLURM_JOB_ID",
    "TORCHELASTIC_RUN_ID",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_SIZE",
    "LSB_JOBID",
    "JSM_NAMESPACE_RANK",
)
SWITCH = "MULTILOSS_EARLY_RANKS"  # 0: Lightning starts the ranks inside fit, as it does by itself
REPORTS = "MULTILOSS_PRE_GROUP_REPORTS"  # the directory the ranks claim their pre-group error messages in
_ENV = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", ports.RUN_ID, PARENT)


@dataclass
class EarlyRanks:
    """Ranks 1..n-1 of a run, started before the imports, until a launcher adopts them (or they are stopped)."""

    world_size: int
    port: int
    procs: list[subprocess.Popen] = field(default_factory=list)
    reports: Path | None = None
    adopted: bool = False
    run_id: str = field(default_factory=ports.new_run_id)

    def child_env(self) -> dict[str, str]:
        return {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(self.port),
            "NODE_RANK": "0",
            "WORLD_SIZE": str(self.world_size),
            ports.RUN_ID: self.run_id,
            PARENT: str(os.getpid()),
        }

    def stop(self) -> None:
        """Stop the ranks (they have not joined any group: nothing of theirs is lost) and forget them."""
        kill(self.procs)
        self.procs = []
        self.clean()

    def clean(self) -> None:
        ports.release(self.port)  # held for a store this process did not host (it failed before): let it go
        if self.reports is not None:
            shutil.rmtree(self.reports, ignore_errors=True)
            os.environ.pop(REPORTS, None)
            self.reports = None


def kill(procs: list[subprocess.Popen]) -> None:
    """SIGKILL each process still running, then wait for all (none is left a zombie)."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGKILL)
    for proc in procs:
        proc.wait()


_started: EarlyRanks | None = None


def processes_wanted(trainer_cfg: Any) -> int:
    """How many processes this node's run will start, where the config alone says it; 1 where it does not."""
    if any(name in os.environ for name in _LAUNCHED_ELSEWHERE) or os.environ.get(SWITCH) == "0":
        return 1
    if int(trainer_cfg.get("num_nodes", 1) or 1) != 1:
        return 1
    strategy = trainer_cfg.get("strategy", "auto")
    target = strategy.get("_target_") if hasattr(strategy, "get") else None
    if not (target in _STRATEGY_TARGETS or (isinstance(strategy, str) and strategy in _DDP_NAMES)):
        return 1
    accelerator = str(trainer_cfg.get("accelerator", "auto"))
    devices = trainer_cfg.get("devices", "auto")
    if isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        devices = int(devices)
    if isinstance(devices, int) and devices > 0:
        count = devices
    elif isinstance(devices, Sequence) and not isinstance(devices, str):
        count = len(devices)
    elif devices == -1 and accelerator in ("gpu", "cuda"):
        count = visible_gpus()
    else:
        return 1  # "auto", or -1 on a CPU: Lightning decides
    return count if accelerator in ("cpu", "gpu", "cuda") and count > 1 else 1


def visible_gpus() -> int:
    """The NVIDIA GPUs a process here sees (CUDA_VISIBLE_DEVICES, else the driver's list), without importing torch."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = 0
        for entry in visible.split(","):
            entry = entry.strip()
            if not entry or entry.startswith("-"):
                break  # CUDA stops at the first invalid entry
            count += 1
        return count
    gpus = Path("/proc/driver/nvidia/gpus")
    return len(list(gpus.iterdir())) if gpus.is_dir() else 0


def start(cfg: Any) -> EarlyRanks | None:
    """Start ranks 1..n-1 of ``cfg``'s run now, when `processes_wanted` says n > 1 (None otherwise)."""
    global _started
    world_size = processes_wanted(cfg.trainer)
    if world_size < 2:
        return None
    from multiloss.parallel.child_command import job_command

    # The user's MASTER_PORT as given (a port taken by another process is then named as such by rank 0); else a port
    # held from now until rank 0's store listens on it (`multiloss.parallel.ports`).
    given = os.environ.get("MASTER_PORT", "")
    ranks = EarlyRanks(world_size, int(given) if given.isdigit() else ports.hold())
    ranks.reports = Path(tempfile.mkdtemp(prefix="multiloss-ranks-"))
    os.environ[REPORTS] = str(ranks.reports)  # this process claims its messages there too
    env = {**os.environ, **ranks.child_env()}
    env.pop("PL_GLOBAL_SEED", None)  # as Lightning's launcher: each rank seeds itself from the config
    for local_rank in range(1, world_size):
        command, cwd = job_command(local_rank)
        ranks.procs.append(subprocess.Popen(command, env={**env, "LOCAL_RANK": str(local_rank)}, cwd=cwd))
    _started = ranks
    return ranks


def adopt(num_processes: int, num_nodes: int, environment_is_lightnings: bool) -> EarlyRanks | None:
    """The ranks started early, for a launcher about to start ``num_processes`` on one node of Lightning's own
    environment: this process made their rank zero (the environment Lightning's launcher sets), None if there are
    none or they are not those (then they are stopped, and the launcher starts its own)."""
    global _started
    ranks = _started
    if ranks is None or ranks.adopted:
        return None
    if not (environment_is_lightnings and num_nodes == 1 and num_processes == ranks.world_size):
        discard()
        return None
    ranks.adopted = True
    os.environ.update({**ranks.child_env(), "LOCAL_RANK": "0"})
    os.environ.pop(PARENT)  # the children's parent is this process; it follows none
    return ranks


def settle(strategy: Any, launches_hydra_jobs: bool) -> None:
    """Stop the ranks started early at once if the Trainer's strategy will not take them over (a launcher of another
    kind, a process count other than theirs): they would wait for a group that never forms."""
    ranks = _started
    if ranks is None or ranks.adopted:
        return
    wanted = getattr(strategy, "num_processes", None)
    if not launches_hydra_jobs or wanted != ranks.world_size or getattr(strategy, "num_nodes", 1) != 1:
        discard()


def discard() -> None:
    """Stop the ranks started early that no launcher adopted (this process failed or chose another way)."""
    global _started
    if _started is not None and not _started.adopted:
        _started.stop()
        _started = None


def finished() -> None:
    """The run of this process is over: a launcher that adopted the ranks has waited for them; forget them."""
    global _started
    if _started is not None:
        _started.clean() if _started.adopted else _started.stop()
    _started = None


def saved_environment() -> dict[str, str | None]:
    """This process's launch variables before any rank was started or adopted (a launcher restores them after)."""
    return {key: os.environ.get(key) for key in _ENV}


def started_early() -> bool:
    """Whether this process is a rank > 0 that `start` launched (its rank zero checked the config before)."""
    return bool(os.environ.get(REPORTS)) and os.environ.get("LOCAL_RANK", "0") != "0"


def report_once(message: str) -> bool:
    """Whether this process is the first of its run's ranks to report ``message`` before their process group exists
    (always True outside a run whose ranks started early)."""
    reports = os.environ.get(REPORTS)
    if not reports or not Path(reports).is_dir():
        return True
    claim = Path(reports) / hashlib.sha1(message.encode()).hexdigest()
    try:
        os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    except OSError:
        return True
    return True


__all__ = ["EarlyRanks", "adopt", "discard", "finished", "kill", "processes_wanted", "report_once", "settle", "start"]
