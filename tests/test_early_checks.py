"""The config checked before torch and Lightning are imported: the same verdict and the same words as the run's.

`multiloss.config.early` reads each ``_target_`` from its source (`multiloss.config.source`) and follows what its
constructor checks of the config's values (`multiloss.config.argument_checks`). These tests hold it to the run's own
checks (`multiloss.training.prepare`, after the imports): every mistake it names is named word for word as the run
names it; what it cannot tell it leaves to the run; a command that fails on a config error imports neither torch nor
Lightning; and the signatures it reads from source are the imported ones.
"""

from __future__ import annotations

import copy
import inspect
import typing
from pathlib import Path

import pytest
import yaml

from multiloss.config import ConfigError, argument_checks, source
from multiloss.config.argument_checks import UNKNOWN, rejection
from multiloss.config.early import check_early
from multiloss.config.validate import imported_target, source_target
from tests.conftest import CONFIG_DIR, run_cli
from tests.test_cli import BAD_INPUTS, MISSING


def test_the_tests_read_strictly():
    """A construct the reader gets wrong fails a test instead of leaving the check to the run (tests/conftest.py)."""
    assert argument_checks.STRICT


def _early(cfg) -> str | None:
    """What `python train.py` says of ``cfg`` before the imports (`multiloss.cli.check_before_imports`)."""
    from multiloss.saving.run_dir import checkpoint_to_resume

    cfg = copy.deepcopy(cfg)
    try:
        check_early(cfg)
        checkpoint_to_resume(cfg)
    except ConfigError as err:
        return err.message
    return None


def _run(cfg) -> str | None:
    """What the run says of ``cfg`` before it fits: `multiloss.train`'s checks, nothing written."""
    from multiloss.config import check_config
    from multiloss.saving.run_dir import checkpoint_to_resume
    from multiloss.training import prepare

    cfg = copy.deepcopy(cfg)
    try:
        check_config(cfg)
        checkpoint_to_resume(cfg)
        prepare(cfg)
    except ConfigError as err:
        return err.message
    return None


# The config mistakes of the CLI's table, and more of the kinds a config can hold: all found before the imports.
FOUND_EARLY = [
    *(b[0] for b in BAD_INPUTS if b[0] not in ("seed=abc", "recipe=nope")),  # those two: Hydra's own, below
    "recipe=gan model.n_critic=0",
    "recipe=gan model.loss=wgan-gp model.penalty=none",
    "recipe=gan model.penalty=r1 model.penalty_weight=0",
    "recipe=gan model.g_input=same_fakes model.accumulate_grad_batches=2",  # a value set on the object, read back
    "recipe=gan model.d_optimizer.betas=[0.5,1.5]",
    "recipe=tbptt model.chunk_length=0",
    "recipe=accumulation model.lr_scaling=cubic",
    "recipe=accumulation model.accumulate_grad_batches=0",
    "optimizer=sgd model.optimizer.momentum=-0.5",
    "model.gradient_clip_val=-1",
    "model.head_weights=[1,-1,1]",
    "data.val_fraction=1.5",
    "data.num_workers=-1",
    "trainer.max_epochs=-3",
    "trainer=fsdp_cpu trainer.precision=bf16-mixed",
    "collective_timeout=0",
    "nonfinite=maybe",
    "data=images data.path=/no/such/images",  # the file system read before the imports, as the run reads it
    "data=samples data.path=/no/such/samples",
    "data=npz data.path=/no/such/arrays.npz",
    "data=images data.path=/tmp data.labels=tags",
    "data=images data.path=/tmp data.val_path=/no/such/images",
    "recipe=tbptt data=text data.path=/no/such/text.txt",
    f"recipe=tbptt data=text data.path={Path(__file__).resolve()} data.test_path=/no/such/text.txt",
]
FOUND_EARLY.remove("model.head_weights=[1,2]")  # counted against the net's heads: the net is built for it
FOUND_EARLY.remove("model.net.num_classes=1")  # the net run on a batch
FOUND_EARLY.remove("trainer.val_check_interval=1000")  # Lightning's check against the data, inside fit


@pytest.mark.parametrize("overrides", FOUND_EARLY)
def test_a_config_mistake_is_found_before_the_imports_in_the_runs_own_words(make_cfg, overrides):
    cfg = make_cfg(*overrides.replace("'", "").split())
    early, run = _early(cfg), _run(cfg)
    assert run is not None, "the run accepts it"
    assert early == run


@pytest.mark.parametrize(
    "overrides",
    [
        # Found in fit, on a batch of the data (the CLI's table shows the run's message): the heads counted on the
        # built net, the net run on the batch, Lightning's check against the number of batches.
        "model.head_weights=[1,2]",
        "model.net.num_classes=1",
        "trainer.val_check_interval=1000",
        "model.net.width=0",  # a component the recipe builds: its own checks run when it is built
        # A list of penalties is checked name by name in a loop the source reader does not follow.
        "recipe=gan model.penalty=[r1,r3]",
        "recipe=gan model.penalty=[r1,r2] model.penalty_weight=[1,2,3]",
    ],
)
def test_what_needs_the_components_built_is_left_to_the_run(make_cfg, overrides):
    assert _early(make_cfg(*overrides.split())) is None


@pytest.mark.parametrize("recipe", ["multihead", "weighted", "gan", "tbptt", "accumulation"])
@pytest.mark.parametrize("trainer", ["cpu", "ddp_cpu", "fsdp_cpu"])
def test_every_recipe_on_every_cpu_engine_passes(make_cfg, recipe, trainer):
    cfg = make_cfg(f"recipe={recipe}", f"trainer={trainer}")
    assert _early(cfg) is None


def test_a_failing_command_imports_neither_torch_nor_lightning(tmp_path):
    # -X importtime lists every module the interpreter imported, on stderr.
    for override in (
        "data.batch_size=0",
        "model.optimizer.lr=-1",
        "trainer.max_steps=-5",
        f"trainer.accelerator={MISSING}",
    ):
        proc = run_cli(override, f"hydra.run.dir={tmp_path / 'run'}", python_flags=("-X", "importtime"))
        assert proc.returncode == 2, proc.stderr[-2000:]
        imported = {line.split("|")[-1].strip().split(".")[0] for line in proc.stderr.splitlines() if "|" in line}
        assert not imported & {"torch", "lightning", "torchmetrics", "numpy"}, (override, sorted(imported))
        assert f"multiloss: config error: {override.split('=')[0]}" in proc.stderr
        assert not (tmp_path / "run").exists()


# --- Hydra's own composition errors: the project's one message --------------------------------------------------


@pytest.mark.parametrize(
    ("override", "said"),
    [
        ("model.head_weight=[1,1,1]", ["model.head_weight=[1, 1, 1]: unknown key", "did you mean head_weights?"]),
        ("recipe=multihed", ["recipe='multihed'", "recipe/multihed.yaml", "did you mean multihead?"]),
        ("balancer=famoo", ["balancer='famoo'", "did you mean famo"]),
        ("model.optimizer.lr=[1,2", ["model.optimizer.lr='[1,2'", "Hydra cannot parse it", "quote"]),
        ("seed=abc", ["seed='abc': wrong type", "accepted: int"]),
        ("trainer.max_time=00:00:30", ["trainer.max_time='00:00:30': not in the config", "+trainer.max_time"]),
    ],
)
def test_hydras_composition_errors_are_one_message_naming_the_key(tmp_path, override, said):
    proc = run_cli(override, f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.startswith("multiloss: config error:"), proc.stderr
    for text in said:
        assert text in proc.stderr, (text, proc.stderr)
    for noise in ("HYDRA_FULL_ERROR", "Traceback", "search path", "provider="):
        assert noise not in proc.stderr
    assert not (tmp_path / "run").exists()


def test_hydra_full_error_set_by_the_user_still_shows_hydras_own_report(tmp_path):
    proc = run_cli("recipe=multihed", f"hydra.run.dir={tmp_path}", env={"HYDRA_FULL_ERROR": "1"})
    assert proc.returncode == 1 and "MissingConfigException" in proc.stderr and "Traceback" in proc.stderr


# --- what is read from source is what the import gives -------------------------------------------------------


def _shipped_targets() -> list[str]:
    found: set[str] = set()

    def walk(node):
        if isinstance(node, dict):
            if isinstance(node.get("_target_"), str):
                found.add(node["_target_"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    for path in CONFIG_DIR.rglob("*.yaml"):
        walk(yaml.safe_load(path.read_text()))
    return sorted(t for t in found if not t.startswith(("hydra_plugins.", "optuna.")))


@pytest.mark.parametrize("target", _shipped_targets())
def test_a_shipped_targets_signature_read_from_source_is_the_imported_one(target):
    try:
        imported = imported_target(target)
    except ConfigError as err:
        pytest.skip(f"not installed here: {err.problem}")
    read = source_target(target)
    assert read is not None, "the source does not tell"
    assert (read.name, read.params, read.open_kwargs, read.passes_down) == (
        imported.name,
        imported.params,
        imported.open_kwargs,
        imported.passes_down,
    )
    for name, hint in read.hints.items():  # a hint the source could build is the imported one
        if name in read.params and hint is not typing.Any and not _mentions_any(hint):
            assert hint == imported.hints.get(name), name


def _mentions_any(hint) -> bool:
    return hint is typing.Any or any(_mentions_any(a) for a in typing.get_args(hint))


def test_an_unknown_target_is_named_with_hydras_words(make_cfg):
    cfg = make_cfg("model.optimizer._target_=torch.optim.Nope")
    assert _early(cfg) == _run(cfg)
    cfg = make_cfg("model.optimizer._target_=nopackage.Adam")
    assert _early(cfg) == _run(cfg)


def test_the_accelerators_known_before_the_imports_are_lightnings():
    import torch
    from lightning.pytorch.accelerators import AcceleratorRegistry

    from multiloss.config import machine

    assert set(AcceleratorRegistry.available_accelerators()) == machine.LIGHTNING_ACCELERATORS
    told = machine.cuda_available()
    assert told in (None, torch.cuda.is_available())  # never a wrong answer: None where only torch can tell


# --- the reading itself: what it tells, what it leaves ----------------------------------------------------------


def _definitions(tmp_path: Path, code: str) -> dict[str, source.Definition]:
    module = tmp_path / "early_checks_case.py"
    module.write_text(inspect.cleandoc(code))
    import ast

    parsed = source.Module("early_checks_case", module, False, ast.parse(module.read_text()))
    return {
        s.name: source.Definition(parsed, s) for s in parsed.tree.body if isinstance(s, ast.ClassDef | ast.FunctionDef)
    }


def test_the_reading_reports_only_what_the_code_surely_raises(tmp_path):
    found = _definitions(
        tmp_path,
        """
        import abc

        from multiloss.config import ConfigError, require

        def helper(values):
            values.append(-1)

        class Component:
            def __init__(self, width=8, sizes=(1, 2), mode="a", net=None):
                require(width >= 1, "width", width, "an integer >= 1")
                if net is not None and net.ready():
                    return                      # an unknown branch that may leave: nothing after it is judged
                require(mode in ("a", "b"), "mode", mode, "a or b")

        class Mutating:
            def __init__(self, values=None):
                values = list(values or [1])
                helper(values)                  # a call that may change what it is given
                require(all(v > 0 for v in values), "values", values, "positives")

        class Spec:
            pass

        class Abstract(abc.ABC):
            pass

        class Takes:
            def __init__(self, spec=None):
                if isinstance(spec, Spec):
                    return                      # no plain value is a Spec: read on
                require(spec is None or "scope" in spec, "spec", spec, "a mapping with a scope")

        class TakesAbstract:
            def __init__(self, spec=None):
                if isinstance(spec, Abstract):
                    return                      # an ABC may claim a plain value (register): unknown, may have left
                require(spec is None or "scope" in spec, "spec", spec, "a mapping with a scope")

        class Loop:
            def __init__(self, sizes=(1, 2)):
                for i, size in enumerate(sizes):
                    require(size > 0, f"sizes.{i}", size, "a positive size")
                total = 0
                for size in sizes:
                    total += size
                if total > 10:
                    raise ConfigError("sizes", list(sizes), "ten at most in all")
        """,
    )
    assert rejection(found["Component"], {"width": 0}).message == "width=0\n  accepted: an integer >= 1"
    assert rejection(found["Component"], {"mode": "c"}).message.startswith("mode='c'")
    assert rejection(found["Component"], {"mode": "c", "net": UNKNOWN}) is None  # may have returned before
    assert rejection(found["Component"], {"width": 4}) is None
    assert rejection(found["Mutating"], {"values": [2]}) is None  # helper's effect is not read: unknown, not wrong
    assert rejection(found["Loop"], {"sizes": [1, -2]}).message.startswith("sizes.1=-2")
    assert rejection(found["Loop"], {"sizes": [6, 6]}).message.startswith("sizes=[6, 6]")
    assert rejection(found["Loop"], {"sizes": UNKNOWN}) is None
    assert rejection(found["Takes"], {"spec": {"x": 1}}).message.startswith("spec={'x': 1}")
    assert rejection(found["TakesAbstract"], {"spec": {"x": 1}}) is None
