"""`accumulation`: k micro-batches of b == one batch of k·b == the hand-written loop; LR == the rule.

The runs are the recipe's own, under the real Trainer and the real composed config; the reference
is the hand-written loop in plain PyTorch (``loss / accumulation_steps``, ``backward()`` every batch,
``step()`` every ``accumulation_steps``), reading the examples straight from the split tensors.
Weights are compared after several SGD steps (not Adam: see tests/recipes/test_multihead.py), in
float64 (``trainer.precision=64-true``, the references' tensors in float64) to 1e-10: an algebraic
equality, so any CPU's rounding (~1e-16 a step) stays far inside it.
Expected learning rates are worked out by hand in the test tables, not by calling the rule.
"""

from __future__ import annotations

import copy
import csv
import json

import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate

from multiloss import testing, train
from multiloss.base.lr_scaling import effective_batch_size, lr_factor, scaled_lr
from multiloss.config import ConfigError
from multiloss.testing import GradientCapture
from tests.conftest import ONE_CPU_NO_VAL, load_weights

FAST = (
    "recipe=accumulation",
    "optimizer=sgd",
    *ONE_CPU_NO_VAL,
    "model.net.width=32",
    "trainer.precision=64-true",
)
EXACT = 1e-10  # float64: equal up to rounding, on any CPU


def _fit(make_cfg, *overrides, callbacks=()):
    """Initial weights, the fitted module and its trainer, for one run of the recipe's real config."""
    cfg = make_cfg(*FAST, "logger=none", "callbacks=none", *overrides)
    datamodule, model = testing.build(cfg)  # seeded, as train(cfg) builds them
    initial = copy.deepcopy(model.net).double()
    trainer = instantiate(cfg.trainer, callbacks=list(callbacks), logger=False, enable_checkpointing=False)
    trainer.fit(model, datamodule=datamodule)
    return initial, model, trainer


def _train_tensors(make_cfg):
    """The training split as plain tensors, in index order (what `data.shuffle=false` must serve)."""
    dm, _ = testing.build(make_cfg(*FAST))
    dm.setup("fit")
    return dm.train_set.datasets["x"].double(), dm.train_set.datasets["y"], dm


def _seed_loop(net, x, y, order, micro_batch, accumulation_steps, steps, lr, momentum=0.0):
    """The hand-written gradient-accumulation loop, in plain PyTorch."""
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
    optimizer.zero_grad()
    net.train()
    for i in range(steps * accumulation_steps):
        idx = order[i * micro_batch : (i + 1) * micro_batch]
        loss = F.cross_entropy(net(x[idx]), y[idx])
        loss = loss / accumulation_steps
        loss.backward()
        if (i + 1) % accumulation_steps == 0:
            optimizer.step()
            optimizer.zero_grad()
    return net


def _max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    return max((pa[k] - pb[k]).abs().max().item() for k in pa)


# --- the rule itself ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        # (base_lr, batch_size, accumulate, world_size, base_batch_size, rule) -> lr, by hand
        ((0.1, 32, 4, 2, 64, "linear"), 0.4),  # 256 / 64 = 4
        ((0.1, 32, 4, 2, 64, "sqrt"), 0.2),  # √4 = 2
        ((0.1, 32, 4, 2, 64, "none"), 0.1),
        ((1e-3, 16, 1, 1, 64, "linear"), 2.5e-4),  # a quarter of the base batch: a quarter of the LR
        ((1e-3, 16, 1, 1, 64, "sqrt"), 5e-4),  # √(1/4) = 1/2
        ((3e-4, 8, 8, 4, 32, "linear"), 2.4e-3),  # 256 / 32 = 8
        ((3e-4, 8, 8, 4, 32, "sqrt"), 3e-4 * 8**0.5),
        ((0.05, 64, 1, 1, 64, "linear"), 0.05),  # the base batch itself: unchanged under every rule
    ],
)
def test_scaled_lr_rule(args, expected):
    assert scaled_lr(*args) == pytest.approx(expected, rel=1e-12)


def test_scaled_lr_rejects_nonsense():
    assert effective_batch_size(32, 4, 2) == 256
    assert lr_factor(256, 64, "sqrt") == 2.0
    with pytest.raises(ValueError, match="rule"):
        scaled_lr(0.1, 32, 1, 1, 64, "cubic")
    with pytest.raises(ValueError, match="accumulate"):
        scaled_lr(0.1, 32, 0, 1, 64)
    with pytest.raises(ValueError, match="base_batch_size"):
        scaled_lr(0.1, 32, 1, 1, 0)


# --- the LR the optimizer actually uses ----------------------------------------------------------

# (rule, b, k, LR by hand) with model.optimizer.lr=0.1 tuned for model.base_batch_size=32
LR_CASES = [
    ("linear", 16, 4, 0.2),  # 64 / 32 = 2
    ("linear", 8, 2, 0.05),  # 16 / 32 = 1/2
    ("sqrt", 16, 8, 0.2),  # √(128 / 32) = 2
    ("sqrt", 24, 3, 0.15),  # √(72 / 32) = 1.5
    ("none", 16, 4, 0.1),
]


@pytest.mark.parametrize(("rule", "b", "k", "lr"), LR_CASES)
def test_lr_used_equals_rule(make_cfg, tmp_path, rule, b, k, lr):
    """The optimizer steps with the rule's LR: in its param group, in the `lr-SGD` column, in the
    checkpoint, and in the weights themselves (w₁ = w₀ − lr·g, g from a plain-PyTorch gradient)."""
    cfg = make_cfg(
        *FAST,
        f"model.lr_scaling={rule}",
        "model.base_batch_size=32",
        "model.optimizer.lr=0.1",
        f"data.batch_size={b}",
        f"model.accumulate_grad_batches={k}",
        "data.shuffle=false",
        "trainer.max_steps=1",
        "trainer.log_every_n_steps=1",
        "~callbacks.loss_curves",
        output_dir=tmp_path,
    )
    train(cfg)

    ckpt = torch.load(tmp_path / "checkpoints/last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 1
    assert ckpt["optimizer_states"][0]["param_groups"][0]["lr"] == pytest.approx(lr, rel=1e-12)
    with next((tmp_path / "csv").rglob("metrics.csv")).open(newline="") as f:
        logged = [float(row["lr-SGD"]) for row in csv.DictReader(f) if row.get("lr-SGD")]
    assert logged and all(v == pytest.approx(lr, rel=1e-6) for v in logged), logged
    assert json.loads((tmp_path / "lr_scaling.json").read_text())["lr"] == pytest.approx(lr, rel=1e-12)

    # The step itself: one SGD step on the first k·b examples (data.shuffle=false) at the rule's LR.
    net = testing.build(cfg)[1].net.double()
    x, y, _ = _train_tensors(make_cfg)
    loss = F.cross_entropy(net(x[: k * b]), y[: k * b])
    grads = torch.autograd.grad(loss, list(net.parameters()))
    stepped = load_weights(tmp_path / "checkpoints/last.ckpt")
    for (name, p), g in zip(net.named_parameters(), grads):
        torch.testing.assert_close(stepped[f"net.{name}"], p.detach() - lr * g, atol=EXACT, rtol=0)


def test_resume_rescales_for_the_new_effective_batch(make_cfg, tmp_path):
    """Resuming with another k (or on more ranks) uses the rule for the new effective batch, not the
    LR stored in the checkpoint's optimizer state."""
    first = (*FAST, "model.base_batch_size=32", "data.batch_size=16", "~callbacks.loss_curves")
    train(make_cfg(*first, "model.accumulate_grad_batches=2", "trainer.max_steps=2", output_dir=tmp_path / "a"))
    ckpt = tmp_path / "a/checkpoints/last.ckpt"
    assert torch.load(ckpt, weights_only=False)["optimizer_states"][0]["param_groups"][0]["lr"] == pytest.approx(0.1)
    train(
        make_cfg(
            *first,
            "model.accumulate_grad_batches=4",
            "trainer.max_steps=3",
            f"ckpt_path={ckpt}",
            output_dir=tmp_path / "b",
        )
    )
    resumed = torch.load(tmp_path / "b/checkpoints/last.ckpt", weights_only=False)
    assert resumed["global_step"] == 3
    assert resumed["optimizer_states"][0]["param_groups"][0]["lr"] == pytest.approx(0.2)  # 0.1 × 64/32


def test_lr_used_with_adam(make_cfg, tmp_path):
    """`optimizer=adam` swaps cleanly: Adam's group LR (1e-3 at base 64) × √(32·8 / 64) = 2e-3."""
    train(
        make_cfg(
            *FAST,
            "optimizer=adam",
            "model.lr_scaling=sqrt",
            "data.batch_size=32",
            "model.accumulate_grad_batches=8",
            "trainer.max_steps=1",
            "trainer.log_every_n_steps=1",
            "~callbacks.loss_curves",
            output_dir=tmp_path,
        )
    )
    with next((tmp_path / "csv").rglob("metrics.csv")).open(newline="") as f:
        rows = list(csv.DictReader(f))
    logged = [float(r["lr-Adam"]) for r in rows if r.get("lr-Adam")]
    assert logged and all(v == pytest.approx(2e-3, rel=1e-6) for v in logged), logged
    assert [float(r["scaling/factor"]) for r in rows if r.get("scaling/factor")] == [2.0]


# --- k micro-batches of b == one batch of k·b -----------------------------------------------------

STEPS = 5  # 5 steps × 64 examples: well inside the first epoch (1438 training examples)


@pytest.mark.parametrize(
    ("rule", "lr", "momentum", "shuffle"),
    [
        ("none", 0.1, 0.0, False),
        # Scaling on: both runs have the same effective batch (64), so the same LR (0.1 × 64/32).
        ("linear", 0.2, 0.9, True),
    ],
)
def test_micro_batches_equal_one_big_batch_and_the_seed_loop(make_cfg, rule, lr, momentum, shuffle):
    common = (
        f"model.lr_scaling={rule}",
        "model.base_batch_size=32",
        "model.optimizer.lr=0.1",
        f"model.optimizer.momentum={momentum}",
        f"data.shuffle={str(shuffle).lower()}",
        f"trainer.max_steps={STEPS}",
    )
    initial, accumulated, t_acc = _fit(make_cfg, *common, "data.batch_size=16", "model.accumulate_grad_batches=4")
    _, big, t_big = _fit(make_cfg, *common, "data.batch_size=64", "model.accumulate_grad_batches=1")
    assert t_acc.global_step == t_big.global_step == STEPS
    assert t_acc.optimizers[0].param_groups[0]["lr"] == pytest.approx(lr, rel=1e-12)
    assert t_big.optimizers[0].param_groups[0]["lr"] == pytest.approx(lr, rel=1e-12)

    # The hand-written loop, over the same examples: with shuffle=false the split's index order; with
    # shuffle=true the sampler's permutation, a pure function of (seed, epoch) whatever the batch size.
    x, y, dm = _train_tensors(make_cfg)
    order = torch.arange(len(y))
    if shuffle:
        order = torch.tensor(list(iter(dm.train_dataloader().sampler)))
        assert not torch.equal(order, torch.arange(len(y)))
    reference = _seed_loop(copy.deepcopy(initial), x, y, order, 16, 4, STEPS, lr, momentum)

    assert _max_diff(accumulated.net, big.net) < EXACT
    assert _max_diff(accumulated.net, reference) < EXACT
    # Not vacuous: the weights moved far more than the tolerance.
    assert _max_diff(accumulated.net, initial) > 1e-3


def test_multiloss_testing_references_prove_the_recipe(make_cfg):
    """The public helpers: the recipe's accumulated step == the hand-written loop over the 4 micro-batches ==
    one backward over their 64 examples."""
    cfg = make_cfg(
        *FAST,
        "logger=none",
        "callbacks=none",
        "data.batch_size=16",
        "model.lr_scaling=none",
        "model.accumulate_grad_batches=4",
    )
    datamodule, model = testing.build(cfg)
    (grads,) = testing.step_gradients(model, datamodule, steps=1, precision="64-true")
    datamodule.setup("fit")
    micro = [testing.in_dtype(batch, torch.float64) for batch, _ in zip(datamodule.train_dataloader(), range(4))]
    whole = {k: torch.cat([m[k] for m in micro]) for k in micro[0]}
    testing.assert_gradients_close(grads, testing.accumulated_gradients(model.net, micro), atol=EXACT)
    testing.assert_gradients_close(grads, testing.one_batch_gradients(model.net, whole), atol=EXACT)


# --- where it breaks -------------------------------------------------------------------------------


def test_batch_norm_breaks_the_equivalence(make_cfg):
    """With BatchNorm, k micro-batches of b are *not* one batch of k·b.

    BatchNorm normalises each forward pass by the mean and variance of the batch it sees. Under
    accumulation every micro-batch of 16 is normalised by its own statistics; the big batch of 64
    by the statistics of all 64. The loss is then a different function of the weights (each
    example's output depends on which other examples share its micro-batch), so its gradient
    differs, and no LR rule can fix that. (Dropout breaks it too: other masks.) That is why the
    recipe's default has neither; models that need BatchNorm under accumulation reach for
    GroupNorm/LayerNorm or ghost batch norm, or accept the difference.

    The difference is the statistics and nothing else: the hand-written loop, which also
    normalises per micro-batch, matches Lightning's accumulated run to float precision.
    """
    common = (
        "model.net.batch_norm=true",
        "model.lr_scaling=none",
        "data.shuffle=false",
        f"trainer.max_steps={STEPS}",
    )
    initial, accumulated, _ = _fit(make_cfg, *common, "data.batch_size=16", "model.accumulate_grad_batches=4")
    _, big, _ = _fit(make_cfg, *common, "data.batch_size=64", "model.accumulate_grad_batches=1")

    x, y, _ = _train_tensors(make_cfg)
    reference = _seed_loop(copy.deepcopy(initial), x, y, torch.arange(len(y)), 16, 4, STEPS, lr=0.1)
    assert _max_diff(accumulated.net, reference) < EXACT
    # 10⁷× the tolerance the equivalence holds to without BatchNorm.
    gap = _max_diff(accumulated.net, big.net)
    assert gap > 1e-3, gap


def test_short_last_step_under_micro_batches_is_down_weighted(make_cfg):
    """``model.accumulation_mean=micro_batches`` (the seed's loop, Lightning's own): the last optimizer step of an
    epoch takes whatever micro-batches are left, and still divides each one's loss by k, so that step's gradient is
    Σ(micro-batch means)/k rather than the mean over its examples. Here 1438 examples in micro-batches of 16 are 89
    full ones and one of 14: 22 steps of 4, then a 23rd step of 2 micro-batches (16 + 14 examples) whose gradient is
    about half the mean gradient over those 30 (the default, ``examples``, steps on that mean: the next test).
    """
    capture = GradientCapture()
    initial, _, trainer = _fit(
        make_cfg,
        "model.lr_scaling=none",
        "model.accumulation_mean=micro_batches",
        "data.shuffle=false",
        "data.batch_size=16",
        "model.accumulate_grad_batches=4",
        "trainer.max_steps=23",
        callbacks=[capture],
    )
    assert trainer.current_epoch == 1 and len(capture.steps) == 23  # the 23rd step ended epoch 0

    # Weights before step 23: the hand-written loop for 22 full steps (checked equal to Lightning above).
    x, y, _ = _train_tensors(make_cfg)
    net = _seed_loop(copy.deepcopy(initial), x, y, torch.arange(len(y)), 16, 4, 22, lr=0.1)
    tail = slice(22 * 64, len(y))
    mb = [slice(tail.start, tail.start + 16), slice(tail.start + 16, len(y))]
    lightning_rule = sum(F.cross_entropy(net(x[s]), y[s]) for s in mb) / 4
    mean_over_tail = F.cross_entropy(net(x[tail]), y[tail])
    params = dict(net.named_parameters())
    want = dict(zip(params, torch.autograd.grad(lightning_rule, list(params.values()))))
    mean = dict(zip(params, torch.autograd.grad(mean_over_tail, list(params.values()))))
    for name in params:
        torch.testing.assert_close(capture.steps[22][f"net.{name}"], want[name], atol=EXACT, rtol=0)
    ratio = capture.steps[22]["net.2.weight"].norm() / mean["2.weight"].norm()
    assert 0.4 < ratio < 0.6, ratio


# --- the run a user gets ----------------------------------------------------------------------------


def test_default_run_logs_and_learns(make_cfg, tmp_path):
    """Loss and LR columns, the scaling inputs, the artifacts; and the classifier learns."""
    metrics = train(
        make_cfg(
            "recipe=accumulation",
            "trainer.accelerator=cpu",
            "trainer.max_epochs=6",
            "model.optimizer.momentum=0.9",
            output_dir=tmp_path,
        )
    )
    assert metrics["val/acc"] >= 0.9, metrics
    header = next((tmp_path / "csv").rglob("metrics.csv")).read_text().splitlines()[0].split(",")
    assert {"loss/total", "val/loss/total", "val/acc", "lr-SGD", "scaling/factor"} <= set(header)
    # Defaults: 32 per micro-batch × 4 micro-batches × 1 rank = 128 vs base 64: SGD's 0.1 × 2.
    scaling = json.loads((tmp_path / "lr_scaling.json").read_text())
    assert (scaling["effective_batch_size"], scaling["factor"], scaling["lr"]) == (128, 2.0, pytest.approx(0.2))
    assert (tmp_path / "checkpoints/last.ckpt").is_file()
    assert (tmp_path / "loss_curves.png").stat().st_size > 10_000


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("model.lr_scaling=cubic", "model.lr_scaling"),
        ("model.base_batch_size=0", "model.base_batch_size"),
        ("model.accumulate_grad_batches=0", "model.accumulate_grad_batches"),
        ("trainer.accumulate_grad_batches=4", "trainer.accumulate_grad_batches"),
    ],
)
def test_bad_settings_are_rejected_before_training(make_cfg, tmp_path, override, key):
    with pytest.raises(ConfigError) as err:
        train(make_cfg("recipe=accumulation", override, output_dir=tmp_path))
    assert err.value.key == key
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize("key", ["model.accumulation_mean=examples", "model.count_exact=true"])
def test_the_short_last_step_is_the_mean_over_its_examples(make_cfg, key):
    """The default (``model.accumulation_mean=examples``; ``model.count_exact=true``, its earlier spelling, says
    the same): the same 23rd step (16 + 14 examples) is the mean gradient over its 30 examples, and a full step is
    still the mean over its 64 (one batch of all their examples)."""
    capture = GradientCapture()
    initial, _, _ = _fit(
        make_cfg,
        "model.lr_scaling=none",
        key,
        "data.shuffle=false",
        "data.batch_size=16",
        "model.accumulate_grad_batches=4",
        "trainer.max_steps=23",
        callbacks=[capture],
    )
    assert len(capture.steps) == 23
    x, y, _ = _train_tensors(make_cfg)
    first = copy.deepcopy(initial)
    params = dict(first.named_parameters())
    full = torch.autograd.grad(F.cross_entropy(first(x[:64]), y[:64]), list(params.values()))
    for name, g in zip(params, full):
        torch.testing.assert_close(capture.steps[0][f"net.{name}"], g, atol=EXACT, rtol=0)

    net = _seed_loop(copy.deepcopy(initial), x, y, torch.arange(len(y)), 16, 4, 22, lr=0.1)
    tail = slice(22 * 64, len(y))
    params = dict(net.named_parameters())
    mean = torch.autograd.grad(F.cross_entropy(net(x[tail]), y[tail]), list(params.values()))
    for name, g in zip(params, mean):
        torch.testing.assert_close(capture.steps[22][f"net.{name}"], g, atol=EXACT, rtol=0)
