"""`tbptt`: truncated BPTT under the real Trainer == hand-written plain-PyTorch references.

The recipe's gradients are captured just before each optimizer step of a real `Trainer.fit`; the
references below are written from scratch: an LSTM cell spelled out gate by gate from the
module's weights, chunks cut by index, the ``repackage_hidden`` loop, SGD by hand. Then the
memory proof (bytes autograd saves for backward, counted with ``saved_tensors_hooks``) and the
classic pitfall, shown on the real module with the detach removed.

The proofs run in float64 (``trainer.precision=64-true``, the references on float64 copies of the
weights) and hold to `EXACT`: equal up to float64 rounding, on any CPU.
"""

from __future__ import annotations

import copy
import math
import weakref

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from multiloss.recipes.tbptt import TruncatedBPTT
from omegaconf import OmegaConf

from multiloss import ConfigError, testing, train
from multiloss.data.text import TextDataModule, Vocabulary, pydoc_text
from multiloss.testing import GradientCapture, assert_gradients_close
from tests.conftest import load_weights, run_cli
from tests.helpers import padded_tbptt, padded_token_npz, straight_and_resumed

TINY = (
    "recipe=tbptt",
    "model.net.embedding_dim=8",
    "model.net.hidden_size=16",
    "data.batch_size=4",
    "trainer.accelerator=cpu",
    "trainer.devices=1",
)
ONE_BATCH = (
    *TINY,
    "model.gradient_clip_val=null",
    "trainer.num_sanity_val_steps=0",
    "trainer.limit_val_batches=0",
    "logger=none",
    "callbacks=none",
)
F64 = "trainer.precision=64-true"  # the proofs' runs: Lightning casts the module and every floating input to float64
EXACT = 1e-10  # float64: equal up to rounding (a few steps' rounding stays near 1e-15), on any CPU
# The validation scores tbptt logs are accumulated in float32 whatever the run's dtype (recipes/tbptt.py: each chunk's
# summed nll `.float()`, their float32 sum, the float32 MeanMetric of the logged means; torchmetrics' Perplexity on
# `logits.float()`). Along that path a score of float64 logits meets at most ~10 roundings, each ≤ 2⁻²⁴ relative of a
# positive value: 32·2⁻²⁴ (1.9e-6) bounds the relative error against a float64 recomputation with a factor 3 to spare.
FLOAT32_SCORE = 32 * 2**-24


# ----------------------------------------------------------------------------- references


def reference_lstm(p: dict[str, torch.Tensor], x: torch.Tensor, hidden=None):
    """Embedding -> one LSTM layer, gate by gate (PyTorch's i, f, g, o order) -> linear head.

    ``p``: the recipe module's parameters by name (``net.embed.weight``, ...).
    """
    p = {k.removeprefix("net."): v for k, v in p.items()}
    emb = p["embed.weight"][x]
    batch, hidden_size = x.shape[0], p["lstm.weight_hh_l0"].shape[1]
    h, c = hidden if hidden is not None else (emb.new_zeros(batch, hidden_size), emb.new_zeros(batch, hidden_size))
    outs = []
    for t in range(x.shape[1]):
        gates = emb[:, t] @ p["lstm.weight_ih_l0"].T + p["lstm.bias_ih_l0"] + h @ p["lstm.weight_hh_l0"].T
        i, f, g, o = (gates + p["lstm.bias_hh_l0"]).chunk(4, dim=1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        outs.append(h)
    logits = torch.stack(outs, dim=1) @ p["head.weight"].T + p["head.bias"]
    return logits, (h, c)


def repackage_hidden(hidden):
    """PyTorch word_language_model's helper: new tensors with the same values, no history."""
    return tuple(t.detach() for t in hidden)


def reference_tbptt(initial, batch, chunk_length, lr=0.1, every=1):
    """The hand-written TBPTT loop: per chunk forward, backward, (every k chunks) SGD step, detach.

    Returns the gradient in effect at each optimizer step (what GradientCapture sees in the recipe).
    """
    p = {k: v.detach().clone().requires_grad_() for k, v in initial.items()}
    x, y = batch["x"], batch["y"]
    starts = list(range(0, x.shape[1], chunk_length))
    hidden, steps = None, []
    for i, s in enumerate(starts):
        xc, yc = x[:, s : s + chunk_length], y[:, s : s + chunk_length]
        logits, hidden = reference_lstm(p, xc, hidden)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), yc.reshape(-1)) / every
        loss.backward()
        if (i + 1) % every == 0 or i == len(starts) - 1:
            steps.append({k: v.grad.clone() for k, v in p.items()})
            with torch.no_grad():
                for v in p.values():
                    v -= lr * v.grad
                    v.grad = None
        hidden = repackage_hidden(hidden)
    return steps


def full_bptt_grads(initial, batch):
    """One backward through the whole sequence: the gradient truncation approximates."""
    p = {k: v.detach().clone().requires_grad_() for k, v in initial.items()}
    logits, _ = reference_lstm(p, batch["x"])
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["y"].reshape(-1)).backward()
    return {k: v.grad for k, v in p.items()}


# ---------------------------------------------------------------------------------- runs


def _fit_one_batch(
    make_cfg, *overrides, target: str | None = None, callbacks=(), steps: int | None = None, float64: bool = True
):
    """A real Trainer.fit over the first batch; returns captured grads, initial params and the batch.

    ``float64``: the run at ``64-true`` and the initial params as float64 copies (the proofs); False: float32 (the
    memory proofs count float32 bytes)."""
    cfg = make_cfg(*ONE_BATCH, *((F64,) if float64 else ()), *overrides)
    if target is not None:
        OmegaConf.update(cfg, "model._target_", target)
    datamodule, model = testing.build(cfg)
    dtype = torch.float64 if float64 else torch.float32
    initial = {k: v.detach().clone().to(dtype) for k, v in model.named_parameters()}
    capture = GradientCapture()
    if steps is None:  # one batch: as many steps as that batch's optimizer steps
        n_chunks = math.ceil(cfg.data.seq_len / cfg.model.chunk_length)
        steps = math.ceil(n_chunks / cfg.model.accumulate_grad_batches)
    trainer = instantiate(
        cfg.trainer,
        callbacks=[capture, *callbacks],
        logger=False,
        enable_checkpointing=False,
        max_steps=steps,
    )
    trainer.fit(model, datamodule=datamodule)
    return capture.steps, initial, testing.first_batch(datamodule)


# -------------------------------------------------------------------------------- proofs


def test_one_chunk_of_the_whole_sequence_is_full_bptt(make_cfg):
    captured, initial, batch = _fit_one_batch(make_cfg, "data.seq_len=24", "model.chunk_length=24")
    assert len(captured) == 1
    full = full_bptt_grads(initial, batch)
    assert captured[0]["net.head.bias"].dtype == torch.float64
    assert_gradients_close(captured[0], full, atol=EXACT, rtol=EXACT)
    # Not vacuous: truncating the same sequence into chunks of 8 changes the (first) gradient.
    truncated = reference_tbptt(initial, batch, chunk_length=8)[0]
    assert (truncated["net.lstm.weight_hh_l0"] - full["net.lstm.weight_hh_l0"]).abs().max() > 1e-4


def test_chunk_by_chunk_equals_repackage_hidden_loop(make_cfg):
    # 40 = 16 + 16 + 8: torch.split by length gives 3 chunks (tensor_split(x, 16) would give 16).
    captured, initial, batch = _fit_one_batch(
        make_cfg, "optimizer=sgd", "model.optimizer.lr=0.1", "data.seq_len=40", "model.chunk_length=16"
    )
    reference = reference_tbptt(initial, batch, chunk_length=16, lr=0.1)
    assert len(captured) == len(reference) == 3
    for got, want in zip(captured, reference):
        assert_gradients_close(got, want, atol=EXACT, rtol=EXACT)
    # The steps are real: the second chunk's gradient was taken at updated weights.
    assert (captured[1]["net.head.bias"] - captured[0]["net.head.bias"]).abs().max() > 1e-4


@pytest.mark.parametrize(("seq_len", "chunk", "every"), [(40, 16, 1), (32, 8, 2), (24, 24, 1)])
def test_multiloss_testing_references_prove_the_recipe(make_cfg, seq_len, chunk, every):
    """The public helpers a user proves their own net with: the recipe's steps == the repackage_hidden
    loop (SGD by hand between steps), and one chunk of the whole sequence == full BPTT."""
    cfg = make_cfg(
        *ONE_BATCH,
        "optimizer=sgd",
        "model.optimizer.lr=0.1",
        f"data.seq_len={seq_len}",
        f"model.chunk_length={chunk}",
        f"model.accumulate_grad_batches={every}",
    )
    datamodule, model = testing.build(cfg)
    n_steps = math.ceil(math.ceil(seq_len / chunk) / every)
    captured = testing.step_gradients(model, datamodule, steps=n_steps, precision="64-true")  # model.net: float64 now
    batch = testing.first_batch(datamodule)  # token ids: nothing to cast
    reference = testing.tbptt_gradients(model.net, batch, chunk_length=chunk, lr=0.1, every=every)
    assert len(captured) == len(reference) == n_steps
    for got, want in zip(captured, reference):
        testing.assert_gradients_close(got, want, atol=EXACT, rtol=EXACT)
    if chunk >= seq_len:
        full = testing.full_bptt_gradients(model.net, batch)
        testing.assert_gradients_close(captured[0], full, atol=EXACT, rtol=EXACT)


def test_accumulation_sums_consecutive_chunks(make_cfg):
    # 4 chunks, k = 2: two steps per batch, each on (g_chunk_a + g_chunk_b) / 2.
    captured, initial, batch = _fit_one_batch(
        make_cfg,
        "optimizer=sgd",
        "model.optimizer.lr=0.1",
        "data.seq_len=32",
        "model.chunk_length=8",
        "model.accumulate_grad_batches=2",
    )
    reference = reference_tbptt(initial, batch, chunk_length=8, lr=0.1, every=2)
    assert len(captured) == len(reference) == 2
    for got, want in zip(captured, reference):
        assert_gradients_close(got, want, atol=EXACT, rtol=EXACT)


def test_gradient_is_clipped_by_global_norm(make_cfg):
    clip = 0.05
    captured, initial, batch = _fit_one_batch(
        make_cfg, "data.seq_len=16", "model.chunk_length=16", f"model.gradient_clip_val={clip}"
    )
    raw = full_bptt_grads(initial, batch)
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in raw.values()]))
    assert norm > clip  # the clip is active
    scale = clip / (norm + 1e-6)  # torch.nn.utils.clip_grad_norm_'s rule
    assert_gradients_close(captured[0], {k: g * scale for k, g in raw.items()}, atol=EXACT, rtol=EXACT)


# ------------------------------------------------------------------------ memory proof


class _Saved:
    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class SavedBytes:
    """Counts the bytes autograd saves for backward: packed per chunk, and the peak held at once."""

    def __init__(self) -> None:
        self.live = self.peak = self.packed = 0

    def pack(self, tensor: torch.Tensor) -> _Saved:
        n = tensor.numel() * tensor.element_size()
        self.live += n
        self.packed += n
        self.peak = max(self.peak, self.live)
        box = _Saved(tensor)
        # Freed when autograd releases the saved tensor (backward without retain_graph, or the
        # graph going out of scope).
        weakref.finalize(box, self._release, n)
        return box

    def _release(self, n: int) -> None:
        self.live -= n

    @staticmethod
    def unpack(box: _Saved) -> torch.Tensor:
        return box.tensor


class _PerStep(GradientCapture):
    """Records the bytes packed since the previous optimizer step (one chunk's forward)."""

    def __init__(self, saved: SavedBytes) -> None:
        super().__init__()
        self.saved, self.per_step = saved, []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.per_step.append(self.saved.packed)
        self.saved.packed = 0


def _saved_bytes(make_cfg, seq_len: int, *overrides: str, target: str | None = None) -> tuple[int, list[int]]:
    saved = SavedBytes()
    per_step = _PerStep(saved)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        _fit_one_batch(
            make_cfg,
            f"data.seq_len={seq_len}",
            "model.chunk_length=16",
            *overrides,
            target=target,
            callbacks=[per_step],
            float64=False,
        )
    return saved.peak, per_step.per_step


class NoDetach(TruncatedBPTT):
    """The classic pitfall: the hidden state is carried with its graph."""

    @staticmethod
    def repackage_hidden(hidden):
        return hidden


class NoDetachRetainGraph(NoDetach):
    """... and the usual first remedy for the error that follows: retain_graph=True."""

    def manual_backward(self, loss, *args, **kwargs):
        super().manual_backward(loss, *args, retain_graph=True, **kwargs)


def test_saved_memory_does_not_grow_with_seq_len(make_cfg):
    peak_64, per_chunk_64 = _saved_bytes(make_cfg, 64)
    peak_256, per_chunk_256 = _saved_bytes(make_cfg, 256)
    assert len(per_chunk_64) == 4 and len(per_chunk_256) == 16
    # Every chunk saves the same bytes, and only one chunk's are ever held at once.
    assert len(set(per_chunk_64 + per_chunk_256)) == 1, (per_chunk_64, per_chunk_256)
    assert peak_64 == peak_256 == per_chunk_64[0]


def test_without_detach_retained_graphs_grow_with_seq_len(make_cfg):
    # The pitfall "made to work": retain_graph=True and no step between chunks (k = all chunks,
    # otherwise the step's in-place update breaks it, see below). Every chunk's backward walks all
    # earlier chunks again, and all their saved tensors stay alive.
    def peak(seq_len: int) -> int:
        k = f"model.accumulate_grad_batches={seq_len // 16}"
        return _saved_bytes(make_cfg, seq_len, k, target=f"{__name__}.NoDetachRetainGraph")[0]

    detached = _saved_bytes(make_cfg, 64)[0]
    peak_64, peak_256 = peak(64), peak(256)
    assert peak_64 > 3 * detached
    assert peak_256 > 3.5 * peak_64, (peak_64, peak_256)


def test_without_detach_second_chunk_backward_fails(make_cfg):
    """The classic error, on the real module: chunk 2's backward runs into chunk 1's freed graph."""
    with pytest.raises(RuntimeError, match="Trying to backward through the graph a second time"):
        _fit_one_batch(make_cfg, "data.seq_len=32", "model.chunk_length=16", target=f"{__name__}.NoDetach")


def test_without_detach_retain_graph_trips_on_the_optimizer_step(make_cfg):
    """The usual remedy, retain_graph=True, fails next: the step changed weights chunk 1's graph saved."""
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _fit_one_batch(make_cfg, "data.seq_len=32", "model.chunk_length=16", target=f"{__name__}.NoDetachRetainGraph")


# -------------------------------------------------------------- logging, samples, data


def test_logs_bpc_and_writes_samples(make_cfg, tmp_path):
    cfg = make_cfg(
        *TINY,
        "data.seq_len=48",
        "model.chunk_length=16",
        "model.sample_length=40",
        "trainer.max_epochs=2",
        "trainer.limit_train_batches=3",
        "trainer.limit_val_batches=2",
        "trainer.log_every_n_steps=1",
        "~callbacks.loss_curves",
        F64,
        output_dir=tmp_path,
    )
    metrics = train(cfg)

    # val/bpc is the cross-entropy over the held-out slice's first 2 batches, in bits, at the final weights.
    weights = load_weights(tmp_path / "checkpoints/last.ckpt")
    assert weights["net.head.bias"].dtype == torch.float64
    p = {k: v for k, v in weights.items() if not k.startswith("val_")}
    dm, model = testing.build(cfg)
    dm.setup("fit")
    val = dm.val_set[: 2 * cfg.data.batch_size]
    with torch.no_grad():
        logits, _ = reference_lstm(p, val["x"])
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), val["y"].reshape(-1)).item()
    # The recipe's validation sums in float32 (FLOAT32_SCORE); the forwards are float64 on both sides.
    assert metrics["val/bpc"] == pytest.approx(ce / math.log(2), rel=FLOAT32_SCORE)
    assert metrics["val/loss/ce"] == pytest.approx(ce, rel=FLOAT32_SCORE)

    csv = next((tmp_path / "csv").rglob("metrics.csv")).read_text().splitlines()
    header = csv[0].split(",")
    assert {"loss/ce", "train/bpc", "val/bpc", "val/loss/ce"} <= set(header)
    assert any(col.startswith("lr") for col in header)
    rows = [dict(zip(header, line.split(","))) for line in csv[1:]]
    train_rows = [r for r in rows if r["loss/ce"]]
    assert len(train_rows) == 6  # one per batch (2 epochs × 3), though each batch stepped 3 times
    for r in train_rows:
        # Logged values, not a proof: both are float32 (the recipe's float32 ce; the training log's float32 rows),
        # train/bpc = ce / ln 2 rounded to float32 before each is averaged over the row's steps in float32: a few
        # roundings of 2⁻²⁴ (6e-8) relative each, well inside 1e-6.
        assert float(r["train/bpc"]) == pytest.approx(float(r["loss/ce"]) / math.log(2), rel=1e-6)
    assert torch.load(tmp_path / "checkpoints/last.ckpt", weights_only=True)["global_step"] == 2 * 3 * 3

    # One sample per epoch; the last one is the final weights' continuation of the prompt.
    samples = sorted((tmp_path / "samples").glob("epoch_*.txt"))
    assert [s.name for s in samples] == ["epoch_000.txt", "epoch_001.txt"]
    header_line, text = samples[-1].read_text(encoding="utf-8").split("\n", 1)
    # The batch index metrics.csv ends at (6 batches: 5), not global_step (18 optimizer steps).
    assert header_line.startswith("# epoch 1, step 5, val/bpc")
    assert max(int(r["step"]) for r in train_rows) == 5
    model.double().load_state_dict(weights)  # the run sampled from its float64 weights
    expected = model.generate("The ", 40, 0.8, torch.Generator().manual_seed(0))
    assert text == expected + "\n"
    assert text.startswith("The ") and len(expected) == 44


def test_sampling_is_seeded_and_leaves_the_global_rng_alone(make_cfg):
    _, model = testing.build(make_cfg(*TINY))
    before = torch.get_rng_state()
    a = model.generate("The ", 60, 0.8, torch.Generator().manual_seed(0))
    assert torch.equal(torch.get_rng_state(), before)
    assert a == model.generate("The ", 60, 0.8, torch.Generator().manual_seed(0))
    assert a != model.generate("The ", 60, 0.8, torch.Generator().manual_seed(1))
    greedy = model.generate("The ", 20, 0.0, torch.Generator().manual_seed(0))
    assert greedy == model.generate("The ", 20, 0.0, torch.Generator().manual_seed(1))


def test_vocabulary_is_fixed_and_validation_is_the_held_out_tail():
    text = pydoc_text()
    vocab = Vocabulary.from_text(text)
    assert vocab.spec == "".join(sorted(set(text)))
    tails = []
    for seq_len in (64, 100):
        dm = TextDataModule(level="chars", seq_len=seq_len, val_fraction=0.1)
        assert dm.vocab == vocab
        dm.setup("fit")
        x, y = dm.train_set[:]["x"], dm.train_set[:]["y"]
        assert x.shape[1] == y.shape[1] == seq_len
        assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one character
        assert torch.equal(x[1:, 0], y[:-1, -1])  # windows tile the text: no target lost at the seams
        train_chars = vocab.decode(x[0, :1]) + vocab.decode(y.flatten())
        assert text.startswith(train_chars)
        val = dm.val_set[:]
        val_text = vocab.decode(val["x"][0, :1]) + vocab.decode(val["y"].flatten())
        cut = len(text) - round(0.1 * len(text))
        assert text[cut:].startswith(val_text)
        assert len(train_chars) <= cut  # disjoint: the training windows end before the cut
        tails.append(val_text[:5000])
    assert tails[0] == tails[1]  # the held-out characters do not move with seq_len


# ----------------------------------------------------- accumulation_mean: how a step weighs its chunks


@pytest.mark.parametrize("spelling", [(), ("model.accumulation_mean=examples",), ("model.count_exact=true",)])
def test_the_examples_mean_weighs_the_short_last_chunk_like_the_others(make_cfg, spelling):
    """40 tokens = chunks of 16 + 16 + 8, k=3: one step per batch. Per-chunk means / k (``micro_batches``) weigh each
    of the last chunk's tokens twice; ``accumulation_mean=examples`` (the default; earlier versions' spelling
    ``count_exact=true``) steps on the mean over all 40·b tokens, the gradient one backward of their summed loss
    gives."""
    common = (*ONE_BATCH, "optimizer=sgd", "model.optimizer.lr=0.1", "data.seq_len=40", "model.chunk_length=16")
    cfg = make_cfg(*common, "model.accumulate_grad_batches=3", *spelling)
    if spelling == ("model.count_exact=true",):
        with pytest.warns(UserWarning, match="model.count_exact=true is model.accumulation_mean=examples now"):
            datamodule, model = testing.build(cfg)
    else:
        datamodule, model = testing.build(cfg)
    assert model.accumulation_mean == "examples"
    (captured,) = testing.step_gradients(model, datamodule, steps=1, precision="64-true")
    batch = testing.first_batch(datamodule)
    (exact,) = testing.tbptt_gradients(model.net, batch, chunk_length=16, every=3, count_exact=True)
    testing.assert_gradients_close(captured, exact, atol=EXACT, rtol=EXACT)
    # The reference is what it says: the summed token loss of the three chunks over their count.
    net = copy.deepcopy(model.net)
    hidden, total = None, 0.0
    for x, y in zip(batch["x"].split(16, dim=1), batch["y"].split(16, dim=1)):
        logits, hidden = net(x, hidden)
        total = total + F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
        hidden = tuple(h.detach() for h in hidden)
    (total / batch["y"].numel()).backward()
    by_hand = {f"net.{k}": v.grad for k, v in net.named_parameters()}
    testing.assert_gradients_close(exact, by_hand, atol=EXACT, rtol=EXACT)
    # Not vacuous: Lightning-style 1/k per chunk gives another gradient.
    (per_chunk,) = testing.tbptt_gradients(model.net, batch, chunk_length=16, every=3)
    assert (per_chunk["net.head.bias"] - exact["net.head.bias"]).abs().max() > 1e-4


def test_the_micro_batches_mean_is_each_chunks_mean_over_k(make_cfg):
    """The same 16 + 16 + 8 tokens, k=3, with ``accumulation_mean=micro_batches``: the plain loop's
    ``(chunk mean / k).backward()``, the short chunk's tokens weighing twice."""
    common = (*ONE_BATCH, "optimizer=sgd", "model.optimizer.lr=0.1", "data.seq_len=40", "model.chunk_length=16")
    datamodule, model = testing.build(
        make_cfg(*common, "model.accumulate_grad_batches=3", "model.accumulation_mean=micro_batches")
    )
    (captured,) = testing.step_gradients(model, datamodule, steps=1, precision="64-true")
    batch = testing.first_batch(datamodule)
    (per_chunk,) = testing.tbptt_gradients(model.net, batch, chunk_length=16, every=3)
    testing.assert_gradients_close(captured, per_chunk, atol=EXACT, rtol=EXACT)


@pytest.mark.parametrize("mean", ["micro_batches", "examples"])
def test_padded_sequences_score_only_their_masked_tokens(make_cfg, tmp_path, mean):
    """Variable-length sequences padded to 24 with a mask: no sequence is longer than 16, so the third
    chunk is all padding (a zero gradient, not NaN). With ``accumulation_mean=micro_batches`` each chunk adds its
    mean over its scored tokens / k; with ``examples`` a step is the mean over the scored tokens of all its chunks
    (k=2: chunks 1-2, then 3)."""
    data = padded_token_npz(tmp_path / "tokens.npz", n=16, seq_len=24, longest=16)
    cfg = make_cfg(
        *ONE_BATCH,
        *padded_tbptt(data),
        "optimizer=sgd",
        "model.optimizer.lr=0.5",
        "model.chunk_length=8",
        "model.accumulate_grad_batches=2",
        f"model.accumulation_mean={mean}",
        "data.shuffle=false",
    )
    datamodule, model = testing.build(cfg)
    captured = testing.step_gradients(model, datamodule, steps=2, precision="64-true")
    batch = testing.first_batch(datamodule)  # token ids and a boolean mask: nothing to cast
    assert (
        bool((batch["mask"][:, 16:] == 0).all()) and 0 < batch["mask"][:, 8:16].sum() < batch["mask"][:, 8:16].numel()
    )
    count_exact = mean == "examples"
    reference = testing.tbptt_gradients(model.net, batch, chunk_length=8, lr=0.5, every=2, count_exact=count_exact)
    assert len(captured) == len(reference) == 2
    for got, want in zip(captured, reference):
        testing.assert_gradients_close(got, want, atol=EXACT, rtol=EXACT)
    assert all(float(g.abs().max()) == 0 for g in captured[1].values())  # the all-padding step
    assert all(bool(torch.isfinite(g).all()) for g in captured[0].values())
    # Padding changes the gradient: scoring the padded targets too would give another one.
    unmasked = {k: v for k, v in batch.items() if k != "mask"}
    (everything, _) = testing.tbptt_gradients(model.net, unmasked, chunk_length=8, every=2, count_exact=count_exact)
    assert (everything["net.head.bias"] - captured[0]["net.head.bias"]).abs().max() > 1e-4
    # And the two means differ on these uneven chunks (chunk 2 is part padding).
    other = testing.tbptt_gradients(model.net, batch, chunk_length=8, lr=0.5, every=2, count_exact=not count_exact)
    assert (other[0]["net.head.bias"] - captured[0]["net.head.bias"]).abs().max() > 1e-4


def test_padded_data_trains_and_validates_on_scored_tokens(make_cfg, tmp_path):
    data = padded_token_npz(tmp_path / "tokens.npz", n=40, seq_len=24)
    metrics = train(
        make_cfg(
            *TINY,
            *padded_tbptt(data),
            "data.val_fraction=0.25",
            "model.chunk_length=8",
            "model.accumulation_mean=examples",
            "trainer.max_epochs=2",
            F64,
            output_dir=tmp_path / "run",
        )
    )
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    # val/loss/ce and val/ppl are the mean over the held-out scored tokens: recompute them from the checkpoint.
    ckpt = tmp_path / "run/checkpoints/last.ckpt"
    module = TruncatedBPTT.load_from_checkpoint(ckpt, weights_only=True)
    module.double().load_state_dict(load_weights(ckpt))  # loading casts to the new module's float32: the run's float64
    datamodule = instantiate(make_cfg(*TINY, *padded_tbptt(data), "data.val_fraction=0.25").data)
    datamodule.setup("fit")
    val = datamodule.val_set[:]
    with torch.no_grad():
        logits, _ = module.net(val["x"], None)
    scored = val["mask"].bool()
    ce = F.cross_entropy(logits[scored], val["y"][scored])
    assert logits.dtype == torch.float64  # the run's float64 weights, recomputed in float64
    # The recipe's validation sums in float32 (FLOAT32_SCORE); ppl = exp(mean), so the mean's absolute error is ppl's
    # relative one: ce ≈ ln 11 < 2.5 keeps it inside 2.5·FLOAT32_SCORE.
    assert metrics["val/loss/ce"] == pytest.approx(float(ce), rel=FLOAT32_SCORE)
    assert metrics["val/ppl"] == pytest.approx(math.exp(float(ce)), rel=2.5 * FLOAT32_SCORE)
    assert "val/bpc" not in metrics  # bits per character: for bytes and characters, not opaque ids


@pytest.mark.parametrize(
    ("arrays", "hint"),
    [
        ({"mask": np.full((16, 24), 2)}, "0/1 (or boolean) mask"),
        ({"mask": np.ones((16, 23), dtype=bool)}, "of y's shape"),
        ({"y": np.full((16, 24), 11)}, "target ids in [0, 11)"),
        ({"x": np.full((16, 24), 12)}, "the data's largest token id is 12"),  # inputs too: no IndexError
    ],
)
def test_bad_masks_and_targets_are_refused_before_training(make_cfg, tmp_path, arrays, hint):
    data = padded_token_npz(tmp_path / "tokens.npz", n=16, seq_len=24)
    with np.load(data) as saved:
        np.savez(data, **{**dict(saved), **arrays})
    with pytest.raises(ConfigError) as err:
        train(make_cfg(*TINY, *padded_tbptt(data), output_dir=tmp_path / "run"))
    assert err.value.key == "data" and hint in str(err.value)
    assert not (tmp_path / "run/checkpoints").exists()


# ---------------------------------------------------------------------- rejected settings


@pytest.mark.parametrize(
    ("override", "key", "hint"),
    [
        ("trainer.gradient_clip_val=0.5", "trainer.gradient_clip_val", "model.gradient_clip_val"),
        ("+trainer.gradient_clip_algorithm=value", "trainer.gradient_clip_algorithm", "model.gradient_clip_val"),
        ("trainer.accumulate_grad_batches=2", "trainer.accumulate_grad_batches", "model.accumulate_grad_batches"),
        ("model.chunk_length=0", "model.chunk_length", "≥ 1"),
        ("model.accumulate_grad_batches=0", "model.accumulate_grad_batches", "≥ 1"),
        ("model.gradient_clip_val=0", "model.gradient_clip_val", "positive"),
        ("model.sample_prompt='Ω '", "model.sample_prompt", "not in the vocabulary: ['Ω']"),
        ("model.sample_prompt=''", "model.sample_prompt", "empty"),
        ("data.seq_len=500000", "data.seq_len", "at most"),
    ],
)
def test_rejected_settings_name_the_key(make_cfg, tmp_path, override, key, hint):
    with pytest.raises(ConfigError) as err:
        train(make_cfg(*TINY, override, output_dir=tmp_path))
    assert err.value.key == key
    assert hint in str(err.value)
    assert not (tmp_path / "checkpoints").exists()  # nothing trained


def test_cli_rejects_trainer_clipping_with_the_model_key(tmp_path):
    result = run_cli("recipe=tbptt", "trainer.gradient_clip_val=1.0", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "trainer.gradient_clip_val" in result.stderr and "model.gradient_clip_val" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "checkpoints").exists()


# ------------------------------------------------------------------------------ resume


RESUMABLE = (
    *TINY,
    "data.seq_len=32",
    "model.chunk_length=16",
    "trainer.limit_train_batches=3",
    "~callbacks.loss_curves",
)


def test_resume_across_an_epoch_end_is_exact(make_cfg, tmp_path):
    """1 + 1 epochs == 2 epochs, through the epoch-end sample and the vocabulary check on load."""
    runs = straight_and_resumed(make_cfg, tmp_path, RESUMABLE, stop="trainer.max_epochs=1", end="trainer.max_epochs=2")
    straight, first, resumed = (load_weights(run / "checkpoints/last.ckpt") for run in runs)
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    assert any(not torch.equal(straight[k], first[k]) for k in straight)
    assert (tmp_path / "resumed/samples/epoch_001.txt").read_text() == (
        tmp_path / "straight/samples/epoch_001.txt"
    ).read_text()


def test_checkpoint_with_another_vocabulary_is_refused(make_cfg, tmp_path):
    train(make_cfg(*RESUMABLE, "trainer.max_steps=2", output_dir=tmp_path / "first"))
    ckpt = torch.load(tmp_path / "first/checkpoints/last.ckpt", weights_only=True)
    assert ckpt["vocab"] == ckpt["hyper_parameters"]["vocab"] == Vocabulary.from_text(pydoc_text()).spec
    ckpt["vocab"] = ckpt["vocab"][::-1]  # same size, other ids: would decode garbage silently
    torch.save(ckpt, tmp_path / "other.ckpt")
    with pytest.raises(ConfigError) as err:
        train(make_cfg(*RESUMABLE, "trainer.max_steps=4", f"ckpt_path={tmp_path / 'other.ckpt'}", output_dir=tmp_path))
    assert err.value.key == "ckpt_path"


def test_a_chunk_longer_than_the_sequence_is_said(make_cfg, tmp_path):
    """chunk_length ≥ seq_len is full BPTT: allowed, but not silently (a typo in either key would be)."""
    with pytest.warns(UserWarning, match=r"chunk_length=64 exceeds the sequences' length \(32"):
        train(
            make_cfg(*ONE_BATCH, "data.seq_len=32", "model.chunk_length=64", "trainer.max_steps=1", output_dir=tmp_path)
        )
