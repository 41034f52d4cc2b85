"""What the tasks' K gradients cost in memory when a rule needs them (the Jacobian rules, and the fallback of the
Gramian rules on layers the layer-by-layer Gramian does not cover): peak resident memory added by
`multiloss.balancers.task_gradients.task_gradients`, in copies of the K × n matrix it returns.

    MALLOC_MMAP_THRESHOLD_=65536 python benchmarks/k_gradients.py     # (glibc: every freed block goes back)

A 5.2 M-parameter Linear trunk, K = 8 heads, batch 64, float32. A benchmark, not a test: the numbers depend on the
machine and the allocator. Measured 2026-11-28 on the 2-core x86-64 VM of the README: 1.14 copies (before this
version: 3.02 — the K gradients, their flattened rows and the stacked matrix were alive at once).
"""

from __future__ import annotations

import resource

import torch
from torch import nn

from multiloss.balancers.task_gradients import task_gradients


def main(k: int = 8) -> None:
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU())
    heads = nn.ModuleList([nn.Linear(2048, 1) for _ in range(k)])
    h = trunk(torch.randn(64, 512))
    losses = [head(h).square().mean() for head in heads]
    n = sum(p.numel() for p in trunk.parameters())
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    task_gradients(losses, [*trunk.parameters(), *heads.parameters()])
    grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    print(f"K × n = {k * n * 4 / 2**20:.0f} MiB; peak grew {grew / 2**20:.0f} MiB = {grew / (k * n * 4):.2f} copies")


if __name__ == "__main__":
    main()
