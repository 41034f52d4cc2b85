"""One file per sample and per batch key, as multi-task datasets are kept: LibMTL's NYUv2 is
``{train,val}/{image,label,depth,normal}/<i>.npy`` (Cityscapes the same with ``label``/``depth``), read one
sample at a time."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from multiloss.config import require
from multiloss.data.arrays import ArrayDataModule, check_like_training
from multiloss.data.columns import FileSamples, FileStore, LazyColumn, as_served, read_npy, read_pt, served_dtype
from multiloss.data.images import ImageDecoder, ScaledImage, as_range, image_extensions

PARTS = ("train", "val", "test")


def _stem_order(stem: str) -> tuple[int, int | str]:
    """Numbered files in number order (2.npy before 10.npy, as LibMTL reads range(n)), others by name."""
    return (0, int(stem)) if stem.isdigit() else (1, stem)


@dataclass(frozen=True)
class ArrayFile:
    """``bytes -> tensor`` of a per-sample ``.npy`` or ``.pt`` file: ``read``, the last axis moved first when
    ``channels_last``, served as ``dtype``. (Classes, not closures: picklable for spawned loader workers.)"""

    read: Callable[[bytes], np.ndarray]
    channels_last: bool
    dtype: torch.dtype

    def __call__(self, data: bytes) -> torch.Tensor:
        array = self.read(data)
        return as_served(np.moveaxis(array, -1, 0) if self.channels_last else array, self.dtype)


@dataclass(frozen=True)
class MaskImage:
    """``bytes -> tensor`` of an image file that holds integers (a segmentation mask): ``(H, W)``, or
    ``(C, H, W)`` for a mask of several channels, as ``dtype``."""

    dtype: torch.dtype

    def __call__(self, data: bytes) -> torch.Tensor:
        array = ImageDecoder()(data)
        return as_served(array[:, :, 0] if array.shape[2] == 1 else np.moveaxis(array, -1, 0), self.dtype)


class SamplesDataModule(ArrayDataModule):
    """Per-sample files: each sub-folder of ``path`` is a batch key holding one file per sample, matched across
    keys by file name (``image/7.npy`` and ``depth/7.npy`` are sample 7's); samples in number order of their names
    (else by name).

    A ``path`` holding ``train/`` (and ``val/``, ``test/``) folders of such key folders reads as LibMTL's layout:
    those are the parts (no random split); ``val_path`` / ``test_path`` name them explicitly instead. Files:
    ``.npy`` (never a pickle), ``.pt`` (one tensor, ``weights_only``) or images PIL decodes; every key's files of one
    kind. Values as ``data=npz`` serves them (floats -> float32, integers -> int64, booleans -> float32; ``dtypes``
    overrides per key); image files are integer masks ``(H, W)`` (int64) unless their key is in ``scaled`` (then
    ``(C, H, W)`` float32 over ``value_range``). ``keys`` picks folders, ``rename`` maps folder names to batch keys
    (a folder ``image`` is served as ``x``, the net's input, where no folder is ``x``: LibMTL's name);
    ``channels_last`` lists keys stored ``(H, W, C)`` (LibMTL's NYUv2 ``image``, ``depth``, ``normal``) served
    channels-first, ``flatten`` keys served as ``(features,)``; all name batch keys (after ``rename``).

    Found before training (a listing and the first sample's files): a missing folder, no key folders, a sample
    missing from one key's folder (named), a folder mixing file kinds, a first file that does not decode. Found at
    the batch that meets it (`multiloss.data.columns.BadSample`, the run stops naming the file): a file that does
    not decode, or whose shape or dtype differs from the first sample's, or a NaN/inf.
    """

    def __init__(
        self,
        path: str,
        val_path: str | None = None,
        test_path: str | None = None,
        keys: list[str] | None = None,
        rename: dict[str, str] | None = None,
        channels_last: list[str] | None = None,
        flatten: list[str] | None = None,
        dtypes: dict[str, str] | None = None,
        scaled: list[str] | None = None,
        value_range: Sequence[float] | None = (0.0, 1.0),
        val_fraction: float | None = None,
        **kwargs,
    ) -> None:
        require(
            os.path.isdir(path),
            "path",
            path,
            "a folder of per-key folders (or of train/, val/ folders of them)",
            "not a folder" if os.path.exists(path) else "no such folder",
        )
        for given, key in ((val_path, "val_path"), (test_path, "test_path")):
            require(given is None or os.path.isdir(given), key, given, "a folder of the same key folders as data.path")
        root = Path(path)
        nested = (root / "train").is_dir() and val_path is None and test_path is None
        folders = {"train": (root / "train", "path")} if nested else {"train": (root, "path")}
        for part, given, key in (("val", val_path, "val_path"), ("test", test_path, "test_path")):
            if given is not None:
                folders[part] = (Path(given), key)
            elif nested and (root / part).is_dir():
                folders[part] = (root / part, "path")
        has_val = "val" in folders
        super().__init__(val_fraction=(0.0 if has_val else 0.2) if val_fraction is None else val_fraction, **kwargs)
        self.given_parts(*(str(folders[p][0]) if p in folders else None for p in ("val", "test")))
        self.options = {
            "keys": keys,
            "rename": dict(rename or {}),
            "channels_last": list(channels_last or []),
            "flatten": list(flatten or []),
            "dtypes": dict(dtypes or {}),
            "scaled": list(scaled or []),
        }
        self.value_range = as_range(value_range)
        self.parts = {part: self._read(folder, key) for part, (folder, key) in folders.items()}
        for part in ("val", "test"):
            if part in self.parts:
                check_like_training(self.parts[part], self.parts["train"], folders[part][1], str(folders[part][0]))

    def _read(self, folder: Path, key: str) -> dict[str, LazyColumn]:
        options = self.options
        found = sorted(p.name for p in folder.iterdir() if p.is_dir())
        if options["keys"] is not None:
            missing = [k for k in options["keys"] if k not in found]
            require(not missing, "keys", list(options["keys"]), f"folders of {folder}: {found}", f"no {missing}")
            found = list(options["keys"])
        require(
            len(found) > 0,
            key,
            str(folder),
            "a folder holding one folder per batch key (image/, label/, ...), each one file per sample",
            "it has no sub-folders",
        )
        unknown = [k for k in options["rename"] if k not in found]
        if unknown:
            require(
                False, f"rename.{unknown[0]}", options["rename"][unknown[0]], f"renames of folders of {folder}: {found}"
            )
        renames = dict(options["rename"])
        if "image" in found and "x" not in found and "x" not in renames.values():
            renames.setdefault("image", "x")  # LibMTL's name for the input
        batch_keys = {name: renames.get(name, name) for name in found}
        for option in ("channels_last", "flatten", "dtypes", "scaled"):
            unknown = [k for k in options[option] if k not in batch_keys.values()]
            require(
                not unknown,
                option,
                unknown[0] if unknown else None,
                f"batch keys: {sorted(batch_keys.values())}",
                "no such key",
            )
        files = {name: self._files(folder / name, key) for name in found}
        stems = {name: set(listed) for name, listed in files.items()}
        every = set().union(*stems.values())
        for name in found:
            missing = sorted(every - stems[name], key=_stem_order)
            if missing:
                holder = next(n for n in found if missing[0] in stems[n])
                require(
                    False,
                    key,
                    str(folder / name),
                    f"one file per sample, as every key folder of {folder} has",
                    f"{len(missing)} sample(s) have no file here, the first {missing[:3]} (found in {holder}/)",
                )
        order = sorted(every, key=_stem_order)
        columns: dict[str, LazyColumn] = {}
        for name in found:
            batch_key, store = batch_keys[name], FileStore(folder / name)
            names = [files[name][stem] for stem in order]
            column = FileSamples(store, names, self._decoder(store, names[0], batch_key), batch_key, key)
            columns[batch_key] = column.flattened() if batch_key in options["flatten"] else column
        return columns

    def _files(self, folder: Path, key: str) -> dict[str, str]:
        names = sorted(p.name for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
        require(len(names) > 0, key, str(folder), "one file per sample in every key folder", "it is empty")
        kinds = {Path(n).suffix.lower() for n in names}
        readable = {".npy", ".pt"} | image_extensions()
        require(
            len(kinds) == 1 and kinds <= readable,
            key,
            str(folder),
            "files of one kind per key folder: .npy, .pt, or images (.png, .jpg, ...)",
            f"it holds {sorted(kinds)}",
        )
        return {Path(n).stem: n for n in names}

    def _decoder(self, store: FileStore, first: str, batch_key: str) -> Callable[[bytes], torch.Tensor]:
        """``bytes -> tensor`` for one key's files, the served dtype fixed by its first file (or ``dtypes``)."""
        options, kind = self.options, Path(first).suffix.lower()
        override = options["dtypes"].get(batch_key)
        if kind in (".npy", ".pt"):
            read = read_npy if kind == ".npy" else read_pt
            dtype = served_dtype(read(store.read(first)).dtype, batch_key, override)
            return ArrayFile(read, batch_key in options["channels_last"], dtype)
        if batch_key in options["scaled"]:
            return ScaledImage(ImageDecoder(), self.value_range)
        return MaskImage(served_dtype(np.dtype(np.int64), batch_key, override))

    def load_parts(self) -> dict[str, dict[str, LazyColumn]]:
        return self.parts
