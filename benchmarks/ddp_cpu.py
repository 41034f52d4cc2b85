"""Wall time of every recipe on 1 CPU process vs 2 DDP ranks (gloo), and of the GAN's two DDP designs.

    python benchmarks/ddp_cpu.py                  # all recipes, 1 repeat
    python benchmarks/ddp_cpu.py --repeats 3 --recipes gan multihead

Each case is ``python train.py`` in a subprocess, as a user runs it, with the same global batch:
1 rank × 2b and 2 ranks × b (``trainer=ddp_cpu``). The training time is Lightning's own ``Timer``
callback, read from the final checkpoint (saved at the end of the last step), so process start-up,
data loading and DDP set-up are reported apart from the training loop. The GAN is also run under
Lightning's stock ``ddp_find_unused_parameters_true`` (one wrapper around the whole module, a graph
walk per backward) against multiloss's ``ddp`` (one wrapper per network). A benchmark, not a test:
on a shared 2-core machine the numbers move from run to run; the median of ``--repeats`` is shown.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
QUIET = (
    "print_config=false",
    "trainer.enable_progress_bar=false",
    "~callbacks.progress_bar",
    "trainer.enable_model_summary=false",
    "~callbacks.loss_curves",
    "trainer.limit_val_batches=0",
    "trainer.num_sanity_val_steps=0",
    "+callbacks.timer._target_=lightning.pytorch.callbacks.Timer",
)
# recipe -> (per-rank batch b on 2 ranks, optimizer steps, recipe overrides)
CASES = {
    "multihead": (32, 300, ()),
    "weighted": (32, 300, ("trainer.val_check_interval=null",)),
    "accumulation": (16, 100, ()),  # k=4: 400 batches
    "gan": (128, 300, ("model.n_plot_samples=0",)),
    "tbptt": (16, 64, ()),  # 4 chunks a batch: 16 batches
}


def run(out: Path, *overrides: str) -> dict[str, float]:
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *QUIET, *overrides, f"hydra.run.dir={out}"],
        cwd=out.parent,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"},
    )
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"failed: {' '.join(overrides)}\n{proc.stderr[-3000:]}")
    ckpt = torch.load(out / "checkpoints/last.ckpt", weights_only=True)
    timer = next(v for k, v in ckpt["callbacks"].items() if k.startswith("Timer"))
    return {"wall": wall, "train": timer["time_elapsed"]["train"], "steps": ckpt["global_step"]}


def median_of(repeats: int, out: Path, *overrides: str) -> dict[str, float]:
    runs = [run(out / str(i), *overrides) for i in range(repeats)]
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipes", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for recipe in args.recipes:
            b, steps, extra = CASES[recipe]
            common = (f"recipe={recipe}", f"trainer.max_steps={steps}", *extra)
            cases = {
                f"1 rank × {2 * b}": ("trainer=cpu", f"data.batch_size={2 * b}"),
                f"2 ranks × {b} (ddp)": ("trainer=ddp_cpu", f"data.batch_size={b}"),
            }
            if recipe == "gan":
                cases[f"2 ranks × {b} (ddp_find_unused_parameters_true)"] = (
                    "trainer=ddp_cpu",
                    "trainer.strategy=ddp_find_unused_parameters_true",
                    f"data.batch_size={b}",
                )
            for name, overrides in cases.items():
                out = Path(tmp) / f"{recipe}-{len(rows)}"
                out.mkdir()
                result = median_of(args.repeats, out, *common, *overrides)
                rows.append((recipe, name, result))
                print(f"{recipe:12s} {name:48s} {result['train']:6.1f} s training", file=sys.stderr)

    print(f"\n{len(args.recipes)} recipes, median of {args.repeats}, OMP_NUM_THREADS=1, {os.cpu_count()} cores\n")
    print("| recipe | processes × per-rank batch | optimizer steps | training (s) | ms / step | whole run (s) |")
    print("|---|---|---:|---:|---:|---:|")
    for recipe, name, r in rows:
        per_step = 1000 * r["train"] / r["steps"]
        print(f"| {recipe} | {name} | {r['steps']:.0f} | {r['train']:.1f} | {per_step:.1f} | {r['wall']:.1f} |")


if __name__ == "__main__":
    main()
