"""CPython's own documentation (``pydoc_data.topics``, ≈465k characters) as a character-level corpus.

It ships with every Python, so nothing downloads. The text is the topics joined in sorted-key
order; the vocabulary is the sorted set of characters of that whole text, so the id of a character
never depends on the train/validation split, on ``seq_len`` or on the order files were read: a
checkpoint's embedding rows and a sample's decoding stay meaningful across runs. (Another Python
release ships a slightly different text; the recipe stores the vocabulary in its checkpoints and
refuses one whose vocabulary differs.)
"""

from __future__ import annotations

import functools

import torch
from torch.utils.data import StackDataset

from multiloss.config import require
from multiloss.data.arrays import ArrayDataModule


@functools.cache
def pydoc_text() -> str:
    """The corpus: every ``pydoc_data.topics`` entry, in sorted-key order (each ends with a newline)."""
    from pydoc_data.topics import topics

    return "".join(topics[key] for key in sorted(topics))


class CharVocab:
    """Characters <-> ids: id i is the i-th character of ``chars`` (sorted, unique)."""

    def __init__(self, chars: str) -> None:
        self.chars = chars
        self.index = {ch: i for i, ch in enumerate(chars)}

    @classmethod
    def from_text(cls, text: str) -> CharVocab:
        return cls("".join(sorted(set(text))))

    @classmethod
    def pydoc(cls) -> CharVocab:
        """The vocabulary of the whole `pydoc_text` corpus (train and validation alike)."""
        return cls.from_text(pydoc_text())

    def __len__(self) -> int:
        return len(self.chars)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CharVocab) and other.chars == self.chars

    __hash__ = None  # type: ignore[assignment]

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.index[ch] for ch in text], dtype=torch.long)

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        return "".join(self.chars[i] for i in (ids.tolist() if isinstance(ids, torch.Tensor) else ids))


def windows(ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """(N, seq_len + 1) windows with stride ``seq_len``: each character is a target exactly once.

    Consecutive windows share one character (the last target of one is the first input of the
    next), so no target is lost at the seams.
    """
    n = (len(ids) - 1) // seq_len
    return ids[: n * seq_len + 1].unfold(0, seq_len + 1, seq_len) if n > 0 else ids.new_empty(0, seq_len + 1)


class PydocTextDataModule(ArrayDataModule):
    """Character sequences of CPython's ``pydoc_data.topics``: ``x`` = ids[:, :-1], ``y`` = ids[:, 1:].

    Examples are windows of ``seq_len + 1`` characters (a ``(N, seq_len + 1)`` long tensor), so a
    batch is ``x`` and ``y`` of shape ``(batch_size, seq_len)``, ``y`` shifted by one. The held-out
    validation slice is the last ``val_fraction`` of the text (a contiguous tail, cut before
    windowing): the same characters whatever ``seq_len`` is, so validation bits per character are
    comparable across ``seq_len`` and chunk lengths, and no window straddles the cut. The training
    windows keep the base class's loaders: order a function of (seed, epoch), rank-sharded,
    resumable mid-epoch.

    Raises:
        ConfigError: ``seq_len`` < 1, or so long that the training or validation slice holds no
            complete sequence; and the base class's checks.
    """

    def __init__(
        self,
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
        require(seq_len >= 1, "seq_len", seq_len, "an integer ≥ 1 (characters per training sequence)")
        self.seq_len = seq_len
        self.vocab = CharVocab.pydoc()
        # Checked here, not in setup(): a rejected run must fail before any file is written.
        train_text, val_text = self._texts()
        for part, text in (("training", train_text), ("validation", val_text)):
            if part == "validation" and val_fraction == 0:
                continue
            require(
                len(text) > seq_len,
                "seq_len",
                seq_len,
                f"at most {len(text) - 1} (the {part} slice holds {len(text)} characters; "
                f"lower seq_len or change data.val_fraction)",
                f"no complete {part} sequence",
            )

    def _texts(self) -> tuple[str, str]:
        text = pydoc_text()
        cut = len(text) - round(len(text) * self.val_fraction)
        return text[:cut], text[cut:]

    def load(self) -> dict[str, torch.Tensor]:
        """All windows as ``x`` and ``y``: the training slice's first, then the validation slice's."""
        train, val = (windows(self.vocab.encode(t), self.seq_len) for t in self._texts())
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
