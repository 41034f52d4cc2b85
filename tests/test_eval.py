"""``multiloss-eval ckpt_path=...``: a checkpoint's validation and test metrics, from its own run's overrides.

The reproductions (an evaluation = the training run's last validation) train in float64 (``trainer.precision=64-true``,
which the evaluation carries from the run's overrides) and hold bit for bit: the same weights, data and arithmetic.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import multiloss
from multiloss import testing
from multiloss.config import ConfigError
from multiloss.evaluation import evaluate, with_training_overrides
from tests.conftest import ONE_CPU_NO_VAL, QUIET, SMALL_GAN

# Per recipe: overrides for a short run, and the metric its validation reports.
RUNS = {
    "multihead": ((), "acc"),
    "weighted": ((), "acc/parity"),
    "accumulation": (("model.accumulate_grad_batches=2",), "acc"),
    "gan": (SMALL_GAN, "modes"),
    "tbptt": (("data.seq_len=32", "model.net.hidden_size=32", "trainer.limit_val_batches=4"), "bpc"),
}
HAS_TEST_SET = {"multihead", "weighted", "accumulation", "gan"}  # array data; the text module has no test split
F64 = "trainer.precision=64-true"  # the proofs' runs, and (carried by with_training_overrides) their evaluations
# The GAN's float64 runs draw their epoch-end sample plot too (its noise in the module's dtype).
F64_GAN = (F64,)


def _train(recipe: str, out: Path, *extra: str) -> tuple[Path, dict[str, float]]:
    overrides, _ = RUNS[recipe]
    split = ("data.test_fraction=0.2",) if recipe in HAS_TEST_SET else ()
    cfg = testing.compose(
        f"recipe={recipe}",
        *QUIET,
        "trainer.accelerator=cpu",
        "trainer.devices=1",
        "trainer.max_epochs=1",
        "trainer.max_steps=-1",
        "trainer.limit_train_batches=6",
        "trainer.num_sanity_val_steps=0",
        *split,
        *overrides,
        *extra,
        output_dir=out,
    )
    metrics = multiloss.train(cfg)
    return out / "checkpoints" / "last.ckpt", metrics


def _eval_config(*args: str, output_dir: Path):
    return testing.compose(*with_training_overrides([*args, *QUIET]), config_name="eval", output_dir=output_dir)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", sorted(RUNS))
def test_eval_reproduces_the_final_validation_and_tests(recipe: str, tmp_path: Path) -> None:
    ckpt, trained = _train(recipe, tmp_path / "train", *(F64_GAN if recipe == "gan" else (F64,)))
    metric = RUNS[recipe][1]
    cfg = _eval_config(f"ckpt_path={ckpt}", output_dir=tmp_path / "eval")
    assert cfg.trainer.precision == "64-true"  # from the run's overrides
    # The recipe and its components came from the checkpoint, not from the command line.
    assert cfg.model._target_.endswith({"multihead": "MultiHead", "weighted": "WeightedMultiTask"}.get(recipe, ""))
    metrics = evaluate(cfg)
    assert f"val/{metric}" in metrics, sorted(metrics)
    if recipe in HAS_TEST_SET:
        assert f"test/{metric}" in metrics and any(k.startswith("test/loss/") for k in metrics), sorted(metrics)
    else:
        assert not any(k.startswith("test/") for k in metrics)
    # The same weights on the same validation set: the training run's last validation (at its end), again, bit for
    # bit (the same float64 forwards and the same float32 metric sums, in the same order, in one process).
    assert metrics[f"val/{metric}"] == trained[f"val/{metric}"]
    assert (tmp_path / "eval" / "csv" / "version_0" / "metrics.csv").is_file()
    assert not (tmp_path / "eval" / "checkpoints").exists()


def test_training_overrides_come_first_and_the_command_line_wins(tmp_path: Path) -> None:
    ckpt, _ = _train("multihead", tmp_path / "train", "model.net.width=16", "seed=3")
    args = with_training_overrides([f"ckpt_path={ckpt}", "seed=5", "trainer.limit_val_batches=2"])
    assert "recipe=multihead" in args and "model.net.width=16" in args
    assert "seed=3" not in args and "seed=5" in args  # given on the command line: the user's value
    assert not any(a.startswith("hydra.") for a in args) and sum(a.startswith("ckpt_path=") for a in args) == 1
    assert args[-3:] == [f"ckpt_path={ckpt}", "seed=5", "trainer.limit_val_batches=2"]
    # No checkpoint, nothing added (evaluate names ckpt_path).
    assert with_training_overrides(["ckpt_path=/no/such.ckpt", "seed=1"]) == ["ckpt_path=/no/such.ckpt", "seed=1"]
    # Another recipe than the run's: nothing carried (its keys would not fit; the checkpoint check names the mismatch).
    other = [f"ckpt_path={ckpt}", "recipe=gan"]
    assert with_training_overrides(other) == other


def test_eval_refuses_another_split_and_another_recipe(tmp_path: Path) -> None:
    ckpt, _ = _train("multihead", tmp_path / "train")
    cfg = _eval_config(f"ckpt_path={ckpt}", "data.test_fraction=0.3", output_dir=tmp_path / "eval")
    with pytest.raises(ConfigError, match=r"data\.test_fraction") as err:
        evaluate(cfg)
    assert "0.2" in err.value.message
    cfg = _eval_config(f"ckpt_path={ckpt}", "recipe=accumulation", output_dir=tmp_path / "eval2")
    with pytest.raises(ConfigError, match="ckpt_path"):
        evaluate(cfg)
    cfg = testing.compose("recipe=multihead", *ONE_CPU_NO_VAL, config_name="eval", output_dir=tmp_path / "eval3")
    with pytest.raises(ConfigError, match="ckpt_path"):
        evaluate(cfg)
    # Rejected before writing anything.
    assert not any((tmp_path / d).exists() for d in ("eval", "eval2", "eval3"))


def test_eval_into_a_training_runs_dir_is_refused_and_writes_nothing(tmp_path: Path) -> None:
    ckpt, _ = _train("multihead", tmp_path / "train")
    before = {p: p.read_bytes() for p in (tmp_path / "train" / ".hydra").iterdir()}
    with pytest.raises(ConfigError, match=r"hydra\.run\.dir=.*another run's records"):
        evaluate(_eval_config(f"ckpt_path={ckpt}", output_dir=tmp_path / "train"))
    assert {p: p.read_bytes() for p in (tmp_path / "train" / ".hydra").iterdir()} == before


@pytest.mark.slow
@pytest.mark.distributed
def test_eval_on_two_ranks_gives_the_one_rank_metrics(tmp_path: Path) -> None:
    # Rank 1 used to refuse the eval dir rank 0 had just made (its .hydra/): the job was killed.
    import subprocess
    import sys

    from tests.conftest import ROOT

    ckpt, _ = _train("multihead", tmp_path / "train", F64)
    one = evaluate(_eval_config(f"ckpt_path={ckpt}", output_dir=tmp_path / "one"))
    two = subprocess.run(
        [
            sys.executable,
            str(ROOT / "eval.py"),
            f"ckpt_path={ckpt}",
            "trainer=ddp_cpu",
            f"hydra.run.dir={tmp_path / 'two'}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    from tests.helpers import logged_rows

    (row,) = [r for r in logged_rows(tmp_path / "two") if r.get("val/loss/total")]
    # Both evaluations in float64 (the run's 64-true): each example's loss the same to float64's rounding; the logged
    # mean is a float32 MeanMetric (src/multiloss/base/metrics.py, EpochMeans): Σ value·n over the B batches, summed per
    # rank then across the ranks, in another order than one rank's. Reordering a float32 sum of B positive terms moves
    # it by ≤ (B − 1)·2⁻²⁴ relative, the products and the division add B + 1 more: ≤ 2B·2⁻²⁴, under 1e-5 for B < 80.
    assert float(row["val/loss/total"]) == pytest.approx(one["val/loss/total"], rel=1e-5)
    # Accuracy: integer counts summed over the ranks, then one float32 quotient: the same number.
    assert float(row["val/acc"]) == one["val/acc"]


def test_eval_of_a_gan_scores_its_samples_as_its_last_validation(tmp_path: Path) -> None:
    """FID, KID (its random subsets drawn from the run's seed), precision, recall, density, coverage: the same
    checkpoint and validation data give the run's last validation numbers again, KID's included."""
    digits = ("data=digits", "model.data_dim=64", "model.latent_dim=16", "+model.metrics.feature=digits")
    # Two validations, DiffAugment: the last validation meets torch's global stream where an evaluation does not.
    augment = ("+model.augment.policy=[color,translation]", "+model.augment.p=0.5")
    ckpt, trained = _train("gan", tmp_path / "train", *digits, *augment, "seed=3", "trainer.max_epochs=2", *F64_GAN)
    metrics = evaluate(_eval_config(f"ckpt_path={ckpt}", output_dir=tmp_path / "eval"))
    names = [f"val/{m}" for m in ("fid", "kid", "kid_std", "precision", "recall", "density", "coverage")]
    # Bit for bit: the same float64 generator, noise and validation data, the same features and metric arithmetic.
    assert {n: metrics[n] for n in names} == {n: trained[n] for n in names}
    # Another seed draws other subsets (the seed is what makes them agree, not a fixed stream); FID takes no subsets.
    other = evaluate(_eval_config(f"ckpt_path={ckpt}", "+model.metrics.seed=4", output_dir=tmp_path / "eval4"))
    assert other["val/fid"] == trained["val/fid"] and other["val/kid"] != trained["val/kid"]
