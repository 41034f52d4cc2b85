"""The GAN's accumulation: k micro-batches of b == one batch of k·b, per optimizer step, in float64.

Lightning's ``trainer.accumulate_grad_batches`` refuses manual optimization, so the GAN accumulates
through its own step, `multiloss.base.step.OptimizerStep` (``model.accumulate_grad_batches``; each
micro-batch's mean loss weighted by its share of the step's examples, ``model.accumulation_mean``).
Both runs below are the recipe's real training step under the real Trainer, in float64
(``trainer.precision=64-true``); the gradients are captured just before every optimizer step. SGD, so
the weights after a step are a function of the gradient alone and the later steps compare as exactly
as the first.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from hydra.utils import instantiate

from multiloss import testing
from multiloss.testing import GradientCapture, assert_gradients_close
from tests.conftest import BARE, SMALL_GAN

G_INDEX, D_INDEX = 0, 1
EXACT = 1e-10  # float64: equal up to rounding (the sums' order differs), on any CPU
BASE = (
    "recipe=gan",
    *BARE,
    *SMALL_GAN,
    "model.n_plot_samples=0",
    "model.n_critic=1",
    "optimizer@model.g_optimizer=sgd",
    "optimizer@model.d_optimizer=sgd",
    "model.g_optimizer.lr=0.05",
    "model.d_optimizer.lr=0.05",
    "trainer.precision=64-true",
)


def _run(make_cfg, *overrides: str) -> tuple[GradientCapture, dict]:
    cfg = make_cfg(*BASE, *overrides)
    L.seed_everything(cfg.seed)
    datamodule, model = testing.build(cfg)
    capture = GradientCapture()
    trainer = instantiate(cfg.trainer, callbacks=[capture], logger=False, enable_checkpointing=False)
    trainer.fit(model, datamodule=datamodule)
    return capture, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    "loss",
    [
        ("model.loss=nonsaturating", "model.penalty=none", "model.n_critic=1"),
        ("model.loss=wgan-gp", "model.penalty_weight=0.5", "model.n_critic=1"),
    ],
    ids=["nonsaturating", "wgan-gp"],
)
def test_k_micro_batches_of_b_equal_one_batch_of_kb(make_cfg, loss):
    k, b, steps = 4, 16, 6  # 3 discriminator steps, each followed by a generator step
    micro, micro_weights = _run(
        make_cfg, *loss, f"model.accumulate_grad_batches={k}", f"data.batch_size={b}", f"trainer.max_steps={steps}"
    )
    whole, whole_weights = _run(make_cfg, *loss, f"data.batch_size={k * b}", f"trainer.max_steps={steps}")

    # Same schedule: one D step per k micro-batches, one G step (of k micro-batches of noise) after it.
    assert micro.optimizer_index == whole.optimizer_index == [D_INDEX, G_INDEX] * (steps // 2)
    # The discriminator's update (and the generator's) from k×b equals the one from k·b, step by step.
    for accumulated, single in zip(micro.steps, whole.steps):
        assert accumulated.keys() == single.keys()
        assert_gradients_close(accumulated, single, atol=EXACT, rtol=EXACT)
    # Not vacuous: the gradients are not zero, and the weights after three steps of each agree.
    assert sum(g.abs().sum() for g in micro.steps[0].values()) > 0
    assert all(v.dtype == torch.float64 for v in micro_weights.values() if v.is_floating_point())
    assert_gradients_close(micro_weights, whole_weights, atol=EXACT, rtol=EXACT)


def test_accumulated_steps_follow_the_micro_batch_count_and_the_epoch_end(make_cfg):
    """k=4 over 6 batches an epoch: D steps after batch 4 (then G), and after batch 6, the epoch's
    last (no gradient is carried into the next epoch); that short last D step is followed by G's, as
    one batch of k·b's short last batch is."""
    capture, _ = _run(
        make_cfg,
        "model.accumulate_grad_batches=4",
        "data.batch_size=16",
        "trainer.limit_train_batches=6",
        "trainer.max_epochs=2",
    )
    assert capture.optimizer_index == [D_INDEX, G_INDEX, D_INDEX, G_INDEX] * 2


def test_trainer_accumulation_is_rejected_naming_the_model_key(make_cfg, tmp_path):
    """Lightning refuses Trainer(accumulate_grad_batches=k) for a manual-optimization module (with a
    traceback, mid-fit): the recipe rejects it first, before any file is written, naming the key to use."""
    from multiloss import ConfigError, train

    with pytest.raises(ConfigError) as err:
        train(make_cfg("recipe=gan", "trainer.accumulate_grad_batches=2", output_dir=tmp_path))
    assert err.value.key == "trainer.accumulate_grad_batches"
    assert "model.accumulate_grad_batches=2" in err.value.message
    assert not (tmp_path / ".hydra").exists()
