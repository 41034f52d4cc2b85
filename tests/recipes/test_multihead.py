"""`multihead`: one backward of the summed heads == per-head backward(retain_graph=True) == per-head autograd.grad.

The summed gradient is taken from the recipe's real training step under the real Trainer (captured
just before the optimizer step); the references are the hand-written loops in plain PyTorch. The proofs run in
float64 (``precision="64-true"``, the batch cast as Lightning casts it) and hold to `EXACT`, on any CPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from multiloss import testing, train
from multiloss.config import ConfigError
from multiloss.testing import assert_gradients_close
from tests.conftest import BARE

BATCH = 64
EXACT = 1e-10  # float64: equal up to rounding (one step's stays near 1e-16), on any CPU


def _step(make_cfg, *overrides):
    """The recipe's first-step gradients under the real Trainer in float64, the module at its initial weights (float64
    now), the batch (cast to float64 as the run's was)."""
    cfg = make_cfg("recipe=multihead", *BARE, f"data.batch_size={BATCH}", *overrides)
    datamodule, model = testing.build(cfg)
    (grads,) = testing.step_gradients(model, datamodule, steps=1, precision="64-true")
    return grads, model, testing.in_dtype(testing.first_batch(datamodule), torch.float64)


@pytest.mark.parametrize("weights", [None, "[0.3,0.5,1.0]"])
def test_summed_backward_equals_per_head_references(make_cfg, weights):
    overrides = [] if weights is None else [f"model.head_weights={weights}"]
    summed, model, batch = _step(make_cfg, *overrides)
    head_weights = model.head_weights or [1.0, 1.0, 1.0]

    # Reference 1: the hand-written loop, one backward per head, retain_graph so the trunk survives.
    per_head_backward = testing.per_head_gradients(model.net, batch, head_weights)

    # Reference 2: torch.autograd.grad per head, summed by hand.
    params = dict(model.named_parameters())
    per_head_grad = {n: torch.zeros_like(p) for n, p in params.items()}
    for w, logits in zip(head_weights, model.net(batch["x"])):
        loss = w * F.cross_entropy(logits, batch["y"])
        grads = torch.autograd.grad(loss, list(params.values()), retain_graph=True, allow_unused=True)
        for (n, _), g in zip(params.items(), grads):
            if g is not None:
                per_head_grad[n] += g

    assert summed["net.heads.0.weight"].dtype == torch.float64
    assert_gradients_close(summed, per_head_backward, atol=EXACT, rtol=EXACT)
    assert_gradients_close(summed, per_head_grad, atol=EXACT, rtol=EXACT)
    # Head i's weights get gradient only from loss i: the sum does not mix heads.
    assert summed["net.heads.0.weight"].abs().sum() > 0


def test_per_head_backward_without_retain_graph_fails(make_cfg):
    """The classic pitfall, shown on the real module: the second head's backward finds the trunk freed."""
    datamodule, model = testing.build(make_cfg("recipe=multihead"))
    batch = testing.first_batch(datamodule)
    losses = [F.cross_entropy(logits, batch["y"]) for logits in model.net(batch["x"])]
    losses[0].backward()
    with pytest.raises(RuntimeError, match="Trying to backward through the graph a second time"):
        losses[1].backward()


def test_logs_every_head_and_learns(make_cfg, tmp_path):
    """Each head's loss is logged under its own name beside the total, and the final head learns."""
    metrics = train(
        make_cfg("recipe=multihead", "trainer.max_epochs=3", "trainer.accelerator=cpu", output_dir=tmp_path)
    )
    for i in range(3):
        assert f"val/acc/head{i}" in metrics
    assert metrics["val/acc"] >= 0.85, metrics
    header = next((tmp_path / "csv").rglob("metrics.csv")).read_text().splitlines()[0].split(",")
    assert {"loss/head0", "loss/head1", "loss/head2", "loss/total"} <= set(header)
    assert any(col.startswith("lr") for col in header)
    assert (tmp_path / "loss_curves.png").stat().st_size > 10_000


@pytest.mark.parametrize(
    ("overrides", "key", "said"),
    [
        # A classifier with one output where the recipe needs one per head.
        (
            ("model.net._target_=multiloss.nets.MLP", "~model.net.num_classes", "+model.net.out_features=10"),
            "model.net",
            "it returned a tensor float32 (2, 10)",
        ),
        (("model.head_weights=[1,2]",), "model.head_weights", "3 numbers (model.net has 3 heads)"),
        (("model.net.num_classes=1",), "model.net", "it failed"),  # y holds classes up to 9
    ],
)
def test_a_net_that_breaks_the_contract_is_rejected_before_any_write(make_cfg, tmp_path, overrides, key, said):
    with pytest.raises(ConfigError) as err:
        train(make_cfg("recipe=multihead", "trainer.max_steps=1", *overrides, output_dir=tmp_path))
    assert err.value.key == key
    assert said in err.value.message
    assert not (tmp_path / ".hydra").exists() and not (tmp_path / "checkpoints").exists()


def test_gradient_clipping_clips(make_cfg):
    # The step clips only when model.gradient_clip_val is set.
    cfg = make_cfg(
        "recipe=multihead",
        *BARE,
        "optimizer=sgd",
        "model.optimizer.lr=1.0",
        "model.gradient_clip_val=1e-3",
        "trainer.max_steps=1",
    )
    datamodule, model = testing.build(cfg)
    before = [p.detach().clone().double() for p in model.parameters()]
    testing.bare_trainer(max_steps=1, precision="64-true").fit(model, datamodule=datamodule)
    moved = torch.linalg.vector_norm(torch.stack([(p - b).norm() for p, b in zip(model.parameters(), before)]))
    # One SGD step of lr 1 on a gradient clipped to norm 1e-3: clip_grad_norm_ scales by 1e-3 / (‖g‖ + 1e-6), so the
    # step is 1e-3·‖g‖/(‖g‖ + 1e-6) < 1e-3. In float64 the update rounds each of the N ≈ 4.5e4 weights (|w| < 0.2) by
    # ≤ 2⁻⁵³·|w|, which moves this norm by ≤ √N·0.2·2⁻⁵³ ≈ 5e-15, 5e-12 of 1e-3: inside EXACT.
    assert 0 < moved <= 1e-3 * (1 + EXACT)
