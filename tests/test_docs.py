"""Every code block of the README and docs/ runs as written: a user copies them.

The blocks are read from the Markdown itself. A Python or YAML block whose first comment names a file
(``# mypkg/nets.py``) is written there, in a scratch project dir beside a copy of ``train.py``, as the user would;
the launch lines then run from that dir as printed. A block that shows a session (``$ python train.py …`` and what it
printed) is run and its printed lines compared (``…`` stands for any text). Every other launch line is
composed and checked as ``python train.py`` would check it before training (`multiloss.config.check_config`).
"""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

import pytest
import torch

from multiloss import testing
from multiloss.config import check_config
from tests.conftest import ROOT, run_cli, run_shell

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
FILE_COMMENT = re.compile(r"^# ([\w./-]+\.(?:py|yaml))\b")


def blocks(page: Path) -> list[tuple[str, str, str]]:
    """``(where, language, body)`` of each fenced block of ``page``."""
    text = page.read_text()
    return [
        (f"{page.name}:{text[: m.start()].count(chr(10)) + 1}", m.group(1), m.group(2)) for m in FENCE.finditer(text)
    ]


ALL = [block for page in PAGES for block in blocks(page)]


def named_file(body: str) -> str | None:
    """The path a Python or YAML block says it is, in a comment of its first two lines."""
    for line in body.splitlines()[:2]:
        if match := FILE_COMMENT.match(line):
            return match.group(1)
    return None


def launch_lines(body: str) -> list[str]:
    """The ``python train.py …`` commands of a shell block, continuation lines joined, comments dropped."""
    joined = body.replace("\\\n", " ")
    return [line.split(" #")[0].strip() for line in joined.splitlines() if line.startswith("python train.py")]


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A user's project dir: ``train.py`` and every file a block names, written from the blocks."""
    root = tmp_path_factory.mktemp("project")
    shutil.copy(ROOT / "train.py", root / "train.py")
    for _, language, body in ALL:
        if language in ("python", "yaml") and (name := named_file(body)):
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_text(body)
    return root


def test_the_blocks_that_are_files_say_so_where_hydra_and_python_read_them():
    named = {named_file(body): where for where, language, body in ALL if language in ("python", "yaml")}
    assert {"mypkg/nets.py", "my_configs/net/two_head_cnn.yaml"} <= set(named), named
    for where, language, body in ALL:
        if language == "yaml" and named_file(body):
            # Hydra reads a `# @package` line only before any other line.
            assert body.startswith("# @package "), where


def test_bring_your_own_model_runs_as_written(project):
    """README's two files and its launch line, from the project dir: the CNN trains (3 steps, the line's own
    overrides as printed), and README's proof of the step passes on it."""
    (line,) = [c for _, language, body in ALL if language == "bash" for c in launch_lines(body) if "my_configs" in c]
    proc = run_shell(f"{line} trainer.max_steps=3 print_config=false hydra.run.dir=run", project)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert torch.load(project / "run/checkpoints/last.ckpt", weights_only=True)["global_step"] == 3
    (proof,) = [body for _, language, body in ALL if language == "python" and "testing.compose(" in body]
    (project / "proof.py").write_text(proof)
    done = run_shell("python proof.py", project)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_inference_snippet_loads_a_run_as_written(tmp_path):
    (snippet,) = [body for _, language, body in ALL if language == "python" and "load_from_checkpoint" in body]
    run = tmp_path / "outputs/multihead/2026-01-01_00-00-00"
    proc = run_cli("recipe=multihead", "trainer.max_steps=2", "print_config=false", f"hydra.run.dir={run}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (tmp_path / "infer.py").write_text(snippet.replace("<time>", run.name) + "\nassert logits.shape == (5, 10)\n")
    done = run_shell("python infer.py", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_step_shown_is_the_step_that_runs():
    """README's and docs/recipes.md's "multihead's, whole": the recipe's training_step, annotations aside."""
    import inspect
    import textwrap

    from multiloss.recipes.multihead import MultiHead

    source = textwrap.dedent(inspect.getsource(MultiHead.training_step))
    source = source.replace("batch: Any, batch_idx: int) -> None:", "batch, batch_idx):")
    shown = [body for _, language, body in ALL if language == "python" and body.startswith("def training_step")]
    assert len(shown) == 2 and all(body == source for body in shown), shown


def _sessions() -> list[tuple[str, str, list[str]]]:
    """``(where, command, printed lines)`` of every ``$ python train.py`` session a text block shows."""
    found = []
    for where, language, body in ALL:
        if language != "text" or not body.startswith("$ python train.py"):
            continue
        for part in body.split("$ ")[1:]:
            command, *printed = part.rstrip("\n").splitlines()
            found.append((where, command.split("  #")[0].strip(), printed))
    return found


@pytest.mark.parametrize("where, command, printed", _sessions(), ids=[s[1] for s in _sessions()])
def test_each_session_shown_prints_what_it_shows(where, command, printed, tmp_path):
    if "accelerator=gpu" in command and torch.cuda.is_available():
        pytest.skip("the session shows a machine without a GPU")
    args = shlex.split(command)[2:]
    proc = run_cli(*args, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    said = [line for line in proc.stderr.splitlines() + proc.stdout.splitlines() if line.strip()]
    for line in printed:
        shown = re.compile(".*".join(re.escape(part) for part in line.rstrip().split("…")))
        assert any(shown.fullmatch(s.rstrip()) for s in said), (where, line, said[-6:])


def _launches() -> list[tuple[str, str]]:
    found = []
    for where, language, body in ALL:
        if language in ("bash", "") and "my_configs" not in body:
            found += [(where, line) for line in launch_lines(body) if "<" not in line and " -m " not in line]
    return found


@pytest.mark.parametrize("where, line", _launches(), ids=[line for _, line in _launches()])
def test_every_launch_line_composes_and_passes_the_checks(where, line, tmp_path):
    args = shlex.split(line)[2:]
    dirs = [args[i + 1] for i, a in enumerate(args) if a == "--config-dir"]
    overrides = [a for i, a in enumerate(args) if a != "--config-dir" and (i == 0 or args[i - 1] != "--config-dir")]
    cfg = testing.compose(*overrides, config_dir=ROOT / dirs[0] if dirs else None, output_dir=tmp_path)
    assert check_config(cfg) is None  # raises ConfigError, naming the key, on a line a run would refuse
    # The line means what it says: each option it picks is the one composed, each value it sets is the config's.
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    choices = HydraConfig.get().runtime.choices
    parsed = OverridesParser.create().parse_overrides(overrides)
    assert parsed, line
    for override in parsed:
        key, value = override.key_or_group.lstrip("+"), override.value()
        if key in choices:
            assert choices[key] == value, (line, key)
        else:
            found = OmegaConf.select(cfg, key)
            found = OmegaConf.to_container(found) if OmegaConf.is_config(found) else found
            assert found == value, (line, key, found)


def test_an_option_file_whose_package_line_is_not_first_is_named_as_such(project, tmp_path):
    """The mistake README's YAML block once made: a comment above ``# @package``, which Hydra then ignores. The
    launch line's ``model.net.channels=32`` is not "no such key" but the option file's header."""
    shutil.copytree(project / "my_configs", tmp_path / "my_configs")
    option = tmp_path / "my_configs/net/two_head_cnn.yaml"
    lines = option.read_text().splitlines()
    option.write_text("\n".join([lines[1], lines[0], *lines[2:]]) + "\n")
    proc = run_cli("--config-dir", str(tmp_path / "my_configs"), "net=two_head_cnn", "model.net.channels=32")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "this option landed at the top level of the config" in proc.stderr
    assert "whose first line is `# @package model.net`" in proc.stderr


def test_the_extending_pages_code_is_the_examples_code():
    """docs/extending.md shows the example package's methods and proof: each block that names a file under examples/
    is a verbatim part of that file (the test that runs the file then runs what the page shows)."""
    shown = [
        (where, body)
        for where, language, body in ALL
        if where.startswith("extending.md") and (named_file(body) or "").startswith("examples/")
    ]
    assert len(shown) >= 5, shown
    for where, body in shown:
        name, code = body.split("\n", 1)
        assert code in (ROOT / name.removeprefix("# ")).read_text(), where
