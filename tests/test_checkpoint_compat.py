"""Checkpoints written by earlier code still load and resume to the weights the code that wrote them reached.

Checkpoints that name multihead's head count (written before the step options and the balancer lifecycle were
one), and checkpoints of every recipe, a sharded run's directory included, written by commit e12c38f (the last
before the step, the parallelism, the balancers and a run's saved state had one owner each:
``tests/data/checkpoints_of_e12c38f/make.py`` wrote them).

``tests/data/checkpoints_naming_a_head_count/<recipe>_<balancer>.ckpt``: 2 epochs of multihead / weighted with a
balancer that has parameters or state (uncertainty, dwa, gradnorm), written by the code before the change;
``....resumed_weights.pt``: that code's weights after resuming them to 3 epochs. Multihead then registered its
balancer after the net (its optimizer state in that order) and named its head count in the checkpoint.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from multiloss.recipes.accumulation import Accumulation
from multiloss.recipes.gan import GAN
from multiloss.recipes.multihead import MultiHead
from multiloss.recipes.tbptt import TruncatedBPTT
from multiloss.recipes.weighted import WeightedMultiTask

from multiloss import train
from tests.conftest import QUIET, load_weights, run_cli

DATA = Path(__file__).parent / "data" / "checkpoints_naming_a_head_count"
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


E12C38F = DATA.parent / "checkpoints_of_e12c38f"
_spec = importlib.util.spec_from_file_location("make_checkpoints_of_e12c38f", E12C38F / "make.py")
MADE = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(MADE)
RECIPES = {
    "multihead": MultiHead,
    "weighted": WeightedMultiTask,
    "accumulation": Accumulation,
    "tbptt": TruncatedBPTT,
    "gan": GAN,
}
ONE_PROCESS = [case for case in MADE.CASES if "fsdp" not in case]


def _assert_resumed_to(got: dict, case: str) -> None:
    expected = torch.load(E12C38F / f"{case}.resumed_weights.pt", weights_only=True)
    assert got.keys() == expected.keys()
    tensors = [k for k, v in expected.items() if isinstance(v, torch.Tensor) and v.is_floating_point()]
    worst = max((got[k].float() - expected[k].float()).abs().max().item() for k in tensors)
    assert worst <= 1e-6, f"{case}: {worst:.3g} from the weights the earlier code resumed to"


@pytest.mark.parametrize("case", ONE_PROCESS)
def test_a_checkpoint_of_every_recipe_of_e12c38f_resumes_to_its_weights(make_cfg, tmp_path, case):
    overrides = [o for o in (*MADE.QUIET, *MADE.CASES[case]) if o not in QUIET]  # (make_cfg adds QUIET)
    # The run's own command line, but for the key since renamed: `model.gp_weight` is no longer in the config, and
    # `+model.gp_weight=<λ>` still means penalty=gp at λ (what the checkpoint's hyper-parameters say too).
    overrides = [f"+{o}" if o.startswith("model.gp_weight=") else o for o in overrides]
    cfg = make_cfg(*overrides, "trainer.max_epochs=3", f"ckpt_path={E12C38F / f'{case}.ckpt'}")
    train(cfg)
    _assert_resumed_to(torch.load(tmp_path / "run/checkpoints/last.ckpt", weights_only=True)["state_dict"], case)


@pytest.mark.distributed
@pytest.mark.slow
def test_a_sharded_checkpoint_of_e12c38f_resumes_sharded_to_its_weights(tmp_path):
    case = "weighted_uncertainty_fsdp"
    out = tmp_path / "run"
    ckpt = f"ckpt_path={E12C38F / f'{case}.ckpt'}"
    proc = run_cli(*MADE.QUIET, *MADE.CASES[case], "trainer.max_epochs=3", ckpt, f"hydra.run.dir={out}", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _assert_resumed_to(load_weights(out / "checkpoints/last.ckpt"), case)


@pytest.mark.parametrize("case", list(MADE.CASES))
def test_a_checkpoint_of_every_recipe_of_e12c38f_loads_for_inference(case):
    ckpt = E12C38F / f"{case}.ckpt"  # the sharded run's directory too, read whole
    module = RECIPES[case.split("_")[0]].load_from_checkpoint(ckpt, map_location="cpu", weights_only=True)
    saved = load_weights(ckpt)
    state = module.state_dict()
    assert not [k for k, v in saved.items() if isinstance(v, torch.Tensor) and not torch.equal(state[k], v)]


def test_every_module_path_of_an_earlier_layout_is_mapped_where_a_config_or_checkpoint_is_read():
    """Users' YAML (`multiloss.fsdp.FSDPStrategy`), old checkpoints' hyper-parameters (`multiloss.schedules.*`,
    `multiloss.dense_tasks.*`) name modules that moved into packages by concern: each old module name maps to a module
    that imports and whose source the early config check reads, a config's strings are rewritten in place, and no
    finder is installed on ``sys.meta_path`` by ``import multiloss`` (old ``from multiloss.module import …`` imports
    are gone: a 0.x interface change)."""
    import importlib
    import sys

    from omegaconf import OmegaConf

    from multiloss.config import source
    from multiloss.config.renamed import MOVED, current_name, rename_targets

    for old in MOVED:
        new = current_name(f"{old}.X").removesuffix(".X")
        assert importlib.import_module(new) is not None, (old, new)
        assert source.parsed(new) is not None, new
    assert current_name("multiloss.schedules.Constant") == "multiloss.base.schedules.Constant"
    assert current_name("multiloss.multitask.MultiTaskRecipe") == "multiloss.multitask.recipe.MultiTaskRecipe"
    assert current_name("multiloss.multitask.tasks.build_tasks") == "multiloss.multitask.tasks.build_tasks"
    assert current_name("multiloss.nets.MLP") == "multiloss.nets.MLP"
    cfg = OmegaConf.create(
        {"a": {"_target_": "multiloss.fsdp.FSDPStrategy"}, "b": ["multiloss.dense_tasks.depth_loss", "${a._target_}"]}
    )
    rename_targets(cfg)
    assert cfg.a._target_ == "multiloss.parallel.fsdp.FSDPStrategy"
    assert list(cfg.b) == ["multiloss.multitask.dense.depth_loss", "multiloss.parallel.fsdp.FSDPStrategy"]
    assert not any(type(finder).__module__.startswith("multiloss") for finder in sys.meta_path)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("multiloss.module")


def test_a_checkpoint_naming_the_earlier_layouts_paths_resumes(make_cfg, tmp_path):
    """A checkpoint whose hyper-parameters and learning-rate plan name the schedule and balancer at their old paths
    (as every checkpoint before the move does) loads for inference and resumes under the same schedule."""
    import re

    common = (*RUN, "recipe=multihead", "scheduler=warmup_cosine", "model.scheduler.warmup_steps=2", "balancer=pcgrad")
    train(make_cfg(*common, "trainer.max_steps=3", output_dir=tmp_path / "new"))
    checkpoint = torch.load(tmp_path / "new/checkpoints/last.ckpt", weights_only=True)

    def old_paths(value):
        if isinstance(value, str):
            return re.sub(r"multiloss\.base\.schedules\b", "multiloss.schedules", value)
        if isinstance(value, dict):
            return {k: old_paths(v) for k, v in value.items()}
        if isinstance(value, list):
            return [old_paths(v) for v in value]
        return value

    written = {
        k: old_paths(v) if k in ("hyper_parameters", "multiloss_learning_rates") else v for k, v in checkpoint.items()
    }
    assert "multiloss.schedules.WarmupCosine" in repr(written["hyper_parameters"])
    old = tmp_path / "old.ckpt"
    torch.save(written, old)
    assert isinstance(MultiHead.load_from_checkpoint(old, map_location="cpu"), MultiHead)
    train(make_cfg(*common, "trainer.max_steps=6", f"ckpt_path={old}", output_dir=tmp_path / "resumed"))
    assert torch.load(tmp_path / "resumed/checkpoints/last.ckpt", weights_only=True)["global_step"] == 6
