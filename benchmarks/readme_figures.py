"""Every figure of the README's recipe table, its balancer advice and its modern-GAN showcase, from one script.

    python benchmarks/readme_figures.py              # run everything (~20 min on 2 cores), write docs/figures.json,
                                                     # and rewrite the README's marked blocks from it
    python benchmarks/readme_figures.py --render     # the README's blocks from docs/figures.json again (no runs)
    python benchmarks/readme_figures.py --only recipes --workers 1   # re-measure one part (wall times: an idle
                                                                    # machine, one run at a time)

What runs: each recipe's default run as a user starts it (``python train.py recipe=<name>``, seed 0: its final
values and wall time, start-up included); ``recipe=weighted balancer=<m>`` for every method at seeds 0-2 (each task's
final validation metric: what a user reads); the README's modern-GAN command. The JSON keeps the machine, the date
and the commit with the numbers; `tests/test_readme_figures.py` checks that the README says what the JSON holds, and
that a default run today still gives the JSON's figure (so a change that moves the numbers regenerates them).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FIGURES = ROOT / "docs" / "figures.json"
RECIPES = ("multihead", "weighted", "gan", "tbptt", "accumulation")
SEEDS = (0, 1, 2)
# Each task of recipe=weighted, the metric a user reads, and whether higher is better.
TASKS = (("digit", "val/acc/digit", True), ("parity", "val/acc/parity", True), ("ink", "val/mae/ink", False))
# The README's modern-GAN showcase: relativistic loss, R1, G_ema and ADA on the shipped digits; and the two
# settings the README says matter, each changed alone.
SHOWCASE = (
    "recipe=gan data=digits model.data_dim=64 model.latent_dim=16 model.loss=relativistic "
    "model.penalty=r1 model.penalty_weight=1 +model.g_ema.half_life_images=2000 "
    "'+model.augment.policy=[translation,cutout]' +model.augment.p=0 +model.augment.ada_target=0.6 "
    "+model.metrics.feature=digits trainer.max_epochs=60"
)
SHOWCASE_CHANGED = {
    "lazy": "model.penalty_every=16",
    "gamma": "model.penalty_weight=0.1",
    "n_critic": "model.n_critic=1",
}
QUIET = ("print_config=false", "~callbacks.progress_bar")
PARTS = ("recipes", "balancers", "showcase")


def machine() -> str:
    """The CPU, its cores and vector width, the torch and Lightning builds: what the numbers depend on."""
    cpu = platform.processor() or "x86-64"
    flags = ""
    with open("/proc/cpuinfo") as info:  # Linux: the model name and the widest vector unit
        for line in info:
            if line.startswith("model name") and cpu in ("", "x86_64", "x86-64"):
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = line
    vector = "AVX-512" if " avx512f" in flags else "AVX2" if " avx2" in flags else "no AVX2"
    import lightning
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (
        f"{cpu} ({vector}), {os.cpu_count()} cores, {gpu}; Python {platform.python_version()}, torch "
        f"{torch.__version__}, Lightning {lightning.__version__}"
    )


def final_values(stdout: str) -> dict[str, float]:
    """The end-of-run summary's table (``multiloss: final values``) as numbers."""
    values = {}
    for line in stdout.split("multiloss: final values", 1)[1].splitlines()[2:]:
        parts = line.split()
        if len(parts) != 2 or line.startswith("multiloss:"):
            break
        values[parts[0]] = float(parts[1])
    return values


def run_command(args: str, one_thread: bool = True) -> dict[str, float]:
    """``python train.py <args>`` as a user runs it, in a scratch run dir: its final values and its wall time.
    ``one_thread``: beside other runs (OMP_NUM_THREADS=1); else with torch's default threads, alone."""
    out = tempfile.mkdtemp(prefix="figures-")
    command = [sys.executable, str(ROOT / "train.py"), *shlex.split(args), *QUIET, f"hydra.run.dir={out}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if one_thread else dict(os.environ)
    started = time.perf_counter()
    proc = subprocess.run(command, cwd=out, capture_output=True, text=True, env=env)
    took = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"{args}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return {**final_values(proc.stdout), "wall_s": round(took, 1)}


def run_balancer(balancer: str, seed: int) -> dict[str, float]:
    """``recipe=weighted balancer=<balancer> seed=<seed>``'s default run, in this process (no start-up to pay), as
    `benchmarks/balancers.py` runs it: each task's final validation metric."""
    import torch
    from balancers import run  # benchmarks/balancers.py, beside this script

    torch.set_num_threads(1)
    metrics, _ = run(["recipe=weighted"], balancer, seed, [])
    return {metric: metrics[metric] for _, metric, _ in TASKS}


def measure(workers: int, parts: set[str]) -> dict:
    """The ``parts`` (recipes, balancers, showcase) measured, ``workers`` runs at a time."""
    balancers = sorted(p.stem for p in (ROOT / "configs" / "balancer").glob("*.yaml"))
    found: dict = {}
    if "recipes" in parts:  # as a user runs them: one at a time, torch's own threads (they change the rounding)
        found["recipes"] = {r: run_command(f"recipe={r}", one_thread=False) for r in RECIPES}
    with ProcessPoolExecutor(workers) as pool:
        if "showcase" in parts:
            showcase = pool.submit(run_command, SHOWCASE)
            changed = {name: pool.submit(run_command, f"{SHOWCASE} {o}") for name, o in SHOWCASE_CHANGED.items()}
        if "balancers" in parts:
            runs = {(b, s): pool.submit(run_balancer, b, s) for b in balancers for s in SEEDS}
            per_balancer = {b: {m: [runs[b, s].result()[m] for s in SEEDS] for _, m, _ in TASKS} for b in balancers}
            found["balancers"] = {"seeds": list(SEEDS), "metrics": per_balancer}
        if "showcase" in parts:
            variants = {n: {"override": SHOWCASE_CHANGED[n], "values": run.result()} for n, run in changed.items()}
            found["showcase"] = {"command": SHOWCASE, "values": showcase.result(), "changed": variants}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    found.update(
        machine=machine(), date=datetime.date.today().isoformat(), commit=commit.stdout.strip() or "unknown", threads=1
    )
    return found


# --- the README's blocks -----------------------------------------------------------------------------------------


def _fmt(value: float, digits: int = 3) -> str:
    return f"{value:.{digits}f}"


def recipes_table(figures: dict) -> str:
    r = figures["recipes"]
    rows = [
        ("multihead", "python train.py recipe=multihead",
         "deep supervision on digits: heads at 3 depths of one trunk, Σ wᵢ·CE(headᵢ) (`model.head_weights`), "
         "**one** backward",
         f"final head val acc **{_fmt(r['multihead']['val/acc'])}** after 15 epochs"),
        ("weighted", "python train.py recipe=weighted",
         "multi-task digits (class, odd/even, ink mass) on one trunk, the task losses weighted through **one** "
         "`backward(grad_tensors=w)`; `balancer=` picks the weights",
         f"digit acc **{_fmt(r['weighted']['val/acc/digit'])}**, parity acc "
         f"**{_fmt(r['weighted']['val/acc/parity'])}**, ink-mass MAE **{_fmt(r['weighted']['val/mae/ink'], 4)}**"),
        ("gan", "python train.py recipe=gan",
         "WGAN-GP on the 8-Gaussians ring: two optimizers, `fake.detach()`, D stepped before G's loss is built, the "
         "gradient penalty's double backward (`create_graph=True`)",
         f"**{r['gan']['val/modes']:.0f}/8 modes** covered, {100 * r['gan']['val/high_quality']:.1f} % of samples "
         "within 3σ of a mode"),
        ("tbptt", "python train.py recipe=tbptt",
         "a character LSTM on CPython's docs, truncated BPTT: a step per chunk of `model.chunk_length`, `(h, c)` "
         "detached between chunks (and across batches with `data.layout=streams`)",
         f"validation **{_fmt(r['tbptt']['val/bpc'])} bits/char** after 4 epochs"),
        ("accumulation", "python train.py recipe=accumulation",
         "k micro-batches per optimizer step (`model.accumulate_grad_batches`), the LR scaled by the effective batch "
         "b·k·world_size (`model.lr_scaling=linear\\|sqrt\\|none`)",
         f"val acc **{_fmt(r['accumulation']['val/acc'])}** after 30 epochs (SGD 0.1 at base 64 → 0.2 at 64×2)"),
    ]  # fmt: skip
    lines = [
        f"The numbers are each recipe's default run (`python train.py recipe=<name>`, seed 0, torch's default "
        f"threads) on {figures['machine']}, measured on {figures['date']} at commit {figures['commit']} by "
        "`python benchmarks/readme_figures.py`; wall times include start-up. A run is deterministic on one machine "
        "and thread count; another CPU or thread count rounds differently and ends elsewhere (below).",
        "",
        "| recipe | launch | what it shows | measured (default run) |",
        "|---|---|---|---|",
    ]
    for name, launch, what, measured in rows:
        lines.append(f"| `{name}` | `{launch}` | {what} | {measured}; {r[name]['wall_s']:.0f} s |")
    return "\n".join(lines)


def _summary(values: list[float], digits: int) -> str:
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def balancers_block(figures: dict) -> str:
    metrics = figures["balancers"]["metrics"]
    fixed = metrics["fixed"]
    seeds = figures["balancers"]["seeds"]

    def verdict(name: str) -> str:
        """Per task: better or worse than `fixed` where the seeds' ranges do not overlap, else "≈"."""
        said = []
        for task, metric, higher in TASKS:
            mine, base = metrics[name][metric], fixed[metric]
            if min(mine) > max(base):
                said.append(f"{task} {'better' if higher else 'worse'}")
            elif max(mine) < min(base):
                said.append(f"{task} {'worse' if higher else 'better'}")
        return ", ".join(said) or "≈ `fixed`"

    lines = [
        f"`recipe=weighted balancer=<m>`'s default run (15 epochs), seeds {', '.join(map(str, seeds))}, each task's "
        'final validation metric (mean ± std over the seeds); "better" / "worse" where every seed\'s value lies '
        "beyond every seed's value of `fixed`:",
        "",
        "| `balancer=` | digit acc ↑ | parity acc ↑ | ink MAE ↓ | against `fixed` |",
        "|---|---:|---:|---:|---|",
    ]
    for name in ["fixed", *(n for n in sorted(metrics) if n != "fixed")]:
        cells = [_summary(metrics[name][m], 4 if not higher else 3) for _, m, higher in TASKS]
        lines.append(f"| `{name}` | " + " | ".join(cells) + f" | {'—' if name == 'fixed' else verdict(name)} |")
    others = [n for n in sorted(metrics) if n != "fixed"]
    better = [n for n in others if "better" in verdict(n)]
    worse = [n for n in others if "worse" in verdict(n)]
    same = [n for n in others if verdict(n) == "≈ `fixed`"]

    def names(found: list[str]) -> str:
        return ", ".join(f"`{n}`" for n in found) or "none"

    lines += [
        "",
        f"Better than `fixed` on some task and worse on none: {names([n for n in better if n not in worse])}. "
        f"Better on one task, worse on another: {names([n for n in better if n in worse])}. "
        f"Worse on some task: {names([n for n in worse if n not in better])}. "
        f"Within the seeds' spread of `fixed` on every task: {names(same)}.",
    ]
    return "\n".join(lines)


def showcase_block(figures: dict) -> str:
    values = figures["showcase"]["values"]
    changed = figures["showcase"]["changed"]
    command = "python train.py " + figures["showcase"]["command"]
    for key in (" model.penalty=", " '+model.augment", " +model.metrics"):
        command = command.replace(key, " \\\n  " + key.lstrip())

    def quality(v: dict) -> str:
        return f"FID {v['val/fid']:.1f}, recall {v['val/recall']:.2f}, coverage {v['val/coverage']:.2f}"

    return "\n".join(
        [
            "```bash",
            command,
            "```",
            "",
            f"It ends (seed 0, {values['wall_s']:.0f} s on the machine of the recipe table) at FID "
            f"**{values['val/fid']:.1f}**, KID {values['val/kid']:.1f}, precision {values['val/precision']:.2f}, "
            f"recall **{values['val/recall']:.2f}**, density {values['val/density']:.2f}, coverage "
            f"{values['val/coverage']:.2f} (digits-features v1; lower FID and KID, higher recall and coverage are "
            f"better; ADA's p ends at {values.get('augment/p', 0):.2f}"
            + (
                ": D's sign statistic never reached its 0.6 target, so no image was augmented)"
                if not values.get("augment/p")
                else ")"
            )
            + ". What it needs, each changed alone: R1's γ = 1 (at "
            f"`{changed['gamma']['override']}`: {quality(changed['gamma']['values'])}) and the recipe's two critic "
            f"steps a generator step (at `{changed['n_critic']['override']}`: "
            f"{quality(changed['n_critic']['values'])}). Lazy R1 (`{changed['lazy']['override']}`, stylegan2-ada's "
            f"saving for large nets) costs quality at this size and length: {quality(changed['lazy']['values'])}.",
        ]
    )


BLOCKS = {"recipes": recipes_table, "balancers": balancers_block, "showcase": showcase_block}


def render(readme: str, figures: dict) -> str:
    """``readme`` with each ``<!-- figures:NAME -->`` … ``<!-- /figures:NAME -->`` block rendered from ``figures``."""
    for name, block in BLOCKS.items():
        pattern = re.compile(rf"(<!-- figures:{name} -->\n)(?:.*?\n)?(<!-- /figures:{name} -->)", re.S)
        if not pattern.search(readme):
            raise SystemExit(f"README.md has no <!-- figures:{name} --> block")
        readme = pattern.sub(lambda m, b=block: m.group(1) + b(figures) + "\n" + m.group(2), readme)
    return readme


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--render", action="store_true", help="only rewrite the README from docs/figures.json")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="runs at once (one thread each)")
    parser.add_argument(
        "--only", nargs="+", choices=PARTS, default=PARTS, help="measure these parts again, keep the others' figures"
    )
    args = parser.parse_args()
    if not args.render:
        figures = json.loads(FIGURES.read_text()) if FIGURES.exists() else {}
        figures.update(measure(args.workers, set(args.only)))
        FIGURES.write_text(json.dumps(figures, indent=1, sort_keys=True) + "\n")
        print(f"wrote {FIGURES.relative_to(ROOT)}")
    figures = json.loads(FIGURES.read_text())
    README.write_text(render(README.read_text(), figures))
    print(f"rendered {README.relative_to(ROOT)} from {FIGURES.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
