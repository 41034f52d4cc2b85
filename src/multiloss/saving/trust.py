"""What a checkpoint may make the program do: it is data, and the code it names is the shipped configs' or yours.

Checkpoints travel: a colleague's ``last.ckpt``, a model shared with a paper, a file pulled from a bucket. Loading one
with ``torch.load(weights_only=True)`` runs no code of its own; but a run rebuilt from what it says would, through
every ``_target_`` Hydra imports and calls. So whatever a checkpoint carries that becomes configuration — its run's
overrides and config dirs (``train.py ckpt_path=``, ``multiloss-eval``), its hyper-parameters
(``Recipe.load_from_checkpoint``), a sharded checkpoint's ``meta.pt`` and ``.metadata`` — passes here first, before
anything is imported, composed or written:

- a ``_target_`` it carries is one the shipped configs use (`shipped_targets`; an earlier module path of one too,
  `multiloss.config.renamed`), one this command line writes itself, or one a config dir this command line names defines;
- a config dir it names is used only when this command line names it too (its option files are code as much as data);
- an override value that builds config from a string at resolution time (a resolver other than a reference, ``oc.env``,
  ``oc.select``, ``oc.dict.*`` and multiloss's own) is refused: it could hide a ``_target_`` from this check;
- Lightning's own ``_instantiator`` and ``_class_path`` hyper-parameters are refused whatever Lightning is installed
  (2.6.5 and earlier imported and called them: GHSA-qqmf-gpg7-g8gw);
- a sharded checkpoint's ``.metadata``, which torch's DCP reads with a bare ``pickle.load``, is unpickled here first
  with only DCP's metadata classes allowed (`read_sharded_metadata`).

``trust_checkpoint=true`` (a checkpoint you would run as code) lifts the first three; ``trust_checkpoint=[mypkg]``
allows the targets under the named packages. The Hydra keys (``hydra.*``, its callbacks and launcher) never come from
a checkpoint at all (`multiloss.saving.run_dir`), nor do the keys that only say where a run writes (``paths.*``, a
``dirpath``, ``save_dir`` or ``default_root_dir``: a resumed run writes below the run dir its own command names). What
stays data and is not policed: the other arguments of allowed targets; read the overrides the run prints before it
continues ("continuing with the checkpoint's run's overrides").
"""

from __future__ import annotations

import functools
import io
import pickle
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from multiloss.config.errors import ConfigError

TRUST_KEY = "trust_checkpoint"
LIGHTNING_INSTANTIATORS = ("_instantiator", "_class_path")
# Resolvers a carried value may use: they read config keys or the environment, never build nodes from a string.
_SAFE_RESOLVERS = re.compile(r"^(oc\.env|oc\.select|oc\.dict\.keys|oc\.dict\.values|hydra|multiloss_[a-z_]+)$")
_RESOLVER_CALL = re.compile(r"\$\{\s*([A-Za-z_][\w.]*)\s*:")
_HOW = (
    "a _target_ the shipped configs use, or one you allow: write it on the command line yourself, name the config dir "
    "that defines it (--config-dir <dir>), trust_checkpoint=[<its package>], or trust_checkpoint=true for a "
    "checkpoint you would run as code"
)


@functools.cache
def shipped_targets() -> frozenset[str]:
    """Every ``_target_`` the shipped configs (``multiloss.configs``) name."""
    import multiloss.configs

    return frozenset(_targets_in_files(Path(next(iter(multiloss.configs.__path__))).rglob("*.yaml")))


def _targets_in_files(files: Iterable[Path]) -> Iterator[str]:
    import yaml

    for file in files:
        try:
            tree = yaml.safe_load(file.read_text())
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            continue  # Hydra says what is wrong with it, if it is ever used
        yield from (target for _, target in targets_in(tree) if isinstance(target, str))


def targets_in(tree: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted key, value)`` of every ``_target_`` (and Lightning's instantiator keys) in a plain tree."""
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            here = f"{path}.{key}" if path else str(key)
            if key == "_target_" or key in LIGHTNING_INSTANTIATORS:
                yield here, value
            else:
                yield from targets_in(value, here)
    elif isinstance(tree, list | tuple):
        for i, value in enumerate(tree):
            yield from targets_in(value, f"{path}[{i}]")


def _canonical(target: str) -> str:
    """``target`` at its module's current place (`multiloss.config.renamed`: the paths of earlier layouts)."""
    from multiloss.config.renamed import current_name

    return current_name(target)


class Allowed:
    """The targets a checkpoint may name in this command: shipped, yours (named here), or trusted."""

    def __init__(self, trust: Any = False, yours: Iterable[str] = (), config_dirs: Iterable[Path] = ()) -> None:
        self.everything = trust is True
        self.packages = tuple(str(p) for p in trust) if isinstance(trust, list | tuple) else ()
        self.yours = set(yours) | set(_targets_in_files(f for d in config_dirs for f in Path(d).rglob("*.yaml")))

    def __contains__(self, target: object) -> bool:
        if self.everything:
            return True
        if not isinstance(target, str):
            return False
        canonical = _canonical(target)
        if canonical in shipped_targets() or target in self.yours or canonical in self.yours:
            return True
        return any(target == p or target.startswith(p + ".") for p in self.packages)

    def check_tree(self, tree: Any, where: str, key: str = "") -> None:
        """Refuse the first target in ``tree`` (found under the dotted ``key``) this command does not allow."""
        for path, target in targets_in(tree, key):
            if path.rpartition(".")[2] in LIGHTNING_INSTANTIATORS:
                raise ConfigError(
                    path,
                    target,
                    "hyper-parameters that name components by _target_ (what multiloss saves)",
                    f"{where}: Lightning would import and call it on load (GHSA-qqmf-gpg7-g8gw), refused whatever "
                    "Lightning is installed and whatever is trusted",
                )
            if target not in self:
                raise ConfigError(path, target, _HOW, f"it comes only from {where}, and a checkpoint is data")

    def check_value(self, value: Any, where: str, key: str) -> None:
        """Refuse a carried override's value that names a target not allowed, or builds config from a string."""
        if key.rpartition(".")[2] == "_target_":
            if value not in self:
                raise ConfigError(key, value, _HOW, f"it comes only from {where}, and a checkpoint is data")
            return
        self.check_tree(value, where, key)
        if self.everything:
            return
        for text in _strings_in(value):
            for resolver in _RESOLVER_CALL.findall(text):
                if not _SAFE_RESOLVERS.match(resolver):
                    raise ConfigError(
                        key,
                        text,
                        "a value, a reference (${key}), or the resolvers oc.env, oc.select, oc.dict.*; or "
                        "trust_checkpoint=true for a checkpoint you would run as code",
                        f"it comes only from {where}, and ${{{resolver}:...}} builds config from a string at run time "
                        "(a _target_ this check cannot see)",
                    )


def _strings_in(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from _strings_in(k)
            yield from _strings_in(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _strings_in(v)


def trust_of(args: Sequence[str]) -> Any:
    """What ``trust_checkpoint=`` on the command line ``args`` says: False, True, or a list of package names."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    given = [a for a in args if a.split("=")[0].lstrip("+") == TRUST_KEY]
    if not given:
        return False
    (override,) = OverridesParser.create().parse_overrides(given[-1:])
    value = override.value()
    if isinstance(value, bool) or value is None:
        return bool(value)
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise ConfigError(TRUST_KEY, value, "true, false, or a list of package names (trust_checkpoint=[mypkg])")


def command_line_dirs(args: Sequence[str]) -> list[Path]:
    """The config dirs the command line ``args`` names itself (``--config-dir``/``-cd``, ``hydra.searchpath``)."""
    from multiloss.config.composition import config_dirs

    dirs = config_dirs(list(args))
    for arg in args:
        key, eq, value = arg.partition("=")
        if key.lstrip("+") == "hydra.searchpath" and eq:
            dirs.extend(entry.strip(" '\"") for entry in value.strip("[]").split(","))
    found = []
    for entry in dirs:
        if entry.startswith("pkg://") or not entry:
            continue  # a package's configs: installed code, read where it is used
        path = Path(entry.removeprefix("file://")).expanduser()
        found.append(path.resolve() if path.exists() else path)
    return found


def check_carried(ckpt: str, carried: Sequence[Any], stored_dirs: Sequence[str], args: Sequence[str]) -> list[str]:
    """The config dirs of the checkpoint's run that this command may add (all of ``stored_dirs`` when the checkpoint
    is trusted); `ConfigError` for a carried override or dir this command does not allow.

    ``carried``: Hydra's parsed overrides the checkpoint's run gave and this command leaves to it; ``stored_dirs``:
    the config dirs of its run (none when this command line names its own, which replace them).
    """
    trust = trust_of(args)
    named = command_line_dirs(args)
    allowed = Allowed(trust, _targets_written(args), named)
    where = f"the checkpoint ckpt_path={ckpt}"
    dirs = []
    for stored in stored_dirs:
        path = Path(str(stored))
        if trust is True:
            dirs.append(str(stored))
            continue
        if not path.is_dir():
            problem = f"{where} names the config dir {stored}, which does not exist here"
        else:
            problem = f"{where} names the config dir {stored} of its run, which this command line does not name"
        raise ConfigError(
            "--config-dir",
            str(stored),
            f"the run's options from a config dir you name yourself: --config-dir {stored} (its option files are code "
            "as much as data), or trust_checkpoint=true for a checkpoint you would run as code",
            problem,
        )
    for override in carried:
        # A group's option (net=my_cnn) is the shipped configs' or a dir's allowed above: a name, checked as a value.
        if not override.is_delete():
            allowed.check_value(override.value(), where, override.key_or_group.lstrip("+~"))
    return dirs


def refuse_hydras_own_keys(stored: Sequence[Any], ckpt: str) -> None:
    """Refuse a checkpoint whose run's overrides hold a key of Hydra's own (``hydra.*``, ``hydra/<group>``): Hydra
    keeps those apart from a run's task overrides, so one stored there was written by hand, and Hydra's keys reach
    its callbacks, its launcher, where it writes. Whatever is trusted."""
    for override in stored:
        key = override.key_or_group.lstrip("+~")
        if key == "hydra" or key.startswith(("hydra.", "hydra/")):
            raise ConfigError(
                key,
                override.value() if not override.is_delete() else None,
                "a checkpoint whose stored overrides are its run's own (Hydra's keys are never among them)",
                f"the checkpoint ckpt_path={ckpt} stores a key of Hydra's own, which no run stores: written by hand, "
                "and Hydra's keys reach its callbacks, its launcher and where it writes",
            )


def own_packages(args: Sequence[str]) -> list[str]:
    """The top-level packages of the targets the command line ``args`` writes beyond the shipped configs'."""
    shipped = Allowed()
    return sorted({target.split(".")[0] for target in _targets_written(args) if target not in shipped})


def _targets_written(args: Sequence[str]) -> set[str]:
    """The targets the command line ``args`` writes itself: yours, whatever the checkpoint says."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from multiloss.config.composition import overrides

    written: set[str] = set()
    for arg in overrides(list(args)):
        try:
            (override,) = OverridesParser.create().parse_overrides([arg])
        except Exception:  # Hydra reports a malformed override itself
            continue
        value = override.value()
        if override.key_or_group.rpartition(".")[2] == "_target_" and isinstance(value, str):
            written.add(value)
        written.update(t for _, t in targets_in(value) if isinstance(t, str))
    return written


def check_hyper_parameters(path: str | Path, trust: Any, where: str) -> dict[str, Any]:
    """Refuse a checkpoint file whose ``hyper_parameters`` name code this call does not allow (`Allowed`), or
    Lightning's instantiator keys; read with ``weights_only=True``, nothing imported. Returns the hyper-parameters
    that name a module of an earlier layout, each at its current place (`multiloss.config.renamed`), the others left
    out: what a load passes over the checkpoint's own."""
    import copy

    import torch

    from multiloss.config.renamed import rename_targets

    checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    hyper_parameters = checkpoint.get("hyper_parameters", {}) if isinstance(checkpoint, dict) else {}
    Allowed(trust).check_tree(hyper_parameters, f"{where}'s hyper-parameters", "hyper_parameters")
    return {k: new for k, v in hyper_parameters.items() if (new := rename_targets(copy.deepcopy(v))) != v}


# --- a sharded checkpoint's .metadata ------------------------------------------------------------------------------

_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice", "complex"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's metadata classes and torch's dtypes, nothing else (a bare ``pickle.load`` calls anything)."""

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if name in _DCP_CLASSES.get(module, ()) or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which is no part of a checkpoint's metadata")


def read_sharded_metadata(path: Path, key: str = "ckpt_path") -> Any:
    """The ``.metadata`` of the sharded checkpoint directory ``path``, unpickled with DCP's classes alone.

    torch's ``FileSystemReader.read_metadata`` (what every DCP load, Lightning's included, calls) is a bare
    ``pickle.load``: a ``.metadata`` from someone else would run any code it names. Every multiloss path reads it here
    first, so a file that names anything else is refused before torch reads it.
    """
    accepted = "a whole sharded checkpoint (a directory of .distcp shards, their .metadata and meta.pt)"
    try:
        return _MetadataUnpickler(io.BytesIO((path / ".metadata").read_bytes())).load()
    except pickle.UnpicklingError as err:
        raise ConfigError(key, str(path), accepted, f"its .metadata is refused: {err}") from None
    except Exception as err:  # truncated, not a pickle, ...
        raise ConfigError(key, str(path), accepted, f"its .metadata cannot be read: {err}") from None


__all__ = [
    "TRUST_KEY",
    "Allowed",
    "check_carried",
    "check_hyper_parameters",
    "command_line_dirs",
    "own_packages",
    "read_sharded_metadata",
    "refuse_hydras_own_keys",
    "shipped_targets",
    "targets_in",
    "trust_of",
]
