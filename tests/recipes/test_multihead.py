"""`multihead`: one backward of the summed heads == per-head backward(retain_graph=True) == per-head autograd.grad.

The summed gradient is taken from the recipe's real training step under the real Trainer (captured
just before the optimizer step); the references are the seeds' hand-written loops in plain PyTorch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate

from multiloss import train
from tests.conftest import BARE
from tests.helpers import GradCapture, assert_grads_close

BATCH = 64


def _first_batch(cfg):
    dm = instantiate(cfg.data)
    dm.setup("fit")
    return next(iter(dm.train_dataloader()))


def _lightning_grads(make_cfg, *overrides):
    """Gradient of the recipe's own step, from a 1-step run of the real Trainer, and the module."""
    cfg = make_cfg(
        "recipe=multihead",
        "trainer.max_steps=1",
        *BARE,
        f"data.batch_size={BATCH}",
        *overrides,
    )
    torch.manual_seed(cfg.seed)
    capture = GradCapture()
    from lightning import seed_everything

    seed_everything(cfg.seed)
    model = instantiate(cfg.model)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = instantiate(cfg.trainer, callbacks=[capture], logger=False, enable_checkpointing=False)
    trainer.fit(model, datamodule=instantiate(cfg.data))
    model.load_state_dict(initial)  # back to the weights the captured gradient was taken at
    return capture.steps[0], model, _first_batch(cfg)


def _per_head_losses(model, batch):
    return [w * F.cross_entropy(logits, batch["y"]) for w, logits in zip(model.head_weights, model(batch["x"]))]


@pytest.mark.parametrize("weights", [None, "[0.3,0.5,1.0]"])
def test_summed_backward_equals_per_head_references(make_cfg, weights):
    overrides = [] if weights is None else [f"model.head_weights={weights}"]
    summed, model, batch = _lightning_grads(make_cfg, *overrides)
    params = dict(model.named_parameters())

    # Reference 1: the seeds' loop, one backward per head, retain_graph so the trunk survives.
    model.zero_grad(set_to_none=True)
    losses = _per_head_losses(model, batch)
    for i, loss in enumerate(losses):
        loss.backward(retain_graph=i < len(losses) - 1)
    per_head_backward = {n: p.grad.clone() if p.grad is not None else None for n, p in params.items()}

    # Reference 2: torch.autograd.grad per head, summed by hand.
    losses = _per_head_losses(model, batch)
    per_head_grad = {n: torch.zeros_like(p) for n, p in params.items()}
    for loss in losses:
        grads = torch.autograd.grad(loss, list(params.values()), retain_graph=True, allow_unused=True)
        for (n, _), g in zip(params.items(), grads):
            if g is not None:
                per_head_grad[n] += g

    assert_grads_close(summed, per_head_backward, atol=1e-6)
    assert_grads_close(summed, per_head_grad, atol=1e-6)
    # Head i's weights get gradient only from loss i: the sum does not mix heads.
    assert summed["heads.0.weight"].abs().sum() > 0


def test_per_head_backward_without_retain_graph_fails(make_cfg):
    """The seeds' pitfall, shown on the real module: the second head's backward finds the trunk freed."""
    model = instantiate(make_cfg("recipe=multihead").model)
    batch = _first_batch(make_cfg("recipe=multihead"))
    losses = _per_head_losses(model, batch)
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
