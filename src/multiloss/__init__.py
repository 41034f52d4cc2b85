"""multiloss: Lightning + Hydra training recipes for steps with more than one loss or backward pass."""

from multiloss.config import ConfigError, register_schema
from multiloss.config.help import register as _register_help
from multiloss.training import train

# Hydra needs both before it composes `configs/train.yaml`: the typed top-level schema and the
# resolver that fills `--help` with the recipe list.
register_schema()
_register_help()

__all__ = ["ConfigError", "train"]
