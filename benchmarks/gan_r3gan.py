"""R3GAN's configuration against DCGAN's and WGAN-GP's on stacked digits, and the conv nets on an image folder.

    python benchmarks/gan_r3gan.py --part stacked --seeds 0 1 2 3 4 --jobs 2 --results gan_r3gan.jsonl
    python benchmarks/gan_r3gan.py --part folder --epochs 12           # one run of the conv nets, FID per epoch

``stacked``: ``data=stacked_digits`` (1,000 modes, 192 values a sample), the shipped MLPs, the same number of images
shown to D (``--epochs`` epochs of the 18,000 training samples), three loops as their papers configure them:

- **R3GAN** (brownvc/R3GAN ``train.py`` 189-196, ``Trainer.py`` 28-42): the relativistic loss, R1 + R2 at γ/2 every
  D step with γ 0.05 → 0.005, Adam β1 0 with β2 0.9 → 0.99, the rate 2e-4 → 5e-5, G_ema's half-life 0 → a quarter
  of the run's images, each along R3GAN's cosine over the run's images (no augmentation: flat samples);
- **DCGAN** (pytorch/examples ``dcgan/main.py``): BCE (``nonsaturating``, its form on logits), Adam 2e-4 (0.5,
  0.999), G on the very fakes D scored, no penalty, no EMA;
- **WGAN-GP** (Gulrajani et al. 2017, Algorithm 1): the critic's loss, GP at λ 10, 5 critic steps per G step, Adam
  1e-4 (0, 0.9), no EMA.

The final validation metrics in the shipped digits classifier's feature space (FID, KID, modes of 1,000, KL to
uniform modes), on G_ema for R3GAN and G for the others, mean ± 95 % t-interval over the seeds.

``folder``: stacked digits written out as 32 × 32 RGB PNGs (each digit a channel, enlarged 4×: an image folder
of generated images), ``data=images``, the StyleGAN2 generator and the residual discriminator with R3GAN's
configuration; G_ema's FID (digit features, averaged back to 8 × 8) after every epoch.

A benchmark, not a test: the numbers depend on the machine and the seeds.
"""

from __future__ import annotations

import argparse
import csv
import tempfile
from pathlib import Path

import numpy as np
import torch
from balancers import QUIET, Job, Result, Runner, interval
from PIL import Image

from multiloss import testing, train

TRAIN_IMAGES = 18000  # stacked digits' training split (20,000 × 0.9)


def r3gan(images: int) -> tuple[str, ...]:
    """R3GAN's configuration over a run of ``images`` images (its schedules' length)."""
    return (
        "model.loss=relativistic",
        "model.penalty=[r1,r2]",
        "model.penalty_weight=0.05",
        "model.n_critic=1",
        "optimizer@model.g_optimizer=adam",
        "optimizer@model.d_optimizer=adam",
        "model.g_optimizer.lr=2e-4",
        "model.d_optimizer.lr=2e-4",
        "model.g_optimizer.betas=[0.0,0.9]",
        "model.d_optimizer.betas=[0.0,0.9]",
        "+model.g_optimizer.eps=1e-8",
        "+model.d_optimizer.eps=1e-8",
        "scheduler=images",
        f"model.scheduler.total_nimg={images}",
        "model.scheduler.final_value=0.25",
        "+model.g_ema.half_life_images=1",
        f"+model.schedules.gamma={{base_value: 0.05, final_value: 0.005, total_nimg: {images}}}",
        f"+model.schedules.beta2={{base_value: 0.9, final_value: 0.99, total_nimg: {images}}}",
        f"+model.schedules.ema_half_life={{base_value: 0, final_value: {images // 4}, total_nimg: {images}}}",
    )


CONFIGS = {
    "R3GAN": r3gan,
    "DCGAN": lambda images: (
        "model.loss=nonsaturating",
        "model.penalty=none",
        "model.n_critic=1",
        "model.g_input=same_fakes",
        "optimizer@model.g_optimizer=adam",
        "optimizer@model.d_optimizer=adam",
        "model.g_optimizer.lr=2e-4",
        "model.d_optimizer.lr=2e-4",
        "model.g_optimizer.betas=[0.5,0.999]",
        "model.d_optimizer.betas=[0.5,0.999]",
        "scheduler=constant",
    ),
    "WGAN-GP": lambda images: (
        "model.loss=wgan-gp",
        "model.penalty=gp",
        "model.penalty_weight=10",
        "model.n_critic=5",
        "optimizer@model.g_optimizer=adam",
        "optimizer@model.d_optimizer=adam",
        "model.g_optimizer.lr=1e-4",
        "model.d_optimizer.lr=1e-4",
        "model.g_optimizer.betas=[0.0,0.9]",
        "model.d_optimizer.betas=[0.0,0.9]",
        "scheduler=constant",
    ),
}
STACKED = (
    "recipe=gan",
    "data=stacked_digits",
    "model.data_dim=192",
    "model.latent_dim=32",
    "model.n_plot_samples=0",
    "+model.metrics.feature=digits",
)
METRICS = ("val/fid", "val/kid", "val/modes", "val/kl_modes")


def run_config(job: Job) -> Result:
    """One configuration at one seed: its final validation metrics (and no timing: 0)."""
    setup, name, seed, overrides = job
    out = tempfile.mkdtemp(prefix=f"r3gan-{name}-{seed}-")
    metrics = train(testing.compose(*setup, *overrides, f"seed={seed}", *QUIET, output_dir=out))
    return {k: float(v) for k, v in metrics.items()}, 0.0


def stacked(seeds: list[int], epochs: int, jobs: int, results: Path | None) -> None:
    images = epochs * TRAIN_IMAGES
    # Validation once, after the last epoch: the metrics compared.
    setup = (*STACKED, f"trainer.max_epochs={epochs}", f"trainer.check_val_every_n_epoch={epochs}")
    runner = Runner(jobs, 1, results, run_job=run_config)
    jobs_ = [(setup, name, seed, CONFIGS[name](images)) for name in CONFIGS for seed in seeds]
    done = dict(zip(jobs_, runner(jobs_)))
    print(f"\ndata=stacked_digits, {epochs} epochs ({images:,} images shown to D), MLPs, seeds {seeds}:")
    print("mean ± 95 % t-interval, digit features v1 (R3GAN: G_ema's samples)\n")
    print("| loop | FID ↓ | KID ↓ | modes (of 1,000) ↑ | KL(modes ‖ uniform) ↓ |")
    print("|---|---:|---:|---:|---:|")
    for name in CONFIGS:
        finished = [done[job][0] for job in jobs_ if job[1] == name and done.get(job) is not None]
        cells = []
        for metric in METRICS:
            mean, half = interval([m[metric] for m in finished])
            digits = 0 if metric == "val/modes" else 3 if metric == "val/kid" else 2
            cells.append(f"{mean:.{digits}f} ± {half:.{digits}f}")
        print(f"| {name} ({len(finished)} seeds) | {' | '.join(cells)} |")


def write_folder(root: Path, n: int, resolution: int = 32) -> None:
    """``n`` stacked digits (the data module's own draw) as RGB PNGs, each digit a channel enlarged to
    ``resolution``."""
    from multiloss.data import StackedDigitsDataModule

    x = StackedDigitsDataModule(n_samples=n, resolution=resolution).load()["x"]
    root.mkdir(parents=True, exist_ok=True)
    for i, image in enumerate((x.permute(0, 2, 3, 1) * 255).round().to(torch.uint8).numpy()):
        Image.fromarray(np.ascontiguousarray(image)).save(root / f"{i:05d}.png")


def folder(epochs: int, images: int, seed: int) -> None:
    out = Path(tempfile.mkdtemp(prefix="r3gan-folder-"))
    write_folder(out / "images", images)
    run = out / "run"
    train(
        testing.compose(
            "recipe=gan",
            "data=images",
            f"data.path={out / 'images'}",
            "data.batch_size=32",
            "data.num_workers=1",
            "generator=stylegan2",
            "discriminator=resnet",
            "model.generator.output=sigmoid",
            "model.latent_dim=64",
            "model.n_plot_samples=64",
            "+model.metrics.feature=digits",
            "+model.metrics.kid_subset_size=100",
            f"trainer.max_epochs={epochs}",
            f"seed={seed}",
            *r3gan(epochs * int(images * 0.8)),
            *QUIET,
            output_dir=run,
        )
    )
    rows = [r for r in csv.DictReader(next(run.rglob("metrics.csv")).open()) if r.get("val/fid")]
    print(f"\ndata=images ({images} generated 32 × 32 PNGs), StyleGAN2 G + residual D, R3GAN's configuration:")
    print("G_ema's FID (digit features) after each epoch\n\n| epoch | FID ↓ | KID ↓ | modes ↑ |\n|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {int(row['epoch']) + 1} | {float(row['val/fid']):.2f} | {float(row['val/kid']):.3f} | "
            f"{float(row['val/modes']):.0f} |"
        )
    print(f"\nsamples: {run}/samples")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=["stacked", "folder"], default="stacked")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--epochs", type=int, default=None, help="stacked: 8; folder: 12")
    parser.add_argument("--images", type=int, default=4000, help="folder: how many PNGs")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--results", type=Path, default=None)
    args = parser.parse_args()
    if args.part == "stacked":
        stacked(args.seeds, args.epochs or 8, args.jobs, args.results)
    else:
        folder(args.epochs or 12, args.images, args.seeds[0])


if __name__ == "__main__":
    main()
