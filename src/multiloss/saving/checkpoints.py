"""Checkpoints you can trust: written atomically or not at all, read back only when intact and this run's.

Lightning 2.6 writes a checkpoint through fsspec's transaction, whose temporary file may sit on
another filesystem (a killed save then leaves a 0-byte file after the old one was removed), and it
swallows a ``PermissionError`` while saving (``lightning.fabric.utilities.cloud_io._atomic_save``), so a
run whose ``checkpoints/`` is not writable ends with exit 0 and no checkpoint. And ``torch.load``
does not check the zip's CRCs: a checkpoint with a few bytes overwritten loads, and trains on
garbage. Here:

- `AtomicCheckpointIO` writes to a temporary file *beside* the target, fsyncs it and renames it
  over the target (atomic on the destination filesystem): a checkpoint is the old one or the new
  one, never half of either; a failed write raises `CheckpointWriteError`. It loads with
  ``weights_only=True``, always.
- `verify_checkpoint` runs before anything is written: the file is a readable, intact zip (every
  member's CRC checked), loads with ``weights_only=True``, and holds this module's parameters with
  this module's shapes; otherwise a `ConfigError` names ``ckpt_path``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from torch import nn

from multiloss.config import ConfigError, require
from multiloss.saving.saved_state import POSITION, is_sharded_checkpoint
from multiloss.saving.trust import read_sharded_metadata


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written: the run stops instead of going on without one."""


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` with a same-directory temporary file, fsync and rename, and loud failures."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None or "://" in str(path):  # remote storage: Lightning's own way
            return super().save_checkpoint(checkpoint, path, storage_options)
        target = Path(path)
        tmp_name = None
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp_name, 0o666 & ~_umask())  # mkstemp makes it 0600: teammates and other jobs read it as any file
            replace(Path(tmp_name), target)
            tmp_name = None
        except (OSError, RuntimeError) as err:  # a full disk surfaces from torch.save's zip writer as RuntimeError
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            if isinstance(err, RuntimeError):
                reason = f"the write failed (is the disk full?): {reason}"
            raise CheckpointWriteError(f"could not write the checkpoint {target}: {reason}") from err
        finally:
            if tmp_name is not None and os.path.exists(tmp_name):
                os.remove(tmp_name)
        return None

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        # Tensors, numbers, strings and containers only: no code from a checkpoint ever runs.
        if is_sharded_checkpoint(path):  # a sharded run's checkpoint, read whole by a single-device or DDP run
            return read_sharded_checkpoint(path)
        return super().load_checkpoint(
            path, map_location=map_location or (lambda storage, loc: storage), weights_only=True
        )


def replace(new: Path, target: Path) -> None:
    """Put ``new`` (a file, or a sharded checkpoint's directory) where ``target`` is, whichever of the two ``target``
    is now (a run continued under another trainer, in its own run dir): one rename when the kinds agree; else the
    old one renamed aside, ``new`` renamed in, the old one removed — a moment between two renames with neither."""
    if target.is_dir() or (new.is_dir() and target.exists()):
        aside = target.with_name(f".{target.name}.replaced-{os.getpid()}")
        os.replace(target, aside)
        os.replace(new, target)
        shutil.rmtree(aside) if aside.is_dir() else aside.unlink()
    else:
        os.replace(new, target)
    _fsync_dir(target.parent)  # the rename itself survives a crash


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # a platform without directory descriptors: the rename is still atomic
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def verify_checkpoint(path: str | Path, module: nn.Module) -> dict[str, Any]:
    """Raise `ConfigError` (key ``ckpt_path``) unless ``path`` is an intact checkpoint of ``module``'s shape; its
    contents (tensors on the CPU; of a sharded checkpoint, everything but the tensors)."""
    path = str(path)
    checkpoint, shapes = _read_sharded(path) if is_sharded_checkpoint(path) else _read_whole(path)
    # None: an entry that is not a tensor (a module's extra state, e.g. a balancer's).
    expected = {k: tuple(v.shape) if hasattr(v, "shape") else None for k, v in module.state_dict().items()}
    # A sharded checkpoint stores a dict of extra state flattened, one entry a value: "<key>.<name>".
    non_tensors = tuple(f"{k}." for k, v in expected.items() if v is None)
    shapes = {
        next((p[:-1] for p in non_tensors if k.startswith(p)), k): v if not k.startswith(non_tensors) else None
        for k, v in shapes.items()
    }
    missing = [k for k in expected if k not in shapes]
    # Parts a module builds only once it has seen the data (multihead's balancer, sized by its heads): a Recipe's.
    later = getattr(module, "built_at_setup", ())
    unexpected = [k for k in shapes if k not in expected and not k.startswith(later)]
    reshaped = [
        f"{k} {shapes[k]} vs {v}" for k, v in expected.items() if None not in (v, shapes.get(k)) and shapes[k] != v
    ]
    if missing or unexpected or reshaped:
        parts = []
        if missing:
            parts.append(f"missing {missing[:3]}" + (f" and {len(missing) - 3} more" if len(missing) > 3 else ""))
        if unexpected:
            parts.append(
                f"unknown {unexpected[:3]}" + (f" and {len(unexpected) - 3} more" if len(unexpected) > 3 else "")
            )
        if reshaped:
            parts.append(f"other shapes: {reshaped[:3]}")
        raise ConfigError(
            "ckpt_path",
            path,
            f"a checkpoint of this run's model ({type(module).__name__} with these components and sizes)",
            "it belongs to another model: " + "; ".join(parts),
        )
    if (check := getattr(module, "check_checkpoint", None)) is not None:  # a Recipe's own checks
        check(checkpoint, path)
    return checkpoint


def _read_whole(path: str) -> tuple[dict[str, Any], dict[str, tuple[int, ...] | None]]:
    try:
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()  # reads every member, checks its CRC
    except (zipfile.BadZipFile, OSError) as err:
        raise ConfigError(
            "ckpt_path", path, "a checkpoint file written by torch.save (a zip)", f"not a readable checkpoint: {err}"
        ) from None
    if damaged is not None:
        raise ConfigError(
            "ckpt_path", path, "an intact checkpoint", f"damaged: {damaged} fails its CRC check (a corrupted copy?)"
        )
    checkpoint = _load(path)
    state = checkpoint.get("state_dict") if isinstance(checkpoint, dict) else None
    if not isinstance(state, dict):
        raise ConfigError("ckpt_path", path, "a Lightning checkpoint (with a state_dict)", "it has no state_dict")
    return checkpoint, {k: tuple(v.shape) if hasattr(v, "shape") else None for k, v in state.items()}


def _read_sharded(path: str) -> tuple[dict[str, Any], dict[str, tuple[int, ...] | None]]:
    """meta.pt's entries, and the whole shapes of the tensors the shards' metadata lists (no shard is read)."""
    metadata = check_sharded(path)
    checkpoint = _read_meta(Path(path))
    prefix = "state_dict."
    shapes = {
        k[len(prefix) :]: tuple(v.size) if hasattr(v, "size") else None  # None: stored as bytes, not a tensor
        for k, v in metadata.state_dict_metadata.items()
        if k.startswith(prefix)
    }
    return checkpoint, shapes


def _load(path: str, key: str = "ckpt_path") -> dict[str, Any]:
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise ConfigError(key, path, "a checkpoint of tensors and plain values", f"cannot load it: {err}") from None
    return checkpoint if isinstance(checkpoint, dict) else {}


META = "meta.pt"  # a sharded checkpoint's everything-but-the-tensors (Lightning's ModelParallelStrategy writes it)


def check_sharded(path: str | Path, key: str = "ckpt_path") -> Any:
    """The shards' metadata of the sharded checkpoint ``path``, once it is whole: its ``.metadata`` readable, its
    ``meta.pt`` there, every shard file it lists there and as long as the metadata says (a save that did not
    finish, a copy cut short); otherwise a `ConfigError` under ``key``. Reads no tensor: every rank can ask."""
    root = Path(path)
    accepted = "a whole sharded checkpoint (a directory of .distcp shards, their .metadata and meta.pt)"
    if not (root / ".metadata").is_file():
        raise ConfigError(
            key, str(path), accepted, "no .metadata in it: a sharded save that did not finish, or a damaged copy"
        )
    metadata = read_sharded_metadata(root, key)  # before torch's own reading of it, a bare pickle.load
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    missing = sorted(name for name in ends if not (root / name).is_file())
    if missing:
        raise ConfigError(key, str(path), accepted, f"shard files missing: {missing[:3]}")
    short = sorted(name for name, end in ends.items() if (root / name).stat().st_size < end)
    if short:
        raise ConfigError(key, str(path), accepted, f"shard files cut short (truncated): {short[:3]}")
    if not (root / META).is_file():
        raise ConfigError(
            key, str(path), accepted, f"no {META} in it (the run's state besides the tensors: loops, callbacks, config)"
        )
    _load(str(root / META), key)
    return metadata


def sharded_metadata(path: str | Path) -> dict[str, Any]:
    """What a resume needs to know of a sharded checkpoint before it loads: meta.pt's entries (``meta``) and, per
    optimizer index, the setting names of each of its param groups (``group_settings``), from the shards' metadata."""
    metadata = check_sharded(path)
    settings: dict[int, dict[int, set[str]]] = {}
    for name in metadata.state_dict_metadata:
        parts = name.split(".")
        if len(parts) >= 4 and parts[0].startswith("optimizer_") and parts[1] == "param_groups":
            index, group = int(parts[0].split("_")[1]), int(parts[2])
            if parts[3] != "params":
                settings.setdefault(index, {}).setdefault(group, set()).add(parts[3])
    groups = {index: [by_group[g] for g in sorted(by_group)] for index, by_group in settings.items()}
    return {"meta": _read_meta(Path(path)), "group_settings": groups}


def _read_meta(path: Path) -> dict[str, Any]:
    """A sharded checkpoint's entries other than the tensors (none if it has no meta.pt)."""
    return _load(str(path / META)) if (path / META).is_file() else {}


def read_sharded_checkpoint(path: str | Path) -> dict[str, Any]:
    """A sharded checkpoint as the one-file Lightning checkpoint DDP would have written: meta.pt's entries, the
    whole ``state_dict`` and each optimizer's whole state, keyed by parameter index as ``Optimizer.state_dict``
    keys it (the shards key it by parameter name).

    Read by torch's ``dcp_to_torch_save`` (Lightning's own ``consolidate_checkpoint`` fails on these: KeyError
    'model'); everything loads with ``weights_only=True``.
    """
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = Path(path)
    check_sharded(path)  # whole, and its .metadata names nothing but DCP's classes (torch unpickles it bare)
    with tempfile.TemporaryDirectory() as tmp:
        whole = Path(tmp) / "whole.pt"
        dcp_to_torch_save(path, whole)
        tensors = torch.load(whole, map_location="cpu", weights_only=True)
    checkpoint = _read_meta(path)
    optimizers = sorted((k for k in tensors if k.startswith("optimizer_")), key=lambda k: int(k.split("_")[1]))
    return {
        **checkpoint,
        "state_dict": tensors["state_dict"],
        "optimizer_states": [_indexed(tensors[k]) for k in optimizers],
    }


def _indexed(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state keyed by parameter name (FSDP2's) keyed by index instead, in its groups' order."""
    groups, by_name, index = [], state.get("state", {}), 0
    indexed: dict[int, Any] = {}
    for group in state["param_groups"]:
        names = group["params"]
        for i, name in enumerate(names, start=index):
            if name in by_name:
                indexed[i] = by_name[name]
        groups.append({**group, "params": list(range(index, index + len(names)))})
        index += len(names)
    return {"state": indexed, "param_groups": groups}


def consolidate(path: str | Path, out: str | Path) -> Path:
    """Write the sharded checkpoint ``path`` as one file ``out`` (atomically; never over an existing file)."""
    require(Path(path).is_dir(), "checkpoint", str(path), "a sharded checkpoint (a directory with .metadata)")
    check_sharded(path, "checkpoint")
    out = Path(out)
    require(not out.exists(), "out", str(out), "a path where nothing is yet", "it exists (never overwritten)")
    AtomicCheckpointIO().save_checkpoint(read_sharded_checkpoint(path), out)
    return out


@contextmanager
def whole_checkpoint_file(path: Any) -> Iterator[Any]:
    """``path`` itself, or for a sharded checkpoint a temporary file holding it whole (`consolidate`), while inside."""
    if not is_sharded_checkpoint(path):
        yield path
        return
    with tempfile.TemporaryDirectory() as tmp:
        yield consolidate(path, Path(tmp) / "whole.ckpt")


def mid_epoch(checkpoint: dict[str, Any]) -> bool:
    """Whether ``checkpoint`` was saved inside a training epoch (a resume continues that epoch's batches)."""
    progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_progress", {}).get("current", {})
    return progress.get("started", 0) > progress.get("processed", 0)


def saved_position(checkpoint: dict[str, Any]) -> dict[str, Any] | None:
    """The training loader's place in its epoch, in examples (`multiloss.data.order`), if the checkpoint keeps one
    (checkpoints of earlier versions kept torchdata's count of batches instead)."""
    loaders = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {}).get("combined_loader") or [{}]
    return loaders[0].get(POSITION) if isinstance(loaders[0], dict) else None


def verify_position(
    checkpoint: dict[str, Any],
    batches: dict[str, Any],
    batch_size: Any,
    world_size: int,
    streams: bool = False,
    order: tuple[Any, Any] | None = None,
) -> list[str]:
    """Raise `ConfigError` if a mid-epoch ``checkpoint`` cannot continue its epoch on another batch size or number of
    ranks; the changes the resume makes (one line each, for the run to say).

    A checkpoint that keeps its place in the epoch in examples continues on any shape: the rest of the epoch's
    order, each example once, split as a fresh run on the new shape splits it. Refused mid-epoch: token streams
    (``streams``: each rank carries its streams' hidden state from window to window, and another number of ranks
    would cut the streams elsewhere) and a checkpoint whose loader counted batches (an earlier version's, or a data
    module of the user's own). At an epoch's end either may change. ``order``: this run's (data.seed,
    data.shuffle), which a mid-epoch resume keeps (its place is a count of that order's examples).
    """
    position = saved_position(checkpoint) if mid_epoch(checkpoint) else None
    if position is not None and order is not None:
        for key, now in zip(("data.seed", "data.shuffle"), order):
            then = position["seed" if key == "data.seed" else "shuffle"]
            require(
                now == then,
                key,
                now,
                f"the checkpoint's, {then}, until its epoch ends (its place in the epoch is a count of that order's "
                "examples); or resume from a checkpoint taken at an epoch's end to change it",
            )
    if not batches:
        return []
    saved_size, saved_world = batches.get("batch_size"), batches.get("world_size")
    changes = []
    for key, now, then in (("data.batch_size", batch_size, saved_size), ("trainer.devices", world_size, saved_world)):
        if then is None or now is None or now == then:
            continue
        what = "per rank" if key == "data.batch_size" else "ranks (devices × nodes)"
        if not mid_epoch(checkpoint):
            changes.append(f"{key}: {now} {what} (the checkpoint's {then}), from this epoch on")
            continue
        if position is not None and not streams:
            changes.append(
                f"{key}: {now} {what} (the checkpoint's {then}): its epoch continues at example "
                f"{position['consumed']} of {position['examples']}, the rest split as a fresh run on "
                f"{world_size} rank(s) × {batch_size} splits it"
            )
            continue
        what = "per-rank batch size" if key == "data.batch_size" else "number of ranks (devices × nodes)"
        why = (
            "each rank carries its token streams' hidden state from window to window: another number of ranks "
            "would cut the streams elsewhere"
            if streams
            else f"its place in the epoch is a count of batches of {saved_size} on {saved_world} rank(s), not of "
            "examples (a checkpoint of an earlier version, or a training loader of your own)"
        )
        raise ConfigError(
            key,
            now,
            f"the checkpoint's {what}, {then}, until its epoch ends; or resume from a checkpoint taken at "
            "an epoch's end (last.ckpt after max_epochs, or the epoch-end save) to change it",
            f"the checkpoint was saved mid-epoch and {why}",
        )
    return changes


def refuse_a_bound_already_reached(checkpoint: dict[str, Any], max_steps: Any, max_epochs: Any) -> None:
    """Raise `ConfigError` when the checkpoint's run is already at or past ``trainer.max_steps`` (or has finished
    ``trainer.max_epochs``): the resume would train nothing and write an empty run record."""
    step = checkpoint.get("global_step")
    if isinstance(max_steps, int) and max_steps > 0 and isinstance(step, int) and step >= max_steps:
        raise ConfigError(
            "trainer.max_steps",
            max_steps,
            f"more than the checkpoint's {step} steps (it trained that far already), or -1 (max_epochs bounds it)",
            "the run is already past it: nothing to train",
        )
    progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_progress", {}).get("current", {})
    finished = progress.get("processed")  # epochs whose batches all ran (a mid-epoch save's epoch is not one)
    if isinstance(max_epochs, int) and max_epochs > 0 and finished is not None and finished >= max_epochs:
        raise ConfigError(
            "trainer.max_epochs",
            max_epochs,
            f"more than the {finished} epoch(s) the checkpoint's run finished",
            "the run is already past it: nothing to train",
        )
