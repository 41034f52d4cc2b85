"""The balancers side by side: final metrics per task and time per training batch, over several seeds.

    python benchmarks/balancers.py                                   # weighted on digits, every balancer, seeds 0-2
    python benchmarks/balancers.py --experiment digit_pairs          # two competing tasks (MultiMNIST-style)
    python benchmarks/balancers.py --balancers fixed pcgrad --seeds 0 --override trainer.max_epochs=3
    python benchmarks/balancers.py --delta-p --seeds 0 1 2 3 4       # LibMTL's Δp against single-task runs, 95 % CI
    python benchmarks/balancers.py --delta-p --experiment task_regression --override data.correlation=0.9

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
from pathlib import Path

import lightning as L
import torch
from omegaconf import open_dict

from multiloss import testing, train
from multiloss.metrics import delta_p

BALANCERS = tuple(sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "configs/balancer").glob("*.yaml")))
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


def interval(values: list[float]) -> tuple[float, float]:
    """The mean and the half-width of its 95 % Student-t interval."""
    from scipy import stats

    mean = statistics.mean(values)
    if len(values) < 2:
        return mean, float("nan")
    return mean, stats.t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / len(values) ** 0.5


# The tuned fixed's budget, per setup: one key, four values (a method's defaults get no tuning either).
TUNING = {
    "recipe=weighted": "model.tasks.ink.weight=1,10,30,100",
    "experiment=digit_pairs": "model.tasks.right.weight=0.5,1,2,4",
    "experiment=task_regression": "model.optimizer.lr=0.001,0.003,0.01,0.03",
    "experiment=scenes": "model.tasks.depth.weight=0.25,0.5,1,2",
}


def delta_p_table(
    setup: list[str], balancers: list[str], seeds: list[int], overrides: list[str], tune: str | None
) -> None:
    """Each task trained alone (the others' weights 0, per seed), then every balancer: Δp per seed, mean ± 95 % CI.
    A tuned ``fixed`` gets a budget of four runs per seed (``tune``: ``key=v1,v2,...``), the best mean Δp over the
    seeds (reported as such: it has seen the seeds it is scored on)."""
    tasks = list(testing.compose(*setup, *overrides).model.tasks)
    singles = {}
    for seed in seeds:
        merged: dict[str, float] = {}
        for task in tasks:
            alone = [f"model.tasks.{other}.weight=0" for other in tasks if other != task]
            metrics, _ = run(setup, "fixed", seed, [*overrides, *alone])
            merged.update({n: v for n, v in metrics.items() if n.endswith(f"/{task}")})
        singles[seed] = merged
    names = task_metrics(singles[seeds[0]])
    rows = []
    for balancer in balancers:
        values = [delta_p(run(setup, balancer, seed, overrides)[0], singles[seed], names) for seed in seeds]
        rows.append((f"`{balancer}`", values))
        print(
            f"{balancer}: Δp {interval(values)[0]:+.2f} % (seeds: {', '.join(f'{v:+.2f}' for v in values)})", flush=True
        )
    tune = tune or TUNING.get(" ".join(setup))
    if tune:
        key, _, grid = tune.partition("=")
        tuned = []
        for value in grid.split(","):
            extra = [*overrides, f"{key}={value}"]
            tuned.append((value, [delta_p(run(setup, "fixed", s, extra)[0], singles[s], names) for s in seeds]))
        value, values = max(tuned, key=lambda t: statistics.mean(t[1]))
        rows.append((f"`fixed`, tuned ({key}={value})", values))
    where = " ".join([*setup, *overrides])
    print(f"\n{where}, seeds {seeds}: Δp (%) against each task trained alone, mean ± 95 % CI (t)")
    print("| balancer | Δp % | 95 % CI | per seed |")
    print("|---|---:|---:|---|")
    for label, values in rows:
        mean, half = interval(values)
        print(f"| {label} | {mean:+.2f} | ± {half:.2f} | {', '.join(f'{v:+.1f}' for v in values)} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--experiment", default=None, help="an experiment config (e.g. digit_pairs); default: recipe=weighted"
    )
    parser.add_argument("--balancers", nargs="+", default=list(BALANCERS), choices=BALANCERS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--override", nargs="*", default=[], help="extra config overrides for every run")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--delta-p", action="store_true", help="LibMTL's Δp against single-task runs")
    parser.add_argument("--tune", default=None, help="the tuned fixed's grid, key=v1,v2,... (default: per setup)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    setup = [f"experiment={args.experiment}"] if args.experiment else ["recipe=weighted"]
    if args.delta_p:
        delta_p_table(setup, args.balancers, args.seeds, args.override, args.tune)
        return

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
