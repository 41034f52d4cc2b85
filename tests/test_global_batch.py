"""One meaning of the global batch: W ranks × b × k micro-batches is one step of the same examples on every shape.

``model.accumulation_mean=examples`` (the default, `multiloss.base.window`) weighs each micro-batch's mean loss by its
examples' share of its step over every rank, so an optimizer step is the mean over its examples whatever splits
them: 1 × 64, 1 × 32 × k 2, 1 × 16 × k 4 (``global_batch_size=64`` derives k) and 2 ranks × 32 train the same
steps, an epoch's last, ragged one included. Every recipe that accumulates runs here for two epochs whose last global
batch holds an odd number of examples (the two ranks' shares differ by one), in float64 (``trainer.precision=64-true``)
with SGD: the gradients of every step on one device, and the weights at the end on two ranks, equal the 1 × 64
run's to 1e-10 — an algebraic identity, so any CPU's rounding (~1e-16 a step) stays far inside it. The weighted
recipe's losses (``balancer=uncertainty``: its own term too) and the GAN's terms (D's loss and penalty, G's loss,
the lazy penalty's step) are weighed alike. ``micro_batches`` (the plain loop's ``loss / k``) parts from it at the
epoch's last step. A run stopped mid-epoch on 2 × 32 and continued on 1 × 32 with ``global_batch_size=64`` ends on
the straight 1 × 64 run's weights.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from hydra.utils import instantiate

from multiloss import testing, train
from multiloss.config import ConfigError
from multiloss.testing import GradientCapture
from tests.conftest import BARE, QUIET, load_weights
from tests.rank_pool import pooled_train

EXACT = 1e-10  # float64: equal up to rounding, on any CPU
FLOAT64_SGD = ("trainer.precision=64-true", "trainer.max_epochs=2", "data.shuffle=true")
DIGITS_ODD_TAIL = ("data.val_fraction=0.1",)  # 1617 training digits: 25 × 64 + 17 (ranks: 9 and 8)
GAUSSIANS_ODD_TAIL = ("data.n_samples=1001",)  # 901 training points: 14 × 64 + 5 (ranks: 3 and 2)
SMALL_GAN = ("model.generator.width=16", "model.discriminator.width=16", "model.n_plot_samples=0")
SGD_GAN = (
    "optimizer@model.g_optimizer=sgd",
    "optimizer@model.d_optimizer=sgd",
    "model.g_optimizer.lr=0.01",
    "model.d_optimizer.lr=0.01",
)
RECIPES = {
    "multihead": ("recipe=multihead", "model.net.width=16", "optimizer=sgd", *DIGITS_ODD_TAIL),
    "weighted_uncertainty": (
        "recipe=weighted",
        "balancer=uncertainty",
        "model.net.width=16",
        "optimizer=sgd",
        *DIGITS_ODD_TAIL,
    ),
    "accumulation": ("recipe=accumulation", "model.net.width=16", *DIGITS_ODD_TAIL),
    "gan_wgan_gp": ("recipe=gan", *SMALL_GAN, *SGD_GAN, *GAUSSIANS_ODD_TAIL),
    # R1 in its own lazy step every 2nd D step (its micro-batches weighed as D's), G on D's noise.
    "gan_lazy_r1_same_z": (
        "recipe=gan",
        *SMALL_GAN,
        *SGD_GAN,
        *GAUSSIANS_ODD_TAIL,
        "model.loss=nonsaturating",
        "model.penalty=r1",
        "model.penalty_weight=0.5",
        "model.penalty_every=2",
        "model.n_critic=1",
        "model.g_input=same_z",
    ),
}
SHAPES = {"1x64": ("data.batch_size=64",), "1x32k2": ("data.batch_size=32",), "1x16k4": ("data.batch_size=16",)}


def _fit(make_cfg, *overrides: str) -> tuple[GradientCapture, dict[str, torch.Tensor]]:
    """One device, in this process: every optimizer step's gradients, and the weights at the end."""
    cfg = make_cfg(*BARE, *FLOAT64_SGD, *overrides)
    L.seed_everything(cfg.seed)
    datamodule, model = testing.build(cfg)
    capture = GradientCapture()
    trainer = instantiate(cfg.trainer, callbacks=[capture], logger=False, enable_checkpointing=False)
    trainer.fit(model, datamodule=datamodule)
    return capture, {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def _accumulated(make_cfg, recipe: str, shape: str, *more: str) -> tuple[GradientCapture, dict[str, torch.Tensor]]:
    # global_batch_size derives k (multiloss.train does it; a Trainer built here takes the k it would derive).
    k = 64 // int(SHAPES[shape][0].split("=")[1])
    return _fit(make_cfg, *RECIPES[recipe], *SHAPES[shape], f"model.accumulate_grad_batches={k}", *more)


def _worst_step(a: GradientCapture, b: GradientCapture) -> tuple[float, int]:
    """The largest gradient difference of two runs' steps, and the step it is at."""
    assert len(a.steps) == len(b.steps) > 0 and a.optimizer_index == b.optimizer_index
    worst, at = 0.0, -1
    for i, (x, y) in enumerate(zip(a.steps, b.steps)):
        assert x.keys() == y.keys()
        for name in x:
            if x[name] is None or y[name] is None:
                assert x[name] is None and y[name] is None, name
                continue
            assert x[name].dtype == torch.float64
            gap = (x[name] - y[name]).abs().max().item()
            if gap > worst:
                worst, at = gap, i
    return worst, at


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_every_shape_of_the_global_batch_steps_alike_an_epochs_last_step_included(make_cfg, recipe):
    big, _ = _accumulated(make_cfg, recipe, "1x64")
    for shape in ("1x32k2", "1x16k4"):
        accumulated, _ = _accumulated(make_cfg, recipe, shape)
        worst, at = _worst_step(accumulated, big)
        assert worst <= EXACT, f"{shape}: {worst:.3g} at step {at} of {len(big.steps)}"
    # Not vacuous: the steps moved the weights (the gradients are not all zero).
    assert max(g.abs().max().item() for step in big.steps for g in step.values() if g is not None) > 1e-3


def test_the_plain_loops_mean_parts_from_it_at_the_epochs_ragged_last_step(make_cfg):
    """``model.accumulation_mean=micro_batches``: the same steps until epoch 0's last (25 full steps of 64, then 17
    examples: one micro-batch of 17 weighed 1/2), then apart; ``examples`` stays on the 1 × 64 run."""
    big, _ = _accumulated(make_cfg, "multihead", "1x64")
    plain, _ = _accumulated(make_cfg, "multihead", "1x32k2", "model.accumulation_mean=micro_batches")
    per_step = [max((x[n] - y[n]).abs().max().item() for n in x) for x, y in zip(plain.steps, big.steps)]
    assert max(per_step[:25]) <= EXACT
    assert per_step[25] > 1e-3, per_step[25]  # the last step of epoch 0: half the mean's gradient


# --- two ranks ---------------------------------------------------------------------------------------------------


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return {k: v for k, v in load_weights(out / "checkpoints/last.ckpt").items() if isinstance(v, torch.Tensor)}


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a if a[k].is_floating_point())
    assert worst <= EXACT, worst
    return worst


def _two_ranks(out: Path, recipe: str, *more: str) -> Path:
    return pooled_train(
        out,
        *QUIET,
        *RECIPES[recipe],
        *FLOAT64_SGD,
        "trainer=ddp_cpu",
        "trainer.limit_val_batches=0",
        "trainer.num_sanity_val_steps=0",
        "~callbacks.loss_curves",
        "data.batch_size=32",
        "global_batch_size=64",
        *more,
    )


@pytest.mark.distributed
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_two_ranks_of_32_step_as_one_of_64_an_epochs_ragged_last_step_included(make_cfg, tmp_path, recipe):
    """2 × 32 against 1 × 64 over two epochs whose last global batch is odd (rank 0 holds one example more): DDP's mean
    over the ranks weighs each rank's examples, not each rank 1/2; the GAN's noise is one draw of the global batch's
    rows, each rank taking its own."""
    _, one = _accumulated(make_cfg, recipe, "1x64")
    two = _weights(_two_ranks(tmp_path / "two", recipe))
    _assert_same(two, one)


@pytest.mark.distributed
@pytest.mark.parametrize("recipe", ["multihead", "gan_wgan_gp"])
def test_two_ranks_stopped_mid_epoch_continue_on_one_with_the_global_batch_as_the_straight_run(
    make_cfg, tmp_path, recipe
):
    """2 × 32 stopped in epoch 0, continued on 1 × 32 with ``global_batch_size=64`` (k = 2 derived) through the epoch's
    ragged last step and the next epoch: the straight 1 × 64 run's weights, to 1e-10."""
    stop = "trainer.max_steps=12"  # mid-epoch 0 (26 steps an epoch; the GAN counts both networks' steps)
    first = _two_ranks(tmp_path / "first", recipe, stop)
    resumed = tmp_path / "resumed"
    train(
        make_cfg(
            *RECIPES[recipe],
            *FLOAT64_SGD,
            "trainer=cpu",
            "trainer.limit_val_batches=0",
            "trainer.num_sanity_val_steps=0",
            "~callbacks.loss_curves",
            "data.batch_size=32",
            "global_batch_size=64",
            f"ckpt_path={first / 'checkpoints/last.ckpt'}",
            output_dir=resumed,
        )
    )
    _, straight = _accumulated(make_cfg, recipe, "1x64")
    _assert_same(_weights(resumed), straight)


def test_tbptt_refuses_a_global_batch_of_several_batches(make_cfg, tmp_path):
    """tbptt accumulates the chunks of a batch (``model.accumulate_grad_batches``), not batches: a global batch of two
    batches would make k chunks, not k batches — refused by name before anything is written; one batch's is taken."""
    tiny = ("recipe=tbptt", "model.net.hidden_size=8", "data.seq_len=16", "model.sample_length=2", *BARE)
    with pytest.raises(ConfigError) as err:
        train(make_cfg(*tiny, "data.batch_size=4", "global_batch_size=8", output_dir=tmp_path / "refused"))
    assert (err.value.key, err.value.value) == ("global_batch_size", 8)
    assert "chunks" in err.value.message and not (tmp_path / "refused").exists()
    train(
        make_cfg(*tiny, "data.batch_size=4", "global_batch_size=4", "trainer.max_steps=2", output_dir=tmp_path / "ok")
    )
