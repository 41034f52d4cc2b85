"""Token ids <-> text, at four levels: UTF-8 bytes, a text's characters, its words, or opaque ids.

Each `Vocabulary` is saved in a checkpoint as one plain value (`Vocabulary.spec`), so a checkpoint
still loads with ``weights_only=True`` and a resume on another vocabulary is refused. Word level is
the word language model's tokenisation: every line's whitespace-separated words and an end-of-line
token (``<eos>``), ids in order of first appearance in the training text, and an unknown-word token
(``<unk>``: the text's own when it has one, as Penn Treebank files do, else one more id) for a word the
training text never had.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Iterable
from typing import Any

import torch

EOS, UNK = "<eos>", "<unk>"


@functools.cache
def pydoc_text() -> str:
    """The default corpus: every ``pydoc_data.topics`` entry, in sorted-key order (each ends with a newline)."""
    from pydoc_data.topics import topics

    return "".join(topics[key] for key in sorted(topics))


def words_of(text: str) -> list[str]:
    """``text``'s words, line by line, each line's followed by ``<eos>`` (a final line without newline too)."""
    return [word for line in io.StringIO(text) for word in (*line.split(), EOS)]


class Vocabulary:
    """Token ids <-> text. Four kinds, by `spec`:

    - UTF-8 bytes (``None``): 256 ids, any text encodes;
    - characters (a string): id i is the i-th character of it;
    - words (a list of strings): id i is the i-th word; a word it lacks encodes as ``<unk>`` in data
      (`encode_words`), and is refused in a prompt (`unknown`);
    - opaque ids (an int n): ids 0..n-1 with no text behind them (a user's own tokens); text is
      written as space-separated ids.
    """

    def __init__(self, spec: str | int | list[str] | tuple[str, ...] | None = None) -> None:
        if isinstance(spec, tuple):
            spec = list(spec)
        if isinstance(spec, bool) or not (spec is None or isinstance(spec, str | int | list)):
            raise TypeError(
                f"a vocabulary is None (bytes), a string of characters, a list of words or a size, not {spec!r}"
            )
        self.spec = spec
        self.index = {tok: i for i, tok in enumerate(spec)} if isinstance(spec, str | list) else {}

    @classmethod
    def from_text(cls, text: str) -> Vocabulary:
        """The sorted set of ``text``'s characters."""
        return cls("".join(sorted(set(text))))

    @classmethod
    def from_words(cls, words: Iterable[str]) -> Vocabulary:
        """``words`` in order of first appearance, then ``<unk>`` unless they hold it."""
        seen = list(dict.fromkeys(words))
        return cls(seen if UNK in seen else [*seen, UNK])

    @property
    def kind(self) -> str:
        if self.spec is None:
            return "bytes"
        return {str: "chars", list: "words", int: "ids"}[type(self.spec)]

    def __len__(self) -> int:
        return 256 if self.spec is None else self.spec if isinstance(self.spec, int) else len(self.spec)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Vocabulary) and other.spec == self.spec

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Vocabulary({self.kind}, {len(self)} ids)"

    def difference(self, other: Vocabulary) -> str:
        """How ``other`` differs from this vocabulary, for a message naming both (empty when they are equal)."""
        if self == other:
            return ""
        if (self.kind, len(self)) != (other.kind, len(other)):
            return f"{self.kind}, {len(self)} ids vs {other.kind}, {len(other)} ids"
        if self.kind in ("bytes", "ids"):
            return ""
        pairs = [(i, a, b) for i, (a, b) in enumerate(zip(self.spec, other.spec)) if a != b]  # type: ignore[arg-type]
        i, a, b = pairs[0]
        return f"{self.kind}, {len(self)} ids each, {len(pairs)} of them other tokens (id {i}: {a!r} vs {b!r})"

    @property
    def separator(self) -> str:
        """What joins decoded tokens: nothing for bytes and characters, a space for words and ids."""
        return " " if self.kind in ("words", "ids") else ""

    def default_prompt(self) -> str:
        """A prompt this vocabulary encodes: ``The`` where it can, else its first token (ids: ``0``)."""
        if self.kind == "ids":
            return "0"
        if self.kind == "words":
            return "The" if "The" in self.index else self.spec[0]  # type: ignore[index]
        return "The " if not self.unknown("The ") else self.spec[0]  # type: ignore[index]

    def unknown(self, text: str) -> list[str]:
        """The parts of ``text`` this vocabulary cannot encode (characters, words, or non-id words)."""
        if self.kind == "chars":
            return sorted(set(text) - set(self.index))
        if self.kind == "words":
            return [w for w in text.split() if w not in self.index]
        if self.kind == "ids":
            return [w for w in text.split() if not (w.isdigit() and int(w) < len(self))]
        return []

    def encode(self, text: str) -> torch.Tensor:
        if self.kind == "bytes":
            ids = list(text.encode("utf-8"))
        elif self.kind == "chars":
            ids = [self.index[ch] for ch in text]
        elif self.kind == "words":
            ids = [self.index[w] for w in text.split()]
        else:
            ids = [int(w) for w in text.split()]
        return torch.tensor(ids, dtype=torch.long)

    def encode_words(self, words: Iterable[str]) -> torch.Tensor:
        """A word-level corpus as ids, a word this vocabulary lacks as ``<unk>``."""
        unk = self.index[UNK]
        return torch.tensor([self.index.get(w, unk) for w in words], dtype=torch.long)

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        if self.kind == "bytes":
            return bytes(ids).decode("utf-8", errors="replace")
        if self.kind == "ids":
            return " ".join(map(str, ids))
        return self.separator.join(self.spec[i] for i in ids)  # type: ignore[index]

    def to_plain(self) -> Any:
        """The spec as checkpoints and hyper-parameters keep it (a list of words stays a list)."""
        return list(self.spec) if isinstance(self.spec, list) else self.spec
