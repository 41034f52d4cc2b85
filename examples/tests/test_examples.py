"""The example package as a user runs it and proves it: nothing here comes from multiloss's own tests.

Each example trains through ``python train.py --config-dir examples/configs ...`` (a subprocess, as
from a shell), writes a checkpoint that loads with ``weights_only=True`` and rebuilds with
``<Recipe>.load_from_checkpoint(path, trust_checkpoint=["mypkg"])`` (a checkpoint is data: its package allowed by
name), and has its gradients proven with `multiloss.testing`
against a plain-PyTorch reference on the user's own network: in float64 (``precision="64-true"``, the batches cast as
the Trainer casts them), to `EXACT`, on any CPU.
"""

from __future__ import annotations

import copy
import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from multiloss.recipes.accumulation import Accumulation
from multiloss.recipes.gan import GAN
from multiloss.recipes.multihead import MultiHead
from multiloss.recipes.tbptt import TruncatedBPTT
from multiloss.recipes.weighted import WeightedMultiTask
from mypkg.data import write_all
from mypkg.word_corpus import write_corpus

from multiloss import testing, train
from multiloss.config import ConfigError
from multiloss.data import TextDataModule

EXAMPLES = Path(__file__).resolve().parents[1]
ROOT = EXAMPLES.parent
CONFIGS = EXAMPLES / "configs"
NOTES = EXAMPLES / "data" / "notes.txt"
WORDS = EXAMPLES / "data" / "words"

# name -> (the command line's choices, the loss columns its metrics.csv must hold)
RUNS = {
    "cnn_multihead": (("recipe=multihead", "net=two_head_cnn"), {"loss/head0", "loss/head1", "val/acc"}),
    "shapes_weighted": (
        ("recipe=weighted", "net=shapes_net", "tasks=shapes", "data=npz", "data.path={shapes}"),
        {"loss/shape", "loss/big", "loss/area", "loss/total", "val/acc/shape", "val/acc/big", "val/mae/area"},
    ),
    "residual_gan": (("recipe=gan", "generator=residual", "discriminator=residual"), {"loss/d", "loss/g", "val/modes"}),
    "gru_tbptt": (
        ("recipe=tbptt", "net=gru", "data=text", f"data.path={NOTES}", "data.seq_len=64", "data.batch_size=8"),
        {"loss/ce", "val/bpc"},
    ),
    "moons_accumulation": (
        ("recipe=accumulation", "net=small_mlp", "data=npz", "data.path={moons}", "data.batch_size=16"),
        {"loss/total", "val/acc"},
    ),
    "word_lm": (
        ("recipe=tbptt", "experiment=word_lm", "model.net.ninp=16", "model.net.nhid=16"),
        {"loss/ce", "val/ppl", "lr-SGD"},
    ),
}
RECIPES = {
    "multihead": MultiHead,
    "weighted": WeightedMultiTask,
    "gan": GAN,
    "tbptt": TruncatedBPTT,
    "accumulation": Accumulation,
}
EXACT = 1e-10  # float64: equal up to rounding (a few steps' stays near 1e-15), on any CPU
F64 = {"precision": "64-true"}  # the proofs' Trainer (step_gradients): the module and every floating input in float64
SHORT = (
    "trainer.max_epochs=1",
    "trainer.limit_train_batches=8",
    "trainer.limit_val_batches=2",
    "trainer.log_every_n_steps=1",
)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    """The example's .npz files, written by its own script (`python -m mypkg.data DIR`)."""
    return write_all(tmp_path_factory.mktemp("data"))


def _choices(name: str, data: dict[str, Path]) -> list[str]:
    return [o.format(**data) for o in RUNS[name][0]]


def _train_cli(out: Path, *overrides: str) -> subprocess.CompletedProcess:
    path = os.pathsep.join(filter(None, [str(EXAMPLES), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "PYTHONWARNINGS": "ignore"}
    quiet = ("print_config=false", "~callbacks.progress_bar", "trainer.enable_progress_bar=false")
    command = [sys.executable, str(ROOT / "train.py"), "--config-dir", str(CONFIGS), *quiet, *overrides]
    return subprocess.run(
        [*command, f"hydra.run.dir={out}"], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", RUNS)
def test_example_trains_from_the_command_line_and_its_checkpoint_loads(name, data, tmp_path):
    out = tmp_path / "run"
    proc = _train_cli(out, *_choices(name, data), *SHORT)
    assert proc.returncode == 0, proc.stderr[-3000:]

    with next(out.rglob("metrics.csv")).open(newline="") as f:
        columns = set(next(csv.reader(f)))
    assert RUNS[name][1] <= columns, columns

    ckpt_path = out / "checkpoints" / "last.ckpt"
    ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True)  # configs, not modules, inside
    recipe = RECIPES[RUNS[name][0][0].removeprefix("recipe=")]
    # A checkpoint is data: your package's components load once you allow it (multiloss.saving.trust).
    with pytest.raises(ConfigError, match=r"hyper_parameters\..*_target_=mypkg\."):
        recipe.load_from_checkpoint(ckpt_path, map_location="cpu")
    loaded = recipe.load_from_checkpoint(ckpt_path, map_location="cpu", trust_checkpoint=["mypkg"])
    for key, value in ckpt["state_dict"].items():
        assert torch.equal(loaded.state_dict()[key], value), key
    assert type(getattr(loaded, "net", getattr(loaded, "generator", None))).__module__.startswith("mypkg.")


def _build(name: str, data: dict[str, Path], *overrides: str):
    cfg = testing.compose(*_choices(name, data), *overrides, config_dir=CONFIGS)
    return cfg, *testing.build(cfg)


def _float64(batch: dict) -> dict:
    """A batch as a ``64-true`` step sees it: its floating tensors in float64 (ids and labels as they are)."""
    return testing.in_dtype(batch, torch.float64)


def test_cnn_multihead_summed_backward_equals_per_head_backwards(data):
    _, datamodule, module = _build("cnn_multihead", data)
    (grads,) = testing.step_gradients(module, datamodule, **F64)
    batch = _float64(testing.first_batch(datamodule))
    assert grads["net.conv1.0.weight"].dtype == torch.float64
    testing.assert_gradients_close(grads, testing.per_head_gradients(module.net, batch), atol=EXACT, rtol=EXACT)


def test_shapes_weighted_backward_equals_weighted_sum(data):
    _, datamodule, module = _build("shapes_weighted", data, "model.tasks.big.weight=0.5")
    (grads,) = testing.step_gradients(module, datamodule, **F64)
    served = testing.first_batch(datamodule)
    assert served["big"].dtype == torch.float32  # the data serves float32; the 64-true step casts it
    # The weights (1, 0.5, 10) are exact in float32 too: the recipe's float32-made weight buffer holds them exactly.
    expected = testing.weighted_sum_gradients(module.net, _float64(served), module.tasks)
    testing.assert_gradients_close(grads, expected, atol=EXACT, rtol=EXACT)
    assert grads["net.area.weight"].abs().sum() > 0


def test_a_gradient_balancer_finds_the_layers_the_users_heads_share(data):
    """GradNorm on the user's CNN (multihead), no key set: the auxiliary head branches off after conv1,
    so conv1 is all the heads share, and the norms Gᵢ are taken there. First step (w = 1): the task
    weights' gradient is sign(Gᵢ - Ḡ)·Gᵢ with Gᵢ = ‖∇_conv1 Lᵢ‖ (Chen et al. 2018), the net's Σ ∇Lᵢ."""
    _, datamodule, module = _build("cnn_multihead", data, "balancer=gradnorm")
    before = copy.deepcopy(module).double()  # the step's float64 weights
    (grads,) = testing.step_gradients(module, datamodule, **F64)
    batch = _float64(testing.first_batch(datamodule))
    losses = [F.cross_entropy(out, batch["y"]) for out in before.net(batch["x"])]

    def norm(loss, layer):
        return torch.cat(
            [g.reshape(-1) for g in torch.autograd.grad(loss, list(layer.parameters()), retain_graph=True)]
        ).norm()

    shared = torch.stack([norm(loss, before.net.conv1) for loss in losses])
    torch.testing.assert_close(
        grads["balancer.task_weight"], torch.sign(shared - shared.mean()) * shared, atol=EXACT, rtol=EXACT
    )
    # Not the whole body: conv2 (the final head's alone) would add to that head's norm.
    assert norm(losses[1], before.net.conv2) > 1e-3
    testing.assert_gradients_close(
        {k: v for k, v in grads.items() if k.startswith("net.")},
        testing.per_head_gradients(before.net, batch),
        atol=EXACT,
        rtol=EXACT,
    )


@pytest.mark.parametrize("loss", ["wgan-gp", "nonsaturating"])
def test_residual_gan_steps_equal_the_references(data, loss):
    lr = 0.05
    cfg, datamodule, module = _build(
        "residual_gan",
        data,
        f"model.loss={loss}",
        "model.n_critic=1",
        "optimizer@model.d_optimizer=sgd",
        f"model.d_optimizer.lr={lr}",
        "data.batch_size=64",
        # No epoch-end sample plot: it has no part in the steps.
        "model.n_plot_samples=0",
    )
    d_step, g_step = testing.step_gradients(module, datamodule, steps=2, **F64)
    real = _float64(testing.first_batch(datamodule))["x"]
    with testing.default_dtype(torch.float64):  # the recipe's noise in the dtype the 64-true step draws it in
        (z, eps), (z_g, _) = testing.gan_noise(cfg.seed, len(real), module.latent_dim, draws=2)
    with torch.no_grad():
        fake = module.generator(z)
    d_grads = testing.discriminator_gradients(module.discriminator, real, fake, loss, module.penalties, eps=eps)
    testing.assert_gradients_close(d_step, d_grads, atol=EXACT, rtol=EXACT)
    stepped = testing.sgd_step(module.discriminator, d_grads, lr, prefix="discriminator.")
    g_grads = testing.generator_gradients(module.generator, stepped, z_g, loss)
    testing.assert_gradients_close(g_step, g_grads, atol=EXACT, rtol=EXACT)


@pytest.mark.parametrize(("chunk", "every"), [(16, 1), (16, 2), (64, 1)])
def test_gru_tbptt_equals_the_detach_loop(data, chunk, every):
    lr = 0.1
    _, datamodule, module = _build(
        "gru_tbptt",
        data,
        "optimizer=sgd",
        f"model.optimizer.lr={lr}",
        "model.gradient_clip_val=null",
        f"model.chunk_length={chunk}",
        f"model.accumulate_grad_batches={every}",
    )
    n_steps = -(-(64 // chunk) // every)
    captured = testing.step_gradients(module, datamodule, steps=n_steps, **F64)
    batch = testing.first_batch(datamodule)  # token ids: nothing to cast
    reference = testing.tbptt_gradients(module.net, batch, chunk, lr=lr, every=every)
    assert len(captured) == len(reference) == n_steps
    for got, want in zip(captured, reference):
        testing.assert_gradients_close(got, want, atol=EXACT, rtol=EXACT)
    if chunk == 64:  # one chunk of the whole sequence: full BPTT
        full = testing.full_bptt_gradients(module.net, batch)
        testing.assert_gradients_close(captured[0], full, atol=EXACT, rtol=EXACT)


def test_moons_accumulation_equals_one_big_batch(data):
    _, datamodule, module = _build("moons_accumulation", data, "model.accumulate_grad_batches=4")
    (grads,) = testing.step_gradients(module, datamodule, **F64)
    datamodule.setup("fit")
    micro = [_float64(batch) for batch, _ in zip(datamodule.train_dataloader(), range(4))]
    whole = {k: torch.cat([m[k] for m in micro]) for k in micro[0]}
    accumulated = testing.accumulated_gradients(module.net, micro)
    testing.assert_gradients_close(grads, accumulated, atol=EXACT, rtol=EXACT)
    testing.assert_gradients_close(grads, testing.one_batch_gradients(module.net, whole), atol=EXACT, rtol=EXACT)


def test_resume_with_user_components_is_exact(data, tmp_path):
    """ckpt_path= with the user's GRU: 2 + 2 batches == 4 straight (the config is in the checkpoint)."""
    common = (*_choices("gru_tbptt", data), "trainer.max_epochs=1", "trainer.limit_val_batches=0")
    common = (*common, "logger=none")
    straight, first, resumed = tmp_path / "straight", tmp_path / "first", tmp_path / "resumed"
    train(testing.compose(*common, "trainer.max_steps=8", config_dir=CONFIGS, output_dir=straight))
    train(testing.compose(*common, "trainer.max_steps=4", config_dir=CONFIGS, output_dir=first))
    ckpt = first / "checkpoints" / "last.ckpt"
    train(testing.compose(*common, "trainer.max_steps=8", f"ckpt_path={ckpt}", config_dir=CONFIGS, output_dir=resumed))
    a = torch.load(straight / "checkpoints/last.ckpt", weights_only=True)["state_dict"]
    b = torch.load(resumed / "checkpoints/last.ckpt", weights_only=True)["state_dict"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_command_line_resumes_and_evaluates_a_user_components_checkpoint_once_its_config_dir_is_named(
    data, tmp_path
):
    """From the command line, the run's overrides coming from its checkpoint: the user's config dir named again (a
    checkpoint adds none by itself), 4 + 4 steps == 8 straight; unnamed, one message says which dir to name."""
    common = (*_choices("gru_tbptt", data), "trainer.max_epochs=1", "trainer.limit_val_batches=0", "logger=none")
    straight, first, resumed = tmp_path / "straight", tmp_path / "first", tmp_path / "resumed"
    for out, steps in ((straight, 8), (first, 4)):
        proc = _train_cli(out, *common, f"trainer.max_steps={steps}")
        assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = first / "checkpoints" / "last.ckpt"
    refused = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), f"ckpt_path={ckpt}", f"hydra.run.dir={resumed}"],
        env={**os.environ, "PYTHONPATH": str(EXAMPLES), "PYTHONWARNINGS": "ignore", "HYDRA_FULL_ERROR": "0"},
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert refused.returncode == 2 and f"--config-dir {CONFIGS}" in refused.stderr, refused.stderr[-3000:]
    assert not resumed.exists()
    proc = _train_cli(resumed, f"ckpt_path={ckpt}", "trainer.max_steps=8")  # --config-dir examples/configs
    assert proc.returncode == 0, proc.stderr[-3000:]
    a = torch.load(straight / "checkpoints/last.ckpt", weights_only=True)["state_dict"]
    b = torch.load(resumed / "checkpoints/last.ckpt", weights_only=True)["state_dict"]
    assert all(torch.equal(a[k], b[k]) for k in a)


# --- the word language model (experiment=word_lm) -------------------------------------------------------

# The shipped corpus by absolute path: the experiment's own paths are relative to the repository's root.
WORD_FILES = tuple(
    f"data.{key}={WORDS / name}"
    for key, name in (("path", "train.txt"), ("val_path", "valid.txt"), ("test_path", "test.txt"))
)


def _script_corpus(directory: Path) -> tuple[dict[str, int], dict[str, list[int]]]:
    """word_language_model's Corpus, from its description: each file's lines split on whitespace plus
    ``<eos>``, every word added to one dictionary (train, then valid, then test) in order of first sight."""
    dictionary: dict[str, int] = {}
    ids = {}
    for part in ("train", "valid", "test"):
        with open(directory / f"{part}.txt", encoding="utf8") as f:
            words = [w for line in f for w in [*line.split(), "<eos>"]]
        ids[part] = [dictionary.setdefault(w, len(dictionary)) for w in words]
    return dictionary, ids


def test_the_word_corpus_reads_as_the_scripts_corpus():
    """Its Corpus adds valid's and test's words to the dictionary; data.level=words takes train's (and <unk>
    for the rest). On the shipped corpus, as on WikiText, they are the same ids: no word of valid or test
    is missing from train."""
    dm = TextDataModule(
        str(WORDS / "train.txt"),
        val_path=str(WORDS / "valid.txt"),
        test_path=str(WORDS / "test.txt"),
        level="words",
        layout="streams",
        seq_len=35,
        batch_size=20,
    )
    dictionary, ids = _script_corpus(WORDS)
    assert dm.vocab.spec == list(dictionary) and len(dm.vocab) == 1640
    for part, key in (("train", "train"), ("valid", "val"), ("test", "test")):
        assert dm.ids[key].tolist() == ids[part], part


def test_the_corpus_script_writes_wikitext_shaped_files(tmp_path):
    """From this Python's documentation (the shipped files are Python 3.11's): every valid/test word is a
    train word, rare words are <unk>, no blank line."""
    paths = write_corpus(tmp_path)
    words = {part: path.read_text(encoding="utf-8").split() for part, path in paths.items()}
    assert len(words["train"]) > 50_000 and "<unk>" in words["train"]
    assert set(words["valid"]) | set(words["test"]) <= set(words["train"])
    assert all(line.strip() for path in paths.values() for line in path.read_text(encoding="utf-8").splitlines())


def test_the_word_lm_steps_are_the_scripts_steps():
    """The user's RNNModel (dropout 0: the same draws on both sides) under recipe=tbptt and under the script's
    train() loop written out (`testing.stream_gradients`): batchify into 20 streams, windows of 35, one
    backward per window from the carried state, the gradient clipped to norm 0.25, SGD at lr 20. The first
    window starts empty, the next ones from the carried state, to the epoch's last (shorter) window."""
    cfg = testing.compose(
        "experiment=word_lm",
        *WORD_FILES,
        "model.net.ninp=16",
        "model.net.nhid=16",
        "model.net.dropout=0",
        config_dir=CONFIGS,
    )
    datamodule, module = testing.build(cfg)
    steps = 6
    captured = testing.step_gradients(module, datamodule, steps=steps, **F64)
    reference = testing.stream_gradients(module.net, datamodule.train_ids, 20, 35, 35, lr=20.0, steps=steps, clip=0.25)
    assert len(captured) == len(reference) == steps
    for got, want in zip(captured, reference):
        testing.assert_gradients_close(got, want, atol=EXACT, rtol=EXACT)
    norms = [float(torch.cat([g.flatten() for g in step.values()]).norm()) for step in captured]
    # The clip acted (here on steps 3 and 4, whose gradients were longer), and no step went beyond it. clip_grad_norm_
    # scales a gradient of norm N > 0.25 by 0.25 / (N + 1e-6): to 0.25·N/(N + 1e-6), short of 0.25 by less than
    # 1e-6 / 0.25 = 4e-6 of it (float64's rounding adds ~1e-16).
    assert all(n <= 0.25 * (1 + EXACT) for n in norms)
    assert any(n == pytest.approx(0.25, rel=4e-6 + EXACT) for n in norms)
