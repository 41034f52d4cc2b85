"""The non-finite guard: a NaN/inf loss component or gradient stops the run naming it (or the step is skipped),
and no checkpoint with non-finite weights is ever written."""

from __future__ import annotations

import csv

import pytest
import torch

from multiloss import ConfigError, train
from multiloss.callbacks import NonFiniteError
from multiloss.nets import DeepSupervisionMLP

SMALL = ("recipe=multihead", "model.net.width=16", "trainer.accelerator=cpu", "trainer.limit_val_batches=0")


class TurnsNaN(DeepSupervisionMLP):
    """The shipped net, whose training forwards ``from_call`` .. ``to_call`` (1-based) return NaN logits."""

    def __init__(self, from_call: int, to_call: int = 10**9, **kwargs) -> None:
        super().__init__(**kwargs)
        self.calls, self.window = 0, (from_call, to_call)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        out = super().forward(x)
        if self.training:
            self.calls += 1
            if self.window[0] <= self.calls <= self.window[1]:
                out = [o * float("nan") for o in out]
        return out


def _nan_net(*window: int) -> tuple[str, ...]:
    keys = ("+model.net.from_call", "+model.net.to_call")
    return (f"model.net._target_={__name__}.TurnsNaN", *(f"{k}={v}" for k, v in zip(keys, window)))


def _finite(ckpt) -> bool:
    return all(torch.isfinite(v).all() for v in torch.load(ckpt, weights_only=True)["state_dict"].values())


def test_stop_names_the_component_and_step_and_writes_no_bad_checkpoint(make_cfg, tmp_path):
    periodic = ("callbacks.model_checkpoint.every_n_train_steps=2", "callbacks.model_checkpoint.save_top_k=-1")
    cfg = make_cfg(
        *SMALL, *_nan_net(6), *periodic, "trainer.max_steps=20", "trainer.log_every_n_steps=3", output_dir=tmp_path
    )
    with pytest.raises(NonFiniteError) as err:
        train(cfg)
    said = str(err.value)
    # Forward call 6 is the step taken from global step 5: every head's loss, then the gradients, went NaN.
    assert "loss/head0" in said and "global step 5" in said
    saved = sorted((tmp_path / "checkpoints").glob("*.ckpt"))
    assert saved and all(_finite(p) for p in saved)  # every checkpoint written is a good one
    assert max(torch.load(p, weights_only=True)["global_step"] for p in saved) <= 5
    assert "last good checkpoint: " + str(tmp_path / "checkpoints") in said


def test_a_diverging_learning_rate_stops_the_run(make_cfg, tmp_path):
    with pytest.raises(NonFiniteError, match="became NaN/inf at global step"):
        train(make_cfg(*SMALL, "optimizer=sgd", "model.optimizer.lr=1e6", "trainer.max_steps=40", output_dir=tmp_path))
    assert not (tmp_path / "checkpoints" / "last.ckpt").exists()


def test_skip_drops_the_bad_steps_and_counts_them(make_cfg, tmp_path):
    cfg = make_cfg(
        *SMALL,
        *_nan_net(3, 4),
        "nonfinite=skip",
        "trainer.max_steps=8",
        "trainer.log_every_n_steps=1",
        output_dir=tmp_path,
    )
    train(cfg)
    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    assert _finite(ckpt) and torch.load(ckpt, weights_only=True)["global_step"] == 8
    with next((tmp_path / "csv").rglob("metrics.csv")).open(newline="") as f:
        skipped = [float(r["nonfinite/skipped"]) for r in csv.DictReader(f) if r.get("nonfinite/skipped")]
    assert skipped[0] == 1.0 and max(skipped) == 2.0  # the two NaN steps, and no other


def test_off_trains_on_regardless(make_cfg, tmp_path):
    train(make_cfg(*SMALL, *_nan_net(3), "nonfinite=off", "trainer.max_steps=5", output_dir=tmp_path))
    assert not _finite(tmp_path / "checkpoints" / "last.ckpt")  # what the guard is there to prevent


@pytest.mark.parametrize(
    ("override", "key"),
    [("model.head_weights=[inf,1,1]", "model.head_weights"), ("nonfinite=maybe", "nonfinite")],
)
def test_infinite_weights_and_unknown_modes_are_rejected(make_cfg, tmp_path, override, key):
    with pytest.raises(ConfigError) as err:
        train(make_cfg(*SMALL, override, output_dir=tmp_path))
    assert err.value.key == key


def test_gan_steps_are_guarded_under_manual_optimization(make_cfg, tmp_path):
    lr = ("model.g_optimizer.lr=1e6", "model.d_optimizer.lr=1e6", "model.n_plot_samples=0")
    with pytest.raises(NonFiniteError, match=r"loss/d"):
        train(make_cfg("recipe=gan", "trainer.accelerator=cpu", *lr, "trainer.max_steps=50", output_dir=tmp_path))
    assert not (tmp_path / "checkpoints" / "last.ckpt").exists()


def test_a_healthy_run_is_not_stopped(make_cfg, tmp_path):
    train(make_cfg(*SMALL, "trainer.max_steps=10", output_dir=tmp_path))
    assert _finite(tmp_path / "checkpoints" / "last.ckpt")


def test_the_checkpoint_a_stop_names_exists(make_cfg, tmp_path):
    # NaN at the first step of a 3-step run: nothing saved yet, and the message says so.
    with pytest.raises(NonFiniteError, match=r"last good checkpoint: none saved yet"):
        train(make_cfg(*SMALL, *_nan_net(1), "trainer.max_steps=3", output_dir=tmp_path / "short"))
    # A resumed run that goes NaN before its first save names the checkpoint it resumed from.
    train(make_cfg(*SMALL, "trainer.max_steps=3", output_dir=tmp_path / "good"))
    good = tmp_path / "good/checkpoints/last.ckpt"
    with pytest.raises(NonFiniteError) as err:
        train(make_cfg(*SMALL, *_nan_net(1), "trainer.max_steps=6", f"ckpt_path={good}", output_dir=tmp_path / "on"))
    assert f"last good checkpoint: {good}" in str(err.value)
