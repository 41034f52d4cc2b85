"""Batch keys whose examples stay on disk until a batch asks for them: RAM flat in the data's size.

A `LazyColumn` stands where an in-memory data module holds a tensor (`torch.utils.data.StackDataset` takes
either): ``column[i]`` reads example i; ``column[index]`` with an index tensor, array or slice is the view of
those examples and reads nothing, so `multiloss.data.arrays.ArrayDataModule`'s split copies no data;
``__getitems__`` reads a batch's examples in one call. Two kinds:

- `NpyRows`: the rows of a ``.npy`` file, or of an uncompressed (``np.savez``) member of an ``.npz``, read with
  ``os.preadv`` at their offsets. Not ``np.memmap``: the pages a memory map touches count in the process's
  resident memory (an epoch over a 4 GiB array would show 4 GiB of RSS); pages read stay in the kernel's page
  cache, which the kernel gives back under pressure.
- `FileSamples`: one file per example (an image of a folder or zip, a per-sample ``.npy``/``.png``/``.pt``),
  decoded when drawn.

Bad data, by when it can be found: what a cheap scan sees (the names, the counts, the headers and the first
example) is refused before training as a `ConfigError`; a file that does not decode, an example shaped or typed
otherwise than the first, or a NaN/inf in a float example stops the run at the batch that meets it with
`BadSample`, naming the file (the policy is to stop, never to skip: a skipped example would change the batch
size on one rank and the order every resume reproduces). The checkpoints written before it are kept.
"""

from __future__ import annotations

import copy
import io
import math
import os
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from multiloss.config import ConfigError, require


class BadSample(ValueError):
    """An example the run met that cannot be served like the first one: the file, what it held, what was expected.

    Built from its message alone, as a DataLoader worker re-raises an exception in the main process.
    """


def worker_message(err: BadSample) -> str:
    """The message a `BadSample` was raised with, also when a loader worker re-raised it with its traceback."""
    text = str(err)
    return text.rsplit(f"{BadSample.__name__}: ", 1)[-1].strip() if "Original Traceback" in text else text


def served_dtype(dtype: np.dtype, key: str, override: str | None = None) -> torch.dtype:
    """floats -> float32, integers -> int64, booleans -> float32 0/1 (what a BCE target needs); or ``override``.

    Raises:
        ConfigError: ``override`` not a torch dtype name (key ``dtypes.<key>``), or a non-numeric ``dtype``.
    """
    if override is not None:
        target = getattr(torch, override, None)
        require(isinstance(target, torch.dtype), f"dtypes.{key}", override, "a torch dtype name: float32, int64, ...")
        return target
    kind = dtype.kind
    if kind in "fb":
        return torch.float32
    if kind in "iu":
        return torch.int64
    raise ConfigError(
        "path",
        f"<array {key!r} of dtype {dtype}>",
        "numeric arrays (float, int, bool); convert strings or objects to numbers before saving",
        "not a numeric array",
    )


def as_served(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """``array`` as a tensor of ``dtype`` (no copy when it already is one)."""
    if array.dtype.kind == "b":
        array = array.astype(np.uint8)
    return torch.as_tensor(np.asarray(array)).to(dtype)


def _non_finite(t: torch.Tensor) -> int:
    return int((~torch.isfinite(t)).sum()) if t.is_floating_point() else 0


class LazyColumn:
    """One batch key's examples on disk; subclasses read them (`_read`). Each view keeps its examples' row numbers
    in the file (``rows``) and whether each is mirrored left-right (``mirror``, stylegan2-ada's x-flip)."""

    def __init__(self, n: int, item_shape: tuple[int, ...], dtype: torch.dtype, key: str) -> None:
        self.n, self.item_shape, self.dtype, self.key = n, tuple(item_shape), dtype, key
        self.rows: np.ndarray | None = None
        self.mirror: np.ndarray | None = None
        self.flat = False  # served as (features,): the example flattened after any mirroring

    # -- what a tensor of examples answers -------------------------------------------------------------------
    def __len__(self) -> int:
        return self.n if self.rows is None else len(self.rows)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((len(self), *self.served_shape))

    @property
    def served_shape(self) -> tuple[int, ...]:
        return (math.prod(self.item_shape),) if self.flat else self.item_shape

    def dim(self) -> int:
        return 1 + len(self.served_shape)

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def numel(self) -> int:
        return len(self) * math.prod(self.served_shape)

    def flattened(self) -> LazyColumn:
        view = copy.copy(self)
        view.flat = True
        return view

    # -- views and reads -------------------------------------------------------------------------------------
    def _file_rows(self) -> np.ndarray:
        return np.arange(self.n) if self.rows is None else self.rows

    def _mirrors(self) -> np.ndarray:
        return np.zeros(len(self), dtype=bool) if self.mirror is None else self.mirror

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, int | np.integer) or (isinstance(index, torch.Tensor) and index.dim() == 0):
            return self.__getitems__([int(index)])[0]
        if isinstance(index, torch.Tensor):
            index = index.numpy()
        view = copy.copy(self)
        view.rows, view.mirror = self._file_rows()[index], self._mirrors()[index]
        return view

    def mirrored(self) -> LazyColumn:
        """Every example, then every example mirrored left-right (last axis): twice the examples."""
        view = copy.copy(self)
        view.rows = np.concatenate([self._file_rows(), self._file_rows()])
        view.mirror = np.concatenate([self._mirrors(), ~self._mirrors()])
        return view

    def __getitems__(self, indices: Sequence[int]) -> list[torch.Tensor]:
        rows, mirrors = self._file_rows()[list(indices)], self._mirrors()[list(indices)]
        examples = self._read(rows)
        out = []
        for example, mirror in zip(examples, mirrors, strict=True):
            if mirror:
                example = example.flip(-1)
            out.append(example.reshape(-1) if self.flat else example)
        return out

    def _read(self, rows: np.ndarray) -> list[torch.Tensor]:
        raise NotImplementedError

    def where(self, row: int) -> str:
        """The file (and row) example ``row`` comes from, for messages."""
        raise NotImplementedError

    def _bad(self, row: int, found: str, expected: str) -> BadSample:
        return BadSample(
            f"data: {self.where(int(row))} (batch key {self.key!r}): {found}; expected {expected}. "
            "Fix or replace that file (the run stops at bad data rather than skip it)"
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.key!r}, {len(self)} × {self.served_shape} {self.dtype})"


class NpyRows(LazyColumn):
    """The rows of a C-ordered array stored raw in a file at ``offset`` (a ``.npy``, or an ``np.savez`` member)."""

    def __init__(self, path: Path, offset: int, dtype: np.dtype, shape: tuple[int, ...], key: str, label: str) -> None:
        super().__init__(shape[0], shape[1:], served_dtype(dtype, key), key)
        self.path, self.offset, self.np_dtype, self.label = Path(path), offset, dtype, label
        self.row_bytes = dtype.itemsize * math.prod(shape[1:])
        self._fd: int | None = None
        self._pid: int | None = None

    def serve_as(self, dtype: torch.dtype) -> NpyRows:
        self.dtype = dtype
        return self

    def __getstate__(self) -> dict[str, Any]:  # a loader worker opens its own descriptor
        return {**self.__dict__, "_fd": None, "_pid": None}

    def _descriptor(self) -> int:
        if self._fd is None or self._pid != os.getpid():
            self._fd, self._pid = os.open(self.path, os.O_RDONLY), os.getpid()
        return self._fd

    def _raw(self, rows: np.ndarray) -> np.ndarray:
        out = np.empty((len(rows), *self.item_shape), dtype=self.np_dtype)
        fd, flat = self._descriptor(), out.reshape(len(rows), -1).view(np.uint8)
        for j, row in enumerate(rows):
            got = os.preadv(fd, [flat[j]], self.offset + int(row) * self.row_bytes)
            if got != self.row_bytes:
                raise self._bad(row, f"{got} of its {self.row_bytes} bytes could be read", "a complete row")
        return out

    def _read(self, rows: np.ndarray) -> list[torch.Tensor]:
        batch = as_served(self._raw(rows), self.dtype)
        if batch.is_floating_point() and not bool(torch.isfinite(batch).all()):
            j = int((~torch.isfinite(batch.reshape(len(rows), -1))).any(dim=1).nonzero()[0, 0])
            raise self._bad(rows[j], f"{_non_finite(batch[j])} NaN/inf values", "finite numbers only")
        return list(batch.unbind(0))

    def where(self, row: int) -> str:
        return f"{self.label} row {row}"

    def whole(self) -> torch.Tensor:
        """Every example of this view at once, as served (for a small column: labels)."""
        rows = self._file_rows()
        return as_served(self._raw(rows), self.dtype).reshape(len(rows), *self.served_shape)

    def largest(self, chunk_bytes: int = 64 << 20) -> int | None:
        """The largest value of an integer column, read in chunks of ``chunk_bytes`` (token ids for the vocabulary)."""
        if self.dtype.is_floating_point or self.n == 0:
            return None
        step = max(1, chunk_bytes // max(self.row_bytes, 1))
        rows = self._file_rows()
        return max(int(self._raw(rows[i : i + step]).max()) for i in range(0, len(rows), step))

    @classmethod
    def in_file(cls, path: Path, key: str, member: str | None = None) -> NpyRows | np.ndarray:
        """The array of a ``.npy`` file (``member`` None) or of an ``.npz``'s member, as rows read on demand; a 0-d
        or string array (a vocabulary) is read whole and returned as it is.

        Raises:
            ConfigError: a compressed member (``np.savez_compressed``), a Fortran-ordered array, or a file shorter
                than its header says (key ``path``-like, its value the file).
        """
        label = str(path) if member is None else f"{path}:{member}"
        with open(path, "rb") as f:
            start = 0
            if member is not None:
                info = zipfile.ZipFile(f).getinfo(member)
                require(
                    info.compress_type == zipfile.ZIP_STORED,
                    key,
                    str(path),
                    "with data.lazy=true, an .npz written by np.savez (stored), or .npy files",
                    f"its array {member.removesuffix('.npy')!r} is compressed (np.savez_compressed): it cannot be "
                    "read a row at a time (data.lazy=false reads it into memory)",
                )
                f.seek(info.header_offset)
                local = f.read(30)  # the zip's local file header: its name and extra field lengths at 26 and 28
                start = info.header_offset + 30 + int.from_bytes(local[26:28], "little")
                start += int.from_bytes(local[28:30], "little")
                f.seek(start)
            version = np.lib.format.read_magic(f)
            header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = header(f)
            offset = f.tell()
        if len(shape) == 0 or dtype.kind not in "biuf":  # a vocabulary, or what served_dtype will refuse by name
            if member is None:
                return np.load(path, allow_pickle=False)
            with np.load(path, allow_pickle=False) as npz:
                return npz[member.removesuffix(".npy")]
        require(
            not fortran or len(shape) == 1,
            key,
            label,
            "a C-ordered array (np.save(path, np.ascontiguousarray(a))) to read a row at a time, or data.lazy=false",
            "it is stored in Fortran order",
        )
        needed = offset + math.prod(shape) * dtype.itemsize
        size = os.path.getsize(path)
        require(
            member is not None or size >= needed,
            key,
            label,
            "a complete .npy file",
            f"its header promises {shape} {dtype} ({needed} bytes) but the file has {size}: truncated",
        )
        return cls(path, offset, dtype, shape, key, label)


class FileStore:
    """Files under a folder, or the members of a zip (opened once per process: loader workers each open their own)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.is_zip = self.path.is_file()
        self._zip: zipfile.ZipFile | None = None
        self._pid: int | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_zip": None, "_pid": None}

    def names(self) -> list[str]:
        """Every file's name relative to the root, '/'-separated, sorted (the order stylegan2-ada's dataset reads)."""
        if self.is_zip:
            return sorted(n for n in self.archive().namelist() if not n.endswith("/"))
        return sorted(
            os.path.relpath(os.path.join(root, name), self.path).replace(os.sep, "/")
            for root, _dirs, files in os.walk(self.path)
            for name in files
        )

    def archive(self) -> zipfile.ZipFile:
        if self._zip is None or self._pid != os.getpid():
            self._zip, self._pid = zipfile.ZipFile(self.path), os.getpid()
        return self._zip

    def read(self, name: str) -> bytes:
        if self.is_zip:
            return self.archive().read(name)
        return (self.path / name).read_bytes()

    def where(self, name: str) -> str:
        return f"{self.path}:{name}" if self.is_zip else str(self.path / name)


class FileSamples(LazyColumn):
    """One file per example, ``decode(bytes) -> tensor``; the first file fixes the shape and dtype every other must
    have (read when built: an unreadable first file is a `ConfigError` under ``key_path``)."""

    def __init__(
        self, store: FileStore, names: list[str], decode: Callable[[bytes], torch.Tensor], key: str, key_path: str
    ) -> None:
        require(len(names) > 0, key_path, str(store.path), "at least one example", "no files")
        self.store, self.names, self.decode = store, names, decode
        try:
            first = decode(store.read(names[0]))
        except ConfigError:
            raise
        except Exception as err:
            raise ConfigError(
                key_path, store.where(names[0]), "files that decode", f"it does not: {type(err).__name__}: {err}"
            ) from None
        super().__init__(len(names), tuple(first.shape), first.dtype, key)

    def _read(self, rows: np.ndarray) -> list[torch.Tensor]:
        return [self._example(int(row)) for row in rows]

    def _example(self, row: int) -> torch.Tensor:
        expected = f"{tuple(self.item_shape)} {str(self.dtype).removeprefix('torch.')} like {self.names[0]}"
        try:
            example = self.decode(self.store.read(self.names[row]))
        except Exception as err:
            raise self._bad(row, f"it does not decode ({type(err).__name__}: {err})", expected) from None
        if tuple(example.shape) != self.item_shape or example.dtype != self.dtype:
            found = f"it is {tuple(example.shape)} {str(example.dtype).removeprefix('torch.')}"
            raise self._bad(row, found, expected)
        if bad := _non_finite(example):
            raise self._bad(row, f"{bad} NaN/inf values", "finite numbers only")
        return example

    def where(self, row: int) -> str:
        return self.store.where(self.names[row])


def read_npy(data: bytes) -> np.ndarray:
    """A ``.npy`` file's array from its bytes (never a pickle).

    Raises:
        ValueError: not a ``.npy`` file (numpy takes whatever lacks its header for a pickle and suggests loading it
            unsafely: never the advice to give for a damaged file).
    """
    try:
        return np.load(io.BytesIO(data), allow_pickle=False)
    except ValueError as err:
        if "pickle" in str(err):
            raise ValueError("not a .npy file (no .npy header: text, a pickle, or another format?)") from None
        raise


def read_pt(data: bytes) -> np.ndarray:
    """A ``.pt`` file's tensor (torch.save of one tensor) from its bytes, loaded with ``weights_only``."""
    value = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"it holds a {type(value).__name__}, not one tensor")
    return value.numpy()
