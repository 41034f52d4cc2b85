"""Methods of one's own (examples/mypkg/methods.py) and a recipe of one's own (examples/mypkg/recipes.py), named
from examples/configs, proven as the shipped ones are,
with `multiloss.testing` and a reference written from each method's formula — the few lines docs/extending.md shows.

- In this process: the recipe's real step (``testing.step_gradients``, float64) equals the reference on the same
  batch, to `EXACT`: `InverseLoss`'s weights, `EqualNorms`' combined gradient, `DriftWasserstein` with
  `LipschitzPenalty` (D's step, then G's through the stepped D), `DoubleBackprop`'s step.
- From the command line, as a user runs them (``python train.py --config-dir examples/configs ...``, float64 SGD):
  one device × 64, two DDP ranks × 32 and two FSDP2 ranks × 32 (``global_batch_size=64``), a run stopped mid-epoch
  and resumed on one rank, and one stopped on two ranks and continued on one: the same weights, to `EXACT`.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from multiloss import testing

EXAMPLES = Path(__file__).resolve().parents[1]
ROOT = EXAMPLES.parent
CONFIGS = EXAMPLES / "configs"
EXACT = 1e-10  # float64: equal up to rounding (a few steps' stays near 1e-15), on any CPU
F64 = {"precision": "64-true"}
SMALL = ("model.net.width=16", "optimizer=sgd")


def _build(*overrides: str):
    cfg = testing.compose(*overrides, config_dir=CONFIGS)
    return cfg, *testing.build(cfg)


def _head_losses(net, batch):
    """Each head's cross-entropy on the batch's labels: the multihead recipe's tasks (graph on)."""
    return [F.cross_entropy(out, batch["y"]) for out in net(batch["x"])]


def test_inverse_loss_weights_each_head_by_its_formula():
    _, datamodule, module = _build("recipe=multihead", "balancer=inverse_loss", *SMALL)
    (grads,) = testing.step_gradients(module, datamodule, **F64)
    batch = testing.in_dtype(testing.first_batch(datamodule), torch.float64)
    net = copy.deepcopy(module.net).double()
    with torch.no_grad():
        losses = torch.stack(_head_losses(net, batch))
    inverse = 1 / (losses + 1e-8)
    weights = (len(losses) * inverse / inverse.sum()).tolist()  # the method's formula, written again here
    expected = testing.per_head_gradients(net, batch, weights=weights)
    testing.assert_gradients_close(grads, expected, atol=EXACT, rtol=EXACT)


def test_equal_norms_rescales_each_tasks_shared_gradient_to_the_mean_norm():
    _, datamodule, module = _build("recipe=multihead", "balancer=equal_norms", *SMALL)
    (grads,) = testing.step_gradients(module, datamodule, **F64)
    batch = testing.in_dtype(testing.first_batch(datamodule), torch.float64)
    net = copy.deepcopy(module.net).double()
    names, params = zip(*net.named_parameters())
    # Each task's gradient of every parameter (None where its loss does not reach it); shared: reached by > 1 task.
    per_task = [
        torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True) for loss in _head_losses(net, batch)
    ]
    shared = [j for j in range(len(params)) if sum(task[j] is not None for task in per_task) > 1]
    norms = torch.stack(
        [torch.cat([task[j].flatten() for j in shared if task[j] is not None]).norm() for task in per_task]
    )
    alpha = norms.mean() / norms  # the method's formula: every task's shared gradient brought to the mean norm
    expected = {}
    for j, name in enumerate(names):
        reaching = [(i, task[j]) for i, task in enumerate(per_task) if task[j] is not None]
        scale = (lambda i: alpha[i]) if j in shared else (lambda i: 1.0)  # a task's own layers: its own gradient
        expected[f"net.{name}"] = sum(scale(i) * g for i, g in reaching) if reaching else None
    testing.assert_gradients_close(grads, expected, atol=EXACT, rtol=EXACT)


def test_drift_wasserstein_with_the_lipschitz_penalty_equals_its_formulas():
    lr = 0.05
    cfg, datamodule, module = _build(
        "recipe=gan",
        "experiment=wgan_lp",
        "model.n_critic=1",
        "optimizer@model.d_optimizer=sgd",
        f"model.d_optimizer.lr={lr}",
        "model.n_plot_samples=0",
    )
    d_step, g_step = testing.step_gradients(module, datamodule, steps=2, **F64)
    real = testing.in_dtype(testing.first_batch(datamodule), torch.float64)["x"]
    with testing.default_dtype(torch.float64):
        (z, eps), (z_g, _) = testing.gan_noise(cfg.seed, len(real), module.latent_dim, draws=2)
    with torch.no_grad():
        fake = module.generator.double()(z)
    drift = cfg.model.loss.drift
    d_grads = testing.discriminator_gradients(
        module.discriminator.double(),
        real,
        fake,
        loss=lambda r, f: f.mean() - r.mean() + drift * (r**2).mean(),
        penalty={"lp": cfg.model.penalty_weight},
        eps=eps,
        penalty_references={
            "lp": ("interpolates", lambda g: torch.clamp(g.reshape(len(g), -1).norm(dim=1) - 1, min=0).pow(2).mean())
        },
    )
    testing.assert_gradients_close(d_step, d_grads, atol=EXACT, rtol=EXACT)
    stepped = testing.sgd_step(module.discriminator, d_grads, lr, prefix="discriminator.")
    g_grads = testing.generator_gradients(module.generator, stepped, z_g, loss=lambda f, r: -f.mean())
    testing.assert_gradients_close(g_step, g_grads, atol=EXACT, rtol=EXACT)


def test_double_backprop_recipe_equals_the_plain_loop():
    """The recipe of one's own (examples/mypkg/recipes.py) against the loop a user writes by hand: CE plus
    λ·E‖∇ₓ CEᵢ‖², the input gradient taken with create_graph=True, one backward."""
    cfg, datamodule, module = _build("recipe=double_backprop", "model.net.width=16")
    (grads,) = testing.step_gradients(module, datamodule, **F64)
    batch = testing.in_dtype(testing.first_batch(datamodule), torch.float64)
    net = copy.deepcopy(module.net).double()
    x = batch["x"].clone().requires_grad_(True)
    ce = F.cross_entropy(net(x), batch["y"])
    (gx,) = torch.autograd.grad(ce * len(x), x, create_graph=True)  # each example's own input gradient
    (ce + cfg.model.weight * (gx**2).sum(dim=1).mean()).backward()
    expected = {f"net.{n}": p.grad for n, p in net.named_parameters()}
    testing.assert_gradients_close(grads, expected, atol=EXACT, rtol=EXACT)


# --- from the command line, on every engine -------------------------------------------------------------------------

RUNS = {
    "double_backprop": ("recipe=double_backprop", "model.net.width=16"),
    # scope=global: the rule on the global batch's gradients (scope=rank, each rank's own, then averaged: not the
    # one device's step, by design).
    "equal_norms": ("recipe=multihead", "balancer=equal_norms", "model.balancer.scope=global", *SMALL),
    "inverse_loss": ("recipe=multihead", "balancer=inverse_loss", *SMALL),
    "wgan_lp": (
        "recipe=gan",
        "experiment=wgan_lp",
        "model.generator.width=16",
        "model.discriminator.width=16",
        "optimizer@model.g_optimizer=sgd",
        "optimizer@model.d_optimizer=sgd",
        "model.n_plot_samples=0",
    ),
}
FLOAT64 = (
    "trainer.precision=64-true",
    "trainer.max_steps=12",
    "trainer.limit_val_batches=0",
    "trainer.num_sanity_val_steps=0",
    "print_config=false",
    "~callbacks.progress_bar",
    "~callbacks.loss_curves",
    "trainer.enable_progress_bar=false",
)


def _train(out: Path, *overrides: str) -> Path:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(EXAMPLES), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, str(ROOT / "train.py"), "--config-dir", str(CONFIGS), *FLOAT64, *overrides]
    proc = subprocess.run(
        [*command, f"hydra.run.dir={out}"], env=env, capture_output=True, text=True, timeout=400, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "checkpoints" / "last.ckpt"


def _weights(path: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's floating weights: a file's, or (FSDP2) a sharded checkpoint's directory read whole."""
    from multiloss.saving.checkpoints import read_sharded_checkpoint

    if path.is_dir():
        state = read_sharded_checkpoint(path)["state_dict"]
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}


def _gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    assert all(v.dtype == torch.float64 for v in a.values())
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("method", list(RUNS))
def test_own_method_trains_alike_on_one_device_ddp_fsdp2_and_resumed(method, tmp_path):
    """Each method from its YAML: 1 × 64 for 12 steps; 2 DDP ranks × 32 and 2 FSDP2 ranks × 32 with
    ``global_batch_size=64``; 6 steps on 1 × 64 then resumed to 12; 6 steps on 2 DDP ranks × 32 continued on 1 × 64.
    Every run ends on the 1 × 64 run's weights, to `EXACT` (float64 SGD: the same sums in another order)."""
    run = RUNS[method]
    one = _weights(_train(tmp_path / "one", *run, "data.batch_size=64"))
    ranks = ("data.batch_size=32", "global_batch_size=64", "trainer.devices=2")
    for engine in ("ddp_cpu", "fsdp_cpu"):
        gap = _gap(_weights(_train(tmp_path / engine, *run, f"trainer={engine}", *ranks)), one)
        assert gap <= EXACT, f"{engine}: {gap:.3g}"
    half = _train(tmp_path / "half", *run, "data.batch_size=64", "trainer.max_steps=6")
    resumed = _train(tmp_path / "resumed", *run, "data.batch_size=64", f"ckpt_path={half}", "trust_checkpoint=[mypkg]")
    assert _gap(_weights(resumed), one) <= EXACT
    two = _train(tmp_path / "two", *run, "trainer=ddp_cpu", *ranks, "trainer.max_steps=6")
    # On one rank of 64 (a gradient rule under accumulation takes each micro-batch's gradients: not the big batch's).
    on_one = ("trainer=cpu", "trainer.devices=1", "data.batch_size=64", "global_batch_size=64")
    elastic = _train(tmp_path / "elastic", *run, *on_one, f"ckpt_path={two}", "trust_checkpoint=[mypkg]")
    assert _gap(_weights(elastic), one) <= EXACT
    # Not vacuous: the steps moved the weights.
    first = _weights(half)
    assert _gap(first, one) > 1e-4
