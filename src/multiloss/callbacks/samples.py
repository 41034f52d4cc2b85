"""What a generative recipe produces, written into the run dir at every epoch end: pictures (gan) and text (tbptt).

Rank zero draws from the model (every rank, when the networks are sharded: their forward gathers the
shards) with its own ``torch.Generator`` seeded the same way every epoch: the epochs' samples are
comparable, they depend on the weights only, and the global random stream that training draws from is
left exactly where it was (so exact resume holds). Each file's header names the epoch and the step
(`multiloss.base.module.Recipe.step_index`, the ``step`` of metrics.csv).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning as L
import torch

from multiloss.callbacks.lean import LeanCallback
from multiloss.parallel.parallelism import parallelism_of
from multiloss.parallel.sharding import full


class GeneratedSamplesPlot(LeanCallback):
    """``samples/epoch_NNN.png``: ``n_samples`` generated points over the real ones (2-D samples), or a grid of
    generated images (``(H, W)``, ``(1 or 3, H, W)``, or a square number of features such as the digits' 64).

    Needs ``pl_module(z)`` (the GAN: G_ema's samples when on) and ``pl_module.latent_dim``; the real points come
    from the data module's ``train_set`` (named tensors) when it has them.
    """

    def __init__(self, n_samples: int = 1000, seed: int = 0) -> None:
        self.n_samples, self.seed = n_samples, seed

    @torch.no_grad()
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not _draws_here(trainer):
            return
        z = torch.randn(self.n_samples, pl_module.latent_dim, generator=torch.Generator().manual_seed(self.seed))
        dtype = next(pl_module.parameters()).dtype  # (float64 under 64-true)
        fake = full(pl_module(z.to(pl_module.device, dtype))).float().cpu()  # the recipe's samples: G_ema's when on
        if not trainer.is_global_zero:
            return
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        # Shown over the data's own range ([-1, 1] for stylegan2-ada's scaling), [0, 1] unless it says.
        value_range = getattr(trainer.datamodule, "value_range", None) or (0.0, 1.0)
        images = as_images(fake, value_range=tuple(value_range))
        if fake[0].numel() == 2:
            fake = fake.reshape(len(fake), 2).numpy()
            fig, ax = plt.subplots(figsize=(4.5, 4.5))
            ax.scatter(fake[:, 0], fake[:, 1], s=4, c="tab:red", alpha=0.5, label="generated")
            datasets = getattr(getattr(trainer.datamodule, "train_set", None), "datasets", None)
            if isinstance(datasets, dict) and "x" in datasets:  # on top, small: the targets stay visible
                real = datasets["x"][: self.n_samples].reshape(-1, 2).numpy()
                ax.scatter(real[:, 0], real[:, 1], s=1, c="k", alpha=0.6, label="real")
            ax.set_aspect("equal")
            ax.legend(loc="upper right", fontsize=7, markerscale=3)
        elif images is not None:
            cols = 8
            fig, axes = plt.subplots(math.ceil(len(images) / cols), cols, figsize=(4.5, 4.5), squeeze=False)
            for ax, image in zip(axes.flat, images):
                ax.imshow(image.numpy(), cmap="gray_r" if image.dim() == 2 else None, vmin=0, vmax=1)
            for ax in axes.flat:
                ax.axis("off")
        else:
            return
        try:
            fig.suptitle(f"epoch {trainer.current_epoch}, step {pl_module.step_index}", fontsize=9)
            path = _epoch_file(trainer, "png")
            path.parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(path, dpi=80)
        finally:
            plt.close(fig)


class TextSamples(LeanCallback):
    """``samples/epoch_NNN.txt``: ``length`` tokens continuing ``prompt`` (``pl_module.generate``), with a header
    naming the epoch, the step and the last validation score."""

    def __init__(self, prompt: str, length: int, temperature: float, seed: int = 0, metric: str = "val/bpc") -> None:
        self.prompt, self.length, self.temperature, self.seed, self.metric = prompt, length, temperature, seed, metric

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not _draws_here(trainer):
            return
        generator = torch.Generator(device=pl_module.device).manual_seed(self.seed)
        text = pl_module.generate(self.prompt, self.length, self.temperature, generator)
        if not trainer.is_global_zero:
            return
        score = trainer.callback_metrics.get(self.metric)
        header = f"# epoch {trainer.current_epoch}, step {pl_module.step_index}" + (
            f", {self.metric} {float(score):.4f}" if score is not None else ""
        )
        path = _epoch_file(trainer, "txt")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{header}\n{text}\n", encoding="utf-8")


def _draws_here(trainer: L.Trainer) -> bool:
    """Rank zero draws the samples; every rank does when the networks are sharded (their forward gathers shards)."""
    return trainer.is_global_zero or parallelism_of(trainer).sharded


def _epoch_file(trainer: L.Trainer, suffix: str) -> Path:
    return Path(trainer.default_root_dir) / "samples" / f"epoch_{trainer.current_epoch:03d}.{suffix}"


def as_images(samples: torch.Tensor, n: int = 64, value_range: tuple[float, float] = (0.0, 1.0)) -> Any:
    """Up to ``n`` samples as images in [0, 1] — ``(H, W)`` grey or ``(H, W, 3)`` colour — or None if not images;
    ``value_range``: the samples' (mapped onto [0, 1], then clamped).

    Image-shaped means ``(H, W)``, ``(1, H, W)``, ``(3, H, W)``, or a flat square number of features (8×8 digits).
    """
    samples = samples[:n]
    shape = tuple(samples.shape[1:])
    if len(shape) == 3 and shape[0] in (1, 3):
        images = samples.squeeze(1) if shape[0] == 1 else samples.permute(0, 2, 3, 1)
    elif len(shape) == 2:
        images = samples
    elif len(shape) == 1 and shape[0] > 2 and math.isqrt(shape[0]) ** 2 == shape[0]:
        side = math.isqrt(shape[0])
        images = samples.reshape(-1, side, side)
    else:
        return None
    low, high = value_range
    return ((images - low) / (high - low)).clamp(0, 1)
