"""The ecosystem's options: Optuna sweeps, MLflow and W&B loggers, early stopping, the lint hooks."""

from __future__ import annotations

import csv
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest
import yaml

import multiloss
from multiloss.base.step import refuse_lightning_step_options
from multiloss.cli import optimized_value
from multiloss.config import check_config
from tests.conftest import CONFIG_DIR, ROOT, run_cli

SHORT = ("trainer.max_epochs=1", "trainer.limit_train_batches=3", "trainer.limit_val_batches=2")


needs_optuna = pytest.mark.skipif(
    find_spec("hydra_plugins.hydra_optuna_sweeper") is None, reason="the optuna extra is not installed"
)


@pytest.mark.slow
@needs_optuna
def test_an_optuna_sweep_of_three_trials_writes_its_results(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    proc = run_cli(
        "hparams_search=multihead",
        "hydra.sweeper.n_trials=3",
        *SHORT,
        "print_config=false",
        "~callbacks.progress_bar",
        "trainer.enable_progress_bar=false",
        f"hydra.sweep.dir={sweep}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert set(results["best_params"]) == {"model.optimizer.lr", "model.net.width"}
    # Each trial is a run of its own; the best value is the best trial's final val/acc (maximized).
    finals = []
    for trial in ("0", "1", "2"):
        (metrics,) = (sweep / trial).rglob("metrics.csv")
        rows = [r for r in csv.DictReader(metrics.open()) if r.get("val/acc")]
        finals.append(float(rows[-1]["val/acc"]))
    assert results["best_value"] == pytest.approx(max(finals))
    assert not (sweep / "3").exists()


def test_optimized_metric_is_returned_as_a_float_or_named_when_missing(capsys) -> None:
    metrics = {"val/acc": 0.5, "loss/total": 2.0}
    assert optimized_value(metrics, None) is metrics
    value = optimized_value(metrics, "val/acc")
    assert type(value) is float and value == 0.5
    with pytest.raises(SystemExit) as stop:
        optimized_value(metrics, "val/accuracy")
    assert stop.value.code == 2
    said = capsys.readouterr().err
    assert "optimized_metric" in said and "val/accuracy" in said and "loss/total, val/acc" in said


@needs_optuna
@pytest.mark.parametrize("recipe", ["multihead", "weighted", "accumulation", "gan", "tbptt"])
def test_each_recipes_search_composes_its_recipe_and_objective(make_cfg, recipe: str) -> None:
    cfg = make_cfg(f"hparams_search={recipe}")
    check_config(cfg)
    assert cfg.model._target_.rsplit(".", 2)[-2] == recipe
    assert cfg.optimized_metric.startswith("val/")
    # Every knob it sweeps is one a run accepts, at a choice's last value or a range's low end (a key the
    # recipe refuses, such as trainer.accumulate_grad_batches above 1, would fail every trial).
    from omegaconf import OmegaConf

    from multiloss.training import build_data_and_model, build_trainer

    params = OmegaConf.load(CONFIG_DIR / "hparams_search" / f"{recipe}.yaml").hydra.sweeper.params
    for key, space in params.items():
        values = str(space).split("(")[-1].rstrip(")").split(",")
        value = (values[-1] if "choice(" in str(space) else values[0]).strip()
        trial = make_cfg(f"recipe={recipe}", f"{key}={value}")
        check_config(trial)
        build_data_and_model(trial)  # the recipe is built with it
        refuse_lightning_step_options(build_trainer(trial))  # the step options Lightning must not take


@pytest.mark.skipif(find_spec("mlflow") is None, reason="the mlflow extra is not installed")
def test_mlflow_logs_the_same_values_as_the_csv(make_cfg, tmp_path: Path) -> None:
    import mlflow

    out = tmp_path / "run"
    multiloss.train(make_cfg("logger=mlflow", *SHORT, "trainer.log_every_n_steps=1", output_dir=out))
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{out}/mlflow.db")
    (experiment,) = [e for e in client.search_experiments() if e.name == "multihead"]
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.data.params["model/_target_"] == "multiloss.recipes.multihead.MultiHead"  # the run's config
    logged = [m.value for m in client.get_metric_history(run.info.run_id, "loss/total")]
    (metrics,) = out.glob("csv/version_0/metrics.csv")
    in_csv = [float(r["loss/total"]) for r in csv.DictReader(metrics.open()) if r.get("loss/total")]
    assert logged == pytest.approx(in_csv) and len(logged) == 3
    assert "val/acc" in run.data.metrics


def test_wandb_composes_offline_into_the_run_dir(make_cfg, tmp_path: Path) -> None:
    cfg = make_cfg("logger=wandb", output_dir=tmp_path / "run")
    check_config(cfg)
    assert cfg.logger.wandb.offline is True and cfg.logger.wandb.save_dir == str(tmp_path / "run")
    assert "csv" in cfg.logger  # the loss curves still read metrics.csv


def test_early_stopping_stops_a_run_that_does_not_improve(make_cfg, tmp_path: Path) -> None:
    out = tmp_path / "run"
    cfg = make_cfg(
        "callbacks=[default,early_stopping]",
        "~callbacks.progress_bar",
        "callbacks.early_stopping.monitor=val/acc",
        "callbacks.early_stopping.mode=max",
        "callbacks.early_stopping.patience=0",
        "callbacks.early_stopping.min_delta=1.0",  # no accuracy improves by 1: stop at the second validation
        "trainer.max_epochs=5",
        "trainer.limit_train_batches=2",
        "trainer.limit_val_batches=1",
        output_dir=out,
    )
    multiloss.train(cfg)
    (metrics,) = out.glob("csv/version_0/metrics.csv")
    epochs = {int(r["epoch"]) for r in csv.DictReader(metrics.open()) if r.get("val/acc")}
    assert epochs == {0, 1}


def test_lint_is_clean_and_the_hooks_pin_the_same_ruff() -> None:
    hooks = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())["repos"][0]["hooks"]
    ruff = subprocess.run([sys.executable, "-m", "ruff", "--version"], capture_output=True, text=True, check=True)
    version = ruff.stdout.split()[1]
    assert {h["additional_dependencies"][0] for h in hooks} == {f"ruff=={version}"}
    for command in (["check", "."], ["format", "--check", "."]):
        done = subprocess.run([sys.executable, "-m", "ruff", *command], cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr


def test_logger_none_still_trains_with_the_default_callbacks(make_cfg, tmp_path: Path) -> None:
    # The LR monitor has nowhere to write: left out, not a crash at the first step.
    metrics = multiloss.train(make_cfg("logger=none", "trainer.max_steps=2", output_dir=tmp_path))
    assert "loss/total" in metrics and (tmp_path / "checkpoints" / "last.ckpt").is_file()
