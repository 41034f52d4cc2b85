"""The tasks' Gramian segment by segment (``gramian: layers``) on the trunks users bring: convolutions with BatchNorm
and in-place ReLU, residual blocks, an LSTM with a bare parameter, the shipped MLP with BatchNorm — the same steps as
the rule on the K task gradients (``gramian: gradients``), while no segment holds the K gradients of more than one layer
(or one residual block) where carrying the tasks' gradients down is the cheaper, and no more than the K gradients
where it is not; and an operation the vectorised backward cannot run falls back to the K gradients, saying
where and what to do."""

from __future__ import annotations

import warnings
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from multiloss.testing import balancer_backward

pytestmark = pytest.mark.skipif(find_spec("torchjd") is None, reason="the torchjd extra is not installed")

TASKS, BASE, STEPS = ["a", "b", "c"], [1.0, 2.0, 0.5], 5
EXACT = 1e-10  # float64: equal up to rounding, on any CPU


class Residual(nn.Module):
    """A ResNet basic block: the skip makes its inner outputs no boundary; the block's output is one."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels)
        self.conv2, self.bn2 = nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class Recurrent(nn.Module):
    """An LSTM (a tuple output: no boundary of its own) and a bare parameter of the enclosing module."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm, self.scale = nn.LSTM(3, 16, batch_first=True), nn.Parameter(torch.linspace(0.5, 1.5, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lstm(x.reshape(len(x), -1, 3))[0][:, -1] * self.scale


class _NumpyDouble(torch.autograd.Function):
    """×2, its backward through numpy: no batching rule (what an op the vectorised backward cannot run looks like)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(grad.detach().numpy() * 2)


class _NumpyStep(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _NumpyDouble.apply(x)


def _trunk(kind: str) -> nn.Module:
    if kind == "conv":
        return nn.Sequential(
            nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(inplace=True),
            nn.Conv2d(6, 8, 3, stride=2), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Flatten(), nn.Linear(8 * 3 * 3, 16), nn.ReLU(),
        )  # fmt: skip
    if kind == "residual":
        return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), Residual(4), Residual(4), nn.Flatten(), nn.Linear(256, 16))
    if kind == "recurrent":
        return Recurrent()
    if kind == "conv_then_wide":  # a convolution's large activations below wide Linear layers
        return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(256, 64), nn.ReLU(),
                             nn.Linear(64, 16))  # fmt: skip
    if kind == "wide":
        return nn.Sequential(nn.Flatten(), nn.Linear(192, 64), nn.ReLU(), nn.Linear(64, 16))
    if kind == "wide_numpy":  # the op the vectorised backward cannot run, inside the trunk
        return nn.Sequential(nn.Flatten(), nn.Linear(192, 64), _NumpyStep(), nn.ReLU(), nn.Linear(64, 16))
    from multiloss.nets import MultiTaskMLP  # the shipped net with its documented model.net.batch_norm=true

    return MultiTaskMLP({"unused": 1}, in_features=192, width=16, depth=2, batch_norm=True).trunk


class Net(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = _trunk(kind)
        self.heads = nn.ModuleList([nn.Linear(16, 1) for _ in TASKS])

    def losses(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.trunk(x)
        return {
            t: F.mse_loss(head(h).squeeze(-1), y[:, i]) * (i + 1) for i, (t, head) in enumerate(zip(TASKS, self.heads))
        }


def _data(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(12, 3, 8, 8, generator=g, dtype=torch.float64)
    if kind in ("recurrent", "mlp_batch_norm", "wide", "wide_numpy"):
        x = x.reshape(12, -1)
    y = torch.stack([x.flatten(1)[:, 0], -x.flatten(1)[:, 1], x.flatten(1)[:, 2] * 3], dim=1)
    return x, y


def _spec(name: str, gramian: str) -> dict:
    from omegaconf import OmegaConf

    from tests.conftest import compose_config

    cfg = compose_config(["recipe=weighted", f"balancer={name}", f"model.balancer.gramian={gramian}"], Path("unused"))
    return OmegaConf.to_container(cfg.model.balancer, resolve=True)


def _run(kind: str, name: str, gramian: str) -> tuple[Net, nn.Module]:
    from multiloss.balancers.build import build_balancer

    net = Net(kind).double()
    balancer = build_balancer(_spec(name, gramian), TASKS, BASE, net, "model.balancer").double()
    optimizer = torch.optim.SGD([*net.parameters(), *balancer.parameters()], lr=0.002)
    x, y = _data(kind)
    for _ in range(STEPS):
        optimizer.zero_grad()
        balancer_backward(balancer, net.losses(x, y), net)
        optimizer.step()
    return net, balancer


def _largest_difference(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


KINDS = ["conv", "residual", "recurrent", "mlp_batch_norm", "wide", "conv_then_wide"]
# How each is taken: wide Linear layers carried vectorised to the end ("carried"); where the activations outweigh the
# parameters below them (a 12-image batch of 8×8 maps on a few hundred weights) the lower part task by task
# ("switched"), and where that is the whole trunk, the K gradients themselves ("gradients": as much held, one backward
# fewer).
WAY = {
    "conv": "switched",
    "residual": "switched",
    "recurrent": "gradients",
    "mlp_batch_norm": "carried",
    "wide": "carried",
    "conv_then_wide": "switched",
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["pcgrad", "upgrad", "gradnorm", "cagrad"])
def test_the_gramian_segment_by_segment_on_conv_residual_and_recurrent_trunks_is_the_k_gradients_rule(kind, name):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no fallback said: the segments served every step
        segments, balancer = _run(kind, name, "layers")
    gradients, _ = _run(kind, name, "gradients")
    layers = balancer._layers
    assert (layers.steps, layers.switched, layers.by_gradients) == {
        "carried": (STEPS, 0, 0),
        "switched": (STEPS, STEPS, 0),
        "gradients": (0, 0, STEPS),
    }[WAY[kind]]
    assert _largest_difference(segments, Net(kind).double()) > 1e-3  # it trained
    # Float64, equal to rounding: measured ≤ 2.2e-16, and 3.9e-15 for CAGrad (mlp_batch_norm), whose solver (cvxpy's
    # Clarabel) runs on both sides on Gramians equal to rounding: the same solve, no solver gap.
    assert _largest_difference(segments, gradients) <= EXACT, (kind, name)
    trunk, k = sum(p.numel() for p in segments.trunk.parameters()), len(TASKS)
    # Never more held than the K gradients (and the trunk's output's K gradients); carried, less.
    assert layers.held <= k * (trunk + 12 * 16)
    assert WAY[kind] == "gradients" or layers.held < k * trunk


def test_an_operation_without_a_batching_rule_takes_the_k_gradients_and_says_where():
    with pytest.warns(
        UserWarning, match=r"from the output of trunk\.2 to the output of trunk\.1.*no batching rule"
    ) as said:
        fallback, balancer = _run("wide_numpy", "upgrad", "layers")
    assert len([w for w in said if "segment by segment" in str(w.message)]) == 1  # once, not every step
    assert balancer._layers.steps == 0
    gradients, _ = _run("wide_numpy", "upgrad", "gradients")
    assert _largest_difference(fallback, gradients) <= 1e-12
