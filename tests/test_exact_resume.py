"""Exact under every schedule: each recipe × step, warm-up cosine, linear decay and plateau, stopped and resumed
at every kind of stop, ends with the weights and the learning rates of the run that was never stopped.

One run goes straight through 3 epochs. Another is stopped four times and continued each time with
``ckpt_path=last`` in the same run dir: SIGTERM mid-epoch 0, SIGTERM on epoch 0's last batch,
``trainer.max_epochs=2`` (an epoch end), ``trainer.max_steps`` mid-epoch 2, then the end. The schedules'
lengths are set (a run length resolved from the stopping bound would be another schedule). The LR
column of the two metrics.csv must be the same at every optimizer step, and the weights equal (0.0).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from multiloss import train
from multiloss.callbacks import RunPreempted
from multiloss.data.vocabulary import pydoc_text
from tests.conftest import SMALL_GAN, load_weights
from tests.helpers import logged_rates

EPOCHS = 3
# Every recipe at 6 optimizer steps an epoch (the GAN: 6 iterations of 2 steps; tbptt: 3 windows of 2 chunks).
RECIPES = {
    "multihead": ("recipe=multihead", "model.net.width=16", "data.batch_size=256"),
    "weighted": ("recipe=weighted", "model.net.width=16", "data.batch_size=256"),
    "accumulation": ("recipe=accumulation", "model.net.width=16", "data.batch_size=128"),
    "gan": (
        "recipe=gan",
        *SMALL_GAN,
        "data.n_samples=1536",
        "data.batch_size=256",
        "model.n_critic=1",
        "model.n_plot_samples=0",
    ),
    "tbptt": (
        "recipe=tbptt",
        "data=text",
        "data.level=chars",
        "data.layout=streams",
        "data.batch_size=4",
        "data.seq_len=16",
        "model.chunk_length=8",
        "model.net.embedding_dim=8",
        "model.net.hidden_size=16",
        "model.sample_length=5",
    ),
}
STEPS_PER_BATCH = {"gan": 2, "tbptt": 2}  # optimizer steps (Lightning's global_step) a training batch takes
SCHEDULES = {
    "step": ("scheduler=step", "model.scheduler.step_size=1", "model.scheduler.gamma=0.5"),
    "warmup_cosine": ("scheduler=warmup_cosine", "model.scheduler.warmup_steps=4", "model.scheduler.total_steps=40"),
    "linear_decay": ("scheduler=linear_decay", f"model.scheduler.epochs={EPOCHS + 1}"),
    # mode=max on a falling loss: a cut at (nearly) every validation, each one state the resume must keep.
    "plateau": ("scheduler=plateau", "model.scheduler.mode=max", "model.scheduler.factor=0.5"),
}
COMMON = (
    "trainer=cpu",
    "trainer.num_sanity_val_steps=0",
    "trainer.limit_val_batches=2",
    "trainer.log_every_n_steps=1",
    "~callbacks.loss_curves",
)


@pytest.fixture(scope="module")
def text_files(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("corpus")
    text = pydoc_text()
    (root / "train.txt").write_text(text[: 4 * 48 + 1])  # 4 streams of 48 characters: 3 windows of 16
    (root / "valid.txt").write_text(text[1000:1200])
    return root / "train.txt", root / "valid.txt"


def _overrides(recipe: str, schedule: str, text_files: tuple[Path, Path]) -> tuple[str, ...]:
    extra: tuple[str, ...] = ()
    if recipe == "tbptt":
        extra = (f"data.path={text_files[0]}", f"data.val_path={text_files[1]}")
    if recipe == "gan" and schedule == "plateau":
        extra = ("model.scheduler.monitor=val/loss/d",)
    return (*RECIPES[recipe], *extra, *SCHEDULES[schedule], *COMMON)


def _signal_at(step: int) -> tuple[str, ...]:
    return ("+callbacks.signal._target_=tests.helpers.SignalAt", f"+callbacks.signal.step={step}")


@pytest.mark.slow
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_a_run_stopped_and_resumed_at_every_kind_of_stop_ends_as_the_straight_run(
    make_cfg, tmp_path, text_files, recipe, schedule
):
    common = _overrides(recipe, schedule, text_files)
    end = f"trainer.max_epochs={EPOCHS}"
    straight, run = tmp_path / "straight", tmp_path / "run"
    train(make_cfg(*common, end, output_dir=straight))
    per_epoch = torch.load(straight / "checkpoints/last.ckpt", weights_only=True)["global_step"] // EPOCHS
    per_batch = STEPS_PER_BATCH.get(recipe, 1)
    half_epoch = per_batch * (per_epoch // per_batch // 2)  # a batch's first step, mid-epoch

    with pytest.raises(RunPreempted):  # SIGTERM mid-epoch 0
        train(make_cfg(*common, end, *_signal_at(half_epoch), output_dir=run))
    with pytest.raises(RunPreempted):  # SIGTERM as epoch 0's last batch starts: saved at the epoch's end
        train(make_cfg(*common, end, "ckpt_path=last", *_signal_at(per_epoch - per_batch), output_dir=run))
    assert torch.load(run / "checkpoints/last.ckpt", weights_only=True)["global_step"] == per_epoch
    train(make_cfg(*common, "trainer.max_epochs=2", "ckpt_path=last", output_dir=run))  # an epoch end
    train(make_cfg(*common, end, f"trainer.max_steps={2 * per_epoch + half_epoch}", "ckpt_path=last", output_dir=run))
    train(make_cfg(*common, end, "ckpt_path=last", output_dir=run))

    expected, got = (load_weights(r / "checkpoints/last.ckpt") for r in (straight, run))
    worst = max((expected[k].float() - got[k].float()).abs().max().item() for k in expected)
    assert worst == 0.0, f"weights differ by up to {worst:.3g}"
    assert logged_rates(run) == logged_rates(straight)
