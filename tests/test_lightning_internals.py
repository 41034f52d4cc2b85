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


def _torch_private_attributes() -> set[str]:
    """The private attributes torch's modules, optimizers, schedulers and grad scaler give their instances."""
    from torch.amp import grad_scaler
    from torch.nn.modules import module
    from torch.optim import lr_scheduler, optimizer

    pattern = re.compile(r"self\.(_[a-zA-Z]\w*)\s*[:=]")
    names: set[str] = set()
    for source in (module, optimizer, lr_scheduler, grad_scaler):
        names |= {n for n in pattern.findall(Path(source.__file__).read_text(encoding="utf-8")) if n[-1] != "_"}
    return names


def _is_torch(node: ast.AST) -> bool:
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name) and node.id == "torch"


def test_no_private_torch_name_nor_private_name_in_a_string_outside_the_one_module():
    # torch's private functions (torch._foreach_norm) and instance attributes (Module._compiled_call_impl, a
    # scheduler's _step_count), and any private Lightning or torch name written as a string ("_current_fx_name", a
    # scheduler state's "_last_lr"): all behind the door, where check_internals verifies them.
    torch_private = _torch_private_attributes()
    private = (_lightning_private_names() | torch_private) - set(dir(torch.nn.Module))
    found = []
    for path in SOURCES:
        if path == DOOR:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        affixes = {  # "_step" in name.endswith("_step") is a part of names, not a name
            id(arg)
            for call in ast.walk(tree)
            if isinstance(call, ast.Call) and getattr(call.func, "attr", "") in ("startswith", "endswith")
            for arg in call.args
        }
        for node in ast.walk(tree):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                if _is_torch(node.value) or node.attr in torch_private - set(dir(torch.nn.Module)):
                    found.append(f"{where} .{node.attr}")
            elif isinstance(node, ast.Constant) and node.value in private and id(node) not in affixes:
                found.append(f"{where} {node.value!r}")
    assert not found, "private torch or Lightning names outside multiloss/lightning_internals.py:\n" + "\n".join(found)
