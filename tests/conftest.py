"""Shared fixtures: compose the real Hydra config the way `python train.py` does."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig

from multiloss import testing

# Every distributed run of the suite (subprocesses inherit it; SLURM's srun exports it) runs under torch's collective
# checker: before each collective every rank's call is compared (op, shapes, dtypes), so a collective one rank issues
# alone fails at once with both ranks' calls named, instead of hanging the test.
os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
# The check before the imports (multiloss.config.early) fails loudly on a source it cannot read, in the tests' own
# process and in every command they run, instead of leaving the check to the run as a user's run does.
os.environ["MULTILOSS_STRICT_EARLY"] = "1"

ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = ROOT / "configs"
# Quiet and quick: no progress bar, no config tree, no model summary.
# One CPU process, no validation: the shape of most proof runs.
ONE_CPU_NO_VAL = (
    "trainer.accelerator=cpu",
    "trainer.devices=1",
    "trainer.num_sanity_val_steps=0",
    "trainer.limit_val_batches=0",
)
# ... and no loggers or callbacks either (nothing written but what a test asks for).
BARE = (*ONE_CPU_NO_VAL, "logger=none", "callbacks=none")
# The GAN's two shipped MLPs at width 32: quick, still learning.
SMALL_GAN = ("model.generator.width=32", "model.discriminator.width=32")
QUIET = (
    "print_config=false",
    "~callbacks.progress_bar",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
)


def compose_config(overrides: list[str], output_dir: Path) -> DictConfig:
    """The composed config of ``python train.py <overrides> hydra.run.dir=<output_dir>``."""
    return testing.compose(*overrides, output_dir=output_dir)


def train_here(out: Path, *overrides: str) -> Path:
    """``python train.py <overrides> hydra.run.dir=<out>`` run in this process (`multiloss.train`, what the command
    calls): a one-device reference run without a second interpreter's start-up."""
    from multiloss import train

    train(compose_config(list(overrides), out))
    return out


def _replaces_group(group: str, overrides: tuple[str, ...]) -> bool:
    return any(o.startswith(f"{group}=") for o in overrides)


@pytest.fixture
def make_cfg(tmp_path: Path) -> Callable[..., DictConfig]:
    def make(*overrides: str, output_dir: Path | str | None = None, quiet: bool = True) -> DictConfig:
        out = Path(output_dir) if output_dir is not None else tmp_path / "run"
        quiet_overrides = [
            q for q in QUIET if not (q.startswith("~callbacks.") and _replaces_group("callbacks", overrides))
        ]
        return compose_config([*(quiet_overrides if quiet else ()), *overrides], out)

    return make


def run_cli(
    *args: str,
    cwd: Path = ROOT,
    timeout: float = 300,
    python_flags: tuple[str, ...] = (),
    warnings: str = "ignore",
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """``python [python_flags] train.py <args>`` in a subprocess, as a user runs it (``PYTHONWARNINGS=warnings``;
    ``env``: variables set or changed)."""
    env = {**os.environ, "HYDRA_FULL_ERROR": "0", "PYTHONWARNINGS": warnings, **(env or {})}
    return subprocess.run(
        [sys.executable, *python_flags, str(ROOT / "train.py"), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_shell(
    command: str, cwd: Path = ROOT, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``command`` pasted into bash as a user would, ``python`` being this interpreter (the project's venv); ``env``:
    variables set or changed (the user's shell, e.g. a ``PYTHONPATH`` that imports their package)."""
    path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    env = {**os.environ, "PATH": path, "HYDRA_FULL_ERROR": "0", **(env or {})}
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def load_checkpoint(ckpt: Path) -> dict:
    """A checkpoint's entries: a file's, or a sharded run's directory read whole."""
    from multiloss.saving.checkpoints import read_sharded_checkpoint
    from multiloss.saving.saved_state import is_sharded_checkpoint

    if is_sharded_checkpoint(ckpt):
        return read_sharded_checkpoint(ckpt)
    return torch.load(ckpt, map_location="cpu", weights_only=False)


def load_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's ``state_dict`` (see `load_checkpoint`)."""
    return load_checkpoint(ckpt)["state_dict"]


@pytest.fixture(scope="session", autouse=True)
def _temporary_files_under_pytests_own_dir(tmp_path_factory: pytest.TempPathFactory):
    """`multiloss.testing`'s default dirs (`tempfile.mkdtemp`) under this session's basetemp, which pytest prunes,
    rather than one /tmp/multiloss-* a test left for good (hundreds a run)."""
    before = tempfile.tempdir
    tempfile.tempdir = str(tmp_path_factory.mktemp("tempfile"))
    yield
    tempfile.tempdir = before


@pytest.fixture(autouse=True)
def _few_threads():
    # Two cores: intra-op threads beyond that only add contention between tests and DDP ranks.
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest tests first: the SLURM group (one worker, minutes of jobs), then the other multi-process tests,
    then the rest, so that no worker is left with a long test while the other has finished (xdist hands tests out
    in this order)."""

    def rank(item: pytest.Item) -> int:
        if item.get_closest_marker("xdist_group"):
            return 0
        return 1 if item.get_closest_marker("distributed") else 2

    items.sort(key=rank)  # stable: within a rank, the collection order


def pytest_collection_finish(session: pytest.Session) -> None:
    """Under ``--dist loadgroup`` every test marked ``xdist_group`` must carry its group in its id (how xdist sends
    a group to one worker); when it does not (pytest 9.2 with xdist 3.8), each worker would start its own SLURM
    cluster: the run stops here instead."""
    if not session.config.getoption("loadgroup", default=False):
        return
    lost = [item.nodeid for item in session.items if item.get_closest_marker("xdist_group") and "@" not in item.nodeid]
    if lost:
        raise pytest.UsageError(
            f"pytest-xdist's loadgroup does not group {lost[0]} (and {len(lost) - 1} more) under pytest "
            f"{pytest.__version__}: the grouped tests would run on several workers at once"
        )
