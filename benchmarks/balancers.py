"""The balancers side by side: final metrics per task and time per training batch, over several seeds.

    python benchmarks/balancers.py                                   # weighted on digits, every balancer, seeds 0-2
    python benchmarks/balancers.py --experiment digit_pairs          # two competing tasks (MultiMNIST-style)
    python benchmarks/balancers.py --balancers fixed pcgrad --seeds 0 --override trainer.max_epochs=3
    python benchmarks/balancers.py --delta-p --seeds 0 1 2 3 4       # LibMTL's Δp against single-task runs, 95 % CI
    python benchmarks/balancers.py --delta-p --experiment task_regression --override data.correlation=0.9
    python benchmarks/balancers.py --delta-p --experiment scenes --override data.path=$PWD/data/scenes \
        --jobs 2 --results scenes.jsonl                              # 2 runs at a time; re-run to resume


Each run is the recipe's default (``python train.py recipe=weighted balancer=<name> seed=<s>``, or
``experiment=<name>``), quiet, in a temporary run dir. Time per batch is the median of
``on_train_batch_start`` → ``on_train_batch_end`` (the step, its backward(s) and the optimizer), so
start-up and validation are left out. One more run, ``balancer=fixed monitor=conflicts`` at the first
seed, measures how often the tasks' gradients conflict. Prints Markdown tables (the README's): each
task's final validation metric as mean ± standard deviation over the seeds. A benchmark, not a test:
the numbers depend on the machine.

``--jobs N`` runs N trainings at a time, each in its own process with ``--threads`` threads; ``--results FILE``
keeps every finished run (one JSON line: its setup, balancer, seed, overrides, final metrics and ms/batch), so an
interrupted benchmark started again with the same file runs only what is missing.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import lightning as L
import torch
from omegaconf import open_dict

from multiloss import testing, train
from multiloss.base.metrics import LOWER_IS_BETTER, delta_p

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


Job = tuple[tuple[str, ...], str, int, tuple[str, ...]]  # setup, balancer, seed, overrides
Result = tuple[dict[str, float], float]  # final metrics, median ms per training batch


def run(setup: list[str], balancer: str, seed: int, overrides: list[str]) -> Result:
    """One training run: its final metrics and its median ms per training batch."""
    out = tempfile.mkdtemp(prefix=f"balancer-{balancer}-{seed}-")
    cfg = testing.compose(*setup, f"balancer={balancer}", f"seed={seed}", *QUIET, *overrides, output_dir=out)
    with open_dict(cfg):
        cfg.callbacks["batch_timer"] = {"_target_": f"{__name__}.BatchTimer"}
    TIMES.clear()
    metrics = train(cfg)
    return {k: float(v) for k, v in metrics.items()}, statistics.median(TIMES) * 1e3


def _run_job(job: Job) -> Result:
    setup, balancer, seed, overrides = job
    return run(list(setup), balancer, seed, list(overrides))


class Runner:
    """Runs jobs ``jobs`` at a time (spawned processes of ``threads`` threads each), keeping each result in
    ``results`` (JSON lines) and reading the ones already there instead of running them again."""

    def __init__(
        self,
        jobs: int = 1,
        threads: int = 1,
        results: Path | None = None,
        run_job: Callable[[Job], Result] | None = None,
    ) -> None:
        self.jobs, self.threads, self.results = jobs, threads, results
        self.run_job = run_job or _run_job  # (a job's "balancer" is its configuration's name for another benchmark)
        self.done: dict[Job, Result] = {}
        if results is not None and results.exists():
            for line in results.read_text().splitlines():
                row = json.loads(line)
                job = (tuple(row["setup"]), row["balancer"], row["seed"], tuple(row["overrides"]))
                self.done[job] = (row["metrics"], row["ms"])

    def _keep(self, job: Job, result: Result, seconds: float) -> None:
        self.done[job] = result
        setup, balancer, seed, overrides = job
        print(f"  ran {balancer} seed {seed} {' '.join(overrides)} ({seconds:.0f} s)", flush=True)
        if self.results is not None:
            row = {"setup": setup, "balancer": balancer, "seed": seed, "overrides": overrides}
            with self.results.open("a") as f:
                f.write(json.dumps({**row, "metrics": result[0], "ms": result[1]}) + "\n")

    def __call__(self, jobs: list[Job]) -> list[Result | None]:
        missing = list(dict.fromkeys(job for job in jobs if job not in self.done))
        start = time.perf_counter()
        if self.jobs == 1:
            for job in missing:
                self._keep(job, self.run_job(job), time.perf_counter() - start)
        elif missing:
            spawn = multiprocessing.get_context("spawn")  # no forked torch state in the workers
            with ProcessPoolExecutor(
                self.jobs, spawn, initializer=torch.set_num_threads, initargs=(self.threads,)
            ) as pool:
                futures = {pool.submit(self.run_job, job): job for job in missing}
                for future in as_completed(futures):
                    try:
                        self._keep(futures[future], future.result(), time.perf_counter() - start)
                    except Exception as error:  # the others go on; a failed run is reported, not kept
                        print(f"  FAILED {futures[future][1]} seed {futures[future][2]}: {error!r}", flush=True)
        return [self.done.get(job) for job in jobs]


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
    "experiment=scenes": "model.tasks.normal.weight=1,2,4,8",  # its loss (1 - cos) is ~10x smaller
}


def delta_p_table(
    setup: list[str],
    balancers: list[str],
    seeds: list[int],
    overrides: list[str],
    tune: str | None,
    runner: Runner,
    columns: list[str] | None = None,
) -> None:
    """Each task trained alone (the others' weights 0, per seed), then every balancer: Δp per seed, mean ± 95 % CI,
    and beside it each metric's mean over the seeds (``columns``: which, ``<metric>/<task>``; default every one).
    A tuned ``fixed`` gets a budget of four runs per seed (``tune``: ``key=v1,v2,...``), the best mean Δp over the
    seeds (reported as such: it has seen the seeds it is scored on). Every run is handed to ``runner`` at once."""
    tasks = list(testing.compose(*setup, *overrides).model.tasks)
    tune = tune or TUNING.get(" ".join(setup))
    key, _, grid = (tune or "").partition("=")
    alone = {task: tuple(f"model.tasks.{other}.weight=0" for other in tasks if other != task) for task in tasks}
    single_jobs = {
        (seed, task): (tuple(setup), "fixed", seed, (*overrides, *alone[task])) for seed in seeds for task in tasks
    }
    method_jobs = {(b, seed): (tuple(setup), b, seed, tuple(overrides)) for b in balancers for seed in seeds}
    tuned_jobs = {
        (value, seed): (tuple(setup), "fixed", seed, (*overrides, f"{key}={value}"))
        for value in (grid.split(",") if tune else [])
        for seed in seeds
    }
    everything = [*single_jobs.values(), *method_jobs.values(), *tuned_jobs.values()]
    results = dict(zip(everything, runner(everything), strict=True))

    singles = {
        seed: {n: v for task in tasks for n, v in results[single_jobs[seed, task]][0].items() if n.endswith(f"/{task}")}
        for seed in seeds
    }
    names = task_metrics(singles[seeds[0]])
    shown = [f"val/{c}" for c in columns] if columns else names
    rows = [("each task alone (`fixed`)", [0.0] * len(seeds), [singles[s] for s in seeds])]
    for balancer in balancers:
        if any(results[method_jobs[balancer, seed]] is None for seed in seeds):
            print(f"{balancer}: left out of the table, a run failed (above)")
            continue
        runs = [results[method_jobs[balancer, seed]][0] for seed in seeds]
        rows.append((f"`{balancer}`", [delta_p(m, singles[s], names) for m, s in zip(runs, seeds, strict=True)], runs))
    if tune:
        tried = []
        for value in grid.split(","):
            runs = [results[tuned_jobs[value, seed]][0] for seed in seeds]
            tried.append((value, [delta_p(m, singles[s], names) for m, s in zip(runs, seeds, strict=True)], runs))
        value, values, runs = max(tried, key=lambda t: statistics.mean(t[1]))
        rows.append((f"`fixed`, tuned ({key}={value})", values, runs))
    where = " ".join([*setup, *overrides])
    print(f"\n{where}, seeds {seeds}: Δp (%) against each task trained alone; every figure mean ± 95 % CI (t)")
    print("| balancer | Δp % | " + " | ".join(f"`{n.removeprefix('val/')}`" for n in shown) + " | Δp per seed |")
    print("|---|---:|" + "---:|" * len(shown) + "---|")
    for label, values, runs in rows:
        cells = " | ".join("{:.3f} ± {:.3f}".format(*interval([r[n] for r in runs])) for n in shown)
        mean, half = interval(values)
        print(f"| {label} | {mean:+.2f} ± {half:.2f} | {cells} | {', '.join(f'{v:+.1f}' for v in values)} |")
    print(against_fixed(rows, shown), flush=True)


def against_fixed(rows: list[tuple[str, list[float], list[dict[str, float]]]], shown: list[str]) -> str:
    """Per metric, the methods whose 95 % interval lies wholly beyond default ``fixed``'s, better or worse (the
    metric's direction as LibMTL's Δp reads it); every other method overlaps ``fixed`` there."""
    by_label = {label: runs for label, _, runs in rows}
    if "`fixed`" not in by_label:
        return ""
    lines = []
    for name in shown:
        lower = any(word in name.split("/")[-2] for word in LOWER_IS_BETTER)
        ref_mean, ref_half = interval([r[name] for r in by_label["`fixed`"]])
        better, worse = [], []
        for label, runs in by_label.items():
            mean, half = interval([r[name] for r in runs])
            if label == "`fixed`" or half != half:  # nan: one seed
                continue
            if mean - half > ref_mean + ref_half:
                (worse if lower else better).append(label)
            elif mean + half < ref_mean - ref_half:
                (better if lower else worse).append(label)
        lines.append(
            f"- `{name.removeprefix('val/')}`: better than `fixed` {', '.join(better) or 'none'}; "
            f"worse {', '.join(worse) or 'none'}"
        )
    return "\nIntervals apart from default `fixed`'s (the rest overlap it):\n" + "\n".join(lines)


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
    parser.add_argument("--columns", nargs="*", default=None, help="metrics beside Δp, <metric>/<task> (default: all)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time, each its own process (--delta-p)")
    parser.add_argument("--results", type=Path, default=None, help="JSON lines of finished runs, read to resume")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    runner = Runner(args.jobs, args.threads, args.results)
    setup = [f"experiment={args.experiment}"] if args.experiment else ["recipe=weighted"]
    if args.delta_p:
        delta_p_table(setup, args.balancers, args.seeds, args.override, args.tune, runner, args.columns)
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
