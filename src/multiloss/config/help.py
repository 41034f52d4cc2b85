"""``python train.py --help``: the recipe list, read from the recipes themselves.

Hydra's help template is an OmegaConf string, so a resolver registered here fills it in when Hydra
prints it. Each recipe's one-line description is the first line of its module's class docstring
(the recipe config's ``model._target_``), so the list cannot drift from the code.
"""

from __future__ import annotations

from hydra.core.global_hydra import GlobalHydra
from hydra.types import RunMode
from hydra.utils import get_object
from omegaconf import OmegaConf


def recipe_lines() -> str:
    loader = GlobalHydra.instance().config_loader()
    lines = []
    for name in loader.get_group_options("recipe"):
        target = _model_target(loader, name)
        try:
            doc = (get_object(target).__doc__ or "").strip().splitlines()[0]
        except Exception as err:  # a broken recipe must not break --help
            doc = f"(cannot import {target}: {err})"
        lines.append(f"  {name:<13} {doc}\n  {'':<13} python train.py recipe={name}")
    return "\n".join(lines)


def _model_target(loader, name: str) -> str:
    result = loader.load_configuration("train", overrides=[f"recipe={name}"], run_mode=RunMode.RUN, from_shell=False)
    return str(result.model._target_)


def register() -> None:
    if not OmegaConf.has_resolver("multiloss_recipes"):
        OmegaConf.register_new_resolver("multiloss_recipes", recipe_lines)
