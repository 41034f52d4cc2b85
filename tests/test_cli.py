"""`python train.py` as a user runs it: a real run's outputs, --help, and clean rejection of bad input."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import CONFIG_DIR, ROOT, run_cli, run_shell

QUICK_CLI = ("print_config=false", "~callbacks.progress_bar", "trainer.enable_progress_bar=false")
RECIPES = sorted(p.stem for p in (CONFIG_DIR / "recipe").glob("*.yaml"))
# An accelerator this machine does not have (asked of the machine: the suite runs with and without a GPU).
MISSING = "tpu" if torch.cuda.is_available() or torch.backends.mps.is_available() else "gpu"


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """One real 30-step multihead run through the CLI, shared by the tests below."""
    out = tmp_path_factory.mktemp("cli") / "run"
    proc = run_cli("recipe=multihead", "trainer.max_steps=30", f"hydra.run.dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    SAID["finished_run"] = proc.stdout
    return out


SAID: dict[str, str] = {}  # what the shared run printed


def test_run_ends_with_a_summary_of_final_values_and_outputs(finished_run):
    said = SAID["finished_run"]
    summary = said[said.index("multiloss: final values") :]
    for name in ("loss/head0", "loss/head1", "loss/head2", "loss/total", "val/acc"):
        assert name in summary, name
    assert f"multiloss: outputs in {finished_run}" in summary
    assert f"ckpt_path={finished_run / 'checkpoints/last.ckpt'}" in summary


def test_run_writes_the_contract_outputs(finished_run):
    out = finished_run
    for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
        assert (out / ".hydra" / name).is_file(), name
    assert "trainer.max_steps=30" in (out / ".hydra/overrides.yaml").read_text()
    metrics = list(out.rglob("metrics.csv"))
    assert len(metrics) == 1
    header = metrics[0].read_text().splitlines()[0].split(",")
    assert {"loss/head0", "loss/head1", "loss/head2", "loss/total"} <= set(header)
    assert any(col.startswith("lr") for col in header)
    ckpt = torch.load(out / "checkpoints/last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 30
    assert (out / "loss_curves.png").stat().st_size > 10_000
    assert "training MultiHead on rank 0 of 1 into" in (out / "train.log").read_text()  # the run's log lines


def test_help_lists_every_recipe_with_its_description():
    proc = run_cli("--help")
    assert proc.returncode == 0, proc.stderr
    for name in RECIPES:
        assert f"recipe={name}" in proc.stdout
    assert "Deep supervision: several classification heads" in proc.stdout  # multihead's docstring, first line
    for group in ("net:", "logger:", "hydra/launcher: slurm", "local: configs/local/default.yaml"):
        assert group in proc.stdout, group


def test_help_imports_neither_torch_nor_lightning():
    # -X importtime lists every module the interpreter imported, on stderr.
    proc = run_cli("--help", python_flags=("-X", "importtime"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    imported = {line.split("|")[-1].strip().split(".")[0] for line in proc.stderr.splitlines() if "|" in line}
    assert "hydra" in imported
    assert not imported & {"torch", "lightning", "torchmetrics", "numpy"}, sorted(imported)


def _digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    }


# (override, what the one-line message must name): one message, exit 2, whether Hydra finds the mistake while
# composing or multiloss after (before torch is imported, `multiloss.config.early`, or after, with the run's data).
BAD_INPUTS = [
    ("seed=abc", ["seed", "abc"]),  # wrong type, caught by the structured schema
    ("data.batch_size=abc", ["data.batch_size", "abc", "int"]),  # wrong type, by the signature
    ("data.batch_size=0", ["data.batch_size=0", "≥ 1"]),  # impossible value
    ("+model.bogus=1", ["model.bogus", "unknown key", "head_weights"]),  # unknown key, with what is accepted
    ("+trainer.max_stepz=10", ["trainer.max_stepz", "did you mean max_steps"]),
    ("+sed=3", ["sed=3", "unknown key", "did you mean seed"]),  # a top-level key nothing reads
    ("model.optimizer.lr=-1", ["model.optimizer.lr=-1", "rejected by the optimizer"]),  # torch's own check, early
    ("model.optimizer.weight_decay=-1", ["model.optimizer.weight_decay", "weight_decay"]),
    ("model.head_weights=[1,2]", ["model.head_weights", "[1.0, 2.0]", "3 numbers"]),  # mismatched length
    # A component that breaks its contract, found by running it on the data at setup.
    ("model.net.num_classes=1", ["model.net", "DeepSupervisionMLP", "out of bounds"]),
    ("recipe=nope", ["recipe/nope", "multihead"]),  # unknown recipe, with the available ones
    # Hydra logs its own error line while looking it up: it must not reach the earlier run's train.log.
    ("model.optimizer._target_=torch.optim.Nope", ["model.optimizer._target_=torch.optim.Nope", "importable"]),
    ("ckpt_path=/no/such.ckpt", ["ckpt_path", "/no/such.ckpt", "no such checkpoint"]),
    (f"trainer.accelerator={MISSING}", ["trainer.accelerator", MISSING, "cpu"]),  # hardware this machine lacks
    ("trainer.max_steps=-5", ["trainer.max_steps=-5", "non-negative"]),  # Lightning's own check
    # Lightning's check against the data, inside fit: still before anything is written.
    ("trainer.val_check_interval=1000", ["trainer.val_check_interval=1000", "number of the training batches"]),
]


@pytest.mark.parametrize(("override", "named"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_is_rejected_cleanly_and_leaves_earlier_results(finished_run, tmp_path, override, named):
    out = tmp_path / "earlier"
    shutil.copytree(finished_run, out)
    before = _digest(out)

    proc = run_cli("recipe=multihead", override, f"hydra.run.dir={out}")

    said = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "Traceback" not in said
    for text in named:
        assert text in said, f"{text!r} not in:\n{said}"
    after = _digest(out)
    assert after == before  # nothing overwritten, nothing added (its train.log included)


@pytest.mark.parametrize(
    ("override", "said"),
    [
        ("model.net.width=0", "model.net.width=0"),  # at the config check
        ("model.head_weights=[1,2]", "model.head_weights=[1.0, 2.0]"),  # at setup, once the heads are counted
        ("balancer=pcgrad model.balancer.shared=[nope]", "model.balancer.shared='nope'"),  # multihead: at setup too
    ],
)
def test_a_rejected_run_leaves_no_run_dir(tmp_path, override, said):
    out = tmp_path / "fresh"
    proc = run_cli(*override.split(), f"hydra.run.dir={out}")
    assert proc.returncode == 2 and said in proc.stderr, proc.stderr[-2000:]
    # Hydra made it before the check (and the logger its version dir before a setup-time check):
    # multiloss removes the empty dirs again.
    assert not out.exists()


def test_a_sweep_runs_without_naming_its_sweep_dir(tmp_path):
    """The README's `python train.py -m recipe=multihead seed=1,2`, as written: one run dir per job."""
    proc = run_cli("-m", "recipe=multihead", "seed=1,2", "trainer.max_steps=2", *QUICK_CLI, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (sweep,) = (tmp_path / "multirun").iterdir()
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1"]
    for job in ("0", "1"):
        assert (sweep / job / "checkpoints" / "last.ckpt").is_file()
    # It ends with one table across its jobs: what tells them apart, how each ended, its values, its run dir.
    table = proc.stdout.split("multiloss: the sweep's 2 jobs\n")[1].splitlines()
    header = table[0].split()
    assert header[:4] == ["job", "overrides", "ended", "loss/head0"] and header[-2:] == ["run", "dir"]
    for job, seed in (("0", 1), ("1", 2)):
        row = next(line.split() for line in table if line.split()[:3] == [job, f"seed={seed}", "done"])
        assert row[-1] == str(sweep / job) and float(row[3]) > 0


def test_a_run_is_quiet_about_known_third_party_noise(tmp_path):
    proc = run_cli("recipe=gan", "trainer.max_steps=4", *QUICK_CLI, f"hydra.run.dir={tmp_path}", warnings="default")
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = proc.stdout + proc.stderr
    for noise in ("💡 Tip", "litlogger", "set_vital", "LeafSpec"):
        assert noise not in said, noise


def test_other_warnings_still_show():
    import warnings

    from multiloss.console.noise import silence_known_noise

    silence_known_noise()
    with pytest.warns(UserWarning, match="a real one"):
        warnings.warn("a real one", UserWarning, stacklevel=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        silence_known_noise()
        warnings.warn("'set_vital' is deprecated, please do not call", UserWarning, stacklevel=1)
    assert not caught


# What a run's command line trusts: a target of the user's own package (a callback of the tests' package that never
# fires), a config dir of theirs (examples/configs, whose net is mypkg's: importable with PYTHONPATH=examples).
OWN_TARGET = ("+callbacks.mine._target_=tests.helpers.SignalAt", "+callbacks.mine.step=1000")
CONFIG_DIR_NET = ("--config-dir", str(ROOT / "examples/configs"), "net=two_head_cnn")
USERS_SHELL = {"PYTHONPATH": str(ROOT / "examples")}
TRUSTED = {"own target": OWN_TARGET, "config dir": CONFIG_DIR_NET, "both": (*CONFIG_DIR_NET, *OWN_TARGET)}


@pytest.mark.parametrize("kind", list(TRUSTED))
def test_the_train_on_line_runs_as_printed_with_what_the_command_trusted(tmp_path, kind):
    """A run whose command line named a target of its own package, a config dir of its own, or both: the ``train on:``
    line it ends with carries what that command trusted (``trust_checkpoint=[tests]``, ``--config-dir <dir>``), and
    pasted into the user's shell as it is, it trains on (a ``[...]`` in it is printed as it is, not read as markup)."""
    run = tmp_path / "run"
    first = run_cli(
        *TRUSTED[kind], "recipe=multihead", "trainer.max_steps=2", *QUICK_CLI, f"hydra.run.dir={run}", env=USERS_SHELL
    )
    assert first.returncode == 0, first.stderr[-3000:]
    line = " ".join(first.stdout.split("; train on: ")[1].split())
    if kind != "config dir":
        assert "'trust_checkpoint=[tests]'" in line, line
    if kind != "own target":
        assert f"--config-dir {ROOT / 'examples/configs'}" in line, line
    again = run_shell(line, cwd=tmp_path, env=USERS_SHELL)
    assert again.returncode == 0, again.stderr[-3000:]
    out = Path(again.stdout.split("multiloss: outputs in ")[1].split(";")[0])
    assert torch.load(out / "checkpoints/last.ckpt", weights_only=True)["global_step"] == 4


def test_the_continue_with_line_of_a_stopped_run_runs_as_printed(tmp_path):
    """A run stopped by a SIGTERM (its own package's callback sends it; its net from its own config dir): the
    ``continue with:`` line it prints, pasted as it is (the signal's step moved past the run's end), continues it."""
    run = tmp_path / "run"
    stop = ("+callbacks.signal._target_=tests.helpers.SignalAt", "+callbacks.signal.step=2")
    first = run_cli(
        *CONFIG_DIR_NET,
        *stop,
        "recipe=multihead",
        "trainer.max_steps=4",
        *QUICK_CLI,
        f"hydra.run.dir={run}",
        env=USERS_SHELL,
    )
    assert first.returncode == 143, first.stderr[-3000:]
    (message,) = [line for line in first.stderr.splitlines() if line.startswith("multiloss:")]
    line = message.split("continue with: ")[1]
    assert "'trust_checkpoint=[tests]'" in line and f"--config-dir {ROOT / 'examples/configs'}" in line, line
    done = run_shell(f"{line} +callbacks.signal.step=100 hydra.run.dir={run}", cwd=tmp_path, env=USERS_SHELL)
    assert done.returncode == 0, done.stderr[-3000:]
    assert torch.load(run / "checkpoints/last.ckpt", weights_only=True)["global_step"] == 4


def test_the_printed_resume_line_resumes_as_printed(tmp_path):
    """The last line of a run is a command: pasted into a shell as it is, it continues that run (its recipe, seed
    and every other override from the checkpoint), and with a longer budget on top it trains on."""

    first = run_cli("recipe=gan", "seed=1", "trainer.max_steps=4", *QUICK_CLI, f"hydra.run.dir={tmp_path / 'gan'}")
    assert first.returncode == 0, first.stderr[-3000:]
    line = first.stdout.split("; train on: ")[1].strip()
    ckpt = tmp_path / "gan/checkpoints/last.ckpt"
    # Twice the budget: the same one would be refused (nothing to train).
    assert (
        line
        == f"python {Path(__file__).parents[1] / 'train.py'} ckpt_path={ckpt} trainer.max_steps=8 trainer.max_epochs=40"
    )
    again = run_shell(line, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    said = "multiloss: continuing with the checkpoint's run's overrides (yours win): "
    carried = again.stdout.split(said)[1].splitlines()[0].split()
    assert {"recipe=gan", "seed=1"} <= set(carried) and not any("max_steps" in o for o in carried), carried
    out = Path(again.stdout.split("multiloss: outputs in ")[1].split(";")[0])
    assert out.parent.parent == tmp_path / "outputs"  # a run dir of its own, beside the first
    steps = [torch.load(d / "checkpoints/last.ckpt", weights_only=True)["global_step"] for d in (ckpt.parents[1], out)]
    assert steps[0] >= 4 and steps[1] >= 8, steps  # a GAN batch's steps: both networks', n_critic + 1
