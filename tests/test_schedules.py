"""The ``scheduler`` group on real runs: the rates each schedule gives, its steps, and exact resumes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from multiloss import ConfigError, train
from multiloss.base.schedules import _warmup_cosine
from tests.conftest import load_weights
from tests.helpers import logged_rates, straight_and_resumed

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
    """The ``lr-SGD`` column of the run's (newest) metrics.csv, one value per optimizer step."""
    return [rate for (rate,) in logged_rates(run).values()]


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


# --- one owner of the learning rate: base × the recipe's rule × the schedule's factor ------------------

ACCUMULATION = (
    "recipe=accumulation",
    "trainer.accelerator=cpu",
    "trainer.devices=1",
    "trainer.num_sanity_val_steps=0",
    "trainer.limit_val_batches=2",
    "trainer.log_every_n_steps=1",
    "data.batch_size=128",  # × k=2 = 256 examples a step, against base_batch_size 64: linear rule × 4
    "model.net.width=16",
    "model.optimizer.lr=0.05",
    "~callbacks.loss_curves",
)


def test_accumulations_first_step_under_warm_up_is_the_warm_ups(make_cfg, tmp_path):
    # The rule's rate (0.05 × 4) is where the warm-up goes, not where it starts.
    train(make_cfg(*ACCUMULATION, "scheduler=warmup_cosine", "model.scheduler.warmup_steps=4", "trainer.max_steps=12"))
    rates = _logged_rates(tmp_path / "run")
    expected = [0.2 * _warmup_cosine(s, warmup=4, total=12, floor=0.0) for s in range(12)]
    assert rates == pytest.approx(expected, rel=1e-6) and rates[0] == pytest.approx(0.2 / 5)


def test_a_plateaus_cuts_are_the_runs_state_and_a_resume_keeps_them_silently(make_cfg, tmp_path, caplog):
    plateau = (*SMALL, "scheduler=plateau", "model.scheduler.monitor=val/loss/total", "model.scheduler.mode=max")
    run = tmp_path / "run"
    train(make_cfg(*plateau, "trainer.max_epochs=3", output_dir=run))
    assert _rate_in(run / "checkpoints/last.ckpt") == pytest.approx(LR / 16)
    with caplog.at_level("INFO", logger="multiloss"):
        train(make_cfg(*plateau, "trainer.max_epochs=4", "ckpt_path=last", output_dir=run))
    assert "resuming with" not in caplog.text
    assert _logged_rates(run)[18:] == pytest.approx([LR / 16] * 6)  # epoch 4 trained at the cut rate


def test_a_resume_with_another_batch_size_applies_the_rule_for_the_new_effective_batch_and_says_so(
    make_cfg, tmp_path, caplog
):
    decay = ("scheduler=step", "model.scheduler.step_size=1", "model.scheduler.gamma=0.5")
    run = tmp_path / "run"
    train(make_cfg(*ACCUMULATION, *decay, "trainer.max_epochs=1", output_dir=run))
    assert _rate_in(run / "checkpoints/last.ckpt") == pytest.approx(0.2 * 0.5)  # rule × 4, one decay
    with caplog.at_level("INFO", logger="multiloss"):
        train(
            make_cfg(
                *ACCUMULATION, *decay, "data.batch_size=64", "trainer.max_epochs=2", "ckpt_path=last", output_dir=run
            )
        )
    # 64 × 2 = 128 examples a step: × 2, from the schedule's point (one decay): 0.05 × 2 × 0.5, then decayed again.
    assert "the recipe's LR factor 2 (lr_scaling=linear, effective_batch_size=128" in caplog.text
    assert "now trains at 0.05 × 2 × the schedule's 0.5 = 0.05" in caplog.text
    assert _logged_rates(run)[-1] == pytest.approx(0.05)
    assert _rate_in(run / "checkpoints/last.ckpt") == pytest.approx(0.025)


def test_a_resume_with_another_schedule_is_refused_before_anything_is_written(make_cfg, tmp_path):
    decay = ("scheduler=step", "model.scheduler.step_size=1", "model.scheduler.gamma=0.5")
    run = tmp_path / "run"
    train(make_cfg(*SMALL, *decay, "trainer.max_epochs=1", output_dir=run))
    record = (run / ".hydra/config.yaml").read_text()
    with pytest.raises(ConfigError, match="the checkpoint's run was trained under another schedule") as err:
        train(make_cfg(*SMALL, "scheduler=constant", "trainer.max_epochs=2", "ckpt_path=last", output_dir=run))
    assert err.value.key == "model.scheduler._target_"
    assert "multiloss.base.schedules.StepDecay(step_size=1, gamma=0.5" in err.value.accepted
    assert (run / ".hydra/config.yaml").read_text() == record
    assert torch.load(run / "checkpoints/last.ckpt", weights_only=True)["global_step"] == 6


def test_a_longer_run_resumed_under_warm_up_cosine_says_the_schedules_new_length(make_cfg, tmp_path, caplog):
    cosine = (*SMALL, "scheduler=warmup_cosine", "model.scheduler.warmup_steps=2")
    run = tmp_path / "run"
    train(make_cfg(*cosine, "trainer.max_steps=8", output_dir=run))
    with caplog.at_level("INFO", logger="multiloss"):
        train(make_cfg(*cosine, "trainer.max_steps=16", "ckpt_path=last", output_dir=run))
    assert "resuming with model.scheduler.total_steps=16 (the checkpoint's 8)" in caplog.text
    state = torch.load(run / "checkpoints/last.ckpt", weights_only=True)["lr_schedulers"][0]
    assert state["total_steps"] == 16  # the config's length, not the checkpoint's
    assert _logged_rates(run)[8:] == pytest.approx([LR * _warmup_cosine(s, 2, 16, 0.0) for s in range(8, 16)])


def test_tbptt_fits_warm_up_cosine_to_its_run_once_the_data_is_known(make_cfg, tmp_path):
    # tbptt's steps a run are its batches × chunks: the batch count is known only once the data is set up.
    train(
        make_cfg(
            "recipe=tbptt",
            *SMALL[2:6],
            "model.net.hidden_size=16",
            "model.sample_length=5",
            "scheduler=warmup_cosine",
            "model.scheduler.warmup_steps=2",
            "trainer.max_epochs=1",
            output_dir=tmp_path,
        )
    )
    checkpoint = torch.load(tmp_path / "checkpoints/last.ckpt", weights_only=True)
    assert checkpoint["lr_schedulers"][0]["total_steps"] == checkpoint["global_step"] == 6 * 4  # 4 chunks a window


@pytest.mark.parametrize("recipe", ["multihead", "weighted", "gan", "tbptt", "accumulation"])
def test_a_schedule_fitted_to_an_endless_run_is_refused_before_anything_is_written(make_cfg, tmp_path, recipe):
    schedule = "scheduler=linear_decay" if recipe == "gan" else "scheduler=warmup_cosine"
    key = "model.scheduler.epochs" if recipe == "gan" else "model.scheduler.total_steps"
    with pytest.raises(ConfigError, match="the run has no last") as err:
        train(
            make_cfg(f"recipe={recipe}", schedule, "trainer.max_epochs=-1", "trainer.max_steps=-1", output_dir=tmp_path)
        )
    assert err.value.key == key
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_the_gans_plateau_without_a_monitor_names_the_metrics_it_logs(make_cfg, tmp_path):
    # Was: "accepted: a validation metric, e.g. val/loss/ce", a metric the GAN never logs.
    with pytest.raises(ConfigError) as err:
        train(make_cfg("recipe=gan", *SMALL[2:6], "scheduler=plateau", "trainer.max_epochs=1", output_dir=tmp_path))
    assert err.value.key == "model.scheduler.monitor"
    assert "val/loss/d, val/loss/g, val/modes" in err.value.accepted and "val/loss/ce" not in str(err.value)
    assert not tmp_path.exists() or not any(tmp_path.rglob("*.*"))
