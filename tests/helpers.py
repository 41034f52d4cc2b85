"""Test-only tools shared by the recipe proofs."""

from __future__ import annotations

from collections.abc import Iterable

import lightning as L
import torch


class GradCapture(L.Callback):
    """Copies every parameter's ``.grad`` just before each optimizer step, as Lightning computed it.

    ``steps[i]`` maps parameter name -> gradient (or None) for the i-th optimizer step, with the
    optimizer's index in ``optimizer_index[i]``: the recipe's real backward path, no re-implementation.
    """

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor | None]] = []
        self.optimizer_index: list[int] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
        self.steps.append(
            {
                name: (p.grad.detach().clone() if p.grad is not None else None)
                for name, p in pl_module.named_parameters()
                if id(p) in owned
            }
        )
        self.optimizer_index.append(next(i for i, o in enumerate(trainer.optimizers) if o is optimizer))


def assert_grads_close(
    actual: dict[str, torch.Tensor | None],
    expected: dict[str, torch.Tensor | None],
    atol: float = 1e-6,
    rtol: float = 1e-5,
    names: Iterable[str] | None = None,
) -> float:
    """Assert two name -> gradient maps agree (None == None); return the largest absolute difference."""
    keys = list(names) if names is not None else sorted(expected)
    assert keys, "nothing to compare"
    worst = 0.0
    for k in keys:
        a, e = actual[k], expected[k]
        if e is None or a is None:
            assert a is None and e is None, f"{k}: one gradient is None, the other is not"
            continue
        torch.testing.assert_close(a, e, atol=atol, rtol=rtol, msg=lambda m, k=k: f"{k}: {m}")
        worst = max(worst, (a - e).abs().max().item())
    return worst
