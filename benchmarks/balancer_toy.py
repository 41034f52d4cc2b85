"""The two-objective toy of the CAGrad, Nash-MTL and FAMO papers: which balancer reaches the Pareto set from where.

    python benchmarks/balancer_toy.py                        # every method the toy suits, 5 starts, the figure
    python benchmarks/balancer_toy.py --methods fixed famo upgrad --steps 20000 --lr 1e-3
    python benchmarks/balancer_toy.py --papers --jobs 2       # the papers' settings and methods (below)

The problem is ``Toy`` of Cranial-XIX/FAMO, ``experiments/toy/problem.py`` at 0a6ad06 (lines 1-41: CAGrad's toy,
the first loss scaled by 0.1), written out below; its five starting points and Adam on x are that repository's
``experiments/toy/trainer.py`` (lines 35-41, 61-66; FAMO's lower bounds -21·0.1 and -21, line 59). Each method runs
through the balancer protocol as the recipes do (`multiloss.balancers.balance`), x the only parameter (shared by
both tasks). Shortened for a CPU budget: ``--steps`` 2000 at ``--lr`` 1e-2 (the papers: 50000-100000 at 1e-3), so
a slow method may stop short where the papers' runs go on. ``--papers`` runs the FAMO repository's own settings
instead: LS (``fixed``), MGDA, PCGrad, CAGrad, Nash-MTL and FAMO, 50000 Adam steps at lr 1e-3 (``trainer.py``'s
default ``n_epochs`` and x's learning rate), CAGrad's c 0.4 and FAMO's γ 0 (``experiments/utils.py`` defaults and
``experiments/toy/run.sh``: "a very small gamma as the objective is not changing"), PCGrad's and CAGrad's update
clipped to norm 1 (``methods/weight_methods.py``: their own backward clips, the others' clip comes before any
gradient), drawn to
``docs/balancer_toy_papers.png``. ``--jobs N`` runs N (method, start) pairs at a time, one process each.

*Reached* = at the end the two losses lie within ``--tol`` (0.05) of the Pareto front in loss space (the papers'
figures: a trajectory ends on the grey front or does not). Not Pareto-stationarity: from the start (9, 9) both
gradients vanish on a plateau (tanh saturated), and the minimum-norm combination of them is 0.007 there.
Methods the toy's negative losses rule out are listed with the reason. Prints a Markdown table; draws
``docs/balancer_toy.png`` (trajectories over the contours of the mean loss). A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
LOWER = 0.000005
SCALE = 0.1
STARTS = [(-8.5, 7.5), (0.0, 0.0), (9.0, 9.0), (-7.5, -0.5), (9.0, -1.0)]
# What the toy's losses (negative in most of the plane) rule out, and why.
UNSUITED = {
    "gls": "a geometric mean of negative losses is undefined",
    "db_mtl_loss": "log of a negative loss",
    "db_mtl": "log of a negative loss",
    "moco": "scales each gradient by its (negative) loss: the update turns around",
    "uncertainty": "exp(-s)·L + s with L < 0 has no minimum in s",
    "imtl_l": "e^s·L - s with L < 0 has no minimum in s",
    "imtl": "IMTL-L's scales, as imtl_l",
    "gradnorm": "its training rates L/L(0) change sign",
    "dwa": "epoch means: the toy has no epochs (it is fixed)",
}
OVERRIDES = {"famo": ["model.balancer.scalarizer.min_losses=[-2.1,-21]"]}
# Cranial-XIX/FAMO at 0a6ad06: experiments/utils.py (c 0.4, method-params-lr 0.025) and experiments/toy/run.sh (γ 0).
PAPERS = {
    "methods": ["fixed", "mgda", "pcgrad", "cagrad", "nash_mtl", "famo"],
    "steps": 50000,
    "lr": 1e-3,
    "overrides": {
        "cagrad": ["model.balancer.aggregator.c=0.4"],
        "famo": [*OVERRIDES["famo"], "model.balancer.scalarizer.weight_decay=0"],
    },
    # methods/weight_methods.py: PCGrad's and CAGrad's own backward clip the update's norm to max_norm 1.0 before
    # Adam (lines 641-642, 765-766); the others clip before their loss.backward(), on no gradient (lines 77-80).
    "max_norm": {"pcgrad": 1.0, "cagrad": 1.0},
    "figure": ROOT / "docs/balancer_toy_papers.png",
}


def toy(x: torch.Tensor) -> torch.Tensor:
    """Cranial-XIX/FAMO experiments/toy/problem.py (0a6ad06), ``Toy.forward`` lines 14-31, scale 0.1."""
    x1, x2 = x[0], x[1]
    f1 = torch.clamp((0.5 * (-x1 - 7) - torch.tanh(-x2)).abs(), LOWER).log() + 6
    f2 = torch.clamp((0.5 * (-x1 + 3) + torch.tanh(-x2) + 2).abs(), LOWER).log() + 6
    c1 = torch.clamp(torch.tanh(x2 * 0.5), 0)
    f1_sq = ((-x1 + 7).pow(2) + 0.1 * (-x2 - 8).pow(2)) / 10 - 20
    f2_sq = ((-x1 - 7).pow(2) + 0.1 * (-x2 - 8).pow(2)) / 10 - 20
    c2 = torch.clamp(torch.tanh(-x2 * 0.5), 0)
    f1 = (f1 * c1 + f1_sq * c2) * SCALE
    f2 = f2 * c1 + f2_sq * c2
    return torch.stack([f1, f2])


def front_distance(x: torch.Tensor) -> float:
    """How far the losses at ``x`` lie from the Pareto front, in loss space: the front is the image of the segment
    x2 = -8.3552, -7 ≤ x1 ≤ 7 (Cranial-XIX/FAMO experiments/toy/utils.py at 0a6ad06, ``plot_2d_pareto`` lines
    21-27, CAGrad's), sampled every 0.005 in x1."""
    segment = torch.stack([torch.linspace(-7, 7, 2801), torch.full((2801,), -8.3552)])
    with torch.no_grad():
        return float((toy(segment).T - toy(x.detach())).norm(dim=1).min())


def run(
    method: str,
    start: tuple[float, float],
    steps: int,
    lr: float,
    overrides: list[str] | None = None,
    max_norm: float | None = None,
) -> tuple[list[tuple[float, float]], float, float]:
    """One start: the path of x, its losses' distance from the Pareto front at the end, and the seconds it took."""
    from omegaconf import OmegaConf

    from multiloss import testing
    from multiloss.balancers.build import build_balancer
    from multiloss.testing import balancer_backward

    net = nn.Module()
    net.x = nn.Parameter(torch.tensor(start))
    torch.set_num_threads(1)
    overrides = OVERRIDES.get(method, []) if overrides is None else overrides
    cfg = testing.compose("recipe=weighted", f"balancer={method}", *overrides)
    spec = OmegaConf.to_container(cfg.model.balancer, resolve=True)
    balancer = build_balancer(spec, ["f1", "f2"], [1.0, 1.0], net, "model.balancer")
    optimizer = torch.optim.Adam([net.x, *balancer.parameters()], lr=lr)
    path = [tuple(net.x.tolist())]
    began = time.perf_counter()
    for _ in range(steps):
        optimizer.zero_grad()
        f = toy(net.x)
        losses = {"f1": f[0], "f2": f[1]}
        balancer_backward(balancer, losses, net)
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_([net.x], max_norm)
        optimizer.step()
        if balancer.after_step_update:
            with torch.no_grad():
                balancer.after_step(toy(net.x))
        path.append(tuple(net.x.tolist()))
    return path, front_distance(net.x), time.perf_counter() - began


def draw(paths: dict[str, list[list[tuple[float, float]]]], reached: dict[str, list[bool]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    grid = np.linspace(-10, 10, 161)
    xs, ys = np.meshgrid(grid, grid)
    with torch.no_grad():
        mean = np.array([[float(toy(torch.tensor([a, b])).mean()) for a in grid] for b in grid])
    cols = 6
    rows = -(-len(paths) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3 * cols, 3 * rows), squeeze=False)
    for ax in axes.flat:
        ax.set_visible(False)
    for ax, (method, runs) in zip(axes.flat, paths.items()):
        ax.set_visible(True)
        ax.contour(xs, ys, mean, levels=20, linewidths=0.4, colors="0.7")
        for path, ok in zip(runs, reached[method]):
            p = np.array(path)
            ax.plot(p[:, 0], p[:, 1], lw=1.2, color="tab:green" if ok else "tab:red")
            ax.plot(p[0, 0], p[0, 1], "o", ms=3, color="k")
            ax.plot(p[-1, 0], p[-1, 1], "*", ms=7, color="tab:green" if ok else "tab:red")
        ax.set_title(f"{method} ({sum(reached[method])}/5)", fontsize=10)
        ax.set_xlim(-10, 10)
        ax.set_ylim(-10, 10)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle("Two-objective toy (CAGrad / Nash-MTL / FAMO): green = on the Pareto front at the end", fontsize=12)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    shipped = sorted(p.stem for p in (ROOT / "configs/balancer").glob("*.yaml"))
    suited = [m for m in shipped if m not in UNSUITED]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", nargs="+", default=None, choices=suited, help="default: every suited one")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--tol", type=float, default=0.05)
    parser.add_argument("--figure", type=Path, default=ROOT / "docs/balancer_toy.png")
    parser.add_argument("--papers", action="store_true", help="the FAMO repository's settings and methods")
    parser.add_argument("--jobs", type=int, default=1, help="(method, start) pairs at a time, one process each")
    parser.add_argument("--save", type=Path, default=None, help="keep the runs (JSON) to draw them with others later")
    parser.add_argument("--load", type=Path, nargs="*", default=[], help="runs kept by --save: shown, not run again")
    args = parser.parse_args()
    overrides, max_norm = dict(OVERRIDES), {}
    if args.papers:
        args.steps, args.lr, args.figure = (PAPERS[k] for k in ("steps", "lr", "figure"))
        args.methods = args.methods or PAPERS["methods"]
        overrides.update(PAPERS["overrides"])
        max_norm.update(PAPERS["max_norm"])
    args.methods = args.methods or suited
    torch.set_num_threads(1)
    kept = {m: [tuple(r) for r in runs] for f in args.load for m, runs in json.loads(f.read_text()).items()}
    with ProcessPoolExecutor(args.jobs, multiprocessing.get_context("spawn")) as pool:
        futures = {
            (method, s): pool.submit(
                run, method, s, args.steps, args.lr, overrides.get(method, []), max_norm.get(method)
            )
            for method in args.methods
            if method not in kept
            for s in STARTS
        }
        done = {key: future.result() for key, future in futures.items()}
    done.update({(method, s): r for method, runs in kept.items() for s, r in zip(STARTS, runs, strict=True)})
    args.methods = list(dict.fromkeys([*args.methods, *kept]))
    paths, reached, rows = {}, {}, []
    for method in args.methods:
        runs = [done[method, s] for s in STARTS]
        paths[method] = [p for p, _, _ in runs]
        reached[method] = [d <= args.tol for _, d, _ in runs]
        final = [toy(torch.tensor(p[-1])).tolist() for p in paths[method]]
        rows.append((method, runs, final, sum(t for _, _, t in runs)))
        print(f"{method}: {sum(reached[method])}/5 in {rows[-1][3]:.0f} s", flush=True)
    if args.save:
        args.save.write_text(json.dumps({m: [done[m, s] for s in STARTS] for m in args.methods}))
    print(
        f"\n{args.steps} Adam steps at lr {args.lr}; reached = the losses within {args.tol} of the Pareto front"
        " at the end\n"
    )
    print("| method | reached | " + " | ".join(f"start {s}" for s in STARTS) + " |")
    print("|---|---:|" + "---|" * len(STARTS))
    for method, runs, final, _ in rows:
        cells = [
            f"{'✓' if d <= args.tol else '✗'} ({f[0]:.2f}, {f[1]:.2f})"
            for (_, d, _), f in zip(runs, final, strict=True)
        ]
        print(f"| `{method}` | {sum(d <= args.tol for _, d, _ in runs)}/5 | " + " | ".join(cells) + " |")
    for method, why in ({} if args.papers else UNSUITED).items():
        print(f"- `{method}`: not run ({why})")
    draw(paths, reached, args.figure)
    print(f"\nfigure: {args.figure.relative_to(ROOT) if args.figure.is_relative_to(ROOT) else args.figure}")


if __name__ == "__main__":
    main()
