"""``hydra/launcher=slurm``: submitit's SLURM launcher, whose ``-m`` command reports a failed job in one line.

A Hydra plugin (Hydra instantiates launchers only from the ``hydra_plugins`` package, and imports
every module there at each start: this one stays light, and absent without the ``slurm`` extra).

A job that fails reaches submitit's submitter as ``FailedJobError`` with the job's whole traceback,
which Hydra prints as a traceback of its own. Inside a job, multiloss ends a user error with
`multiloss.cli.JobFailed` (an exception, so that submitit records a result at all: an exit would
leave the submitter polling); here the ``multiloss: config error: …`` line it carries comes back
as the ``-m`` command's message, with the path of the job's log, and a non-zero exit.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.errors import CompactHydraException

try:
    from hydra_plugins.hydra_submitit_launcher import submitit_launcher
except ImportError:  # no `slurm` extra: hydra/launcher=slurm then says the plugin is missing
    submitit_launcher = None


class JobError(CompactHydraException):
    """A submitted job failed: Hydra prints a compact exception's message alone, and exits 1."""


if submitit_launcher is not None:

    class SlurmLauncher(submitit_launcher.SlurmLauncher):
        def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Any:
            from submitit.core.utils import FailedJobError, UncompletedJobError

            try:
                results = super().launch(job_overrides, initial_job_idx)
            except (FailedJobError, UncompletedJobError) as err:  # the job died outside Hydra's run_job
                raise JobError(job_message(str(err))) from None
            for result in results:  # Hydra's run_job in the job caught the task's exception
                if result.status == JobStatus.FAILED:
                    raise JobError(self._failure(result))
            return results

        def _failure(self, result: JobReturn) -> str:
            error = result._return_value
            text = str(error) if str(error).startswith("multiloss: ") else f"{type(error).__name__}: {error}"
            job_id = str(result.hydra_cfg.hydra.job.id) if result.hydra_cfg else ""
            log = Path(str(self.params["submitit_folder"]).replace("%j", job_id)) / f"{job_id}_0_log.err"
            return text + (f"\n  job log: {log.resolve()}" if job_id and log.is_file() else "")


def job_message(failure: str) -> str:
    """The job's ``multiloss: …`` line (or its last line) and the paths of its logs, from submitit's message."""
    lines = [line.strip() for line in failure.splitlines() if line.strip()]
    ours = [line[line.index("multiloss: ") :] for line in lines if "multiloss: " in line]
    logs = [line[2:].strip() for line in lines if line.startswith("- ")]
    trace_end = [line for line in lines if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Exit)\b", line)]
    first = ours[-1] if ours else (trace_end[-1] if trace_end else lines[0] if lines else "the job failed")
    return first + (f"\n  job log: {logs[0]}" if logs else "")
