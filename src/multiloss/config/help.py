"""``python train.py --help``: the recipe list, read from the recipes' own source.

Hydra's help template is an OmegaConf string, so a resolver registered here fills it in when Hydra
prints it. Each recipe's one-line description is the first line of the docstring of its class (the
recipe config's ``model._target_``), read from the module's source with `ast`, not imported: the
list cannot drift from the code, and ``--help`` never imports torch or Lightning.
"""

from __future__ import annotations

import ast
import importlib.util
from typing import Any

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


def config_groups(hydra_groups: bool = False) -> str:
    """Every config group (Hydra's own, or all others) with its options, one ``group: a, b`` line each: what Hydra's
    ``$APP_CONFIG_GROUPS`` (``$HYDRA_CONFIG_GROUPS``) lists, read from one config repository (Hydra's own listing
    builds a copy of the repository for each group it asks about: a second of ``--help`` spent copying).
    """
    from hydra.core.object_type import ObjectType

    repository = GlobalHydra.instance().config_loader().repository

    def groups(parent: str) -> list[str]:
        found = []
        for name in repository.get_group_options(parent, ObjectType.GROUP):
            group = f"{parent}/{name}" if parent else name
            if repository.get_group_options(group, ObjectType.CONFIG):
                found.append(group)
            found.extend(groups(group))
        return found

    def is_hydras(group: str) -> bool:
        return group == "hydra" or group.startswith("hydra/")

    return "".join(
        f"{group}: {', '.join(sorted(repository.get_group_options(group, ObjectType.CONFIG)))}\n"
        for group in sorted(set(groups("")))
        if is_hydras(group) == hydra_groups
    )


def print_help(argv: list[str], config_name: str) -> None:
    """``--help``: the config's ``hydra.help.template``, as Hydra renders it (its ``$APP_CONFIG_GROUPS``,
    ``$HYDRA_CONFIG_GROUPS``, ``$FLAGS_HELP`` and ``$CONFIG`` filled in), without Hydra's copies of the repository."""
    import string
    from pathlib import Path

    from hydra import compose, initialize_config_module
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import get_args_parser
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from multiloss.config.composition import CONFIG_MODULE, config_dirs, config_name_in, overrides

    extra = [f"hydra.searchpath=[file://{Path(d).resolve()}]" for d in config_dirs(argv)]
    with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        cfg = compose(config_name_in(argv, config_name), overrides=[*extra, *overrides(argv)], return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
        template = str(cfg.hydra.help.template)
        fields = {
            "APP_CONFIG_GROUPS": lambda: config_groups(),
            "HYDRA_CONFIG_GROUPS": lambda: config_groups(hydra_groups=True),
            "FLAGS_HELP": lambda: Hydra.format_args_help(get_args_parser()),
            "CONFIG": lambda: _without_hydra(cfg, open_dict, resolve="--resolve" in argv),
        }
        values = {name: make() for name, make in fields.items() if f"${name}" in template or f"${{{name}}}" in template}
    print(string.Template(template).safe_substitute(values))


def _without_hydra(cfg: Any, open_dict: Any, resolve: bool) -> str:
    import copy

    clean = copy.deepcopy(cfg)
    with open_dict(clean):
        del clean["hydra"]
    return OmegaConf.to_yaml(clean, resolve=resolve)


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
