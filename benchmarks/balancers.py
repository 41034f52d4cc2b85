"""The balancers side by side: final metrics per task and time per training batch, over several seeds.

    python benchmarks/balancers.py                                   # weighted on digits, every balancer, seeds 0-2
    python benchmarks/balancers.py --experiment digit_pairs          # two competing tasks (MultiMNIST-style)
    python benchmarks/balancers.py --balancers fixed pcgrad --seeds 0 --override trainer.max_epochs=3

Each run is the recipe's default (``python train.py recipe=weighted balancer=<name> seed=<s>``, or
``experiment=<name>``), quiet, in a temporary run dir. Time per batch is the median of
``on_train_batch_start`` → ``on_train_batch_end`` (the step, its backward(s) and the optimizer), so
start-up and validation are left out. One more run, ``balancer=fixed monitor=conflicts`` at the first
seed, measures how often the tasks' gradients conflict. Prints Markdown tables (the README's): each
task's final validation metric as mean ± standard deviation over the seeds. A benchmark, not a test:
the numbers depend on the machine.
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


def run(setup: list[str], balancer: str, seed: int, overrides: list[str]) -> tuple[dict[str, float], float]:
    """One training run: its final metrics and its median ms per training batch."""
    out = tempfile.mkdtemp(prefix=f"balancer-{balancer}-{seed}-")
    cfg = testing.compose(*setup, f"balancer={balancer}", f"seed={seed}", *QUIET, *overrides, output_dir=out)
    with open_dict(cfg):
        cfg.callbacks["batch_timer"] = {"_target_": f"{__name__}.BatchTimer"}
    TIMES.clear()
    metrics = train(cfg)
    return metrics, statistics.median(TIMES) * 1e3


def task_metrics(metrics: dict[str, float]) -> list[str]:
    """``val/<metric>/<task>`` names (not the losses), in a stable order."""
    return sorted(k for k in metrics if k.startswith("val/") and not k.startswith("val/loss/"))


def mean_std(values: list[float], digits: int) -> str:
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--experiment", default=None, help="an experiment config (e.g. digit_pairs); default: recipe=weighted"
    )
    parser.add_argument("--balancers", nargs="+", default=list(BALANCERS), choices=BALANCERS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--override", nargs="*", default=[], help="extra config overrides for every run")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    setup = [f"experiment={args.experiment}"] if args.experiment else ["recipe=weighted"]

    monitored, _ = run(setup, "fixed", args.seeds[0], [*args.override, "monitor=conflicts"])
    for name in sorted(k for k in monitored if k.startswith("conflict/")):
        print(f"{name}: {monitored[name]:.3f} (balancer=fixed, seed {args.seeds[0]}, last log row)", flush=True)

    rows = []
    for balancer in args.balancers:
        results = [run(setup, balancer, seed, args.override) for seed in args.seeds]
        rows.append((balancer, results))
        print(f"{balancer}: {statistics.median(ms for _, ms in results):.2f} ms/batch", flush=True)
    names = task_metrics(rows[0][1][0][0])
    print(f"\n{' '.join(setup)}, seeds {args.seeds}: mean ± std of the final validation metrics")
    print("| balancer | " + " | ".join(f"`{n.removeprefix('val/')}`" for n in names) + " | ms / batch |")
    print("|---|" + "---:|" * (len(names) + 1))
    for balancer, results in rows:
        cells = [mean_std([m[n] for m, _ in results], 4 if "mae" in n else 3) for n in names]
        ms = statistics.median(ms for _, ms in results)
        print(f"| `{balancer}` | " + " | ".join(cells) + f" | {ms:.2f} |")


if __name__ == "__main__":
    main()
