"""The one exception a user's configuration mistake turns into."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A setting the run cannot accept: names the dotted key, the value and what would be accepted.

    Raised before training starts; `python train.py` prints the message alone (no traceback) and
    exits non-zero. Recipes raise it with a key relative to their own config node (``n_critic``);
    ``train`` re-raises it under the node's name (``model.n_critic``).
    """

    def __init__(self, key: str, value: Any, accepted: str, problem: str | None = None) -> None:
        self.key, self.value, self.accepted, self.problem = key, value, accepted, problem
        super().__init__(self.message)

    @property
    def message(self) -> str:
        shown = self.value if isinstance(self.value, str) and self.key.endswith("_target_") else repr(self.value)
        head = f"{self.key}={shown}"
        if self.problem:
            head += f": {self.problem}"
        return f"{head}\n  accepted: {self.accepted}"

    def under(self, prefix: str) -> ConfigError:
        """The same error, with its key moved under ``prefix`` (``n_critic`` -> ``model.n_critic``)."""
        key = f"{prefix}.{self.key}" if prefix and self.key else prefix or self.key
        return ConfigError(key, self.value, self.accepted, self.problem)


def require(ok: bool, key: str, value: Any, accepted: str, problem: str | None = None) -> None:
    """Raise `ConfigError` unless ``ok``; the one-line guard recipes and data modules use."""
    if not ok:
        raise ConfigError(key, value, accepted, problem)


def require_options(spec: Any, key: str, keys: tuple[str, ...]) -> None:
    """An options node (``model.g_ema``, ``model.fsdp``…): a mapping whose keys are among ``keys``; the first unknown
    one is the error's key (``g_ema.decy``)."""
    require(isinstance(spec, dict), key, spec, f"a mapping of {', '.join(keys)}, or null")
    unknown = sorted(set(spec) - set(keys))
    if unknown:
        raise ConfigError(f"{key}.{unknown[0]}", spec[unknown[0]], f"{key}'s keys: {', '.join(keys)}", "unknown key")


def error_from_lightning(path: str, node: Any, err: Exception | str) -> ConfigError:
    """Lightning's own check failed: name the key its message is about, and pass its words on."""
    from omegaconf import OmegaConf

    text = str(err)
    keys = [str(k) for k in node if not str(k).startswith("_") and str(k) in text]
    key = min(keys, key=lambda k: (text.find(k), -len(k))) if keys else None  # the first named, most specific
    return ConfigError(
        f"{path}.{key}" if key else path,
        node[key] if key else OmegaConf.to_container(node),
        text,
        "rejected by Lightning",
    )


# How torch's optimizers name their arguments in their error messages.
_OPTIMIZER_ALIASES = {"lr": "learning rate", "eps": "epsilon", "betas": "beta"}


def optimizer_rejection(key: str, spec: Any, text: str) -> ConfigError:
    """The optimizer configured at ``key`` refused a value (torch's own check, ``text``): the argument it names."""
    named = [k for k in spec if not k.startswith("_") and (k in text or _OPTIMIZER_ALIASES.get(k, "\0") in text)]
    arg = named[0] if named else None
    return ConfigError(
        f"{key}.{arg}" if arg else key,
        spec.get(arg) if arg else spec["_target_"],
        f"a value {spec['_target_']} accepts ({text})",
        "rejected by the optimizer",
    )
