"""``hydra/launcher=slurm``: submitit's SLURM launcher, whose ``-m`` command reports a failed job in one line.

A job that fails reaches submitit's submitter as ``FailedJobError`` with the job's whole traceback,
which Hydra prints as a traceback of its own. Inside a job, multiloss ends a user error with
`multiloss.cli.JobFailed` (an exception, so that submitit records a result at all: an exit would
leave the submitter polling); here the ``multiloss: config error: …`` line it carries comes back
as the ``-m`` command's message, with the path of the job's log, and a non-zero exit.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from hydra.errors import CompactHydraException
from hydra_plugins.hydra_submitit_launcher import submitit_launcher


class JobError(CompactHydraException):
    """A submitted job failed: Hydra prints a compact exception's message alone, and exits 1."""


class SlurmLauncher(submitit_launcher.SlurmLauncher):
    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Any:
        from submitit.core.utils import FailedJobError, UncompletedJobError

        try:
            return super().launch(job_overrides, initial_job_idx)
        except (FailedJobError, UncompletedJobError) as err:
            raise JobError(job_message(str(err))) from None


def job_message(failure: str) -> str:
    """The job's ``multiloss: …`` line (or its last line) and the paths of its logs, from submitit's message."""
    lines = [line.strip() for line in failure.splitlines() if line.strip()]
    ours = [line[line.index("multiloss: ") :] for line in lines if "multiloss: " in line]
    logs = [line[2:].strip() for line in lines if line.startswith("- ")]
    trace_end = [line for line in lines if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Exit)\b", line)]
    first = ours[-1] if ours else (trace_end[-1] if trace_end else lines[0] if lines else "the job failed")
    return first + (f" (job log: {logs[0]})" if logs else "")
