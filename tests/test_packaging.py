"""``pip install .`` gives a package that runs anywhere: its commands, its configs, no top-level ``recipes``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.conftest import CONFIG_DIR, ROOT


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    # Built from a copy: setuptools writes build/ and *.egg-info into the tree it builds, and two test
    # workers building this checkout at once race on them (CI lost a run to it).
    source = tmp_path_factory.mktemp("source") / "multiloss"
    shutil.copytree(
        ROOT,
        source,
        ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "outputs", "multirun", "__pycache__"),
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            str(source),
        ],
        check=True,
        capture_output=True,
    )
    (built,) = out.glob("multiloss-*.whl")
    return built


def test_the_wheel_ships_configs_and_recipes_inside_the_package(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    # The package, and the SLURM launcher where Hydra looks for launchers (hydra_plugins/, a namespace).
    top = {"multiloss", "hydra_plugins", f"{wheel.name.split('-py3')[0]}.dist-info"}
    assert {n.split("/")[0] for n in names} == top
    assert "hydra_plugins/multiloss_slurm/__init__.py" in names and "hydra_plugins/__init__.py" not in names
    shipped = {n.removeprefix("multiloss/configs/") for n in names if n.startswith("multiloss/configs/")}
    expected = {str(p.relative_to(CONFIG_DIR)) for p in CONFIG_DIR.rglob("*.yaml") if p.parent.name != "local"}
    assert expected <= shipped, f"config files missing from the wheel (pyproject's packages?): {expected - shipped}"
    assert not any(n.startswith("multiloss/configs/local/") and n.endswith(".yaml") for n in names)
    recipes = {p.name for p in (ROOT / "recipes").glob("*.py")}
    assert {n.removeprefix("multiloss/recipes/") for n in names if n.startswith("multiloss/recipes/")} == recipes
    (entry_points,) = [n for n in names if n.endswith("entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "multiloss-train = multiloss.cli:train_main" in text and "multiloss-eval = multiloss.cli:eval_main" in text


@pytest.mark.slow
def test_installed_commands_train_and_evaluate_from_an_empty_directory(wheel: Path, tmp_path: Path) -> None:
    # A fresh venv holding only the wheel; the dependencies are this environment's (no download),
    # on the path as a plain directory, so this checkout's editable install is not seen.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps", str(wheel)]
    subprocess.run(pip, check=True, capture_output=True)
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    Path(site, "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    empty = tmp_path / "empty"
    (empty / "my_configs" / "trainer").mkdir(parents=True)
    # A user's own option beside the shipped ones (--config-dir), from outside any checkout.
    (empty / "my_configs" / "trainer" / "short.yaml").write_text("defaults:\n  - default\nmax_steps: 20\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONWARNINGS": "ignore"}

    def command(name: str, *args: str) -> subprocess.CompletedProcess:
        done = subprocess.run(
            [str(venv / "bin" / name), *args], cwd=empty, env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done

    where = subprocess.run(
        [str(python), "-c", "import multiloss, multiloss.recipes.gan as g; print(multiloss.__file__, g.__file__)"],
        cwd=empty,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert str(ROOT) not in where and site in where
    quiet = ("print_config=false", "~callbacks.progress_bar", "trainer.enable_progress_bar=false")
    train = command("multiloss-train", "--config-dir", "my_configs", "recipe=gan", "trainer=short", *quiet)
    (run_dir,) = (empty / "outputs" / "gan").iterdir()
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    assert ckpt.is_file() and f"outputs in {run_dir}" in train.stdout
    assert (run_dir / "train.log").is_file()
    # The run's config dir named again: a checkpoint adds none by itself (multiloss.saving.trust); the printed
    # command that trains on names it.
    assert "train on: multiloss-train --config-dir" in " ".join(train.stdout.split())
    evaluated = command(
        "multiloss-eval", "--config-dir", "my_configs", f"ckpt_path={ckpt}", "trainer.enable_progress_bar=false"
    )
    assert "val/modes" in evaluated.stdout and "val/loss/d" in evaluated.stdout
    (eval_dir,) = (empty / "outputs" / "eval" / "gan").iterdir()
    assert (eval_dir / "csv" / "version_0" / "metrics.csv").is_file() and (eval_dir / "eval.log").is_file()
    assert "recipe=gan" in (eval_dir / ".hydra" / "overrides.yaml").read_text()


def test_no_two_modules_import_each_other():
    """The library's import graph, every import counted (a function's own too): no module imports one that
    imports it back; evaluation.py (evaluate) builds through training.py's builders (train's own)."""
    import ast

    root = Path(__file__).resolve().parents[1] / "src"
    modules = {
        ".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
        for p in (root / "multiloss").rglob("*.py")
    }
    imports: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            found |= {t for t in targets if t in modules and t != name}
        imports[name] = found
    assert "multiloss.training" in imports["multiloss.evaluation"]  # evaluate builds through train's builders
    # A package's __init__ re-exports its submodules; a submodule importing a sibling through the
    # package is the same edge, so packages stand for their submodules here.
    mutual = sorted(
        (a, b)
        for a, targets in imports.items()
        for b in targets
        if a < b and a in imports.get(b, set()) and not (a.startswith(b + ".") or b.startswith(a + "."))
    )
    assert not mutual, mutual


# Known advisories on what pyproject admits: (package, advisory, affected releases, the first release without it).
# A later widening of a range that lets one of these back in fails `test_no_admitted_release_carries_a_known_advisory`.
ADVISORIES = (
    ("lightning", "GHSA-w37p-236h-pfx3 (compromised on the index: a payload at import)", "==2.6.2", "2.6.6"),
    ("lightning", "GHSA-w37p-236h-pfx3 (compromised on the index: a payload at import)", "==2.6.3", "2.6.6"),
    ("pytorch-lightning", "GHSA-w37p-236h-pfx3 (compromised on the index)", "==2.6.2", "2.6.6"),
    ("pytorch-lightning", "GHSA-w37p-236h-pfx3 (compromised on the index)", "==2.6.3", "2.6.6"),
    ("lightning", "GHSA-qqmf-gpg7-g8gw / CVE-2026-58659 (a checkpoint's _instantiator called)", "<2.6.6", "2.6.6"),
    ("pytorch-lightning", "GHSA-qqmf-gpg7-g8gw / CVE-2026-58659", "<2.6.6", "2.6.6"),
    ("torch", "GHSA-63cw-57p8-fm3p (the weights_only unpickler)", "<2.10", "2.10.0"),
    ("hydra-core", "no target policy before 1.3.8 (instantiate calls os.system & co.)", "<1.3.8", "1.3.8"),
    ("pillow", "PYSEC-2026-2253..2257 (decoders' overflows)", "<12.3", "12.3.0"),
)


def _releases_matching(affected: str) -> list[str]:
    """Every release number x.y.z (x one of the majors near the bound, y < 30, z < 15) that ``affected`` matches: a
    grid dense enough that a range admitting any affected release admits one of these."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    bound = Version(affected.lstrip("<=>!~"))
    grid = [
        f"{x}.{y}.{z}" for x in range(max(bound.major - 1, 0), bound.major + 2) for y in range(30) for z in range(15)
    ]
    return [v for v in grid if SpecifierSet(affected).contains(v)]


@pytest.mark.parametrize(("name", "advisory", "affected", "fixed"), ADVISORIES, ids=lambda v: str(v)[:40])
def test_no_admitted_release_carries_a_known_advisory(name, advisory, affected, fixed):
    """pyproject's ranges (what `pip install .` may choose) admit no release an advisory names, and admit its fix."""
    import tomllib
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = {canonicalize_name(r.name): r for r in map(Requirement, project["dependencies"])}
    admitted = requirements[canonicalize_name(name)].specifier
    bad = [v for v in _releases_matching(affected) if admitted.contains(v)]
    assert not bad, f"{name}{admitted} admits {bad[:5]}, affected by {advisory}"
    assert admitted.contains(fixed), f"{name}{admitted} refuses {fixed}, the release that fixes {advisory}"


def test_the_install_is_what_the_suite_passed_with():
    """This environment (what `make` installs) holds every package at the version constraints.txt pins: the versions
    this suite passes with, none of them one an advisory names."""
    import importlib.metadata

    from packaging.specifiers import SpecifierSet
    from packaging.utils import canonicalize_name

    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = version.strip()
    assert "torch" not in pins and "multiloss" not in pins  # torch's build is the user's TORCH_SPEC
    for name, advisory, affected, _ in ADVISORIES:
        pinned = pins.get(canonicalize_name(name))
        assert pinned is None or not SpecifierSet(affected).contains(pinned), (name, pinned, advisory)
    assert {"lightning", "hydra-core", "torchmetrics", "pip"} <= pins.keys()
    if not (Path(sys.prefix) / ".multiloss-installed").exists():
        pytest.skip(f"{sys.prefix} is not the environment `make` builds with constraints.txt")
    # Only the environment's own site-packages: setuptools puts its vendored copies (packaging, zipp, ...) on the path.
    site = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    installed = {canonicalize_name(d.metadata["Name"]): d.version for d in importlib.metadata.distributions(path=site)}
    differ = {name: (pin, installed.get(name)) for name, pin in pins.items() if installed.get(name) != pin}
    assert not differ, f"pinned vs installed: {differ}"


def test_every_directory_that_ships_is_a_listed_package():
    """setuptools ships a data dir not listed in ``packages`` with ~120 lines of warnings at every install (and may
    stop shipping it): each dir of the package, of the configs and of the recipes is listed."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    roots = {"multiloss": ROOT / "src/multiloss", "multiloss.configs": CONFIG_DIR}
    roots["multiloss.recipes"] = ROOT / "recipes"
    found = set()
    for name, root in roots.items():
        for path in [root, *root.rglob("*")]:
            shipped = [p for p in path.glob("*") if p.is_file() and p.suffix in (".py", ".yaml", ".pt")]
            if path.is_dir() and path.name != "__pycache__" and path.name != "local" and shipped:
                found.add(".".join([name, *path.relative_to(root).parts]))
    assert found - listed == set(), "pyproject's [tool.setuptools] packages lacks these"
