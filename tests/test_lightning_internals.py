"""Lightning's private API is used in one module only, and every name it reads is in the installed Lightning.

A Lightning upgrade that moves a private name fails `test_every_private_lightning_name_multiloss_uses_is_there`
with the name; a change that reaches for one outside `multiloss.lightning_internals` fails the source scan.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import lightning
import torch

from multiloss.lightning_internals import check_internals

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [*(ROOT / "src" / "multiloss").rglob("*.py"), *(ROOT / "recipes").glob("*.py")]
DOOR = ROOT / "src" / "multiloss" / "lightning_internals.py"


def test_every_private_lightning_name_multiloss_uses_is_there():
    missing = check_internals()
    assert not missing, f"Lightning {lightning.__version__} no longer has: {', '.join(missing)}"


def _lightning_private_names() -> set[str]:
    """Every single-underscore name Lightning's own source defines or assigns (functions, classes, attributes)."""
    pattern = re.compile(r"(?:def |class |self\.|^)(_[a-zA-Z]\w*)\s*[(:=]", re.MULTILINE)
    names: set[str] = set()
    for path in Path(lightning.__file__).parent.rglob("*.py"):
        names |= {n for n in pattern.findall(path.read_text(encoding="utf-8")) if not n.startswith("__")}
    return names


def test_no_private_lightning_name_outside_the_one_module():
    # nn.Module's extension points (``_load_from_state_dict``) are torch's to override, not Lightning's.
    private = _lightning_private_names() - set(dir(torch.nn.Module))
    found = []
    for path in SOURCES:
        if path == DOOR:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightning"):
                found += [f"{path.name}:{node.lineno} imports {a.name}" for a in node.names if a.name.startswith("_")]
                if any(part.startswith("_") for part in (node.module or "").split(".")):
                    found.append(f"{path.name}:{node.lineno} imports from {node.module}")
            elif isinstance(node, ast.Attribute) and node.attr in private:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
    assert not found, "private Lightning names outside multiloss/lightning_internals.py:\n" + "\n".join(found)
