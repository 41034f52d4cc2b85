"""Text as token sequences for language models: any UTF-8 file, or CPython's own docs (the default).

Two tokenisations, both without a download or a trained tokenizer:

- ``level=bytes``: the file's UTF-8 bytes, ids 0-255. The vocabulary is fixed (256), so any
  byte-level network fits any file, and a checkpoint continues on another file.
- ``level=chars``: the file's characters, with the vocabulary built from the whole file (train and
  validation alike): the sorted set of its characters, id i = the i-th. The id of a character never
  depends on the train/validation split, on ``seq_len`` or on the order files were read.

The default corpus is CPython's ``pydoc_data.topics`` (≈465k characters, ships with every Python),
read at the character level. The data module exposes its `Vocabulary` as ``vocab``; the tbptt
recipe takes it from there (for the network's size, for sampling, and into its checkpoints).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Literal

import torch
from torch.utils.data import StackDataset

from multiloss.config import ConfigError, require
from multiloss.data.arrays import ArrayDataModule


@functools.cache
def pydoc_text() -> str:
    """The default corpus: every ``pydoc_data.topics`` entry, in sorted-key order (each ends with a newline)."""
    from pydoc_data.topics import topics

    return "".join(topics[key] for key in sorted(topics))


class Vocabulary:
    """Token ids <-> text. Three kinds, each saved in a checkpoint as one plain value (`spec`):

    - UTF-8 bytes (``spec`` None): 256 ids, any text encodes;
    - characters (``spec`` a string): id i is the i-th character of ``chars``;
    - opaque ids (``spec`` an int n): ids 0..n-1 with no text behind them (a user's own tokens); text
      is written as space-separated ids.
    """

    def __init__(self, spec: str | int | None = None) -> None:
        if isinstance(spec, bool) or not (spec is None or isinstance(spec, str | int)):
            raise TypeError(f"a vocabulary is None (bytes), a string of characters or a size, not {spec!r}")
        self.spec = spec
        self.index = {ch: i for i, ch in enumerate(spec)} if isinstance(spec, str) else {}

    @classmethod
    def from_text(cls, text: str) -> Vocabulary:
        """The sorted set of ``text``'s characters."""
        return cls("".join(sorted(set(text))))

    @property
    def kind(self) -> str:
        return "bytes" if self.spec is None else "chars" if isinstance(self.spec, str) else "ids"

    def __len__(self) -> int:
        return 256 if self.spec is None else len(self.spec) if isinstance(self.spec, str) else self.spec

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Vocabulary) and other.spec == self.spec

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Vocabulary({self.kind}, {len(self)} ids)"

    def unknown(self, text: str) -> list[str]:
        """The parts of ``text`` this vocabulary cannot encode (characters, or non-id words)."""
        if self.kind == "chars":
            return sorted(set(text) - set(self.index))
        if self.kind == "ids":
            return [w for w in text.split() if not (w.isdigit() and int(w) < len(self))]
        return []

    def encode(self, text: str) -> torch.Tensor:
        if self.kind == "bytes":
            ids = list(text.encode("utf-8"))
        elif self.kind == "chars":
            ids = [self.index[ch] for ch in text]
        else:
            ids = [int(w) for w in text.split()]
        return torch.tensor(ids, dtype=torch.long)

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        if self.kind == "bytes":
            return bytes(ids).decode("utf-8", errors="replace")
        if self.kind == "chars":
            return "".join(self.spec[i] for i in ids)  # type: ignore[index]
        return " ".join(map(str, ids))


def windows(ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """(N, seq_len + 1) windows with stride ``seq_len``: each token is a target exactly once.

    Consecutive windows share one token (the last target of one is the first input of the next),
    so no target is lost at the seams.
    """
    n = (len(ids) - 1) // seq_len
    return ids[: n * seq_len + 1].unfold(0, seq_len + 1, seq_len) if n > 0 else ids.new_empty(0, seq_len + 1)


class TextDataModule(ArrayDataModule):
    """Token sequences of a text: ``x`` = ids[:, :-1], ``y`` = ids[:, 1:] (the next token), each ``(batch, seq_len)``.

    ``path``: a text file (``level=chars`` needs UTF-8; ``level=bytes`` reads any file), or null for
    CPython's ``pydoc_data`` docs. Examples are windows of ``seq_len + 1`` tokens. The held-out
    validation slice is the last ``val_fraction`` of the text (a contiguous tail, cut before
    windowing): the same tokens whatever ``seq_len`` is, so validation bits per token are
    comparable across ``seq_len`` and chunk lengths, and no window straddles the cut. The training
    windows keep the base class's loaders: order a function of (seed, epoch), rank-sharded,
    resumable mid-epoch. ``vocab`` is the text's `Vocabulary`.

    Raises:
        ConfigError: ``path`` missing, or not UTF-8 with ``level=chars``; ``seq_len`` < 1, or so long
            that the training or validation slice holds no complete sequence; the base class's checks.
    """

    def __init__(
        self,
        path: str | None = None,
        level: Literal["bytes", "chars"] = "bytes",
        seq_len: int = 128,
        batch_size: int = 64,
        shuffle: bool = True,
        num_workers: int = 0,
        val_fraction: float = 0.1,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        super().__init__(
            batch_size=batch_size,
            shuffle=shuffle,
            num_workers=num_workers,
            val_fraction=val_fraction,
            seed=seed,
            drop_last=drop_last,
        )
        require(seq_len >= 1, "seq_len", seq_len, "an integer ≥ 1 (tokens per training sequence)")
        require(level in ("bytes", "chars"), "level", level, "bytes (UTF-8 bytes, 256 ids) or chars")
        self.path, self.level, self.seq_len = path, level, seq_len
        # Read and checked here, not in setup(): a rejected run must fail before any file is written.
        ids, self.vocab = self._read()
        cut = len(ids) - round(len(ids) * val_fraction)
        self.train_ids, self.val_ids = ids[:cut], ids[cut:]
        for part, ids in (("training", self.train_ids), ("validation", self.val_ids)):
            if part == "validation" and val_fraction == 0:
                continue
            require(
                len(ids) > seq_len,
                "seq_len",
                seq_len,
                f"at most {len(ids) - 1} (the {part} slice holds {len(ids)} tokens; "
                f"lower seq_len or change data.val_fraction)",
                f"no complete {part} sequence",
            )

    def _read(self) -> tuple[torch.Tensor, Vocabulary]:
        if self.path is None:
            text = pydoc_text()
        else:
            require(Path(self.path).is_file(), "path", self.path, "an existing text file", "no such file")
            raw = Path(self.path).read_bytes()
            require(len(raw) > 0, "path", self.path, "a non-empty text file", "the file is empty")
            if self.level == "bytes":
                return torch.frombuffer(bytearray(raw), dtype=torch.uint8).long(), Vocabulary(None)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ConfigError(
                    "path",
                    self.path,
                    "a UTF-8 text file with level=chars, or data.level=bytes (any file)",
                    f"not UTF-8: {err.reason} at byte {err.start}",
                ) from None
        vocab = Vocabulary(None) if self.level == "bytes" else Vocabulary.from_text(text)
        return vocab.encode(text), vocab

    def load(self) -> dict[str, torch.Tensor]:
        """All windows as ``x`` and ``y``: the training slice's first, then the validation slice's."""
        train, val = windows(self.train_ids, self.seq_len), windows(self.val_ids, self.seq_len)
        self.n_train = len(train)
        seqs = torch.cat([train, val])
        return {"x": seqs[:, :-1], "y": seqs[:, 1:]}

    def setup(self, stage: str | None = None) -> None:
        # Not the base class's random split of examples: the validation slice is the text's tail.
        if self.train_set is not None:
            return
        arrays = self.load()
        self.train_set = StackDataset(**{k: v[: self.n_train] for k, v in arrays.items()})
        self.val_set = StackDataset(**{k: v[self.n_train :] for k, v in arrays.items()})
