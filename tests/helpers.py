"""Test-only tools shared by the recipe proofs."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from multiloss.distributed import ddp_wrappers


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


class AllReduceCounter(L.Callback):
    """Counts DDP's gradient all-reduces (a comm hook on every DDP wrapper) and the optimizer steps.

    Writes ``allreduce_rank<r>.json`` into ``dirpath`` when training ends, one file per rank, so a
    test can read what happened inside real DDP processes.
    """

    def __init__(self, dirpath: str) -> None:
        self.dirpath = dirpath
        self.allreduces = 0
        self.steps = 0

    def on_train_start(self, trainer, pl_module) -> None:
        model = trainer.strategy.model
        wrappers = [model] if isinstance(model, DistributedDataParallel) else list(ddp_wrappers(pl_module).values())
        assert wrappers, "no DDP wrapper: run this under a DDP strategy"
        for wrapper in wrappers:
            wrapper.register_comm_hook(state=None, hook=self._hook)

    def _hook(self, state, bucket):
        self.allreduces += 1
        return allreduce_hook(dist.group.WORLD, bucket)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.steps += 1

    def on_train_end(self, trainer, pl_module) -> None:
        path = Path(self.dirpath) / f"allreduce_rank{trainer.global_rank}.json"
        path.write_text(json.dumps({"allreduces": self.allreduces, "optimizer_steps": self.steps}))


def straight_and_resumed(
    make_cfg: Callable, tmp_path: Path, common: Iterable[str], stop: str, end: str
) -> tuple[Path, Path, Path]:
    """Three real runs: straight to ``end``; to ``stop``; and from that run's ``last.ckpt`` on to ``end``.

    ``stop`` and ``end`` are overrides (``trainer.max_steps=12``); returns the run dirs
    ``(straight, first, resumed)``, so a test compares what the resume must have kept.
    """
    from multiloss import train

    common = tuple(common)
    straight, first, resumed = tmp_path / "straight", tmp_path / "first", tmp_path / "resumed"
    train(make_cfg(*common, end, output_dir=straight))
    train(make_cfg(*common, stop, output_dir=first))
    train(make_cfg(*common, end, f"ckpt_path={first / 'checkpoints/last.ckpt'}", output_dir=resumed))
    return straight, first, resumed
