"""Every config file under configs/ composes, validates and instantiates (or is rejected for a stated reason)."""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path

import numpy as np
import pytest
import torch

from multiloss import testing
from multiloss.config import ConfigError, check_config
from multiloss.training import build_trainer
from tests.conftest import CONFIG_DIR, ROOT

# Groups whose options are selected on the command line as `group=option`.
GROUP_FILES = sorted(
    p
    for p in CONFIG_DIR.rglob("*.yaml")
    if p.parent != CONFIG_DIR and p.parent.name != "local" and p.parts[-3:-1] != ("hydra", "launcher")
)
# Options that need something this machine lacks (asked of the machine), and the error that says so.
NEEDS_GPU = set() if torch.cuda.is_available() else {"trainer/gpu.yaml", "trainer/ddp.yaml", "trainer/fsdp.yaml"}
# Component options, composed with the recipe whose contract they meet.
RECIPE_OF = {
    "net/deep_mlp.yaml": "multihead",
    "net/multitask_mlp.yaml": "weighted",
    "tasks/digits.yaml": "weighted",
    "net/mlp.yaml": "accumulation",
    "net/char_lstm.yaml": "tbptt",
    "generator/mlp.yaml": "gan",
    "discriminator/mlp.yaml": "gan",
    "generator/dcgan.yaml": "gan",
    "generator/stylegan2.yaml": "gan",
    "discriminator/dcgan.yaml": "gan",
    "discriminator/resnet.yaml": "gan",
    "balancer/fixed.yaml": "weighted",
    "balancer/uncertainty.yaml": "weighted",
    "balancer/dwa.yaml": "weighted",
    "balancer/pcgrad.yaml": "weighted",
    "balancer/upgrad.yaml": "weighted",
    "balancer/mgda.yaml": "weighted",
    "balancer/gradnorm.yaml": "weighted",
}


def _override(path: Path) -> str:
    rel = path.relative_to(CONFIG_DIR)
    return f"{'/'.join(rel.parts[:-1])}={rel.stem}"


@pytest.fixture
def npz_file(tmp_path):
    path = tmp_path / "arrays.npz"
    np.savez(path, x=np.random.default_rng(0).random((50, 64)), y=np.arange(50) % 10)
    return path


# Options that need an optional package (an extra): without it, building them names the key.
NEEDS_PACKAGE = {
    rel: name
    for rel, name in {
        "logger/wandb.yaml": "wandb",
        "logger/mlflow.yaml": "mlflow",
        "balancer/upgrad.yaml": "torchjd",
        "balancer/mgda.yaml": "torchjd",
    }.items()
    if not find_spec(name)
}
# hparams_search options select Hydra's Optuna sweeper, a plugin of the `optuna` extra.
HAS_OPTUNA_SWEEPER = find_spec("hydra_plugins.hydra_optuna_sweeper") is not None


def instantiate_all(cfg) -> None:
    """The run's checks (the config, then every component built), after the early check before the imports: that one
    passes too, or names the very error the run raises (`multiloss.config.early`)."""
    early = _early_verdict(cfg)
    try:
        check_config(cfg)
        testing.build(cfg)
        build_trainer(cfg)
    except ConfigError as err:
        assert early in (None, err.message), f"early: {early}\nrun:   {err.message}"
        raise
    assert early is None, f"the early check rejects what the run accepts: {early}"


def _early_verdict(cfg) -> str | None:
    import copy

    from multiloss.config import argument_checks
    from multiloss.config.early import check_early

    assert argument_checks.STRICT  # a construct the reader gets wrong fails here (tests/conftest.py)
    try:
        check_early(copy.deepcopy(cfg))
    except ConfigError as err:
        return err.message
    return None


@pytest.mark.parametrize("path", GROUP_FILES, ids=lambda p: str(p.relative_to(CONFIG_DIR)))
def test_every_config_composes_and_instantiates(make_cfg, path, npz_file):
    from multiloss.data.export import digit_images, write_image_zip, write_samples

    rel = str(path.relative_to(CONFIG_DIR))
    if rel in ("data/images.yaml", "experiment/r3gan.yaml", "experiment/stylegan2_ada.yaml"):
        write_image_zip(npz_file.with_name("images.zip"), digit_images()[:50], np.arange(50) % 10)
    if rel == "data/samples.yaml":
        write_samples(npz_file.with_name("samples"), dict(np.load(npz_file)))
    scenes = npz_file.with_name("scenes")
    if rel in ("experiment/scenes.yaml", "tasks/scenes.yaml"):
        from multiloss.data.scenes import write

        write(scenes, train=4, val=2, size=16)
    extra = {
        "data/npz.yaml": [f"data.path={npz_file}"],
        "data/images.yaml": [f"data.path={npz_file.with_name('images.zip')}", "data.channels=1", "data.flatten=true"],
        "data/samples.yaml": [f"data.path={npz_file.with_name('samples')}"],
        "data/text.yaml": [f"data.path={ROOT / 'README.md'}"],
        "callbacks/early_stopping.yaml": ["callbacks.early_stopping.monitor=val/acc"],
        "net/digit_pairs_mlp.yaml": ["experiment=digit_pairs"],
        "tasks/digit_pairs.yaml": ["experiment=digit_pairs"],
        "data/digit_pairs.yaml": ["experiment=digit_pairs"],
        "net/regression_mlp.yaml": ["experiment=task_regression"],
        "tasks/regression.yaml": ["experiment=task_regression"],
        "data/task_regression.yaml": ["experiment=task_regression"],
        "experiment/scenes.yaml": [f"data.path={scenes}"],
        "experiment/r3gan.yaml": [f"data.path={npz_file.with_name('images.zip')}", "data.channels=3"],
        "experiment/stylegan2_ada.yaml": [f"data.path={npz_file.with_name('images.zip')}", "data.channels=3"],
        "tasks/scenes.yaml": ["experiment=scenes", f"data.path={scenes}"],
    }
    if rel.startswith("hparams_search/") and not HAS_OPTUNA_SWEEPER:
        pytest.skip("the optuna extra (hydra-optuna-sweeper) is not installed")
    recipe = [f"recipe={RECIPE_OF[rel]}"] if rel in RECIPE_OF else []
    cfg = make_cfg(*recipe, _override(path), *extra.get(rel, []), quiet=False)
    if rel in NEEDS_GPU:
        with pytest.raises(ConfigError, match=r"trainer\.accelerator") as refused:
            check_config(cfg)
        assert _early_verdict(cfg) in (None, refused.value.message)
        return
    if rel in NEEDS_PACKAGE:
        with pytest.raises(ConfigError, match=NEEDS_PACKAGE[rel]):  # the key, and the package it lacks
            instantiate_all(cfg)
        return
    instantiate_all(cfg)


def test_the_default_composes_to_the_multihead_recipe(make_cfg):
    cfg = make_cfg(quiet=False)
    assert cfg.model._target_ == "multiloss.recipes.multihead.MultiHead"
    assert cfg.model.net._target_ == "multiloss.nets.DeepSupervisionMLP"
    assert cfg.model.optimizer._partial_ is True
    assert cfg.trainer.use_distributed_sampler is False


def test_a_component_option_selects_the_whole_node(tmp_path):
    """`net=<option>` replaces model.net whole: no key of the recipe's default is left over, and a user's
    option from --config-dir composes exactly as written."""
    examples = ROOT / "examples" / "configs"
    cfg = testing.compose("recipe=multihead", "net=two_head_cnn", config_dir=examples, output_dir=tmp_path)
    assert set(cfg.model.net) == {"_target_", "num_classes", "channels"}
    cfg = testing.compose("recipe=gan", "generator=residual", config_dir=examples, output_dir=tmp_path)
    assert set(cfg.model.generator) == {"_target_", "latent_dim", "data_dim", "width", "blocks"}
    assert set(cfg.model.discriminator) == {"_target_", "in_features", "out_features", "width", "depth"}  # default
    cfg = testing.compose("recipe=weighted", "tasks=shapes", config_dir=examples, output_dir=tmp_path)
    assert set(cfg.model.tasks) == {"shape", "big", "area"}


RECIPES = sorted(p.stem for p in (CONFIG_DIR / "recipe").glob("*.yaml"))


def test_a_recipe_sets_only_its_model():
    """The audit: a recipe picks its groups' defaults and fills ``model``; it forces no data.* or trainer.* key
    (its Trainer settings are configs/recipe_defaults/<recipe>.yaml, below the user's options)."""
    import yaml

    for recipe in RECIPES:
        keys = set(yaml.safe_load((CONFIG_DIR / "recipe" / f"{recipe}.yaml").read_text()))
        assert keys == {"defaults", "model"}, (recipe, keys)
        assert (CONFIG_DIR / "recipe_defaults" / f"{recipe}.yaml").is_file()


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_users_options_keep_their_values_over_the_recipes_defaults(tmp_path, recipe):
    """A data option of the user's that sets batch_size, and a trainer option that sets max_epochs, keep them
    under every recipe; a trainer option that does not set max_epochs gets the recipe's; the command line
    beats both."""
    mine = tmp_path / "my_configs"
    (mine / "data").mkdir(parents=True)
    (mine / "trainer").mkdir()
    (mine / "data" / "my_text.yaml").write_text("defaults:\n  - text\n  - _self_\nbatch_size: 20\nseq_len: 35\n")
    (mine / "trainer" / "my_trainer.yaml").write_text("defaults:\n  - default\n  - _self_\nmax_epochs: 6\n")
    (mine / "trainer" / "my_precision.yaml").write_text("defaults:\n  - default\n  - _self_\nprecision: 32-true\n")
    compose = lambda *o: testing.compose(f"recipe={recipe}", *o, config_dir=mine, output_dir=tmp_path / "run")  # noqa: E731
    recipe_epochs = compose().trainer.max_epochs
    assert isinstance(recipe_epochs, int) and recipe_epochs != 6
    cfg = compose("data=my_text", "trainer=my_trainer")
    assert (cfg.data.batch_size, cfg.data.seq_len, cfg.trainer.max_epochs) == (20, 35, 6)
    assert compose("trainer=my_precision").trainer.max_epochs == recipe_epochs
    assert (
        compose("trainer=my_trainer", "trainer.max_epochs=2", "data=my_text", "data.batch_size=8").trainer.max_epochs
        == 2
    )
    assert compose("data=my_text", "data.batch_size=8").data.batch_size == 8


@pytest.mark.parametrize("recipe", ["multihead", "tbptt"])
def test_debug_fast_runs_validation_too(make_cfg, tmp_path, recipe):
    """debug=fast: a few steps of everything, validation included, though 10 steps end before any epoch."""
    from multiloss import train

    extra = ("data.seq_len=64",) if recipe == "tbptt" else ()
    metrics = train(make_cfg(f"recipe={recipe}", "debug=fast", "trainer.accelerator=cpu", *extra, output_dir=tmp_path))
    assert any(name.startswith("val/") for name in metrics), sorted(metrics)
    header = next((tmp_path / "csv").rglob("metrics.csv")).read_text().splitlines()[0].split(",")
    assert any(col.startswith("val/") for col in header)
