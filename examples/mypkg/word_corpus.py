"""A small word-level corpus in WikiText's shape, from the Python documentation that ships with Python.

``python -m mypkg.word_corpus DIR`` writes ``DIR/train.txt``, ``valid.txt`` and ``test.txt``: the
``pydoc_data.topics`` entries (the text of ``help('topic')``) dealt into the three files 8 : 1 : 1
by a fixed shuffle, lower-cased, punctuation split off into tokens of its own, blank lines and titles'
underlines left out,
and every word seen fewer than ``MIN_COUNT`` times in the training file written as ``<unk>``, in the
validation and test files too (as WikiText and Penn Treebank ship: no word of valid/test is missing
from train). Any word-level reader then builds the same vocabulary from train.txt, whether it adds
the other files' words or not. The shipped files (examples/data/words) were written by Python 3.11's
topics; the script is here to show how, and to make a corpus of another Python's.
"""

from __future__ import annotations

import random
import re
import sys
from collections import Counter
from pathlib import Path

MIN_COUNT = 3
UNK = "<unk>"
TOKEN = re.compile(r"[a-z0-9_]+|[^\sa-z0-9_]")
UNDERLINE = re.compile(r"\s*([*=~^-])\1+\s*")  # a title's ******** or ----- line


def _lines(entry: str) -> list[list[str]]:
    lines = [line for line in entry.lower().splitlines() if not UNDERLINE.fullmatch(line)]
    return [tokens for line in lines if (tokens := TOKEN.findall(line))]


def write_corpus(directory: Path, seed: int = 0) -> dict[str, Path]:
    from pydoc_data.topics import topics

    keys = sorted(topics)
    random.Random(seed).shuffle(keys)
    n = len(keys)
    parts = {"train": keys[: n * 8 // 10], "valid": keys[n * 8 // 10 : n * 9 // 10], "test": keys[n * 9 // 10 :]}
    lines = {part: [line for key in part_keys for line in _lines(topics[key])] for part, part_keys in parts.items()}
    counts = Counter(word for line in lines["train"] for word in line)
    known = {word for word, count in counts.items() if count >= MIN_COUNT}
    directory.mkdir(parents=True, exist_ok=True)
    paths = {}
    for part, part_lines in lines.items():
        paths[part] = directory / f"{part}.txt"
        text = "".join(" ".join(w if w in known else UNK for w in line) + "\n" for line in part_lines)
        paths[part].write_text(text, encoding="utf-8")
    return paths


if __name__ == "__main__":
    for path in write_corpus(Path(sys.argv[1] if len(sys.argv) > 1 else "examples/data/words")).values():
        words = path.read_text(encoding="utf-8").split()
        print(f"{path}: {len(words)} words, {len(set(words))} distinct")
