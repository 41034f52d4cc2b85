"""A multirun ends with one table: each job's overrides, its final values (or why it failed) and its run dir.

A Hydra callback (``hydra.callbacks.sweep_summary``, configs/hydra/default.yaml): Hydra hands it every job's
return as the job ends, in the process that runs the jobs one after another (the basic launcher, multiloss's DDP
jobs included). A launcher that runs the jobs elsewhere (``hydra/launcher=slurm``) returns them to its sweeper, not to
callbacks: each job's own log ends with its summary there. Imports nothing heavy: Hydra builds it before every run.
"""

from __future__ import annotations

from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

MAX_METRICS = 6  # the table's metric columns: the validation values first


class SweepSummary(Callback):
    def __init__(self) -> None:
        self.jobs: list[JobReturn] = []

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        self.jobs.append(job_return)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if self.jobs:
            print_table(self.jobs)
        self.jobs = []


def _values(job: JobReturn) -> dict[str, float] | None:
    if job.status != JobStatus.COMPLETED:
        return None
    value = job.return_value
    if isinstance(value, dict):
        return {str(k): float(v) for k, v in value.items() if isinstance(v, int | float)}
    if isinstance(value, int | float):  # a sweeper's objective (optimized_metric)
        return {str(job.cfg.get("optimized_metric") if job.cfg is not None else "value"): float(value)}
    return {}


def print_table(jobs: list[JobReturn]) -> None:
    import rich.console
    import rich.markup
    import rich.table

    values = [_values(job) for job in jobs]
    # What tells the jobs apart: the overrides not every job shares.
    shared = set.intersection(*(set(job.overrides or []) for job in jobs)) if len(jobs) > 1 else set()
    names = sorted({n for v in values if v for n in v}, key=lambda n: (not n.startswith("val/"), n))[:MAX_METRICS]
    table = rich.table.Table(show_edge=False, box=None)
    for column in ("job", "overrides", "ended", *names, "run dir"):
        table.add_column(column, justify="right" if column in names else "left")
    for number, (job, found) in enumerate(zip(jobs, values, strict=True)):
        hydra = job.hydra_cfg.hydra if job.hydra_cfg is not None else None
        out = str(hydra.runtime.output_dir) if hydra is not None else ""
        if found is None:
            failure = job._return_value  # the exception the job ended with (return_value would raise it)
            ended = f"failed: {type(failure).__name__}: {failure}"[:80]
        else:
            ended = "done"
        cells = [f"{found[n]:.4g}" if found and n in found else "" for n in names]
        number_shown = str(hydra.job.num) if hydra is not None else str(number)
        apart = " ".join(o for o in job.overrides or [] if o not in shared)
        table.add_row(number_shown, rich.markup.escape(apart), ended, *cells, out)
    console = rich.console.Console(highlight=False, width=1000)  # one line a job, as wide as it takes
    console.print(f"multiloss: the sweep's {len(jobs)} jobs")
    console.print(table)
