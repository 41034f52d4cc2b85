"""``python train.py --help``: the recipe list, read from the recipes' own source.

Hydra's help template is an OmegaConf string, so a resolver registered here fills it in when Hydra
prints it. Each recipe's one-line description is the first line of the docstring of its class (the
recipe config's ``model._target_``), read from the module's source with `ast`, not imported: the
list cannot drift from the code, and ``--help`` never imports torch or Lightning.
"""

from __future__ import annotations

import ast
import importlib.util

from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf


def recipe_lines() -> str:
    repository = GlobalHydra.instance().config_loader().repository
    lines = []
    for name in sorted(repository.get_group_options("recipe")):
        target = ""
        try:
            target = str(repository.load_config(f"recipe/{name}").config.model._target_)
            doc = class_summary(target)
        except Exception as err:  # a broken recipe must not break --help
            doc = f"(cannot read {target or f'recipe/{name}'}: {err})"
        lines.append(f"  {name:<13} {doc}\n  {'':<13} python train.py recipe={name}")
    return "\n".join(lines)


def class_summary(target: str) -> str:
    """The first line of the docstring of class ``module.Class``, from the module's source file."""
    module, _, cls = target.rpartition(".")
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ImportError(f"no module {module!r}")
    with open(spec.origin, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return (ast.get_docstring(node) or "").strip().splitlines()[0]
    raise ImportError(f"no class {cls!r} in {spec.origin}")


def register() -> None:
    if not OmegaConf.has_resolver("multiloss_recipes"):
        OmegaConf.register_new_resolver("multiloss_recipes", recipe_lines)
