"""Real DDP on 2 CPU ranks (gloo): every recipe runs, 2 ranks × b == 1 rank × 2b, one all-reduce per
optimizer step under accumulation, Hydra multirun × DDP, torchrun, and the SLURM launcher config.

Each run is `python train.py ...` in a subprocess, as a user starts it (Lightning's DDP launcher
re-executes the script for rank 1, which a test process cannot host).

The proofs of equality (2 ranks × b == 1 × 2b, the loop by hand) run in float64 (``trainer.precision=64-true``, both
sides) and hold to `EXACT`: the two sides sum the same examples' gradients in other groupings, so they part only by
rounding (~1e-16 relative a step), on any CPU's kernels.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from multiloss.balancers.protocol import unpack_state
from multiloss.testing import assert_gradients_close, build, first_batch, tbptt_gradients
from tests.conftest import CONFIG_DIR, QUIET, ROOT, compose_config, load_checkpoint, load_weights, run_cli, train_here
from tests.helpers import char_streams, padded_tbptt, padded_token_npz, same_state
from tests.rank_pool import pooled_train

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# Quiet, and no loss-curve PNG (most runs here are too short to log a curve).
QUIET_RUN = (*QUIET, "~callbacks.loss_curves")
DDP = ("trainer=ddp_cpu",)
ONE = ("trainer=cpu",)
F64 = "trainer.precision=64-true"  # a proof's runs: the module, its batches and its steps in float64
EXACT = 1e-10  # float64: equal up to rounding, on any CPU
# A float32 sum, where a 64-true run still keeps one: torchmetrics makes a metric's states when the metric is made, in
# the default float32 (`Module.double()` leaves a Metric's states alone), so MeanAbsoluteError's `sum_abs_error` adds
# each validation batch's float64 sum of |errors| rounded to float32: ≤ 2⁻²⁴ relative of the running sum (a sum of
# positive terms: ≤ the total) an add. 359 validation digits are 12 batches of 32 on one rank, or 12 of 16 a rank plus
# the ranks' all-reduced sum on two: ≤ 25 roundings between the two sides, inside 32 · 2⁻²⁴ (1.9e-6) relative.
FLOAT32_SUM = 32 * 2**-24


def _train(out: Path, *overrides: str) -> Path:
    """A 2-rank run on this worker's two ranks (`tests.rank_pool`), from the run dir's parent: a file written outside
    the run dir would show up beside it."""
    return pooled_train(out, *QUIET_RUN, *overrides, cwd=out.parent)


def _command(out: Path, *overrides: str) -> Path:
    """``python train.py <overrides>`` as a user starts it (Lightning's launcher, or ours, starts rank 1)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    proc = run_cli(*QUIET_RUN, *overrides, f"hydra.run.dir={out}", cwd=out.parent)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def _last_logged(out: Path) -> dict[str, float]:
    """The last value of every column of the run's metrics.csv."""
    (path,) = out.rglob("metrics.csv")
    last: dict[str, float] = {}
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            last.update({k: float(v) for k, v in row.items() if v not in ("", None)})
    return last


def _counter(out: Path) -> tuple[str, str]:
    return ("+callbacks.allreduce._target_=tests.helpers.AllReduceCounter", f"+callbacks.allreduce.dirpath={out}")


def _counts(out: Path) -> list[dict[str, int]]:
    return [json.loads((out / f"allreduce_rank{r}.json").read_text()) for r in (0, 1)]


def _assert_same_weights(a: Path, b: Path) -> float:
    """Two float64 runs' weights and buffers equal to `EXACT` (each pair in its own dtype; counts exactly)."""
    wa, wb = load_weights(a / "checkpoints/last.ckpt"), load_weights(b / "checkpoints/last.ckpt")
    assert wa.keys() == wb.keys()
    # Tensors (weights and buffers), not a module's extra state (a dict; compared where it matters).
    names = [k for k, v in wa.items() if isinstance(v, torch.Tensor)]
    assert {wa[k].dtype for k in names if wa[k].is_floating_point()} == {torch.float64}  # float64 end to end
    worst = assert_gradients_close(wa, wb, atol=EXACT, rtol=0, names=names)  # name -> tensor maps, as for grads
    print(f"2 ranks × b vs 1 rank × 2b: largest weight difference {worst:.2g}")  # for the record (pytest -s)
    return worst


# recipe -> overrides shared by both runs; SGD so equal gradients mean equal weights (not Adam's ±lr).
# Validation runs once, on the final batch (val_check_interval counts batches, i.e. micro-batches).
EQUIVALENCE = {
    "multihead": ("optimizer=sgd", "trainer.max_steps=6", "trainer.val_check_interval=6"),
    "weighted": ("optimizer=sgd", "trainer.max_steps=6", "trainer.val_check_interval=6"),
    # k=2 under DDP: also counts the all-reduces (one per optimizer step, not one per micro-batch).
    "accumulation": ("model.accumulate_grad_batches=2", "trainer.max_steps=5", "trainer.val_check_interval=10"),
}


@pytest.mark.parametrize("recipe", sorted(EQUIVALENCE))
def test_two_ranks_equal_one_rank_with_twice_the_batch(tmp_path, recipe):
    common = (f"recipe={recipe}", "data.shuffle=false", *EQUIVALENCE[recipe], F64)
    two = _train(tmp_path / "ddp", *common, *DDP, "data.batch_size=16", *_counter(tmp_path / "ddp"))
    one = train_here(tmp_path / "one", *QUIET_RUN, *common, *ONE, "data.batch_size=32")
    _assert_same_weights(two, one)
    # Exactly one gradient all-reduce per optimizer step on each rank (small models: one bucket).
    for counts in _counts(two):
        assert counts["optimizer_steps"] > 0
        assert counts["allreduces"] == counts["optimizer_steps"], counts
    # Logging, checkpoints and plots happen once, on rank zero, and nothing lands outside the run dirs.
    assert len(list(two.rglob("metrics.csv"))) == 1
    assert len(list((two / "checkpoints").glob("*.ckpt"))) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ddp", "one"]
    # Validation metrics are reduced across ranks: each rank scored half the validation set, and
    # the logged numbers are those of the whole set, as on one rank.
    logged_two, logged_one = _last_logged(two), _last_logged(one)
    val = sorted(k for k in logged_one if k.startswith("val/"))
    assert "val/acc" in val or "val/acc/digit" in val, val
    for k in val:
        two_k, one_k = logged_two[k], logged_one[k]
        if "/acc" in k:  # correct / all, from the ranks' summed integer counts: the same integers, the same quotient
            bound = 0.0
        elif k.startswith("val/mae/"):  # a float32 state (FLOAT32_SUM)
            bound = FLOAT32_SUM * abs(one_k)
        else:  # the losses: float64 sums of loss · examples (`multiloss.base.metrics.EpochMeans`), grouped otherwise
            bound = EXACT * abs(one_k)
        print(f"{k}: 2 ranks {two_k!r}, 1 rank {one_k!r}")  # for the record (pytest -s)
        assert abs(two_k - one_k) <= bound, (k, two_k, one_k)
    if recipe == "accumulation":
        # The LR rule counts the ranks: 2 × 16 × k=2 and 1 × 32 × k=2 both step on 64 examples, lr
        # 0.1 × 64/64 (a rule that forgot the ranks would give the DDP run 0.05, and other weights).
        for out, world_size in ((two, 2), (one, 1)):
            scaling = json.loads((out / "lr_scaling.json").read_text())
            assert (scaling["world_size"], scaling["effective_batch_size"]) == (world_size, 64)
            assert scaling["lr"] == pytest.approx(0.1)


@pytest.mark.parametrize(
    ("g_input", "g_step_after", "k"), [("fresh", "last", 2), ("same_z", "first", 2), ("same_fakes", "last", 1)]
)
def test_gan_under_ddp_steps_each_network_with_its_own_allreduce(tmp_path, g_input, g_step_after, k):
    """The GAN's discriminator and generator steps on 2 ranks × b equal 1 rank × 2b, with the
    manual accumulation helper (k=2): one all-reduce per optimizer step, and no
    find_unused_parameters (each backward reaches only its own network's DDP wrapper). Whatever G runs on:
    fresh noise, D's noise again (same_z: each micro-batch's), or the very fakes D scored (same_fakes: G's
    forward through its wrapper before D's step, its backward at G's step)."""
    common = (
        "recipe=gan",
        "data.shuffle=false",
        "model.n_plot_samples=0",
        "model.n_critic=2",
        f"model.accumulate_grad_batches={k}",
        f"model.g_input={g_input}",
        f"model.g_step_after={g_step_after}",
        "optimizer@model.d_optimizer=sgd",
        "optimizer@model.g_optimizer=sgd",
        "model.d_optimizer.lr=0.05",
        "model.g_optimizer.lr=0.05",
        "scheduler=constant",
        "trainer.max_steps=6",
        "trainer.limit_val_batches=0",
        "trainer.num_sanity_val_steps=0",
        F64,
    )
    two = _train(tmp_path / "ddp", *common, *DDP, "data.batch_size=16", *_counter(tmp_path / "ddp"))
    one = train_here(tmp_path / "one", *QUIET_RUN, *common, *ONE, "data.batch_size=32")
    _assert_same_weights(two, one)
    for counts in _counts(two):
        assert counts["optimizer_steps"] == 6
        assert counts["allreduces"] == 6, counts  # not 12: the non-stepping micro-batches skip it
    config = OmegaConf.load(two / ".hydra/config.yaml")
    assert config.trainer.strategy == "ddp"  # multiloss's DDPStrategy, find_unused_parameters off


ADA_DIGITS = (
    "data=digits",
    "model.data_dim=64",
    "model.latent_dim=8",
    "+model.augment.policy=[color,translation,cutout]",
    "+model.augment.p=0.3",
    "+model.augment.ada_target=0.6",
    "+model.augment.ada_interval=3",
    "+model.augment.ada_kimg=1",
)


@pytest.mark.parametrize("data", [(), ADA_DIGITS], ids=["gaussians", "digits-ada"])
def test_modern_gan_under_ddp_equals_one_rank(tmp_path, data):
    """The relativistic loss, lazy R1 (its own D step every 2, on the step's 2 micro-batches) and the generator EMA
    (half-life with ramp-up, images counted over ranks and micro-batches) on 2 ranks × b == 1 rank × 2b: G, D and
    G_ema (weights and image count); on the digits with DiffAugment and ADA's p too (the ranks' sign sums
    all-reduced: p equal to the one rank's)."""
    common = (
        "recipe=gan",
        *data,
        "data.shuffle=false",
        "model.n_plot_samples=0",
        "model.loss=relativistic",
        "model.penalty=r1",
        "model.penalty_weight=1.0",
        "model.penalty_every=2",
        "model.n_critic=1",
        "model.accumulate_grad_batches=2",
        "+model.g_ema.half_life_images=100",
        "+model.g_ema.rampup=0.5",
        "optimizer@model.d_optimizer=sgd",
        "optimizer@model.g_optimizer=sgd",
        "model.d_optimizer.lr=0.05",
        "model.g_optimizer.lr=0.05",
        "scheduler=constant",
        "trainer.max_steps=8",
        "trainer.limit_val_batches=0",
        "trainer.num_sanity_val_steps=0",
        F64,
    )
    two = _train(tmp_path / "ddp", *common, *DDP, "data.batch_size=16")
    one = train_here(tmp_path / "one", *QUIET_RUN, *common, *ONE, "data.batch_size=32")
    _assert_same_weights(two, one)
    weights = load_weights(two / "checkpoints/last.ckpt")
    assert int(weights["generator_ema.images"]) == 4 * 2 * 32  # 4 D steps of 2 micro-batches of 2 × 16
    if data:  # the sums are the ranks' together: D step 4's 2 micro-batches of 2 × 16 since p moved after step 3
        assert int(weights["augment.signs"][1]) == 64 and float(weights["augment.p"]) != 0.3


# R3GAN's and stylegan2-ada's options on the shipped conv nets, stacked digits as 3 × 8 × 8 images.
STACKED_IMAGES = (
    "recipe=gan",
    "data=stacked_digits",
    "data.resolution=8",
    "data.n_samples=512",
    "data.shuffle=false",
    "model.latent_dim=8",
)
CONV_AT_8 = (
    "model.generator.resolution=8",
    "model.generator.output=sigmoid",
    "model.discriminator.resolution=8",
    "model.discriminator.width=8",
    "model.n_plot_samples=0",
    "model.n_critic=1",
)
CONV_NETS = {
    "stylegan2-resnet": (
        "generator=stylegan2",
        "discriminator=resnet",
        "model.generator.noise_mode=const",  # (random noise is each rank's own: the one thing that differs)
        "model.generator.width=8",
        "model.generator.w_dim=8",
        "model.discriminator.width=8",
        "model.g_reg_every=2",
        "+model.path_length.weight=2",
        "+model.path_length.batch_shrink=2",
    ),
    "dcgan": ("generator=dcgan", "discriminator=dcgan", "model.generator.width=8", "model.generator.batch_norm=false"),
}


@pytest.mark.parametrize("nets", list(CONV_NETS))
def test_conv_gan_with_r3gans_options_under_ddp_equals_one_rank(tmp_path, nets):
    """The shipped conv nets with R1 + R2 on every D step, the schedules over images (the rate by scheduler=images,
    γ and the EMA half-life by model.schedules), the gradient clean-up, and on the StyleGAN2 pair path length every 2
    G steps (its mean length over the global batch) with G's correction, 2 micro-batches a step: 2 ranks × b == 1
    rank × 2b — G, D, G_ema, pl_mean, the image clock."""
    common = (
        *STACKED_IMAGES,
        *CONV_NETS[nets],
        *CONV_AT_8,
        "model.loss=relativistic",
        "model.penalty=[r1,r2]",
        "model.penalty_weight=0.5",
        "model.accumulate_grad_batches=2",
        "model.clean_gradients=true",
        "+model.g_ema.half_life_images=1",
        "+model.schedules.gamma={base_value: 0.5, final_value: 0.05, total_nimg: 384, warmup_nimg: 64}",
        "+model.schedules.ema_half_life={base_value: 0, final_value: 200, total_nimg: 384}",
        "optimizer@model.d_optimizer=sgd",
        "optimizer@model.g_optimizer=sgd",
        "model.d_optimizer.lr=0.05",
        "model.g_optimizer.lr=0.05",
        "scheduler=images",
        "model.scheduler.total_nimg=384",
        "model.scheduler.warmup_nimg=128",
        "trainer.max_steps=12",
        "trainer.limit_val_batches=0",
        "trainer.num_sanity_val_steps=0",
        F64,
    )
    two = _train(tmp_path / "ddp", *common, *DDP, "data.batch_size=16")
    one = train_here(tmp_path / "one", *QUIET_RUN, *common, *ONE, "data.batch_size=32")
    _assert_same_weights(two, one)
    weights = load_weights(two / "checkpoints/last.ckpt")
    assert int(weights["generator_ema.images"]) == 6 * 2 * 32  # 6 D steps of 2 micro-batches of 2 × 16
    if "path_length.pl_mean" in weights:
        assert weights["path_length.pl_mean"] > 0
    assert torch.load(two / "checkpoints/last.ckpt", weights_only=True)["gan_images_seen"] == 6 * 2 * 32


def test_dcgans_two_backward_calls_under_ddp_equal_one_rank(tmp_path):
    """``loss=bce`` (dcgan/main.py's D step: the reals' forward and backward, then the fakes'; the sums in .grad) on
    the DCGAN pair without BatchNorm: 2 ranks × b == 1 rank × 2b. (The first pair runs unsynced, its forward
    included: DDP decides a backward's sync at its forward. Both forwards first, then both backward calls, was 5e-4
    off under DDP before 2026-11-28, while FSDP2 and one rank agreed.)"""
    common = (
        *STACKED_IMAGES,
        *CONV_NETS["dcgan"],
        *CONV_AT_8,
        "model.discriminator.sigmoid=true",
        "model.loss=bce",
        "model.penalty=none",
        "optimizer@model.d_optimizer=sgd",
        "optimizer@model.g_optimizer=sgd",
        "scheduler=constant",
        "trainer.max_steps=12",
        "trainer.limit_val_batches=0",
        "trainer.num_sanity_val_steps=0",
        F64,  # bce's probabilities in the module's dtype (gan/objectives.py)
    )
    two = _train(tmp_path / "ddp", *common, *DDP, "data.batch_size=16")
    one = train_here(tmp_path / "one", *QUIET_RUN, *common, *ONE, "data.batch_size=32")
    _assert_same_weights(two, one)


def test_gan_quality_metrics_gather_every_ranks_samples(tmp_path):
    """FID, KID, PRDC and the stacked-digit modes under DDP: every rank updates its own validation batches and
    computes on all of them (torchmetrics' gather; no rank-0-only collective: DETAIL checks the order)."""
    out = _train(
        tmp_path / "ddp",
        "recipe=gan",
        "data=stacked_digits",
        "data.n_samples=2000",
        "model.data_dim=192",
        "model.latent_dim=8",
        "model.n_plot_samples=0",
        "+model.metrics.feature=digits",
        "+model.metrics.kid_subset_size=50",
        "trainer.max_steps=4",
        "trainer.val_check_interval=2",
        "trainer.limit_val_batches=2",
        *DDP,
        "data.batch_size=32",
    )
    logged = _last_logged(out)
    for name in ("fid", "kid", "precision", "recall", "density", "coverage", "modes", "kl_modes"):
        assert float(logged[f"val/{name}"]) >= 0, name
    assert 1 <= float(logged["val/modes"]) <= 128  # at most the 2 ranks × 2 batches × 32 samples scored


def test_tbptt_runs_under_ddp(tmp_path):
    out = _train(
        tmp_path / "ddp", "recipe=tbptt", *DDP, "trainer.max_steps=8", "data.seq_len=64", "trainer.limit_val_batches=2"
    )
    assert torch.load(out / "checkpoints/last.ckpt", weights_only=True)["global_step"] == 8
    assert list((out / "samples").glob("*.txt"))


def _sweep(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    """``python train.py -m recipe=multihead seed=1,2 trainer=ddp_cpu ...``: 2 jobs × 2 ranks."""
    return subprocess.run(
        [
            sys.executable,
            str(ROOT / "train.py"),
            "-m",
            "recipe=multihead",
            "seed=1,2",
            *DDP,
            "trainer.max_steps=3",
            *QUIET_RUN,
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
            *overrides,
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )


def test_multirun_sweep_with_stock_lightning_ddp_relaunches_the_sweep(tmp_path):
    """The failing alternative, reproduced: Lightning's own DDPStrategy starts rank 1 by re-running
    `sys.argv`, which under `-m` is the whole sweep, so the sweep is launched a second time inside
    job 0. (Here its job 1 then happens to pair with the parent's job 1 through the process group
    job 0 left up; with jobs of other lengths or sizes the ranks mismatch or wait forever.)"""
    proc = _sweep(tmp_path, "trainer.strategy={_target_:lightning.pytorch.strategies.DDPStrategy}")
    said = proc.stdout + proc.stderr
    assert said.count("Launching 2 jobs") == 2, said[-4000:]


def test_multirun_sweep_with_ddp_runs_each_job_once(tmp_path):
    """multiloss's launcher starts rank 1 on the job (its overrides, its output dir), not the sweep."""
    sweep = tmp_path / "sweep"
    proc = _sweep(tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    said = proc.stdout + proc.stderr
    assert said.count("Launching 2 jobs") == 1  # no relaunched sweep
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep"]  # no stray outputs/ or lightning_logs/
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1"]
    for job, seed in (("0", 1), ("1", 2)):
        out = sweep / job
        assert OmegaConf.load(out / ".hydra/config.yaml").seed == seed
        assert (out / "train_rank1.log").exists()  # its rank 1 ran this job, here
        assert torch.load(out / "checkpoints/last.ckpt", weights_only=True)["global_step"] == 3


def test_torchrun_launch(tmp_path):
    """torchrun starts both ranks itself; Lightning sees the torchelastic environment. Each rank
    composes its own config, and both land in one run dir named after the launch, not the clock. Each rank ends
    its process group before it exits (left to the interpreter's exit, gloo's threads could be torn down running:
    SIGABRT, and srun marks a finished job FAILED)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(ROOT / "train.py"),
            "recipe=gan",
            "trainer.strategy=ddp",
            "trainer.devices=2",
            "trainer.accelerator=cpu",
            "trainer.max_steps=6",
            "model.n_plot_samples=0",
            "+callbacks.exit._target_=tests.helpers.GroupStateAtExit",
            f"+callbacks.exit.dirpath={tmp_path / 'exit'}",
            *QUIET_RUN,
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "MEMBER: 2/2" in proc.stdout + proc.stderr
    assert [(tmp_path / "exit" / f"group_at_exit_rank{r}.txt").read_text() for r in (0, 1)] == ["False", "False"]
    shutil.rmtree(tmp_path / "exit")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outputs"]
    (out,) = (tmp_path / "outputs/gan").iterdir()  # one run dir for both ranks
    assert out.name.startswith("torchrun-")
    assert torch.load(out / "checkpoints/last.ckpt", weights_only=True)["global_step"] == 6
    assert len(list(out.rglob("metrics.csv"))) == 1


@pytest.mark.parametrize(
    "trainer",
    [
        ("trainer.strategy=ddp", "trainer.devices=2", "trainer.accelerator=cpu"),
        ("trainer=fsdp_cpu",),  # a sharded last.ckpt: each restarted rank reads its own shard
    ],
    ids=["ddp", "fsdp"],
)
def test_torchrun_restarts_a_job_whose_rank_died_and_it_continues_exactly(tmp_path, trainer):
    """``torchrun --max-restarts=1``: rank 1 dies (exit 3) in epoch 2; torchrun restarts both ranks,
    which find their run dir (named after the launch) and its last.ckpt (epoch 1's end) by
    themselves and train on to the same weights as a run never interrupted."""
    common = (
        "recipe=multihead",
        "model.net.width=32",
        "model.net.dropout=0.2",
        "data.batch_size=128",
        *trainer,
        "trainer.max_epochs=3",
    )
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = subprocess.run(
        [
            *torchrun,
            "--max-restarts=1",
            str(ROOT / "train.py"),
            *QUIET_RUN,
            *common,
            "callbacks.model_checkpoint.epoch_save_seconds=0",  # epoch 1's end saved, however short the epoch
            "+callbacks.die._target_=tests.helpers.DieOnce",
            "+callbacks.die.rank=1",
            "+callbacks.die.step=9",  # 6 steps an epoch (1438 examples, 2 × 128 a step): epoch 2
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (run,) = (tmp_path / "outputs/multihead").iterdir()
    assert "Restoring states from the checkpoint path" in proc.stdout + proc.stderr
    assert load_checkpoint(run / "checkpoints/last.ckpt")["global_step"] == 18

    straight = _train(tmp_path / "straight", *common)
    a, b = load_weights(run / "checkpoints/last.ckpt"), load_weights(straight / "checkpoints/last.ckpt")
    worst = max((a[k] - b[k]).abs().max().item() for k in a if isinstance(a[k], torch.Tensor))
    assert worst == 0.0, f"the restarted run's weights differ by {worst:.3g}"


@pytest.mark.parametrize("recipe", ["multihead", "weighted", "gan", "tbptt", "accumulation"])
def test_bf16_mixed_precision_runs_every_recipe(make_cfg, tmp_path, recipe):
    from multiloss import train

    extra = ("data.seq_len=64",) if recipe == "tbptt" else ()
    metrics = train(
        make_cfg(
            f"recipe={recipe}",
            "trainer=cpu",
            "trainer.precision=bf16-mixed",
            "trainer.max_steps=4",
            "trainer.limit_val_batches=1",
            "logger=none",
            "callbacks=none",
            *extra,
            output_dir=tmp_path,
        )
    )
    assert metrics and all(v == v for v in metrics.values())  # trained and logged, no NaN


def test_slurm_launcher_config_composes():
    """It cannot run here (no SLURM); it composes, and sizes the job from the trainer's settings."""
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(
            "train",
            overrides=["hydra/launcher=slurm", "trainer=ddp", "trainer.devices=4", "trainer.num_nodes=2"],
            return_hydra_config=True,
        )
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (2, 4, 4)


def test_two_devices_with_strategy_auto_run_multiloss_ddp(tmp_path):
    """`trainer.devices=2` alone (strategy auto) picks DDP: the GAN then needs multiloss's per-network
    wrappers, which stock Lightning DDP lacks (its unused-parameters error). As a user starts it: Lightning picks the
    strategy and starts rank 1 itself."""
    out = _command(
        tmp_path / "auto",
        "recipe=gan",
        "trainer.accelerator=cpu",
        "trainer.devices=2",
        "trainer.max_steps=4",
        "trainer.limit_val_batches=1",
        "model.n_plot_samples=0",
        *_counter(tmp_path / "auto"),
    )
    assert all(c["allreduces"] == c["optimizer_steps"] > 0 for c in _counts(out))


def test_a_dead_rank_ends_the_job_with_an_error_not_a_hang(tmp_path):
    """Rank 1 dies mid-training (as an OOM kill would): the job ends non-zero within seconds, not after the
    process group's 30-minute timeout."""
    start = time.monotonic()
    out = tmp_path / "run"
    proc = run_cli(
        *QUIET_RUN,
        "recipe=multihead",
        *DDP,
        "trainer.max_steps=50",
        "+callbacks.die._target_=tests.helpers.DieOnRank",
        f"hydra.run.dir={out}",
        cwd=tmp_path,
        timeout=240,
    )
    assert proc.returncode != 0
    assert time.monotonic() - start < 120


# Balancers under DDP: the linear ones (uncertainty's log-variance gradient, DWA's rank-averaged
# epoch means) give 2 ranks × b == 1 rank × 2b; the gradient-level ones reach DDP's all-reduce.
BALANCED = (
    "recipe=weighted",
    "data.shuffle=false",
    "optimizer=sgd",
    "trainer.max_epochs=3",
    "trainer.limit_train_batches=2",
    "trainer.limit_val_batches=0",
    "trainer.num_sanity_val_steps=0",
)


@pytest.mark.parametrize("balancer", ["uncertainty", "dwa", "famo"])
def test_loss_balancers_on_two_ranks_equal_one_rank(tmp_path, balancer):
    """DWA's 2-rank run also stops mid-epoch (step 3 of 3 × 2) and resumes: its running loss sums
    are each rank's own, and the checkpoint's mean of them gives the same epoch means. FAMO weighs, and learns its
    logits after each step, from the ranks' mean losses: its logits end as one rank's on the global batch."""
    common = (*BALANCED, f"balancer={balancer}", F64)
    if balancer == "dwa":
        first = _train(tmp_path / "ddp_first", *common, *DDP, "data.batch_size=16", "trainer.max_steps=3")
        resume = (f"ckpt_path={first / 'checkpoints/last.ckpt'}",)
    else:
        resume = ()
    two = _train(tmp_path / "ddp", *common, *DDP, "data.batch_size=16", *resume)
    one = train_here(tmp_path / "one", *QUIET_RUN, *common, *ONE, "data.batch_size=32")
    # Not DWA's running sums of the current epoch (extra state): each rank's are its own half.
    wa, wb = (load_weights(run / "checkpoints/last.ckpt") for run in (two, one))
    names = [k for k in wb if not k.endswith("_extra_state")]
    assert {wa[k].dtype for k in names if wa[k].is_floating_point()} == {torch.float64}  # float64 end to end
    worst = assert_gradients_close(wa, wb, atol=EXACT, rtol=0, names=names)
    print(f"{balancer}: 2 ranks × b vs 1 rank × 2b, largest weight difference {worst:.2g}")  # (pytest -s)
    if balancer == "famo":  # its logits: extra state (its own Adam steps them, not the recipe's optimizer)
        logits = [unpack_state(w["balancer._extra_state"])[""]["_w"] for w in (wa, wb)]
        worst = assert_gradients_close({"w": logits[0]}, {"w": logits[1]}, atol=EXACT, rtol=0)
        print(f"famo: its logits' largest difference {worst:.2g}")  # (pytest -s)
        assert logits[0].dtype == torch.float64 and bool(logits[0].abs().sum() > 0)
    else:
        assert any(k.startswith("balancer.") for k in names)  # the balancer's state (DWA's weights, sᵢ) too


@pytest.mark.parametrize("balancer", ["moco", "gradvac"])
def test_a_stateful_rule_of_scope_rank_resumes_each_ranks_own_state_exactly(tmp_path, balancer):
    """``scope=rank`` on 2 ranks: each rank's averages (MoCo's K × n, GradVac's cosine EMA) are its own; the checkpoint
    holds every rank's (one all-gather at the save) and each rank resumes with its own: stopped at step 3 and resumed
    to 6, the same checkpoint as the run that went straight to 6."""
    common = (*BALANCED, f"balancer={balancer}", *DDP, "data.batch_size=16")
    straight = _train(tmp_path / "straight", *common, "trainer.max_steps=6")
    first = _train(tmp_path / "first", *common, "trainer.max_steps=3")
    resumed = _train(
        tmp_path / "resumed", *common, "trainer.max_steps=6", f"ckpt_path={first / 'checkpoints/last.ckpt'}"
    )
    a, b = (load_weights(run / "checkpoints/last.ckpt") for run in (straight, resumed))
    states = unpack_state(a["balancer._extra_state"])["per_rank"]
    assert len(states) == 2 and not same_state(states[0], states[1])  # the ranks' own do differ
    assert same_state(a, b)


@pytest.mark.parametrize("balancer", ["pcgrad", "gradnorm", "upgrad"])
def test_gradient_balancers_all_reduce_once_per_step_under_accumulation(tmp_path, balancer):
    """GradNorm's Lᵢ(0) is the ranks' mean of the first step's losses (1 rank × 2b's), the same on every
    rank: a resumed run, which loads rank zero's, goes on exactly as the straight one."""
    out = tmp_path / "ddp"
    common = (*BALANCED, f"balancer={balancer}", "model.accumulate_grad_batches=2", *DDP, "data.batch_size=16", F64)
    _train(out, *common, *_counter(out))
    for counts in _counts(out):
        assert counts["optimizer_steps"] == 3
        assert counts["allreduces"] == 3, counts  # the surrogate backward reaches DDP's reducer, no_sync kept
    if balancer == "gradnorm":
        # One rank × 2b, k=2 as well (the losses a balancer sees carry Lightning's 1/k).
        single = (*BALANCED, "balancer=gradnorm", "model.accumulate_grad_batches=2", *ONE, "data.batch_size=32", F64)
        one = train_here(tmp_path / "one", *QUIET_RUN, *single, "trainer.max_steps=1")
        initial = [
            load_weights(run / "checkpoints/last.ckpt")["balancer._extra_state"]["initial_losses"] for run in (out, one)
        ]
        assert initial[0].dtype == torch.float64  # the losses as the float64 step made them (no float32 cast)
        worst = assert_gradients_close({"L(0)": initial[0]}, {"L(0)": initial[1]}, atol=EXACT, rtol=0)
        print(f"gradnorm: Lᵢ(0) on 2 ranks vs 1 rank, largest difference {worst:.2g}")  # (pytest -s)


# ``model.accumulation_mean=examples``: the counts of a step's examples (tokens) are those of every rank.


def test_accumulation_mean_examples_on_two_ranks_equals_one_batch_of_all_examples(tmp_path):
    """2 ranks × 16 × k=4 with ``accumulation_mean=examples`` == 1 rank × one batch of 128, through the epoch's short
    last step (2 × 15 examples): every step is the mean over all its examples, each weighing the same."""
    common = (
        "recipe=accumulation",
        "data.shuffle=false",
        "trainer.max_epochs=1",
        "trainer.limit_val_batches=0",
        F64,
    )
    two = _train(
        tmp_path / "ddp",
        *common,
        *DDP,
        "data.batch_size=16",
        "model.accumulate_grad_batches=4",
        "model.accumulation_mean=examples",  # (the default, named: the test's subject)
    )
    one = train_here(
        tmp_path / "one", *QUIET_RUN, *common, *ONE, "data.batch_size=128", "model.accumulate_grad_batches=1"
    )
    assert torch.load(two / "checkpoints/last.ckpt", weights_only=True)["global_step"] == 12  # 11 full + the short one
    _assert_same_weights(two, one)
    # Both at linear LR scaling: 16 × 4 × 2 ranks = 128 × 1 × 1 = 128 vs base 64, SGD's 0.1 × 2.
    for out, world_size in ((two, 2), (one, 1)):
        assert json.loads((out / "lr_scaling.json").read_text())["world_size"] == world_size
        assert _last_logged(out)["lr-SGD"] == pytest.approx(0.2)


def test_tbptt_accumulation_mean_examples_sums_every_ranks_tokens(tmp_path):
    """Padded sequences of 1-24 scored tokens: 2 ranks × 2 sequences with ``accumulation_mean=examples`` == 1 rank × 4,
    every step the mean over both ranks' scored tokens (the ranks' counts differ)."""
    data = padded_token_npz(tmp_path / "tokens.npz", n=16, seq_len=24)
    common = (
        *padded_tbptt(data),
        "data.shuffle=false",
        "optimizer=sgd",
        "model.optimizer.lr=0.5",
        "model.gradient_clip_val=null",
        "model.chunk_length=8",
        "model.accumulate_grad_batches=2",
        "model.accumulation_mean=examples",  # (the default, named: the test's subject)
        "trainer.max_steps=8",
        "trainer.limit_val_batches=0",
        "trainer.num_sanity_val_steps=0",
        F64,
    )
    two = _train(tmp_path / "ddp", *common, *DDP, "data.batch_size=2")
    one = train_here(tmp_path / "one", *QUIET_RUN, *common, *ONE, "data.batch_size=4")
    _assert_same_weights(two, one)
    # Not vacuous: averaging each rank's own token mean (what per-rank counts would give) differs.
    datamodule, module = build(
        compose_config([*padded_tbptt(data), "data.shuffle=false", "data.batch_size=4"], tmp_path)
    )
    batch = first_batch(datamodule)
    halves = [{k: v[r::2] for k, v in batch.items()} for r in (0, 1)]
    assert halves[0]["mask"].sum() != halves[1]["mask"].sum()
    exact = tbptt_gradients(module.net, batch, chunk_length=8, every=2, count_exact=True)[0]["net.head.bias"]
    per_rank = [tbptt_gradients(module.net, h, chunk_length=8, every=2, count_exact=True)[0] for h in halves]
    assert (exact - (per_rank[0]["net.head.bias"] + per_rank[1]["net.head.bias"]) / 2).abs().max() > 1e-4


def test_tbptt_streams_on_two_ranks_equal_the_loop_over_all_their_streams(tmp_path):
    """data.layout=streams: rank r reads streams r·B to (r+1)·B - 1 of the corpus cut into 2B; DDP averages the
    ranks' mean chunk losses (equal token counts), so 2 ranks × 2 streams == the hand-written loop over 4
    streams, the state carried on each rank: both in float64."""
    from multiloss.data.vocabulary import pydoc_text
    from multiloss.testing import stream_gradients

    train_file, val_file = tmp_path / "train.txt", tmp_path / "valid.txt"
    train_file.write_text(pydoc_text()[:400])
    val_file.write_text(pydoc_text()[400:500])
    common = (
        *char_streams(train_file, val_file),
        "data.seq_len=12",
        "model.chunk_length=4",
        "model.net.embedding_dim=8",
        "model.net.hidden_size=16",
        "trainer.max_steps=15",  # 5 windows of 3 chunks, each rank its own 2 streams
        "trainer.limit_val_batches=0",
        "trainer.num_sanity_val_steps=0",
        F64,
    )
    two = _train(tmp_path / "ddp", *common, *DDP, "data.batch_size=2")
    datamodule, module = build(compose_config([*common, "data.batch_size=4"], tmp_path / "ref"))
    module.net.double()  # the reference in the run's float64 (its float32 initial weights are exact in float64)
    initial = {f"net.{n}": p.detach().clone() for n, p in module.net.named_parameters()}
    grads = stream_gradients(module.net, datamodule.train_ids, 4, 12, 4, lr=0.5, steps=15)
    expected = {n: w - 0.5 * sum(g[n] for g in grads) for n, w in initial.items()}  # plain SGD, by hand
    got = load_weights(two / "checkpoints/last.ckpt")
    worst = assert_gradients_close({n: got[n] for n in expected}, expected, atol=EXACT, rtol=0)
    print(f"tbptt streams: 2 ranks vs the loop by hand, largest weight difference {worst:.2g}")  # (pytest -s)
    # Not vacuous: the same loop over the first 2 streams alone (one rank's) ends elsewhere.
    alone = stream_gradients(
        module.net, datamodule.train_ids[: len(datamodule.train_ids) // 2], 2, 12, 4, lr=0.5, steps=15
    )
    assert (sum(g["net.head.bias"] for g in alone) - sum(g["net.head.bias"] for g in grads)).abs().max() > 1e-3


def test_a_config_error_every_rank_meets_is_printed_once(tmp_path):
    # The component check fails on both ranks at setup: one message, exit 2, no run dir left.
    out = tmp_path / "run"
    proc = run_cli(*QUIET_RUN, *DDP, "recipe=gan", "model.data_dim=3", f"hydra.run.dir={out}", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("multiloss: config error")]
    assert len(errors) == 1 and "model.generator" in errors[0], proc.stderr[-3000:]
    assert not out.exists()


def test_nodes_that_never_start_are_named_within_seconds_and_the_wait_ends_in_one_message(tmp_path):
    """``trainer.num_nodes=2`` on one machine: 2 of 4 ranks ever join. Within seconds rank 0's node says who is
    missing, where they must connect and how nodes start; at ``rendezvous_timeout`` every rank stops, one message
    (not 30 minutes of silence and a DistStoreError traceback at the collective timeout)."""
    out = tmp_path / "run"
    started = time.monotonic()
    proc = run_cli(
        *QUIET_RUN, *DDP, "trainer.num_nodes=2", "rendezvous_timeout=12", f"hydra.run.dir={out}", cwd=tmp_path
    )
    took = time.monotonic() - started
    assert proc.returncode == 1, proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if line.startswith("multiloss:")]
    assert len(said) == 2, proc.stderr[-3000:]
    waiting, stopped = said
    port = stopped.split("joined at 127.0.0.1:")[1].split()[0]
    # After 5 s this node's second rank may still be starting on a busy machine: 1 or 2 of 4.
    assert re.match(r"multiloss: waiting for the other ranks: [12] of 4 \(trainer.num_nodes=2 × 2 processes\)", waiting)
    assert f"MASTER_PORT={port}" in waiting and "srun" in waiting and "torchrun --nnodes" in waiting
    # On a busy machine rank 1 may still be importing at 12 s: 1 or 2 of 4, either way named.
    assert re.match(r"multiloss: run stopped: [12] of 4 ranks", stopped) and "in 12 s (rendezvous_timeout)" in stopped
    assert "Traceback" not in proc.stderr and "DistStoreError" not in proc.stderr
    assert took < 60, took  # rendezvous_timeout=12 plus start-up on a busy 2-core machine: not the 1800 s of before
    assert not out.exists()  # stopped before the run wrote anything
