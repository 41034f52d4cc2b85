"""Loss balancers (`multiloss.balancers`, ``balancer=``): each update is its paper's rule, on the real recipe."""

from __future__ import annotations

import copy
import csv
import math
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch

from multiloss import testing, train
from multiloss.balancers import DynamicWeightAverage, Fixed, Uncertainty, dwa_weights, pcgrad
from multiloss.config import ConfigError, check_config
from multiloss.testing import assert_gradients_close
from tests.conftest import BARE, QUIET, load_weights, run_cli
from tests.helpers import same_state, straight_and_resumed

WEIGHTED = ("recipe=weighted", "model.net.width=32", "data.batch_size=64", *BARE)
EXACT = 1e-10  # float64: equal up to rounding, on any CPU


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _first_step(cfg):
    """The recipe module as it was, the gradients of its first real Trainer step, and that step's batch: all float64
    (the step under ``precision="64-true"``, which casts the module and the batch as the copies here are cast), so a
    proof on them holds to rounding (`EXACT`)."""
    datamodule, model = testing.build(cfg)
    before = copy.deepcopy(model).double()
    (grads,) = testing.step_gradients(model, datamodule, steps=1, precision="64-true")
    return before, grads, testing.in_dtype(testing.first_batch(datamodule), torch.float64)


def test_fixed_is_the_configured_weights_and_adds_no_state(make_cfg):
    _, model = testing.build(make_cfg(*WEIGHTED, "model.tasks.ink.weight=7"))
    assert isinstance(model.balancer, Fixed) and not model.balancer.adaptive
    assert model.balancer.weights(torch.ones(3)).tolist() == [1.0, 1.0, 7.0]
    # Checkpoints keep the keys they had before balancers: old ones load, proofs are unchanged.
    assert not [k for k in model.state_dict() if k.startswith("balancer.")]


def test_uncertainty_gradients_are_kendalls(make_cfg):
    """One real Trainer step: the net's gradient is Σ cᵢ·exp(-sᵢ)·∇Lᵢ and sᵢ's is cᵢ·(1 - exp(-sᵢ)·Lᵢ)."""
    cfg = make_cfg(*WEIGHTED, "balancer=uncertainty", "model.balancer.init_log_variance=[0.5,-0.3,1.0]")
    before, grads, batch = _first_step(cfg)

    s = before.balancer.log_variance.detach()
    c = torch.tensor([t.weight for t in before.tasks.values()], dtype=torch.float64)
    _, per_task = before.outputs_and_losses(batch)
    losses = torch.stack(list(per_task.values()))
    analytic = c * (1 - torch.exp(-s) * losses.detach())
    assert torch.allclose(grads["balancer.log_variance"], analytic, rtol=0, atol=EXACT)

    net = dict(before.net.named_parameters())
    expected = torch.autograd.grad((c * torch.exp(-s) * losses).sum(), list(net.values()))
    assert_gradients_close(  # float64: its defaults are EXACT
        {k: v for k, v in grads.items() if k.startswith("net.")},
        {f"net.{n}": g for n, g in zip(net, expected)},
    )


def test_uncertainty_settles_where_the_weight_matches_the_loss():
    """The minimum of exp(-s)·L + s over s is at s = log L, whatever L: the paper's fixed point."""
    balancer = Uncertainty(["a", "b"], [1.0, 1.0]).double()
    losses = torch.tensor([4.0, 0.25], dtype=torch.float64)
    optimizer = torch.optim.SGD(balancer.parameters(), lr=0.2)
    for _ in range(500):
        optimizer.zero_grad()
        balancer.extra(losses).backward()
        optimizer.step()
    # A convergence, with a derived bound: the step s ← s - 0.2·(1 - e^-s·L) has slope 1 - 0.2·e^-s·L, in [0.2, 0.95]
    # while e^-s·L is in [0.25, 4] (it goes monotonically from L to 1), so 500 steps from |s - log L| = 1.4 leave at
    # most 1.4·0.95^500 ≈ 1e-11 (0.8 a step near log L: far less), then float64 rounding (measured ≤ 1.8e-15).
    assert torch.allclose(balancer.log_variance.detach(), losses.log(), rtol=0, atol=EXACT)
    assert torch.allclose(balancer.weights(losses), 1 / losses, rtol=0, atol=EXACT)


def test_dwa_is_the_papers_rule_over_epoch_means():
    balancer = DynamicWeightAverage(["a", "b", "c"], [1.0, 1.0, 10.0], temperature=2.0).double()
    epochs = [
        [[2.0, 1.0, 0.5], [4.0, 1.0, 0.3]],  # means 3, 1, 0.4
        [[1.5, 0.9, 0.4]],
        [[1.0, 0.8, 0.1]],
    ]
    epochs = [[torch.tensor(loss, dtype=torch.float64) for loss in steps] for steps in epochs]
    seen = []
    for epoch, steps in enumerate(epochs):
        balancer.start_epoch(epoch, _identity)
        seen += [balancer.weights(loss).clone() for loss in steps]
    base = torch.tensor([1.0, 1.0, 10.0], dtype=torch.float64)
    assert all(torch.equal(w, base) for w in seen[:3])  # epochs 0 and 1: K·softmax of nothing = 1
    r = torch.tensor([1.5 / 3.0, 0.9 / 1.0, 0.4 / 0.4], dtype=torch.float64)  # the last two epochs' mean-loss ratios
    by_hand = 3 * torch.exp(r / 2) / torch.exp(r / 2).sum()
    # DWA's epoch sums follow the losses' dtype (float64 here): the epoch means are exact to float64's rounding.
    assert torch.allclose(seen[3], base * by_hand, rtol=EXACT, atol=0)
    equal = dwa_weights(torch.ones(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64), 2.0)
    assert math.isclose(float(equal.sum()), 3.0, rel_tol=0, abs_tol=EXACT)  # equal rates: 1 each


def test_dwa_in_the_recipe_follows_the_logged_epoch_means(make_cfg, tmp_path):
    out = tmp_path / "run"
    short = ("trainer.max_epochs=3", "trainer.limit_train_batches=4", "trainer.log_every_n_steps=1")
    train(make_cfg(*WEIGHTED, "logger=csv", "balancer=dwa", *short, output_dir=out))
    rows = [r for r in csv.DictReader(next(out.rglob("metrics.csv")).open()) if r.get("loss/digit")]
    tasks = ("digit", "parity", "ink")
    means = [
        [sum(float(r[f"loss/{t}"]) for r in rows if int(float(r["epoch"])) == e) / 4 for t in tasks] for e in (0, 1)
    ]
    expected = dwa_weights(torch.tensor(means[0]), torch.tensor(means[1]), 2.0) * torch.tensor([1.0, 1.0, 30.0])
    third = [r for r in rows if int(float(r["epoch"])) == 2]
    for r in third:
        # Logged values, float32 (the CSV's training rows): each weight logged to 2^-24 relative, and the expected from
        # the logged float32 losses, summed here in float64 where DWA summed them in float32 (≤ 2^-23 per ratio, as
        # in the test above: ≤ 1.2e-7 on the weights). rel 1e-5 holds those with a wide margin.
        assert [float(r[f"weight/{t}"]) for t in tasks] == pytest.approx(expected.tolist(), rel=1e-5)
    assert all(float(r["weight/digit"]) == 1.0 for r in rows if int(float(r["epoch"])) < 2)


@pytest.mark.parametrize(
    ("recipe", "balancer"),
    [
        ("weighted", "dwa"),
        ("weighted", "uncertainty"),
        ("weighted", "pcgrad"),
        ("weighted", "gradnorm"),
        ("multihead", "dwa"),
        ("multihead", "pcgrad"),
        # The stateful methods of torchjd and LibMTL (their state: multiloss.balancers.torchjd_state, moving_average).
        ("weighted", "famo"),
        ("weighted", "gradvac"),
        ("weighted", "nash_mtl"),
        ("weighted", "excess_mtl"),
        ("multihead", "moco"),
        ("multihead", "db_mtl"),
    ],
)
def test_a_resumed_run_continues_the_balancer_exactly(make_cfg, tmp_path, recipe, balancer):
    # 4 batches an epoch: a stop at step 6 is mid-epoch 1; DWA's weights change at epoch 2.
    common = (
        *{"weighted": WEIGHTED, "multihead": MULTIHEAD}[recipe],
        f"balancer={balancer}",
        "callbacks=default",
        "~callbacks.loss_curves",
        "~callbacks.progress_bar",
        "trainer.limit_train_batches=4",
    )
    straight, _, resumed = straight_and_resumed(
        make_cfg, tmp_path, common, stop="trainer.max_steps=6", end="trainer.max_steps=12"
    )
    a, b = load_weights(straight / "checkpoints/last.ckpt"), load_weights(resumed / "checkpoints/last.ckpt")
    assert a.keys() == b.keys() and any(k.startswith("balancer.") for k in a)
    assert same_state(a, b)


@pytest.mark.parametrize("recipe", ["gan", "tbptt", "accumulation"])
def test_a_recipe_without_a_balancer_rejects_one_by_name(make_cfg, recipe):
    with pytest.raises(ConfigError, match=r"model\.balancer"):
        check_config(make_cfg(f"recipe={recipe}", "balancer=dwa"))


def test_bad_balancer_values_are_rejected(make_cfg):
    with pytest.raises(ConfigError, match=r"init_log_variance"):
        testing.build(make_cfg(*WEIGHTED, "balancer=uncertainty", "model.balancer.init_log_variance=[1,2]"))
    with pytest.raises(ConfigError, match=r"temperature"):
        testing.build(make_cfg(*WEIGHTED, "balancer=dwa", "model.balancer.temperature=0"))


# --- PCGrad: gradient surgery -----------------------------------------------------------------------


def _pcgrad_by_hand(vectors: list[list[float]], orders: list[list[int]]) -> list[float]:
    """Yu et al. 2020, Algorithm 1, in plain Python floats."""

    def dot(a, b):
        return sum(x * y for x, y in zip(a, b))

    total = [0.0] * len(vectors[0])
    for i, order in enumerate(orders):
        g = list(vectors[i])
        for j in order:
            if dot(g, vectors[j]) < 0:
                coef = dot(g, vectors[j]) / dot(vectors[j], vectors[j])
                g = [x - coef * y for x, y in zip(g, vectors[j])]
        total = [t + x for t, x in zip(total, g)]
    return total


@pytest.mark.parametrize(
    ("vectors", "expected"),
    [
        ([[1.0, 0.0], [-1.0, 1.0]], [0.5, 1.5]),  # conflicting: each loses its part along the other
        ([[1.0, 0.0], [1.0, 1.0]], [2.0, 1.0]),  # no conflict: the plain sum, unchanged
    ],
)
def test_pcgrad_two_tasks(vectors, expected):
    got = pcgrad(torch.tensor(vectors, dtype=torch.float64), [[1], [0]])
    assert got.tolist() == pytest.approx(expected, abs=1e-12)


def test_pcgrad_three_tasks_in_any_order():
    vectors = [[1.0, 0.2, -0.5], [-0.8, 1.0, 0.3], [0.1, -0.9, 1.0]]
    for orders in ([[1, 2], [0, 2], [0, 1]], [[2, 1], [2, 0], [1, 0]]):
        got = pcgrad(torch.tensor(vectors, dtype=torch.float64), orders)
        assert got.tolist() == pytest.approx(_pcgrad_by_hand(vectors, orders), abs=1e-12)
    same = [[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.0, 0.3, 1.0]]  # pairwise non-negative: nothing projected
    got = pcgrad(torch.tensor(same, dtype=torch.float64), [[1, 2], [0, 2], [0, 1]])
    assert got.tolist() == pytest.approx([1.5, 0.8, 1.0], abs=1e-12)


def test_pcgrad_in_the_recipe_is_the_papers_step(make_cfg):
    """One real Trainer step: the trunk gets Σ PCGrad(cᵢ·∇Lᵢ), each head its own cᵢ·∇Lᵢ."""
    cfg = make_cfg(*WEIGHTED, "balancer=pcgrad", "model.balancer.shuffle=false")
    before, grads, batch = _first_step(cfg)

    _, per_task = before.outputs_and_losses(batch)
    c = [t.weight for t in before.tasks.values()]
    trunk = {n: p for n, p in before.named_parameters() if n.startswith("net.trunk.")}
    per_task_trunk = [
        torch.cat([g.reshape(-1) for g in torch.autograd.grad(w * loss, list(trunk.values()), retain_graph=True)])
        for w, loss in zip(c, per_task.values())
    ]
    orders = [[1, 2], [0, 2], [0, 1]]
    by_hand = torch.tensor(_pcgrad_by_hand([v.tolist() for v in per_task_trunk], orders), dtype=torch.float64)
    got = torch.cat([grads[n].reshape(-1) for n in trunk])
    assert torch.allclose(got, by_hand, rtol=0, atol=EXACT)
    assert not torch.allclose(got, sum(per_task_trunk), atol=1e-6)  # the digits' tasks do conflict at the start
    for name, (task, loss) in zip(before.tasks, per_task.items()):
        head = dict(before.net.heads[task].named_parameters())
        expected = torch.autograd.grad(c[list(before.tasks).index(name)] * loss, list(head.values()), retain_graph=True)
        for (n, _), g in zip(head.items(), expected):
            assert torch.allclose(grads[f"net.heads.{task}.{n}"], g, rtol=0, atol=EXACT)


def test_pcgrad_on_named_shared_layers_projects_only_those(make_cfg):
    """``shared=[trunk.1]``: that layer gets Σ PCGrad(cᵢ·∇Lᵢ); the first trunk layer, reached by every task
    but not named, gets the plain Σ cᵢ·∇Lᵢ."""
    cfg = make_cfg(*WEIGHTED, "balancer=pcgrad", "model.balancer.shuffle=false", "model.balancer.shared=[trunk.1]")
    before, grads, batch = _first_step(cfg)
    _, per_task = before.outputs_and_losses(batch)
    c = [t.weight for t in before.tasks.values()]
    for prefix, projected in (("net.trunk.1.", True), ("net.trunk.0.", False)):
        layer = {n: p for n, p in before.named_parameters() if n.startswith(prefix)}
        per_task_layer = [
            torch.cat([g.reshape(-1) for g in torch.autograd.grad(w * loss, list(layer.values()), retain_graph=True)])
            for w, loss in zip(c, per_task.values())
        ]
        plain = sum(per_task_layer)
        orders = [[1, 2], [0, 2], [0, 1]]
        expected = (
            torch.tensor(_pcgrad_by_hand([v.tolist() for v in per_task_layer], orders), dtype=torch.float64)
            if projected
            else plain
        )
        got = torch.cat([grads[n].reshape(-1) for n in layer])
        assert torch.allclose(got, expected, rtol=0, atol=EXACT)
        assert projected != torch.allclose(got, plain, atol=1e-6)  # the tasks conflict on that layer


@pytest.mark.parametrize(
    ("value", "shown"), [("[trunk.9]", "trunk.9"), ("[]", "[]"), ("[heads.digit,nothing]", "nothing")]
)
def test_shared_names_that_match_no_layer_are_refused(make_cfg, value, shown):
    with pytest.raises(ConfigError) as err:
        testing.build(make_cfg(*WEIGHTED, "balancer=gradnorm", f"model.balancer.shared={value}"))
    assert err.value.key == "model.balancer.shared" and shown in str(err.value)
    if value != "[]":
        assert "trunk.0.0" in str(err.value)  # the names it would accept


# --- torchjd's aggregators ------------------------------------------------------------------------------


@pytest.mark.skipif(find_spec("torchjd") is None, reason="the torchjd extra is not installed")
@pytest.mark.parametrize("name", ["upgrad", "mgda"])
def test_jacobian_descent_is_torchjds_aggregation_of_the_trunk_jacobian(make_cfg, name):
    from torchjd.aggregation import UPGrad

    from multiloss.balancers.min_norm import exact_mgda

    before, grads, batch = _first_step(make_cfg(*WEIGHTED, f"balancer={name}"))
    _, per_task = before.outputs_and_losses(batch)
    c = [t.weight for t in before.tasks.values()]
    trunk = {n: p for n, p in before.named_parameters() if n.startswith("net.trunk.")}
    jacobian = torch.stack(
        [
            torch.cat([g.reshape(-1) for g in torch.autograd.grad(w * loss, list(trunk.values()), retain_graph=True)])
            for w, loss in zip(c, per_task.values())
        ]
    )
    expected = {"upgrad": UPGrad, "mgda": exact_mgda}[name]()(jacobian)
    got = torch.cat([grads[n].reshape(-1) for n in trunk])
    assert torch.allclose(got, expected, rtol=0, atol=EXACT)  # quadprog on both sides: exact to rounding
    # (No "conflicts with no task" here: with rows 100-fold apart in norm, torchjd's regularised
    # solve returns updates at cosine -0.18 to the small tasks; shown on a conditioned problem below.)


@pytest.mark.skipif(find_spec("torchjd") is None, reason="the torchjd extra is not installed")
@pytest.mark.parametrize("aggregator", ["UPGrad", "MGDA"])
def test_jacobian_descent_conflicts_with_no_task_on_two_quadratics(aggregator):
    import torchjd.aggregation

    from multiloss.balancers import JacobianDescent

    w = torch.nn.Parameter(torch.tensor([0.0, 0.0], dtype=torch.float64))
    a, b = torch.tensor([1.0, 0.2], dtype=torch.float64), torch.tensor([-0.8, 1.0], dtype=torch.float64)
    losses = [((w - a) ** 2).sum(), ((w - b) ** 2).sum()]  # gradients -2a, -2b: cosine < 0
    balancer = JacobianDescent(["a", "b"], [1.0, 1.0], getattr(torchjd.aggregation, aggregator)())
    balancer.surrogate(losses, [w]).backward()
    # The same aggregator on the same Jacobian (MGDA's Frank-Wolfe included: the same iterations on both sides).
    expected = getattr(torchjd.aggregation, aggregator)()(torch.stack([-2 * a, -2 * b]))
    assert torch.allclose(w.grad, expected, rtol=0, atol=EXACT)
    assert (torch.stack([-2 * a, -2 * b]) @ w.grad >= -1e-9).all()


@pytest.mark.skipif(find_spec("torchjd") is None, reason="the torchjd extra is not installed")
def test_mgda_is_the_exact_minimum_norm_point_where_torchjds_tolerance_stops_short():
    """Three tasks whose minimum-norm point lies inside a face of their gradients' hull: torchjd's
    Frank-Wolfe MGDA (default tolerance) stops 18 % from it; balancer=mgda's solve is optimal to
    round-off. Optimality (KKT): d = Σαᵢgᵢ with α ≥ 0, Σα = 1, and gᵢ·d ≥ ‖d‖² for every task, with
    equality where αᵢ > 0."""
    from torchjd.aggregation import MGDA

    from multiloss.balancers.min_norm import MinNormWeighting, exact_mgda

    gen = torch.Generator().manual_seed(1)
    jacobian = torch.randn(3, 50, generator=gen, dtype=torch.float64)
    jacobian[1] = -0.5 * jacobian[0] + 0.3 * jacobian[1]  # a conflicting pair, the third task apart
    d = exact_mgda()(jacobian)
    gram = jacobian @ jacobian.T
    alpha = MinNormWeighting()(gram)
    assert alpha.min() >= 0 and alpha.sum() == pytest.approx(1.0, rel=0, abs=EXACT)  # quadprog: Σα = 1 to rounding
    assert torch.allclose(alpha @ jacobian, d, rtol=0, atol=EXACT)
    slack = (jacobian @ d - d @ d) / (d @ d)
    assert slack.min() >= -1e-10, slack  # no task's gradient falls below the point: it is the minimum
    assert slack[alpha > 1e-9].abs().max() <= 1e-10, slack
    torchjd = MGDA()(jacobian)
    assert (torchjd - d).norm() / d.norm() > 0.1  # torchjd's default stopping tolerance: far from it
    assert (torchjd.norm() - d.norm()) / d.norm() > 0.01  # ... and longer than the minimum


ALL = sorted(p.stem for p in (Path(__file__).parents[1] / "configs/balancer").glob("*.yaml"))
WITHOUT_TORCHJD = ("fixed", "uncertainty", "dwa", "pcgrad", "gradnorm", "db_mtl", "moco", "db_mtl_loss")


def test_every_shipped_balancer_is_tried():
    assert len(ALL) >= 26 and {"fixed", "famo", "nash_mtl", "moco"} <= set(ALL)


def _needs_torchjd(balancer: str) -> None:
    if balancer not in WITHOUT_TORCHJD and find_spec("torchjd") is None:
        pytest.skip("the torchjd extra is not installed")


@pytest.mark.parametrize("balancer", ALL)
def test_every_balancer_trains_under_bf16_mixed(make_cfg, tmp_path, balancer):
    _needs_torchjd(balancer)
    metrics = train(
        make_cfg(
            *WEIGHTED,
            f"balancer={balancer}",
            "trainer.precision=bf16-mixed",
            "trainer.max_steps=3",
            output_dir=tmp_path,
        )
    )
    assert metrics and all(math.isfinite(v) for v in metrics.values())


# --- multihead: the heads are the tasks --------------------------------------------------------------

MULTIHEAD = ("recipe=multihead", "model.net.width=32", "data.batch_size=64", *BARE)


@pytest.mark.parametrize("balancer", ALL)
def test_every_balancer_trains_the_multihead_recipe(make_cfg, tmp_path, balancer):
    _needs_torchjd(balancer)
    cfg = make_cfg(*MULTIHEAD, f"balancer={balancer}", "trainer.max_steps=3", output_dir=tmp_path)
    datamodule, model = testing.build(cfg)
    steps = testing.step_gradients(model, datamodule, steps=3)
    assert len(steps) == 3 and all(bool(torch.isfinite(g).all()) for step in steps for g in step.values())
    assert not torch.equal(steps[0]["net.blocks.0.0.weight"], steps[2]["net.blocks.0.0.weight"])  # it stepped
    assert isinstance(model.balancer, Fixed) == (balancer == "fixed")  # fixed: the configured weights


def test_a_balancer_trains_from_the_shell(tmp_path):
    """The issue's own line, as a user types it (``multiloss-train`` is the same entry point)."""
    out = tmp_path / "run"
    proc = run_cli("recipe=weighted", "balancer=gradnorm", "trainer.max_steps=4", *QUIET, f"hydra.run.dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "checkpoints/last.ckpt").is_file()
    header = next(out.rglob("metrics.csv")).read_text().splitlines()[0].split(",")
    assert {"weight/digit", "weight/parity", "weight/ink"} <= set(header)


def test_multihead_uncertainty_gradients_are_kendalls_and_the_balancer_reloads(make_cfg, tmp_path):
    cfg = make_cfg(*MULTIHEAD, "balancer=uncertainty", "model.balancer.init_log_variance=[0.4,-0.2,0.9]")
    before, grads, batch = _first_step(cfg)
    from lightning.pytorch.plugins.precision import DoublePrecision

    # Multihead makes its balancer once the check has counted the heads; under 64-true the check runs in float64 (the
    # default dtype there), so the balancer is made in it: its init_log_variance exact in float64, not from float32.
    with DoublePrecision().forward_context():
        before.check_components(batch)
    s = before.balancer.log_variance.detach()
    losses = torch.stack([torch.nn.functional.cross_entropy(o, batch["y"]) for o in before.net(batch["x"])])
    assert torch.allclose(grads["balancer.log_variance"], 1 - torch.exp(-s) * losses.detach(), rtol=0, atol=EXACT)
    net = dict(before.net.named_parameters())
    expected = torch.autograd.grad((torch.exp(-s) * losses).sum(), list(net.values()))
    assert_gradients_close(  # float64: its defaults are EXACT
        {k: v for k, v in grads.items() if k.startswith("net.")},
        {f"net.{n}": g for n, g in zip(net, expected)},
    )
    # A checkpoint carries the balancer, and loads with no argument (the heads come from it).
    out = tmp_path / "run"
    train(
        make_cfg(
            *MULTIHEAD,
            "balancer=uncertainty",
            "callbacks=default",
            "~callbacks.progress_bar",
            "~callbacks.loss_curves",
            "trainer.max_steps=3",
            output_dir=out,
        )
    )
    from multiloss.recipes.multihead import MultiHead

    loaded = MultiHead.load_from_checkpoint(out / "checkpoints" / "last.ckpt", map_location="cpu")
    saved = load_weights(out / "checkpoints" / "last.ckpt")
    assert torch.equal(loaded.balancer.log_variance.detach(), saved["balancer.log_variance"])


# --- GradNorm ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("shared", "layers"), [(None, "net.trunk."), ("[trunk.1]", "net.trunk.1.")])
def test_gradnorm_weight_update_is_the_gradient_of_its_loss(make_cfg, shared, layers):
    """First step (w = 1, every rᵢ = 1): the weights' gradient is d/dwᵢ Σ|Gᵢ - Ḡ| = sign(Gᵢ - Ḡ)·‖∇_W cᵢLᵢ‖,
    and the network's gradient is the plain Σ cᵢ∇Lᵢ. W: the whole trunk (found), or with
    ``shared=[trunk.1]`` the paper's last shared layer only."""
    override = [f"model.balancer.shared={shared}"] if shared else []
    before, grads, batch = _first_step(make_cfg(*WEIGHTED, "balancer=gradnorm", *override))
    _, per_task = before.outputs_and_losses(batch)
    c = [t.weight for t in before.tasks.values()]
    trunk = [p for n, p in before.named_parameters() if n.startswith(layers)]
    norms = torch.stack(
        [
            torch.cat([g.reshape(-1) for g in torch.autograd.grad(w * loss, trunk, retain_graph=True)]).norm()
            for w, loss in zip(c, per_task.values())
        ]
    )
    # Σ|Gᵢ - Ḡ| with G = w·norms, differentiated by hand at w = 1 (Ḡ held constant, as in the paper).
    expected_weights = torch.sign(norms - norms.mean()) * norms
    assert torch.allclose(grads["balancer.task_weight"], expected_weights, rtol=0, atol=EXACT)
    expected = dict(
        zip(
            dict(before.net.named_parameters()),
            torch.autograd.grad(sum(w * loss for w, loss in zip(c, per_task.values())), list(before.net.parameters())),
        )
    )
    assert_gradients_close(  # float64: its defaults are EXACT
        {k: v for k, v in grads.items() if k.startswith("net.")},
        {f"net.{n}": g for n, g in expected.items()},
    )


def test_gradnorm_keeps_its_weights_positive():
    """A weight pushed to zero or below (a large step on the weights' gradient) comes back as ``min_weight``
    before the renormalisation: no task's gradient is ever turned around."""
    from multiloss.balancers import GradNorm

    balancer = GradNorm(["a", "b", "c"], [1.0, 1.0, 1.0], min_weight=1e-3).double()
    with torch.no_grad():
        # After an SGD step that overshot.
        balancer.task_weight.copy_(torch.tensor([-0.7, 2.2, 1.5], dtype=torch.float64))
    weights = balancer.weights(torch.ones(3, dtype=torch.float64))
    assert (weights > 0).all(), weights
    assert weights.sum() == pytest.approx(3.0, rel=0, abs=EXACT)
    assert weights[0] == pytest.approx(3 * 1e-3 / (1e-3 + 2.2 + 1.5), rel=0, abs=EXACT)
    with pytest.raises(ConfigError, match="min_weight"):
        GradNorm(["a", "b"], [1.0, 1.0], min_weight=0)


def test_gradnorm_weights_stay_positive_under_a_large_learning_rate(make_cfg, tmp_path):
    out = tmp_path / "run"
    train(
        make_cfg(
            *WEIGHTED,
            "logger=csv",
            "balancer=gradnorm",
            "model.tasks.ink.weight=1",
            "optimizer=sgd",
            "model.optimizer.lr=2.0",  # a step on the weights' gradient that overshoots zero (and the net's, later)
            "trainer.max_steps=3",
            "trainer.log_every_n_steps=1",
            "nonfinite=off",
            output_dir=out,
        )
    )
    rows = [r for r in csv.DictReader(next(out.rglob("metrics.csv")).open()) if r.get("weight/digit")]
    weights = [[float(r[f"weight/{t}"]) for t in ("digit", "parity", "ink")] for r in rows]
    assert min(min(w) for w in weights) > 0, weights
    assert min(min(w) for w in weights) < 0.01, weights  # the rule did push one to the floor
    # Logged values, float32 (the CSV's training rows): three weights near 1 rounded to 2^-24 relative each, so their
    # sum is 3 to ≤ 3 × 1.2e-7 = 3.6e-7 (after the float32 renormalisation's own few ulps): abs 1e-5 holds it.
    assert [sum(w) for w in weights] == pytest.approx([3.0] * len(rows), abs=1e-5)


def test_gradnorm_keeps_its_weights_summing_to_the_task_count(make_cfg, tmp_path):
    out = tmp_path / "run"
    train(
        make_cfg(
            *WEIGHTED,
            "logger=csv",
            "balancer=gradnorm",
            "model.tasks.ink.weight=1",
            "trainer.max_steps=8",
            "trainer.log_every_n_steps=1",
            output_dir=out,
        )
    )
    rows = [r for r in csv.DictReader(next(out.rglob("metrics.csv")).open()) if r.get("weight/digit")]
    sums = [sum(float(r[f"weight/{t}"]) for t in ("digit", "parity", "ink")) for r in rows]
    assert sums == pytest.approx([3.0] * len(rows), abs=1e-5)  # logged float32: ≤ 3.6e-7, as in the test above
    assert len({r["weight/ink"] for r in rows}) > 1  # and they move


@pytest.mark.skipif(find_spec("torchjd") is None, reason="the torchjd extra is not installed")
@pytest.mark.parametrize("name", ["pcgrad", "gradnorm", "upgrad", "mgda"])
def test_each_gradient_rule_from_the_gramian_alone_equals_the_rule_on_the_gradients(name):
    """What the sharded rule (``scope=global`` under FSDP2) computes from the tasks' Gramian — coefficients of their
    gradients, and GradNorm's own term — gives the surrogate's gradient on the trunk, the heads and the balancer."""
    from torchjd.aggregation import UPGrad

    from multiloss.balancers import GradNorm, JacobianDescent, PCGrad
    from multiloss.balancers.min_norm import exact_mgda
    from multiloss.balancers.task_gradients import task_gradients

    torch.manual_seed(0)
    trunk = torch.nn.Linear(4, 5).double()
    heads = torch.nn.ModuleList([torch.nn.Linear(5, 1).double() for _ in range(3)])
    x = torch.randn(16, 4, dtype=torch.float64)
    params = [*trunk.parameters(), *heads.parameters()]
    tasks, base = ["a", "b", "c"], [1.0, 2.0, 0.5]
    make = {
        "pcgrad": lambda: PCGrad(tasks, base, seed=3),
        "gradnorm": lambda: GradNorm(tasks, base),
        "upgrad": lambda: JacobianDescent(tasks, base, UPGrad()),
        "mgda": lambda: JacobianDescent(tasks, base, exact_mgda()),
    }[name]

    def losses() -> list[torch.Tensor]:
        h = torch.tanh(trunk(x))
        return [(heads[i](h) - i).pow(2).mean() * (i + 1) for i in range(3)]

    on_gradients, on_gramian = make(), make()
    found = losses()
    on_gradients.weights(torch.stack(found).detach())
    on_gradients.surrogate(found, params).backward()
    expected = {id(p): p.grad.clone() for p in params}

    found = losses()
    on_gramian.weights(torch.stack(found).detach())
    grads = task_gradients([c * loss for c, loss in zip(on_gramian.base, found)], params)
    rule = on_gramian.gramian_rule(grads.vectors @ grads.vectors.T, found)
    combined, offset = rule.shared @ grads.vectors, 0
    got: dict[int, torch.Tensor] = {}
    for p in grads.shared:
        got[id(p)] = combined[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    for p, g, task in grads.own:
        got[id(p)] = got.get(id(p), 0) + rule.own[task] * g
    assert grads.shared and len(got) == len(params)
    for p in params:
        assert torch.allclose(got[id(p)], expected[id(p)], rtol=0, atol=EXACT)
    if rule.extra is not None:  # GradNorm's weights: the same gradient from the Gramian's diagonal
        rule.extra.backward()
        assert torch.allclose(on_gramian.task_weight.grad, on_gradients.task_weight.grad, rtol=0, atol=EXACT)


@pytest.mark.parametrize(
    ("balancer", "override", "key"),
    [
        ("db_mtl", "model.balancer.beta=2", "beta"),
        ("moco", "model.balancer.gamma=0", "gamma"),
        ("famo", "model.balancer.scalarizer._target_=builtins.dict", "scalarizer"),
        ("db_mtl_loss", "model.balancer.scalarizer.eps=0", "eps"),
        ("upgrad", "model.balancer.aggregator._target_=builtins.dict", "aggregator"),
    ],
)
def test_bad_keys_of_the_new_methods_are_one_message_naming_the_key(make_cfg, balancer, override, key):
    _needs_torchjd(balancer)
    with pytest.raises(ConfigError, match=key):
        testing.build(make_cfg(*WEIGHTED, f"balancer={balancer}", override))


@pytest.mark.parametrize("balancer", ["nash_mtl", "graddrop", "config", "excess_mtl", "db_mtl", "moco"])
def test_a_method_that_needs_the_gradients_is_refused_on_the_shards_by_name(balancer):
    """``scope=global`` under FSDP2 runs the rule on the shards, from the tasks' Gramian: a method that needs the
    gradients themselves (or keeps averages of them) is refused before any process starts, naming the key and why."""
    from multiloss.balancers.build import check_sharded_balancer
    from tests.test_balancer_parity import _spec

    _needs_torchjd(balancer)
    with pytest.raises(ConfigError, match=r"model\.balancer\.(aggregator|scope)") as refused:
        check_sharded_balancer(_spec(balancer, "model.balancer.scope=global"), 1)
    assert "global" in str(refused.value) or "Gramian" in str(refused.value)
