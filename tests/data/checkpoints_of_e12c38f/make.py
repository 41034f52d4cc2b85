"""Write the checkpoints of tests/test_checkpoint_compat.py's issue-34 cases with the code it runs from.

Run from a checkout of commit e12c38f (the last before the step, parallelism, balancers and saved state
had one owner each): ``python tests/data/checkpoints_of_e12c38f/make.py OUT``.
Each case trains 2 epochs (``<case>.ckpt``: a file, or the sharded run's directory), resumes to 3 and keeps the
weights it reached (``<case>.resumed_weights.pt``, consolidated from the shards for the sharded case).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path.cwd()
QUIET = (
    "print_config=false",
    "~callbacks.progress_bar",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "~callbacks.loss_curves",
    "trainer.limit_val_batches=1",
)
CASES = {
    "multihead_mgda": ("recipe=multihead", "balancer=mgda", "model.net.width=8", "data.batch_size=256", "trainer=cpu"),
    "weighted_pcgrad": (
        "recipe=weighted",
        "balancer=pcgrad",
        "model.net.width=8",
        "data.batch_size=256",
        "trainer=cpu",
    ),
    "accumulation": (
        "recipe=accumulation",
        "model.accumulate_grad_batches=2",
        "data.batch_size=128",
        "trainer=cpu",
        "scheduler=step",
    ),
    "tbptt_streams": ("recipe=tbptt", "data.layout=streams", "trainer=cpu", "trainer.limit_train_batches=4"),
    "gan_wgan_gp": (
        "recipe=gan",
        "model.loss=wgan-gp",
        "model.gp_weight=10",
        "trainer=cpu",
        "trainer.limit_train_batches=8",
    ),
    "weighted_uncertainty_fsdp": (
        "recipe=weighted",
        "balancer=uncertainty",
        "model.net.width=8",
        "data.batch_size=128",
        "trainer=fsdp_cpu",
    ),
}


def run(out: Path, *overrides: str) -> None:
    subprocess.run([sys.executable, "train.py", *QUIET, *overrides, f"hydra.run.dir={out}"], check=True, cwd=ROOT)


def main(dest: Path) -> None:
    from multiloss.saving.checkpoints import consolidate

    dest.mkdir(parents=True, exist_ok=True)
    work = dest / "_work"
    for case, overrides in CASES.items():
        first, second = work / f"{case}_2", work / f"{case}_3"
        run(first, *overrides, "trainer.max_epochs=2")
        ckpt = first / "checkpoints/last.ckpt"
        target = dest / f"{case}.ckpt"
        (shutil.copytree if ckpt.is_dir() else shutil.copy)(ckpt, target)
        run(second, *overrides, "trainer.max_epochs=3", f"ckpt_path={target}")
        resumed = second / "checkpoints/last.ckpt"
        if resumed.is_dir():
            resumed = consolidate(resumed, work / f"{case}_whole.ckpt")
        torch.save(torch.load(resumed, weights_only=True)["state_dict"], dest / f"{case}.resumed_weights.pt")
    shutil.rmtree(work)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
