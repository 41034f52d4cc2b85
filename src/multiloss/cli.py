"""The commands: ``multiloss-train`` (= ``python train.py``) and ``multiloss-eval`` (= ``python eval.py``).

Both compose the config tree that ships inside the package (``pkg://multiloss.configs``: the
repository's ``configs/``), so they work from any directory; ``--config-dir`` adds a user's own
options. Torch and Lightning are imported inside `run`, once Hydra has a config to run: ``--help``,
``--cfg job`` and config errors found while composing never pay for them. A finished run ends with
a summary: every final value and where the outputs are (rank zero only).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from pathlib import Path

from omegaconf import DictConfig

CONFIGS = "pkg://multiloss.configs"


def train_main() -> None:
    """``multiloss-train [overrides]``: what ``python train.py`` does."""
    _refuse_a_file_as_run_dir(sys.argv[1:])
    _continue_with_the_runs_overrides()
    _run_hydra("train", train_task)


def _continue_with_the_runs_overrides() -> None:
    """``ckpt_path=<a run's checkpoint>``: that run's overrides first (`multiloss.saving.run_dir.run_overrides`),
    said."""
    sys.argv[1:], carried, left = _with_the_checkpoints_overrides(sys.argv[1:])
    if carried:
        print(f"multiloss: continuing with the checkpoint's run's overrides (yours win): {' '.join(carried)}")
    if left:
        print(
            "multiloss: not carried from the checkpoint, where its run wrote (this run writes below its own run dir): "
            + " ".join(left)
        )


def _refuse_a_file_as_run_dir(args: list[str]) -> None:
    """``hydra.run.dir=<an existing file>``: Hydra would fail making it, with a traceback, before any task runs."""
    for arg in args:
        key, _, value = arg.partition("=")
        path = Path(value.strip("'\"")).expanduser() if key.lstrip("+") == "hydra.run.dir" and value else None
        if path is not None and path.exists() and not path.is_dir():
            _print_error("config error", f"hydra.run.dir={value}: it is a file\n  accepted: a directory")
            raise SystemExit(2)


def eval_main() -> None:
    """``multiloss-eval ckpt_path=<file> [overrides]``: validate (and test) a checkpoint, print its metrics.

    The training run's own overrides (stored in the checkpoint, or in its run dir's
    ``.hydra/overrides.yaml``) come first, so ``recipe=``, ``net=``, ``data=`` need not be repeated;
    what the command line gives wins.
    """
    sys.argv[1:], _, _ = _with_the_checkpoints_overrides(sys.argv[1:])
    _run_hydra("eval", eval_task)


def _with_the_checkpoints_overrides(args: list[str]) -> tuple[list[str], list[str], list[str]]:
    """`multiloss.saving.run_dir.run_overrides`, a checkpoint that names what this command does not allow (or cannot
    be read) reported as a config error before Hydra composes or writes anything."""
    from multiloss.config import ConfigError
    from multiloss.saving.run_dir import run_overrides

    try:
        return run_overrides(args)
    except ConfigError as err:
        _fail("config error", err.message, 2)
        raise  # unreachable: _fail exits


def consolidate_main(argv: list[str] | None = None) -> None:
    """``multiloss-consolidate CHECKPOINT [OUT]``: a sharded run's checkpoint (``trainer=fsdp``'s ``last.ckpt``
    directory) as one file, for a single device, DDP, or anything that reads a Lightning checkpoint."""
    import argparse

    parser = argparse.ArgumentParser(prog="multiloss-consolidate", description=consolidate_main.__doc__)
    parser.add_argument("checkpoint", type=Path, help="a sharded checkpoint directory (…/checkpoints/last.ckpt)")
    parser.add_argument("out", type=Path, nargs="?", help="the file to write (default: <checkpoint>.whole.ckpt)")
    args = parser.parse_args(argv)
    from multiloss.config import ConfigError
    from multiloss.saving.checkpoints import consolidate

    out = args.out or args.checkpoint.with_name(f"{args.checkpoint.stem}.whole.ckpt")
    try:
        written = consolidate(args.checkpoint, out)
    except ConfigError as err:
        _fail("config error", err.message, 2)
    print(f"multiloss: wrote {written} (loads with torch.load(weights_only=True) or Recipe.load_from_checkpoint)")


def _run_hydra(config_name: str, task: Callable[[DictConfig], object]) -> None:
    """Hydra's main with ``task``; a mistake Hydra finds while composing (an option or a key that does not exist, a
    value it cannot parse) is one message naming the key, exit 2, as every other config error. ``--help`` is the
    config's help template rendered here (`multiloss.config.help.print_help`: Hydra's own takes a second longer)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    if {"--help", "-h"} & set(sys.argv[1:]):
        from multiloss.config.help import print_help

        try:
            print_help(sys.argv[1:], config_name)
        except (HydraException, OmegaConfBaseException):
            pass  # a mistake in the overrides: Hydra's own help path reports it, below
        else:
            return

    from multiloss.config.composition import explained, hydra_errors_raised, user_wants_hydras_report

    asked_for_hydras_report = user_wants_hydras_report()
    try:
        with hydra_errors_raised():
            _hydra_main(config_name, task)()
    except (HydraException, OmegaConfBaseException) as err:
        if asked_for_hydras_report:
            raise
        error = explained(err, sys.argv[1:], config_name)
        if error is None:
            _fail("config error", " ".join(str(err).split()), 2)
        _fail("config error", error.message, 2)


def _hydra_main(config_name: str, task: Callable[[DictConfig], object]) -> Callable[[], object]:
    import hydra

    from multiloss.config.composition import restore_full_error

    def job(cfg: DictConfig) -> object:
        restore_full_error()  # composed: from here on Hydra reports as the user set it (the ranks inherit it)
        from multiloss.parallel.child_command import follow_parent

        follow_parent()  # a rank a multiloss process started ends with it
        _refuse_a_shadowed_option(cfg)
        return task(cfg)

    job.__name__ = job.__qualname__ = task.__name__  # Hydra names the job (and its log file) after the task's module
    job.__module__ = task.__module__
    _register_slurm_launcher()
    return hydra.main(version_base="1.3", config_path=CONFIGS, config_name=config_name)(job)


def _register_slurm_launcher() -> None:
    """Make ``hydra/launcher=slurm``'s launcher known to Hydra under an editable install too.

    Hydra finds plugins by listing the ``hydra_plugins`` namespace package's directories; an
    editable install (``pip install -e``, as ``make train`` does) serves ours through an import hook
    that such a listing does not see. Registered by name, as Hydra's own scan would.
    """
    try:
        from hydra.core.plugins import Plugins

        from hydra_plugins import multiloss_slurm
    except ImportError:
        return
    if launcher := getattr(multiloss_slurm, "SlurmLauncher", None):  # absent without the slurm extra
        Plugins.instance().class_name_to_class[f"{launcher.__module__}.{launcher.__name__}"] = launcher


def _refuse_a_shadowed_option(cfg: DictConfig) -> None:
    """An option of the user's config dir that a shipped one of the same name would silently replace: one message
    (`multiloss.config.composition.check_no_shadowed_option`), exit 2, nothing left behind."""
    from hydra.core.hydra_config import HydraConfig

    from multiloss.config import ConfigError
    from multiloss.config.composition import check_no_shadowed_option

    try:
        check_no_shadowed_option(HydraConfig.get())
    except ConfigError as err:
        if not os.environ.get("SUBMITIT_EXECUTOR"):
            _remove_if_empty(cfg)
        _fail("config error", err.message, 2)


def train_task(cfg: DictConfig) -> dict[str, float] | float:
    """One Hydra job of ``multiloss-train``: the final metrics, or ``optimized_metric``'s value for a sweeper.

    The config is checked before torch and Lightning are imported (`multiloss.config.early`): a mistake is named in
    a second, with the message the run would give after the imports.
    """
    from multiloss.parallel import early_ranks

    if not early_ranks.started_early():  # a rank rank zero started early runs the config rank zero checked
        check_before_imports(cfg)

    early_ranks.start(cfg)  # a one-node DDP/FSDP run's other ranks, now: they import and build alongside this one
    try:
        from multiloss.training import train

        metrics = run(train, cfg)
    finally:
        early_ranks.finished()
    return optimized_value(metrics, cfg.get("optimized_metric"))


def check_before_imports(cfg: DictConfig) -> None:
    """`multiloss.config.early.check_early`, a mistake reported as `run` reports one (exit 2, nothing left behind)."""
    from multiloss.config import ConfigError, source
    from multiloss.config.early import check_early
    from multiloss.saving.run_dir import checkpoint_to_resume

    try:
        check_early(cfg)
        checkpoint_to_resume(cfg)  # as `train` does
    except ConfigError as err:
        if not os.environ.get("SUBMITIT_EXECUTOR"):
            _remove_if_empty(cfg)
        _fail("config error", err.message, 2)
    except Exception:
        # A source the early reading cannot take (a bug of its own) never stops a run: the run's own checks follow.
        from multiloss.config import argument_checks

        if argument_checks.STRICT:
            raise
    finally:
        # The parsed sources, dropped before the imports: alive, they would lengthen every later garbage collection
        # (0.45 s more to a run's first step).
        source.forget()


def eval_task(cfg: DictConfig) -> dict[str, float]:
    from multiloss.evaluation import evaluate

    return run(evaluate, cfg)


def optimized_value(metrics: dict[str, float], name: str | None) -> dict[str, float] | float:
    """``metrics[name]`` as a float (what Hydra's Optuna sweeper needs), or every metric when no name is set."""
    if name is None:
        return metrics
    if name not in metrics:
        from multiloss.config import ConfigError

        # Known only once the run has logged: the checkpoints are kept, the sweep learns why.
        err = ConfigError("optimized_metric", name, f"one of the run's final metrics: {', '.join(sorted(metrics))}")
        _print_error("config error", err.message)
        raise SystemExit(2)
    return float(metrics[name])


def run(task: Callable[[DictConfig], dict[str, float]], cfg: DictConfig) -> dict[str, float]:
    """``task(cfg)`` quietly, a user's mistake as one line (exit 2), and the end-of-run summary."""
    import logging

    from multiloss.console.noise import silence_known_noise

    silence_known_noise()  # before Lightning and torchdata are imported: some warn at import or first use
    from multiloss.callbacks import NonFiniteError, RunPreempted
    from multiloss.config import ConfigError
    from multiloss.data.columns import BadSample, worker_message
    from multiloss.parallel.stalls import CollectiveStalled
    from multiloss.saving.checkpoints import CheckpointWriteError

    # Imported after Hydra set up logging, Lightning does not add its own console handler and its
    # lines go through Hydra's (into a run dir's train.log, even a rejected run's): set it up as
    # Lightning does when imported first.
    for name in ("lightning.pytorch", "lightning.fabric"):
        lightning_log = logging.getLogger(name)
        if not lightning_log.handlers:
            lightning_log.addHandler(logging.StreamHandler())
            lightning_log.propagate = False

    try:
        metrics = _ending_the_process_group(task, cfg)
    except ConfigError as err:
        # A user error gets one message, not a traceback wall; exit code 2 like argparse.
        if not os.environ.get("SUBMITIT_EXECUTOR"):  # a job's log handlers still write into its dir
            _remove_if_empty(cfg)
        # Another rank of this job prints it (multiloss.callbacks.report_once; before the ranks share a group:
        # multiloss.parallel.early_ranks.report_once).
        from multiloss.parallel.early_ranks import report_once

        quiet = getattr(err, "reported_elsewhere", False) or not report_once(err.message)
        _fail("config error", err.message, 2, quiet=quiet)
    except (CheckpointWriteError, NonFiniteError) as err:
        _fail("run stopped", str(err), 1)
    except BadSample as err:  # met by a batch: the checkpoints written before it stay
        from multiloss.saving.run_dir import last_checkpoint_of

        hint = _resume_hint(last_checkpoint_of(cfg.paths.output_dir), cfg)
        _fail("run stopped", f"{worker_message(err)}{hint}", 1)
    except CollectiveStalled as err:
        from multiloss.parallel.rendezvous import RendezvousIncomplete

        if isinstance(err, RendezvousIncomplete):  # stopped before the run wrote anything
            _remove_if_empty(cfg)
        _fail("run stopped", str(err), 1, quiet=err.reported_elsewhere)
    except RunPreempted as err:
        _print_error("run stopped", f"{err}{_resume_hint(err.checkpoint, cfg)}", rank_zero=True)
        # An exit, never an exception, even in a submitted job: a preempted job is requeued and runs
        # again, and its first attempt must not leave a result that tells the submitter it failed.
        raise SystemExit(err.exit_code) from None
    from lightning.pytorch.utilities import rank_zero_only

    if rank_zero_only.rank == 0:
        print_summary(metrics, cfg)
    return metrics


def _ending_the_process_group(task: Callable[[DictConfig], dict[str, float]], cfg: DictConfig) -> dict[str, float]:
    """``task(cfg)``, then this rank's process group ended, however the task ended.

    A rank that a launcher of ours did not start (torchrun's, srun's, and those Lightning's launcher started)
    would otherwise leave its group to the interpreter's exit, where gloo's threads can be torn down still
    running: ``terminate called without an active exception``, SIGABRT, and srun marks a finished job FAILED.
    No barrier: a launching process waits for its ranks to exit (`multiloss.parallel.ddp.HydraJobLauncher.finish`),
    and a barrier here would wait for it in turn.
    """
    from multiloss import lightning_internals as internals

    try:
        return task(cfg)
    finally:
        internals.destroy_process_group()


class JobFailed(Exception):
    """A run inside a submitted job (submitit) ended on a user error: an exception, so that submitit
    records it and the submitting ``-m`` command reports it (`hydra_plugins.multiloss_slurm`), where an exit would
    leave the submitter polling for a result that never comes."""


def _fail(kind: str, message: str, exit_code: int, quiet: bool = False) -> None:
    from multiloss.parallel.child_command import claim_the_last_word

    # One message a rank: said here (or by another rank), or already by the watch of a parent that has ended.
    if claim_the_last_word() and not quiet:
        _print_error(kind, message)
    if os.environ.get("SUBMITIT_EXECUTOR"):
        raise JobFailed(f"multiloss: {kind}: {message}") from None
    raise SystemExit(exit_code) from None


def _resume_hint(checkpoint: Path | None, cfg: DictConfig) -> str:
    from multiloss.saving.run_dir import resume_command
    from multiloss.saving.saved_state import checkpoint_exists

    if checkpoint is None or not checkpoint_exists(checkpoint):
        return ""
    if os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID"):
        return ""  # the requeued or restarted job finds it by itself
    return f"; continue with: {resume_command(checkpoint)}"


def _remove_if_empty(cfg: DictConfig) -> None:
    """A rejected run leaves no trace: Hydra made its run dir before the config was checked; it goes if empty. What
    the run made below it while it held the dir's lock is removed with the lock (`multiloss.saving.run_dir.claimed`);
    nothing below is touched here: another run may hold the lock and be writing there."""
    with contextlib.suppress(OSError):  # not made, or not empty
        Path(cfg.paths.output_dir).rmdir()


def _print_error(kind: str, message: str, rank_zero: bool = False) -> None:
    import rich.console
    import rich.markup

    if rank_zero and _rank() != 0:
        return
    console = rich.console.Console(stderr=True, highlight=False)
    console.print(f"[bold red]multiloss: {kind}:[/] {rich.markup.escape(message)}", soft_wrap=True)


def _rank() -> int:
    from lightning.pytorch.utilities import rank_zero_only

    return rank_zero_only.rank


def print_summary(metrics: dict[str, float], cfg: DictConfig) -> None:
    """The end of a run: every final value (the last row's training losses, the last validation) and the run dir."""
    import rich.console
    import rich.table

    table = rich.table.Table(show_edge=False, box=None)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name in sorted(metrics, key=lambda n: (not n.startswith("loss/"), n)):
        table.add_row(name, f"{metrics[name]:.4g}")
    out = Path(cfg.paths.output_dir)
    console = rich.console.Console(highlight=False)
    if metrics:
        console.print("multiloss: final values")  # not the table's title: rich wraps that to the table's width
        console.print(table)
    from multiloss.saving.run_dir import last_checkpoint_of, resume_command
    from multiloss.saving.saved_state import checkpoint_exists

    last = last_checkpoint_of(out)
    resume = f"; train on: {resume_command(last, *_twice_the_budget(cfg))}" if checkpoint_exists(last) else ""
    # Not markup: a printed command's ``trust_checkpoint=[mypkg]`` would read as a style tag and vanish.
    console.print(f"multiloss: outputs in {out}{resume}", soft_wrap=True, markup=False)


def _twice_the_budget(cfg: DictConfig) -> list[str]:
    """A finished run continues only with a longer budget (the same one is refused: nothing to train): twice its
    bounds, so that the printed line trains on as it is, whichever bound ended the run."""
    trainer = cfg.get("trainer", {})
    more = []
    if isinstance(steps := trainer.get("max_steps"), int) and steps > 0:
        more.append(f"trainer.max_steps={2 * steps}")
    if isinstance(epochs := trainer.get("max_epochs"), int) and epochs > 0:
        more.append(f"trainer.max_epochs={2 * epochs}")
    return more
