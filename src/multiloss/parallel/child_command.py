"""The command a rank > 0 of a one-node run is started with: *this Hydra job* (not the whole command line).

Lightning's launcher re-runs ``sys.argv``; under ``python train.py -m seed=1,2 trainer=ddp_cpu`` that is the whole
sweep, so every job's child ranks would launch the sweep again. A child runs the job: its own overrides (``seed=1``)
and its own output dir (the sweep subdir), as a plain run. Nothing here imports torch: the ranks are started before
the imports too (`multiloss.parallel.early_ranks`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from hydra.core.hydra_config import HydraConfig
from hydra.utils import get_original_cwd


def job_command(local_rank: int) -> tuple[Sequence[str], str]:
    """The command line and the working directory that run this Hydra job as rank ``local_rank``."""
    import __main__

    hydra_cfg = HydraConfig.get()
    if __main__.__spec__ is None:
        command = [sys.executable, os.path.abspath(sys.argv[0])]
    else:
        command = [sys.executable, "-m", __main__.__spec__.name]
    # Keep how the user pointed at the config (--config-path/-cp, --config-name/-cn, --config-dir/-cd).
    args = sys.argv[1:]
    for i, arg in enumerate(args):
        if arg.split("=")[0] in ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd"):
            command += [arg] if "=" in arg else [arg, args[i + 1]]
    # The option dirs a resumed run took from its checkpoint (`multiloss.saving.run_dir.run_overrides`) are a Hydra
    # override.
    command += [o for o in hydra_cfg.overrides.hydra if o.startswith("hydra.searchpath=")]
    command += list(hydra_cfg.overrides.task)
    command += [
        f'hydra.run.dir="{hydra_cfg.runtime.output_dir}"',
        f"hydra.job.name={hydra_cfg.job.name}_rank{local_rank}",
        "hydra.output_subdir=null",
    ]
    return command, get_original_cwd()
