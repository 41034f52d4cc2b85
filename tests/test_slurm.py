"""The cluster path run on a real SLURM (`tests.slurm_cluster`): 2 ranks under srun, gloo.

On one node: an sbatch DDP job; a Hydra sweep through ``hydra/launcher=slurm`` with no launcher
overrides; a job whose config is wrong, reported to the submitting command in one line; a job
requeued mid-run (``scontrol requeue``, and SIGUSR1 as ``sbatch --signal`` sends it) that continues
from the step it saved, to the same weights as a run never interrupted. On two nodes (each a network
namespace with its own address and hostname): a job that trains across both, loses one and is
requeued onto the other, continuing there. ``make test-slurm`` runs these alone.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import QUIET, ROOT, load_checkpoint, load_weights, run_cli
from tests.helpers import epoch_orders, recording_ids, trained_examples, write_id_data
from tests.slurm_cluster import Unavailable, start_cluster

# One worker (pytest-xdist) runs the whole module: one cluster for all of it.
pytestmark = [pytest.mark.slurm, pytest.mark.distributed, pytest.mark.slow, pytest.mark.xdist_group("slurm")]

RUN = (*QUIET, "~callbacks.loss_curves")
F64 = "trainer.precision=64-true"  # a proof's runs: the module, its batches and its steps in float64
EXACT = 1e-10  # float64: equal up to rounding, on any CPU
# 2 ranks: multihead on the digits, 12 optimizer steps an epoch (64 examples a rank a step).
MULTIHEAD = ("recipe=multihead", "model.net.width=32", "model.net.dropout=0.2", "data.batch_size=64")


# The jobs' MASTER_PORTs: derived from the job id and the attempt, below the kernel's ephemeral range and apart from
# the cluster's own daemons (tests/slurm_cluster.py DAEMON_PORTS) and from Lightning's own SLURM ports (15000 + the job
# id % 5000, which the sweeps' jobs use).
JOB_PORTS = range(20000, 24000)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    try:
        up = start_cluster(tmp_path_factory.mktemp("slurm"))
    except Unavailable as err:
        pytest.skip(f"no SLURM cluster on this machine: {err}")
    yield up
    up.stop()


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """Two nodes, mlnode1 and mlnode2 (`tests.slurm_cluster.NodeNetwork`)."""
    try:
        up = start_cluster(tmp_path_factory.mktemp("slurm2"), nodes=2)
    except Unavailable as err:
        pytest.skip(f"no two-node SLURM cluster on this machine: {err}")
    yield up
    up.stop()


@pytest.fixture(autouse=True)
def _jobs_end_with_their_test(request):
    """Whatever way a test ends, a job it left queued or running is cancelled: one failure never makes every later
    test wait behind its job."""
    yield
    for name in ("cluster", "two_nodes"):
        cluster = request.node.funcargs.get(name)  # set up (not skipped) for this test
        if cluster is not None:
            cluster.cancel_unfinished()


def _script(*overrides: str, tasks: int = 2, nodes: str = "1", out: Path) -> str:
    args = " ".join(f"'{o}'" for o in (*RUN, *overrides))
    srun = "srun"
    if nodes != "1":
        # The trainer and the step take the nodes this attempt got (the batch's SLURM_NTASKS is the submission's).
        args += " trainer.num_nodes=$SLURM_NNODES"
        srun += f" --ntasks-per-node={tasks} --ntasks=$(( SLURM_NNODES * {tasks} ))"
    return (
        "#!/bin/bash\n"
        f"#SBATCH --nodes={nodes} --ntasks-per-node={tasks} --cpus-per-task=1\n"
        f"#SBATCH --output={out}/slurm-%j.out --open-mode=append\n"
        "export OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore\n"
        'echo "attempt ${SLURM_RESTART_COUNT:-0} on ${SLURM_JOB_NODELIST}"\n'
        # Lightning's SLURM port is 15000 + the job id, the same for a requeued attempt, which this cluster
        # restarts after 10 s (cred_expire; a real one waits 120 s): seen in use then (EADDRINUSE). Each attempt a
        # port of its own, derived from the job id and the attempt (`JOB_PORTS`): never a port bound to 0 and let go,
        # which the rank pool of the other test worker may take in the meantime.
        f"export MASTER_PORT=$(( {JOB_PORTS.start} + (SLURM_JOB_ID * 4 + ${{SLURM_RESTART_COUNT:-0}} % 4) "
        f"% {len(JOB_PORTS)} ))\n"
        f"{srun} {sys.executable} {ROOT / 'train.py'} {args}\n"
    )


def _step(ckpt: Path) -> int:
    return load_checkpoint(ckpt)["global_step"]


def test_an_sbatch_job_of_two_ranks_trains_into_one_run_dir_with_a_log_per_rank(cluster, tmp_path):
    job = cluster.sbatch(_script("recipe=gan", "trainer=ddp_cpu", "trainer.max_steps=6", out=tmp_path), tmp_path)
    assert cluster.wait(job) == "COMPLETED", (tmp_path / f"slurm-{job}.out").read_text()[-3000:]
    (run,) = (tmp_path / "outputs/gan").iterdir()
    assert run.name == f"slurm-{job}-0"  # the job's id, not the clock: a requeued job finds it again
    assert _step(run / "checkpoints/last.ckpt") == 6
    assert sorted(p.name for p in run.glob("*.log")) == ["train.log", "train_rank1.log"]
    assert "on rank 1 of 2" in (run / "train_rank1.log").read_text()
    assert "on rank 0 of 2" in (run / "train.log").read_text()


def test_srun_with_ntasks_not_matching_the_trainer_is_one_line_and_leaves_no_run_dir(cluster, tmp_path):
    proc = subprocess.run(
        ["srun", "-N1", "-n2", sys.executable, str(ROOT / "train.py"), *RUN, "trainer=cpu", "trainer.max_steps=2"],
        cwd=tmp_path,
        env={**cluster.env, "PYTHONWARNINGS": "ignore"},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode != 0
    said = [line for line in proc.stderr.splitlines() if line.startswith("multiloss: config error: trainer.devices=1")]
    assert len(said) == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]  # one line from each task
    assert "--ntasks-per-node" in proc.stderr
    assert not (tmp_path / "outputs").exists() or not any(p.is_file() for p in (tmp_path / "outputs").rglob("*"))


def _sweep(cluster, tmp_path: Path, *overrides: str, timeout: float = 400) -> subprocess.CompletedProcess:
    env = {**cluster.env, "HYDRA_FULL_ERROR": "0", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "-m", "hydra/launcher=slurm", *RUN, *overrides],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_a_hydra_sweep_of_two_cpu_jobs_runs_on_slurm_into_one_sweep_dir(cluster, tmp_path):
    proc = _sweep(cluster, tmp_path, "recipe=multihead,gan", "trainer=ddp_cpu", "trainer.max_steps=4")
    assert proc.returncode == 0, proc.stderr[-4000:]
    (sweep,) = (tmp_path / "multirun").iterdir()  # one dir for the sweep over recipe=
    assert sorted(p.name for p in sweep.iterdir() if p.name.isdigit()) == ["0", "1"]
    for job in ("0", "1"):
        assert _step(sweep / job / "checkpoints/last.ckpt") == 4
        assert (sweep / job / "train_rank1.log").is_file()


def test_a_bad_config_in_a_submitted_job_comes_back_to_the_submitter_in_one_line(cluster, tmp_path):
    started = time.monotonic()
    proc = _sweep(cluster, tmp_path, "recipe=gan", "model.n_critic=0", "trainer=cpu", timeout=180)
    took = time.monotonic() - started
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if "multiloss: config error: model.n_critic=0" in line]
    assert len(lines) == 1, proc.stderr[-3000:]
    (log,) = [line.split("job log: ")[1] for line in proc.stderr.splitlines() if "job log: " in line]
    assert "multiloss: config error: model.n_critic=0" in Path(log).read_text()
    assert "Traceback" not in proc.stderr
    print(f"the submitter had the job's message after {took:.0f} s")
    assert took < 120


def _requeue_script(how: str, trainer: str, out: Path, run: Path) -> str:
    # sigusr1_on_an_epochs_last_batch: epoch 1's last batch (12 batches an epoch on each of 2 ranks) holds
    # until the signal has come; Lightning's restart used to count that epoch twice (0.07 off).
    at = ("+callbacks.preempt.step=23", "+callbacks.preempt.hold=true") if how.endswith("last_batch") else ()
    return _script(
        *MULTIHEAD,
        f"trainer={trainer}",
        "trainer.max_steps=40",
        f"hydra.run.dir={run}",
        "+callbacks.preempt._target_=tests.slurm_helpers.PreemptOnce",
        f"+callbacks.preempt.how={how.removesuffix('_on_an_epochs_last_batch')}",
        *(at or ("+callbacks.preempt.step=17",)),
        out=out,
    )


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The same 40 steps under a trainer, never interrupted (Lightning's own launch, the same 2 ranks)."""
    runs: dict[str, Path] = {}

    def run(trainer: str) -> Path:
        if trainer not in runs:
            straight = tmp_path_factory.mktemp("straight") / "run"
            proc = run_cli(*RUN, *MULTIHEAD, f"trainer={trainer}", "trainer.max_steps=40", f"hydra.run.dir={straight}")
            assert proc.returncode == 0, proc.stderr[-3000:]
            runs[trainer] = straight / "checkpoints/last.ckpt"
        return runs[trainer]

    return run


@pytest.mark.parametrize(
    ("how", "trainer"),
    [
        ("scontrol_requeue", "ddp_cpu"),
        ("sigusr1_on_an_epochs_last_batch", "ddp_cpu"),
        # Mid-epoch SIGUSR1 under FSDP2 (under DDP: the last-batch case's signal, the requeue case's mid-epoch
        # continuation): a sharded last.ckpt, each rank's shard written before the requeue.
        ("sigusr1", "fsdp_cpu"),
        # Rank 1 alone gets SIGUSR1: the ranks agree on the signal's kind, and rank 0 requeues the job.
        ("sigusr1_to_rank_1", "ddp_cpu"),
    ],
)
def test_a_requeued_job_continues_from_the_step_it_saved_exactly(cluster, uninterrupted, tmp_path, how, trainer):
    run = tmp_path / "run"
    job = cluster.sbatch(_requeue_script(how, trainer, tmp_path, run), tmp_path)
    state = cluster.wait(job, timeout=400)
    log = "\n".join(p.read_text()[-3000:] for p in tmp_path.glob("slurm-*.out"))
    assert state == "COMPLETED", log
    assert cluster.job(job).get("Restarts") == "1", log  # the same job, requeued once
    record = (run / "preempted.txt").read_text().split()
    saved_step = int(record[0])
    if how.endswith("last_batch"):
        assert saved_step == 24  # the end of epoch 1
    else:
        assert 17 < saved_step < 40  # mid-run, mid-epoch, where the signal found it
    assert _step(run / "checkpoints/last.ckpt") == 40

    a, b = load_weights(run / "checkpoints/last.ckpt"), load_weights(uninterrupted(trainer))
    worst = max((a[k] - b[k]).abs().max().item() for k in a if isinstance(a[k], torch.Tensor))
    assert worst == 0.0, f"the requeued run's weights differ by {worst:.3g}"


def test_a_job_that_continues_its_run_dir_from_a_rewritten_checkpoint_runs_nothing_it_names(cluster, tmp_path):
    """A requeued job's command (``ckpt_path=last`` into its run dir) meeting a ``last.ckpt`` someone rewrote to name
    ``builtins.open`` (which Hydra's own blocklist lets through): every task refuses it in one line, the job fails,
    nothing is written (multiloss.saving.trust)."""
    run, marker = tmp_path / "run", tmp_path / "PWNED"
    straight = run_cli(*RUN, *MULTIHEAD, "trainer=cpu", "trainer.max_steps=2", f"hydra.run.dir={run}")
    assert straight.returncode == 0, straight.stderr[-3000:]
    ckpt = run / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(ckpt, map_location="cpu", weights_only=True)
    checkpoint["multiloss_overrides"] += [
        "~model.net",
        f"+model.net={{_target_: builtins.open, file: '{marker}', mode: w}}",
    ]
    torch.save(checkpoint, ckpt)
    before = sorted((str(p), p.stat().st_mtime_ns) for p in run.rglob("*"))
    job = cluster.sbatch(_script("trainer=ddp_cpu", f"hydra.run.dir={run}", "ckpt_path=last", out=tmp_path), tmp_path)
    assert cluster.wait(job) == "FAILED"
    log = (tmp_path / f"slurm-{job}.out").read_text()
    said = [line for line in log.splitlines() if line.startswith("multiloss: config error: model.net._target_=")]
    assert len(said) == 2 and "Traceback" not in log, log[-3000:]  # one line from each task
    assert not marker.exists() and sorted((str(p), p.stat().st_mtime_ns) for p in run.rglob("*")) == before


def test_a_job_requeued_onto_fewer_nodes_continues_each_example_once_as_the_straight_run(two_nodes, tmp_path):
    """A job on two nodes (a rank × 8 on each, over the nodes' network) is requeued mid-run, held, and its allocation
    shrunk to one node (``scontrol update NumNodes=1``, as a scheduler gives a requeued job what is free); its next
    attempt continues the run on mlnode1 alone, one rank × 8 accumulating 2 batches a step (``global_batch_size=16``
    kept). Every example of both epochs is trained once, and the weights equal a straight one-rank 1 × 16 run's, in
    float64, to `EXACT` (the same examples' gradients summed in other groupings: they part only by rounding)."""
    id_data = write_id_data(tmp_path / "ids.npz")
    common = (
        *("recipe=accumulation", "model.net.width=16", "trainer.limit_val_batches=1"),
        *("trainer.max_epochs=2", "global_batch_size=16", F64),
    )
    straight, run, record = tmp_path / "straight", tmp_path / "run", tmp_path / "ids"
    alone = run_cli(
        *RUN, *common, *recording_ids(id_data, tmp_path / "straight_ids"), "trainer=cpu", "data.batch_size=16",
        f"hydra.run.dir={straight}",
    )  # fmt: skip
    assert alone.returncode == 0, alone.stderr[-3000:]
    preempt = ("how=scontrol_requeuehold", "step=4", "hold=true")  # the batch of step 4 waits for the SIGTERM
    script = _script(
        *common,
        *recording_ids(id_data, record),
        *("trainer=ddp_cpu", "trainer.devices=1", "data.batch_size=8", f"hydra.run.dir={run}"),
        "+callbacks.preempt._target_=tests.slurm_helpers.PreemptOnce",
        *(f"+callbacks.preempt.{p}" for p in preempt),
        tasks=1,
        nodes="2",
        out=tmp_path,
    )
    job = two_nodes.sbatch(script, tmp_path)
    two_nodes.wait_held_after_requeue(job)
    two_nodes.run("scontrol", "update", f"JobId={job}", "NumNodes=1-1", "NumTasks=1")
    two_nodes.run("scontrol", "release", job)
    state = two_nodes.wait(job, timeout=400)
    log = (tmp_path / f"slurm-{job}.out").read_text()
    assert state == "COMPLETED", log[-4000:]
    attempts = [line for line in log.splitlines() if line.startswith("attempt ")]
    assert attempts == ["attempt 0 on mlnode[1-2]", "attempt 1 on mlnode1"], log[-4000:]
    assert (run / "preempted.txt").read_text().split()[0] == "5"  # mid-epoch 0 (10 steps an epoch), at that batch's end
    assert _step(run / "checkpoints/last.ckpt") == 20
    assert len(list(record.glob("trained_rank*.jsonl"))) == 2  # the rank on mlnode2 trained too
    seen = trained_examples(record)
    assert {epoch: sorted(ids) for epoch, ids in seen.items()} == {e: sorted(o) for e, o in epoch_orders(2).items()}
    a, b = load_weights(run / "checkpoints/last.ckpt"), load_weights(straight / "checkpoints/last.ckpt")
    assert a.keys() == b.keys()
    tensors = [k for k in a if isinstance(a[k], torch.Tensor)]
    assert {a[k].dtype for k in tensors if a[k].is_floating_point()} == {torch.float64}  # float64 end to end
    worst = max((a[k] - b[k]).abs().max().item() for k in tensors)  # each pair in its own dtype
    print(f"requeued onto one node: largest weight difference from the straight run {worst:.2g}")  # (pytest -s)
    assert worst <= EXACT, f"the run requeued onto one node differs from the straight run by {worst:.3g}"
