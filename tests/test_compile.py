"""``model.compile=true``: every recipe's step is the eager step's arithmetic, compiled (`components.compile_in_place`).

The eager steps are proven against plain-PyTorch references in ``tests/recipes``; here the compiled
recipe's first two optimizer steps match the eager recipe's, and multihead's also the per-head reference
directly. Both run in float64 (``precision="64-true"``); inductor fuses and reorders the float operations, so
they agree to float64's rounding (`EXACT`), not bit for bit. Checkpoints keep the eager names.
"""

from __future__ import annotations

import pytest
import torch

from multiloss import testing
from tests.conftest import BARE, SMALL_GAN

# Compiled = eager in float64: inductor reorders and fuses sums, and a sum of n terms reordered moves by at most
# (n − 1)·2⁻⁵³ of the sum of their magnitudes; these nets' sums have n ≤ a few hundred (batch ≤ 64, width ≤ 128), so
# each op stays within ~1e-13 of its terms' scale, and two steps (Adam's first update g/(|g| + ε) is insensitive to a
# relative change of g where |g| ≫ ε) keep the gradients within 1e-10 with orders to spare (measured: ≤ 2e-15 relative).
EXACT = 1e-10

RECIPES = {
    "multihead": ("data.batch_size=32",),
    "weighted": ("data.batch_size=32",),
    "accumulation": ("data.batch_size=16", "model.accumulate_grad_batches=2"),
    "tbptt": ("data.seq_len=16", "data.batch_size=4", "model.chunk_length=8", "model.net.hidden_size=32"),
    # No epoch-end sample plot: it has no part in the step.
    "gan": (*SMALL_GAN, "data.batch_size=64", "model.n_plot_samples=0"),
}

pytestmark = pytest.mark.slow


def _gradients(make_cfg, recipe: str, compile: bool) -> tuple[list[testing.Gradients], torch.nn.Module]:
    cfg = make_cfg(f"recipe={recipe}", *BARE, *RECIPES[recipe], f"model.compile={str(compile).lower()}")
    datamodule, model = testing.build(cfg)
    return testing.step_gradients(model, datamodule, steps=2, precision="64-true"), model


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_compiled_steps_equal_eager_steps(make_cfg, recipe):
    compiled, model = _gradients(make_cfg, recipe, compile=True)
    eager, _ = _gradients(make_cfg, recipe, compile=False)
    assert len(compiled) == len(eager) >= 2
    for got, expected in zip(compiled, eager):
        testing.assert_gradients_close(got, expected, atol=EXACT, rtol=EXACT)
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
    (grads,) = testing.step_gradients(model, datamodule, steps=1, precision="64-true")
    reference = testing.per_head_gradients(model.net, testing.in_dtype(testing.first_batch(datamodule), torch.float64))
    testing.assert_gradients_close(grads, reference, atol=EXACT, rtol=EXACT)
