"""Checkpoints written before the step options and the balancer lifecycle were unified (issue 26) still load and
resume to the weights the code that wrote them reached.

``tests/data/before_issue26/<recipe>_<balancer>.ckpt``: 2 epochs of multihead / weighted with a balancer that
has parameters or state (uncertainty, dwa, gradnorm), written by the code before the change;
``....resumed_weights.pt``: that code's weights after resuming them to 3 epochs. Multihead then registered its
balancer after the net (its optimizer state in that order) and named its head count in the checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from multiloss.recipes.multihead import MultiHead
from multiloss.recipes.weighted import WeightedMultiTask

from multiloss import train

DATA = Path(__file__).parent / "data" / "before_issue26"
CASES = ["multihead_uncertainty", "weighted_uncertainty", "multihead_dwa", "weighted_gradnorm"]
RUN = (
    "model.net.width=8",
    "data.batch_size=256",
    "trainer=cpu",
    "trainer.limit_val_batches=1",
    "~callbacks.loss_curves",
)


@pytest.mark.parametrize("case", CASES)
def test_a_checkpoint_of_the_earlier_code_resumes_to_its_weights(make_cfg, tmp_path, case):
    recipe, balancer = case.split("_")
    cfg = make_cfg(
        f"recipe={recipe}", f"balancer={balancer}", *RUN, "trainer.max_epochs=3", f"ckpt_path={DATA / f'{case}.ckpt'}"
    )
    train(cfg)
    got = torch.load(tmp_path / "run/checkpoints/last.ckpt", weights_only=True)["state_dict"]
    expected = torch.load(DATA / f"{case}.resumed_weights.pt", weights_only=True)
    assert got.keys() == expected.keys()
    tensors = [k for k, v in expected.items() if isinstance(v, torch.Tensor)]  # (and a balancer's extra state)
    worst = max((got[k].float() - expected[k].float()).abs().max().item() for k in tensors)
    # The expected weights were computed on the machine that wrote them (AVX-512 kernels); another CPU's kernels
    # (AVX2: measured 3e-8 here, at HEAD as well) round the same sums differently. Exact resume on one machine is
    # proven against the straight run (tests/test_exact_resume.py); across machines, float rounding is the bound.
    assert worst <= 1e-6, f"{case}: {worst:.3g} from the weights the earlier code resumed to"


@pytest.mark.parametrize("case", CASES)
def test_a_checkpoint_of_the_earlier_code_loads_for_inference(case):
    recipe = {"multihead": MultiHead, "weighted": WeightedMultiTask}[case.split("_")[0]]
    module = recipe.load_from_checkpoint(DATA / f"{case}.ckpt", map_location="cpu", weights_only=True)
    saved = torch.load(DATA / f"{case}.ckpt", weights_only=True)["state_dict"]
    state = module.state_dict()
    differ = [
        k for k, v in saved.items() if isinstance(v, torch.Tensor) and not torch.allclose(state[k], v, 0, 0, True)
    ]  # NaN == NaN here: DWA's unknown epoch means
    assert not differ
