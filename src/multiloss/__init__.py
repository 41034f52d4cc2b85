"""multiloss: Lightning + Hydra training recipes for steps with more than one loss or backward pass."""

from typing import Any

from multiloss.config import ConfigError, register_schema
from multiloss.config.help import register as _register_help
from multiloss.config.resolvers import register as _register_resolvers

# Hydra needs these before it composes `configs/train.yaml`: the typed top-level schema, the
# resolver that fills `--help` with the recipe list, and the run-dir stamp. None imports torch or
# Lightning, so `python train.py --help` answers without them.
register_schema()
_register_help()
_register_resolvers()

__all__ = ["ConfigError", "train"]


def __getattr__(name: str) -> Any:
    if name == "train":  # imported on first use: it brings torch and Lightning
        from multiloss.training import train

        return train
    raise AttributeError(f"module 'multiloss' has no attribute {name!r}")
