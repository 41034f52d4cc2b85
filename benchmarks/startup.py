"""Start-up, as a user meets it: ``--help``, and the time from the command to the first training step.

    python benchmarks/startup.py                 # every recipe, median of 3 launches each
    python benchmarks/startup.py --repeats 5 --recipes gan

Each launch is ``python train.py ...`` in a fresh process. "First step" is the wall time from the
launch to Lightning's first ``on_train_batch_start`` (composition, validation, imports, data, the
component check and the Trainer's set-up all before it), read from a callback that notes the time
and stops the run. ``python -c "import torch"`` is the yardstick: ``--help`` imports neither torch
nor Lightning and should beat it.
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


class FirstStep(L.Callback):
    """Writes the wall-clock time of the first training batch's start to ``$MULTILOSS_FIRST_STEP`` and stops."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        Path(os.environ["MULTILOSS_FIRST_STEP"]).write_text(repr(time.time()))
        trainer.should_stop = True


def launch(*args: str, env: dict[str, str] | None = None) -> float:
    start = time.time()
    subprocess.run([sys.executable, *args], cwd=ROOT, env=env, check=True, capture_output=True)
    return time.time() - start


def first_step(recipe: str) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        stamp = Path(tmp) / "first_step"
        env = {
            **os.environ,
            "MULTILOSS_FIRST_STEP": str(stamp),
            "PYTHONPATH": os.pathsep.join([str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH", "")]),
            "PYTHONWARNINGS": "ignore",
        }
        start = time.time()
        subprocess.run(
            [
                sys.executable,
                "train.py",
                f"recipe={recipe}",
                "print_config=false",
                f"hydra.run.dir={tmp}/run",
                "+callbacks.first_step._target_=startup.FirstStep",
            ],
            cwd=ROOT,
            env=env,
            check=True,
            capture_output=True,
        )
        return float(stamp.read_text()) - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=RECIPES)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    median = statistics.median
    print(f"Machine: {platform.machine()}, {os.cpu_count()} cores; Python {platform.python_version()}.\n")
    print(f"| command | seconds (median of {args.repeats}) |")
    print("|---|---:|")
    torch_s = median(launch("-c", "import torch") for _ in range(args.repeats))
    print(f'| `python -c "import torch"` | {torch_s:.2f} |')
    help_s = median(launch("train.py", "--help") for _ in range(args.repeats))
    print(f"| `python train.py --help` | {help_s:.2f} |")
    for recipe in args.recipes:
        seconds = median(first_step(recipe) for _ in range(args.repeats))
        print(f"| `python train.py recipe={recipe}`: command to first step | {seconds:.2f} |", flush=True)


if __name__ == "__main__":
    main()
