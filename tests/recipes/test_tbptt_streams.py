"""`tbptt` on continuous streams (``data.layout=streams``): the word language model's truncated BPTT.

The references are written by hand: the corpus cut into B rows (``batchify``), windows of ``seq_len``
read in order, each chunk's backward, an SGD step, ``hidden.detach()`` kept into the next window
(`multiloss.testing.stream_gradients`). Then: exact mid-epoch resume (weights and the carried state,
bit for bit), validation window by window equal to one forward over the whole stream with a fraction
of the memory, the batch-mixing pitfall refused.

The proofs run in float64 (``precision="64-true"``: Lightning casts the module to float64, the references then run
on it) and hold to `EXACT`, on any CPU; the validation scores the recipe logs are float32 sums (`FLOAT32_SCORE`).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from multiloss import ConfigError, testing, train
from multiloss.data.streams import batchify
from multiloss.data.vocabulary import pydoc_text
from tests.conftest import load_weights
from tests.helpers import char_streams, straight_and_resumed

B, SEQ_LEN, CHUNK = 4, 12, 4  # 3 chunks a window
EXACT = 1e-10  # float64: equal up to rounding (19 steps' rounding stays near 1e-15), on any CPU
# The validation scores tbptt logs are accumulated in float32 whatever the run's dtype (recipes/tbptt.py: each chunk's
# summed nll `.float()`, their float32 sum, the float32 MeanMetric of the logged means; torchmetrics' Perplexity on
# `logits.float()`). Along that path a score of float64 logits meets at most ~10 roundings, each ≤ 2⁻²⁴ relative of a
# positive value: 32·2⁻²⁴ (1.9e-6) bounds the relative error against a float64 recomputation with a factor 3 to spare.
FLOAT32_SCORE = 32 * 2**-24


@pytest.fixture
def corpus(tmp_path: Path) -> tuple[Path, Path]:
    text = pydoc_text()
    train_file, val_file = tmp_path / "train.txt", tmp_path / "valid.txt"
    train_file.write_text(text[:300])  # 4 streams of 75: 7 windows (the last of 2 tokens), 19 chunks
    val_file.write_text(text[300:420])
    return train_file, val_file


def _streams(corpus: tuple[Path, Path], *overrides: str, net: tuple[str, ...] | None = None) -> tuple[str, ...]:
    train_file, val_file = corpus
    net = ("model.net.embedding_dim=8", "model.net.hidden_size=16") if net is None else net
    return (
        *char_streams(train_file, val_file),
        f"data.batch_size={B}",
        "data.val_batch_size=2",
        f"data.seq_len={SEQ_LEN}",
        f"model.chunk_length={CHUNK}",
        *net,
        "trainer.accelerator=cpu",
        "trainer.devices=1",
        *overrides,
    )


def test_batches_are_the_windows_of_batchified_streams(make_cfg, corpus):
    datamodule, module = testing.build(make_cfg(*_streams(corpus)))
    assert module.carry_state  # the data's layout told the recipe
    ids = datamodule.train_ids
    # word_language_model's batchify, time-major, and its get_batch: windows of SEQ_LEN, the last shorter.
    n = len(ids) // B
    time_major = ids[: n * B].view(B, -1).t().contiguous()
    expected = []
    for i in range(0, time_major.size(0) - 1, SEQ_LEN):
        length = min(SEQ_LEN, len(time_major) - 1 - i)
        expected.append((time_major[i : i + length].t(), time_major[i + 1 : i + 1 + length].t()))
    datamodule.setup("fit")
    batches = list(datamodule.train_dataloader())
    assert len(batches) == len(expected) == 7 and batches[-1]["x"].shape == (B, 2)
    for batch, (x, y) in zip(batches, expected):
        assert torch.equal(batch["x"], x) and torch.equal(batch["y"], y)


def test_gradients_equal_the_hand_written_loop_with_the_state_carried(make_cfg, corpus):
    """Every optimizer step of an epoch (7 windows × up to 3 chunks), the state carried from window to window."""
    cfg = make_cfg(*_streams(corpus), "logger=none", "callbacks=none")
    datamodule, module = testing.build(cfg)
    captured = testing.step_gradients(module, datamodule, steps=19, precision="64-true")  # module.net: float64 now
    reference = testing.stream_gradients(module.net, datamodule.train_ids, B, SEQ_LEN, CHUNK, lr=0.5)
    assert len(captured) == len(reference) == 19
    for got, want in zip(captured, reference):
        testing.assert_gradients_close(got, want, atol=EXACT, rtol=EXACT)
    # Not vacuous: without the carried state the second window's first chunk already differs.
    fresh = testing.stream_gradients(module.net, datamodule.train_ids, B, SEQ_LEN, CHUNK, lr=0.5, carry=False)
    assert torch.equal(fresh[2]["net.head.bias"], reference[2]["net.head.bias"])  # window 1: the same
    assert (fresh[3]["net.lstm.weight_hh_l0"] - captured[3]["net.lstm.weight_hh_l0"]).abs().max() > 1e-4


def test_a_mid_epoch_resume_continues_weights_and_state_bit_for_bit(make_cfg, tmp_path, corpus):
    common = (*_streams(corpus), "~callbacks.loss_curves", "trainer.max_epochs=2")
    # 12 steps = 4 windows of epoch 0: the checkpoint holds the state the fifth window starts from.
    straight, first, resumed = straight_and_resumed(
        make_cfg, tmp_path, common, stop="trainer.max_steps=12", end="trainer.max_steps=38"
    )
    saved = torch.load(first / "checkpoints/last.ckpt", weights_only=True)
    h, c = saved["tbptt_carried_state"]
    assert h.shape == c.shape == (1, 1, B, 16) and h.abs().sum() > 0  # (ranks, layers, streams, hidden)
    end = {run: torch.load(run / "checkpoints/last.ckpt", weights_only=True) for run in (straight, resumed)}
    for k, v in end[straight]["state_dict"].items():
        assert torch.equal(end[resumed]["state_dict"][k], v), k
    for a, b in zip(end[straight]["tbptt_carried_state"], end[resumed]["tbptt_carried_state"]):
        assert torch.equal(a, b)
    assert any(
        not torch.equal(load_weights(first / "checkpoints/last.ckpt")[k], v)
        for k, v in end[straight]["state_dict"].items()
    )


@pytest.mark.parametrize("layout", ["streams", "sequences"])
def test_validation_window_by_window_is_one_forward_over_the_whole_text(make_cfg, corpus, layout):
    """The scores of one forward over the whole validation stream (sequence), from chunks of 4 with the state
    carried: the largest logits tensor is 4 tokens long instead of the whole stream."""
    overrides = ("data.layout=sequences", "data.seq_len=48", "data.val_batch_size=1") if layout == "sequences" else ()
    cfg = make_cfg(*_streams(corpus), *overrides, "logger=none", "callbacks=none")
    datamodule, module = testing.build(cfg)
    sizes: list[int] = []
    hook = module.net.head.register_forward_hook(lambda m, args, out: sizes.append(out.numel()))
    trainer = testing.bare_trainer(limit_val_batches=None, precision="64-true")
    (metrics,) = trainer.validate(module, datamodule=datamodule, verbose=False)
    assert module.net.head.weight.dtype == torch.float64  # validated in float64, recomputed below in float64
    hook.remove()
    if layout == "streams":
        rows = batchify(datamodule.val_ids, 2)
        inputs, targets = rows[:, :-1], rows[:, 1:]
    else:
        datamodule.setup("validate")
        val = datamodule.val_set[:]
        inputs, targets = val["x"], val["y"]
    sizes_whole: list[int] = []
    hook = module.net.head.register_forward_hook(lambda m, args, out: sizes_whole.append(out.numel()))
    with torch.no_grad():
        logits, _ = module.net(inputs, None)
    hook.remove()
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).item()
    # The scores are the recipe's float32 sums of float64 chunks (FLOAT32_SCORE); ppl = exp(mean): the mean's
    # absolute error is ppl's relative one, and ce ≈ ln 38 < 4 (the untrained net, 38 characters) keeps it inside
    # 4·FLOAT32_SCORE.
    assert metrics["val/loss/ce"] == pytest.approx(ce, rel=FLOAT32_SCORE)
    assert metrics["val/ppl"] == pytest.approx(math.exp(ce), rel=4 * FLOAT32_SCORE)
    assert metrics["val/bpc"] == pytest.approx(ce / math.log(2), rel=FLOAT32_SCORE)  # characters: bits per character
    vocab = len(module.vocab)
    assert max(sizes) <= inputs.shape[0] * CHUNK * vocab < max(sizes_whole)


class TimeMajorLM(nn.Module):
    """A word LM whose LSTM keeps PyTorch's default ``batch_first=False`` while it is fed (batch, time) tokens."""

    def __init__(self, vocab_size: int, hidden_size: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden_size)
        self.lstm = nn.LSTM(hidden_size, hidden_size)
        self.head = nn.Linear(hidden_size, vocab_size)

    def forward(self, tokens: torch.Tensor, hidden=None):
        out, hidden = self.lstm(self.embed(tokens), hidden)
        return self.head(out), hidden


def test_a_time_major_net_fed_batch_first_tokens_is_refused(make_cfg, tmp_path, corpus):
    """Its logits have the right shape, so only their content shows the recurrence runs across the batch."""
    net = (f"model.net._target_={__name__}.TimeMajorLM", "~model.net.embedding_dim", "~model.net.num_layers")
    cfg = make_cfg(*_streams(corpus, net=net), output_dir=tmp_path / "run")
    with pytest.raises(ConfigError) as err:
        train(cfg)
    assert err.value.key == "model.net" and "batch_first=True" in err.value.message
    assert not (tmp_path / "run" / ".hydra").exists()


def test_a_mid_epoch_resume_with_another_number_of_streams_is_refused(make_cfg, corpus, tmp_path):
    # The carried state has one row a stream: 4 → 2 streams mid-epoch was a traceback (hidden size mismatch).
    run = tmp_path / "run"
    train(make_cfg(*_streams(corpus), "trainer.max_steps=6", output_dir=run))
    with pytest.raises(ConfigError, match="saved mid-epoch") as err:
        train(
            make_cfg(*_streams(corpus), "data.batch_size=2", "trainer.max_steps=12", "ckpt_path=last", output_dir=run)
        )
    assert err.value.key == "data.batch_size"
