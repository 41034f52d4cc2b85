"""The offline data modules: splits, order as a function of (seed, epoch), rank sharding, resumable loaders."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from multiloss.config import ConfigError
from multiloss.data import (
    DigitPairsDataModule,
    DigitsDataModule,
    NpzDataModule,
    TaskRegressionDataModule,
    TextDataModule,
)
from multiloss.data.batches import as_dict
from multiloss.data.vocabulary import Vocabulary


def _order(loader) -> list[int]:
    return [int(i) for i in loader.sampler]


def _ready(**kwargs) -> DigitsDataModule:
    dm = DigitsDataModule(**kwargs)
    dm.setup("fit")
    return dm


def test_digits_split_is_fixed_and_disjoint():
    a, b = _ready(seed=0), _ready(seed=123)
    assert len(a.train_set) + len(a.val_set) == 1797
    assert len(a.val_set) == 359
    # The split follows split_seed only: changing the training seed keeps the validation set.
    assert torch.equal(a.val_set.datasets["x"], b.val_set.datasets["x"])
    assert set(a.train_index.tolist()).isdisjoint(a.val_index.tolist())
    batch = next(iter(a.train_dataloader()))
    assert batch["x"].shape == (64, 64) and batch["y"].dtype == torch.long
    assert batch["x"].min() >= 0.0 and batch["x"].max() <= 1.0
    # The targets derived for multi-task models: odd/even and the mean ink of each image.
    assert torch.equal(batch["parity"], (batch["y"] % 2).float())
    assert torch.allclose(batch["ink"], batch["x"].mean(dim=1))


def test_digit_pairs_hold_both_digits_with_their_classes():
    """Each 12×12 image is digit i top left and its partner bottom right (brighter pixel where they meet)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images, labels = torch.tensor(digits.images, dtype=torch.float32) / 16.0, torch.tensor(digits.target)
    data = DigitPairsDataModule(offset=3, val_fraction=0.0)
    arrays = data.load()
    assert arrays["x"].shape == (1797, 144) and arrays["left"].dtype == arrays["right"].dtype == torch.long
    canvas = arrays["x"].view(-1, 12, 12)
    assert torch.equal(arrays["left"], labels)
    for i in (0, 1, 500, 1796):
        # Left: image i where the partner does not reach; at (3, 3): the max of a digit of class
        # right[i] and image i's overlapping part.
        assert canvas[i, :3, :8].equal(images[i, :3]) and canvas[i, :8, :3].equal(images[i, :, :3])
        left_part = torch.nn.functional.pad(images[i, 3:, 3:], (0, 3, 0, 3))
        assert any(
            torch.equal(canvas[i, 3:11, 3:11], torch.maximum(images[j], left_part))
            for j in torch.nonzero(labels == arrays["right"][i]).flatten().tolist()
        )
    # Pairs are a fixed permutation: every image is some example's right digit once; not the identity.
    assert torch.bincount(arrays["right"], minlength=10).tolist() == torch.bincount(labels, minlength=10).tolist()
    assert (arrays["left"] != arrays["right"]).float().mean() > 0.8
    assert torch.equal(DigitPairsDataModule(offset=3).load()["x"], arrays["x"])  # no randomness but pair_seed
    assert not torch.equal(DigitPairsDataModule(offset=3, pair_seed=1).load()["right"], arrays["right"])
    with pytest.raises(ConfigError) as err:
        DigitPairsDataModule(offset=5)
    assert err.value.key == "offset"


def test_task_regression_has_the_correlation_it_is_given():
    """MMoE's construction: the K weight vectors have pairwise cosine ρ and norm c; each target is wₖ·x plus the
    shared sines of wₖ·x (recomputed here from the weights); more ρ, more correlated targets; data_seed alone."""
    for rho in (0.0, 0.3, 1.0):
        data = TaskRegressionDataModule(n_tasks=5, correlation=rho, in_features=8, scale=2.0, noise=0.0, n_sines=0)
        w = data.task_weights()
        cos = torch.nn.functional.cosine_similarity(w[:, None], w[None], dim=-1)
        off = ~torch.eye(5, dtype=torch.bool)
        assert torch.allclose(cos[off], torch.full((20,), rho, dtype=torch.float64), atol=1e-12)
        assert torch.allclose(w.norm(dim=1), torch.full((5,), 2.0, dtype=torch.float64))
        arrays = data.load()
        assert set(arrays) == {"x", "y0", "y1", "y2", "y3", "y4"} and arrays["x"].shape == (4000, 8)
        assert torch.allclose(arrays["y3"], (arrays["x"].double() @ w[3]).float(), atol=1e-5)  # no sines, no noise
    correlations = []
    for rho in (0.1, 0.9):
        y = TaskRegressionDataModule(correlation=rho).load()
        correlations.append(torch.corrcoef(torch.stack([y[f"y{k}"] for k in range(4)]))[0, 1:].mean().item())
    assert correlations[0] < 0.3 < 0.7 < correlations[1]
    assert torch.equal(TaskRegressionDataModule(seed=5).load()["y2"], TaskRegressionDataModule(seed=6).load()["y2"])
    assert not torch.equal(TaskRegressionDataModule(data_seed=1).load()["y2"], TaskRegressionDataModule().load()["y2"])
    for key, value in (("correlation", 1.5), ("n_tasks", 0), ("in_features", 4), ("noise", -1.0)):
        with pytest.raises(ConfigError) as err:
            TaskRegressionDataModule(**{key: value})
        assert err.value.key == key


def test_training_order_is_a_function_of_seed_and_epoch():
    loader = _ready(seed=7).train_dataloader()
    first = _order(loader)
    assert sorted(first) == list(range(len(first)))  # a permutation
    assert _order(_ready(seed=7).train_dataloader()) == first  # same seed, same epoch: same order
    loader.sampler.set_epoch(1)
    assert _order(loader) != first  # next epoch: reshuffled
    assert _order(_ready(seed=8).train_dataloader()) != first
    assert _order(_ready(shuffle=False).train_dataloader()) == list(range(len(first)))  # shuffle honoured


def test_ranks_shard_the_order_disjointly(monkeypatch):
    dm = _ready(shuffle=False)
    shards = []
    for rank in (0, 1):
        monkeypatch.setattr(dm, "_ranks", lambda rank=rank: (2, rank))
        shards.append(_order(dm.train_dataloader()))
    assert shards[0][:3] == [0, 2, 4] and shards[1][:3] == [1, 3, 5]
    assert len(dm.train_set) % 2 == 0  # so no padding: the shards are disjoint
    assert set(shards[0]).isdisjoint(shards[1])
    assert set(shards[0]) | set(shards[1]) == set(range(len(dm.train_set)))


def test_loader_resumes_mid_epoch_on_the_next_batch():
    loader = _ready(seed=3).train_dataloader()
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.state_dict()
    expected = next(it)

    fresh = _ready(seed=3).train_dataloader()
    fresh.load_state_dict(state)
    assert torch.equal(next(iter(fresh))["x"], expected["x"])


def test_npz_serves_every_array_under_its_own_name_with_its_dtype(tmp_path):
    path = tmp_path / "shapes.npz"
    rng = np.random.default_rng(0)
    np.savez(
        path,
        x=rng.random((40, 1, 4, 4)),  # float64 images: float32, shape kept
        shape=np.arange(40) % 3,  # int: int64
        big=np.arange(40) % 2 == 0,  # bool: float32 0/1 (a BCE target)
        area=rng.random(40).astype(np.float16),
    )
    dm = NpzDataModule(str(path), batch_size=8, val_fraction=0.25)
    dm.setup("fit")
    assert (len(dm.train_set), len(dm.val_set)) == (30, 10)
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"x", "shape", "big", "area"}
    assert batch["x"].shape == (8, 1, 4, 4) and batch["x"].dtype == torch.float32
    assert batch["shape"].dtype == torch.int64 and batch["area"].dtype == torch.float32
    assert batch["big"].dtype == torch.float32 and set(batch["big"].tolist()) <= {0.0, 1.0}

    # Options: a subset, renamed, flattened, another dtype.
    dm = NpzDataModule(
        str(path), keys=["x", "shape"], rename={"shape": "y"}, flatten=["x"], dtypes={"x": "float64"}, batch_size=8
    )
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"x", "y"} and batch["x"].shape == (8, 16) and batch["x"].dtype == torch.float64


def test_npz_with_only_x_and_npy_files(tmp_path):
    np.savez(tmp_path / "points.npz", x=np.zeros((10, 2), dtype=np.float32))
    dm = NpzDataModule(str(tmp_path / "points.npz"), batch_size=4)
    dm.setup("fit")
    assert set(next(iter(dm.train_dataloader()))) == {"x"}
    np.save(tmp_path / "x.npy", np.ones((6, 3)))
    np.save(tmp_path / "y.npy", np.arange(6))
    dm = NpzDataModule(str(tmp_path / "x.npy"), y_path=str(tmp_path / "y.npy"), batch_size=2)
    dm.setup("fit")
    assert set(next(iter(dm.train_dataloader()))) == {"x", "y"}


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"path": "/no/such.npz"}, "path"),
        ({"keys": ["nope"]}, "keys"),
        ({"rename": {"nope": "x"}}, "rename.nope"),
        ({"flatten": ["nope"]}, "flatten"),
        ({"dtypes": {"x": "float99"}}, "dtypes.x"),
        ({"batch_size": 0}, "batch_size"),
    ],
)
def test_npz_rejects_bad_settings_by_name(tmp_path, kwargs, key):
    path = tmp_path / "mine.npz"
    np.savez(path, x=np.zeros((4, 2)), y=np.zeros(4))
    with pytest.raises(ConfigError) as err:
        NpzDataModule(**{"path": str(path), **kwargs})
    assert err.value.key == key


@pytest.mark.parametrize(
    ("arrays", "said"),
    [
        ({"x": np.zeros((4, 2)), "y": np.zeros(5)}, "lengths differ"),
        ({"x": np.zeros((0, 2))}, "empty"),
        ({"x": np.zeros((4, 2)), "name": np.array(["a", "b", "c", "d"])}, "not a numeric array"),
        ({"x": np.array([{"a": 1}] * 4, dtype=object)}, "cannot read it"),  # a pickle: never loaded
        ({"x": np.array([[0.0, np.nan], [1.0, 2.0]])}, "1 NaN/inf value"),
        ({"x": np.zeros((2, 2)), "w": np.array([1.0, np.inf])}, "'w' holds 1 NaN/inf"),
    ],
)
def test_npz_rejects_bad_files(tmp_path, arrays, said):
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    with pytest.raises(ConfigError, match=said) as err:
        NpzDataModule(str(path))
    assert err.value.key == "path"
    (tmp_path / "junk.npz").write_bytes(b"not a zip at all")
    with pytest.raises(ConfigError, match="cannot read it"):
        NpzDataModule(str(tmp_path / "junk.npz"))


def test_text_file_as_bytes_or_characters(tmp_path):
    path = tmp_path / "poem.txt"
    text = "Ünïcode lines, again and again.\n" * 40
    path.write_text(text, encoding="utf-8")
    as_bytes = TextDataModule(str(path), seq_len=16, batch_size=4)
    assert len(as_bytes.vocab) == 256 and as_bytes.vocab.kind == "bytes"
    as_chars = TextDataModule(str(path), level="chars", seq_len=16, batch_size=4)
    assert as_chars.vocab.spec == "".join(sorted(set(text)))
    for dm in (as_bytes, as_chars):
        dm.setup("fit")
        batch = next(iter(dm.train_dataloader()))
        assert batch["x"].shape == batch["y"].shape == (4, 16)
        assert torch.equal(batch["x"][:, 1:], batch["y"][:, :-1])
        assert dm.vocab.decode(dm.train_ids[:12]) in text
    assert as_chars.vocab.decode(as_chars.vocab.encode("again")) == "again"
    assert as_bytes.vocab.decode(as_bytes.vocab.encode("Ünï")) == "Ünï"  # multi-byte characters round-trip


def test_text_rejects_missing_and_non_utf8_files(tmp_path):
    with pytest.raises(ConfigError) as err:
        TextDataModule(str(tmp_path / "none.txt"))
    assert err.value.key == "path"
    (tmp_path / "latin1.txt").write_bytes("café crème ".encode("latin-1") * 100)
    with pytest.raises(ConfigError, match="not UTF-8") as err:
        TextDataModule(str(tmp_path / "latin1.txt"), level="chars")
    assert err.value.key == "path"
    assert len(TextDataModule(str(tmp_path / "latin1.txt"), seq_len=8).vocab) == 256  # as bytes: any file


def test_batches_may_be_dicts_tuples_or_tensors():
    x, y = torch.zeros(2, 3), torch.ones(2)
    assert as_dict({"x": x})["x"] is x
    assert set(as_dict((x, y))) == {"x", "y"} and as_dict([x, y])["y"] is y
    assert set(as_dict((x,))) == {"x"} and as_dict(x)["x"] is x
    with pytest.raises(ConfigError, match="cannot tell which item is which"):
        as_dict((x, y, y))


# --- word level, separate validation and test files, token data in an npz -------------------------


class _Dictionary:
    """The word language model's dictionary, written from its description: a word gets the next id when first seen."""

    def __init__(self) -> None:
        self.word2idx: dict[str, int] = {}

    def add_word(self, word: str) -> int:
        return self.word2idx.setdefault(word, len(self.word2idx))


def _corpus_ids(dictionary: _Dictionary, path) -> list[int]:
    """Its tokenize(): every line's words and <eos>, each added to the dictionary, then their ids."""
    with open(path, encoding="utf8") as f:
        words = [w for line in f for w in [*line.split(), "<eos>"]]
    return [dictionary.add_word(w) for w in words]


def test_words_are_the_word_language_models_tokens(tmp_path):
    files = {
        "train": "the cat sat\n\n  on the   mat\nthe end",  # an empty line, runs of spaces, no final newline
        "valid": "the cat\non the mat\n",
        "test": "sat the end\n",
    }
    for name, text in files.items():
        (tmp_path / f"{name}.txt").write_text(text)
    reference = _Dictionary()
    expected = {name: _corpus_ids(reference, tmp_path / f"{name}.txt") for name in files}
    dm = TextDataModule(
        str(tmp_path / "train.txt"),
        level="words",
        val_path=str(tmp_path / "valid.txt"),
        test_path=str(tmp_path / "test.txt"),
        seq_len=2,
        batch_size=1,
    )
    assert dm.vocab.spec[: len(reference.word2idx)] == list(reference.word2idx)
    assert dm.vocab.spec[-1] == "<unk>" and len(dm.vocab) == len(reference.word2idx) + 1  # the training text has none
    for part, name in (("train", "train"), ("val", "valid"), ("test", "test")):
        assert dm.ids[part].tolist() == expected[name], part
    # A word the training text never had is <unk>; words decode joined by spaces.
    (tmp_path / "odd.txt").write_text("the dog\n")
    odd = TextDataModule(str(tmp_path / "train.txt"), level="words", val_path=str(tmp_path / "odd.txt"), seq_len=1)
    assert odd.vocab.decode(odd.ids["val"]) == "the <unk> <eos>"


def test_a_text_with_its_own_unk_keeps_it(tmp_path):
    (tmp_path / "ptb.txt").write_text(" the <unk> sat \n the cat <unk> \n" * 10)
    dm = TextDataModule(str(tmp_path / "ptb.txt"), level="words", seq_len=4, val_fraction=0.2)
    assert dm.vocab.spec == ["the", "<unk>", "sat", "<eos>", "cat"]  # no second unknown token


def test_validation_and_test_files_replace_the_split(tmp_path):
    (tmp_path / "a.txt").write_text("abcdefgh" * 20)
    (tmp_path / "b.txt").write_text("hgfedcba" * 5)
    dm = TextDataModule(str(tmp_path / "a.txt"), level="chars", val_path=str(tmp_path / "b.txt"), seq_len=8)
    assert len(dm.ids["train"]) == 160 and dm.vocab.decode(dm.ids["val"][:8]) == "hgfedcba"
    dm.setup("fit")
    assert len(dm.train_set) == 19 and len(dm.val_set) == 4
    with pytest.raises(ConfigError) as err:
        TextDataModule(str(tmp_path / "a.txt"), val_path=str(tmp_path / "b.txt"), val_fraction=0.1)
    assert err.value.key == "val_fraction"
    with pytest.raises(ConfigError) as err:
        TextDataModule(str(tmp_path / "a.txt"), val_path=str(tmp_path / "missing.txt"))
    assert err.value.key == "val_path"
    with pytest.raises(ConfigError) as err:
        TextDataModule(str(tmp_path / "a.txt"), layout="streams", shuffle=True)
    assert err.value.key == "shuffle"
    with pytest.raises(ConfigError) as err:
        TextDataModule(str(tmp_path / "a.txt"), layout="streams", batch_size=100, seq_len=4)
    assert err.value.key == "batch_size" and "at most 72 streams" in err.value.message


def test_token_ids_in_an_npz_name_their_vocabulary(tmp_path):
    ids = np.arange(300) % 13
    np.savez(tmp_path / "named.npz", x=ids, vocab_size=np.int64(13))
    np.savez(tmp_path / "words.npz", x=ids % 3, vocab=np.array(["a", "b", "c"]))
    np.savez(tmp_path / "plain.npz", x=ids)
    named = NpzDataModule(str(tmp_path / "named.npz"), layout="streams", seq_len=5, batch_size=2)
    assert named.vocab == Vocabulary(13) and named.max_token_id == 12 and "vocab_size" not in named.arrays
    words = NpzDataModule(str(tmp_path / "words.npz"), layout="streams", seq_len=5, batch_size=2)
    assert words.vocab.decode([2, 0]) == "c a"
    plain = NpzDataModule(str(tmp_path / "plain.npz"), layout="streams", seq_len=5, batch_size=2)
    assert plain.vocab is None and plain.max_token_id == 12
    plain.setup("fit")
    first = next(iter(plain.train_dataloader()))
    # The last 10% (30 ids) is the validation corpus: 270 ids train, 2 streams of 135.
    assert first["x"].tolist() == [list(ids[:5]), list(ids[135:140])] and first["y"][0, 0] == ids[1]
    assert plain.streams.ids["val"].tolist() == list(ids[270:])
    np.savez(tmp_path / "bad.npz", x=ids, vocab_size=np.float32(13.0))
    with pytest.raises(ConfigError, match="vocab_size"):
        NpzDataModule(str(tmp_path / "bad.npz"))
    with pytest.raises(ConfigError) as err:
        NpzDataModule(str(tmp_path / "plain.npz"), layout="streams")
    assert err.value.key == "seq_len"


def test_npz_validation_and_test_files(tmp_path):
    make = lambda n, seed: {"x": np.random.default_rng(seed).normal(size=(n, 3)), "y": np.arange(n) % 2}  # noqa: E731
    for name, (n, seed) in {"train": (20, 0), "val": (6, 1), "test": (4, 2)}.items():
        np.savez(tmp_path / f"{name}.npz", **make(n, seed))
    dm = NpzDataModule(
        str(tmp_path / "train.npz"), val_path=str(tmp_path / "val.npz"), test_path=str(tmp_path / "test.npz")
    )
    dm.setup("fit")
    assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (20, 6, 4)  # no random split
    assert np.allclose(dm.val_set[:]["x"].numpy(), make(6, 1)["x"])
    np.savez(tmp_path / "other.npz", x=np.zeros((3, 2)), y=np.zeros(3))
    with pytest.raises(ConfigError):
        NpzDataModule(str(tmp_path / "train.npz"), val_path=str(tmp_path / "other.npz")).setup("fit")


def test_rename_onto_an_array_the_file_already_has_is_refused(tmp_path):
    np.savez(tmp_path / "both.npz", features=np.zeros((4, 2)), x=np.ones((4, 2)), y=np.zeros(4))
    with pytest.raises(ConfigError) as err:
        NpzDataModule(str(tmp_path / "both.npz"), rename={"features": "x"})
    assert err.value.key == "rename.features" and "one of the two would be lost" in err.value.message
    renamed = NpzDataModule(str(tmp_path / "both.npz"), rename={"features": "x", "x": "extra"})
    assert renamed.arrays["x"].sum() == 0 and renamed.arrays["extra"].sum() == 8  # both kept


def test_the_readmes_rename_and_dtypes_syntax_works_from_the_command_line(make_cfg, tmp_path):
    from multiloss.testing import build, first_batch

    np.savez(tmp_path / "mine.npz", features=np.random.rand(20, 3), label=np.arange(20) % 2)
    cfg = make_cfg(
        "data=npz",
        f"data.path={tmp_path / 'mine.npz'}",
        "data.rename={features: x, label: y}",
        "data.dtypes={x: float64}",
        output_dir=tmp_path / "run",
    )
    batch = first_batch(build(cfg)[0])
    assert set(batch) == {"x", "y"} and batch["x"].dtype == torch.float64
