"""Hydra's own composition errors as multiloss's one message: the key, the value, the nearest valid names.

Hydra reports a misspelled group option with the whole search path and a pointer to ``HYDRA_FULL_ERROR``, a
misspelled key without ``+`` with "To append to your config use +...", a wrong type with OmegaConf's object
dump. `explained` turns each into a `ConfigError` like every other mistake of a config: a misspelled key is
composed again as an addition, so the key is judged as any other (its target's arguments, "did you mean").
"""

from __future__ import annotations

import contextlib
import difflib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hydra.errors import ConfigCompositionException, HydraException, MissingConfigException, OverrideParseException
from omegaconf.errors import OmegaConfBaseException

from multiloss.config.errors import ConfigError

CONFIG_MODULE = "multiloss.configs"
# Command-line flags of Hydra's that take a value (the rest of a command line is overrides).
_FLAGS_WITH_VALUE = ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd", "--info", "-i")


@contextlib.contextmanager
def hydra_errors_raised() -> Iterator[None]:
    """Hydra raises its composition errors (``HYDRA_FULL_ERROR=1``) in the block instead of printing them, unless the
    user set ``HYDRA_FULL_ERROR`` (then Hydra does as it is told). The task restores the setting first thing
    (`restore_full_error`), so that errors inside a run, and the ranks it starts, see the user's own."""
    if user_wants_hydras_report():
        yield
        return
    os.environ[_SAVED] = os.environ.get("HYDRA_FULL_ERROR", _UNSET)
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        yield
    finally:
        restore_full_error()


_SAVED, _UNSET = "MULTILOSS_USERS_HYDRA_FULL_ERROR", "<unset>"


def user_wants_hydras_report() -> bool:
    """``HYDRA_FULL_ERROR=1`` set by the user (not by `hydra_errors_raised`): Hydra's own traceback, as asked."""
    return os.environ.get("HYDRA_FULL_ERROR") == "1" and _SAVED not in os.environ


def restore_full_error() -> None:
    saved = os.environ.pop(_SAVED, None)
    if saved == _UNSET:
        os.environ.pop("HYDRA_FULL_ERROR", None)
    elif saved is not None:
        os.environ["HYDRA_FULL_ERROR"] = saved


def explained(error: BaseException, argv: list[str], config_name: str) -> ConfigError | None:
    """The `ConfigError` a Hydra composition error stands for (None: not one of those)."""
    if isinstance(error, MissingConfigException) and error.missing_cfg_file and error.options is not None:
        group, _, name = str(error.missing_cfg_file).rpartition("/")
        options = sorted(error.options)
        close = difflib.get_close_matches(name, options, n=3)
        hint = f"did you mean {' or '.join(close)}? " if close else ""
        return ConfigError(
            group or "config",
            name,
            f"{hint}the options of {group}: {', '.join(options)} (or one of yours, with --config-dir)",
            f"no config {error.missing_cfg_file}.yaml in the config path",
        )
    if isinstance(error, OverrideParseException):
        key, _, value = error.override.partition("=")
        return ConfigError(
            key.lstrip("+~") or error.override,
            value,
            "a value in Hydra's override grammar: quote one with brackets, commas or spaces, e.g. "
            f"'{key}=\"{value}\"' (https://hydra.cc/docs/advanced/override_grammar/basic/)",
            f"Hydra cannot parse it ({str(error.message).splitlines()[0]})",
        )
    if isinstance(error, ConfigCompositionException) and isinstance(error.__cause__, OmegaConfBaseException):
        return _override_error(str(error), error.__cause__, argv, config_name)
    return None


def _override_error(message: str, cause: Any, argv: list[str], config_name: str) -> ConfigError | None:
    line = message.splitlines()[0]
    if line.startswith("Could not override '"):
        key = line[len("Could not override '") :].rstrip(".").rstrip("'")
        override = next((o for o in overrides(argv) if o.split("=", 1)[0] == key), None)
        if override is not None:
            judged = _judged_as_added(override, argv, config_name)
            if judged is not None:
                return judged
        value = override.split("=", 1)[1] if override else None
        return ConfigError(key, value, f"a key of the config, or +{key}=<value> to add one", "no such key")
    if line.startswith("Error merging override "):
        override = line[len("Error merging override ") :]
        key, _, value = override.partition("=")
        key = getattr(cause, "full_key", None) or key.lstrip("+~")
        expected = _schema_type(str(key))
        accepted = expected or str(getattr(cause, "msg", cause)).splitlines()[0]
        return ConfigError(str(key), value, accepted, "wrong type" if expected else "rejected by the config schema")
    return None


def _schema_type(key: str) -> str | None:
    """The type the top-level schema (`multiloss.config.schema.TrainSchema`) declares for ``key``, described."""
    import dataclasses
    import typing

    from multiloss.config.schema import TrainSchema
    from multiloss.config.validate import describe

    if "." in key or key not in {f.name for f in dataclasses.fields(TrainSchema)}:
        return None
    return describe(typing.get_type_hints(TrainSchema)[key])


def _judged_as_added(override: str, argv: list[str], config_name: str) -> ConfigError | None:
    """``key=value`` for a key the config does not hold, composed again as ``+key=value`` and checked like any key
    (the component's arguments, "did you mean"); the message that the key is not in the config where it is one."""
    from hydra import compose, initialize_config_module
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from multiloss.config.validate import check_config

    key, _, value = override.partition("=")
    others = [o for o in overrides(argv) if o != override]
    extra = [f"hydra.searchpath=[file://{Path(d).resolve()}]" for d in config_dirs(argv)]
    try:
        with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
            cfg = compose(
                config_name_in(argv, config_name),
                overrides=[*extra, *others, f"+{override}"],
                return_hydra_config=True,
            )
        with open_dict(cfg):
            cfg.hydra.runtime.output_dir = str(Path.cwd() / "outputs")  # a path, never made: nothing is written
        HydraConfig.instance().set_config(cfg)  # ${hydra:...} resolves as in the run
        with open_dict(cfg):
            del cfg.hydra
        check_config(cfg, early=True)
    except ConfigError as err:
        # model.net.x of an option file that landed at the top level (its package line not first): say that.
        return err if err.key in (key, key.split(".")[1] if key.startswith("model.") else None) else None
    except (HydraException, OmegaConfBaseException, ValueError):
        return None
    return ConfigError(
        key,
        value,
        f"+{override}: the key is valid, and not in the composed config, so Hydra adds it only with a +",
        "not in the config",
    )


def overrides(argv: list[str]) -> list[str]:
    """The overrides of a command line (its Hydra flags and their values left out)."""
    return _split(argv)[1]


def flags(argv: list[str]) -> list[str]:
    """The Hydra flags of a command line, each with its value (``--config-dir my_configs``), in their order."""
    return _split(argv)[0]


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    found_flags: list[str] = []
    found: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            found_flags.append(arg)
            continue
        if arg.startswith("-"):
            skip = arg in _FLAGS_WITH_VALUE
            found_flags.append(arg)
            continue
        found.append(arg)
    return found_flags, found


def _flag_values(argv: list[str], names: tuple[str, ...]) -> list[str]:
    values = []
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name in names:
            values.append(value if eq else (argv[i + 1] if i + 1 < len(argv) else ""))
    return [v for v in values if v]


def config_dirs(argv: list[str]) -> list[str]:
    return _flag_values(argv, ("--config-dir", "-cd"))


def config_name_in(argv: list[str], default: str) -> str:
    names = _flag_values(argv, ("--config-name", "-cn"))
    return names[-1] if names else default


def check_no_shadowed_option(hydra_config: Any) -> None:
    """Refuse a composed run that picks an option of which a config dir of the user's holds one of the same group and
    name as a shipped one: Hydra takes the shipped file (its primary config path comes first) and ignores the user's
    without a word (say the project begins shipping ``discriminator/dcgan.yaml`` where the user had their own D).

    ``hydra_config``: the composed run's ``HydraConfig`` (its config sources and the choices made).
    """
    import multiloss.configs

    shipped = Path(next(iter(multiloss.configs.__path__)))
    theirs = [
        Path(source.path)
        for source in hydra_config.runtime.config_sources
        if source.schema == "file" and source.provider != "main"
    ]
    if not theirs:
        return
    for group, choice in hydra_config.runtime.choices.items():
        if not isinstance(choice, str) or group.startswith("hydra/"):
            continue
        for name in (n.strip() for n in choice.strip("[]").split(",")):
            option = Path(group) / f"{name}.yaml"
            mine = [d / option for d in theirs if (d / option).is_file()]
            if mine and (shipped / option).is_file():
                raise ConfigError(
                    group.replace("/", "."),
                    name,
                    f"one option of that name: to use yours, rename it (e.g. {mine[0].with_name(f'my_{name}.yaml')}, "
                    f"then {group}=my_{name}); to use the shipped one, move yours out of {mine[0].parent.parent}",
                    f"two options of that name: the shipped {shipped / option}, which Hydra would take, and yours, "
                    f"{mine[0]}, which it would ignore without a word",
                )
