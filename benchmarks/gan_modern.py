"""The modern GAN options, measured over seeds: mode coverage on 25 Gaussians, and G against G_ema on stacked digits.

    python benchmarks/gan_modern.py                      # both parts, seeds 0-4
    python benchmarks/gan_modern.py --part gaussians --seeds 0 1 --jobs 2

``gaussians``: ``data=gaussians25`` under a few configurations (the default WGAN-GP; the non-saturating loss
with R1 every step or lazily, and G_ema; hinge with R1 and G_ema), 60 epochs each: modes hit (of 25) and the
share of samples within 3σ of a mode, scored on G_ema where it is on, mean ± std over the seeds.
``stacked``: ``data=stacked_digits`` (1,000 modes) with G_ema: the digits-classifier FID, KID and mode count of
G and of G_ema on the validation set, per seed, and in how many seeds G_ema's FID is the lower. A benchmark,
not a test: the numbers depend on the machine and the seeds; CPU time ~1 min a stacked run, ~3.5 min a
Gaussians run (``--jobs`` runs them side by side, one process each).
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from multiloss import testing, train

QUIET = (
    "print_config=false",
    "~callbacks.progress_bar",
    "trainer.enable_progress_bar=false",
    "trainer.accelerator=cpu",
)
# 60 epochs of 180 batches (10,800 D steps): 20 fell short of every mode (docs/recipes.md keeps both tables).
GAUSSIANS_COMMON = ("trainer.max_epochs=60", "model.n_plot_samples=0")
GAUSSIANS = {
    "wgan-gp (default)": (),
    "nonsaturating + R1 + G_ema": (
        "model.loss=nonsaturating",
        "model.penalty=r1",
        "model.penalty_weight=0.1",
        "model.n_critic=1",
        "+model.g_ema.half_life_images=20000",
    ),
    "nonsaturating + lazy R1 + G_ema": (
        "model.loss=nonsaturating",
        "model.penalty=r1",
        "model.penalty_weight=0.1",
        "model.penalty_every=16",
        "model.n_critic=1",
        "+model.g_ema.half_life_images=20000",
        "+model.g_ema.rampup=0.05",
    ),
    "hinge + R1 + G_ema": (
        "model.loss=hinge",
        "model.penalty=r1",
        "model.penalty_weight=0.1",
        "model.n_critic=1",
        "+model.g_ema.half_life_images=20000",
    ),
}
STACKED = (
    "recipe=gan",
    "data=stacked_digits",
    "model.data_dim=192",
    "model.latent_dim=32",
    "model.loss=nonsaturating",
    "model.penalty=r1",
    "model.penalty_weight=0.1",
    "model.penalty_every=4",
    "model.n_critic=1",
    "+model.g_ema.half_life_images=5000",
    "+model.g_ema.rampup=0.05",
    "+model.metrics.feature=digits",
    "trainer.max_epochs=8",
)


def gaussians_run(name: str, seed: int, threads: int) -> tuple[float, float]:
    """One configuration, one seed: (modes hit, share within 3σ) on the validation samples."""
    torch.set_num_threads(threads)
    out = tempfile.mkdtemp(prefix="gan25-")
    options = (*GAUSSIANS_COMMON, *GAUSSIANS[name], f"seed={seed}", *QUIET)
    metrics = train(testing.compose("recipe=gan", "data=gaussians25", *options, output_dir=out))
    print(f"{name}, seed {seed}: {metrics['val/modes']:.0f} modes, {100 * metrics['val/high_quality']:.1f} % within 3σ")
    return float(metrics["val/modes"]), float(metrics["val/high_quality"])


def gaussians(seeds: list[int], jobs: int, threads: int, names: list[str]) -> None:
    # Runs in their own processes (spawned: no state shared), `jobs` at a time; each run is seeded as it is alone.
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {name: [pool.submit(gaussians_run, name, seed, threads) for seed in seeds] for name in names}
        rows = [(name, [f.result() for f in runs]) for name, runs in futures.items()]
    epochs = next(o for o in GAUSSIANS_COMMON if o.startswith("trainer.max_epochs=")).split("=")[1]
    print(f"\ndata=gaussians25, {epochs} epochs, seeds {seeds} (G_ema's samples where it is on): mean ± std")
    print("| configuration | modes (of 25) | % within 3σ | all 25 and ≥ 90 % |")
    print("|---|---:|---:|---:|")
    for name, results in rows:
        modes, quality = [r[0] for r in results], [100 * r[1] for r in results]
        both = sum(m == 25 and q >= 90 for m, q in zip(modes, quality))
        print(
            f"| {name} | {statistics.mean(modes):.1f} ± {statistics.pstdev(modes):.1f} | "
            f"{statistics.mean(quality):.1f} ± {statistics.pstdev(quality):.1f} | {both}/{len(seeds)} |"
        )


def quality_of(generator: torch.nn.Module, module, real: torch.Tensor) -> dict[str, float]:
    from multiloss.gan.metrics import SampleQuality

    quality = SampleQuality(tuple(real.shape[1:]))
    quality.update(real, real=True)
    z = torch.randn(len(real), module.latent_dim, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        quality.update(generator(z), real=False)
    return {k: float(v) for k, v in quality.compute().items()}


def stacked(seeds: list[int]) -> None:
    from multiloss.recipes.gan import GAN

    rows = []
    for seed in seeds:
        out = Path(tempfile.mkdtemp(prefix="stacked-"))
        cfg = testing.compose(*STACKED, f"seed={seed}", *QUIET, output_dir=out)
        train(cfg)
        module = GAN.load_from_checkpoint(out / "checkpoints/last.ckpt", map_location="cpu", weights_only=False)
        datamodule, _ = testing.build(cfg)
        datamodule.setup("fit")
        real = datamodule.val_set.datasets["x"]
        g, ema = quality_of(module.generator, module, real), quality_of(module.generator_ema, module, real)
        rows.append((seed, g, ema))
        print(
            f"seed {seed}: FID G {g['fid']:.1f} / G_ema {ema['fid']:.1f}; modes {g['modes']:.0f} / {ema['modes']:.0f}"
        )
    print(f"\ndata=stacked_digits (1,000 modes), {len(real)} validation samples, digits features v1, seeds {seeds}")
    print("| seed | FID G | FID G_ema | KID G | KID G_ema | modes G | modes G_ema | coverage G | coverage G_ema |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for seed, g, ema in rows:
        print(
            f"| {seed} | {g['fid']:.1f} | {ema['fid']:.1f} | {g['kid']:.2f} | {ema['kid']:.2f} | {g['modes']:.0f} | "
            f"{ema['modes']:.0f} | {g['coverage']:.3f} | {ema['coverage']:.3f} |"
        )
    better = sum(ema["fid"] < g["fid"] for _, g, ema in rows)
    print(f"G_ema's FID lower in {better} of {len(rows)} seeds")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("gaussians", "stacked", "both"), default="both")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    parser.add_argument("--threads", type=int, default=1, help="torch threads a run")
    parser.add_argument("--jobs", type=int, default=1, help="gaussians: runs at a time, each in its own process")
    parser.add_argument("--only", nargs="+", choices=list(GAUSSIANS), default=list(GAUSSIANS), help="gaussians: these")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.part in ("stacked", "both"):
        stacked(args.seeds)
    if args.part in ("gaussians", "both"):
        gaussians(args.seeds, args.jobs, args.threads, args.only)


if __name__ == "__main__":
    main()
