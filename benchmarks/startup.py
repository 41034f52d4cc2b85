"""Start-up, as a user meets it: a config error, ``--help``, and the time from the command to the first training step.

    python benchmarks/startup.py                       # this checkout: every figure, median of 3 launches each
    python benchmarks/startup.py --before fca8b6c      # and the same figures of that commit, launches interleaved
    python benchmarks/startup.py --recipes gan --engines cpu ddp_cpu --repeats 5

Each launch is ``python train.py ...`` in a fresh process, timed from the launch:

- **config error**: until the process has exited on a mistake in the config — a value a component refuses
  (``data.batch_size=0``), a GAN penalty misspelled, a misspelled key (Hydra's own error), a misspelled
  recipe;
- **--help**: until it has printed the recipes and the config groups;
- **first step**: until Lightning's first ``on_train_batch_start`` on rank zero (composition, the checks, the
  imports, the data, the component check, the Trainer's set-up, and for 2 ranks their start and their process
  group), read from a callback (`FirstStep`) that notes the time and stops the run; per recipe, on one device
  (``trainer=cpu``) and on 2 ranks (``trainer=ddp_cpu``, ``fsdp_cpu``), with the 2-rank run's ratio to the
  one-device run's.

``import torch`` and ``import lightning`` (``python -c``) are the yardsticks on the same machine. ``--before REF``
checks REF out beside this checkout (``git worktree``) with an environment of its own (its ``make setup``) and
runs each of its launches right after this checkout's, so that both see the same machine. A benchmark, not a
test: the machine's load moves the figures; read the medians.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning as L

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ("multihead", "weighted", "gan", "tbptt", "accumulation")
ENGINES = ("cpu", "ddp_cpu", "fsdp_cpu")
CONFIG_ERRORS = {
    "a value refused (data.batch_size=0)": ("data.batch_size=0",),
    "a penalty misspelled (model.penalty=[r1,r3])": ("recipe=gan", "model.loss=relativistic", "model.penalty=[r1,r3]"),
    "a misspelled key (model.head_weight)": ("model.head_weight=[1,1,1]",),
    "a misspelled recipe (recipe=multihed)": ("recipe=multihed",),
}


class FirstStep(L.Callback):
    """Writes the wall-clock time of the first training batch's start on rank zero to ``$MULTILOSS_FIRST_STEP``, and
    stops the run on every rank."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == 0 and not trainer.should_stop:
            Path(os.environ["MULTILOSS_FIRST_STEP"]).write_text(repr(time.time()))
        trainer.should_stop = True


class Checkout:
    """A checkout to launch from: its ``train.py``, run by its own environment's Python."""

    def __init__(self, root: Path, label: str) -> None:
        self.root, self.label = root, label
        venv = root / ".venv" / "bin" / "python"
        self.python = str(venv) if venv.exists() else sys.executable

    def launch(self, *args: str, check: bool = True, env: dict[str, str] | None = None) -> float:
        start = time.time()
        done = subprocess.run([self.python, *args], cwd=self.root, env=env, capture_output=True, text=True)
        if check and done.returncode != 0:
            raise RuntimeError(f"{self.label}: {' '.join(args)} failed:\n{done.stderr[-2000:]}")
        return time.time() - start

    def config_error(self, *overrides: str) -> float:
        with tempfile.TemporaryDirectory() as tmp:
            return self.launch("train.py", *overrides, f"hydra.run.dir={tmp}/run", check=False)

    def first_step(self, recipe: str, engine: str) -> float:
        with tempfile.TemporaryDirectory() as tmp:
            stamp = Path(tmp) / "first_step"
            env = {
                **os.environ,
                "MULTILOSS_FIRST_STEP": str(stamp),
                "PYTHONPATH": os.pathsep.join([str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH", "")]),
                "PYTHONWARNINGS": "ignore",
            }
            start = time.time()
            self.launch(
                "train.py",
                f"recipe={recipe}",
                f"trainer={engine}",
                "print_config=false",
                "~callbacks.progress_bar",
                "trainer.enable_progress_bar=false",
                f"hydra.run.dir={tmp}/run",
                "+callbacks.first_step._target_=startup.FirstStep",
                env=env,
            )
            return float(stamp.read_text()) - start


def prepare_before(ref: str) -> Path:
    """REF checked out beside this checkout (a git worktree), set up by its own ``make setup``."""
    commit = subprocess.run(["git", "rev-parse", "--short", ref], cwd=ROOT, capture_output=True, text=True, check=True)
    where = Path(tempfile.gettempdir()) / f"multiloss-{commit.stdout.strip()}"
    if not where.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(where), ref], cwd=ROOT, check=True)
    if not (where / ".venv" / ".multiloss-installed").exists():
        subprocess.run(["make", "setup"], cwd=where, check=True)
    return where


def machine() -> str:
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    names = [line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")]
    vector = "AVX-512" if "avx512f" in cpuinfo else "AVX2" if "avx2" in cpuinfo else "no AVX2"
    model = names[0] if names else platform.processor() or platform.machine()
    return f"{model} ({vector}), {os.cpu_count()} cores, Python {platform.python_version()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=RECIPES)
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--before", metavar="REF", help="also time this commit's checkout, interleaved")
    args = parser.parse_args()
    checkouts = [Checkout(ROOT, "now")]
    if args.before:
        checkouts.insert(0, Checkout(prepare_before(args.before), args.before))

    def row(name: str, measure) -> dict[str, float]:
        times: dict[str, list[float]] = {c.label: [] for c in checkouts}
        for i in range(args.repeats):
            for checkout in checkouts if i % 2 == 0 else reversed(checkouts):  # alternate who goes first
                times[checkout.label].append(measure(checkout))
        medians = {label: statistics.median(values) for label, values in times.items()}
        cells = " | ".join(f"{medians[c.label]:.2f}" for c in checkouts)
        print(f"| {name} | {cells} |", flush=True)
        return medians

    print(f"Machine: {machine()}. Seconds, median of {args.repeats} fresh launches.\n")
    print(f"| command | {' | '.join(c.label for c in checkouts)} |")
    print(f"|---|{'---:|' * len(checkouts)}")
    row('`python -c "import torch"`', lambda c: c.launch("-c", "import torch"))
    row('`python -c "import lightning"`', lambda c: c.launch("-c", "import lightning"))
    for name, overrides in CONFIG_ERRORS.items():
        row(f"config error: {name}", lambda c, o=overrides: c.config_error(*o))
    row("`python train.py --help`", lambda c: c.launch("train.py", "--help"))
    ratios: list[str] = []
    for recipe in args.recipes:
        one = None
        for engine in args.engines:
            medians = row(
                f"`recipe={recipe} trainer={engine}`: command to first step",
                lambda c, e=engine, r=recipe: c.first_step(r, e),
            )
            if engine == "cpu":
                one = medians
            elif one is not None:
                ratios.append(
                    f"{recipe} {engine}: "
                    + ", ".join(f"{c.label} {medians[c.label] / one[c.label]:.2f}×" for c in checkouts)
                )
    if ratios:
        print("\n2 ranks against one device, command to first step:\n" + "\n".join(f"- {r}" for r in ratios))


if __name__ == "__main__":
    main()
