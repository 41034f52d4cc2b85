"""`tbptt` on every kind of vocabulary: words, a file's token ids, bytes and characters.

What each gives the recipe (its size, its prompt, its metrics), and the mistakes a vocabulary
invites, each a config error naming its key before training: a net config with another
``vocab_size``, token ids beyond the net's embedding, a prompt the vocabulary cannot encode.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from multiloss import ConfigError, train
from multiloss.data.vocabulary import UNK

WORDS = "the cat sat on the mat\nthe dog sat on the log\na cat and a dog\n"
TINY_NET = ("model.net.embedding_dim=8", "model.net.hidden_size=16")
COMMON = (
    "recipe=tbptt",
    *TINY_NET,
    "data.layout=streams",
    "data.batch_size=2",
    "data.val_batch_size=1",
    "data.seq_len=6",
    "model.chunk_length=3",
    "model.sample_length=4",
    "trainer.accelerator=cpu",
    "trainer.devices=1",
    "trainer.max_epochs=1",
    "trainer.num_sanity_val_steps=0",
    "~callbacks.loss_curves",
)
# ppl against exp(ce), bpc against ce / ln 2: logged values, not proofs. The recipe accumulates its validation scores
# in float32 (recipes/tbptt.py: the chunks' nll sums `.float()`, float32 MeanMetrics; torchmetrics' Perplexity on
# `logits.float()`): ce and ln ppl are the same mean over the same tokens by two float32 paths, each within ~10
# roundings (2⁻²⁴ relative each) of the exact mean, so |ppl / exp(ce) − 1| ≲ 20·2⁻²⁴·ce (1.2e-6·ce), under 1e-5 for
# any ce < 8 nats (ln 256 = 5.5, the largest vocabulary here); bpc and ce / ln 2 part only at the per-batch / ln 2 and
# its mean: a few roundings, 1e-5 with room.
LOGGED = 1e-5


@pytest.fixture
def word_files(tmp_path: Path) -> tuple[str, ...]:
    (tmp_path / "train.txt").write_text(WORDS * 6)
    (tmp_path / "valid.txt").write_text("the cat sat on a log\nthe zebra sat\n")
    (tmp_path / "test.txt").write_text("a dog sat on the mat\n" * 3)
    return (
        "data=text",
        "data.level=words",
        f"data.path={tmp_path / 'train.txt'}",
        f"data.val_path={tmp_path / 'valid.txt'}",
        f"data.test_path={tmp_path / 'test.txt'}",
    )


@pytest.fixture
def id_file(tmp_path: Path) -> tuple[str, ...]:
    np.savez(tmp_path / "ids.npz", x=np.arange(400) % 37, vocab_size=np.int64(40))
    return ("data=npz", f"data.path={tmp_path / 'ids.npz'}")


def _samples(run: Path) -> str:
    """The sampled text of every epoch, without the files' ``# epoch ...`` header lines."""
    lines = [line for p in sorted((run / "samples").glob("*.txt")) for line in p.read_text().splitlines()]
    return "\n".join(line for line in lines if not line.startswith("#"))


def test_words_train_with_perplexity_and_a_word_prompt(make_cfg, tmp_path, word_files):
    run = tmp_path / "run"
    metrics = train(make_cfg(*COMMON, *word_files, "model.sample_prompt=the cat", output_dir=run))
    # The words of the training file, <eos> per line and <unk> for the validation's "zebra": 12 ids.
    assert metrics["val/ppl"] == pytest.approx(math.exp(metrics["val/loss/ce"]), rel=LOGGED)
    assert "val/bpc" not in metrics  # bits per character mean nothing for words
    text = _samples(run)
    assert "the cat" in text
    words = text.split("the cat", 1)[1].split()
    vocabulary = set(WORDS.split()) | {"<eos>", UNK}
    assert len(words) >= 4 and set(words[:4]) <= vocabulary  # words joined by spaces


def test_a_word_the_vocabulary_lacks_is_refused_in_the_prompt(make_cfg, tmp_path, word_files):
    with pytest.raises(ConfigError) as err:
        train(make_cfg(*COMMON, *word_files, "model.sample_prompt=the zebra", output_dir=tmp_path / "run"))
    assert err.value.key == "model.sample_prompt" and "zebra" in str(err.value)


@pytest.mark.parametrize("prompt", ["24", "'3 5 7'"])
def test_token_ids_take_ids_as_the_prompt(make_cfg, tmp_path, id_file, prompt):
    """An int from the command line (Hydra parses ``24`` as one) or space-separated ids; samples are ids."""
    run = tmp_path / "run"
    metrics = train(make_cfg(*COMMON, *id_file, f"model.sample_prompt={prompt}", output_dir=run))
    assert "val/ppl" in metrics and "val/bpc" not in metrics
    ids = _samples(run).split()
    assert all(tok.isdigit() and int(tok) < 40 for tok in ids) and len(ids) >= 5


def test_a_net_config_may_state_the_vocabularys_size_but_not_another(make_cfg, tmp_path, id_file):
    train(make_cfg(*COMMON, *id_file, "+model.net.vocab_size=40", "trainer.max_steps=1", output_dir=tmp_path / "a"))
    with pytest.raises(ConfigError) as err:
        train(make_cfg(*COMMON, *id_file, "+model.net.vocab_size=256", output_dir=tmp_path / "b"))
    assert err.value.key == "model.net.vocab_size" and err.value.value == 256
    assert "40" in str(err.value)  # both numbers named


def test_token_ids_beyond_the_embedding_name_the_largest_id(make_cfg, tmp_path):
    np.savez(tmp_path / "ids.npz", x=np.arange(400) % 37)  # no vocabulary named
    data = ("data=npz", f"data.path={tmp_path / 'ids.npz'}")
    with pytest.raises(ConfigError) as err:
        train(make_cfg(*COMMON, *data, output_dir=tmp_path / "a"))
    assert err.value.key == "model.vocab" and "36" in str(err.value)  # the largest id, and the fix
    with pytest.raises(ConfigError) as err:
        train(make_cfg(*COMMON, *data, "model.vocab=20", output_dir=tmp_path / "b"))
    assert err.value.key == "data" and "36" in str(err.value) and "model.vocab=37" in str(err.value)
    assert not (tmp_path / "b" / "checkpoints").exists()
    train(make_cfg(*COMMON, *data, "model.vocab=37", "trainer.max_steps=1", output_dir=tmp_path / "c"))


@pytest.mark.parametrize("level", ["bytes", "chars"])
def test_bytes_and_characters_log_bits_per_character_and_perplexity(make_cfg, tmp_path, word_files, level):
    metrics = train(make_cfg(*COMMON, *word_files, f"data.level={level}", output_dir=tmp_path / "run"))
    ce = metrics["val/loss/ce"]
    assert metrics["val/bpc"] == pytest.approx(ce / math.log(2), rel=LOGGED)
    assert metrics["val/ppl"] == pytest.approx(math.exp(ce), rel=LOGGED)


def test_the_word_vocabulary_rides_in_the_checkpoint(make_cfg, tmp_path, word_files):
    run = tmp_path / "run"
    train(make_cfg(*COMMON, *word_files, "trainer.max_steps=1", output_dir=run))
    vocab = torch.load(run / "checkpoints/last.ckpt", weights_only=True)["hyper_parameters"]["vocab"]
    assert vocab[:5] == ["the", "cat", "sat", "on", "mat"] and vocab[-1] == UNK and "<eos>" in vocab


def test_eval_scores_the_test_streams_too(make_cfg, tmp_path, word_files):
    """multiloss-eval on a streams run: the validation it ended with, again (bit for bit: the same float64 weights, data
    and arithmetic, its float32 sums included), and the test file's perplexity."""
    from multiloss.evaluation import evaluate, with_training_overrides
    from multiloss.testing import compose

    run = tmp_path / "run"
    trained = train(make_cfg(*COMMON, *word_files, "trainer.precision=64-true", output_dir=run))
    args = with_training_overrides([f"ckpt_path={run / 'checkpoints/last.ckpt'}", "print_config=false"])
    assert "trainer.precision=64-true" in args  # the evaluation runs in the training's float64
    metrics = evaluate(compose(*args, config_name="eval", output_dir=tmp_path / "eval"))
    assert metrics["val/ppl"] == trained["val/ppl"]
    assert metrics["test/ppl"] == pytest.approx(math.exp(metrics["test/loss/ce"]), rel=LOGGED)
    assert "test/bpc" not in metrics


def test_eval_on_text_of_another_vocabulary_is_refused_naming_the_file_and_both_vocabularies(
    make_cfg, tmp_path, word_files
):
    from multiloss.evaluation import evaluate, with_training_overrides
    from multiloss.testing import compose

    run, other = tmp_path / "run", tmp_path / "other.txt"
    train(make_cfg(*COMMON, *word_files, "trainer.max_steps=2", output_dir=run))
    other.write_text(WORDS.replace("cat", "cow") * 6)  # as many words, one of them another
    ckpt = run / "checkpoints/last.ckpt"
    args = with_training_overrides([f"ckpt_path={ckpt}", f"data.path={other}", "data.test_path=null"])
    with pytest.raises(ConfigError) as err:
        evaluate(compose(*args, "print_config=false", config_name="eval", output_dir=tmp_path / "eval"))
    assert (err.value.key, err.value.value) == ("ckpt_path", str(ckpt))
    assert "words, 11 ids each, 1 of them other tokens (id 1: 'cat' vs 'cow')" in err.value.problem
    assert not (tmp_path / "eval").exists()  # nothing written: no .hydra/ copies of a refused run


@pytest.mark.parametrize("layout", ["sequences", "streams"])
def test_float_data_is_refused_naming_its_dtype(make_cfg, tmp_path, layout):
    # Was: "the data's largest token id is 9" (a float's integer part), as if the ids were fine.
    rng = np.random.default_rng(0)
    if layout == "sequences":
        np.savez(tmp_path / "f.npz", x=rng.random((40, 10), dtype=np.float32) * 9, y=rng.integers(0, 9, (40, 10)))
    else:
        np.savez(tmp_path / "f.npz", x=rng.random(400).astype(np.float32) * 9)
    data = ("data=npz", f"data.path={tmp_path / 'f.npz'}", f"data.layout={layout}")
    data += ("data.seq_len=null",) if layout == "sequences" else ()
    with pytest.raises(ConfigError, match=r"x is float32: token ids must be integers|x: float32 \(400,\)") as err:
        train(make_cfg(*COMMON, *data, output_dir=tmp_path / "run"))
    assert err.value.key == ("data" if layout == "sequences" else "data.path")
    assert not (tmp_path / "run" / "checkpoints").exists()
