"""The ``scheduler`` group on real runs: the rates each schedule gives, its steps, and exact resumes."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch

from multiloss import ConfigError, train
from multiloss.schedules import _warmup_cosine
from tests.conftest import load_weights
from tests.helpers import straight_and_resumed

LR = 0.1
# multihead on digits with SGD: 6 batches an epoch, the rate logged at every optimizer step.
SMALL = (
    "recipe=multihead",
    "trainer.accelerator=cpu",
    "trainer.devices=1",
    "trainer.num_sanity_val_steps=0",
    "trainer.limit_train_batches=6",
    "trainer.limit_val_batches=2",
    "trainer.log_every_n_steps=1",
    "optimizer=sgd",
    f"model.optimizer.lr={LR}",
    "data.batch_size=16",
    "~callbacks.loss_curves",
)


def _logged_rates(run: Path) -> list[float]:
    """The ``lr-SGD`` column of the run's metrics.csv, one value per optimizer step."""
    with next((run / "csv").rglob("metrics.csv")).open(newline="") as f:
        return [float(row["lr-SGD"]) for row in csv.DictReader(f) if row.get("lr-SGD")]


def _rate_in(checkpoint: Path) -> float:
    return torch.load(checkpoint, weights_only=True)["optimizer_states"][0]["param_groups"][0]["lr"]


def test_warmup_cosine_gives_its_formula_at_every_step(make_cfg, tmp_path):
    train(
        make_cfg(
            *SMALL,
            "scheduler=warmup_cosine",
            "model.scheduler.warmup_steps=3",
            "trainer.max_steps=12",
            output_dir=tmp_path,
        )
    )
    # The rate each step trained at: warm-up (1/4, 2/4, 3/4), then a cosine to 0 at the run's 12th step.
    expected = [LR * _warmup_cosine(s, warmup=3, total=12, floor=0.0) for s in range(12)]
    assert _logged_rates(tmp_path) == pytest.approx(expected, rel=1e-6)
    assert expected[:3] == pytest.approx([0.025, 0.05, 0.075]) and expected[3] == pytest.approx(LR)
    assert expected[-1] == pytest.approx(LR * 0.5 * (1 + math.cos(math.pi * 8 / 9)))


def test_warmup_cosine_resumes_exactly(make_cfg, tmp_path):
    common = (*SMALL, "scheduler=warmup_cosine", "model.scheduler.warmup_steps=2", "model.scheduler.total_steps=12")
    runs = straight_and_resumed(make_cfg, tmp_path, common, stop="trainer.max_steps=5", end="trainer.max_steps=12")
    straight, first, resumed = (load_weights(run / "checkpoints/last.ckpt") for run in runs)
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    assert any(not torch.equal(first[k], straight[k]) for k in straight)
    assert _rate_in(runs[0] / "checkpoints/last.ckpt") == _rate_in(runs[2] / "checkpoints/last.ckpt")
    assert _logged_rates(runs[2]) == _logged_rates(runs[0])  # the resumed log continues the first run's


def test_step_decay_multiplies_at_each_epoch_end(make_cfg, tmp_path):
    train(
        make_cfg(
            *SMALL,
            "scheduler=step",
            "model.scheduler.step_size=1",
            "model.scheduler.gamma=0.5",
            "trainer.max_epochs=3",
            output_dir=tmp_path,
        )
    )
    assert _logged_rates(tmp_path) == pytest.approx([LR] * 6 + [LR / 2] * 6 + [LR / 4] * 6)


def test_plateau_anneals_on_the_monitored_validation_metric(make_cfg, tmp_path):
    """word_language_model's ``lr /= 4`` when the validation metric is not better than its best.

    Monitoring the falling validation loss as if higher were better (mode=max) makes every validation
    after the first a plateau: the rate is quartered after validations 2 and 3.
    """
    train(
        make_cfg(
            *SMALL,
            "scheduler=plateau",
            "model.scheduler.monitor=val/loss/total",
            "model.scheduler.mode=max",
            "trainer.max_epochs=4",
            output_dir=tmp_path,
        )
    )
    assert _logged_rates(tmp_path) == pytest.approx([LR] * 12 + [LR / 4] * 6 + [LR / 16] * 6)
    # As a checkpoint of the last validation holds it (the schedule steps before the save).
    assert _rate_in(tmp_path / "checkpoints/last.ckpt") == pytest.approx(LR / 64)


def test_plateau_monitors_the_recipes_validation_loss_by_default(make_cfg, tmp_path):
    # The loss falls on every validation here, so the default (mode=min) never anneals.
    train(make_cfg(*SMALL, "scheduler=plateau", "trainer.max_epochs=2", output_dir=tmp_path))
    ckpt = torch.load(tmp_path / "checkpoints/last.ckpt", weights_only=True)
    (state,) = ckpt["lr_schedulers"]
    assert state["best"] < float("inf") and state["num_bad_epochs"] == 0
    assert _rate_in(tmp_path / "checkpoints/last.ckpt") == LR


def test_a_metric_the_recipe_does_not_log_is_named(make_cfg, tmp_path):
    with pytest.raises(ConfigError, match="val/loss/total") as err:
        train(
            make_cfg(
                *SMALL,
                "scheduler=plateau",
                "model.scheduler.monitor=val/nope",
                "trainer.max_epochs=1",
                output_dir=tmp_path,
            )
        )
    assert err.value.key == "model.scheduler.monitor" and err.value.value == "val/nope"


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("model.scheduler.warmup_steps=20", "model.scheduler.total_steps"),  # more warm-up than the run has steps
        ("model.scheduler.warmup_steps=2 model.scheduler.min_factor=2", "model.scheduler.min_factor"),
    ],
)
def test_a_bad_schedule_option_is_named_before_training(make_cfg, tmp_path, override, key):
    with pytest.raises(ConfigError) as err:
        train(
            make_cfg(*SMALL, "scheduler=warmup_cosine", "trainer.max_steps=12", *override.split(), output_dir=tmp_path)
        )
    assert err.value.key == key
    assert not (tmp_path / "checkpoints").exists()
