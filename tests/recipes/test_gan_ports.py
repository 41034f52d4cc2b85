"""The canonical GAN loops, reproduced by config: DCGAN, PyTorch-GAN's WGAN-GP and the WGAN-GP paper's Algorithm 1.

Each script's networks and loop are written out in plain PyTorch (`tests.recipes.gan_references`, which names
the upstream file, commit and lines). The recipe trains the same networks — brought in as a user would, a
``generator/`` and a ``discriminator/`` option in a config dir of theirs — on the same images in the same
order, from the same initial weights, with the same noise (the recipe's documented stream,
`multiloss.testing.gan_noise`, fed to the script's loop), for 3 epochs. Then every weight and every BatchNorm
buffer (running statistics, ``num_batches_tracked``) must agree: bit for bit where the script's own float32 loop is
the subject (DCGAN on BCELoss), else in float64 (the recipe in ``trainer.precision=64-true``, the script's loop on
float64 copies, images and noise) to 1e-10.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits

from multiloss import testing, train
from multiloss.config import ConfigError
from tests.conftest import load_weights
from tests.helpers import logged_rows
from tests.recipes import gan_references as ref

N, BATCH, EPOCHS, NZ, LR, SEED = 64, 8, 3, 8, 2e-4, 0
EXACT = 1e-10  # float64: equal up to rounding, on any CPU
F64 = "trainer.precision=64-true"


def _images(size: int) -> torch.Tensor:
    """The first N digits upsampled to ``size``×``size``, in [-1, 1] (the scripts' Normalize(0.5, 0.5))."""
    digits = torch.from_numpy(load_digits().images[:N]).float() / 16.0
    return (digits.repeat_interleave(size // 8, 1).repeat_interleave(size // 8, 2) * 2 - 1).unsqueeze(1)


def _in_training_order(images: torch.Tensor) -> torch.Tensor:
    """The order ``data=npz data.shuffle=false`` serves them in: the split's fixed permutation (split_seed 0)."""
    return images[torch.from_numpy(np.random.default_rng(0).permutation(len(images)))]


def _user_dir(root: Path, generator: str, discriminator: str, **args: object) -> Path:
    """A user's config dir with the two networks as options (``generator=port``, ``discriminator=port``)."""
    arguments = "".join(f"{k}: {v}\n" for k, v in args.items())
    for group, target in (("generator", generator), ("discriminator", discriminator)):
        (root / group).mkdir(parents=True, exist_ok=True)
        keys = {
            "generator": ("nz", "ngf", "nc", "latent_dim", "img_size"),
            "discriminator": ("ndf", "nc", "img_size", "sigmoid"),
        }
        own = "".join(line for line in arguments.splitlines(keepends=True) if line.split(":")[0] in keys[group])
        (root / group / "port.yaml").write_text(f"# @package model.{group}\n_target_: {target}\n{own}")
    return root


def _overrides(images: Path, *extra: str) -> tuple[str, ...]:
    return (
        "recipe=gan",
        "generator=port",
        "discriminator=port",
        "data=npz",
        f"data.path={images}",
        "data.val_fraction=0",
        "data.shuffle=false",
        f"data.batch_size={BATCH}",
        "trainer=cpu",
        f"trainer.max_epochs={EPOCHS}",
        "trainer.limit_val_batches=0",
        "trainer.num_sanity_val_steps=0",
        f"model.latent_dim={NZ}",
        "model.n_plot_samples=0",
        "scheduler=constant",
        "optimizer@model.g_optimizer=adam",
        "optimizer@model.d_optimizer=adam",
        f"model.g_optimizer.lr={LR}",
        f"model.d_optimizer.lr={LR}",
        "model.g_optimizer.betas=[0.5,0.999]",
        "model.d_optimizer.betas=[0.5,0.999]",
        f"seed={SEED}",
        "~callbacks.loss_curves",
        *extra,
    )


def _assert_same_state(
    recipe_state: dict[str, torch.Tensor], net: torch.nn.Module, prefix: str, tolerance: float = EXACT
) -> None:
    for name, value in net.state_dict().items():
        got = recipe_state[f"{prefix}.{name}"]
        if value.is_floating_point():
            assert got.dtype == value.dtype, f"{prefix}.{name}: {got.dtype} vs {value.dtype} (run both in one dtype)"
            worst = (got - value).abs().max().item()
            assert worst <= tolerance, f"{prefix}.{name} differs by {worst:.3g}"
        else:
            assert torch.equal(got, value), f"{prefix}.{name}: {got} vs {value} (num_batches_tracked)"


def _initial(make_cfg, overrides: tuple[str, ...], config_dir: Path) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The recipe's networks as `train` builds them (seeded): the scripts start from these weights (in float64 where
    the recipe runs in 64-true)."""
    _, module = testing.build(testing.compose(*overrides, config_dir=str(config_dir)))
    dtype = torch.float64 if F64 in overrides else torch.float32
    return copy.deepcopy(module.generator).to(dtype), copy.deepcopy(module.discriminator).to(dtype)


def _color_images(n: int, size: int) -> torch.Tensor:
    """``n`` digits as 3-channel ``size``×``size`` images in [-1, 1]: the digit, its mirror image, its negative."""
    digits = torch.from_numpy(load_digits().images[:n]).float() / 16.0
    gray = digits.repeat_interleave(size // 8, 1).repeat_interleave(size // 8, 2) * 2 - 1
    return torch.stack([gray, gray.flip(-1), -gray], dim=1)


def _dcgan_dir(tmp_path: Path, images: torch.Tensor, nc: int, sigmoid: bool = False) -> Path:
    """The images as ``data=npz``'s file, and a config dir with DCGAN's two networks (nz 8, ngf = ndf 8)."""
    np.savez(tmp_path / "images.npz", x=images.numpy())
    extra = {"sigmoid": True} if sigmoid else {}
    return _user_dir(
        tmp_path / "configs",
        "tests.recipes.gan_references.DCGANGenerator",
        "tests.recipes.gan_references.DCGANDiscriminator",
        nz=NZ,
        ngf=8,
        ndf=8,
        nc=nc,
        **extra,
    )


DCGAN = ("model.penalty=none", "model.n_critic=1", "model.g_input=same_fakes")


def test_dcgan_by_config_is_the_dcgan_loop_bit_for_bit(tmp_path, make_cfg):
    """DCGAN as dcgan/main.py runs it: 3×64×64 images, batch 8, its D with the Sigmoid, ``model.loss=bce`` (BCELoss on
    D's probabilities, D's real and fake terms backwarded in turn), 24 iterations (3 epochs) with a validation each
    epoch (which must leave the training state alone). Every weight and BatchNorm buffer equal: 0.0."""
    n_train, n_val = 64, 16
    images = _color_images(n_train + n_val, 64)
    config_dir = _dcgan_dir(tmp_path, images, nc=3, sigmoid=True)
    overrides = (
        *_overrides(tmp_path / "images.npz", "model.loss=bce", *DCGAN),
        "data.val_fraction=0.2",  # 16 of 80: the split's permutation puts them first
        "trainer.limit_val_batches=null",
    )
    net_g, net_d = _initial(make_cfg, overrides, config_dir)
    order = torch.from_numpy(np.random.default_rng(0).permutation(n_train + n_val))
    train_images = images[order[n_val:]]
    batches = [train_images[i : i + BATCH] for _ in range(EPOCHS) for i in range(0, n_train, BATCH)]
    noise = iter(z for z, _ in testing.gan_noise(SEED, BATCH, NZ, draws=len(batches)))  # one draw an iteration
    ref.dcgan_loop(net_g, net_d, batches, noise, LR)  # the script's own: Sigmoid output, nn.BCELoss

    out = tmp_path / "run"
    train(testing.compose(*overrides, config_dir=str(config_dir), output_dir=out))
    state = load_weights(out / "checkpoints/last.ckpt")
    assert len(batches) == 24
    _assert_same_state(state, net_g, "generator", tolerance=0.0)  # one G forward a batch: its running statistics too
    _assert_same_state(state, net_d, "discriminator", tolerance=0.0)  # three D forwards: real, fake, G's loss
    assert int(state["generator.main.1.num_batches_tracked"]) == len(batches)
    assert any(k.startswith("val/") for k in logged_rows(out)[-1])  # it did validate


def test_the_logits_form_of_dcgan_is_its_loop_written_on_logits(tmp_path, make_cfg):
    """``model.loss=nonsaturating`` with D's logits (its Sigmoid left out) is dcgan/main.py's loop with the loss
    written on logits (softplus(∓l), the recipe's form), in float64 to 1e-10 over 3 epochs. Against the script's own
    Sigmoid + BCELoss it is the same function in another rounding, which a GAN trained with Adam amplifies:
    docs/recipes.md gives the drift measured (1e-7 after 8 iterations on some CPUs, 1e-4 on others; ~1e-3 by 24)."""
    images = _images(64)
    config_dir = _dcgan_dir(tmp_path, images, nc=1)
    overrides = _overrides(tmp_path / "images.npz", "model.loss=nonsaturating", *DCGAN, F64)
    net_g, net_d = _initial(make_cfg, overrides, config_dir)
    images = _in_training_order(images).double()
    batches = [images[i : i + BATCH] for _ in range(EPOCHS) for i in range(0, N, BATCH)]
    with testing.default_dtype(torch.float64):  # the noise as the 64-true step draws it
        noise = iter(z for z, _ in testing.gan_noise(SEED, BATCH, NZ, draws=len(batches)))
        ref.dcgan_loop(net_g, net_d, batches, noise, LR, criterion=ref.bce_on_logits)

    out = tmp_path / "run"
    train(testing.compose(*overrides, config_dir=str(config_dir), output_dir=out))
    state = load_weights(out / "checkpoints/last.ckpt")
    _assert_same_state(state, net_g, "generator")
    _assert_same_state(state, net_d, "discriminator")
    assert int(state["generator.main.1.num_batches_tracked"]) == len(batches)


def test_bce_refuses_a_discriminator_that_returns_logits(tmp_path, make_cfg):
    images = _images(64)
    config_dir = _dcgan_dir(tmp_path, images, nc=1)
    overrides = _overrides(tmp_path / "images.npz", "model.loss=bce", *DCGAN)
    # At setup when its scores on the checked examples leave [0, 1]; at the first step that shows it otherwise.
    with pytest.raises(ConfigError, match="ends in a Sigmoid") as err:
        train(testing.compose(*overrides, config_dir=str(config_dir), output_dir=tmp_path / "run"))
    assert err.value.key in ("model.discriminator", "model.loss")


def _wgan_setup(tmp_path: Path, *options: str) -> tuple[torch.Tensor, tuple[str, ...], Path]:
    images = _images(16)
    np.savez(tmp_path / "images.npz", x=images.numpy())
    config_dir = _user_dir(
        tmp_path / "configs",
        "tests.recipes.gan_references.WGANGenerator",
        "tests.recipes.gan_references.WGANCritic",
        latent_dim=NZ,
        img_size=16,
    )
    overrides = _overrides(tmp_path / "images.npz", "model.loss=wgan-gp", "model.penalty_weight=10", *options, F64)
    return images, overrides, config_dir


def test_pytorch_gans_wgan_gp_by_config_is_its_loop(tmp_path, make_cfg):
    """In float64, to 1e-10 over 3 epochs."""
    images, overrides, config_dir = _wgan_setup(
        tmp_path, "model.n_critic=5", "model.g_input=same_z", "model.g_step_after=first"
    )
    generator, critic = _initial(make_cfg, overrides, config_dir)
    images = _in_training_order(images).double()
    epochs = [[images[i : i + BATCH] for i in range(0, N, BATCH)] for _ in range(EPOCHS)]
    with testing.default_dtype(torch.float64):  # the noise as the 64-true step draws it (and the script's ones)
        noise = iter(testing.gan_noise(SEED, BATCH, NZ, draws=EPOCHS * N // BATCH))  # one (z, ε) a batch: G reuses z
        ref.pytorch_gan_wgan_gp_loop(generator, critic, epochs, noise, LR, n_critic=5, lambda_gp=10)

    out = tmp_path / "run"
    train(testing.compose(*overrides, config_dir=str(config_dir), output_dir=out))
    state = load_weights(out / "checkpoints/last.ckpt")
    _assert_same_state(state, generator, "generator")  # its BatchNorm1d ran twice on the batches G stepped on
    _assert_same_state(state, critic, "discriminator")
    # G stepped at batches 0 and 5 of each 8-batch epoch: 2 of every 8, where the paper's order gives 1.
    assert int(state["generator.model.3.num_batches_tracked"]) == EPOCHS * (8 + 2)


def test_the_default_step_is_the_wgan_gp_papers_algorithm_1(tmp_path, make_cfg):
    """In float64, to 1e-10 over 3 epochs."""
    images, overrides, config_dir = _wgan_setup(tmp_path, "model.n_critic=2")  # g_input=fresh, g_step_after=last
    generator, critic = _initial(make_cfg, overrides, config_dir)
    images = _in_training_order(images).double()
    batches = [images[i : i + BATCH] for _ in range(EPOCHS) for i in range(0, N, BATCH)]
    # A critic draw each batch, and a generator draw after every second one: the recipe's order of draws.
    with testing.default_dtype(torch.float64):  # the noise as the 64-true step draws it
        noise = iter(testing.gan_noise(SEED, BATCH, NZ, draws=len(batches) * 3 // 2))
        ref.wgan_gp_algorithm_1(generator, critic, batches, noise, LR, n_critic=2, lambda_gp=10)

    out = tmp_path / "run"
    train(testing.compose(*overrides, config_dir=str(config_dir), output_dir=out))
    state = load_weights(out / "checkpoints/last.ckpt")
    _assert_same_state(state, generator, "generator")
    _assert_same_state(state, critic, "discriminator")


def test_a_batch_norm_critic_with_a_penalty_is_refused_in_one_line(tmp_path, make_cfg):
    images = _images(64)
    config_dir = _dcgan_dir(tmp_path, images, nc=1)
    overrides = _overrides(tmp_path / "images.npz", "model.loss=wgan-gp", "model.penalty_weight=10")
    with pytest.raises(ConfigError, match="needs each sample's own gradient") as err:
        train(testing.compose(*overrides, config_dir=str(config_dir), output_dir=tmp_path / "run"))
    assert err.value.key == "model.discriminator" and "main.3" in err.value.problem
    assert "\n" not in err.value.problem and not (tmp_path / "run" / "checkpoints").exists()


def test_same_fakes_with_accumulation_is_refused_naming_both_keys(make_cfg, tmp_path):
    with pytest.raises(ConfigError) as err:
        train(make_cfg("recipe=gan", "model.g_input=same_fakes", "model.accumulate_grad_batches=2"))
    assert err.value.key == "model.g_input" and "model.accumulate_grad_batches" in err.value.accepted


@pytest.mark.parametrize(("after", "expected"), [("last", [2, 5, 8, 11]), ("first", [0, 3, 6, 9])])
def test_which_batches_the_generator_steps_after(make_cfg, after, expected):
    """n_critic=3, k=1: after the 3rd critic step of each group (the paper), or after the 1st (PyTorch-GAN)."""
    _, module = testing.build(make_cfg("recipe=gan", "model.n_critic=3", f"model.g_step_after={after}"))
    assert [b for b in range(12) if module.generator_steps_after(b)] == expected
