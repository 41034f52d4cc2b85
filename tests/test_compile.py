"""``model.compile=true``: every recipe's step is the eager step's arithmetic, compiled (`components.compile_in_place`).

The eager steps are proven against plain-PyTorch references in ``tests/recipes``; here the compiled
recipe's first two optimizer steps match the eager recipe's (inductor fuses and reorders float
operations, so to float tolerance, not bit for bit), and multihead's also the per-head reference
directly. Checkpoints keep the eager names.
"""

from __future__ import annotations

import pytest
import torch

from multiloss import testing
from tests.conftest import BARE, SMALL_GAN

RECIPES = {
    "multihead": ("data.batch_size=32",),
    "weighted": ("data.batch_size=32",),
    "accumulation": ("data.batch_size=16", "model.accumulate_grad_batches=2"),
    "tbptt": ("data.seq_len=16", "data.batch_size=4", "model.chunk_length=8", "model.net.hidden_size=32"),
    "gan": (*SMALL_GAN, "data.batch_size=64"),
}

pytestmark = pytest.mark.slow


def _gradients(make_cfg, recipe: str, compile: bool) -> tuple[list[testing.Gradients], torch.nn.Module]:
    cfg = make_cfg(f"recipe={recipe}", *BARE, *RECIPES[recipe], f"model.compile={str(compile).lower()}")
    datamodule, model = testing.build(cfg)
    return testing.step_gradients(model, datamodule, steps=2), model


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_compiled_steps_equal_eager_steps(make_cfg, recipe):
    compiled, model = _gradients(make_cfg, recipe, compile=True)
    eager, _ = _gradients(make_cfg, recipe, compile=False)
    assert len(compiled) == len(eager) >= 2
    for got, expected in zip(compiled, eager):
        testing.assert_gradients_close(got, expected, atol=1e-5, rtol=1e-4)
    compiled_names = [name for name in model.components if getattr(model, name)._compiled_call_impl is not None]
    if recipe == "gan":  # the gradient penalty's double backward keeps the critic eager
        assert compiled_names == ["generator"]
    else:
        assert compiled_names == ["net"]
    # In place: the state dict (and so a checkpoint) has the eager names.
    assert not any("_orig_mod" in key for key in model.state_dict())


def test_compiled_multihead_equals_the_per_head_reference(make_cfg):
    cfg = make_cfg("recipe=multihead", *BARE, "data.batch_size=32", "model.compile=true")
    datamodule, model = testing.build(cfg)
    (grads,) = testing.step_gradients(model, datamodule, steps=1)
    reference = testing.per_head_gradients(model.net, testing.first_batch(datamodule))
    testing.assert_gradients_close(grads, reference, atol=1e-5, rtol=1e-4)
