"""The command a rank > 0 of a one-node run is started with: *this Hydra job* (not the whole command line).

Lightning's launcher re-runs ``sys.argv``; under ``python train.py -m seed=1,2 trainer=ddp_cpu`` that is the whole
sweep, so every job's child ranks would launch the sweep again. A child runs the job: its own overrides (``seed=1``)
and its own output dir (the sweep subdir), as a plain run. Nothing here imports torch: the ranks are started before
the imports too (`multiloss.parallel.early_ranks`).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Sequence

from hydra.core.hydra_config import HydraConfig
from hydra.utils import get_original_cwd

PARENT = "MULTILOSS_PARENT_PID"  # set for a rank that a multiloss process started: the pid of that process
_voice = threading.Lock()  # one message a rank: the run's own, or `follow_parent`'s, whichever comes first
_spoken = False
_watching = False  # `follow_parent` watches this process's parent: two voices could race


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


def follow_parent() -> None:
    """In a rank that a multiloss process started (`PARENT` set), end this process as soon as that one has ended.

    Its rank zero hosts the run's store and waits for its ranks before it exits, so a parent gone first was killed:
    nothing is left to train with or to save for, and a rank left behind would wait in a collective for the whole
    collective timeout, or, between two jobs, for ever. A daemon thread looks every half second (a rank blocked in a
    collective releases the GIL) and ends the process with one line, unless the process already said why it stops
    (`claim_the_last_word`: the collective it waited in failed first).
    """
    parent = os.environ.get(PARENT, "")
    if not parent.isdigit():
        return
    global _watching
    pid, _watching = int(parent), True

    def watch() -> None:
        while os.getppid() == pid:
            time.sleep(0.5)
        if claim_the_last_word():
            print(
                f"multiloss: run stopped: the process that started this rank (pid {pid}, its rank 0) has ended; "
                "this rank ends with it",
                file=sys.stderr,
                flush=True,
            )
        os._exit(1)

    threading.Thread(target=watch, name="multiloss-parent-watch", daemon=True).start()


def claim_the_last_word() -> bool:
    """Whether this process may still say why it stops: in a rank `follow_parent` watches, the first to ask (the
    run's own error report, or the watch when the parent is gone), every later caller staying quiet, so the rank
    prints one message; anywhere else always (a process that runs several commands, a test calling them, speaks for
    each)."""
    global _spoken
    if not _watching:
        return True
    with _voice:
        first, _spoken = not _spoken, True
    return first
