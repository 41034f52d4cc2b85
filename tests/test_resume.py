"""`ckpt_path=` resumes exactly: 1 + 1 epochs == 2 epochs, and the same from a mid-epoch checkpoint.

Stock Lightning is off by ~2.5e-2 in the weights here (reshuffled order, fresh RNG streams). The
model uses dropout so the RNG streams matter, and the loader shuffles so the order matters.
"""

from __future__ import annotations

import logging

import pytest
import torch

from multiloss import train
from multiloss.config import ConfigError
from multiloss.saving.history import read_rows
from tests.conftest import load_weights
from tests.helpers import straight_and_resumed

SMALL = (
    "recipe=multihead",
    "model.net.width=32",
    "model.net.dropout=0.2",
    "data.batch_size=128",
    "trainer.accelerator=cpu",
    "trainer.devices=1",
    "~callbacks.loss_curves",
)


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst == 0.0, f"weights differ by up to {worst:.3g}"


def test_resume_at_epoch_boundary_equals_straight_run(make_cfg, tmp_path):
    runs = straight_and_resumed(make_cfg, tmp_path, SMALL, stop="trainer.max_epochs=1", end="trainer.max_epochs=2")
    straight, first, resumed = (load_weights(run / "checkpoints/last.ckpt") for run in runs)
    _assert_same(resumed, straight)
    # And the comparison is not vacuous: the second epoch moved the weights.
    assert any((first[k] - straight[k]).abs().max() > 1e-4 for k in straight)


@pytest.mark.parametrize("stop_at", [5, 17])
def test_resume_mid_epoch_equals_straight_run(make_cfg, tmp_path, stop_at):
    # 1438 training examples / 128 = 12 batches an epoch: step 5 is mid-epoch 0, step 17 mid-epoch 1.
    straight, first, resumed = straight_and_resumed(
        make_cfg, tmp_path, SMALL, stop=f"trainer.max_steps={stop_at}", end="trainer.max_steps=20"
    )
    assert torch.load(first / "checkpoints/last.ckpt", weights_only=True)["global_step"] == stop_at
    _assert_same(load_weights(resumed / "checkpoints/last.ckpt"), load_weights(straight / "checkpoints/last.ckpt"))
    # One training, one metrics.csv: the resumed run's holds the first run's rows, then its own.
    (straight_rows,), (first_rows,), (resumed_rows,) = (
        [[{k: v for k, v in row.items() if v} for row in read_rows(p)] for p in run.glob("csv/version_0/metrics.csv")]
        for run in (straight, first, resumed)
    )
    assert resumed_rows[: len(first_rows)] == first_rows
    assert {r["step"] for r in resumed_rows} >= {str(s) for s in range(stop_at - 1, 20, 5)} | {"19"}
    if stop_at % 5 == 0:  # the first run's last row is one of the straight run's rows: the files are equal
        assert resumed_rows == straight_rows


def test_resume_from_periodic_checkpoint_equals_straight_run(make_cfg, tmp_path):
    # A preempted job's periodic checkpoint: Lightning's own every_n_train_steps save, mid-epoch 0.
    periodic = ("callbacks.model_checkpoint.every_n_train_steps=7", "callbacks.model_checkpoint.save_top_k=-1")
    train(make_cfg(*SMALL, *periodic, "trainer.max_steps=20", output_dir=tmp_path / "straight"))
    step7 = next((tmp_path / "straight/checkpoints").glob("*step000007.ckpt"))
    train(make_cfg(*SMALL, "trainer.max_steps=20", f"ckpt_path={step7}", output_dir=tmp_path / "resumed"))

    _assert_same(
        load_weights(tmp_path / "resumed/checkpoints/last.ckpt"),
        load_weights(tmp_path / "straight/checkpoints/last.ckpt"),
    )


def test_a_resume_applies_the_configs_learning_rate_and_says_so(make_cfg, tmp_path, caplog):
    first = tmp_path / "first"
    train(make_cfg(*SMALL, "model.optimizer.lr=0.003", "trainer.max_steps=5", output_dir=first))
    ckpt = first / "checkpoints/last.ckpt"
    with caplog.at_level("INFO", logger="multiloss"):
        train(make_cfg(*SMALL, "model.optimizer.lr=0.0001", "trainer.max_steps=8", "ckpt_path=last", output_dir=first))
    (group,) = torch.load(ckpt, weights_only=True)["optimizer_states"][0]["param_groups"]
    assert group["lr"] == 0.0001
    assert "resuming with model.optimizer.lr=0.0001 (the checkpoint's 0.003)" in caplog.text


def test_a_resume_with_another_optimizer_is_refused_before_anything_is_written(make_cfg, tmp_path):
    from multiloss.config import ConfigError

    first = tmp_path / "first"
    train(make_cfg(*SMALL, "trainer.max_steps=3", output_dir=first))
    record = (first / ".hydra/config.yaml").read_text()
    with pytest.raises(ConfigError, match=r"model\.optimizer='?SGD'?: the checkpoint's optimizer has other settings"):
        train(make_cfg(*SMALL, "optimizer=sgd", "trainer.max_steps=6", "ckpt_path=last", output_dir=first))
    assert (first / ".hydra/config.yaml").read_text() == record
    assert torch.load(first / "checkpoints/last.ckpt", weights_only=True)["global_step"] == 3


def test_a_mid_epoch_resume_on_another_batch_size_continues_the_epoch_and_says_so(make_cfg, tmp_path, caplog):
    # 64 → 128 at batch 10: the epoch continues at example 640 (tests/test_elastic_resume.py proves the examples).
    run = tmp_path / "run"
    train(make_cfg(*SMALL, "data.batch_size=64", "trainer.max_steps=10", output_dir=run))
    with caplog.at_level(logging.INFO, logger="multiloss"):
        train(make_cfg(*SMALL, "data.batch_size=128", "trainer.max_epochs=1", "ckpt_path=last", output_dir=run))
    said = "data.batch_size: 128 per rank (the checkpoint's 64): its epoch continues at example 640 of 1438"
    assert said in caplog.text
    # 10 steps of 64, then the 798 examples left in 7 of 128 (the last one 30).
    assert torch.load(run / "checkpoints/last.ckpt", weights_only=True)["global_step"] == 10 + 7


def test_a_mid_epoch_resume_of_an_earlier_versions_checkpoint_on_another_batch_size_is_refused(make_cfg, tmp_path):
    """Earlier versions kept torchdata's count of batches (of their size, on their ranks): continued on its own
    shape, refused on another before anything is written."""
    run = tmp_path / "run"
    train(make_cfg(*SMALL, "data.batch_size=64", "trainer.max_steps=10", output_dir=run))
    ckpt = run / "checkpoints/last.ckpt"
    checkpoint = torch.load(ckpt, weights_only=True)
    checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"] = [{"_num_yielded": 10}]
    torch.save(checkpoint, ckpt)
    record = (run / ".hydra/config.yaml").read_text()
    refused = "its place in the epoch is a count of batches of 64 on 1 rank\\(s\\), not of examples"
    with pytest.raises(ConfigError, match=refused) as err:
        train(make_cfg(*SMALL, "data.batch_size=128", "trainer.max_steps=20", "ckpt_path=last", output_dir=run))
    assert (err.value.key, err.value.value) == ("data.batch_size", 128)
    assert (run / ".hydra/config.yaml").read_text() == record
    train(make_cfg(*SMALL, "data.batch_size=64", "trainer.max_epochs=1", "ckpt_path=last", output_dir=run))
    assert torch.load(ckpt, weights_only=True)["global_step"] == 23  # 10 + the 13 left: the epoch, once


def test_an_epoch_end_resume_may_change_the_batch_size(make_cfg, tmp_path):
    run = tmp_path / "run"
    train(make_cfg(*SMALL, "data.batch_size=64", "trainer.max_epochs=1", output_dir=run))
    train(make_cfg(*SMALL, "data.batch_size=128", "trainer.max_epochs=2", "ckpt_path=last", output_dir=run))
    # 23 steps of 64 (1438 examples), then 12 of 128: every example once an epoch.
    assert torch.load(run / "checkpoints/last.ckpt", weights_only=True)["global_step"] == 23 + 12


def test_a_mid_epoch_resume_with_another_shuffle_seed_is_refused_before_anything_is_written(make_cfg, tmp_path):
    """The checkpoint's place in the epoch is a count of its order's examples: another data.seed would name others."""
    run = tmp_path / "run"
    train(make_cfg(*SMALL, "trainer.max_steps=3", output_dir=run))
    record = (run / ".hydra/config.yaml").read_text()
    with pytest.raises(ConfigError, match="the checkpoint's, 0, until its epoch ends") as err:
        train(make_cfg(*SMALL, "data.seed=1", "trainer.max_steps=6", "ckpt_path=last", output_dir=run))
    assert (err.value.key, err.value.value) == ("data.seed", 1)
    assert (run / ".hydra/config.yaml").read_text() == record
