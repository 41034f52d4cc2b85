"""What a run prints and saves about its own configuration."""

from __future__ import annotations

from pathlib import Path

import rich
import rich.syntax
import rich.tree
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from multiloss.config.schema import COMPONENT_GROUPS

_FIRST = ("data", "model", "trainer", "callbacks", "logger", "paths")


def _shown_keys(cfg: DictConfig) -> list[str]:
    # The schema's top-level placeholders for misplaced component options are empty in every valid
    # config: not shown, not saved.
    return [str(k) for k in cfg if not (k in COMPONENT_GROUPS and cfg._get_node(k)._is_none())]


@rank_zero_only
def print_config_tree(cfg: DictConfig) -> None:
    """The composed config as a rich tree, one branch per top-level section."""
    tree = rich.tree.Tree("config", style="dim", guide_style="dim")
    keys = _shown_keys(cfg)
    order = [k for k in _FIRST if k in keys] + [k for k in keys if k not in _FIRST]
    for key in order:
        branch = tree.add(str(key), style="bold")
        node = cfg._get_node(key)
        text = OmegaConf.to_yaml(node, resolve=True) if isinstance(node, DictConfig) else repr(cfg[key])
        branch.add(rich.syntax.Syntax(text, "yaml", theme="ansi_dark", background_color="default"))
    rich.print(tree)


@rank_zero_only
def save_run_config(cfg: DictConfig, output_dir: str | Path) -> None:
    """Hydra's ``.hydra/`` copies (config, hydra, overrides), written only once the config is valid.

    Hydra would write them before the task starts (``hydra.output_subdir``), which would overwrite
    an earlier run's copies even when this run's config is then rejected; ``configs/hydra`` turns
    that off and `train` calls this after validation instead.
    """
    out = Path(output_dir) / ".hydra"
    out.mkdir(parents=True, exist_ok=True)
    container = OmegaConf.to_container(cfg, resolve=False)
    OmegaConf.save(OmegaConf.create({k: container[k] for k in _shown_keys(cfg)}), out / "config.yaml")
    if HydraConfig.initialized():
        hydra_cfg = HydraConfig.get()
        OmegaConf.save(OmegaConf.create({"hydra": hydra_cfg}), out / "hydra.yaml")
        OmegaConf.save(hydra_cfg.overrides.task, out / "overrides.yaml")
