"""The offline data modules: splits, order as a function of (seed, epoch), rank sharding, resumable loaders."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from multiloss.config import ConfigError
from multiloss.data import DigitsDataModule, NpzDataModule


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


def test_npz_arrays(tmp_path):
    path = tmp_path / "mine.npz"
    x = np.random.default_rng(0).random((40, 4, 4)).astype(np.float32)
    np.savez(path, features=x, labels=np.arange(40) % 3)
    dm = NpzDataModule(str(path), x_key="features", y_key="labels", batch_size=8, val_fraction=0.25)
    dm.setup("fit")
    assert (len(dm.train_set), len(dm.val_set)) == (30, 10)
    assert next(iter(dm.train_dataloader()))["x"].shape == (8, 16)


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [({"path": "/no/such.npz"}, "path"), ({"x_key": "nope"}, "x_key"), ({"batch_size": 0}, "batch_size")],
)
def test_npz_rejects_bad_settings_by_name(tmp_path, kwargs, key):
    path = tmp_path / "mine.npz"
    np.savez(path, x=np.zeros((4, 2)), y=np.zeros(4))
    with pytest.raises(ConfigError) as err:
        NpzDataModule(**{"path": str(path), **kwargs})
    assert err.value.key == key


def test_npz_rejects_mismatched_lengths(tmp_path):
    path = tmp_path / "bad.npz"
    np.savez(path, x=np.zeros((4, 2)), y=np.zeros(5))
    with pytest.raises(ConfigError, match="same length"):
        NpzDataModule(str(path))
