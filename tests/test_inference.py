"""A checkpoint loads for inference with no extra argument: ``<Recipe>.load_from_checkpoint(path)``.

The recipes save their component configs (not modules) as hyper-parameters, so the class rebuilds
the user's networks itself; the loaded module predicts exactly what the trained one did.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from multiloss import testing, train
from tests.conftest import ONE_CPU_NO_VAL, SMALL_GAN

CASES = {
    "multihead": ("multiloss.recipes.multihead.MultiHead", ()),
    "weighted": ("multiloss.recipes.weighted.WeightedMultiTask", ()),
    "accumulation": ("multiloss.recipes.accumulation.Accumulation", ()),
    "tbptt": ("multiloss.recipes.tbptt.TruncatedBPTT", ("data.seq_len=32", "data.batch_size=8")),
    "gan": ("multiloss.recipes.gan.GAN", (*SMALL_GAN, "model.n_plot_samples=0")),
}


@pytest.mark.parametrize("recipe", list(CASES))
def test_load_from_checkpoint_needs_only_the_path(make_cfg, tmp_path, recipe):
    target, extra = CASES[recipe]
    cfg = make_cfg(f"recipe={recipe}", *ONE_CPU_NO_VAL, "trainer.max_steps=4", *extra, output_dir=tmp_path)
    train(cfg)
    module_name, _, cls_name = target.rpartition(".")
    cls = getattr(importlib.import_module(module_name), cls_name)
    model = cls.load_from_checkpoint(tmp_path / "checkpoints/last.ckpt", map_location="cpu").eval()

    trained = torch.load(tmp_path / "checkpoints/last.ckpt", weights_only=True)["state_dict"]
    for key, value in model.state_dict().items():
        assert torch.equal(value, trained[key]), key
    batch = testing.first_batch(testing.build(cfg)[0])
    with torch.no_grad():
        if recipe == "gan":
            out = model(torch.zeros(3, model.latent_dim))
            assert out.shape == (3, 2)
        elif recipe == "tbptt":
            logits, _ = model(batch["x"][:2])
            assert logits.shape[:2] == batch["x"][:2].shape
        else:
            out = model(batch["x"][:3])
            assert out is not None
