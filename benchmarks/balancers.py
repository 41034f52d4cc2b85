"""The balancers side by side: final metrics per task and time per training batch, one default run each.

    python benchmarks/balancers.py                       # weighted on digits, every balancer, 15 epochs
    python benchmarks/balancers.py --balancers fixed pcgrad --override trainer.max_epochs=3

Each run is the recipe's default (``python train.py recipe=weighted balancer=<name>``, seed 0), quiet,
in a temporary run dir. Time per batch is the median of ``on_train_batch_start`` → ``on_train_batch_end``
(the step, its backward(s) and the optimizer), so start-up and validation are left out. Prints a
Markdown table (the README's). A benchmark, not a test: the numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import lightning as L
import torch
from omegaconf import open_dict

from multiloss import testing, train

BALANCERS = ("fixed", "uncertainty", "dwa", "pcgrad", "gradnorm", "upgrad", "mgda")
QUIET = (
    "print_config=false",
    "~callbacks.progress_bar",
    "trainer.enable_progress_bar=false",
    "trainer.accelerator=cpu",
)


TIMES: list[float] = []  # the current run's batch times (the timer is built from config, by train)


class BatchTimer(L.Callback):
    def __init__(self) -> None:
        self._start = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: object, i: int) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: object) -> None:
        TIMES.append(time.perf_counter() - self._start)


def run(balancer: str, overrides: list[str]) -> tuple[dict[str, float], float, float]:
    out = tempfile.mkdtemp(prefix=f"balancer-{balancer}-")
    cfg = testing.compose("recipe=weighted", f"balancer={balancer}", *QUIET, *overrides, output_dir=out)
    with open_dict(cfg):
        cfg.callbacks["batch_timer"] = {"_target_": f"{__name__}.BatchTimer"}
    TIMES.clear()
    started = time.perf_counter()
    metrics = train(cfg)
    wall = time.perf_counter() - started
    return metrics, wall, statistics.median(TIMES) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--balancers", nargs="+", default=list(BALANCERS), choices=BALANCERS)
    parser.add_argument("--override", nargs="*", default=[], help="extra config overrides for every run")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for name in args.balancers:
        metrics, wall, per_batch = run(name, args.override)
        rows.append((name, metrics, wall, per_batch))
        print(f"{name}: {per_batch:.2f} ms/batch, {wall:.1f} s", flush=True)
    print("\n| balancer | digit acc | parity acc | ink MAE | ms / batch | run (s) |\n|---|---:|---:|---:|---:|---:|")
    for name, m, wall, per_batch in rows:
        print(
            f"| `{name}` | {m['val/acc/digit']:.3f} | {m['val/acc/parity']:.3f} | {m['val/mae/ink']:.4f} "
            f"| {per_batch:.2f} | {wall:.0f} |"
        )


if __name__ == "__main__":
    main()
