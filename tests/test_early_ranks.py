"""A one-node DDP/FSDP2 run's other ranks start right after the config is checked (`multiloss.parallel.early_ranks`).

Which runs start them early (only where the config says what Lightning will do), that the launcher takes them over
(the same ranks train: rank 1 carries the mark of an early start), and that ranks no launcher takes over are stopped
at once. The distributed tests run their commands through it (tests/test_distributed.py, test_sharded_run_dir.py,
test_collectives.py, test_preemption.py): a config error the ranks meet before their group exists printed once, a
failed rank ending the others.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
from omegaconf import OmegaConf

from multiloss.parallel import early_ranks
from tests.conftest import QUIET, run_cli


def _trainer(**keys):
    return OmegaConf.create({"accelerator": "auto", "devices": "auto", "strategy": "auto", "num_nodes": 1, **keys})


FSDP = {"_target_": "multiloss.parallel.fsdp.FSDPStrategy"}


@pytest.mark.parametrize(
    ("keys", "env", "wanted"),
    [
        ({"accelerator": "cpu", "devices": 2, "strategy": "ddp"}, {}, 2),  # trainer=ddp_cpu
        ({"accelerator": "cpu", "devices": 2, "strategy": FSDP}, {}, 2),  # trainer=fsdp_cpu
        ({"accelerator": "cpu", "devices": "3", "strategy": "ddp_find_unused_parameters_true"}, {}, 3),
        ({"accelerator": "gpu", "devices": -1, "strategy": "ddp"}, {"CUDA_VISIBLE_DEVICES": "0,1"}, 2),  # trainer=ddp
        ({"accelerator": "gpu", "devices": -1, "strategy": FSDP}, {"CUDA_VISIBLE_DEVICES": "0,-1,2"}, 1),  # CUDA stops
        ({"accelerator": "cpu", "devices": 1}, {}, 1),  # trainer=cpu
        ({"accelerator": "cpu", "devices": 2}, {}, 1),  # strategy auto: Lightning decides
        ({"accelerator": "cpu", "devices": 2, "strategy": "ddp_spawn"}, {}, 1),  # refused later, never started early
        ({"accelerator": "cpu", "devices": 2, "strategy": "ddp", "num_nodes": 2}, {}, 1),  # several nodes
        ({"accelerator": "cpu", "devices": 2, "strategy": "ddp"}, {"LOCAL_RANK": "0"}, 1),  # started by another
        ({"accelerator": "cpu", "devices": 2, "strategy": "ddp"}, {"TORCHELASTIC_RUN_ID": "x"}, 1),  # torchrun
        ({"accelerator": "cpu", "devices": 2, "strategy": "ddp"}, {"SLURM_JOB_ID": "7"}, 1),  # srun / sbatch
        ({"accelerator": "cpu", "devices": 2, "strategy": "ddp"}, {"MULTILOSS_EARLY_RANKS": "0"}, 1),  # turned off
    ],
)
def test_only_runs_whose_ranks_the_config_tells_start_them_early(monkeypatch, keys, env, wanted):
    for name in (*early_ranks._LAUNCHED_ELSEWHERE, "CUDA_VISIBLE_DEVICES", early_ranks.SWITCH):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert early_ranks.processes_wanted(_trainer(**keys)) == wanted


def test_ranks_no_launcher_takes_over_are_stopped_at_once(monkeypatch):
    """Started for 2 ranks, then the Trainer wants 3 (or another launcher): stopped, and the launcher starts its own."""
    monkeypatch.delenv(early_ranks.REPORTS, raising=False)
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    for adopt in (lambda: early_ranks.adopt(3, 1, True), lambda: early_ranks.settle(object(), False)):
        ranks = early_ranks.EarlyRanks(2, 0, procs=[subprocess.Popen(sleeper)])
        monkeypatch.setattr(early_ranks, "_started", ranks)
        assert adopt() is None
        assert ranks.procs == [] and early_ranks._started is None  # killed and waited for
    ranks = early_ranks.EarlyRanks(2, 12345, procs=[subprocess.Popen(sleeper)])
    monkeypatch.setattr(early_ranks, "_started", ranks)
    for name in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert early_ranks.adopt(2, 1, True) is ranks  # the launcher's count: taken over, this process their rank zero
    import os

    assert (os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_PORT"]) == ("0", "2", "12345")
    ranks.adopted = False
    early_ranks.finished()  # the run over: nothing left running
    assert ranks.procs == []


class EarlyMark(L.Callback):
    """Writes, per rank, whether this process was started before its rank zero imported anything."""

    def __init__(self, dirpath: str) -> None:
        self.dirpath = dirpath

    def on_train_start(self, trainer, pl_module) -> None:
        mark = {"early": early_ranks.started_early(), "world_size": trainer.world_size}
        (Path(self.dirpath) / f"early_rank{trainer.global_rank}.json").write_text(json.dumps(mark))


@pytest.mark.distributed
@pytest.mark.parametrize("trainer", ["ddp_cpu", "fsdp_cpu"])
def test_the_launcher_takes_over_the_ranks_started_early(tmp_path, trainer):
    out = tmp_path / "run"
    proc = run_cli(
        *QUIET,
        "~callbacks.loss_curves",
        f"trainer={trainer}",
        "trainer.max_steps=2",
        "+callbacks.mark._target_=tests.test_early_ranks.EarlyMark",
        f"+callbacks.mark.dirpath={tmp_path}",
        f"hydra.run.dir={out}",
        cwd=tmp_path,
        env={"TMPDIR": str(tmp_path)},  # where the ranks' shared report dir is made
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    marks = [json.loads((tmp_path / f"early_rank{r}.json").read_text()) for r in (0, 1)]
    assert marks == [{"early": False, "world_size": 2}, {"early": True, "world_size": 2}]
    assert (out / "train_rank1.log").is_file() and (out / "checkpoints" / "last.ckpt").exists()
    assert not list(tmp_path.glob("multiloss-ranks-*"))  # the ranks' shared report dir is gone too
