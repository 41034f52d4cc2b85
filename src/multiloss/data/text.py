"""Text as token sequences for language models: any UTF-8 file, or CPython's own docs (the default).

Three tokenisations, none needing a download or a trained tokenizer (`multiloss.data.vocabulary`):

- ``level=bytes``: the file's UTF-8 bytes, ids 0-255. The vocabulary is fixed (256), so any
  byte-level network fits any file, and a checkpoint continues on another file.
- ``level=chars``: the characters, with the vocabulary built from every file given (training,
  validation, test alike): the sorted set of their characters, id i = the i-th. The id of a character
  never depends on the split, on ``seq_len`` or on the order files were read.
- ``level=words``: the word language model's tokens: each line's whitespace-separated words and an
  ``<eos>``; the vocabulary is the training text's words in order of first appearance, and a word the
  training text never had is ``<unk>`` (the text's own when it has one, as Penn Treebank's files do).

Two layouts (``layout``): ``sequences`` (windows of ``seq_len + 1`` tokens, shuffled, each a fresh
sequence: a recipe starts every batch from an empty state) and ``streams`` (`multiloss.data.streams`:
B contiguous streams read in order, batch t the t-th window of each, so a recipe carries its state
from one batch into the next — the truncated BPTT of language modelling).

The default corpus is CPython's ``pydoc_data.topics`` (≈465k characters, ships with every Python).
The data module exposes its `Vocabulary` as ``vocab``; the tbptt recipe takes it from there (for the
network's size, for sampling, and into its checkpoints), and its ``layout``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import torch
from torch.utils.data import StackDataset

from multiloss.config import ConfigError, require
from multiloss.data.arrays import ArrayDataModule
from multiloss.data.streams import TokenStreams
from multiloss.data.vocabulary import Vocabulary, pydoc_text, words_of

__all__ = ["TextDataModule", "Vocabulary", "pydoc_text", "windows"]


def windows(ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """(N, seq_len + 1) windows with stride ``seq_len``: each token is a target exactly once.

    Consecutive windows share one token (the last target of one is the first input of the next),
    so no target is lost at the seams.
    """
    n = (len(ids) - 1) // seq_len
    return ids[: n * seq_len + 1].unfold(0, seq_len + 1, seq_len) if n > 0 else ids.new_empty(0, seq_len + 1)


class TextDataModule(ArrayDataModule):
    """Token sequences of a text: ``x`` = ids[:-1], ``y`` = ids[1:] (the next token), each ``(batch, length)``.

    ``path``: the training text (``level=chars`` and ``words`` need UTF-8; ``level=bytes`` reads any
    file), or null for CPython's ``pydoc_data`` docs. ``val_path`` / ``test_path``: the validation and
    test texts; without ``val_path`` the validation text is the last ``val_fraction`` (default 0.1) of
    the training text, a contiguous tail cut before windowing: the same tokens whatever ``seq_len``
    is, so validation scores are comparable across ``seq_len`` and chunk lengths.

    ``layout=sequences``: examples are windows of ``seq_len + 1`` tokens; the training windows keep the
    base class's loaders (order a function of (seed, epoch), rank-sharded, resumable mid-epoch).
    ``layout=streams``: ``batch_size`` streams per rank (``val_batch_size`` for validation and test),
    read window by window in order (`multiloss.data.streams`); ``shuffle`` does not apply.

    Raises:
        ConfigError: a file missing or empty, or not UTF-8 with ``level=chars``/``words``; ``seq_len`` < 1,
            or so long that the training or validation text holds no complete sequence (sequences), or too
            many streams for the text (streams); ``val_fraction`` with ``val_path``; ``shuffle=true`` with
            streams; the base class's checks.
    """

    def __init__(
        self,
        path: str | None = None,
        level: Literal["bytes", "chars", "words"] = "bytes",
        layout: Literal["sequences", "streams"] = "sequences",
        seq_len: int = 128,
        batch_size: int = 64,
        val_batch_size: int | None = None,
        shuffle: bool | None = None,
        num_workers: int = 0,
        val_fraction: float | None = None,
        val_path: str | None = None,
        test_path: str | None = None,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        for given, key in ((path, "path"), (val_path, "val_path"), (test_path, "test_path")):
            require(given is None or os.path.isfile(given), key, given, "an existing text file", "no such file")
        require(
            val_path is None or not val_fraction,
            "val_fraction",
            val_fraction,
            f"null or 0 with data.val_path={val_path} (the validation text is that file)",
        )
        require(
            layout == "sequences" or shuffle is not True,
            "shuffle",
            shuffle,
            "null or false with layout=streams: streams are read in order, every window after the one before",
        )
        val_fraction = (0.0 if val_path is not None else 0.1) if val_fraction is None else val_fraction
        super().__init__(
            batch_size=batch_size,
            val_batch_size=val_batch_size,
            shuffle=shuffle is not False,
            num_workers=num_workers,
            val_fraction=val_fraction,
            seed=seed,
            drop_last=drop_last,
        )
        require(seq_len >= 1, "seq_len", seq_len, "an integer ≥ 1 (tokens per training sequence)")
        require(level in ("bytes", "chars", "words"), "level", level, "bytes (UTF-8 bytes, 256 ids), chars or words")
        require(layout in ("sequences", "streams"), "layout", layout, "sequences or streams")
        self.path, self.level, self.layout, self.seq_len = path, level, layout, seq_len
        # Read and checked here, not in setup(): a rejected run must fail before any file is written.
        texts = {"train": self._read(path, "path")}
        for part, part_path, key in (("val", val_path, "val_path"), ("test", test_path, "test_path")):
            if part_path is not None:
                texts[part] = self._read(part_path, key)
        self.vocab = self._vocabulary(texts)
        self.ids = {part: self._encode(text) for part, text in texts.items()}
        if val_path is None:
            cut = len(self.ids["train"]) - round(len(self.ids["train"]) * val_fraction)
            self.ids["train"], self.ids["val"] = self.ids["train"][:cut], self.ids["train"][cut:]
        if layout == "streams":
            parts = {part: ids for part, ids in self.ids.items() if part == "train" or len(ids)}
            self.streams = TokenStreams(parts, batch_size, self.val_batch_size, seq_len)
            return
        for part, ids in self.ids.items():
            if part == "val" and val_fraction == 0 and val_path is None:
                continue
            require(
                len(ids) > seq_len,
                "seq_len",
                seq_len,
                f"at most {len(ids) - 1} (the {part} text holds {len(ids)} tokens; "
                f"lower seq_len{', or change data.val_fraction' if val_path is None else ''})",
                f"no complete {part} sequence",
            )

    @property
    def train_ids(self) -> torch.Tensor:
        return self.ids["train"]

    @property
    def val_ids(self) -> torch.Tensor:
        return self.ids["val"]

    def _read(self, path: str | None, key: str) -> str | bytes:
        """The file's text (bytes at ``level=bytes``), or the pydoc corpus."""
        if path is None:
            return pydoc_text().encode("utf-8") if self.level == "bytes" else pydoc_text()
        try:
            raw = Path(path).read_bytes()
        except OSError as err:
            raise ConfigError(key, path, "a text file this process can read", f"cannot read it: {err}") from None
        require(len(raw) > 0, key, path, "a non-empty text file", "the file is empty")
        if self.level == "bytes":
            return raw
        try:
            # As open(path, encoding="utf-8") reads it: universal newlines (\r\n and \r become \n).
            return raw.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
        except UnicodeDecodeError as err:
            raise ConfigError(
                key,
                path,
                f"a UTF-8 text file with level={self.level}, or data.level=bytes (any file)",
                f"not UTF-8: {err.reason} at byte {err.start}",
            ) from None

    def _vocabulary(self, texts: dict[str, str | bytes]) -> Vocabulary:
        if self.level == "bytes":
            return Vocabulary(None)
        if self.level == "chars":
            return Vocabulary.from_text("".join(texts.values()))  # type: ignore[arg-type]
        if "val" in texts:  # words: the training file's
            return Vocabulary.from_words(words_of(texts["train"]))  # type: ignore[arg-type]
        # One text, split at its tail: the words of the part trained on.
        words = words_of(texts["train"])  # type: ignore[arg-type]
        val_fraction = self.val_fraction
        return Vocabulary.from_words(words[: len(words) - round(len(words) * val_fraction)])

    def _encode(self, text: str | bytes) -> torch.Tensor:
        if self.level == "bytes":
            return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()  # type: ignore[arg-type]
        if self.level == "words":
            return self.vocab.encode_words(words_of(text))  # type: ignore[arg-type]
        return self.vocab.encode(text)  # type: ignore[arg-type]

    @property
    def max_token_id(self) -> int:
        """The largest token id in the data (every id is the vocabulary's by construction)."""
        return max(int(ids.max()) for ids in self.ids.values() if len(ids))

    def load(self) -> dict[str, torch.Tensor]:
        """All windows as ``x`` and ``y``: the training text's first, then the validation text's."""
        train, val = windows(self.ids["train"], self.seq_len), windows(self.ids["val"], self.seq_len)
        self.n_train = len(train)
        seqs = torch.cat([train, val])
        return {"x": seqs[:, :-1], "y": seqs[:, 1:]}

    def setup(self, stage: str | None = None) -> None:
        # Not the base class's random split of examples: the validation text is its own.
        if self.train_set is not None or self.streams is not None:
            return
        arrays = self.load()
        self.train_set = StackDataset(**{k: v[: self.n_train] for k, v in arrays.items()})
        self.val_set = StackDataset(**{k: v[self.n_train :] for k, v in arrays.items()})
        test = windows(self.ids.get("test", self.ids["train"][:0]), self.seq_len)
        self.test_set = StackDataset(x=test[:, :-1], y=test[:, 1:])
