"""The user's own arrays from a ``.npz`` file (or a ``.npy`` file, with an optional ``.npy`` of labels)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from multiloss.config import ConfigError, require
from multiloss.data.arrays import ArrayDataModule, check_like_training
from multiloss.data.columns import LazyColumn, NpyRows, as_served, served_dtype
from multiloss.data.streams import TokenStreams
from multiloss.data.vocabulary import Vocabulary


def _tensor(name: str, array: np.ndarray, dtype: str | None) -> torch.Tensor:
    return as_served(array, served_dtype(array.dtype, name, dtype))


class NpzDataModule(ArrayDataModule):
    """Every array of the ``.npz`` at ``path`` as a batch key of the same name, its examples along the first axis.

    dtypes: floats -> float32, integers -> int64, booleans -> float32 (0/1); ``dtypes`` overrides per
    key (``{x: float32}``). Shapes are kept (``x`` of images stays ``(N, C, H, W)``) unless the key
    is listed in ``flatten`` (then ``(N, features)``). ``keys`` loads a subset; ``rename`` maps file
    names to batch keys (``{features: x, labels: y}``). A ``.npy`` ``path`` is served as ``x``, and
    ``y_path`` (a ``.npy`` of labels) as ``y``. ``val_path`` / ``test_path``: files of the same arrays
    for validation and test (then no random split: ``val_fraction`` 0). Everything is read and
    checked when the data module is built, before a run writes anything.

    ``lazy``: read each batch's rows from the file when the batch is drawn (`multiloss.data.columns.NpyRows`),
    RAM flat in the file's size, instead of holding the arrays in memory. null (default): lazy for ``.npy``
    files, in memory for ``.npz``; true: an ``.npz`` too (written by ``np.savez``: compressed members cannot be
    read a row at a time). Lazily read, a NaN/inf is found at the batch that meets it (in memory: when built).

    Token data (tbptt): a file may name its vocabulary, an integer ``vocab_size`` array (0-d) or a
    string array ``vocab`` (its words, id i the i-th): not batch keys, they become ``vocab``; the
    recipe takes it from there (or from ``model.vocab``). ``max_token_id`` is the largest id of every
    integer array. ``layout=streams``: the file holds the corpus as one 1-D integer array (``x``, or its
    only 1-D integer array), cut into ``batch_size`` contiguous streams read window by window of
    ``seq_len`` tokens (`multiloss.data.streams`); without ``val_path`` the validation streams are the
    corpus's last ``val_fraction`` (default 0.1), a contiguous tail as ``data=text`` cuts it.

    Raises:
        ConfigError: a file missing or unreadable, a listed key not in it, a non-numeric array,
            no examples, or arrays of different lengths; a ``vocab_size`` that is not a positive
            integer, or files naming different vocabularies; streams without one 1-D integer corpus or
            without ``seq_len``; ``val_fraction`` with ``val_path``; the base class's checks.
    """

    def __init__(
        self,
        path: str,
        keys: list[str] | None = None,
        rename: dict[str, str] | None = None,
        flatten: list[str] | None = None,
        dtypes: dict[str, str] | None = None,
        y_path: str | None = None,
        val_path: str | None = None,
        test_path: str | None = None,
        layout: Literal["sequences", "streams"] = "sequences",
        seq_len: int | None = None,
        val_fraction: float | None = None,
        lazy: bool | None = None,
        **kwargs,
    ) -> None:
        # Each file there before anything is read (the early checker reads these too, before the imports).
        require(os.path.isfile(path), "path", str(path), "an existing .npz (or .npy) file", "no such file")
        require(
            val_path is None or os.path.isfile(val_path),
            "val_path",
            str(val_path),
            "an existing .npz (or .npy) file",
            "no such file",
        )
        require(
            test_path is None or os.path.isfile(test_path),
            "test_path",
            str(test_path),
            "an existing .npz (or .npy) file",
            "no such file",
        )
        require(y_path is None or os.path.isfile(y_path), "y_path", y_path, "an existing .npy file of labels")
        require(lazy in (None, True, False), "lazy", lazy, "true, false, or null (.npy files lazy, .npz in memory)")
        require(
            not (lazy and layout == "streams"),
            "lazy",
            lazy,
            "false or null with layout=streams (the token streams are cut from the corpus in memory)",
        )
        self.lazy = False if layout == "streams" else lazy
        default_fraction = 0.0 if val_path is not None else 0.1 if layout == "streams" else 0.2
        super().__init__(val_fraction=default_fraction if val_fraction is None else val_fraction, **kwargs)
        self.given_parts(val_path, test_path)
        require(layout in ("sequences", "streams"), "layout", layout, "sequences or streams")
        self.path, self.y_path, self.layout, self.seq_len = Path(path), y_path, layout, seq_len
        options = {
            "keys": keys,
            "rename": dict(rename or {}),
            "flatten": list(flatten or []),
            "dtypes": dict(dtypes or {}),
        }
        parts = {"train": (path, "path")}
        parts.update({p: (f, k) for p, f, k in (("val", val_path, "val_path"), ("test", test_path, "test_path")) if f})
        read = {part: self._arrays(Path(f), key, options) for part, (f, key) in parts.items()}
        vocabularies = {part: v for part, (_, v) in read.items() if v is not None}
        require(
            len({str(v.spec) for v in vocabularies.values()}) <= 1,
            "val_path",
            val_path,
            "files that name the same vocabulary (their vocab_size or vocab arrays)",
            f"they differ: {', '.join(f'{p}: {v}' for p, v in vocabularies.items())}",
        )
        self.vocab = next(iter(vocabularies.values()), None)
        self.arrays = read["train"][0]
        self.split = {part: arrays for part, (arrays, _) in read.items()}
        for part in ("val", "test"):
            if part in self.split:
                check_like_training(self.split[part], self.arrays, parts[part][1], parts[part][0])
        ints = [t for arrays in self.split.values() for t in arrays.values() if not t.is_floating_point() and t.numel()]
        self.max_token_id = max((_largest(t) for t in ints), default=None)
        if layout == "streams":
            require(
                isinstance(seq_len, int) and seq_len >= 1,
                "seq_len",
                seq_len,
                "an integer ≥ 1 with layout=streams: the tokens per window",
            )
            corpus = {part: self._corpus(arrays, *parts[part][::-1]) for part, arrays in self.split.items()}
            if "val" not in corpus and self.val_fraction > 0:  # the tail, as data=text cuts it
                cut = len(corpus["train"]) - round(len(corpus["train"]) * self.val_fraction)
                corpus["train"], corpus["val"] = corpus["train"][:cut], corpus["train"][cut:]
            self.streams = TokenStreams(corpus, self.batch_size, self.val_batch_size, seq_len)
        else:
            require(
                seq_len is None, "seq_len", seq_len, "null: a file's sequences keep their own length (layout=sequences)"
            )

    def _arrays(self, path: Path, key: str, options: dict) -> tuple[dict[str, torch.Tensor], Vocabulary | None]:
        """One file's arrays as tensors (renamed, flattened, converted and checked), and the vocabulary it names."""
        arrays = self._read(path, key, options["keys"])
        vocab = _vocabulary(arrays, path, key)
        rename, flatten, dtypes = options["rename"], options["flatten"], options["dtypes"]
        for old in rename:
            require(old in arrays, f"rename.{old}", rename[old], f"renames of the file's arrays: {sorted(arrays)}")
        clash = [rename[old] for old in rename if rename[old] in arrays and rename[old] not in rename]
        require(
            not clash,
            f"rename.{next((o for o in rename if rename[o] in clash), '')}",
            clash[0] if clash else None,
            f"a batch key the file does not already hold: {sorted(arrays)} (rename that array too, or leave it "
            "out with data.keys)",
            f"the file already has an array {clash[0] if clash else ''!r}: one of the two would be lost",
        )
        arrays = {rename.get(k, k): v for k, v in arrays.items()}
        for option, names in (("flatten", flatten), ("dtypes", list(dtypes))):
            unknown = [n for n in names if n not in arrays]
            require(
                not unknown, option, unknown[0] if unknown else None, f"batch keys: {sorted(arrays)}", "no such key"
            )
        tensors = {
            k: v.serve_as(served_dtype(v.np_dtype, k, dtypes.get(k)))
            if isinstance(v, NpyRows)
            else _tensor(k, v, dtypes.get(k))
            for k, v in arrays.items()
        }
        for k in flatten:
            require(tensors[k].dim() >= 1, "flatten", k, "keys of arrays with an examples axis")
            if tensors[k].dim() > 1:
                tensors[k] = tensors[k].flattened() if isinstance(tensors[k], LazyColumn) else tensors[k].flatten(1)
        for k, v in tensors.items():
            if isinstance(v, LazyColumn):
                continue  # checked a batch at a time, as it is read
            if v.is_floating_point() and not bool(torch.isfinite(v).all()):
                bad = int((~torch.isfinite(v)).sum())
                raise ConfigError(
                    key,
                    str(path),
                    "finite numbers only (clean or drop the examples first)",
                    f"array {k!r} holds {bad} NaN/inf value{'s' if bad > 1 else ''}",
                )
        lengths = {k: len(v) if v.dim() > 0 else 0 for k, v in tensors.items()}
        require(
            len(set(lengths.values())) == 1,
            key,
            str(path),
            "arrays of the same length along their first axis (the examples)",
            f"lengths differ: {lengths}",
        )
        require(next(iter(lengths.values())) > 0, key, str(path), "at least one example", "the arrays are empty")
        return tensors, vocab

    def _read(self, path: Path, key: str, keys: list[str] | None) -> dict[str, np.ndarray]:
        lazy = self.lazy if self.lazy is not None else path.suffix == ".npy"
        try:
            if path.suffix == ".npy":
                arrays = {"x": NpyRows.in_file(path, key) if lazy else np.load(path, allow_pickle=False)}
                if self.y_path is not None and key == "path":
                    y = Path(self.y_path)
                    arrays["y"] = NpyRows.in_file(y, "y_path") if lazy else np.load(y, allow_pickle=False)
            elif lazy:
                with np.load(path, allow_pickle=False) as npz:
                    names = list(npz.files)
                arrays = {name: NpyRows.in_file(path, key, f"{name}.npy") for name in names}
            else:
                with np.load(path, allow_pickle=False) as npz:
                    arrays = {name: npz[name] for name in npz.files}
        except ConfigError:
            raise
        except Exception as err:  # a damaged file, a pickle, not numpy at all: all the same to a user
            # numpy takes whatever is not a zip or .npy header for a pickle, and suggests loading it
            # unsafely: never the advice to give for a text file named .npz.
            said = "not a numpy file (no .npz/.npy header: text, or another format?)" if "pickle" in str(err) else err
            raise ConfigError(
                key, str(path), "a .npz (np.savez) or .npy file of numeric arrays", f"cannot read it: {said}"
            ) from None
        require(len(arrays) > 0, key, str(path), "a .npz holding at least one array", "it holds none")
        if keys is not None:
            missing = [k for k in keys if k not in arrays]
            require(not missing, "keys", list(keys), f"names of the file's arrays: {sorted(arrays)}", f"no {missing}")
            arrays = {k: arrays[k] for k in keys if k not in VOCAB_KEYS} | {
                k: arrays[k] for k in VOCAB_KEYS if k in arrays
            }
        return arrays

    def _corpus(self, arrays: dict[str, torch.Tensor], key: str, path: str) -> torch.Tensor:
        """The one 1-D integer array a streams file holds (``x`` when there are several)."""
        ids = [name for name, t in arrays.items() if t.dim() == 1 and not t.is_floating_point()]
        name = "x" if "x" in ids else ids[0] if len(ids) == 1 else None
        require(
            name is not None,
            key,
            path,
            "with layout=streams, a file holding the corpus as one 1-D integer array of token ids (x, or its only one)",
            f"its 1-D integer arrays: {ids or 'none'} (it holds "
            + ", ".join(f"{k}: {str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}" for k, t in arrays.items())
            + ")",
        )
        return arrays[name]

    def load(self) -> dict[str, torch.Tensor]:
        return self.arrays

    def load_parts(self) -> dict[str, dict[str, torch.Tensor]]:
        return self.split

    def setup(self, stage: str | None = None) -> None:
        if self.streams is None and self.train_set is None:
            super().setup(stage)
            # The split holds what the runs read (copies of in-memory arrays): the file's arrays can go.
            self.arrays = self.split = {}


def _largest(t: torch.Tensor | LazyColumn) -> int:
    return t.largest() if isinstance(t, NpyRows) else int(t.max())


# A file's arrays that name its vocabulary rather than hold examples.
VOCAB_KEYS = ("vocab_size", "vocab")


def _vocabulary(arrays: dict[str, np.ndarray], path: Path, key: str) -> Vocabulary | None:
    """The vocabulary a file names (taken out of ``arrays``): ``vocab_size`` (0-d integer) or ``vocab`` (strings)."""
    size, words = arrays.pop("vocab_size", None), arrays.pop("vocab", None)
    if words is not None:
        require(
            words.ndim == 1 and words.dtype.kind == "U" and len(words) > 0,
            key,
            str(path),
            "a `vocab` array of strings (the tokens, id i the i-th)",
            f"its `vocab` is {words.dtype} {words.shape}",
        )
        return Vocabulary([str(w) for w in words])
    if size is not None:
        require(
            size.ndim == 0 and size.dtype.kind in "iu" and int(size) >= 1,
            key,
            str(path),
            "a `vocab_size` array holding one positive integer (np.savez(..., vocab_size=10000))",
            f"its `vocab_size` is {size.dtype} {size.shape}",
        )
        return Vocabulary(int(size))
    return None
