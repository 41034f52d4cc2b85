"""``monitor=conflicts``: the logged cosines are the tasks' gradients on the shared layers; training unchanged."""

from __future__ import annotations

import copy
import csv

import pytest
import torch

from multiloss import testing, train
from tests.conftest import BARE, load_weights
from tests.helpers import same_state

WEIGHTED = ("recipe=weighted", "model.net.width=32", "data.batch_size=64", *BARE, "logger=csv")


def _rows(out):
    return [r for r in csv.DictReader(next(out.rglob("metrics.csv")).open()) if r.get("conflict/cos/digit-parity")]


@pytest.mark.parametrize(
    ("balancer", "layers"),
    [((), "net.trunk."), (("balancer=pcgrad", "model.balancer.shared=[trunk.1]"), "net.trunk.1.")],
    ids=["found", "named"],
)
def test_logged_cosines_are_the_task_gradients_on_the_trunk(make_cfg, tmp_path, balancer, layers):
    """On the shared layers: the trunk (found), or the layers the balancer's ``shared`` key names."""
    cfg = make_cfg(
        *WEIGHTED,
        *balancer,
        "monitor=conflicts",
        "trainer.max_steps=1",
        "trainer.log_every_n_steps=1",
        output_dir=tmp_path,
    )
    datamodule, model = testing.build(cfg)
    before = copy.deepcopy(model)
    train(cfg)
    (row,) = _rows(tmp_path)

    _, per_task = before.outputs_and_losses(testing.first_batch(datamodule))
    trunk = [p for n, p in before.named_parameters() if n.startswith(layers)]
    grads = {
        task: torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, trunk, retain_graph=True)])
        for task, loss in per_task.items()
    }
    for a, b in (("digit", "parity"), ("digit", "ink"), ("parity", "ink")):
        expected = torch.nn.functional.cosine_similarity(grads[a], grads[b], dim=0).item()
        assert float(row[f"conflict/cos/{a}-{b}"]) == pytest.approx(expected, abs=1e-5)
        assert float(row[f"conflict/negative/{a}-{b}"]) == (1.0 if expected < 0 else 0.0)
    assert (tmp_path / "conflicts.png").stat().st_size > 10_000


@pytest.mark.parametrize("balancer", ["fixed", "pcgrad"])
def test_monitoring_changes_nothing_in_training(make_cfg, tmp_path, balancer):
    common = (*WEIGHTED, "callbacks=default", "~callbacks.progress_bar", "~callbacks.loss_curves")
    runs = {}
    for monitor in ("none", "conflicts"):
        out = tmp_path / monitor
        train(
            make_cfg(
                *common,
                f"balancer={balancer}",
                f"monitor={monitor}",
                "trainer.max_steps=6",
                "trainer.log_every_n_steps=2",
                output_dir=out,
            )
        )
        runs[monitor] = load_weights(out / "checkpoints" / "last.ckpt")
    assert same_state(runs["conflicts"], runs["none"])
    assert len(_rows(tmp_path / "conflicts")) == 3  # steps 1, 3, 5


def test_multihead_heads_conflict_on_the_layers_they_share(make_cfg, tmp_path):
    out = tmp_path / "run"
    cfg = make_cfg(
        "recipe=multihead",
        "model.net.width=32",
        *BARE,
        "logger=csv",
        "monitor=conflicts",
        "trainer.max_steps=4",
        "trainer.log_every_n_steps=2",
        output_dir=out,
    )
    train(cfg)
    rows = [r for r in csv.DictReader(next(out.rglob("metrics.csv")).open()) if r.get("conflict/cos/head0-head1")]
    assert len(rows) == 2
    assert {"conflict/cos/head0-head2", "conflict/cos/head1-head2"} <= set(rows[0])
    assert all(-1 <= float(r["conflict/cos/head0-head1"]) <= 1 for r in rows)


def test_digit_pairs_experiment_trains_its_competing_tasks_under_a_balancer(make_cfg, tmp_path):
    """``experiment=digit_pairs`` selects recipe, data, tasks and net together; balancers and the
    monitor work on its two tasks as on the digits'."""
    cfg = make_cfg(
        "experiment=digit_pairs",
        "balancer=pcgrad",
        "monitor=conflicts",
        *BARE,
        "logger=csv",
        "trainer.max_steps=12",
        "trainer.log_every_n_steps=2",
        output_dir=tmp_path,
    )
    assert cfg.model._target_.endswith("WeightedMultiTask") and cfg.data._target_.endswith("DigitPairsDataModule")
    assert set(cfg.model.net.heads) == set(cfg.model.tasks) == {"left", "right"}
    metrics = train(cfg)
    assert {"loss/left", "loss/right"} <= set(metrics)
    rows = [r for r in csv.DictReader(next(tmp_path.rglob("metrics.csv")).open()) if r.get("conflict/cos/left-right")]
    assert len(rows) == 6
    assert all(-1 <= float(r["conflict/cos/left-right"]) <= 1 for r in rows)
    assert 0 <= float(rows[-1]["conflict/negative/left-right"]) <= 1
