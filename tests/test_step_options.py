"""The step options every recipe shares: ``model.accumulate_grad_batches``, ``model.gradient_clip_val``, ``scheduler``.

Every recipe runs under manual optimization, its whole step in ``training_step``; Lightning's
``trainer.accumulate_grad_batches`` and ``trainer.gradient_clip_val`` cannot act there and are refused
with the model key named. Clipping under a GradScaler (16-mixed) sees the true gradients.
"""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from multiloss import testing, train
from multiloss.config import ConfigError
from tests.conftest import BARE, SMALL_GAN

RECIPES = {
    "multihead": (),
    "weighted": (),
    "gan": (*SMALL_GAN, "model.n_plot_samples=0"),
    "tbptt": ("model.net.hidden_size=16", "data.seq_len=32", "model.sample_length=5"),
    "accumulation": (),
}


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize(
    ("override", "key", "named"),
    [
        ("trainer.accumulate_grad_batches=2", "trainer.accumulate_grad_batches", "model.accumulate_grad_batches=2"),
        ("trainer.gradient_clip_val=0.5", "trainer.gradient_clip_val", "model.gradient_clip_val=0.5"),
    ],
    ids=["accumulate", "clip"],
)
def test_lightnings_own_keys_are_refused_naming_the_model_key(make_cfg, tmp_path, recipe, override, key, named):
    with pytest.raises(ConfigError) as err:
        train(make_cfg(f"recipe={recipe}", *RECIPES[recipe], override, output_dir=tmp_path))
    assert err.value.key == key
    assert named in err.value.message
    assert not tmp_path.exists() or not any(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("model.accumulate_grad_batches=0", "model.accumulate_grad_batches"),
        ("model.gradient_clip_val=-1", "model.gradient_clip_val"),
        ("model.gradient_clip_algorithm=l1", "model.gradient_clip_algorithm"),
        ("model.accumulation_mean=tokens", "model.accumulation_mean"),
    ],
)
def test_bad_step_options_name_their_key(make_cfg, tmp_path, recipe, override, key):
    with pytest.raises(ConfigError) as err:
        train(make_cfg(f"recipe={recipe}", *RECIPES[recipe], override, output_dir=tmp_path))
    assert err.value.key == key


@pytest.mark.parametrize("recipe", ["multihead", "weighted", "gan", "accumulation"])
def test_clipping_bounds_every_step_of_every_recipe(make_cfg, recipe):
    """One SGD step of lr 1 with model.gradient_clip_val=1e-3: no network moves by more than 1e-3."""
    gan = recipe == "gan"
    sgd = ("optimizer@model.g_optimizer=sgd", "optimizer@model.d_optimizer=sgd") if gan else ("optimizer=sgd",)
    lr = ("model.g_optimizer.lr=1.0", "model.d_optimizer.lr=1.0") if gan else ("model.optimizer.lr=1.0",)
    cfg = make_cfg(
        f"recipe={recipe}",
        *RECIPES[recipe],
        *BARE,
        *sgd,
        *lr,
        "model.gradient_clip_val=1e-3",
        "model.accumulate_grad_batches=1",
        "scheduler=constant",
    )
    if recipe == "accumulation":
        cfg.model.lr_scaling = "none"
    datamodule, model = testing.build(cfg)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    testing.bare_trainer(max_steps=1).fit(model, datamodule=datamodule)
    moved = torch.linalg.vector_norm(torch.stack([(p - before[n]).norm() for n, p in model.named_parameters()])).item()
    assert 0 < moved <= 1e-3 * (1 + 1e-4), moved


@pytest.mark.parametrize("recipe", ["multihead", "gan"])
@pytest.mark.parametrize("clean", [True, False])
def test_clean_gradients_is_stylegan2_adas_nan_to_num(make_cfg, recipe, clean):
    """``model.clean_gradients=true``: before the step every gradient goes through stylegan2-ada's clean-up
    (training_loop.py 289-291: ``nan_to_num(nan=0, posinf=1e5, neginf=-1e5)``): a weight whose gradient a hook makes
    [nan, inf, -inf, 1e6, ...] moves by SGD lr 1 × [0, 1e5, -1e5, 1e6, ...] (finite values kept, as torch's
    ``nan_to_num``). Off, the same step writes NaN and ±inf into the weight."""
    gan = recipe == "gan"
    sgd = ("optimizer@model.g_optimizer=sgd", "optimizer@model.d_optimizer=sgd") if gan else ("optimizer=sgd",)
    lr = ("model.g_optimizer.lr=1.0", "model.d_optimizer.lr=1.0", "model.loss=nonsaturating", "model.penalty=none")
    cfg = make_cfg(
        f"recipe={recipe}",
        *RECIPES[recipe],
        *BARE,
        *sgd,
        *(lr if gan else ("model.optimizer.lr=1.0",)),
        f"model.clean_gradients={str(clean).lower()}",
        "scheduler=constant",
        "nonfinite=warn",
    )
    datamodule, model = testing.build(cfg)
    weight = next(p for p in (model.discriminator if gan else model).parameters() if p.numel() >= 4)
    bad = torch.tensor([float("nan"), float("inf"), float("-inf"), 1e6])

    def poisoned(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad.view(-1)[:4] = bad
        return grad

    weight.register_hook(poisoned)
    before = weight.detach().clone().view(-1)[:4]
    testing.bare_trainer(max_steps=1).fit(model, datamodule=datamodule)
    after = weight.detach().view(-1)[:4]
    if clean:
        assert torch.equal(after, before - torch.nan_to_num(bad, nan=0, posinf=1e5, neginf=-1e5))
    else:
        assert after.isnan()[0] and after[1] == float("-inf") and after[2] == float("inf")


def test_16_mixed_clipping_sees_the_true_gradients(make_cfg):
    """Under a GradScaler the backward's gradients are multiplied by the loss scale; the step unscales them
    before clipping (Lightning's own manual optimization clips the scaled ones: issue #18089), and its
    optimizer step does not unscale them a second time. One SGD step of lr 1 then moves the weights by
    exactly the clip norm, as in fp32 — not by clip / scale."""
    cfg = make_cfg("recipe=multihead", *BARE, "optimizer=sgd", "model.optimizer.lr=1.0", "model.gradient_clip_val=1e-3")
    datamodule, model = testing.build(cfg)
    before = [p.detach().clone() for p in model.parameters()]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    trainer = testing.bare_trainer(max_steps=1, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    trainer.fit(model, datamodule=datamodule)
    assert trainer.precision_plugin.scaler.get_scale() == 2.0**10  # the step was taken, not skipped for an inf
    moved = torch.linalg.vector_norm(torch.stack([(p - b).norm() for p, b in zip(model.parameters(), before)])).item()
    assert moved == pytest.approx(1e-3, rel=1e-3), moved


def test_the_logging_step_counts_optimizer_steps_under_accumulation(make_cfg, tmp_path):
    """Lightning is told the recipe's k, so its logging step, its log rows and estimated_stepping_batches
    count optimizer steps as the recipe takes them (and a Trainer fitted again starts from 1 again)."""
    cfg = make_cfg(
        "recipe=accumulation",
        *BARE,
        "logger=csv",
        "data.batch_size=16",
        "model.accumulate_grad_batches=4",
        "trainer.max_steps=6",
        "trainer.log_every_n_steps=2",
        output_dir=tmp_path,
    )
    train(cfg)
    import csv

    rows = [r for r in csv.DictReader(next(tmp_path.rglob("metrics.csv")).open()) if r.get("loss/total")]
    assert [int(r["step"]) for r in rows] == [1, 3, 5]  # a row every 2 optimizer steps of 4 micro-batches
    datamodule, model = testing.build(cfg)
    trainer = testing.bare_trainer(max_steps=2)
    trainer.fit(model, datamodule=datamodule)
    assert trainer.global_step == 2 and trainer.accumulate_grad_batches == 1
    trainer.fit_loop.epoch_loop.max_steps = 3
    trainer.fit(model, datamodule=datamodule)  # the same Trainer again: Lightning's check passes
    assert trainer.global_step == 3


class _StepRecorder(L.Callback):
    """Each optimizer step as the optimizer sees it: the batch, which optimizer, its rate, its gradient norm."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, int, float, float]] = []
        self.lengths: list[int] = []  # each training batch's sequence length (tbptt: its chunks)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batch_idx = batch_idx
        x = batch["x"] if isinstance(batch, dict) else batch[0]
        self.lengths.append(x.shape[1] if x.dim() > 1 else 1)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        index = [getattr(o, "optimizer", o) for o in trainer.optimizers].index(
            getattr(optimizer, "optimizer", optimizer)
        )
        grads = [p.grad.norm() for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack(grads)).item()
        self.steps.append((self.batch_idx, index, optimizer.param_groups[0]["lr"], norm))


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_the_step_options_act_the_same_in_every_recipe(make_cfg, recipe):
    """k = 2, clipping at 1e-3 and a per-step warm-up through each recipe's step
    (`multiloss.base.step.OptimizerStep`): every
    optimizer steps once every k micro-batches (tbptt's micro-batches are its chunks), on a gradient clipped to the
    bound, at the rate the schedule gives its own step count (the warm-up's (j + 1) / 4 of the rate: one schedule
    step per optimizer step, none per micro-batch)."""
    gan = ("model.n_critic=1",) if recipe == "gan" else ()
    cfg = make_cfg(
        f"recipe={recipe}",
        *RECIPES[recipe],
        *gan,
        *BARE,
        "model.accumulate_grad_batches=2",
        "model.gradient_clip_val=1e-3",
        "scheduler=warmup_cosine",
        "model.scheduler.warmup_steps=3",
    )
    datamodule, model = testing.build(cfg)
    recorder = _StepRecorder()
    testing.bare_trainer(max_epochs=1, limit_train_batches=8, callbacks=[recorder]).fit(model, datamodule=datamodule)
    optimizers = sorted({i for _, i, _, _ in recorder.steps})
    assert len(optimizers) == (2 if recipe == "gan" else 1)
    for index in optimizers:
        steps = [s for s in recorder.steps if s[1] == index]
        if recipe == "tbptt":  # ⌈chunks / k⌉ steps in each batch
            chunks = [math.ceil(n / model.chunk_length) for n in recorder.lengths]
            assert [sum(1 for s in steps if s[0] == b) for b in range(8)] == [math.ceil(c / 2) for c in chunks]
        else:
            assert [s[0] for s in steps] == [1, 3, 5, 7]
        assert all(0 < norm <= 1e-3 * (1 + 1e-4) for *_, norm in steps), steps
        rates = [rate for _, _, rate, _ in steps]
        assert rates[1] == pytest.approx(2 * rates[0]) and rates[2] == pytest.approx(3 * rates[0]), rates
