"""The user's own arrays from a ``.npz`` file (or a ``.npy`` file, with an optional ``.npy`` of labels)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from multiloss.config import ConfigError, require
from multiloss.data.arrays import ArrayDataModule


def _tensor(name: str, array: np.ndarray, dtype: str | None) -> torch.Tensor:
    """floats -> float32, integers -> int64, booleans -> float32 0/1 (what a BCE target needs); or ``dtype``."""
    if dtype is not None:
        target = getattr(torch, dtype, None)
        require(isinstance(target, torch.dtype), f"dtypes.{name}", dtype, "a torch dtype name: float32, int64, ...")
        return torch.as_tensor(np.asarray(array)).to(target)
    kind = array.dtype.kind
    if kind == "f":
        return torch.as_tensor(np.asarray(array, dtype=np.float32))
    if kind in "iu":
        return torch.as_tensor(np.asarray(array, dtype=np.int64))
    if kind == "b":
        return torch.as_tensor(np.asarray(array, dtype=np.float32))
    raise ConfigError(
        "path",
        f"<array {name!r} of dtype {array.dtype}>",
        "numeric arrays (float, int, bool); convert strings or objects to numbers before saving",
        "not a numeric array",
    )


class NpzDataModule(ArrayDataModule):
    """Every array of the ``.npz`` at ``path`` as a batch key of the same name, its examples along the first axis.

    dtypes: floats -> float32, integers -> int64, booleans -> float32 (0/1); ``dtypes`` overrides per
    key (``{x: float32}``). Shapes are kept (``x`` of images stays ``(N, C, H, W)``) unless the key
    is listed in ``flatten`` (then ``(N, features)``). ``keys`` loads a subset; ``rename`` maps file
    names to batch keys (``{features: x, labels: y}``). A ``.npy`` ``path`` is served as ``x``, and
    ``y_path`` (a ``.npy`` of labels) as ``y``. Everything is read and checked when the data module
    is built, before a run writes anything.

    Raises:
        ConfigError: the file missing or unreadable, a listed key not in it, a non-numeric array,
            no examples, or arrays of different lengths; the base class's checks.
    """

    def __init__(
        self,
        path: str,
        keys: list[str] | None = None,
        rename: dict[str, str] | None = None,
        flatten: list[str] | None = None,
        dtypes: dict[str, str] | None = None,
        y_path: str | None = None,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        require(Path(path).is_file(), "path", path, "an existing .npz (or .npy) file", "no such file")
        self.path, self.y_path = Path(path), y_path
        rename, flatten, dtypes = dict(rename or {}), list(flatten or []), dict(dtypes or {})
        arrays = self._read(keys)
        for old in rename:
            require(old in arrays, f"rename.{old}", rename[old], f"renames of the file's arrays: {sorted(arrays)}")
        arrays = {rename.get(k, k): v for k, v in arrays.items()}
        for key, names in (("flatten", flatten), ("dtypes", list(dtypes))):
            unknown = [n for n in names if n not in arrays]
            require(not unknown, key, unknown[0] if unknown else None, f"batch keys: {sorted(arrays)}", "no such key")
        tensors = {k: _tensor(k, v, dtypes.get(k)) for k, v in arrays.items()}
        for k in flatten:
            require(tensors[k].dim() >= 1, "flatten", k, "keys of arrays with an examples axis")
            tensors[k] = tensors[k].flatten(1) if tensors[k].dim() > 1 else tensors[k]
        for k, v in tensors.items():
            if v.is_floating_point() and not bool(torch.isfinite(v).all()):
                bad = int((~torch.isfinite(v)).sum())
                raise ConfigError(
                    "path",
                    str(path),
                    "finite numbers only (clean or drop the examples first)",
                    f"array {k!r} holds {bad} NaN/inf value{'s' if bad > 1 else ''}",
                )
        lengths = {k: len(v) if v.dim() > 0 else 0 for k, v in tensors.items()}
        require(
            len(set(lengths.values())) == 1,
            "path",
            str(path),
            "arrays of the same length along their first axis (the examples)",
            f"lengths differ: {lengths}",
        )
        require(next(iter(lengths.values())) > 0, "path", str(path), "at least one example", "the arrays are empty")
        self.arrays = tensors

    def _read(self, keys: list[str] | None) -> dict[str, np.ndarray]:
        try:
            if self.path.suffix == ".npy":
                arrays = {"x": np.load(self.path, allow_pickle=False)}
                if self.y_path is not None:
                    require(Path(self.y_path).is_file(), "y_path", self.y_path, "an existing .npy file of labels")
                    arrays["y"] = np.load(self.y_path, allow_pickle=False)
            else:
                with np.load(self.path, allow_pickle=False) as npz:
                    arrays = {name: npz[name] for name in npz.files}
        except ConfigError:
            raise
        except Exception as err:  # a damaged file, a pickle, not numpy at all: all the same to a user
            raise ConfigError(
                "path", str(self.path), "a .npz (np.savez) or .npy file of numeric arrays", f"cannot read it: {err}"
            ) from None
        require(len(arrays) > 0, "path", str(self.path), "a .npz holding at least one array", "it holds none")
        if keys is not None:
            missing = [k for k in keys if k not in arrays]
            require(not missing, "keys", list(keys), f"names of the file's arrays: {sorted(arrays)}", f"no {missing}")
            arrays = {k: arrays[k] for k in keys}
        return arrays

    def load(self) -> dict[str, torch.Tensor]:
        return self.arrays
