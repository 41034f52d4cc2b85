"""What each balancer costs: step time and peak memory relative to ``fixed``, at K tasks, on the 34 M trunk.

    python benchmarks/balancer_cost.py                          # every shipped balancer, K = 3 and 8
    python benchmarks/balancer_cost.py --balancers fixed pcgrad upgrad --tasks 8
    python benchmarks/balancer_cost.py --balancers fixed upgrad upgrad:gradients   # the Gramian by segments or not
    python benchmarks/balancer_cost.py --trunk conv      # a conv trunk with BatchNorm (--trunk linear: a Linear one)

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


TRUNKS = {
    "dense": "3 × Linear(4096) + ReLU, input 256, batch 512: 34.0 M parameters (the sharding law's)",
    "conv": "4 × (Conv 3×3 + BatchNorm + ReLU), channels 128/256/256/512, strides 1/2/2/2, global average pool, "
    "3×32×32 images, batch 64: 2.07 M parameters (a user's conv trunk)",
    "linear": "Linear 3072→512, 2 × Linear(512) + ReLU, 3×32×32 images flattened, batch 64: 2.10 M parameters "
    "(the conv trunk's size, Linear)",
}


def _trunk(kind: str):
    """(trunk, feature width, inputs) of ``kind`` (`TRUNKS`)."""
    import torch
    from torch import nn

    from multiloss.nets import dense_blocks

    if kind == "dense":
        return nn.Sequential(*dense_blocks(256, 4096, 3, 0.0, False)), 4096, torch.randn(512, 256)
    images = torch.randn(64, 3, 32, 32)
    if kind == "linear":
        layers = [nn.Flatten(), nn.Linear(3072, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512)]
        return nn.Sequential(*layers, nn.ReLU()), 512, images
    blocks, channels = [], 3
    for width, stride in ((128, 1), (256, 2), (256, 2), (512, 2)):
        blocks += [nn.Conv2d(channels, width, 3, stride, 1), nn.BatchNorm2d(width), nn.ReLU(inplace=True)]
        channels = width
    return nn.Sequential(*blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten()), 512, images


def run_case(name: str, k: int, steps: int, trunk: str = "dense") -> dict[str, float]:
    """One balancer at ``k`` tasks, in this process: median seconds a step, and peak MiB above the start."""
    import torch
    import torch.nn.functional as F
    from omegaconf import OmegaConf
    from torch import nn

    from multiloss import testing
    from multiloss.balancers.build import build_balancer
    from multiloss.testing import balancer_backward

    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = nn.Module()
    net.trunk, width, x = _trunk(trunk)
    net.heads = nn.ModuleList(nn.Linear(width, 10) for _ in range(k))
    tasks = [f"task{i}" for i in range(k)]
    method, _, path = name.partition(":")  # pcgrad:gradients — the rule on the K task gradients; :rep_grad
    extra = {"": [], "rep_grad": ["model.balancer.rep_grad=batch"]}.get(path, [f"model.balancer.gramian={path}"])
    cfg = testing.compose("recipe=weighted", f"balancer={method}", *extra)
    spec = OmegaConf.to_container(cfg.model.balancer, resolve=True)
    balancer = build_balancer(spec, tasks, [1.0] * k, net, "model.balancer")
    optimizer = torch.optim.Adam([*net.parameters(), *balancer.parameters()], lr=1e-4)
    y = torch.randint(0, 10, (k, len(x)))

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


def case(name: str, k: int, steps: int, trunk: str) -> dict[str, float]:
    proc = subprocess.run(
        [sys.executable, __file__, "--case", name, str(k), "--steps", str(steps), "--trunk", trunk],
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
    variants += [f"{n}:rep_grad" for n in ("pcgrad", "upgrad", "mgda", "gradnorm", "nash_mtl", "graddrop")]
    parser.add_argument("--balancers", nargs="+", default=[*shipped, *variants], choices=[*shipped, *variants])
    parser.add_argument("--tasks", nargs="+", type=int, default=[3, 8])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument(
        "--trunk", default="dense", choices=list(TRUNKS), help="; ".join(f"{k}: {v}" for k, v in TRUNKS.items())
    )
    parser.add_argument("--case", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case[0], int(args.case[1]), args.steps, args.trunk)))
        return
    names = ["fixed", *(n for n in args.balancers if n != "fixed")]
    results = {k: {} for k in args.tasks}
    for k in args.tasks:
        for name in names:
            results[k][name] = case(name, k, args.steps, args.trunk)
            r = results[k][name]
            print(f"K={k} {name}: {r['seconds']:.2f} s/step, peak {r['peak_mib']:.0f} MiB", file=sys.stderr, flush=True)
    header = " | ".join(
        f"K={k} s/step | × fixed | above start MiB | × fixed | peak RSS MiB | × fixed" for k in args.tasks
    )
    print(f"\n{args.trunk} trunk: {TRUNKS[args.trunk]}; {args.steps} timed steps, one thread")
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
