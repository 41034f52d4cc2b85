"""Every balancer method equals its reference: the net after 20 steps on fixed inputs, float64, equal to rounding
(`EXACT`: ≤ 1e-10 on any CPU; measured ≤ 3e-16), but for the two whose state src still holds in float32 (`PENDING`).

Our side runs the balancer protocol as the recipes do (`multiloss.testing.balancer_backward`: `balance`, then
``Balanced.backward``, and FAMO's after-step update); the reference is the plain loop its authors' code
writes: torchjd called directly where torchjd is the reference (``S(losses).backward()`` for a scalarizer,
``mtl_backward`` + ``jac_to_grad`` for an aggregator), LibMTL's code transcribed below where LibMTL is (DB-MTL,
MoCo, IMTL). Both sides draw the same random numbers (RLW's weights, GradVac's and GradDrop's draws): the global
generator is seeded alike before each step.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from multiloss.testing import balancer_backward

pytestmark = pytest.mark.skipif(find_spec("torchjd") is None, reason="the torchjd extra is not installed")

STEPS, LR = 20, 0.05
TASKS, BASE = ["a", "b", "c"], [1.0, 2.0, 0.5]
EXACT = 1e-10  # float64: equal up to rounding, on any CPU (20 steps here end ≤ 4e-15 apart where they are equal)

# Every method's state follows the run's dtype (FAMO's logits and Adam, outside the module tree, cast with the
# losses; MoCo's λ starts in float64): none is held to a looser bound than EXACT.
PENDING: dict[str, float] = {}


class Net(nn.Module):
    """A trunk and three heads whose tasks conflict (targets of opposite signs, losses of different scales)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
        self.heads = nn.ModuleList([nn.Linear(8, 1) for _ in TASKS])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        h = self.trunk(x)
        return h, [head(h).squeeze(-1) for head in self.heads]


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 6, generator=g, dtype=torch.float64)
    y = torch.stack([x[:, 0] + x[:, 1], -x[:, 0] + 0.5 * x[:, 2], 3 * x[:, 3] - x[:, 0]], dim=1)
    return x, y


def _losses(net: Net, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    h, outs = net(x)
    return h, [F.mse_loss(out, y[:, i]) * (i + 1) for i, out in enumerate(outs)]


def _ours(balancer: nn.Module | Callable[[Net], nn.Module]) -> Net:
    """20 steps of the balancer protocol (``balancer``, or a function making it for the net)."""
    net = Net().double()
    balancer = (balancer if isinstance(balancer, nn.Module) else balancer(net)).double()
    x, y = _data()
    optimizer = torch.optim.SGD([*net.parameters(), *balancer.parameters()], lr=LR)
    for step in range(STEPS):
        torch.manual_seed(100 + step)
        optimizer.zero_grad()
        balancer_backward(balancer, dict(zip(TASKS, _losses(net, x, y)[1])), net)
        optimizer.step()
        if balancer.after_step_update:
            with torch.no_grad():
                balancer.after_step(torch.stack(_losses(net, x, y)[1]))
    return net


def _scalarizer_reference(make_scalarizer) -> Net:
    """torchjd's own loop for a scalarizer: ``S(losses).backward()``, FAMO's ``update`` with the losses after the step
    (torchjd/scalarization/_famo.py's docstring)."""
    net = Net().double()
    scalarizer = make_scalarizer().double()
    x, y = _data()
    own = [] if hasattr(scalarizer, "update") else list(scalarizer.parameters())
    optimizer = torch.optim.SGD([*net.parameters(), *own], lr=LR)
    base = torch.tensor(BASE, dtype=torch.float64)
    for step in range(STEPS):
        torch.manual_seed(100 + step)
        optimizer.zero_grad()
        _, losses = _losses(net, x, y)
        scalarizer(torch.stack(losses) * base).backward()
        optimizer.step()
        if hasattr(scalarizer, "update"):
            with torch.no_grad():
                scalarizer.update(torch.stack(_losses(net, x, y)[1]) * base)
    return net


def _aggregator_reference(make_aggregator) -> Net:
    """torchjd's own MTL loop (docs/source/examples/mtl.rst, torchjd 0.18): ``mtl_backward`` of the losses on the
    shared features, then ``jac_to_grad`` of the shared parameters with the aggregator."""
    from torchjd.autojac import jac_to_grad, mtl_backward

    net = Net().double()
    aggregator = make_aggregator()
    x, y = _data()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    for step in range(STEPS):
        torch.manual_seed(100 + step)
        optimizer.zero_grad()
        h, losses = _losses(net, x, y)
        mtl_backward([c * loss for c, loss in zip(BASE, losses)], features=h)
        jac_to_grad(list(net.trunk.parameters()), aggregator)
        optimizer.step()
    return net


def _largest_difference(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def _changed(net: nn.Module) -> bool:
    return _largest_difference(net, Net().double()) > 1e-3


# --- torchjd's scalarizers: GLS, RLW, STCH, FAMO, IMTL-L, and DB-MTL's log-loss -------------------------------

SCALARIZERS = {
    "gls": lambda: __import__("torchjd.scalarization").scalarization.GeometricMean(),
    "rlw": lambda: __import__("torchjd.scalarization").scalarization.Random(),
    "stch": lambda: __import__("torchjd.scalarization").scalarization.STCH(mu=1.0),
    "famo": lambda: __import__("torchjd.scalarization").scalarization.FAMO(3, lr=0.025, weight_decay=1e-3),
    "imtl_l": lambda: __import__("torchjd.scalarization").scalarization.IMTLL(3),
}


@pytest.mark.parametrize("name", [*SCALARIZERS, "db_mtl_loss"])
def test_a_scalarization_is_its_reference(name):
    from multiloss.balancers import LogSum, Scalarized

    # db_mtl_loss: LibMTL's DB_MTL.py line 27 (4336804), the log of each loss + 1e-8, backwarded.
    make = SCALARIZERS.get(name, lambda: LogSum(1e-8))
    ours = _ours(Scalarized(TASKS, BASE, make()))
    reference = _scalarizer_reference(make)
    print(f"{name}: largest difference {_largest_difference(ours, reference):.2g}")
    assert _changed(ours) and _largest_difference(ours, reference) <= PENDING.get(name, EXACT)


# --- torchjd's aggregators ---------------------------------------------------------------------------------------

AGGREGATORS = {
    "cagrad": ("CAGrad", {"c": 0.5}),
    "nash_mtl": ("NashMTL", {"n_tasks": 3}),
    "aligned_mtl": ("AlignedMTL", {}),
    "imtl_g": ("IMTLG", {}),
    "fairgrad": ("FairGrad", {"alpha": 1.0}),
    "gradvac": ("GradVac", {"beta": 0.5}),
    "dualproj": ("DualProj", {}),
    "graddrop": ("GradDrop", {}),
    "config": ("ConFIG", {}),
    "excess_mtl": ("ExcessMTL", {}),
    "upgrad": ("UPGrad", {}),
}


@pytest.mark.parametrize("name", AGGREGATORS)
def test_an_aggregator_is_torchjds_loop(name):
    """CAGrad, Nash-MTL and FairGrad solve iteratively (cvxpy's Clarabel, ECOS; scipy's least_squares), but the same
    solver on the same float64 Gramian on both sides: no solver gap, the same steps (measured 0 for all eleven)."""
    import torchjd.aggregation

    from multiloss.balancers import JacobianDescent

    cls, kwargs = AGGREGATORS[name]
    make = lambda: getattr(torchjd.aggregation, cls)(**kwargs)  # noqa: E731
    ours = _ours(JacobianDescent(TASKS, BASE, make()))
    reference = _aggregator_reference(make)
    print(f"{name}: largest difference {_largest_difference(ours, reference):.2g}")
    assert _changed(ours) and _largest_difference(ours, reference) <= EXACT


def test_nash_mtl_on_a_singular_gramian_keeps_its_last_weights_instead_of_crashing():
    """Two tasks with the same gradient and one with none: ECOS meets a singular Gramian; torchjd's NashMTL catches
    the solver's error and keeps its previous weights, and the step is finite."""
    import torchjd.aggregation

    from multiloss.balancers import JacobianDescent

    balancer = JacobianDescent(TASKS, [1.0, 1.0, 1.0], torchjd.aggregation.NashMTL(n_tasks=3))
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    same = (w**2).sum()
    losses = [same, same * 1.0, (w * 0).sum()]
    balancer.surrogate(losses, [w]).backward()
    assert torch.isfinite(w.grad).all()


# --- LibMTL's DB-MTL, MoCo and IMTL, transcribed ------------------------------------------------------------------
# median-research-group/LibMTL at 4336804847eaa5e0b924b743d76beec7ac3fdc97: LibMTL/weighting/DB_MTL.py lines 13-37,
# MoCo.py lines 27-50, IMTL.py lines 19-39, and AbsWeighting._compute_grad / _reset_grad (abstract_weighting.py lines
# 37-76) for what the heads get: each task's own loss's gradient (its per-task backward), the shared parameters the
# method's vector.


class _LibMTL:
    """AbsWeighting's gradient plumbing (``_compute_grad(mode='backward')``, ``_reset_grad``) on `Net`'s trunk."""

    def __init__(self, net: Net) -> None:
        self.net, self.task_num = net, len(TASKS)
        self.grad_index = [p.numel() for p in net.trunk.parameters()]
        self.grad_dim = sum(self.grad_index)

    def compute_grad(self, losses: list[torch.Tensor], retain_last: bool = False) -> torch.Tensor:
        """``retain_last``: every backward keeps the graph (MoDo's and SDMGrad's, abstract_weighting.py 45-46)."""
        grads = torch.zeros(self.task_num, self.grad_dim, dtype=torch.float64)
        for tn in range(self.task_num):
            keep = retain_last or (tn + 1) != self.task_num
            losses[tn].backward(retain_graph=True) if keep else losses[tn].backward()
            grads[tn] = torch.cat([p.grad.view(-1) for p in self.net.trunk.parameters()])
            for p in self.net.trunk.parameters():  # zero_grad_share_params
                p.grad.zero_()
        return grads

    def reset_grad(self, new_grads: torch.Tensor) -> None:
        offset = 0
        for p in self.net.trunk.parameters():
            p.grad.data = new_grads[offset : offset + p.numel()].contiguous().view(p.size()).data.clone()
            offset += p.numel()


def _libmtl_reference(method: str) -> Net:
    net = Net().double()
    x, y = _data()
    lib = _LibMTL(net)
    base = torch.tensor(BASE, dtype=torch.float64)
    loss_scale = nn.Parameter(torch.zeros(3, dtype=torch.float64))  # IMTL.init_param
    optimizer = torch.optim.SGD([*net.parameters(), loss_scale], lr=LR)
    step, grad_buffer = 0, torch.zeros(3, lib.grad_dim, dtype=torch.float64)  # DB_MTL.init_param
    y_state, lambd = torch.zeros(3, lib.grad_dim, dtype=torch.float64), torch.ones(3, dtype=torch.float64) / 3
    for t in range(STEPS):
        torch.manual_seed(100 + t)
        optimizer.zero_grad()
        _, raw = _losses(net, x, y)
        losses = torch.stack(raw) * base
        if method == "db_mtl":
            step += 1
            beta, beta_sigma = 0.9, 0.0
            batch_grads = lib.compute_grad(torch.log(losses + 1e-8))
            grad_buffer = batch_grads + (beta / step**beta_sigma) * (grad_buffer - batch_grads)
            u_grad = grad_buffer.norm(dim=-1)
            alpha = u_grad.max() / (u_grad + 1e-8)
            new_grads = sum([alpha[i] * grad_buffer[i] for i in range(3)])
            lib.reset_grad(new_grads)
        elif method == "moco":
            step += 1
            beta, beta_sigma, gamma, gamma_sigma, rho = 0.5, 0.5, 0.1, 0.5, 0.0
            grads = lib.compute_grad(losses)
            with torch.no_grad():
                for tn in range(3):
                    grads[tn] = grads[tn] / (grads[tn].norm() + 1e-8) * losses[tn]
            y_state = y_state - (beta / step**beta_sigma) * (y_state - grads)
            lambd = F.softmax(
                lambd - (gamma / step**gamma_sigma) * (y_state @ y_state.t() + rho * torch.eye(3)) @ lambd, -1
            )
            lib.reset_grad(y_state.t() @ lambd)
        else:  # imtl
            losses = loss_scale.exp() * losses - loss_scale
            grads = lib.compute_grad(losses)
            grads_unit = grads / torch.norm(grads, p=2, dim=-1, keepdim=True)
            D = grads[0:1].repeat(2, 1) - grads[1:]
            U = grads_unit[0:1].repeat(2, 1) - grads_unit[1:]
            alpha = torch.matmul(torch.matmul(grads[0], U.t()), torch.inverse(torch.matmul(D, U.t())))
            alpha = torch.cat((1 - alpha.sum().unsqueeze(0), alpha), dim=0)
            lib.reset_grad(sum([alpha[i] * grads[i] for i in range(3)]))
        optimizer.step()
    return net


@pytest.mark.parametrize("name", ["db_mtl", "moco", "imtl"])
def test_a_libmtl_method_is_libmtls_code(name):
    from multiloss.balancers import DBMTL, IMTL, MoCo

    balancer = {
        "db_mtl": lambda: DBMTL(TASKS, BASE),
        "moco": lambda: MoCo(TASKS, BASE),
        "imtl": lambda: IMTL(TASKS, BASE),
    }
    ours = _ours(balancer[name]())
    reference = _libmtl_reference(name)
    print(f"{name}: largest difference {_largest_difference(ours, reference):.2g}")
    assert _changed(ours) and _largest_difference(ours, reference) <= PENDING.get(name, EXACT)


def test_a_stateful_balancer_state_round_trips_through_a_checkpoint_file(tmp_path):
    """The state a checkpoint holds of the stateful methods loads with ``weights_only=True`` and continues exactly."""
    import torchjd.aggregation
    import torchjd.scalarization

    from multiloss.balancers import DBMTL, JacobianDescent, MoCo, Scalarized

    makes = {
        "gradvac": lambda: JacobianDescent(TASKS, BASE, torchjd.aggregation.GradVac()),
        "nash_mtl": lambda: JacobianDescent(TASKS, BASE, torchjd.aggregation.NashMTL(n_tasks=3)),
        "excess_mtl": lambda: JacobianDescent(TASKS, BASE, torchjd.aggregation.ExcessMTL()),
        "famo": lambda: Scalarized(TASKS, BASE, torchjd.scalarization.FAMO(3)),
        "db_mtl": lambda: DBMTL(TASKS, BASE),
        "moco": lambda: MoCo(TASKS, BASE),
    }
    for name, make in makes.items():
        straight, first = make(), make()
        a, b = _ours(straight), _ours(first)  # the same 20 steps
        path = tmp_path / f"{name}.pt"
        torch.save(first.state_dict(), path)
        resumed = make().double()
        resumed.load_state_dict(torch.load(path, weights_only=True))
        # Both go on from where they are: 20 more steps of each, from the same net.
        net_a, net_b = copy.deepcopy(a), copy.deepcopy(b)
        for balancer, net in ((straight, net_a), (resumed, net_b)):
            _continue(balancer, net)
        assert _largest_difference(net_a, net_b) == 0.0, name


def _continue(balancer: nn.Module, net: Net) -> None:
    x, y = _data()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    for step in range(5):
        torch.manual_seed(200 + step)
        optimizer.zero_grad()
        balancer_backward(balancer, dict(zip(TASKS, _losses(net, x, y)[1])), net)
        optimizer.step()
        if balancer.after_step_update:
            with torch.no_grad():
                balancer.after_step(torch.stack(_losses(net, x, y)[1]))


# --- at any scale: every method's distributed paths in one 2-process group ----------------------------------------

GRAMIAN = [
    "pcgrad",
    "gradnorm",
    "upgrad",
    "mgda",
    "cagrad",
    "aligned_mtl",
    "imtl_g",
    "fairgrad",
    "gradvac",
    "dualproj",
    "imtl",
]
NEEDS_GRADIENTS = ["nash_mtl", "graddrop", "config", "excess_mtl", "db_mtl", "moco"]
LOSS_BASED = ["uncertainty", "dwa", "gls", "rlw", "stch", "famo", "imtl_l", "db_mtl_loss"]
REP_GRAD = [*GRAMIAN, "nash_mtl", "excess_mtl", "graddrop"]  # every rule on the representation
DRAWS = ["sdmgrad", "modo"]  # three draws a step

# 2 ranks against 1: the ranks' sums make the tasks' Gramian equal to rounding, not to the bit, and where the rule is an
# iterative solver that stops at a tolerance, its weights are determined only to that tolerance, not to rounding.
# (Above, both sides solve the same Gramian to the bit: no gap. FairGrad's least_squares: measured ≤ 2.3e-14 here.)
SOLVER_GAP = {
    # Nash-MTL's outer loop stops where α moves less than 1e-6 (or ‖Gα - 1/α‖ < 1e-3), each inner ECOS solve at its
    # 1e-8 tolerances: α is determined to ~1e-6, so 3 steps × lr 0.05 × 1e-6 × the shared update (norm ≤ 4.3 here,
    # max_norm 1 on the parameters) ≤ 6.4e-7. Measured 2.3e-11 (parameters), 2.5e-9 (rep_grad).
    "nash_mtl": 1e-6,
    # CAGrad's Clarabel stops at its gap tolerances 1e-8: 3 steps × lr 0.05 × 1e-8 × the update (norm ≤ 5.4 here)
    # ≤ 8e-9. Measured 1.7e-16 (parameters), 1.9e-12 (rep_grad).
    "cagrad": 1e-7,
}


def _spec(name: str, *overrides: str) -> dict:
    """``balancer=<name>``'s config as the shipped group composes it."""
    from omegaconf import OmegaConf

    from tests.conftest import compose_config

    cfg = compose_config(["recipe=weighted", f"balancer={name}", *overrides], Path("unused"))
    return OmegaConf.to_container(cfg.model.balancer, resolve=True)


@pytest.mark.slow
@pytest.mark.distributed
def test_every_method_on_two_ranks_ddp_and_fsdp2_in_one_process_group(tmp_path):
    """``scope=global`` (and every scalarization): 2 ranks × 16 equal 1 rank × 32 (float64, `EXACT`; the iterative
    solvers of `SOLVER_GAP` and `PENDING`'s two at their bounds) under DDP, and under FSDP2 for the rules the Gramian
    serves; ``scope=rank``: FSDP2 held whole equals DDP. Three steps each."""
    import json
    import os
    import subprocess
    import sys

    methods = {}
    for name in GRAMIAN:
        methods[name] = {"spec": _spec(name, "model.balancer.scope=global"), "ways": ["ddp", "fsdp_global"]}
        methods[f"{name}@rank"] = {"spec": _spec(name), "ways": ["fsdp_rank_vs_ddp"]}
    for name in NEEDS_GRADIENTS:
        methods[name] = {"spec": _spec(name, "model.balancer.scope=global"), "ways": ["ddp"]}
        methods[f"{name}@rank"] = {"spec": _spec(name), "ways": ["fsdp_rank_vs_ddp"]}
    for name in DRAWS:  # each rank's own three draws: FSDP2 held whole against DDP
        methods[f"{name}@rank"] = {"spec": _spec(name), "ways": ["fsdp_rank_vs_ddp"]}
    for name in LOSS_BASED:
        methods[name] = {"spec": _spec(name), "ways": ["ddp", "fsdp_global"]}
    # rep_grad, scope=global: the global batch's representation gradients (one all-reduce of K × d, or of the K × K
    # Gramian for every sample's); under FSDP2 on the shards as they are (no parameter's gradient is taken).
    for name in REP_GRAD:
        spec = _spec(name, "model.balancer.rep_grad=batch", "model.balancer.scope=global")
        methods[f"{name}@rep_grad"] = {"spec": spec, "ways": ["ddp", "fsdp_global"]}
    for name in ("upgrad", "mgda", "pcgrad"):
        spec = _spec(name, "model.balancer.rep_grad=samples", "model.balancer.scope=global")
        methods[f"{name}@rep_grad_samples"] = {"spec": spec, "ways": ["ddp", "fsdp_global"]}
    (tmp_path / "methods.json").write_text(json.dumps(methods))
    out = tmp_path / "results.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    command += ["-m", "tests.balancer_ranks", str(tmp_path / "methods.json"), str(out)]
    env = {**os.environ, "TORCH_DISTRIBUTED_DEBUG": "DETAIL", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command, cwd=Path(__file__).parents[1], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(out.read_text())
    for name, ways in results.items():
        print(name, {way: d if isinstance(d, list) else f"{d:.2g}" for way, d in ways.items()})
    assert results.keys() == methods.keys()
    for name, ways in results.items():
        # scope=rank: a Gramian rule takes the Gramian layer by layer on DDP and on FSDP2 held whole, every step.
        layer_steps = ways.pop("layer_steps", None)
        if layer_steps is not None:
            assert layer_steps == ([3, 3] if name.removesuffix("@rank") in GRAMIAN else [0, 0]), (name, layer_steps)
        for way, difference in ways.items():
            method = name.split("@")[0]
            assert difference <= SOLVER_GAP.get(method, PENDING.get(method, EXACT)), (name, way, difference)


# --- the Gramian layer by layer: the same step as the K gradients, without them --------------------------------------


@pytest.mark.parametrize("name", GRAMIAN)
def test_the_gramian_layer_by_layer_gives_the_step_of_the_task_gradients(name):
    """``gramian: layers`` (the default where the shared layers are Linear) against ``gramian: gradients`` (the K task
    gradients): the same 20 steps, float64, equal to rounding (CAGrad's and FairGrad's solvers on Gramians equal to
    rounding: measured 0 for all eleven)."""
    from multiloss.balancers.build import build_balancer

    def run(gramian: str) -> Net:
        def make(net: Net) -> nn.Module:
            balancer = build_balancer({**_spec(name), "gramian": gramian}, TASKS, BASE, net, "model.balancer")
            assert (balancer._layers is not None) == (gramian == "layers")
            return balancer

        return _ours(make)

    layers, gradients = run("layers"), run("gradients")
    print(f"{name}: layers vs gradients {_largest_difference(layers, gradients):.2g}")
    assert _changed(layers) and _largest_difference(layers, gradients) <= EXACT
