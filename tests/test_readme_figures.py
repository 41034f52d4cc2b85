"""The README's figures are the ones `benchmarks/readme_figures.py` measured, and still what the code gives."""

from __future__ import annotations

import importlib.util
import json

import pytest

from multiloss import testing, train
from tests.conftest import QUIET, ROOT

spec = importlib.util.spec_from_file_location("readme_figures", ROOT / "benchmarks" / "readme_figures.py")
figures_script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(figures_script)


def figures() -> dict:
    return json.loads((ROOT / "docs" / "figures.json").read_text())


def test_the_readme_says_what_the_measurements_hold():
    """Each marked block of the README is rendered from docs/figures.json: an edit by hand, or numbers measured and
    not rendered, fails here (`python benchmarks/readme_figures.py --render` rewrites them)."""
    readme, measured = (ROOT / "README.md").read_text(), figures()
    assert figures_script.render(readme, measured) == readme
    for key in ("machine", "date", "commit"):
        assert measured[key] and measured[key] in readme, key


@pytest.mark.slow
def test_a_default_run_today_gives_the_readme_figure(tmp_path):
    """multihead's default run (15 epochs on the digits, seed 0), on this machine's CPU: a change to the code that
    moves the figure fails here until the figures are measured again (runs are deterministic; the tolerance is for
    another CPU's rounding: 0.02, a few seeds' spread)."""
    cfg = testing.compose("recipe=multihead", *QUIET, "trainer.accelerator=cpu", output_dir=tmp_path)
    metrics = train(cfg)
    assert metrics["val/acc"] == pytest.approx(figures()["recipes"]["multihead"]["val/acc"], abs=0.02)
