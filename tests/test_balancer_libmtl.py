"""``model.balancer.convention=libmtl``: the methods whose update LibMTL writes otherwise than torchjd equal LibMTL's
own code, its classes run as its Trainer runs them (the heads' gradients included), 20 SGD steps in float64.

LibMTL transcribed from median-research-group/LibMTL at 4336804847eaa5e0b924b743d76beec7ac3fdc97 (the lines named
at each method), on `tests.test_balancer_parity`'s net, data and AbsWeighting plumbing (`_LibMTL`). CAGrad's QP is
solved by scipy's SLSQP there and by cvxpy's Clarabel in torchjd: 20 steps end 5e-9 apart.
"""

from __future__ import annotations

from importlib.util import find_spec

import numpy as np
import pytest
import torch

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
    _LibMTL,
    _losses,
    _ours,
)

pytestmark = pytest.mark.skipif(find_spec("torchjd") is None, reason="the torchjd extra is not installed")
K = len(TASKS)


def _autograd_grads(lib: _LibMTL, losses: list[torch.Tensor]) -> torch.Tensor:
    """AbsWeighting._compute_grad(mode='autograd') (abstract_weighting.py 50-52): each task's shared gradient."""
    grads = torch.zeros(K, lib.grad_dim, dtype=torch.float64)
    for tn in range(K):
        grad = list(torch.autograd.grad(losses[tn], list(lib.net.trunk.parameters()), retain_graph=True))
        grads[tn] = torch.cat([g.view(-1) for g in grad])
    return grads


def _libmtl_cagrad(grads: torch.Tensor, calpha: float, rescale: int) -> torch.Tensor:
    """LibMTL/weighting/CAGrad.py lines 45-60 (the update from the K × n task gradients), as written there."""
    from scipy.optimize import minimize

    GG = torch.matmul(grads, grads.t()).cpu()
    g0_norm = (GG.mean() + 1e-8).sqrt()
    x_start = np.ones(len(grads)) / len(grads)
    bnds = tuple((0, 1) for _ in x_start)
    cons = {"type": "eq", "fun": lambda w: 1 - sum(w)}
    A, b, c = GG.numpy(), x_start.copy(), (calpha * g0_norm + 1e-8).item()

    def objfn(w):
        return (
            w.reshape(1, -1).dot(A).dot(b.reshape(-1, 1))
            + c * np.sqrt(w.reshape(1, -1).dot(A).dot(w.reshape(-1, 1)) + 1e-8)
        ).sum()

    ww = torch.tensor(minimize(objfn, x_start, bounds=bnds, constraints=cons).x, dtype=grads.dtype)
    gw = (grads * ww.view(-1, 1)).sum(0)
    g = grads.mean(0) + c / (gw.norm() + 1e-8) * gw
    return g / (1 + calpha**2) if rescale == 1 else g


class _NashMTL:
    """LibMTL/weighting/Nash_MTL.py lines 28-100 (init_param, _stop_criteria, solve_optimization,
    _calc_phi_alpha_linearization, _init_optim_problem), as written there."""

    def __init__(self, optim_niter: int = 20) -> None:
        self.optim_niter, self.task_num = optim_niter, K
        self.step = 0
        self.prvs_alpha_param = None
        self.init_gtg = np.eye(self.task_num)
        self.prvs_alpha = np.ones(self.task_num, dtype=np.float32)
        self.normalization_factor = np.ones((1,))

    def _stop_criteria(self, gtg, alpha_t):
        return (
            (self.alpha_param.value is None)
            or (np.linalg.norm(gtg @ alpha_t - 1 / (alpha_t + 1e-10)) < 1e-3)
            or (np.linalg.norm(self.alpha_param.value - self.prvs_alpha_param.value) < 1e-6)
        )

    def solve_optimization(self, gtg):
        import cvxpy as cp

        self.G_param.value = gtg
        self.normalization_factor_param.value = self.normalization_factor
        alpha_t = self.prvs_alpha
        for _ in range(self.optim_niter):
            self.alpha_param.value = alpha_t
            self.prvs_alpha_param.value = alpha_t
            try:
                self.prob.solve(solver=cp.ECOS, warm_start=True, max_iters=100)
            except Exception:  # LibMTL: a bare except
                self.alpha_param.value = self.prvs_alpha_param.value
            if self._stop_criteria(gtg, alpha_t):
                break
            alpha_t = self.alpha_param.value
        if alpha_t is not None:
            self.prvs_alpha = alpha_t
        return self.prvs_alpha

    def _init_optim_problem(self):
        import cvxpy as cp

        self.alpha_param = cp.Variable(shape=(self.task_num,), nonneg=True)
        self.prvs_alpha_param = cp.Parameter(shape=(self.task_num,), value=self.prvs_alpha)
        self.G_param = cp.Parameter(shape=(self.task_num, self.task_num), value=self.init_gtg)
        self.normalization_factor_param = cp.Parameter(shape=(1,), value=np.array([1.0]))
        G_prvs_alpha = self.G_param @ self.prvs_alpha_param
        prvs_phi_tag = 1 / self.prvs_alpha_param + (1 / G_prvs_alpha) @ self.G_param
        self.phi_alpha = prvs_phi_tag @ (self.alpha_param - self.prvs_alpha_param)
        G_alpha = self.G_param @ self.alpha_param
        constraint = [
            -cp.log(self.alpha_param[i] * self.normalization_factor_param) - cp.log(G_alpha[i]) <= 0
            for i in range(self.task_num)
        ]
        self.prob = cp.Problem(
            cp.Minimize(cp.sum(G_alpha) + self.phi_alpha / self.normalization_factor_param), constraint
        )


class _ExcessMTL:
    """LibMTL/weighting/ExcessMTL.py lines 14-52 (init_param, backward: the official yifei-he/ExcessMTL's rule)."""

    def __init__(self, robust_step_size: float = 1e-2) -> None:
        self.robust_step_size, self.task_num = robust_step_size, K
        self.loss_weight = torch.tensor([1.0] * self.task_num, dtype=torch.float64, requires_grad=False)
        self.grad_sum = None
        self.first_epoch = True

    def weights(self, grads: torch.Tensor) -> torch.Tensor:
        if self.grad_sum is None:
            self.grad_sum = torch.zeros_like(grads)
        w = torch.zeros(self.task_num, dtype=torch.float64)
        for i in range(self.task_num):
            self.grad_sum[i] += grads[i] ** 2
            grad_i = grads[i]
            h_i = torch.sqrt(self.grad_sum[i] + 1e-7)
            w[i] = grad_i * (1 / h_i) @ grad_i.t()
        if self.first_epoch:
            self.initial_w = w
            self.first_epoch = False
        else:
            w = w / self.initial_w
            self.loss_weight = self.loss_weight * torch.exp(w * self.robust_step_size)
            self.loss_weight = self.loss_weight / self.loss_weight.sum() * self.task_num
            self.loss_weight = self.loss_weight.detach().clone()
        return self.loss_weight

    def backward(self, losses: torch.Tensor, grads: torch.Tensor) -> None:
        loss = torch.mul(losses, self.weights(grads)).sum()
        loss.backward()


def _libmtl_run(method: str) -> Net:
    """LibMTL's Trainer around one method: zero_grad, the weighted losses (cᵢLᵢ), ``weighting.backward``, SGD step."""
    from scipy.optimize import least_squares

    net = Net().double()
    x, y = _data()
    lib = _LibMTL(net)
    base = torch.tensor(BASE, dtype=torch.float64)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    nash = _NashMTL()
    excess = _ExcessMTL()
    for t in range(STEPS):
        torch.manual_seed(100 + t)
        optimizer.zero_grad()
        losses = torch.stack(_losses(net, x, y)[1]) * base
        if method == "aligned_mtl":  # Aligned_MTL.py 18-41 (torch.symeig, gone from torch, is torch.linalg.eigh)
            grads = lib.compute_grad(losses)
            M = torch.matmul(grads, grads.t())
            lmbda, V = torch.linalg.eigh(M)
            tol = torch.max(lmbda) * max(M.shape[-2:]) * torch.finfo().eps
            rank = sum(lmbda > tol)
            order = torch.argsort(lmbda, dim=-1, descending=True)
            lmbda, V = lmbda[order][:rank], V[:, order][:, :rank]
            sigma = torch.diag(1 / lmbda.sqrt())
            B = lmbda[-1].sqrt() * ((V @ sigma) @ V.t())
            alpha = B.sum(0)
            lib.reset_grad(
                sum([alpha[i] * grads[i] for i in range(K)])
            )  # _backward_new_grads (abstract_weighting.py 102-122)
        elif method == "cagrad":  # CAGrad.py 27-64, calpha 0.5, rescale 1 (LibMTL's defaults)
            lib.reset_grad(_libmtl_cagrad(lib.compute_grad(losses), calpha=0.5, rescale=1))
        elif method == "fairgrad":  # FairGrad.py 19-41, alpha 1
            grads = _autograd_grads(lib, list(losses))
            A = torch.mm(grads, grads.t()).data.cpu().numpy()
            res = least_squares(
                lambda w, A=A: np.dot(A, w) - np.power(1 / w, 1 / 1.0), np.ones(K) / K, bounds=(0, np.inf)
            )
            # ``torch.Tensor(w_cpu)``: torch's default dtype, float64 in a float64 run (Lightning's 64-true sets it);
            # float32 here would round the weights every step (the nets then end 1.9e-9 apart).
            torch.sum(torch.tensor(res.x, dtype=torch.float64) * losses).backward()
        elif method == "mgda":  # MGDA.py 124-135, mgda_gn 'none'; its solver: tests.test_balancer_rep_grad
            from tests.test_balancer_rep_grad import _mgda_weights

            grads = lib.compute_grad(losses)
            sol = _mgda_weights(grads).to(grads.dtype)
            lib.reset_grad(sum([sol[i] * grads[i] for i in range(K)]))
        elif method == "excess_mtl":  # ExcessMTL.py 19-52 (robust_step_size 1e-2: config.py 69)
            grads = _autograd_grads(lib, list(losses))
            excess.backward(losses, grads)
        else:  # nash_mtl: Nash_MTL.py 102-133, update_weights_every 1, optim_niter 20, max_norm 1
            if nash.step == 0:
                nash._init_optim_problem()
            nash.step += 1
            grads = _autograd_grads(lib, list(losses))
            GTG = torch.mm(grads, grads.t())
            nash.normalization_factor = torch.norm(GTG).detach().cpu().numpy().reshape((1,))
            alpha = nash.solve_optimization((GTG / nash.normalization_factor.item()).cpu().detach().numpy())
            torch.sum(torch.from_numpy(alpha).to(torch.float32) * losses).backward()
            torch.nn.utils.clip_grad_norm_(list(net.trunk.parameters()), 1.0)
        optimizer.step()
    return net


def _ours_libmtl(method: str, gramian: str = "layers") -> Net:
    import torchjd.aggregation as aggregation

    from multiloss.balancers import JacobianDescent

    make = {
        "aligned_mtl": lambda: aggregation.AlignedMTL(),
        "cagrad": lambda: aggregation.CAGrad(c=0.5),
        "fairgrad": lambda: aggregation.FairGrad(alpha=1.0),
        "nash_mtl": lambda: aggregation.NashMTL(n_tasks=K, max_norm=1.0, update_weights_every=1, optim_niter=20),
        "excess_mtl": lambda: __import__("multiloss.balancers.excess_mtl").balancers.excess_mtl.ExcessMTL(),
        "mgda": lambda: __import__("multiloss.balancers.min_norm").balancers.min_norm.exact_mgda(),
    }[method]
    return _ours(lambda net: JacobianDescent(TASKS, BASE, make(), net=net, gramian=gramian, convention="libmtl"))


# Where LibMTL's code does not reach the update ours does to rounding: the solver differs, or LibMTL rounds to float32.
# Every other method is equal to rounding (`EXACT`): measured ≤ 1e-15 (aligned_mtl 0, fairgrad 1.8e-15, excess_mtl
# 9.8e-16, mgda 0: LibMTL's own Frank-Wolfe, its 1e-5 stop included, on both sides: `min_norm.libmtl_min_norm`).
SOLVER_GAP = {
    # CAGrad's QP: scipy's SLSQP in LibMTL (default ftol 1e-6, on the objective), cvxpy's Clarabel in torchjd (gap
    # tolerances 1e-8). Each step's weights are each solver's optimum only to its own tolerance, not to rounding.
    # Measured 4.6e-9 after 20 steps; the bound is SLSQP's ftol (200 times the gap measured).
    "cagrad": 1e-6,
    # Nash-MTL: ECOS (max_iters 100, tolerances 1e-8) on both sides, but LibMTL rounds its weights to float32
    # (Nash_MTL.py's backward: ``torch.from_numpy(alpha).to(torch.float32)``, 2^-24 relative a step). Measured 5.1e-9;
    # 1.4e-9 with LibMTL's α kept in float64 (the interior point's stop on Gramians equal to rounding). Bound 1e-6:
    # 200 times the gap measured, above 20 steps × lr 0.05 × 2^-24 on the clipped (norm ≤ 1) update.
    "nash_mtl": 1e-6,
}


@pytest.mark.parametrize("gramian", ["layers", "gradients"])  # the Gramian layer by layer, or the K gradients
@pytest.mark.parametrize("method", ["aligned_mtl", "cagrad", "fairgrad", "nash_mtl", "excess_mtl", "mgda"])
def test_convention_libmtl_is_libmtls_code(method, gramian):
    ours, reference = _ours_libmtl(method, gramian), _libmtl_run(method)
    worst = _largest_difference(ours, reference)
    print(f"{method}: largest weight difference to LibMTL {worst:.2g}")
    assert _changed(ours) and worst <= SOLVER_GAP.get(method, EXACT)


def test_the_torchjd_convention_is_not_libmtls_where_the_two_differ():
    """The default stays torchjd's (the parity tests of test_balancer_parity): LibMTL's convention is another update."""
    import torchjd.aggregation as aggregation

    from multiloss.balancers import JacobianDescent

    torchjd_run = _ours(lambda net: JacobianDescent(TASKS, BASE, aggregation.AlignedMTL(), net=net))
    assert _largest_difference(torchjd_run, _libmtl_run("aligned_mtl")) > 1e-3


def test_excess_mtls_default_weights_are_the_official_codes_over_k():
    """``balancer=excess_mtl``'s weighting as shipped (its yaml: robust_step_size 1e-2, the official first step) gives
    the official code's weights divided by K (torchjd's simplex) at every call — uniform at the first, where torchjd's
    own updates from the raw excess (kept by ``update_first_step=true``)."""
    import torchjd.aggregation
    from hydra.utils import instantiate

    from tests.test_balancer_parity import _spec

    ours = instantiate(_spec("excess_mtl")["aggregator"]).weighting
    official, torchjd_first = _ExcessMTL(), torchjd.aggregation.ExcessMTL(robust_step_size=1e-2).weighting
    g = torch.Generator().manual_seed(0)
    for call in range(6):
        grads = torch.randn(K, 40, generator=g, dtype=torch.float64) * torch.tensor([[1.0], [3.0], [0.2]])
        mine, theirs = ours(grads), official.weights(grads) / K
        assert (mine - theirs).abs().max() <= 1e-12, call
        if call == 0:
            assert torch.equal(mine, torch.full((K,), 1 / K, dtype=torch.float64))
            assert (torchjd_first(grads) - mine).abs().max() > 1e-3  # torchjd's first call moves them
    assert (mine - 1 / K).abs().max() > 1e-4  # and they did move after the first call


# --- STCH: LibMTL's warm-up, nadir and scalarization (epochs: 1 warm-up, the nadir's, 2 after; 5 steps each) --------

EPOCHS, PER_EPOCH = 4, 5


class _STCH:
    """LibMTL/weighting/STCH.py lines 18-55 (init_param, backward), STCH_mu 1.0, STCH_warmup_epoch 1; ``epoch`` set by
    the Trainer (trainer.py: ``self.model.epoch = epoch``)."""

    def __init__(self, mu: float = 1.0, warmup_epoch: int = 1) -> None:
        self.mu, self.warmup_epoch, self.task_num, self.epoch = mu, warmup_epoch, K, 0
        self.step = 0
        self.nadir_vector = None
        self.average_loss = 0.0
        self.average_loss_count = 0

    def backward(self, losses: torch.Tensor) -> None:
        self.step += 1
        mu, warmup_epoch = self.mu, self.warmup_epoch
        if self.epoch < warmup_epoch:
            loss = torch.mul(torch.log(losses + 1e-20), torch.ones_like(losses)).sum()
            loss.backward()
        elif self.epoch == warmup_epoch:
            loss = torch.mul(torch.log(losses + 1e-20), torch.ones_like(losses)).sum()
            self.average_loss += losses.detach()
            self.average_loss_count += 1
            loss.backward()
        else:
            if self.nadir_vector is None:
                self.nadir_vector = self.average_loss / self.average_loss_count
            losses = torch.log(losses / self.nadir_vector + 1e-20)
            max_term = torch.max(losses.data).detach()
            reg_losses = losses - max_term
            loss = mu * torch.log(torch.sum(torch.exp(reg_losses / mu))) * self.task_num
            loss.backward()


def _stch_libmtl() -> Net:
    net, (x, y) = Net().double(), _data()
    optimizer, stch = torch.optim.SGD(net.parameters(), lr=LR), _STCH()
    base = torch.tensor(BASE, dtype=torch.float64)
    for epoch in range(EPOCHS):
        stch.epoch = epoch
        for _ in range(PER_EPOCH):
            optimizer.zero_grad()
            stch.backward(torch.stack(_losses(net, x, y)[1]) * base)
            optimizer.step()
    return net


def _stch_ours(epochs: range, net: Net | None = None, balancer=None):
    import functools

    import torchjd.scalarization

    from multiloss.balancers import Scalarized
    from multiloss.testing import balancer_backward

    net = net or Net().double()
    if balancer is None:
        stch = functools.partial(torchjd.scalarization.STCH, mu=1.0)
        balancer = Scalarized(TASKS, BASE, stch, convention="libmtl", warmup_epochs=1).double()
    x, y = _data()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    for epoch in epochs:
        for _ in range(PER_EPOCH):
            optimizer.zero_grad()
            balancer_backward(balancer, dict(zip(TASKS, _losses(net, x, y)[1])), net, epoch=epoch)
            optimizer.step()
    return net, balancer


def test_stch_convention_libmtl_is_libmtls_code_through_its_warm_up_and_nadir():
    ours, _ = _stch_ours(range(EPOCHS))
    reference = _stch_libmtl()
    worst = _largest_difference(ours, reference)
    print(f"stch: largest weight difference to LibMTL {worst:.2g}")
    assert _changed(ours) and worst <= EXACT  # measured 1.1e-16
    from multiloss.balancers import Scalarized
    from tests.test_balancer_parity import SCALARIZERS

    torchjd_default, _ = _stch_ours(range(EPOCHS), balancer=Scalarized(TASKS, BASE, SCALARIZERS["stch"]()).double())
    assert _largest_difference(torchjd_default, reference) > 1e-3  # the default is torchjd's: another update


def test_stch_libmtls_nadir_resumes_from_the_checkpointed_state():
    """Two epochs (the warm-up and the nadir's), the net's and balancer's state saved and loaded into new ones, two
    more: the straight run's weights to the bit."""
    import copy

    straight, _ = _stch_ours(range(EPOCHS))
    first, balancer = _stch_ours(range(2))
    saved = copy.deepcopy({"net": first.state_dict(), "balancer": balancer.state_dict()})
    assert float(saved["balancer"]["scalarizer.loss_count"]) == PER_EPOCH
    net, again = Net().double(), copy.deepcopy(balancer)
    again.scalarizer.loss_sum.zero_(), again.scalarizer.loss_count.zero_()
    net.load_state_dict(saved["net"]), again.load_state_dict(saved["balancer"])
    resumed, _ = _stch_ours(range(2, EPOCHS), net, again)
    assert _largest_difference(resumed, straight) == 0.0


# --- SDMGrad and MoDo: three draws a step (LibMTL's trainer.py 256: three batches for these two) ---------------------


def _three_draws(net: Net, x: torch.Tensor, y: torch.Tensor) -> list[list[torch.Tensor]]:
    """The batch in three parts (the recipe's `MultiTaskRecipe.draws`: ``torch.tensor_split``), each part's losses."""
    return [_losses(net, xs, ys)[1] for xs, ys in zip(torch.tensor_split(x, 3), torch.tensor_split(y, 3))]


def _libmtl_draws(method: str) -> Net:
    """LibMTL's SDMGrad.py 23-60 (SDMGrad_lamda 0.3, SDMGrad_niter 20; its inner SGD lr 5, momentum 0.5) and MoDo.py
    22-60 (MoDo_gamma 1e-3, MoDo_rho 0.1), as its Trainer runs them on three draws: ``_get_grads(losses[i],
    mode='backward')`` for each (the heads accumulate every draw's gradient), the rule, ``_reset_grad``. Its weights
    start in the gradients' dtype here (LibMTL's ``torch.ones`` is float32, which ``torch.mv`` refuses beside float64
    gradients)."""
    import numpy as np

    net, (x, y) = Net().double(), _data()
    lib = _LibMTL(net)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    base = torch.tensor(BASE, dtype=torch.float64)
    state = torch.full((K,), 1 / K, dtype=torch.float64)  # SDMGrad's w, MoDo's lambd (init_param)

    def euclidean_proj_simplex(v, s=1):  # SDMGrad.py 26-36
        v = v.astype(np.float64)
        (n,) = v.shape
        if v.sum() == s and np.all(v >= 0):
            return v
        u = np.sort(v)[::-1]
        cssv = np.cumsum(u)
        rho = np.nonzero(u * np.arange(1, n + 1) > (cssv - s))[0][-1]
        theta = float(cssv[rho] - s) / (rho + 1)
        return (v - theta).clip(min=0)

    def projection2simplex(y):  # MoDo.py 25-35
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
        return torch.max(y - tmax_f, torch.zeros(m, dtype=y.dtype))

    for _ in range(STEPS):
        optimizer.zero_grad()
        losses = [torch.stack(draw) * base for draw in _three_draws(net, x, y)]
        grads = [lib.compute_grad(losses[i], retain_last=True) for i in range(3)]
        if method == "sdmgrad":
            lamda, niter = 0.3, 20
            zeta_grads, xi_grads1, xi_grads2 = grads
            GG = torch.mm(xi_grads1, xi_grads2.t())
            GG_diag = torch.diag(GG)
            GG_diag = torch.where(GG_diag < 0, torch.zeros_like(GG_diag), GG_diag)
            scale = torch.mean(torch.sqrt(GG_diag))
            GG = GG / (scale.pow(2) + 1e-8)
            Gg = torch.mean(GG, dim=1)
            w = state.clone().requires_grad_(True)
            inner = torch.optim.SGD([w], lr=5, momentum=0.5)
            for _ in range(niter):
                inner.zero_grad()
                w.grad = torch.mv(GG, w.detach()) + lamda * Gg
                inner.step()
                w.data.copy_(torch.from_numpy(euclidean_proj_simplex(w.data.cpu().numpy())).data)
            state = w.detach()
            g0 = torch.mean(zeta_grads, dim=0)
            gw = (zeta_grads * state.view(-1, 1)).sum(0)
            lib.reset_grad((gw + lamda * g0) / (1 + lamda))
        else:
            gamma, rho = 1e-3, 0.1
            stacked = torch.stack(grads)
            for head in net.heads:  # MoDo.py 52-55: the decoders' gradients of the three draws, averaged
                for p in head.parameters():
                    p.grad.data = p.grad.data / 3
            state = projection2simplex(
                state - gamma * (stacked[0] @ (torch.transpose(stacked[1], 0, 1) @ state) + rho * state)
            )
            lib.reset_grad(sum(state[i] * stacked[2][i] for i in range(K)))
        optimizer.step()
    return net


def _ours_draws(method: str) -> Net:
    from multiloss.balancers.build import build_balancer
    from multiloss.testing import balancer_backward
    from tests.test_balancer_parity import _spec

    net, (x, y) = Net().double(), _data()
    balancer = build_balancer(_spec(method), TASKS, BASE, net, "model.balancer").double()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    for _ in range(STEPS):
        optimizer.zero_grad()
        balancer_backward(balancer, [dict(zip(TASKS, draw)) for draw in _three_draws(net, x, y)], net)
        optimizer.step()
    return net


@pytest.mark.parametrize("method", ["sdmgrad", "modo"])
def test_sdmgrad_and_modo_are_libmtls_code_on_three_draws(method):
    ours, reference = _ours_draws(method), _libmtl_draws(method)
    worst = _largest_difference(ours, reference)
    print(f"{method}: largest weight difference to LibMTL {worst:.2g}")
    assert _changed(ours) and worst <= EXACT  # measured ≤ 4.4e-16


@pytest.mark.parametrize("name", ["sdmgrad", "modo"])
def test_three_draw_rules_train_the_recipes_and_resume_exactly(tmp_path, name):
    """``recipe=weighted balancer=<m>`` (and multihead) through the real Trainer: the batch split in three draws each
    step, the weighting's state in the checkpoint — 2 + 2 steps resumed equal 4 straight, to the bit."""
    from multiloss import testing, train
    from tests.conftest import QUIET

    short = (*QUIET, "~callbacks.loss_curves", "trainer=cpu", "trainer.num_sanity_val_steps=0")
    runs = {}
    for recipe in ("weighted", "multihead"):
        common = (f"recipe={recipe}", f"balancer={name}")
        straight, split = tmp_path / recipe / "straight", tmp_path / recipe / "split"
        train(testing.compose(*short, *common, "trainer.max_steps=4", output_dir=straight))
        train(testing.compose(*short, *common, "trainer.max_steps=2", output_dir=split))
        last = split / "checkpoints/last.ckpt"
        train(testing.compose(*short, *common, "trainer.max_steps=4", f"ckpt_path={last}", output_dir=split))
        a, b = (torch.load(d / "checkpoints/last.ckpt", weights_only=False)["state_dict"] for d in (straight, split))
        floats = [k for k, v in a.items() if isinstance(v, torch.Tensor) and v.is_floating_point()]
        runs[recipe] = max(float((a[k] - b[k]).abs().max()) for k in floats)
    assert runs == {"weighted": 0.0, "multihead": 0.0}


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (("data.batch_size=2",), "data.batch_size"),
        (("data.batch_size=1436", "data.val_fraction=0.2"), "data.drop_last"),
    ],
)
def test_a_batch_too_small_for_three_draws_is_refused_before_anything_is_written(tmp_path, overrides, key):
    from multiloss import testing, train
    from multiloss.config import ConfigError
    from tests.conftest import QUIET

    out = tmp_path / "run"
    cfg = testing.compose(*QUIET, "trainer=cpu", "recipe=weighted", "balancer=sdmgrad", *overrides, output_dir=out)
    with pytest.raises(ConfigError) as err:
        train(cfg)
    assert err.value.key == key
    assert not (out / "checkpoints").exists() and not (out / "csv").exists()


@pytest.mark.parametrize("norm_eps, stalls", [(None, False), (1e-4, True)])
def test_cagrad_moves_where_torchjds_cut_would_stop_it(norm_eps, stalls):
    """The two-objective toy's point where torchjd's CAGrad stalls for good (benchmarks/balancer_toy.py --papers, from
    the start (9, 9): docs/balancers.md): ‖∇f2‖ = 1242, ‖∇f1‖ = 0.06, CAGrad's direction g_w = ∇f1. torchjd's
    norm_eps 1e-4 cuts the update to zero (‖g_w‖ < 1e-4·√Σ‖gᵢ‖²); the shipped default (1e-12) gives the paper's
    update (Algorithm 1: ḡ + c‖ḡ‖·g_w/‖g_w‖ at the exact minimiser w, found here on a 1-D bracket). LibMTL's and the
    official code's SLSQP stop at their start w = (½, ½) on this Gramian (objective 5.8e5, the minimum 24.8)."""
    from omegaconf import OmegaConf
    from scipy.optimize import minimize_scalar

    from multiloss.balancers.build import build_balancer
    from multiloss.testing import balancer_backward, compose

    rows = torch.tensor([[0.00917452946305275, 0.05913855880498886], [1241.5787353515625, 17.561588287353516]]).double()
    net = torch.nn.Module()
    net.x = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    extra = [] if norm_eps is None else [f"model.balancer.aggregator.norm_eps={norm_eps}"]
    spec = OmegaConf.to_container(compose("recipe=weighted", "balancer=cagrad", *extra).model.balancer, resolve=True)
    balancer = build_balancer(spec, ["f1", "f2"], [1.0, 1.0], net, "model.balancer")
    balancer_backward(balancer, {"f1": rows[0] @ net.x, "f2": rows[1] @ net.x}, net)
    if stalls:
        assert not net.x.grad.any()
        return
    mean, c = rows.mean(0), 0.5  # the shipped c

    def objective(t: float) -> float:
        g_w = t * rows[0] + (1 - t) * rows[1]
        return float(g_w @ mean + c * mean.norm() * g_w.norm())

    t = minimize_scalar(objective, bounds=(0, 1), method="bounded", options={"xatol": 1e-12}).x
    g_w = t * rows[0] + (1 - t) * rows[1]
    expected = mean + c * mean.norm() / g_w.norm() * g_w
    # Approximate by nature: torchjd's Clarabel (gap tolerances 1e-8) on this Gramian, its rows 2e4 apart in norm
    # (its eigenvalues 4e8 apart), stops 1.4e-4 (relative) from the bracket's minimiser (xatol 1e-12): a solver's
    # tolerance times the Gramian's condition, not rounding. The bound, 1e-3, is 7 times the gap measured.
    torch.testing.assert_close(net.x.grad, expected, rtol=1e-3, atol=0)
