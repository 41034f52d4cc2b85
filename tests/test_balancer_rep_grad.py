"""``model.balancer.rep_grad``: the rules on the tasks' gradients of the representation, equal to LibMTL's ``rep_grad``.

LibMTL transcribed from median-research-group/LibMTL at 4336804847eaa5e0b924b743d76beec7ac3fdc97: the architecture's
``_prepare_rep`` (``architecture/abstract_arch.py`` 67-75: each task's decoder on its own detached copy of the
encoder's output), ``AbsWeighting._compute_grad`` / ``_get_grads`` / ``_backward_new_grads`` with ``rep_grad=True``
(``weighting/abstract_weighting.py`` 56-65, 87-96, 110-114: each task's gradient of its copy, summed over the batch
for the rule, then ``rep.backward(Σ wᵢ·∇_Z Lᵢ)``), and the methods (lines named at each). 20 SGD steps, float64,
`tests.test_balancer_parity`'s net (its trunk's output is the representation) and data.
"""

from __future__ import annotations

from importlib.util import find_spec

import pytest
import torch
import torch.nn.functional as F

from tests.test_balancer_parity import (
    BASE,
    EXACT,
    LR,
    STEPS,
    TASKS,
    Net,
    _changed,
    _data,
    _largest_difference,
    _ours,
)

pytestmark = pytest.mark.skipif(find_spec("torchjd") is None, reason="the torchjd extra is not installed")
K = len(TASKS)


def _mgda_weights(grads: torch.Tensor) -> torch.Tensor:
    """LibMTL/weighting/MGDA.py lines 22-108 (``_find_min_norm_element``), as written there."""

    def _min_norm_element_from2(v1v1, v1v2, v2v2):
        if v1v2 >= v1v1:
            return 0.999, v1v1
        if v1v2 >= v2v2:
            return 0.001, v2v2
        gamma = -1.0 * ((v1v2 - v2v2) / (v1v1 + v2v2 - 2 * v1v2))
        return gamma, v2v2 + gamma * (v1v2 - v2v2)

    def _min_norm_2d(grad_mat):
        dmin = 1e8
        for i in range(grad_mat.size()[0]):
            for j in range(i + 1, grad_mat.size()[0]):
                c, d = _min_norm_element_from2(grad_mat[i, i], grad_mat[i, j], grad_mat[j, j])
                if d < dmin:
                    dmin = d
                    sol = [(i, j), c, d]
        return sol

    def _projection2simplex(y):
        m = len(y)
        sorted_y = torch.sort(y, descending=True)[0]
        tmpsum = 0.0
        tmax_f = (torch.sum(y) - 1.0) / m
        for i in range(m - 1):
            tmpsum += sorted_y[i]
            tmax = (tmpsum - 1) / (i + 1.0)
            if tmax > sorted_y[i + 1]:
                tmax_f = tmax
                break
        return torch.max(y - tmax_f, torch.zeros(m))

    def _next_point(cur_val, grad, n):
        proj_grad = grad - (torch.sum(grad) / n)
        tm1 = -1.0 * cur_val[proj_grad < 0] / proj_grad[proj_grad < 0]
        tm2 = (1.0 - cur_val[proj_grad > 0]) / (proj_grad[proj_grad > 0])
        t = torch.ones(1)
        if (tm1 > 1e-7).sum() > 0:
            t = torch.min(tm1[tm1 > 1e-7])
        if (tm2 > 1e-7).sum() > 0:
            t = torch.min(t, torch.min(tm2[tm2 > 1e-7]))
        return _projection2simplex(proj_grad * t + cur_val)

    grad_mat = grads.mm(grads.t())
    init_sol = _min_norm_2d(grad_mat)
    n = grads.size()[0]
    sol_vec = torch.zeros(n)
    sol_vec[init_sol[0][0]] = init_sol[1]
    sol_vec[init_sol[0][1]] = 1 - init_sol[1]
    for _ in range(250):  # MAX_ITER
        grad_dir = -1.0 * torch.matmul(grad_mat, sol_vec.to(grad_mat.dtype))
        new_point = _next_point(sol_vec, grad_dir, n)
        v1v1 = torch.sum(sol_vec.unsqueeze(1).repeat(1, n) * sol_vec.unsqueeze(0).repeat(n, 1) * grad_mat)
        v1v2 = torch.sum(sol_vec.unsqueeze(1).repeat(1, n) * new_point.unsqueeze(0).repeat(n, 1) * grad_mat)
        v2v2 = torch.sum(new_point.unsqueeze(1).repeat(1, n) * new_point.unsqueeze(0).repeat(n, 1) * grad_mat)
        nc, _ = _min_norm_element_from2(v1v1, v1v2, v2v2)
        new_sol_vec = nc * sol_vec + (1 - nc) * new_point
        if torch.sum(torch.abs(new_sol_vec - sol_vec)) < 1e-5:  # STOP_CRIT
            return sol_vec
        sol_vec = new_sol_vec
    return sol_vec


def _libmtl_rep_grad(method: str) -> Net:
    """LibMTL's Trainer with ``rep_grad=True`` around one method: each head on its own detached copy of the trunk's
    output, each task's backward (the heads' own gradients, the copies' gradients), the method, ``rep.backward``."""
    net, (x, y) = Net().double(), _data()
    loss_scale = torch.zeros(K, dtype=torch.float64, requires_grad=True)  # IMTL's (IMTL.py 15-16)
    optimizer = torch.optim.SGD([*net.parameters(), loss_scale], lr=LR)
    base = torch.tensor(BASE, dtype=torch.float64)
    for t in range(STEPS):
        torch.manual_seed(100 + t)
        optimizer.zero_grad()
        rep = net.trunk(x)
        rep_tasks = [rep.detach().clone().requires_grad_(True) for _ in TASKS]  # abstract_arch.py 73-75
        losses = torch.stack(
            [
                F.mse_loss(head(r).squeeze(-1), y[:, i]) * (i + 1)
                for i, (head, r) in enumerate(zip(net.heads, rep_tasks))
            ]
        )
        losses = losses * base
        if method == "imtl":  # IMTL.py 22
            losses = loss_scale.exp() * losses - loss_scale
        per_grads = torch.zeros(K, *rep.size(), dtype=rep.dtype)  # abstract_weighting.py 57-64
        for tn in range(K):
            losses[tn].backward(retain_graph=True) if (tn + 1) != K else losses[tn].backward()
            per_grads[tn] = rep_tasks[tn].grad.data.clone()
        grads = per_grads.reshape(K, rep.size()[0], -1).sum(1)  # abstract_weighting.py 90
        if method == "mgda":  # MGDA.py 124-135, mgda_gn 'none'
            weights = _mgda_weights(grads).to(rep.dtype)
        elif method == "imtl":  # IMTL.py 23-35
            grads_unit = grads / torch.norm(grads, p=2, dim=-1, keepdim=True)
            D = grads[0:1].repeat(K - 1, 1) - grads[1:]
            U = grads_unit[0:1].repeat(K - 1, 1) - grads_unit[1:]
            alpha = torch.matmul(torch.matmul(grads[0], U.t()), torch.inverse(torch.matmul(D, U.t())))
            weights = torch.cat((1 - alpha.sum().unsqueeze(0), alpha), dim=0)
        elif method == "aligned_mtl":  # Aligned_MTL.py 18-41 (torch.symeig: torch.linalg.eigh)
            M = torch.matmul(grads, grads.t())
            lmbda, V = torch.linalg.eigh(M)
            tol = torch.max(lmbda) * max(M.shape[-2:]) * torch.finfo().eps
            rank = sum(lmbda > tol)
            order = torch.argsort(lmbda, dim=-1, descending=True)
            lmbda, V = lmbda[order][:rank], V[:, order][:, :rank]
            B = lmbda[-1].sqrt() * ((V @ torch.diag(1 / lmbda.sqrt())) @ V.t())
            weights = B.sum(0)
        if method == "graddrop":  # GradDrop.py 25-49, leak 0.0
            leak = 0.0
            inputs = rep.unsqueeze(0).repeat_interleave(K, dim=0)
            signed = (per_grads * inputs.sign()).sum(1)
            P = 0.5 * (1 + signed.sum(0) / (signed.abs().sum(0) + 1e-7))
            U = torch.rand_like(P)
            M = P.gt(U).unsqueeze(0).repeat_interleave(K, dim=0) * signed.gt(0) + P.lt(U).unsqueeze(
                0
            ).repeat_interleave(K, dim=0) * signed.lt(0)
            M = M.unsqueeze(1).repeat_interleave(per_grads.size()[1], dim=1)
            rep.backward((per_grads * (leak + (1 - leak) * M)).sum(0))
        else:  # _backward_new_grads (abstract_weighting.py 110-114)
            rep.backward(sum([weights[i] * per_grads[i] for i in range(K)]))
        optimizer.step()
    return net


def _ours_rep_grad(method: str, rep_grad: str = "batch", libmtl: bool = True) -> Net:
    from multiloss.balancers.build import build_balancer
    from tests.test_balancer_parity import _spec

    extra = ["model.balancer.convention=libmtl"] if libmtl and method in ("aligned_mtl", "mgda") else []
    spec = _spec(method, f"model.balancer.rep_grad={rep_grad}", *extra)
    return _ours(lambda net: build_balancer(spec, TASKS, BASE, net, "model.balancer"))


@pytest.mark.parametrize("method", ["mgda", "imtl", "aligned_mtl", "graddrop"])
def test_rep_grad_is_libmtls_rep_grad(method):
    """Equal to rounding (measured ≤ 3.3e-16). MGDA: LibMTL's Frank-Wolfe solver (its 1e-5 stop, its weights in the
    default dtype) runs on both sides (``convention=libmtl``: `min_norm.libmtl_min_norm`) on the same Gramian, so its
    stopping short of the exact point is the same on both: no solver gap. Aligned-MTL: float32's ε in the rank cut on
    both sides, as LibMTL writes it."""
    ours, reference = _ours_rep_grad(method), _libmtl_rep_grad(method)
    worst = _largest_difference(ours, reference)
    print(f"{method}: rep_grad, largest weight difference to LibMTL {worst:.2g}")
    assert _changed(ours) and worst <= EXACT


def _reference_samples_mgda() -> Net:
    """MGDA-UB as Sener & Koltun's code runs it: the minimum-norm point of every sample's representation gradient
    (the tasks' ∇_Z Lᵢ flattened over the batch), applied as ``rep.backward(Σ αᵢ ∇_Z Lᵢ)`` — the exact point here
    (`MinNormWeighting`), on the LibMTL-shaped harness above."""
    from multiloss.balancers.min_norm import MinNormWeighting

    net, (x, y) = Net().double(), _data()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    base = torch.tensor(BASE, dtype=torch.float64)
    for _ in range(STEPS):
        optimizer.zero_grad()
        rep = net.trunk(x)
        copies = [rep.detach().clone().requires_grad_(True) for _ in TASKS]
        losses = torch.stack(
            [F.mse_loss(head(r).squeeze(-1), y[:, i]) * (i + 1) for i, (head, r) in enumerate(zip(net.heads, copies))]
        )
        (losses * base).sum().backward()  # each head its own task's gradient, each copy its task's ∇_Z
        per = torch.stack([c.grad for c in copies])
        flat = per.reshape(K, -1)
        alpha = MinNormWeighting()(flat @ flat.T)
        rep.backward((alpha.view(-1, 1, 1) * per).sum(0))
        optimizer.step()
    return net


def test_rep_grad_samples_is_mgda_ub_on_every_samples_representation_gradient():
    ours, reference = _ours_rep_grad("mgda", "samples", libmtl=False), _reference_samples_mgda()
    assert _changed(ours) and _largest_difference(ours, reference) <= EXACT  # quadprog on both sides: measured 0
    batch = _ours_rep_grad("mgda", "batch", libmtl=False)
    assert _largest_difference(ours, batch) > 1e-4  # the batch's sum: another rule


@pytest.mark.parametrize(
    ("overrides", "key", "value"),
    [
        (("balancer=upgrad", "model.balancer.rep_grad=encoder"), "model.balancer.rep_grad", "encoder"),
        (
            ("balancer=upgrad", "model.balancer.rep_grad=batch", "model.balancer.shared=[trunk]"),
            "model.balancer.shared",
            ["trunk"],
        ),
        (("balancer=graddrop", "model.balancer.rep_grad=samples"), "model.balancer.rep_grad", "samples"),
        (("balancer=config", "model.balancer.rep_grad=batch"), "model.balancer.rep_grad", "batch"),
        (
            ("balancer=nash_mtl", "model.balancer.rep_grad=samples", "model.balancer.scope=global"),
            "model.balancer.rep_grad",
            "samples",
        ),
    ],
)
def test_a_rep_grad_the_rule_cannot_run_is_refused_by_key(tmp_path, overrides, key, value):
    from multiloss import testing
    from multiloss.config import ConfigError

    cfg = testing.compose("recipe=weighted", *overrides, output_dir=tmp_path)
    with pytest.raises(ConfigError) as err:
        testing.build(cfg)
    assert (err.value.key, err.value.value) == (key, value)


@pytest.mark.parametrize("name", ["mgda", "pcgrad", "graddrop", "nash_mtl"])
def test_rep_grad_trains_the_recipe_and_costs_no_parameter_gradient(tmp_path, name):
    """``recipe=weighted balancer=<m> model.balancer.rep_grad=batch`` through the real Trainer: the representation is
    the trunk's output, found; the rule never takes a parameter's gradient (one backward through the heads, then
    one), and the run resumes from its checkpoint to the straight run's weights."""
    from multiloss import testing, train
    from tests.conftest import QUIET

    short = (*QUIET, "~callbacks.loss_curves", "trainer=cpu", "trainer.num_sanity_val_steps=0")
    common = ("recipe=weighted", f"balancer={name}", "model.balancer.rep_grad=batch")
    train(testing.compose(*short, *common, "trainer.max_steps=4", output_dir=tmp_path / "straight"))
    train(testing.compose(*short, *common, "trainer.max_steps=2", output_dir=tmp_path / "split"))
    last = tmp_path / "split/checkpoints/last.ckpt"
    train(testing.compose(*short, *common, "trainer.max_steps=4", f"ckpt_path={last}", output_dir=tmp_path / "split"))
    straight, split = (
        torch.load(tmp_path / f"{d}/checkpoints/last.ckpt", weights_only=False)["state_dict"]
        for d in ("straight", "split")
    )
    floats = [k for k, v in straight.items() if isinstance(v, torch.Tensor) and v.is_floating_point()]
    assert floats and max(float((straight[k] - split[k]).abs().max()) for k in floats) == 0.0


# --- GradNorm as LibMTL writes it (convention=libmtl), on the parameters and on the representation ------------------

EPOCHS, PER_EPOCH = 3, 5


def _libmtl_gradnorm(rep_grad: bool) -> Net:
    """LibMTL/weighting/GradNorm.py 21-50 (alpha 1.5) as its Trainer runs it: ``loss_scale`` in the optimizer, its
    epochs (``self.epoch``), ``train_loss_buffer[:, 0]`` the first epoch's mean losses (trainer.py 286: the meter's
    average; equal batches here), the heads' own gradients from ``_compute_grad``; on the parameters
    (``_backward_new_grads(grads=...)``) or the representation (``rep_grad=True``). One line differs, marked: with
    ``rep_grad`` LibMTL's first epoch backwards ``losses.sum()`` into the heads' detached copies of the representation
    only, so its encoder does not train for that epoch; here it gets the copies' summed gradient (weight 1)."""
    net, (x, y) = Net().double(), _data()
    loss_scale = torch.nn.Parameter(torch.tensor([1.0] * K, dtype=torch.float64))  # init_param
    optimizer = torch.optim.SGD([*net.parameters(), loss_scale], lr=LR)
    base = torch.tensor(BASE, dtype=torch.float64)
    train_loss_buffer = torch.zeros(K, EPOCHS, dtype=torch.float64)
    alpha = 1.5
    for epoch in range(EPOCHS):
        epoch_losses = []
        for _ in range(PER_EPOCH):
            optimizer.zero_grad()
            rep = net.trunk(x)
            inputs = [rep.detach().clone().requires_grad_(True) for _ in TASKS] if rep_grad else [rep] * K
            losses = torch.stack(
                [
                    F.mse_loss(head(r).squeeze(-1), y[:, i]) * (i + 1)
                    for i, (head, r) in enumerate(zip(net.heads, inputs))
                ]
            )
            losses = losses * base
            epoch_losses.append(losses.detach())
            if epoch >= 1:
                scale = K * F.softmax(loss_scale, dim=-1)
                if rep_grad:  # _compute_grad(rep_grad=True) and _get_grads' batch sum
                    per_grads = torch.zeros(K, *rep.size(), dtype=rep.dtype)
                    for tn in range(K):
                        losses[tn].backward(retain_graph=True)
                        per_grads[tn] = inputs[tn].grad.data.clone()
                    grads = per_grads.reshape(K, rep.size()[0], -1).sum(1)
                else:  # _compute_grad(mode='backward'): each task's shared gradient, the heads accumulating
                    grads = torch.zeros(K, sum(p.numel() for p in net.trunk.parameters()), dtype=torch.float64)
                    for tn in range(K):
                        losses[tn].backward(retain_graph=True)
                        grads[tn] = torch.cat([p.grad.view(-1) for p in net.trunk.parameters()])
                        for p in net.trunk.parameters():
                            p.grad.zero_()
                G_per_loss = torch.norm(scale.unsqueeze(1) * grads, p=2, dim=-1)
                G = G_per_loss.mean(0)
                L_i = torch.tensor([losses[tn].item() / train_loss_buffer[tn, 0] for tn in range(K)])
                r_i = L_i / L_i.mean()
                constant_term = (G * (r_i**alpha)).detach()
                L_grad = (G_per_loss - constant_term).abs().sum(0)
                L_grad.backward()
                weight = scale.detach().clone()
                if rep_grad:
                    rep.backward(sum(weight[i] * per_grads[i] for i in range(K)))
                else:
                    new = sum(weight[i] * grads[i] for i in range(K))
                    offset = 0
                    for p in net.trunk.parameters():
                        p.grad.data = new[offset : offset + p.numel()].view(p.size()).clone()
                        offset += p.numel()
            else:
                losses.sum().backward()
                if rep_grad:  # LibMTL's first epoch stops at the detached copies: the encoder would not train
                    rep.backward(sum(r.grad for r in inputs))  # the one line that differs (docs/balancers.md)
            optimizer.step()
        train_loss_buffer[:, epoch] = torch.stack(epoch_losses).mean(0)
    return net


def _ours_gradnorm(rep_grad: bool, gramian: str = "layers") -> Net:
    from multiloss.balancers.build import build_balancer
    from multiloss.testing import balancer_backward
    from tests.test_balancer_parity import _losses, _spec

    extra = ["model.balancer.rep_grad=batch"] if rep_grad else [f"model.balancer.gramian={gramian}"]
    spec = _spec("gradnorm", "model.balancer.convention=libmtl", *extra)
    net, (x, y) = Net().double(), _data()
    balancer = build_balancer(spec, TASKS, BASE, net, "model.balancer").double()
    optimizer = torch.optim.SGD([*net.parameters(), *balancer.parameters()], lr=LR)
    for epoch in range(EPOCHS):
        for _ in range(PER_EPOCH):
            optimizer.zero_grad()
            balancer_backward(balancer, dict(zip(TASKS, _losses(net, x, y)[1])), net, epoch=epoch)
            optimizer.step()
    return net


@pytest.mark.parametrize("way", ["rep_grad", "layers", "gradients"])
def test_gradnorm_convention_libmtl_is_libmtls_gradnorm(way):
    ours = _ours_gradnorm(way == "rep_grad", "gradients" if way == "gradients" else "layers")
    reference = _libmtl_gradnorm(way == "rep_grad")
    worst = _largest_difference(ours, reference)
    print(f"gradnorm ({way}): largest weight difference to LibMTL {worst:.2g}")
    assert _changed(ours) and worst <= EXACT  # measured ≤ 4.4e-16
