"""Config schema, validation and the errors a user's mistakes turn into."""

from multiloss.config.errors import ConfigError, require, require_options
from multiloss.config.schema import register as register_schema
from multiloss.config.validate import check_config

__all__ = ["ConfigError", "check_config", "register_schema", "require", "require_options"]
