"""Where the modules of earlier layouts live now: the dotted names a user's YAML or a kept checkpoint may still carry,
mapped where a config or a checkpoint is read — not by an import hook.

Users' YAML (``_target_: multiloss.fsdp.FSDPStrategy``), the hyper-parameters of checkpoints written before
(``multiloss.schedules.LinearDecay``, ``multiloss.dense_tasks.depth_loss``) name modules that moved into packages by
concern. `rename_targets` rewrites every such name in a composed config (`multiloss.cli`, `multiloss.train`) and in a
checkpoint's hyper-parameters (`multiloss.base.module.Recipe.load_from_checkpoint`) to its module's current place,
before anything imports it; `current_name` answers for one name. An old ``from multiloss.module import …`` in a
user's own code no longer imports (a 0.x interface change, said in the README). Imports nothing heavy.
"""

from __future__ import annotations

from typing import Any

# old module -> new module
MOVED = {
    "multiloss.digit_features": "multiloss.gan.digit_features",
    "multiloss.gan_augment": "multiloss.gan.augment",
    "multiloss.gan_metrics": "multiloss.gan.metrics",
    "multiloss.gan_objectives": "multiloss.gan.objectives",
    "multiloss.generator_ema": "multiloss.gan.ema",
    "multiloss.distributed": "multiloss.parallel.ddp",
    "multiloss.fsdp": "multiloss.parallel.fsdp",
    "multiloss.parallelism": "multiloss.parallel.parallelism",
    "multiloss.sharding": "multiloss.parallel.sharding",
    "multiloss.stalls": "multiloss.parallel.stalls",
    "multiloss.torchrun": "multiloss.parallel.rendezvous",
    "multiloss.rendezvous": "multiloss.parallel.rendezvous",
    "multiloss.early_ranks": "multiloss.parallel.early_ranks",
    "multiloss.child_command": "multiloss.parallel.child_command",
    "multiloss.checkpoints": "multiloss.saving.checkpoints",
    "multiloss.history": "multiloss.saving.history",
    "multiloss.run_dir": "multiloss.saving.run_dir",
    "multiloss.run_log": "multiloss.saving.run_log",
    "multiloss.saved_state": "multiloss.saving.saved_state",
    "multiloss.learning_rate": "multiloss.base.learning_rate",
    "multiloss.lr_scaling": "multiloss.base.lr_scaling",
    "multiloss.module": "multiloss.base.module",
    "multiloss.multitask": "multiloss.base.multitask",
    "multiloss.precision": "multiloss.base.precision",
    "multiloss.recipe_logging": "multiloss.base.logging",
    "multiloss.recipe_optimizers": "multiloss.base.optimizers",
    "multiloss.schedules": "multiloss.base.schedules",
    "multiloss.step": "multiloss.base.step",
    "multiloss.training_log": "multiloss.base.training_log",
    "multiloss.min_norm": "multiloss.balancers.min_norm",
}

# 0.x (the top level by concern): the multi-task parts together, one place that builds a run, callbacks in callbacks/.
MOVED.update(
    {
        "multiloss.tasks": "multiloss.multitask.tasks",
        "multiloss.dense_tasks": "multiloss.multitask.dense",
        "multiloss.base.multitask": "multiloss.multitask.recipe",
        "multiloss.metrics": "multiloss.base.metrics",
        "multiloss.components": "multiloss.building.components",
        "multiloss.component_check": "multiloss.building.checks",
        "multiloss.builders": "multiloss.training",
        "multiloss.batches": "multiloss.data.batches",
        "multiloss.lean_callback": "multiloss.callbacks.lean",
        "multiloss.quiet": "multiloss.console.noise",
        "multiloss.sweep_summary": "multiloss.console.sweep_summary",
    }
)


def current_name(dotted: str) -> str:
    """A class or function's dotted name (``multiloss.schedules.Constant``) at its module's current place; any other
    string as it is. Only the module part is matched, whole: ``multiloss.multitask.tasks.x`` is not the old
    ``multiloss.multitask`` module's."""
    module, _, name = dotted.rpartition(".")
    seen = 0
    while module in MOVED and seen < 3:  # an old name's new place may itself have moved since
        module, seen = MOVED[module], seen + 1
    return f"{module}.{name}" if seen else dotted


def rename_targets(tree: Any) -> Any:
    """``tree`` (a config node, or plain dicts and lists) with every string that names a moved module's class or
    function at its current place: containers changed in place, and returned."""
    from omegaconf import DictConfig, ListConfig, open_dict

    if isinstance(tree, str):
        return current_name(tree) if tree.startswith("multiloss.") else tree
    if isinstance(tree, DictConfig | ListConfig):
        keys = list(tree.keys()) if isinstance(tree, DictConfig) else list(range(len(tree)))
        with open_dict(tree) if isinstance(tree, DictConfig) else _nothing():
            for key in keys:
                node = tree._get_node(key)
                if node is None or node._is_missing() or node._is_interpolation():
                    continue  # an interpolation names another key, renamed there
                value = tree[key]
                if isinstance(value, str):
                    if (renamed := rename_targets(value)) != value:
                        tree[key] = renamed
                else:
                    rename_targets(value)
        return tree
    if isinstance(tree, dict | list):
        for key in list(tree) if isinstance(tree, dict) else range(len(tree)):
            tree[key] = rename_targets(tree[key])
    return tree


def _nothing() -> Any:
    import contextlib

    return contextlib.nullcontext()
