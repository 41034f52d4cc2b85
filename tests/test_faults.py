"""User errors found only while the run starts, each one line naming the key, before a step is trained."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from multiloss import train
from multiloss.config import ConfigError
from tests.conftest import run_cli

SMALL = ("recipe=multihead", "model.net.width=16", "trainer=cpu", "~callbacks.loss_curves")


class NoParameters(nn.Module):
    """A net for weighted's digit tasks with nothing to train (a user's forgotten ``nn.Parameter``)."""

    def __init__(self, **sizes: object) -> None:
        super().__init__()

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"digit": x[:, :10], "parity": x[:, 10], "ink": x[:, 11]}


@pytest.mark.parametrize("seed", [-1, 2**32])
def test_a_seed_outside_numpys_range_is_refused(make_cfg, tmp_path, seed):
    with pytest.raises(ConfigError, match=rf"seed={seed}"):
        train(make_cfg(*SMALL, f"seed={seed}", output_dir=tmp_path))
    assert not any(tmp_path.iterdir())


def test_a_net_without_parameters_is_named(make_cfg, tmp_path):
    with pytest.raises(ConfigError, match=r"model\.net=.*NoParameters.*it has none") as err:
        train(
            make_cfg(
                "recipe=weighted", "trainer=cpu", f"model.net._target_={__name__}.NoParameters", output_dir=tmp_path
            )
        )
    assert "trainable parameters" in str(err.value)


def test_early_stopping_on_a_metric_never_logged_names_the_key_and_the_metrics(make_cfg, tmp_path):
    cfg = make_cfg(
        *SMALL[:-1],
        "callbacks=[default,early_stopping]",
        "callbacks.early_stopping.monitor=val/nope",
        "~callbacks.progress_bar",
        "trainer.max_epochs=2",
        output_dir=tmp_path,
    )
    with pytest.raises(ConfigError, match=r"callbacks\.early_stopping\.monitor='?val/nope'?: never logged") as err:
        train(cfg)
    assert "val/acc/head0" in str(err.value) or "val/loss" in str(err.value)


def test_drop_last_with_a_batch_larger_than_the_data_is_refused_not_an_empty_run(make_cfg, tmp_path):
    with pytest.raises(ConfigError, match=r"data\.drop_last=True: .*every batch would be dropped"):
        train(make_cfg(*SMALL, "data.drop_last=true", "data.batch_size=5000", output_dir=tmp_path))
    assert not (tmp_path / "checkpoints").exists()


def test_a_text_file_named_npz_is_not_called_a_pickle(make_cfg, tmp_path):
    fake = tmp_path / "data.npz"
    fake.write_text("x,y\n1,2\n")
    with pytest.raises(ConfigError) as err:
        train(make_cfg(*SMALL, "data=npz", f"data.path={fake}", output_dir=tmp_path / "run"))
    said = str(err.value)
    assert "data.path" in said and "not a numpy file" in said
    assert "allow_pickle" not in said and "unsafely" not in said


def test_a_run_dir_that_is_a_file_is_one_line_and_the_file_is_untouched(tmp_path):
    afile = tmp_path / "results.txt"
    afile.write_text("my notes")
    proc = run_cli(*SMALL, f"hydra.run.dir={afile}", "trainer.max_steps=1")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[0] == f"multiloss: config error: hydra.run.dir={afile}: it is a file"
    assert "Traceback" not in proc.stderr and afile.read_text() == "my notes"
