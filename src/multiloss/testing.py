"""Gradient proofs for any recipe module — the shipped ones and yours: capture, reference, compare.

A proof runs the recipe's real training step under the real Lightning Trainer, captures every
parameter's gradient just before each optimizer step (`step_gradients`), and compares it
(`assert_gradients_close`) with an independent reference computed in plain PyTorch on the same
network, the way the usual hand-written loops compute it:

- `per_head_gradients`: one ``backward(retain_graph=True)`` per head (multihead's summed backward);
- `weighted_sum_gradients`: the backward of Σ wᵢ·lossᵢ (weighted's single ``grad_tensors`` backward);
- `tbptt_gradients` / `full_bptt_gradients`: the ``repackage_hidden`` chunk loop, and one backward
  through the whole sequence (tbptt with ``chunk_length == seq_len``); `stream_gradients`: the word
  language model's loop over continuous streams, the state carried from window to window
  (tbptt with ``data.layout=streams``);
- `accumulated_gradients` / `one_batch_gradients`: k micro-batches of ``loss / k`` vs one batch of
  k·b (accumulation);
- `gan_noise`, `discriminator_gradients`, `generator_gradients`: the GAN's two steps.

A proof of your own network, in your own tests::

    from multiloss import testing

    cfg = testing.compose("recipe=multihead", "net=my_cnn", "trainer.max_steps=1", config_dir="my_configs")
    datamodule, module = testing.build(cfg)
    (grads,) = testing.step_gradients(module, datamodule, steps=1)  # the recipe's own step
    batch = testing.first_batch(datamodule)  # what that step saw: the order is a function of (seed, epoch)
    expected = testing.per_head_gradients(module.net, batch, prefix="net.")
    testing.assert_gradients_close(grads, expected)

References never call recipe code: they take the network (an ``nn.Module``), a batch and the loss,
work on a copy of the network and return ``{prefix + parameter name: gradient}``.
"""

from __future__ import annotations

import contextlib
import copy
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from hydra import compose as hydra_compose
from hydra import initialize_config_module
from hydra.core.hydra_config import HydraConfig
from lightning_utilities.core.apply_func import apply_to_collection
from omegaconf import DictConfig, open_dict
from torch import nn

from multiloss.data.batches import as_dict
from multiloss.training import build_data_and_model

Gradients = dict[str, torch.Tensor | None]

# The Hydra tree `multiloss-train` (`python train.py`) composes: the repository's configs/, installed
# as this package.
CONFIG_MODULE = "multiloss.configs"


# --- composing and building, as `python train.py` does ----------------------------------------------


def compose(
    *overrides: str,
    config_dir: str | Path | None = None,
    output_dir: str | Path | None = None,
    config_name: str = "train",
) -> DictConfig:
    """The config ``python train.py [--config-dir config_dir] <overrides>`` composes, run dir ``output_dir``.

    ``config_dir`` adds a directory of your own options (``net/my_cnn.yaml``, ...) to Hydra's search
    path, as ``--config-dir`` does. ``output_dir`` defaults to a fresh temporary directory.
    ``config_name="eval"``: what ``python eval.py`` composes (without the checkpoint's own overrides).
    """
    extra = [f"hydra.searchpath=[file://{Path(config_dir).resolve()}]"] if config_dir is not None else []
    with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        cfg = hydra_compose(config_name, overrides=[*extra, *overrides], return_hydra_config=True)
    out = Path(output_dir) if output_dir is not None else Path(tempfile.mkdtemp(prefix="multiloss-"))
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(out)
        cfg.hydra.job.num = 0
    # ${hydra:runtime.output_dir} (paths.output_dir) resolves against this, as in a real run.
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg.hydra
    return cfg


def build(cfg: DictConfig) -> tuple[L.LightningDataModule, L.LightningModule]:
    """The data module and the recipe module ``multiloss.train(cfg)`` would train (seeded by ``cfg.seed``)."""
    return build_data_and_model(cfg)


def first_batch(datamodule: L.LightningDataModule) -> dict[str, Any]:
    """The first training batch (a dict, as the recipes see it) of a fresh training loader."""
    datamodule.setup("fit")
    return as_dict(next(iter(datamodule.train_dataloader())))


# --- the recipe's own gradients ------------------------------------------------------------------------


class GradientCapture(L.Callback):
    """Copies every parameter's ``.grad`` just before each optimizer step, as Lightning computed it.

    ``steps[i]`` maps parameter name -> gradient (None where the parameter got none) for the i-th
    optimizer step, restricted to that optimizer's parameters; ``optimizer_index[i]`` says which of
    ``trainer.optimizers`` stepped. Works under automatic and manual optimization alike.
    """

    def __init__(self) -> None:
        self.steps: list[Gradients] = []
        self.optimizer_index: list[int] = []

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
        self.steps.append(_snapshot((n, p) for n, p in pl_module.named_parameters() if id(p) in owned))
        self.optimizer_index.append(next(i for i, o in enumerate(trainer.optimizers) if o is optimizer))


def step_gradients(
    module: L.LightningModule,
    datamodule: L.LightningDataModule,
    steps: int = 1,
    callbacks: Sequence[L.Callback] = (),
    **trainer_kwargs: Any,
) -> list[Gradients]:
    """The gradients of the module's first ``steps`` optimizer steps, from a real ``Trainer.fit``.

    One CPU process, no validation, logging or checkpoints unless ``trainer_kwargs`` say otherwise.
    Afterwards the module is put back at its initial weights (and buffers), the ones the first
    gradient was taken at, so a reference can start from them.
    """
    initial = copy.deepcopy(module.state_dict())
    capture = GradientCapture()
    bare_trainer(max_steps=steps, callbacks=[capture, *callbacks], **trainer_kwargs).fit(module, datamodule=datamodule)
    # Not strict: a component made during fit (multihead's balancer, once the heads are known) has no
    # initial state to go back to; everything that existed before is restored.
    module.load_state_dict(initial, strict=False)
    return capture.steps


def bare_trainer(**overrides: Any) -> L.Trainer:
    """A Trainer with nothing beside the training loop: one CPU process, no validation, logging,
    checkpoints, progress bar or summary, and the recipe's artifacts (tbptt's samples, accumulation's
    ``lr_scaling.json``) in a temporary dir rather than the working directory. ``max_epochs`` is
    Lightning's own default (1000), also with ``max_steps``, so a schedule by epochs (the GAN's
    ``linear_decay``) has a last epoch. ``overrides`` are Trainer arguments (``max_steps=1``,
    ``callbacks=[...]``)."""
    settings: dict[str, Any] = {
        "max_epochs": 1000,
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
        "use_distributed_sampler": False,
        "default_root_dir": tempfile.mkdtemp(prefix="multiloss-steps-"),
        **overrides,
    }
    return L.Trainer(**settings)


# The default tolerance of a comparison, by the dtype compared: a proof of algebraic equality belongs in float64, where
# a few steps' rounding stays near 1e-15 on any CPU; float32's default is a bound for a single step's rounding.
TOLERANCE: dict[torch.dtype, tuple[float, float]] = {torch.float64: (1e-10, 1e-10), torch.float32: (1e-6, 1e-5)}


def assert_gradients_close(
    actual: Mapping[str, torch.Tensor | None],
    expected: Mapping[str, torch.Tensor | None],
    atol: float | None = None,
    rtol: float | None = None,
    names: Iterable[str] | None = None,
) -> float:
    """Assert two name -> tensor maps agree (None only where both are None); return the largest difference.

    Compares every name of ``expected`` (or ``names``); fails on an empty comparison, so a proof
    that compared nothing cannot pass. ``atol`` / ``rtol`` default to the compared dtype's (`TOLERANCE`:
    1e-10 in float64, 1e-6 / 1e-5 in float32); tensors of two dtypes are refused (a float64 proof
    against a float32 reference proves float32's rounding).
    """
    keys = list(names) if names is not None else sorted(expected)
    assert keys, "nothing to compare"
    worst = 0.0
    for k in keys:
        assert k in actual, f"{k}: not in the captured gradients (names there: {sorted(actual)[:5]}...)"
        a, e = actual[k], expected[k]
        if e is None or a is None:
            assert a is None and e is None, f"{k}: one gradient is None, the other is not"
            continue
        assert a.dtype == e.dtype, f"{k}: {a.dtype} against {e.dtype} (run both in one dtype)"
        default_atol, default_rtol = TOLERANCE.get(a.dtype, TOLERANCE[torch.float32])
        atol_k, rtol_k = default_atol if atol is None else atol, default_rtol if rtol is None else rtol
        torch.testing.assert_close(a, e, atol=atol_k, rtol=rtol_k, msg=lambda m, k=k: f"{k}: {m}")
        worst = max(worst, (a - e).abs().max().item())
    return worst


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Inside: ``dtype`` is torch's default dtype, as a ``64-true`` run's step has float64 (Lightning's DoublePrecision
    sets it): a reference that makes tensors of the default dtype (noise from `gan_noise`, ``torch.ones``) makes them
    as the recipe's float64 step does, not rounded through float32."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def in_dtype(batch: Mapping[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """``batch`` with its floating-point tensors in ``dtype`` (a reference run in the dtype of a ``64-true`` run, whose
    Trainer casts every batch it feeds the module)."""
    return {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in batch.items()}


# --- plain-PyTorch references --------------------------------------------------------------------------


def _snapshot(named: Iterable[tuple[str, torch.Tensor]], prefix: str = "") -> Gradients:
    """A copy of each parameter's ``.grad`` (None where it has none), by ``prefix + name``."""
    return {f"{prefix}{n}": None if p.grad is None else p.grad.detach().clone() for n, p in named}


def _grads(net: nn.Module, prefix: str) -> Gradients:
    return _snapshot(net.named_parameters(), prefix)


def per_head_gradients(
    net: nn.Module,
    batch: Mapping[str, Any],
    weights: Sequence[float] | None = None,
    loss: Callable[..., torch.Tensor] = F.cross_entropy,
    prefix: str = "net.",
) -> Gradients:
    """The hand-written multi-head loop: ``(wᵢ·loss(headᵢ, y)).backward(retain_graph=True)`` for each head in turn.

    ``net(batch["x"])`` returns one output per head; gradients accumulate across the backwards.
    """
    net = copy.deepcopy(net)
    net.zero_grad(set_to_none=True)
    outputs = net(batch["x"])
    weights = [1.0] * len(outputs) if weights is None else list(weights)
    for i, (w, out) in enumerate(zip(weights, outputs, strict=True)):
        (w * loss(out, batch["y"])).backward(retain_graph=i < len(outputs) - 1)
    return _grads(net, prefix)


def _task_parts(task: Any) -> tuple[Callable[..., torch.Tensor], str, float]:
    if isinstance(task, tuple | list):
        loss, target, weight = task
        return loss, target, float(weight)
    return task.loss, task.target, float(task.weight)


def weighted_sum_gradients(
    net: nn.Module, batch: Mapping[str, Any], tasks: Mapping[str, Any], prefix: str = "net."
) -> Gradients:
    """The backward of the scalar Σ wᵢ·lossᵢ, with lossᵢ = ``loss(net(x)[name], batch[target])``.

    ``tasks`` maps each output name to ``(loss, target key, weight)`` (or to an object with those
    attributes, such as a weighted recipe's ``module.tasks``).
    """
    net = copy.deepcopy(net)
    net.zero_grad(set_to_none=True)
    outputs = net(batch["x"])
    total = 0
    for name, task in tasks.items():
        loss, target, weight = _task_parts(task)
        total = total + weight * loss(outputs[name], batch[target])
    total.backward()
    return _grads(net, prefix)


def _detach(hidden: Any) -> Any:
    return apply_to_collection(hidden, torch.Tensor, torch.Tensor.detach)


def tbptt_gradients(
    net: nn.Module,
    batch: Mapping[str, Any],
    chunk_length: int,
    lr: float = 0.0,
    every: int = 1,
    clip: float | None = None,
    prefix: str = "net.",
    count_exact: bool = False,
) -> list[Gradients]:
    """The hand-written TBPTT loop: per chunk forward, ``backward(loss / every)``, step, ``hidden.detach()``.

    Chunks are cut by index (``x[:, s:s + chunk_length]``); every ``every`` chunks (and at the last)
    the gradient is recorded, clipped by global norm to ``clip`` if given, and an SGD step of
    ``lr`` is taken by hand. A chunk's loss is its mean cross-entropy over its scored targets (not
    where ``batch["mask"]`` is 0 or the target is -100; a chunk with none adds nothing). With
    ``count_exact`` each step is instead one backward of the summed cross-entropy of all its
    chunks' scored targets divided by their number: the gradient of one batch of those tokens.
    Returns the gradient of each step (what `step_gradients` captures from the recipe with SGD at ``lr``).
    """
    net = copy.deepcopy(net)
    net.zero_grad(set_to_none=True)
    x, y = batch["x"], batch["y"]
    if "mask" in batch:
        y = y.masked_fill(batch["mask"] == 0, -100)
    starts = list(range(0, x.shape[1], chunk_length))
    hidden, steps = None, []
    step_sum, step_tokens = 0.0, 0
    for i, s in enumerate(starts):
        logits, hidden = net(x[:, s : s + chunk_length], hidden)
        target = y[:, s : s + chunk_length].reshape(-1)
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target, reduction="sum")
        tokens = int((target != -100).sum())
        if count_exact:
            step_sum, step_tokens = step_sum + nll, step_tokens + tokens
        else:
            (nll / max(tokens, 1) / every).backward()
        if (i + 1) % every == 0 or i == len(starts) - 1:
            if count_exact:
                (step_sum / max(step_tokens, 1)).backward()
                step_sum, step_tokens = 0.0, 0
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
            steps.append(_grads(net, prefix))
            with torch.no_grad():
                for p in net.parameters():
                    if p.grad is not None:
                        p -= lr * p.grad
            net.zero_grad(set_to_none=True)
        hidden = _detach(hidden)
    return steps


def stream_gradients(
    net: nn.Module,
    ids: torch.Tensor,
    streams: int,
    seq_len: int,
    chunk_length: int,
    lr: float = 0.0,
    steps: int | None = None,
    carry: bool = True,
    prefix: str = "net.",
    clip: float | None = None,
) -> list[Gradients]:
    """The word-language-model loop over continuous streams: batchify, windows in order, the state carried.

    ``ids`` (1-D) cut into ``streams`` contiguous rows (the remainder dropped); windows of ``seq_len``
    tokens in order (the last one shorter), each cut into chunks of ``chunk_length``; per chunk a
    forward from the carried state, ``backward`` of its mean cross-entropy, the gradient clipped to
    global norm ``clip`` (when set) and recorded, an SGD step of ``lr`` by hand, the state detached —
    and kept into the next window (``carry=False``: every window starts empty). Returns the first
    ``steps`` steps' gradients (all when None).
    """
    net = copy.deepcopy(net)
    rows = ids[: len(ids) // streams * streams].view(streams, -1)
    hidden, grads = None, []
    for start in range(0, rows.shape[1] - 1, seq_len):
        length = min(seq_len, rows.shape[1] - 1 - start)
        x, y = rows[:, start : start + length], rows[:, start + 1 : start + 1 + length]
        hidden = hidden if carry else None
        for c in range(0, length, chunk_length):
            net.zero_grad(set_to_none=True)
            logits, hidden = net(x[:, c : c + chunk_length], hidden)
            target = y[:, c : c + chunk_length].reshape(-1)
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target).backward()
            if clip is not None:
                nn.utils.clip_grad_norm_(net.parameters(), clip)
            grads.append(_grads(net, prefix))
            with torch.no_grad():
                for p in net.parameters():
                    if p.grad is not None:
                        p -= lr * p.grad
            hidden = _detach(hidden)
            if steps is not None and len(grads) == steps:
                return grads
    return grads


def full_bptt_gradients(net: nn.Module, batch: Mapping[str, Any], prefix: str = "net.") -> Gradients:
    """One backward through the whole sequence: the gradient truncated BPTT approximates."""
    net = copy.deepcopy(net)
    net.zero_grad(set_to_none=True)
    logits, _ = net(batch["x"], None)
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["y"].reshape(-1)).backward()
    return _grads(net, prefix)


def accumulated_gradients(
    net: nn.Module,
    micro_batches: Sequence[Mapping[str, Any]],
    loss: Callable[..., torch.Tensor] = F.cross_entropy,
    prefix: str = "net.",
) -> Gradients:
    """The hand-written accumulation loop: ``(loss(net(x), y) / k).backward()`` on each of k micro-batches."""
    net = copy.deepcopy(net)
    net.zero_grad(set_to_none=True)
    for micro in micro_batches:
        (loss(net(micro["x"]), micro["y"]) / len(micro_batches)).backward()
    return _grads(net, prefix)


def one_batch_gradients(
    net: nn.Module, batch: Mapping[str, Any], loss: Callable[..., torch.Tensor] = F.cross_entropy, prefix: str = "net."
) -> Gradients:
    """One backward of the mean loss over the whole batch."""
    return accumulated_gradients(net, [batch], loss, prefix)


def gan_noise(seed: int, n: int, latent_dim: int, draws: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The GAN recipe's training noise, drawn independently of it: ``draws`` pairs (z, ε) of ``n`` rows each.

    The recipe draws from its own generator seeded with ``model.noise_seed`` (the run's ``seed``),
    one row of ``latent_dim + 1`` standard normals per sample for each micro-batch it trains (a
    discriminator micro-batch, then each generator micro-batch): z is the row's first
    ``latent_dim`` values, ε = Φ(last value) the interpolation weight of the gradient penalty.
    Each normal is Φ⁻¹ of its own float64 uniform (at least 2⁻⁵³), in the default dtype.
    """
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(draws):
        rows = gan_normals(n, latent_dim + 1, gen)
        out.append((rows[:, :latent_dim], torch.special.ndtr(rows[:, latent_dim:])))  # Φ, as the recipe computes it
    return out


def gan_normals(n: int, width: int, generator: torch.Generator) -> torch.Tensor:
    """``n × width`` standard normals as the GAN recipe draws them from its noise stream: each Φ⁻¹ of its own float64
    uniform (at least 2⁻⁵³), in the default dtype — so a draw of n rows equals draws that split them."""
    uniform = torch.rand(n, width, generator=generator, dtype=torch.float64)
    return torch.special.ndtri(uniform.clamp(min=2.0**-53)).to(torch.get_default_dtype())


DiscriminatorReference = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (D(x), D(G(z))) -> D's loss
GeneratorReference = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]  # (D(G(z)), D(x) | None) -> G's
PenaltyReference = tuple[str, Callable[[torch.Tensor], torch.Tensor]]  # (where: real|fake|interpolates, ∇ₓD -> value)


def discriminator_gradients(
    discriminator: nn.Module,
    real: torch.Tensor,
    fake: torch.Tensor,
    loss: str | DiscriminatorReference = "nonsaturating",
    penalty: str | Mapping[str, float] = "none",
    penalty_weight: float = 0.0,
    eps: torch.Tensor | None = None,
    prefix: str = "discriminator.",
    penalty_references: Mapping[str, PenaltyReference] | None = None,
) -> Gradients:
    """D's step on detached fakes, written from the papers' formulas: nonsaturating −log σ(D(x)) − log(1 − σ(D(G(z))));
    wgan-gp D(G(z)) − D(x); hinge max(0, 1 − D(x)) + max(0, 1 + D(G(z))); lsgan ½(D(x) − 1)² + ½D(G(z))²;
    relativistic −log σ(D(x) − D(G(z))) row by row; + λ·(‖∇D(x̂)‖ − 1)² (gp), γ/2·‖∇D(x)‖² (r1) or γ/2·‖∇D(G(z))‖²
    (r2). ``penalty``: one name at ``penalty_weight``, or several, name → weight (a GAN module's ``penalties``).

    Your own loss: ``loss`` a function of D's scores (d_real, d_fake) → D's loss, written as your paper writes it
    (not your `GANLoss`: a reference never calls the code it proves); your own penalty: its name in ``penalty`` and
    ``penalty_references[name] = (at, value)``, ``at`` where ∇ₓD is taken (real, fake, interpolates at ε) and
    ``value`` ∇ₓD → the penalty (a mean over the samples)."""
    D = copy.deepcopy(discriminator)
    D.zero_grad(set_to_none=True)
    fake = fake.detach()
    d_real, d_fake = D(real), D(fake)
    formulas: dict[str, DiscriminatorReference] = {
        "wgan-gp": lambda r, f: f.mean() - r.mean(),
        "hinge": lambda r, f: torch.clamp(1 - r, min=0).mean() + torch.clamp(1 + f, min=0).mean(),
        "lsgan": lambda r, f: ((r - 1) ** 2).mean() / 2 + (f**2).mean() / 2,
        "relativistic": lambda r, f: -torch.log(torch.sigmoid(r - f)).mean(),
        "nonsaturating": lambda r, f: -torch.log(torch.sigmoid(r)).mean() - torch.log(1 - torch.sigmoid(f)).mean(),
    }
    total = (formulas[loss] if isinstance(loss, str) else loss)(d_real, d_fake)
    shipped: dict[str, PenaltyReference] = {
        "gp": ("interpolates", lambda g: ((g.reshape(len(g), -1).pow(2).sum(dim=1).sqrt() - 1) ** 2).mean()),
        "r1": ("real", lambda g: g.reshape(len(g), -1).pow(2).sum(dim=1).mean() / 2),
        "r2": ("fake", lambda g: g.reshape(len(g), -1).pow(2).sum(dim=1).mean() / 2),
    }
    references = {**shipped, **(penalty_references or {})}
    penalties = penalty if isinstance(penalty, Mapping) else ({} if penalty == "none" else {penalty: penalty_weight})
    for name, weight in penalties.items():
        where, value = references[name]
        if where == "interpolates":
            assert eps is not None, "a penalty at interpolates needs ε"
            e = eps.reshape(-1, *[1] * (real.dim() - 1))
            at = e * real + (1 - e) * fake
        else:
            at = real if where == "real" else fake
        at = at.detach().requires_grad_(True)
        scores = D(at)
        (grad,) = torch.autograd.grad(scores, at, grad_outputs=torch.ones_like(scores), create_graph=True)
        total = total + weight * value(grad)
    total.backward()
    return _grads(D, prefix)


def generator_gradients(
    generator: nn.Module,
    discriminator: nn.Module,
    z: torch.Tensor,
    loss: str | GeneratorReference = "nonsaturating",
    real: torch.Tensor | None = None,
    prefix: str = "generator.",
) -> Gradients:
    """G's step through D (whose weights get no gradient): −log σ(D(G(z))); −D(G(z)) for wgan-gp and hinge;
    ½(D(G(z)) − 1)² for lsgan; −log σ(D(G(z)) − D(x)) row by row for relativistic (``real``: the paired x). Your
    own loss: a function (D(G(z)), D(x) or None) → G's loss (D(x) given where ``real`` is)."""
    G = copy.deepcopy(generator)
    D = copy.deepcopy(discriminator).requires_grad_(False)
    G.zero_grad(set_to_none=True)
    scores = D(G(z))
    d_real = D(real) if real is not None else None
    formulas: dict[str, GeneratorReference] = {
        "wgan-gp": lambda f, r: -f.mean(),
        "hinge": lambda f, r: -f.mean(),
        "lsgan": lambda f, r: ((f - 1) ** 2).mean() / 2,
        "relativistic": lambda f, r: -torch.log(torch.sigmoid(f - r)).mean(),
        "nonsaturating": lambda f, r: -torch.log(torch.sigmoid(f)).mean(),
    }
    value = (formulas[loss] if isinstance(loss, str) else loss)(scores, d_real)
    value.backward()
    return _grads(G, prefix)


def sgd_step(net: nn.Module, gradients: Mapping[str, torch.Tensor | None], lr: float, prefix: str = "") -> nn.Module:
    """A copy of ``net`` after one plain SGD step ``w -= lr·g`` with ``gradients`` (named with ``prefix``)."""
    net = copy.deepcopy(net)
    with torch.no_grad():
        for n, p in net.named_parameters():
            g = gradients.get(f"{prefix}{n}")
            if g is not None:
                p -= lr * g
    return net


# --- the balancer protocol outside a Trainer ------------------------------------------------------


class _PlainStep:
    """What `Balanced.backward` asks of `multiloss.base.step.OptimizerStep` outside a Trainer: the backward itself."""

    @staticmethod
    def backward(loss: torch.Tensor, gradient: torch.Tensor | None = None, **kwargs: Any) -> None:
        torch.autograd.backward(loss, grad_tensors=gradient)


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def balancer_backward(
    balancer: Any,
    losses: Mapping[str, torch.Tensor],
    net: nn.Module,
    parallelism: Any = None,
    mean_over_ranks: Callable[[torch.Tensor], torch.Tensor] = _same,
    sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] = _same,
    epoch: int = 0,
) -> None:
    """One step's balancer protocol as the multi-task recipes run it, without a Trainer: `multiloss.balancers.balance`
    (``parallelism``: one device unless given; the reductions: identities on one device; ``epoch``: the step's), then
    its backward. The caller steps the optimizer and, for an ``after_step_update`` balancer, hands it the recomputed
    losses."""
    from types import SimpleNamespace

    from multiloss.balancers import balance

    one_device = SimpleNamespace(sharded=False, held={})
    balanced = balance(
        balancer,
        losses,
        net,
        parallelism or one_device,
        epoch,
        mean_over_ranks,
        sum_over_ranks,
        torch.autograd.backward,
    )
    balanced.backward(_PlainStep())
