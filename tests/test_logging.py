"""Training losses are summed on the device and written as means on Lightning's log rows (`Recipe.log_losses`).

Every step counts in exactly one row: a row every n steps holds the mean of the n per-step values a
run logging every step writes (training itself does not depend on logging, so both runs see the
same losses). Under accumulation a row comes only on optimizer steps, and holds every micro-batch.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from multiloss import train
from tests.conftest import ONE_CPU_NO_VAL, SMALL_GAN


def _rows(run: Path, column: str) -> dict[int, float]:
    with next(run.rglob("metrics.csv")).open(newline="") as f:
        return {int(r["step"]): float(r[column]) for r in csv.DictReader(f) if r.get(column)}


def _run(make_cfg, tmp_path: Path, name: str, *overrides: str) -> tuple[Path, dict[str, float]]:
    out = tmp_path / name
    metrics = train(make_cfg(*ONE_CPU_NO_VAL, "callbacks=none", *overrides, output_dir=out))
    return out, metrics


@pytest.mark.parametrize(
    ("recipe", "column", "steps"),
    [
        ("multihead", "loss/head1", ("trainer.max_steps=12", "data.batch_size=32")),
        # The generator's loss exists on generator steps only (every n_critic-th batch).
        ("gan", "loss/g", (*SMALL_GAN, "trainer.max_steps=18", "data.batch_size=64")),
    ],
)
def test_a_row_is_the_mean_of_its_steps(make_cfg, tmp_path, recipe, column, steps):
    every, _ = _run(make_cfg, tmp_path, "every", f"recipe={recipe}", *steps, "trainer.log_every_n_steps=1")
    fourth, metrics = _run(make_cfg, tmp_path, "fourth", f"recipe={recipe}", *steps, "trainer.log_every_n_steps=4")
    per_step, per_row = _rows(every, column), _rows(fourth, column)
    assert len(per_row) >= 2
    previous = -1
    for step, value in sorted(per_row.items()):
        window = [v for s, v in per_step.items() if previous < s <= step]
        assert window, step
        assert value == pytest.approx(sum(window) / len(window), rel=1e-6)
        previous = step
    # Callbacks that monitor a training loss see the latest row's values.
    assert metrics[column] == pytest.approx(per_row[max(per_row)], rel=1e-6)


def test_accumulation_writes_rows_on_optimizer_steps_with_every_micro_batch(make_cfg, tmp_path):
    # lr=0: the weights stay put, so a micro-batch has the same loss in both runs.
    common = ("recipe=accumulation", "data.batch_size=16", "model.optimizer.lr=0", "trainer.log_every_n_steps=1")
    one, _ = _run(make_cfg, tmp_path, "k1", *common, "model.accumulate_grad_batches=1", "trainer.max_steps=12")
    run, _ = _run(
        make_cfg,
        tmp_path,
        "k2",
        *common,
        "model.accumulate_grad_batches=2",
        "trainer.max_steps=6",
        "trainer.log_every_n_steps=3",
    )
    micro = [v for _, v in sorted(_rows(one, "loss/total").items())]
    rows = [v for _, v in sorted(_rows(run, "loss/total").items())]
    assert len(micro) == 12 and len(rows) == 2
    # A row every 3 optimizer steps = 6 micro-batches, each of them in it.
    assert rows == pytest.approx([sum(micro[:6]) / 6, sum(micro[6:]) / 6], rel=1e-6)


def test_a_run_shorter_than_a_row_still_logs_its_losses(make_cfg, tmp_path):
    run, metrics = _run(
        make_cfg, tmp_path, "short", "recipe=multihead", "trainer.max_steps=3", "trainer.log_every_n_steps=50"
    )
    rows = _rows(run, "loss/total")
    assert list(rows) == [2]  # one row at the end (steps 0-2), the mean of the 3 steps
    assert metrics["loss/total"] == pytest.approx(rows[2], rel=1e-6)


def test_one_step_count_in_csv_samples_and_plots(make_cfg, tmp_path):
    """tbptt steps 4 times a batch and the GAN 1.5 times: their outputs still name one step, the batch's
    index as metrics.csv writes it (the last row is the last batch's), not Lightning's global_step."""
    chunks = ("recipe=tbptt", "data.seq_len=64", "model.chunk_length=16", "model.net.hidden_size=32")
    out, _ = _run(make_cfg, tmp_path, "tbptt", *chunks, "trainer.max_epochs=1", "trainer.limit_train_batches=7")
    last_row = max(_rows(out, "loss/ce"))
    assert last_row == 6  # 7 batches: steps 0-6 (28 optimizer.step() calls)
    header = (out / "samples" / "epoch_000.txt").read_text().splitlines()[0]
    assert header.startswith("# epoch 0, step 6"), header
    gan, _ = _run(make_cfg, tmp_path, "gan", "recipe=gan", *SMALL_GAN, "trainer.max_steps=30")  # 20 batches
    assert max(_rows(gan, "loss/d")) == 19
    # weighted's task-metric plot draws metrics.csv's validation rows: their steps.
    out = tmp_path / "weighted"
    short = ("trainer.max_epochs=1", "trainer.limit_train_batches=5", "trainer.limit_val_batches=1")
    train(
        make_cfg("recipe=weighted", "trainer.accelerator=cpu", "trainer.num_sanity_val_steps=0", *short, output_dir=out)
    )
    assert list(_rows(out, "val/acc/digit")) == [1, 3]  # twice an epoch
    assert (out / "task_metrics.png").stat().st_size > 10_000


def test_the_epoch_column_is_the_rows_epoch_written_as_lightning_writes_it(make_cfg, tmp_path):
    """tbptt's training rows and Lightning's validation rows say epoch ``0``, not ``0.0`` beside ``0``; and the
    run's last training rows, written at its end, belong to its last epoch (1 in a 2-epoch run), not the next."""
    out = tmp_path / "tbptt"
    small = ("data.seq_len=32", "model.net.hidden_size=32", "trainer.limit_train_batches=5")
    small += ("trainer.limit_val_batches=2",)
    train(make_cfg("recipe=tbptt", "trainer.max_epochs=2", "trainer.log_every_n_steps=3", *small, output_dir=out))
    with next(out.rglob("metrics.csv")).open(newline="") as f:
        rows = list(csv.DictReader(f))
    epochs = [r["epoch"] for r in rows]
    assert all(e.isdigit() for e in epochs), epochs
    # The last training row, written at the run's end: epoch 1's.
    assert {e for r, e in zip(rows, epochs, strict=True) if r.get("loss/ce")} == {"0", "1"}
    assert {e for r, e in zip(rows, epochs, strict=True) if r.get("val/bpc")} == {"0", "1"}
