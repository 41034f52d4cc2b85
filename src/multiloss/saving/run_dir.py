"""A run dir belongs to one run: another run's checkpoints are not overwritten, and two live runs never share it.

A second run started into a finished run dir would overwrite its ``.hydra/`` copies and plots and
save ``last-v1.ckpt`` beside the old ``last.ckpt`` (so ``ckpt_path=<dir>/checkpoints/last.ckpt`` then
resumes the *older* run); two live runs in one dir interleave their files. `claim_run_dir` refuses
a dir holding checkpoints unless the run resumes from one of them (it continues that run) or
``overwrite=true``, and holds a lock file while training; a lock left by a process that is gone
(killed) is taken over.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import socket
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from multiloss.config.errors import ConfigError
from multiloss.saving.saved_state import CONFIG_DIRS_KEY, OVERRIDES_KEY, checkpoint_exists, is_sharded_checkpoint
from multiloss.saving.trust import check_carried, refuse_hydras_own_keys

LOCK = ".multiloss.lock"
# Set by SLURM in a requeued job and by torchrun in a restarted worker: the same run, again.
RESTART_COUNTS = ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT")


def last_checkpoint_of(output_dir: str | Path) -> Path:
    """A run dir's own ``last.ckpt`` (a file, or a sharded run's directory), whether it exists or not."""
    return Path(output_dir) / "checkpoints" / "last.ckpt"


def resume_from(output_dir: str | Path, ckpt_path: str | None) -> str | None:
    """The checkpoint a run starts from: ``ckpt_path``, with ``last`` meaning the run dir's own ``last.ckpt``.

    ``ckpt_path=last`` continues the run in ``output_dir`` when it saved a ``last.ckpt``, and starts
    fresh when there is none (a first attempt). A job SLURM requeued or torchrun restarted keeps its
    run dir (the run stamp is the launch's id, `multiloss.config.resolvers`) and continues from
    its own ``last.ckpt`` whatever ``ckpt_path`` says, which was the first attempt's start.
    """
    last = last_checkpoint_of(output_dir)
    counts = [os.environ.get(name, "0") for name in RESTART_COUNTS]
    restarted = any(count.isdigit() and int(count) > 0 for count in counts)
    if (ckpt_path == "last" or restarted) and last.is_dir() and not is_sharded_checkpoint(last):
        # Not "no checkpoint": a sharded one whose .metadata is gone. A fresh start would train over the run.
        raise ConfigError(
            "ckpt_path",
            str(last),
            "a whole sharded checkpoint (its .metadata written last, when every shard is in), or a new run dir",
            "it is a directory without .metadata: a sharded save that did not finish, or a damaged copy",
        )
    if ckpt_path == "last" or (restarted and checkpoint_exists(last)):
        return str(last) if checkpoint_exists(last) else None
    return ckpt_path


def checkpoint_to_resume(cfg: Any) -> None:
    """``cfg.ckpt_path`` set to the checkpoint the run starts from (`resume_from`), refused when there is none."""
    cfg.ckpt_path = resume_from(cfg.paths.output_dir, cfg.get("ckpt_path"))
    require_checkpoint(cfg.get("ckpt_path"))


def require_checkpoint(ckpt: str | None) -> None:
    """`ConfigError` naming ``ckpt_path`` unless it is None or an existing checkpoint (a file or a sharded dir)."""
    if ckpt is not None and not checkpoint_exists(ckpt):
        raise ConfigError(
            "ckpt_path",
            ckpt,
            "the path of an existing checkpoint (a .ckpt file, or a sharded run's .ckpt directory)",
            "no such checkpoint",
        )


def check_run_dir(output_dir: str | Path, ckpt_path: str | None, overwrite: bool) -> None:
    """Raise `ConfigError` if ``output_dir`` holds another run's checkpoints (reads only; call it early)."""
    checkpoints = Path(output_dir) / "checkpoints"
    existing = sorted(checkpoints.glob("*.ckpt")) if checkpoints.is_dir() else []
    if not existing or overwrite:
        return
    resuming_here = ckpt_path is not None and Path(ckpt_path).resolve().parent == checkpoints.resolve()
    if not resuming_here:
        last = checkpoints / "last.ckpt"
        resume = "ckpt_path=last" if checkpoint_exists(last) else resume_argument(existing[-1])
        raise ConfigError(
            "hydra.run.dir",
            str(output_dir),
            f"a new run dir (leave hydra.run.dir unset for a fresh one), {resume} to continue "
            "the run that is there, or overwrite=true to train over it",
            f"it holds another run's checkpoints ({', '.join(p.name for p in existing[:3])})",
        )


def refuse_a_runs_dir(output_dir: str | Path) -> None:
    """`ConfigError` if ``output_dir`` holds another run's records (its ``.hydra/``, checkpoints, metrics).

    For commands that write a run dir of their own (``multiloss-eval``): aimed at a training run's
    dir, they would replace its ``.hydra/`` config copies with their own.
    """
    out = Path(output_dir)
    records = [name for name in (".hydra", "checkpoints", "csv", LOCK) if (out / name).exists()]
    if records:
        raise ConfigError(
            "hydra.run.dir",
            str(output_dir),
            "a dir of its own (leave hydra.run.dir unset: outputs/eval/<recipe>/<time>)",
            f"it holds another run's records ({', '.join(records)}), which this run would overwrite",
        )


def resume_argument(checkpoint: Path | str) -> str:
    """``ckpt_path=<file>`` as a shell argument Hydra parses back to the same path (spaces and all)."""
    text = str(checkpoint)
    if any(c in text for c in '\\"$`'):
        return shlex.quote(f"ckpt_path='{text}'") if "'" not in text else shlex.quote(f'ckpt_path="{text}"')
    if all(c.isalnum() or c in "/._-+" for c in text):
        return f"ckpt_path={text}"
    return f"\"ckpt_path='{text}'\""


def resume_command(checkpoint: Path | str, *more: str) -> str:
    """The command that continues the run from ``checkpoint``: this program with ``ckpt_path=`` (and ``more``),
    the run's other overrides coming from the checkpoint (`run_overrides`), its config dirs named (a checkpoint
    adds none by itself: `multiloss.saving.trust`)."""
    import sys

    program = sys.argv[0] if sys.argv and sys.argv[0] else "train.py"
    command = f"python {shlex.quote(program)}" if program.endswith(".py") else Path(program).name
    return " ".join([command, *_config_dir_arguments(), resume_argument(checkpoint), *_trust_arguments(), *more])


def _trust_arguments() -> list[str]:
    """What this run's own command line trusted, again: its ``trust_checkpoint``, or the packages of the targets it
    wrote itself beyond the shipped configs' (a checkpoint names nothing else without being told: `trust`)."""
    from hydra.core.hydra_config import HydraConfig

    from multiloss.saving.trust import TRUST_KEY, own_packages

    if not HydraConfig.initialized():
        return []
    task = list(HydraConfig.get().overrides.task)
    given = [o for o in task if o.split("=")[0].lstrip("+") == TRUST_KEY]
    if given:
        return [shlex.quote(given[-1])]
    packages = own_packages(task)
    return [shlex.quote(f"{TRUST_KEY}=[{','.join(packages)}]")] if packages else []


def _config_dir_arguments() -> list[str]:
    """The config dirs of this run (its ``--config-dir``, its searchpath's files) as command-line arguments."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return []
    sources = HydraConfig.get().runtime.config_sources
    dirs = [s.path for s in sources if s.schema == "file" and s.provider != "main"]
    if len(dirs) == 1:
        return ["--config-dir", shlex.quote(dirs[0])]
    return [shlex.quote(f"hydra.searchpath=[{','.join(f'file://{d}' for d in dirs)}]")] if dirs else []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def acquire_lock(output_dir: str | Path) -> Path:
    """Create ``<output_dir>/.multiloss.lock`` for this process; `ConfigError` if a live run holds it."""
    path = Path(output_dir) / LOCK
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        owner = path.read_text().split() if path.exists() else []
        host, pid = [*owner, "", "0"][:2]
        if not (host == socket.gethostname() and pid.isdigit() and not _alive(int(pid))):
            raise ConfigError(
                "hydra.run.dir",
                str(output_dir),
                f"a run dir no live run is using (if that run is gone, delete {path})",
                f"the run {pid} on {host or 'another host'} is training in it",
            ) from None
        path.unlink(missing_ok=True)  # left by a run that was killed: take it over
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    with os.fdopen(fd, "w") as f:
        f.write(f"{socket.gethostname()} {os.getpid()}")
    return path


def launch_rank_zero() -> bool:
    """Whether this process is the job's rank zero, judged before any process group exists: what the launcher set.

    Lightning's launcher gives the ranks it starts LOCAL_RANK (and every node's launching process NODE_RANK),
    torchrun sets RANK, srun SLURM_PROCID; a process none of them marked is the one a person started."""
    marks = ("RANK", "SLURM_PROCID", "NODE_RANK", "LOCAL_RANK", "JSM_NAMESPACE_RANK")
    return all(os.environ.get(name, "0") == "0" for name in marks)


@contextlib.contextmanager
def claimed(output_dir: str | Path, claim: bool) -> Iterator[Path | None]:
    """The run dir is this run's for the block: its lock taken first (``claim``: by the job's rank zero), before the
    run writes anything, and given back at the end.

    Refused at the lock (a live run trains in the dir), the run has written nothing and removes nothing. Refused
    later (`ConfigError` out of the block), it removes the empty directories under ``output_dir`` while still
    holding the lock — so they are its own: no other run writes there meanwhile — then gives the lock back.
    """
    made = not Path(output_dir).exists()  # the lock makes it (a run outside Hydra, which makes it first)
    lock = acquire_lock(output_dir) if claim else None
    try:
        with _sigterm_exits() if lock is not None else contextlib.nullcontext():
            yield lock
    except (ConfigError, StoppedBeforeTheFirstStep):
        if lock is not None:
            remove_empty_dirs(output_dir)
            release_lock(lock)
            lock = None
            if made:
                with contextlib.suppress(OSError):  # something in it
                    Path(output_dir).rmdir()
        raise
    finally:
        release_lock(lock)


class StoppedBeforeTheFirstStep(SystemExit):
    """SIGTERM while the run was being set up: exit 143, its lock given back and its empty dirs removed."""


@contextlib.contextmanager
def _sigterm_exits() -> Iterator[None]:
    """SIGTERM ends the process through its ``finally`` blocks (the lock given back, the run's empty dirs removed)
    until the run's own handler takes over at its first step (`multiloss.callbacks.Preemption`, which saves); by
    default it would end the process at once, mid-set-up, leaving the lock behind."""
    import signal
    import sys
    import threading

    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield
        return

    def stop(signum: int, frame: object) -> None:
        sys.stderr.write("multiloss: run stopped: SIGTERM before the first step: nothing to save\n")
        raise StoppedBeforeTheFirstStep(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def remove_empty_dirs(output_dir: str | Path) -> None:
    """Remove every empty directory below ``output_dir`` (a file anywhere keeps its directories)."""
    root = Path(output_dir)
    for folder in sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        with contextlib.suppress(OSError):  # not empty
            folder.rmdir()


def release_lock(path: Path | None) -> None:
    """Remove a lock `acquire_lock` made (only this process's: a lock another run took over stays)."""
    if path is not None and path.exists() and path.read_text().split()[-1:] == [str(os.getpid())]:
        path.unlink(missing_ok=True)


# Overrides of a run that never carry over to a command given its checkpoint: its own checkpoint, its dir.
_NOT_CARRIED = ("ckpt_path", "overwrite", "hydra", "optimized_metric", "trust_checkpoint")
# Keys that only say where a run writes (its run dir under another name, a callback's or a logger's dir): a command
# given a checkpoint writes below the run dir it names itself, never where the checkpoint's run wrote.
_WHERE_IT_WRITES = ("dirpath", "save_dir", "default_root_dir", "output_dir")


def moves_outputs(key: str) -> bool:
    """Whether override ``key`` only moves where a run writes (``paths.*``, a ``dirpath`` / ``save_dir`` /
    ``default_root_dir``)."""
    key = key.lstrip("+~")
    return key.split(".")[0].split("/")[0] == "paths" or key.rpartition(".")[2] in _WHERE_IT_WRITES


def run_overrides(args: Sequence[str]) -> tuple[list[str], list[str], list[str]]:
    """``args`` (a command line's overrides) preceded by the overrides of the run whose checkpoint ``ckpt_path=``
    names, for the keys ``args`` leaves unset; those carried, to say which; and those left behind because they only
    moved where that run wrote (`moves_outputs`: this command's run dir is where it writes), to say so.

    The run's overrides are the ones its checkpoint stores (or its run dir's ``.hydra/overrides.yaml``), its
    ``--config-dir`` too; ``ckpt_path=last`` is ``<hydra.run.dir>/checkpoints/last.ckpt``. Nothing is added when
    there is no such checkpoint: the command then names the problem with the key. What the command line gives wins.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from multiloss.config.composition import flags, overrides

    parser = OverridesParser.create()
    given = overrides(list(args))  # a flag's value (--config-dir my_configs) is no override
    try:
        parsed = parser.parse_overrides(given)
    except Exception:  # Hydra reports a malformed override itself, with its own message
        return list(args), [], []
    keys = {o.key_or_group.lstrip("+~") for o in parsed}
    values = {o.key_or_group.lstrip("+~"): o.value() for o in parsed}
    ckpt = values.get("ckpt_path")
    if not isinstance(ckpt, str) or not ckpt:
        return list(args), [], []
    if ckpt == "last" and isinstance(run_dir := values.get("hydra.run.dir"), str):
        ckpt = str(last_checkpoint_of(run_dir))
    stored = stored_entries(ckpt)  # one read of the checkpoint for both of its entries
    try:
        runs = parser.parse_overrides(_overrides_of(Path(ckpt), stored.get(OVERRIDES_KEY)))
    except Exception as err:  # Hydra's OverrideParseException: a damaged or hand-written checkpoint
        raise ConfigError(
            "ckpt_path",
            str(ckpt),
            "a checkpoint whose stored overrides are its run's own (as multiloss writes them)",
            f"its run's stored overrides cannot be read: {' '.join(str(err).split())[:200]}",
        ) from None
    # Another recipe (or experiment) than the run's: its overrides would not fit; the checkpoint's own check then
    # names the mismatch ("it belongs to another model").
    chosen = {o.key_or_group: o.value() for o in runs if o.key_or_group in ("recipe", "experiment")}
    if any(key in values and values[key] != value for key, value in chosen.items()):
        return list(args), [], []
    refuse_hydras_own_keys(runs, str(ckpt))
    theirs = [
        o
        for o in runs
        if o.key_or_group.lstrip("+~") not in keys and o.key_or_group.split(".")[0].split("/")[0] not in _NOT_CARRIED
    ]
    training = [o for o in theirs if not moves_outputs(o.key_or_group)]
    carried = [o.input_line for o in training if o.input_line]
    left = [o.input_line for o in theirs if moves_outputs(o.key_or_group) and o.input_line]
    # The run's own option dirs, unless this command line names its own; what the checkpoint names is data, checked
    # before anything of it is used (multiloss.saving.trust): a dir this command names, targets the shipped configs
    # or this command allow.
    named_here = any(a.startswith(("--config-dir", "-cd", "hydra.searchpath")) for a in args)
    stored_dirs = [] if named_here else [str(d) for d in stored.get(CONFIG_DIRS_KEY) or []]
    dirs = check_carried(str(ckpt), training, stored_dirs, args)
    searchpath = [f"hydra.searchpath=[{','.join(dirs)}]"] if dirs else []
    # Hydra's flags first: argparse takes no flag after the overrides have begun.
    return flags(list(args)) + searchpath + carried + given, carried, left


def stored_entries(ckpt: Path | str) -> dict[str, Any]:
    """The checkpoint's top-level entries (memory-mapped), or none if it cannot be read."""
    import torch

    from multiloss.saving.checkpoints import META

    if not checkpoint_exists(ckpt):
        return {}
    if is_sharded_checkpoint(ckpt):  # a sharded checkpoint keeps its entries in meta.pt
        ckpt = Path(ckpt) / META
    try:
        checkpoint = torch.load(ckpt, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # not a readable checkpoint: `verify_checkpoint` says so, naming ckpt_path
        return {}
    return checkpoint if isinstance(checkpoint, dict) else {}


def _overrides_of(ckpt: Path, stored: object) -> list[str]:
    if stored is None and (beside := ckpt.parent.parent / ".hydra" / "overrides.yaml").is_file():
        from omegaconf import OmegaConf

        stored = OmegaConf.to_container(OmegaConf.load(beside))
    return [str(o) for o in stored or []]
