"""What each balancer costs: step time and peak memory relative to ``fixed``, at K tasks, on the 34 M trunk.

    python benchmarks/balancer_cost.py                          # every shipped balancer, K = 3 and 8
    python benchmarks/balancer_cost.py --balancers fixed pcgrad upgrad --tasks 8
    python benchmarks/balancer_cost.py --balancers fixed upgrad upgrad:gradients   # the Gramian layer by layer or not

One process per case (a fresh allocator, so peak RSS is the case's own; glibc's mmap threshold lowered as in
``benchmarks/memory.py``): the 3 × 4096 dense trunk of ``benchmarks/memory.py``'s sharding law (34.0 M
parameters, input 256, batch 512) and K heads ``Linear(4096, 10)`` with cross-entropy on random labels, Adam,
one thread; the balancer protocol as the recipes run it (`multiloss.balancers.balance`, ``Balanced.backward``,
FAMO's after-step forward). One warm-up step, then the median of ``--steps`` timed steps; *above start* = the
process's peak resident memory above the timed steps' start, *peak RSS* = the process's peak (weights, gradients
and Adam's state included) (the K task gradients a gradient rule holds, its solver's, the
graph kept for K backward passes). A benchmark, not a test: the numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_case(name: str, k: int, steps: int) -> dict[str, float]:
    """One balancer at ``k`` tasks, in this process: median seconds a step, and peak MiB above the start."""
    import torch
    import torch.nn.functional as F
    from omegaconf import OmegaConf
    from torch import nn

    from multiloss import testing
    from multiloss.balancers.build import build_balancer
    from multiloss.nets import dense_blocks
    from multiloss.testing import balancer_backward

    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = nn.Module()
    net.trunk = nn.Sequential(*dense_blocks(256, 4096, 3, 0.0, False))
    net.heads = nn.ModuleList(nn.Linear(4096, 10) for _ in range(k))
    tasks = [f"task{i}" for i in range(k)]
    method, _, path = name.partition(":")  # pcgrad:gradients — the rule on the K task gradients
    extra = [f"model.balancer.gramian={path}"] if path else []
    cfg = testing.compose("recipe=weighted", f"balancer={method}", *extra)
    spec = OmegaConf.to_container(cfg.model.balancer, resolve=True)
    balancer = build_balancer(spec, tasks, [1.0] * k, net, "model.balancer")
    optimizer = torch.optim.Adam([*net.parameters(), *balancer.parameters()], lr=1e-4)
    x, y = torch.randn(512, 256), torch.randint(0, 10, (k, 512))

    def losses() -> dict[str, torch.Tensor]:
        features = net.trunk(x)
        return {t: F.cross_entropy(head(features), y[i]) for i, (t, head) in enumerate(zip(tasks, net.heads))}

    times, base = [], 0
    for step in range(steps + 1):
        if step == 1:  # after a warm-up step: Adam's state and the gradients allocated
            base = _rss()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        balancer_backward(balancer, losses(), net)
        optimizer.step()
        if balancer.after_step_update:
            with torch.no_grad():
                balancer.after_step(torch.stack(list(losses().values())))
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seconds": statistics.median(times[1:]), "peak_mib": (peak - base) / 2**20, "total_mib": peak / 2**20}


def case(name: str, k: int, steps: int) -> dict[str, float]:
    proc = subprocess.run(
        [sys.executable, __file__, "--case", name, str(k), "--steps", str(steps)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONWARNINGS": "ignore", "MALLOC_MMAP_THRESHOLD_": "65536"},
    )
    if proc.returncode != 0:
        raise RuntimeError(f"case {name} K={k} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    shipped = sorted(p.stem for p in (ROOT / "configs/balancer").glob("*.yaml"))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    variants = [f"{n}:gradients" for n in ("pcgrad", "upgrad", "cagrad", "gradvac")]
    parser.add_argument("--balancers", nargs="+", default=[*shipped, *variants], choices=[*shipped, *variants])
    parser.add_argument("--tasks", nargs="+", type=int, default=[3, 8])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--case", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case[0], int(args.case[1]), args.steps)))
        return
    names = ["fixed", *(n for n in args.balancers if n != "fixed")]
    results = {k: {} for k in args.tasks}
    for k in args.tasks:
        for name in names:
            results[k][name] = case(name, k, args.steps)
            r = results[k][name]
            print(f"K={k} {name}: {r['seconds']:.2f} s/step, peak {r['peak_mib']:.0f} MiB", file=sys.stderr, flush=True)
    header = " | ".join(
        f"K={k} s/step | × fixed | above start MiB | × fixed | peak RSS MiB | × fixed" for k in args.tasks
    )
    print(f"\n| balancer | {header} |")
    print("|---|" + "---:|" * (6 * len(args.tasks)))
    for name in names:
        cells = []
        for k in args.tasks:
            r, f = results[k][name], results[k]["fixed"]
            cells += [f"{r['seconds']:.2f}", f"{r['seconds'] / f['seconds']:.2f}×"]
            cells += [f"{r['peak_mib']:.0f}", f"{r['peak_mib'] / max(f['peak_mib'], 1):.2f}×"]
            cells += [f"{r['total_mib']:.0f}", f"{r['total_mib'] / f['total_mib']:.2f}×"]
        print(f"| `{name}` | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
