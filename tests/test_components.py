"""Components chosen by config: checkpoints hold configs, not modules; batches of any shape; the contract check.

Every recipe's checkpoint loads with ``torch.load(weights_only=True)`` and rebuilds with
``<Recipe>.load_from_checkpoint(path)`` alone; a user's DataModule may yield ``(x, y)`` tuples; a
recipe built from Python with ready modules trains too; the component check runs before any step
(at setup, or on the first batch when the data comes without a datamodule) and leaves the weights,
the BatchNorm statistics and the random streams as they were.
"""

from __future__ import annotations

import functools

import lightning as L
import pytest
import torch
from multiloss.recipes.accumulation import Accumulation
from multiloss.recipes.gan import GAN
from multiloss.recipes.multihead import MultiHead
from multiloss.recipes.tbptt import TruncatedBPTT
from multiloss.recipes.weighted import WeightedMultiTask
from torch.utils.data import DataLoader, TensorDataset

from multiloss import ConfigError, testing, train
from multiloss.nets import MLP, DeepSupervisionMLP, MultiTaskMLP
from tests.conftest import SMALL_GAN

SHORT = ("trainer.accelerator=cpu", "trainer.max_steps=3", "trainer.limit_val_batches=1")
RECIPES = {
    "multihead": (MultiHead, ("model.net.width=16",)),
    "weighted": (WeightedMultiTask, ("model.net.width=16",)),
    "accumulation": (Accumulation, ("model.net.width=16",)),
    "gan": (GAN, (*SMALL_GAN, "model.n_plot_samples=0")),
    "tbptt": (
        TruncatedBPTT,
        ("model.net.hidden_size=16", "data.seq_len=32", "data.batch_size=4", "model.sample_length=5"),
    ),
}


@pytest.mark.parametrize("recipe", RECIPES)
def test_checkpoint_holds_configs_and_rebuilds_from_itself(make_cfg, tmp_path, recipe):
    cls, small = RECIPES[recipe]
    train(make_cfg(f"recipe={recipe}", *small, *SHORT, output_dir=tmp_path))
    path = tmp_path / "checkpoints" / "last.ckpt"
    ckpt = torch.load(path, weights_only=True)  # no module, no callable, no OmegaConf object inside
    hparams = ckpt["hyper_parameters"]
    for key in ("net", "generator", "discriminator"):
        if key in hparams:
            assert isinstance(hparams[key], dict) and "_target_" in hparams[key]

    loaded = cls.load_from_checkpoint(path, map_location="cpu")  # no extra argument
    assert loaded.state_dict().keys() == ckpt["state_dict"].keys()
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in ckpt["state_dict"].items())
    # And it can train again: the optimizer configs came back with it.
    names = ("g_optimizer_factory", "d_optimizer_factory") if recipe == "gan" else ("optimizer_factory",)
    assert all(callable(getattr(loaded, name)) for name in names)


class TupleData(L.LightningDataModule):
    """A user's DataModule in the most common PyTorch shape: TensorDatasets, batches are [x, y] lists."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor | None = None, batch_size: int = 16) -> None:
        super().__init__()
        tensors = (x,) if y is None else (x, y)
        self.data, self.batch_size = TensorDataset(*tensors), batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size)


def _fit(module: L.LightningModule, datamodule=None, **kwargs) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=2,
        limit_val_batches=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=datamodule, **kwargs)
    return trainer


def test_tuple_batches_and_modules_built_in_python():
    """multihead and the GAN, built from Python objects (no config), on (x, y) and (x,) tuple batches."""
    x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    multihead = MultiHead(net=DeepSupervisionMLP(in_features=8, num_classes=3, width=8, depth=2), optimizer=sgd)
    assert _fit(multihead, TupleData(x, y)).global_step == 2
    assert "net" not in multihead.hparams  # a module given as is stays out of the checkpoint's hyper-parameters

    gan = GAN(generator=MLP(2, 8, 8, 1), discriminator=MLP(8, 1, 8, 1), g_optimizer=sgd, d_optimizer=sgd)
    assert _fit(gan, TupleData(x)).global_step == 2


def test_without_a_datamodule_the_first_batch_is_checked():
    """Loaders passed straight to fit(): no probe at setup, the first batch (of the sanity check) is checked."""
    x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
    wrong = MultiHead(net=MLP(8, 3, 8, 1), optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    with pytest.raises(ConfigError) as err:
        _fit(wrong, train_dataloaders=loader, val_dataloaders=loader)
    assert err.value.key == "model.net" and "one per head" in err.value.message


def test_the_check_leaves_weights_statistics_and_random_streams_alone(make_cfg):
    datamodule, module = testing.build(
        make_cfg("recipe=multihead", "model.net.batch_norm=true", "model.net.dropout=0.5")
    )
    batch = testing.first_batch(datamodule)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    rng = torch.get_rng_state()
    module.run_component_check(batch)
    assert module.training
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())  # BatchNorm's running stats too


@pytest.mark.parametrize(
    ("override", "key", "said"),
    [
        ("model.net._target_=nope.Net", "model.net._target_", "cannot import"),
        ("model.net._target_=types.SimpleNamespace", "model.net._target_", "it built a SimpleNamespace"),
        ("model.net._target_=torch.optim.SGD", "model.net.in_features", "unknown key"),
        ("+model.net.colour=red", "model.net.colour", "unknown key"),
        ("model.net.width=0", "model.net.width", "≥ 1"),
    ],
)
def test_a_bad_component_config_names_its_key(make_cfg, tmp_path, override, key, said):
    with pytest.raises(ConfigError) as err:
        train(make_cfg("recipe=multihead", override, output_dir=tmp_path))
    assert err.value.key == key
    assert said in err.value.message
    assert not (tmp_path / ".hydra").exists()


@pytest.mark.parametrize("precision", ["bf16-true", "bf16-mixed", "64-true"])
def test_the_check_runs_on_the_weights_and_inputs_of_each_precision(make_cfg, tmp_path, precision):
    """The check runs the components as a step of that precision will: the weights and inputs cast as
    Lightning casts them right after setup (true precisions), the batch of a step already converted."""
    small = ("recipe=accumulation", "model.net.width=16", "trainer.max_steps=2", "trainer.limit_val_batches=1")
    train(make_cfg(*small, "trainer.accelerator=cpu", f"trainer.precision={precision}", output_dir=tmp_path))
    assert torch.load(tmp_path / "checkpoints/last.ckpt", weights_only=True)["global_step"] == 2


@pytest.mark.parametrize("recipe", ["multihead", "accumulation"])
def test_labels_beyond_the_nets_classes_are_rejected_before_any_write(make_cfg, tmp_path, recipe):
    """Two examples (the probe) would not see it: every label of the in-memory data is checked."""
    import numpy as np

    y = np.arange(200) % 10
    y[150] = 12  # one bad label, deep in the file
    np.savez(tmp_path / "d.npz", x=np.random.default_rng(0).random((200, 64)).astype(np.float32), y=y)
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match="labels out of range") as err:
        train(make_cfg(f"recipe={recipe}", "data=npz", f"data.path={tmp_path / 'd.npz'}", output_dir=out))
    assert err.value.key == "data" and "0..12" in err.value.message and "0..9" in err.value.message
    assert not (out / ".hydra").exists()


def test_ddp_spawn_is_refused_by_name(make_cfg, tmp_path):
    with pytest.raises(ConfigError) as err:
        train(
            make_cfg("trainer.accelerator=cpu", "trainer.devices=2", "trainer.strategy=ddp_spawn", output_dir=tmp_path)
        )
    assert err.value.key == "trainer.strategy" and "spawn" in err.value.message
    assert not (tmp_path / ".hydra").exists()


def test_float64_data_trains_the_shipped_nets_in_64_true_and_is_refused_against_float32_weights(make_cfg, tmp_path):
    """``data.dtypes={x: float64}`` feeds float64 inputs: the nets' weights must be float64 too."""
    import numpy as np
    from sklearn.datasets import load_digits

    digits = load_digits()
    np.savez(tmp_path / "d.npz", x=digits.data / 16.0, y=digits.target)
    data = ("recipe=accumulation", "data=npz", f"data.path={tmp_path / 'd.npz'}", "data.dtypes={x: float64}")
    small = (
        *data,
        "model.net.width=16",
        "trainer.accelerator=cpu",
        "trainer.max_steps=2",
        "trainer.limit_val_batches=1",
    )
    with pytest.raises(ConfigError, match="Double and Float") as err:
        train(make_cfg(*small, output_dir=tmp_path / "f32"))
    assert err.value.key == "model.net"
    train(make_cfg(*small, "trainer.precision=64-true", output_dir=tmp_path / "f64"))
    weights = torch.load(tmp_path / "f64/checkpoints/last.ckpt", weights_only=True)["state_dict"]
    assert {w.dtype for w in weights.values()} == {torch.float64}


def test_the_shipped_nets_return_no_view_of_their_own_outputs():
    """Out of an FSDP2 unit a view makes torch warn that an in-place op on it could skip the unit's all-gather
    (`trainer=fsdp_cpu balancer=upgrad model.balancer.scope=global` warned twice): the shipped nets return tensors of
    their own (the one-output head's ``(batch,)`` included)."""
    x = torch.rand(4, 64)
    nets = {
        "multi-task": MultiTaskMLP({"digit": 10, "ink": 1}),
        "deep supervision": DeepSupervisionMLP(),
        "mlp": MLP(64, 1),
    }
    for name, net in nets.items():
        out = net(x)
        outputs = out.values() if isinstance(out, dict) else out if isinstance(out, list) else [out]
        assert all(t._base is None for t in outputs), name
