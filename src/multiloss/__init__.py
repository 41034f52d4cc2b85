"""multiloss: Lightning + Hydra training recipes for steps with more than one loss or backward pass."""

from multiloss.config import ConfigError, register_schema
from multiloss.config.help import register as _register_help
from multiloss.config.resolvers import register as _register_resolvers
from multiloss.training import train

# Hydra needs these before it composes `configs/train.yaml`: the typed top-level schema, the
# resolver that fills `--help` with the recipe list, and the run-dir stamp.
register_schema()
_register_help()
_register_resolvers()

__all__ = ["ConfigError", "train"]
