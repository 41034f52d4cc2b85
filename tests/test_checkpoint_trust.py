"""A checkpoint from someone else is data: nothing it names runs, on any path that reads one.

A real run's checkpoint is rewritten as an attacker would (its stored overrides extended with ``~model.net`` and
``+model.net={_target_: ...}``, its config dirs, its hyper-parameters, a sharded checkpoint's ``meta.pt`` and
``.metadata``) and re-saved with ``torch.save``: it still loads with ``weights_only=True``. Then every command that
reads a checkpoint is given it — ``multiloss-eval``, ``train.py ckpt_path=<file>``, ``ckpt_path=last``, a sharded dir,
the ranks of a resumed DDP run, a restarted job's own resume, ``multiloss-consolidate``,
``Recipe.load_from_checkpoint`` — and each must exit with one message naming the key and the target and how to accept
it, no traceback, no file made or changed anywhere (the marker each payload would write stays absent, the run dir
untouched). With the documented acceptance, code of one's own still loads (examples/tests/test_examples.py: the BYO
package's checkpoint evaluates and resumes exactly). A user's option that a shipped option of the same name would
shadow is refused, naming both files, in every group that ships options.
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra.core.hydra_config import HydraConfig
from multiloss.recipes.multihead import MultiHead

from multiloss import testing
from multiloss.config import ConfigError
from multiloss.config.composition import check_no_shadowed_option
from multiloss.saving import trust
from multiloss.saving.run_dir import run_overrides
from tests.conftest import CONFIG_DIR, QUIET, ROOT, run_cli

RUN = (*QUIET, "~callbacks.loss_curves", "recipe=multihead", "model.net.width=8", "data.batch_size=64")
KEPT = ROOT / "tests/data/checkpoints_of_e12c38f"
SHARDED = KEPT / "weighted_uncertainty_fsdp.ckpt"


@pytest.fixture(scope="module")
def real_run(tmp_path_factory) -> Path:
    """A real run's checkpoint (2 steps of multihead on one CPU, from the command line)."""
    out = tmp_path_factory.mktemp("real") / "run"
    proc = run_cli(*RUN, "trainer=cpu", "trainer.max_steps=2", "trainer.limit_val_batches=1", f"hydra.run.dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "checkpoints" / "last.ckpt"


def _rewritten(source: Path, target: Path, overrides: list[str] = (), config_dirs: list[str] | None = None) -> Path:
    """``source``'s entries, its stored overrides extended and its config dirs replaced, saved at ``target``."""
    checkpoint = torch.load(source, map_location="cpu", weights_only=True)
    checkpoint["multiloss_overrides"] = [*checkpoint["multiloss_overrides"], *overrides]
    if config_dirs is not None:
        checkpoint["multiloss_config_dirs"] = config_dirs
    target.parent.mkdir(parents=True, exist_ok=True)
    torch.save(checkpoint, target)
    torch.load(target, map_location="cpu", weights_only=True)  # still loads as data
    return target


def _net(fields: str) -> list[str]:
    return ["~model.net", f"+model.net={{{fields}}}"]


def _payloads(marker: Path, hub: Path) -> dict[str, tuple[list[str], str]]:
    """Each way a checkpoint's overrides could make the program write ``marker``; what the refusal names."""
    hub.mkdir(parents=True, exist_ok=True)
    (hub / "hubconf.py").write_text(f"open({str(marker)!r}, 'w').write('hub')\ndef pwn():\n    return None\n")
    return {
        "os.system by _args_": (_net(f"_target_: os.system, _args_: ['touch {marker}']"), "os.system"),
        "os.system by keyword": (_net(f"_target_: os.system, command: 'touch {marker}'"), "os.system"),
        "builtins.open": (_net(f"_target_: builtins.open, file: '{marker}', mode: w"), "builtins.open"),
        "numpy.savetxt": (
            _net(f"_target_: numpy.savetxt, fname: '{marker}', X: [1.0], header: 'import os'"),
            "numpy.savetxt",
        ),
        "torch.hub.load": (
            _net(f"_target_: torch.hub.load, repo_or_dir: '{hub}', model: pwn, source: local"),
            "torch.hub.load",
        ),
        "a Hydra callback": (
            [f"+hydra.callbacks.pwn={{_target_: builtins.open, file: '{marker}', mode: w}}"],
            "hydra.callbacks.pwn",
        ),
        "oc.create": (
            [f"model.net='${{oc.create:{{_target_: builtins.open, file: {marker}, mode: w}}}}'"],
            "oc.create",
        ),
    }


def _one_refusal(proc: subprocess.CompletedProcess, *named: str) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("multiloss:")]
    assert line.startswith("multiloss: config error:"), line
    for word in named:
        assert word in proc.stderr, proc.stderr[-3000:]
    return line


def _eval(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HYDRA_FULL_ERROR": "0", "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, str(ROOT / "eval.py"), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def _files(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("command", ["eval", "train"])
def test_a_rewritten_checkpoint_runs_nothing_it_names_on_eval_and_resume(real_run, tmp_path, command):
    """Every payload on ``multiloss-eval ckpt_path=<file>`` and ``train.py ckpt_path=<file>``: one message naming the
    key, the target and how to accept it (trust_checkpoint=, --config-dir); the marker never appears."""
    marker = tmp_path / "PWNED"
    for name, (overrides, target) in _payloads(marker, tmp_path / "hub").items():
        ckpt = _rewritten(real_run, tmp_path / name.replace(" ", "_") / "last.ckpt", overrides)
        out = tmp_path / f"{command}-{name.replace(' ', '_')}"
        args = (f"ckpt_path={ckpt}", f"hydra.run.dir={out}", "trainer.max_steps=4")
        proc = _eval(*args, cwd=tmp_path) if command == "eval" else run_cli(*args, cwd=tmp_path)
        line = _one_refusal(proc, target)
        if name != "a Hydra callback":
            assert "trust_checkpoint" in proc.stderr, (name, proc.stderr)
        assert not marker.exists(), name
        assert not out.exists(), (name, line)


def test_a_hydra_key_never_comes_from_a_checkpoint(real_run, tmp_path):
    """A stored override of Hydra's own (its callbacks, launcher, run dir) is never a run's task override: a forgery,
    refused even when the checkpoint is trusted."""
    ckpt = _rewritten(real_run, tmp_path / "c/last.ckpt", ["hydra.job.chdir=true"])
    with pytest.raises(ConfigError, match=r"hydra\.job\.chdir.*Hydra's own"):
        run_overrides([f"ckpt_path={ckpt}", "trust_checkpoint=true"])


def test_a_resumed_run_writes_below_the_run_dir_its_command_names(real_run, tmp_path):
    """A checkpoint whose run's overrides moved where it wrote (``paths.output_dir``, the checkpoint callback's
    ``dirpath``, the CSV logger's ``save_dir``: all elsewhere): resumed with ``hydra.run.dir=<mine>``, every file the
    run writes lands below <mine> (checkpoints, metrics, plots), nothing elsewhere, and the command says which
    overrides it left behind."""
    elsewhere = tmp_path / "elsewhere"
    moved = [
        f"paths.output_dir={elsewhere}",
        f"callbacks.model_checkpoint.dirpath={elsewhere}/ckpts",
        f"logger.csv.save_dir={elsewhere}/logs",
    ]
    ckpt = _rewritten(real_run, tmp_path / "theirs" / "last.ckpt", moved)
    args, carried, left = run_overrides([f"ckpt_path={ckpt}"])
    assert left == moved and not any(o in args for o in moved) and "recipe=multihead" in carried
    mine = tmp_path / "mine"
    proc = run_cli(f"ckpt_path={ckpt}", f"hydra.run.dir={mine}", "trainer.max_steps=4", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"where its run wrote (this run writes below its own run dir): {' '.join(moved)}" in proc.stdout
    assert not elsewhere.exists()
    assert torch.load(mine / "checkpoints/last.ckpt", weights_only=True)["global_step"] == 4
    assert next((mine / "csv").rglob("metrics.csv")).is_file() and (mine / ".hydra").is_dir()


def test_config_dirs_a_checkpoint_names_are_used_only_when_this_command_names_them(real_run, tmp_path):
    """A config dir that does not exist here, and one that does with a hostile option file (selected by the stored
    ``net=pwn``): refused until the command line names the dir itself (then its options are yours)."""
    marker = tmp_path / "PWNED"
    hostile = tmp_path / "their_configs"
    (hostile / "net").mkdir(parents=True)
    (hostile / "net" / "pwn.yaml").write_text(
        f"# @package model.net\n_target_: builtins.open\nfile: {marker}\nmode: w\n"
    )
    for dirs, overrides, why in (
        ([str(tmp_path / "nowhere")], [], "which does not exist here"),
        ([str(hostile)], ["net=pwn"], "which this command line does not name"),
    ):
        ckpt = _rewritten(real_run, tmp_path / "c" / Path(dirs[0]).name / "last.ckpt", overrides, config_dirs=dirs)
        for command in ("eval", "train"):
            out = tmp_path / f"out-{command}"
            args = (f"ckpt_path={ckpt}", f"hydra.run.dir={out}")
            proc = _eval(*args, cwd=tmp_path) if command == "eval" else run_cli(*args, cwd=tmp_path)
            line = _one_refusal(proc, why, f"--config-dir {dirs[0]}")
            assert line.startswith(f"multiloss: config error: --config-dir='{dirs[0]}'"), line
            assert not marker.exists() and not out.exists()
    # Named on the command line, the dir is the user's own: its option is used (and would run: here it is checked by
    # the config check, which names the bad net, before anything is built).
    args, carried, _ = run_overrides(["--config-dir", str(hostile), f"ckpt_path={ckpt}"])
    assert "net=pwn" in carried and args[:2] == ["--config-dir", str(hostile)]


def test_ckpt_path_last_in_the_runs_own_dir_refuses_and_changes_nothing_there(real_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(real_run.parent.parent, run)
    marker = tmp_path / "PWNED"
    _rewritten(real_run, run / "checkpoints" / "last.ckpt", _net(f"_target_: builtins.open, file: '{marker}', mode: w"))
    before = _files(run)
    proc = run_cli("ckpt_path=last", f"hydra.run.dir={run}", "trainer.max_steps=4", cwd=tmp_path)
    _one_refusal(proc, "model.net._target_=builtins.open", "it comes only from the checkpoint")
    assert _files(run) == before and not marker.exists()


@pytest.mark.distributed
def test_the_ranks_of_a_resumed_ddp_run_never_start_on_a_refused_checkpoint(real_run, tmp_path):
    """trainer=ddp_cpu: rank 0 refuses before it starts any rank (they would each read the checkpoint too)."""
    marker = tmp_path / "PWNED"
    ckpt = _rewritten(real_run, tmp_path / "c/last.ckpt", _net(f"_target_: builtins.open, file: '{marker}', mode: w"))
    out = tmp_path / "run"
    proc = run_cli("trainer=ddp_cpu", f"ckpt_path={ckpt}", f"hydra.run.dir={out}", "trainer.max_steps=4", cwd=tmp_path)
    _one_refusal(proc, "builtins.open")
    assert "rank 1" not in proc.stderr and not marker.exists() and not out.exists()


def _sharded_copy(tmp_path: Path, overrides: list[str] = (), metadata: bytes | None = None) -> Path:
    """The kept sharded checkpoint (a real FSDP2 run's), its meta.pt's overrides extended or its .metadata replaced."""
    copy = tmp_path / "sharded" / "checkpoints" / "last.ckpt"
    shutil.copytree(SHARDED, copy)
    if overrides:
        _rewritten(SHARDED / "meta.pt", copy / "meta.pt", list(overrides))
    if metadata is not None:
        (copy / ".metadata").write_bytes(metadata)
    return copy


class _Payload:
    """What a hostile ``.metadata`` holds: unpickled by a bare ``pickle.load``, it runs ``os.system``."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def test_a_sharded_checkpoints_meta_pt_is_checked_like_a_file(tmp_path):
    marker = tmp_path / "PWNED"
    ckpt = _sharded_copy(tmp_path, _net(f"_target_: builtins.open, file: '{marker}', mode: w"))
    for command in ("eval", "train"):
        out = tmp_path / f"out-{command}"
        args = (f"ckpt_path={ckpt}", f"hydra.run.dir={out}", "trainer=fsdp_cpu")
        proc = _eval(*args, cwd=tmp_path) if command == "eval" else run_cli(*args, cwd=tmp_path)
        _one_refusal(proc, "model.net._target_=builtins.open")
        assert not marker.exists() and not out.exists()


def test_a_sharded_checkpoints_metadata_is_unpickled_with_dcps_classes_alone(tmp_path):
    """torch's DCP reads ``.metadata`` with a bare ``pickle.load`` (every DCP load, Lightning's resume included): a
    payload there is refused first on every path — the resume (``ckpt_path=``, and a restarted job's own resume of its
    run dir), evaluation, ``multiloss-consolidate``, ``load_from_checkpoint`` — and never runs."""
    marker = tmp_path / "PWNED"
    ckpt = _sharded_copy(tmp_path, metadata=pickle.dumps(_Payload(f"touch {marker}")))
    refused = r"\.metadata is refused: it names posix\.system"
    for command in ("eval", "train"):
        out = tmp_path / f"out-{command}"
        args = (f"ckpt_path={ckpt}", f"hydra.run.dir={out}", "trainer=fsdp_cpu", *QUIET)
        proc = _eval(*args, cwd=tmp_path) if command == "eval" else run_cli(*args, cwd=tmp_path)
        _one_refusal(proc, "its .metadata is refused", "posix.system")
        assert not marker.exists() and not out.exists()
    # A restarted job (SLURM's requeue, torchrun's restart) resumes its run dir's own last.ckpt by itself.
    run = ckpt.parent.parent
    before = _files(run)
    proc = run_cli(f"hydra.run.dir={run}", "trainer=fsdp_cpu", *RUN, cwd=tmp_path, env={"SLURM_RESTART_COUNT": "1"})
    _one_refusal(proc, "its .metadata is refused")
    assert _files(run) == before and not marker.exists()
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "multiloss-consolidate"), str(ckpt), str(tmp_path / "whole.ckpt")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    _one_refusal(proc, "its .metadata is refused")
    assert not (tmp_path / "whole.ckpt").exists()
    with pytest.raises(ConfigError, match=refused):
        MultiHead.load_from_checkpoint(ckpt, map_location="cpu")
    assert not marker.exists()


def test_load_from_checkpoint_refuses_what_the_hyper_parameters_name_unless_allowed(real_run, tmp_path):
    marker = tmp_path / "PWNED"
    checkpoint = torch.load(real_run, map_location="cpu", weights_only=True)
    hostile = dict(checkpoint)
    hostile["hyper_parameters"] = {
        **checkpoint["hyper_parameters"],
        "net": {"_target_": "builtins.open", "file": str(marker), "mode": "w"},
    }
    torch.save(hostile, tmp_path / "hostile.ckpt")
    with pytest.raises(ConfigError, match=r"hyper_parameters\.net\._target_=builtins\.open: it comes only from"):
        MultiHead.load_from_checkpoint(tmp_path / "hostile.ckpt", map_location="cpu")
    with pytest.raises(ConfigError, match=r"hyper_parameters\.net\._target_=builtins\.open"):  # another allowed
        MultiHead.load_from_checkpoint(tmp_path / "hostile.ckpt", map_location="cpu", trust_checkpoint=["mypkg"])
    assert not marker.exists()
    # Lightning's own instantiator (2.6.5 and earlier called it): refused, even when trusted.
    instantiated = {**checkpoint, "hyper_parameters": {**checkpoint["hyper_parameters"], "_instantiator": "os.system"}}
    torch.save(instantiated, tmp_path / "instantiator.ckpt")
    for trusted in (False, True):
        with pytest.raises(ConfigError, match=r"hyper_parameters\._instantiator=.*GHSA-qqmf-gpg7-g8gw"):
            MultiHead.load_from_checkpoint(tmp_path / "instantiator.ckpt", trust_checkpoint=trusted)
    # The real run's own checkpoint, and the kept ones of earlier versions (moved module paths), need no flag.
    assert isinstance(MultiHead.load_from_checkpoint(real_run, map_location="cpu"), MultiHead)


@pytest.mark.parametrize("kept", sorted(p.name for p in KEPT.glob("*.ckpt")))
def test_every_kept_checkpoint_passes_with_no_flag(kept):
    """The checkpoints kept from earlier versions (their hyper-parameters name moved module paths) pass every check
    with no flag: their stored overrides on the command path, their hyper-parameters, a sharded one's .metadata."""
    path = KEPT / kept
    args, _, _ = run_overrides([f"ckpt_path={path}"])
    assert f"ckpt_path={path}" in args
    trust.check_hyper_parameters(path / "meta.pt" if path.is_dir() else path, False, kept)
    if path.is_dir():
        assert trust.read_sharded_metadata(path).state_dict_metadata


def test_trust_accepts_what_it_says(real_run, tmp_path):
    """``trust_checkpoint=true`` takes what the checkpoint says (documented: a checkpoint you would run as code);
    ``trust_checkpoint=[pkg]`` the targets under pkg; a target written on the command line is the user's own."""
    target = "tests.test_checkpoint_trust._Payload"
    ckpt = _rewritten(real_run, tmp_path / "c/last.ckpt", _net(f"_target_: {target}, command: x"))
    with pytest.raises(ConfigError, match=f"model.net._target_={target}"):
        run_overrides([f"ckpt_path={ckpt}"])
    for allowed in ("trust_checkpoint=true", "trust_checkpoint=[tests]", f"+model.head._target_={target}"):
        run_overrides([f"ckpt_path={ckpt}", allowed])  # accepted
    with pytest.raises(ConfigError, match="trust_checkpoint"):
        run_overrides([f"ckpt_path={ckpt}", "trust_checkpoint=7"])
    # Never carried itself: a checkpoint cannot trust itself.
    self_trusting = _rewritten(ckpt, tmp_path / "d/last.ckpt", ["trust_checkpoint=true"])
    with pytest.raises(ConfigError, match=f"model.net._target_={target}"):
        run_overrides([f"ckpt_path={self_trusting}"])


# --- the user's own option is never silently replaced ------------------------------------------------------------

# Each group that ships options, the option a run picks there (its default, or one chosen by the overrides).
GROUPS = {
    path.name: sorted(p.stem for p in path.glob("*.yaml"))[0]
    for path in sorted(CONFIG_DIR.iterdir())
    if path.is_dir() and path.name not in ("local", "hydra", "__pycache__") and list(path.glob("*.yaml"))
}


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_an_option_of_yours_named_as_a_shipped_one_is_refused_naming_both(tmp_path, group):
    option = GROUPS[group]
    mine = tmp_path / "my_configs" / group / f"{option}.yaml"
    mine.parent.mkdir(parents=True)
    mine.write_text((CONFIG_DIR / group / f"{option}.yaml").read_text())  # the same text: only the place differs
    choice = {
        "recipe_defaults": (f"recipe={option}",),  # chosen by ${recipe}
        "recipe_common": (),
        "hparams_search": (f"hparams_search={option}",),
        "experiment": (f"experiment={option}",),
    }.get(group, (f"{group}={option}",))
    testing.compose(*choice, config_dir=mine.parent.parent)
    with pytest.raises(ConfigError) as refused:
        check_no_shadowed_option(HydraConfig.get())
    message = refused.value.message
    assert str(CONFIG_DIR / group / f"{option}.yaml") in message and str(mine) in message
    assert f"{group}=my_{option}" in message and "move yours out of" in message


def test_an_option_of_yours_with_a_name_of_its_own_is_used(tmp_path):
    mine = tmp_path / "my_configs" / "discriminator" / "my_dcgan.yaml"
    mine.parent.mkdir(parents=True)
    mine.write_text((CONFIG_DIR / "discriminator" / "dcgan.yaml").read_text().replace("ndf: 64", "ndf: 8"))
    cfg = testing.compose("recipe=gan", "discriminator=my_dcgan", config_dir=mine.parent.parent)
    check_no_shadowed_option(HydraConfig.get())
    assert cfg.model.discriminator._target_ == "multiloss.gan.nets.DCGANDiscriminator"


def test_a_shadowed_option_on_the_command_line_is_one_message_and_no_run_dir(tmp_path):
    """The case a new user met: their own ``discriminator/dcgan.yaml`` and ``discriminator=dcgan``."""
    mine = tmp_path / "my_configs" / "discriminator" / "dcgan.yaml"
    mine.parent.mkdir(parents=True)
    mine.write_text((CONFIG_DIR / "discriminator" / "dcgan.yaml").read_text())
    out = tmp_path / "run"
    proc = run_cli(
        "--config-dir",
        str(mine.parent.parent),
        "recipe=gan",
        "discriminator=dcgan",
        "generator=dcgan",
        "data=stacked_digits",
        f"hydra.run.dir={out}",
        cwd=tmp_path,
    )
    line = _one_refusal(proc, str(mine), str(CONFIG_DIR / "discriminator" / "dcgan.yaml"))
    assert line.startswith("multiloss: config error: discriminator='dcgan': two options of that name")
    assert not out.exists()
