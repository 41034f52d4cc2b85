"""Two real ranks (gloo) kept for many runs: ``multiloss.train`` in both, one job after the other, one process group.

A distributed proof that compares weights (2 ranks × b against 1 × 2b, FSDP2 against DDP, a resume against the
straight run) needs real DDP and FSDP2 processes, not a fresh interpreter for each run: started as ``python
train.py`` each such run paid two interpreters' imports (~5 s each here) for a few seconds of training. The pool
starts its two ranks once per test worker, as torchrun starts ranks (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``PORT``: Lightning's own environment, processes created outside it; rank 0 holds its port until its
store listens on it and publishes the number, a run id of its own keeps its store its own, and a rank ends when the
test worker that started it does), and each run is
`multiloss.train` of the composed config in both, exactly what ``python train.py`` calls after composing it
(`multiloss.testing.compose`, the same Hydra tree and run dir). Lightning starts the process group with the first
run and every later run joins it, as a run under torchrun does. What only a command shows — its exit code, its
messages, signals, the launch itself, Hydra's log file — stays with the tests that run the command.

A run that fails on either rank ends the pool (its ranks are killed: one may wait in a collective for the other)
and the test fails with both ranks' tracebacks; the next run starts a new pool.

    python -m tests.rank_pool <dir>     # one rank (RANK etc. set), serving the jobs written into <dir>
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

from multiloss.parallel import ports
from multiloss.parallel.child_command import PARENT, follow_parent
from multiloss.parallel.early_ranks import kill
from multiloss.parallel.ports import RUN_ID

ROOT = Path(__file__).resolve().parents[1]
WORLD_SIZE = 2
JOB_TIMEOUT_S = 600.0


class RankPool:
    """The two ranks of one test worker, and the jobs given to them."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.log = directory / "ranks.log"
        self.jobs = 0
        self.procs: list[subprocess.Popen] = []
        with self.log.open("w") as log:
            for rank in range(WORLD_SIZE):
                env = {
                    **os.environ,
                    "MASTER_ADDR": "127.0.0.1",
                    "WORLD_SIZE": str(WORLD_SIZE),
                    "NODE_RANK": "0",
                    "RANK": str(rank),
                    "LOCAL_RANK": str(rank),
                    "PYTHONWARNINGS": "ignore",
                    RUN_ID: f"rank-pool-{os.getpid()}-{directory.name}",  # its store is its own
                    PARENT: str(os.getpid()),  # a rank ends when this worker does
                }
                command = [sys.executable, "-m", "tests.rank_pool", str(directory)]
                self.procs.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))

    def run(self, out: Path, overrides: tuple[str, ...], cwd: Path) -> None:
        """``multiloss.train`` of ``python train.py <overrides> hydra.run.dir=<out>`` on both ranks; AssertionError with
        the ranks' tracebacks if either fails."""
        job = self.jobs
        self.jobs += 1
        spec = {"overrides": list(overrides), "output_dir": str(out), "cwd": str(cwd)}
        staged = self.directory / f".job-{job}.json"
        staged.write_text(json.dumps(spec))
        staged.rename(self.directory / f"job-{job}.json")  # whole, or not there
        results = [self.directory / f"result-{job}-rank{rank}.json" for rank in range(WORLD_SIZE)]
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while not all(r.exists() for r in results):
            failed = [r for r in results if r.exists() and not json.loads(r.read_text())["ok"]]
            dead = [p for p in self.procs if p.poll() is not None]
            if failed or dead or time.monotonic() > deadline:
                time.sleep(1.0)  # the other rank's traceback, if it has one coming
                self._fail(job, results, "a rank died" if dead and not failed else "timed out" if not failed else "")
            time.sleep(0.02)
        outcome = [json.loads(r.read_text()) for r in results]
        if not all(o["ok"] for o in outcome):
            self._fail(job, results, "")

    def _fail(self, job: int, results: list[Path], why: str) -> None:
        outcome = [json.loads(r.read_text()) for r in results if r.exists()]
        said = [o["error"] for o in outcome if not o["ok"]]
        self.close()
        tail = self.log.read_text()[-4000:] if self.log.exists() else ""
        raise AssertionError(f"pooled run {job} failed{': ' + why if why else ''}\n" + "\n".join(said) + "\n" + tail)

    def close(self) -> None:
        kill(self.procs)
        self.procs = []

    @property
    def alive(self) -> bool:
        return bool(self.procs) and all(p.poll() is None for p in self.procs)


_pool: RankPool | None = None
_pools_made = 0


def pooled_train(out: Path, *overrides: str, cwd: Path | None = None) -> Path:
    """``python train.py <overrides> hydra.run.dir=<out>`` of a 2-rank run (``trainer=ddp_cpu`` / ``fsdp_cpu``), on
    this worker's pool of ranks; ``out``."""
    global _pool, _pools_made
    if _pool is None or not _pool.alive:
        import tempfile

        _pools_made += 1
        _pool = RankPool(Path(tempfile.mkdtemp(prefix=f"multiloss-ranks-{_pools_made}-")))
    out.parent.mkdir(parents=True, exist_ok=True)
    _pool.run(out, overrides, cwd or out.parent)
    return out


@atexit.register
def close() -> None:
    if _pool is not None:
        _pool.close()


# --- a rank ---------------------------------------------------------------------------------------------------


def serve(directory: Path) -> None:
    follow_parent()  # the test worker that started this rank gone (killed, or a hung run cancelled): gone too
    rank = int(os.environ["RANK"])
    _share_port(directory, rank)
    from multiloss import train
    from multiloss.testing import compose

    job = 0
    while True:
        path = directory / f"job-{job}.json"
        while not path.exists():
            time.sleep(0.01)
        spec = json.loads(path.read_text())
        try:
            os.chdir(spec["cwd"])
            train(compose(*spec["overrides"], output_dir=spec["output_dir"]))
            result = {"ok": True}
        except BaseException:  # reported to the test, which fails with it
            result = {"ok": False, "error": f"rank {rank}:\n{traceback.format_exc()}"}
        staged = directory / f".result-{job}-rank{rank}.json"
        staged.write_text(json.dumps(result))
        staged.rename(directory / f"result-{job}-rank{rank}.json")
        if not result["ok"]:
            os._exit(1)  # the other rank may wait in a collective: the pool ends, a new one serves the next job
        job += 1


def _share_port(directory: Path, rank: int) -> None:
    """Rank 0 holds a port until its store listens on it (never bind, close and hope) and tells rank 1 which."""
    published = directory / "port"
    if rank == 0:
        port = ports.hold()
        published.with_suffix(".partial").write_text(str(port))
        published.with_suffix(".partial").rename(published)  # whole, or not there
    else:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while not published.exists():
            if time.monotonic() > deadline:
                raise SystemExit(f"rank {rank}: rank 0 published no port in {JOB_TIMEOUT_S:g} s")
            time.sleep(0.01)
        port = int(published.read_text())
    os.environ["MASTER_PORT"] = str(port)


if __name__ == "__main__":
    serve(Path(sys.argv[1]))
