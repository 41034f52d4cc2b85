"""`weighted`: one backward with grad_tensors=the task weights == backward of Σ wᵢ·lossᵢ == Σ wᵢ·grad(lossᵢ).

The recipe's gradient is taken from its real training step under the real Trainer (captured just
before the optimizer step). The references are plain PyTorch written here from the parameters
alone: their own forward pass, their own targets (class, odd/even, mean ink) and losses. The proofs run in float64
(``precision="64-true"``, the batch cast as Lightning casts it) and hold to `EXACT`, on any CPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from multiloss.recipes.weighted import weighted_backward

from multiloss import testing, train
from multiloss.callbacks.plots import curves_in
from multiloss.config import ConfigError
from multiloss.testing import assert_gradients_close
from tests.conftest import BARE
from tests.helpers import straight_and_resumed

BATCH = 64
QUICK = (
    "recipe=weighted",
    *BARE,
)
TASKS = ("digit", "parity", "ink")
EXACT = 1e-10  # float64: equal up to rounding (one step's stays near 1e-16), on any CPU
F64 = {"precision": "64-true"}  # the proofs' Trainer: the module and every floating batch tensor in float64


def _weights(weights) -> list[str]:
    return [f"model.tasks.{task}.weight={w}" for task, w in zip(TASKS, weights)]


def _lightning_step(make_cfg, *overrides, **trainer_kwargs):
    """Gradients of the recipe's first optimizer step under the real Trainer, the module at its
    initial weights, the batch of that step (in the dtype the step saw it: float64 under ``precision="64-true"``),
    and how many times the trunk's backward ran in it."""
    datamodule, model = testing.build(make_cfg(*QUICK, *overrides))
    # Counts the gradients arriving at the trunk's output: once per backward pass through it.
    trunk_backwards = []

    def count_backwards(module, inputs, output):
        if output.requires_grad:
            output.register_hook(lambda grad: trunk_backwards.append(1))

    hook = model.net.trunk.register_forward_hook(count_backwards)
    steps = testing.step_gradients(model, datamodule, steps=1, **trainer_kwargs)
    hook.remove()
    assert len(steps) == 1
    batch = testing.first_batch(datamodule)
    if trainer_kwargs.get("precision") == "64-true":
        batch = testing.in_dtype(batch, torch.float64)
    return steps[0], model, batch, len(trunk_backwards)


def _reference_losses(params: dict[str, torch.Tensor], batch: dict[str, torch.Tensor], depth: int) -> list:
    """The three task losses in plain PyTorch, from the parameters only (no recipe or data-module code)."""
    h = batch["x"]
    for i in range(depth):
        h = torch.relu(F.linear(h, params[f"net.trunk.{i}.0.weight"], params[f"net.trunk.{i}.0.bias"]))
    digit = F.linear(h, params["net.heads.digit.weight"], params["net.heads.digit.bias"])
    parity = F.linear(h, params["net.heads.parity.weight"], params["net.heads.parity.bias"])[:, 0]
    ink = F.linear(h, params["net.heads.ink.weight"], params["net.heads.ink.bias"])[:, 0]
    y = batch["y"]
    return [
        F.cross_entropy(digit, y),
        F.binary_cross_entropy_with_logits(parity, (y % 2 == 1).to(parity.dtype)),
        ((ink - batch["x"].sum(dim=1) / batch["x"].shape[1]) ** 2).mean(),
    ]


def _references(model, batch, weights):
    """(backward of Σ wᵢ·lossᵢ, Σ wᵢ·autograd.grad(lossᵢ), Σ |float32(wᵢ) − wᵢ|·|grad(lossᵢ)|) as name -> gradient
    maps; the last bounds what a weight rounded to float32 moves the gradient by."""
    params = dict(model.named_parameters())
    depth = model.hparams.net["depth"]
    model.zero_grad(set_to_none=True)
    losses = _reference_losses(params, batch, depth)
    sum(w * loss for w, loss in zip(weights, losses)).backward()
    summed = {n: p.grad.clone() for n, p in params.items()}

    losses = _reference_losses(params, batch, depth)
    per_task = {n: torch.zeros_like(p) for n, p in params.items()}
    rounding = {n: torch.zeros_like(p) for n, p in params.items()}
    for w, loss in zip(weights, losses):
        grads = torch.autograd.grad(loss, list(params.values()), retain_graph=True, allow_unused=True)
        for n, g in zip(params, grads):
            if g is not None:
                per_task[n] += w * g
                rounding[n] += abs(float(torch.tensor(w, dtype=torch.float32)) - w) * g.abs()
    model.zero_grad(set_to_none=True)
    return summed, per_task, rounding


@pytest.mark.parametrize("weights", [None, [0.7, 1.3, 40.0], [1.0, 0.0, 30.0]])
def test_weighted_backward_equals_backward_of_weighted_sum(make_cfg, weights):
    overrides = [f"data.batch_size={BATCH}", *(_weights(weights) if weights else [])]
    grads, model, batch, trunk_backwards = _lightning_step(make_cfg, *overrides, **F64)
    used = [t.weight for t in model.tasks.values()]
    assert used == (weights or [1.0, 1.0, 30.0])  # the shipped default

    summed, per_task, rounding = _references(model, batch, used)
    assert grads["net.heads.ink.weight"].dtype == torch.float64
    # The recipe seeds its backward with the balancer's `base` weights, made again in float64 from the config's numbers
    # when the module goes float64 (Balancer._apply): a weight float32 cannot hold (0.7, 1.3) would otherwise move each
    # gradient element by up to `rounding` (Σ |float32(wᵢ) − wᵢ|·|∂lossᵢ|, 2e-9 here), which the bound would need.
    assert max(float(r.max()) for r in rounding.values()) > 10 * EXACT or weights != [0.7, 1.3, 40.0]
    atol = EXACT
    assert_gradients_close(grads, summed, atol=atol, rtol=EXACT)
    assert_gradients_close(grads, per_task, atol=atol, rtol=EXACT)
    # And multiloss.testing's reference, from the module's own task list (losses, targets, weights).
    reference = testing.weighted_sum_gradients(model.net, batch, model.tasks)
    assert_gradients_close(grads, reference, atol=atol, rtol=EXACT)
    # One backward through the trunk per step: not one per task.
    assert trunk_backwards == 1
    assert all(g.abs().sum() > 0 for n, g in grads.items() if "parity" not in n)


def test_zero_weight_leaves_its_head_with_zero_gradient(make_cfg):
    grads, _, _, _ = _lightning_step(make_cfg, "model.tasks.parity.weight=0")
    for name in ("net.heads.parity.weight", "net.heads.parity.bias"):
        assert grads[name] is not None and torch.count_nonzero(grads[name]) == 0, name
    for name in ("net.heads.digit.weight", "net.heads.ink.weight", "net.trunk.0.0.weight"):
        assert torch.count_nonzero(grads[name]) > 0, name
    # With the weight on, the same head does get a gradient: the zero above is the weight's doing.
    grads_on, _, _, _ = _lightning_step(make_cfg, "model.tasks.parity.weight=0.5")
    assert torch.count_nonzero(grads_on["net.heads.parity.weight"]) > 0


def test_lightning_accumulation_scales_the_loss_vector(make_cfg):
    """model.accumulate_grad_batches=2 of 32 == one batch of 64: the step's loss / k acts on the vector
    before its weighted backward."""
    grads, model, _, _ = _lightning_step(make_cfg, "data.batch_size=32", "model.accumulate_grad_batches=2", **F64)
    batch = testing.first_batch(testing.build(make_cfg(*QUICK, f"data.batch_size={BATCH}"))[0])
    weights = [t.weight for t in model.tasks.values()]
    assert weights == [1.0, 1.0, 30.0]  # float32 holds them exactly: the recipe's float32 `base` buffer is exact too
    summed, _, _ = _references(model, testing.in_dtype(batch, torch.float64), weights)
    assert_gradients_close(grads, summed, atol=EXACT, rtol=EXACT)


def _seed_graph():
    """The textbook grad_tensors example: y0 = (x+w)(w+1), y1 = (x+w)+(w+1) at w=1, x=2."""
    w = torch.tensor([1.0], requires_grad=True)
    x = torch.tensor([2.0], requires_grad=True)
    a, b = torch.add(w, x), torch.add(w, 1)
    return w, x, torch.mul(a, b), torch.add(a, b)


def test_seed_example_through_the_recipes_backward(make_cfg):
    # dy0/dw = 5, dy1/dw = 2, weights [1, 2]: dw = 1·5 + 2·2 = 9; dx = 1·(w+1) + 2·1 = 4.
    w, x, y0, y1 = _seed_graph()
    weighted_backward(torch.cat([y0, y1]), torch.tensor([1.0, 2.0]))
    assert w.grad.item() == 9.0 and x.grad.item() == 4.0

    # The same numbers through the module's own backward hook (the one Lightning calls), with its
    # configured task weights; the third task's weight 0 adds nothing.
    _, model = testing.build(make_cfg("recipe=weighted", *_weights([1, 2, 0])))
    w, x, y0, y1 = _seed_graph()
    model.backward(torch.cat([y0, y1, w * x * 7]))
    assert w.grad.item() == 9.0 and x.grad.item() == 4.0

    # And it did not keep the graph: a second backward finds it freed (no retain_graph anywhere).
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        y0.backward()


def test_the_pitfalls_it_replaces(make_cfg):
    """On the real module: per-task backward without retain_graph fails on the second task (the
    trunk's saved tensors are gone), and the bare loss vector cannot backward without weights."""
    datamodule, model = testing.build(make_cfg(*QUICK))
    batch = testing.first_batch(datamodule)
    _, losses = model.outputs_and_losses(batch)
    losses["digit"].backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        losses["parity"].backward()
    _, losses = model.outputs_and_losses(batch)
    with pytest.raises(RuntimeError, match="grad can be implicitly created only for scalar outputs"):
        torch.stack(list(losses.values())).backward()


@pytest.mark.parametrize(
    ("overrides", "key", "problem"),
    [
        (("model.tasks.parity.weight=-1",), "model.tasks.parity.weight", "≥ 0"),
        (("model.tasks.ink.weight=inf",), "model.tasks.ink.weight", "finite"),
        (_weights([0, 0, 0]), "model.tasks", "every weight is 0"),
        (("+model.tasks.ink.wieght=2",), "model.tasks.ink.wieght", "unknown key"),
        (("~model.tasks.ink.target",), "model.tasks.ink.target", "not set"),
        (("model.tasks.ink.loss=torch.nn.functional.nope",), "model.tasks.ink.loss", "cannot import"),
    ],
)
def test_rejects_bad_tasks(make_cfg, tmp_path, overrides, key, problem):
    with pytest.raises(ConfigError, match=problem) as err:
        train(make_cfg(*QUICK, "trainer.max_steps=1", *overrides, output_dir=tmp_path))
    assert err.value.key == key
    assert not (tmp_path / ".hydra").exists()  # rejected before anything was written


@pytest.mark.parametrize(
    ("overrides", "key", "said"),
    [
        (
            ("model.tasks.ink.target=inky",),
            "model.tasks.ink.target",
            "one of the batch's keys: ['ink', 'parity', 'x', 'y']",
        ),
        (("~model.net.heads.ink",), "model.net", "no output for ['ink']"),
        (("+model.net.heads.extra=2",), "model.tasks", "no task for ['extra']"),
        (
            ("+model.tasks.ink.loss._target_=torch.nn.MSELoss", "+model.tasks.ink.loss.reduction=none"),
            "model.tasks.ink.loss",
            "reduction='none'",
        ),
        (("model.tasks.digit.target=ink",), "model.tasks.digit.loss", "it failed"),  # CE on float targets of (2,)
        # (2, 2) outputs against (2,) targets: MSE would broadcast them silently into a (2, 2) loss.
        (("model.net.heads.ink=2",), "model.tasks.ink.loss", "different to the input size"),
    ],
)
def test_components_that_break_the_contract_are_rejected_before_any_write(make_cfg, tmp_path, overrides, key, said):
    with pytest.raises(ConfigError) as err:
        train(make_cfg(*QUICK, "trainer.max_steps=1", *overrides, output_dir=tmp_path))
    assert err.value.key == key
    assert said in err.value.message
    assert not (tmp_path / ".hydra").exists()


def test_logs_every_task_and_learns(make_cfg, tmp_path):
    """Each task's loss and metric is logged under its own name, every task learns, the plot is written."""
    cfg = make_cfg("recipe=weighted", "trainer.max_epochs=4", "trainer.accelerator=cpu", output_dir=tmp_path)
    metrics = train(cfg)
    assert metrics["val/acc/digit"] >= 0.8, metrics  # chance: 0.1
    assert metrics["val/acc/parity"] >= 0.8, metrics  # chance: 0.5
    # Baseline: predict the training set's mean ink for every validation image.
    dm, _ = testing.build(cfg)
    dm.setup("fit")
    train_ink, val_ink = dm.train_set.datasets["x"].mean(dim=1), dm.val_set.datasets["x"].mean(dim=1)
    baseline = (val_ink - train_ink.mean()).abs().mean().item()
    assert metrics["val/mae/ink"] <= 0.85 * baseline, (metrics, baseline)

    header = next((tmp_path / "csv").rglob("metrics.csv")).read_text().splitlines()[0].split(",")
    for task in ("digit", "parity", "ink"):
        assert {f"loss/{task}", f"val/loss/{task}"} <= set(header)
    assert {"loss/total", "val/acc/digit", "val/acc/parity", "val/mae/ink"} <= set(header)
    assert any(col.startswith("lr") for col in header)
    assert (tmp_path / "loss_curves.png").stat().st_size > 10_000
    assert (tmp_path / "task_metrics.png").stat().st_size > 10_000
    # The plot draws what metrics.csv holds (two validations per epoch); no copy in the module or checkpoint.
    _, digit_acc = _plotted(tmp_path)["val/acc/digit"]
    assert len(digit_acc) == 8
    assert digit_acc[-1] == metrics["val/acc/digit"]  # the same float32 value: metrics.csv writes its repr, read back
    assert "task_metrics_history" not in torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)


def test_resume_mid_epoch_continues_exactly(make_cfg, tmp_path):
    """ckpt_path= with a non-default task weight: the checkpoint loads (weights_only), training continues
    on exactly the same weights as a straight run, and task_metrics.png's curves carry on."""
    small = ("recipe=weighted", "model.tasks.parity.weight=0.5", "model.net.width=32", "~callbacks.loss_curves")
    runs = straight_and_resumed(make_cfg, tmp_path, small, stop="trainer.max_steps=15", end="trainer.max_steps=30")
    straight, _, resumed = (torch.load(run / "checkpoints/last.ckpt", weights_only=True) for run in runs)
    assert resumed["hyper_parameters"]["tasks"]["parity"]["weight"] == 0.5
    for k, v in straight["state_dict"].items():
        assert torch.equal(resumed["state_dict"][k], v), k
    # Validation after the 11th and 22nd steps: steps 10 and 21, as metrics.csv writes them; the resumed
    # run's metrics.csv (what its task_metrics.png draws) holds the first run's validation too.
    plotted = {name: _plotted(run) for name, run in zip(("straight", "first", "resumed"), runs)}
    assert plotted["resumed"]["val/acc/digit"][0] == [10.0, 21.0]
    assert plotted["resumed"] == plotted["straight"]
    assert (runs[2] / "task_metrics.png").is_file()


def _plotted(run) -> dict[str, tuple[list[float], list[float]]]:
    """The curves task_metrics.png draws for a run: its metrics.csv's validation metric columns."""
    columns = ("val/acc/digit", "val/acc/parity", "val/mae/ink")
    return {name: curve for name, curve in curves_in(next(run.rglob("metrics.csv"))).items() if name in columns}
