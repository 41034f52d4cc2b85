"""Elastic resume: a run stopped mid-epoch on W ranks × b continues on W′ × b′, every remaining example exactly once.

The examples a run trains on are recorded by id (`tests.helpers.TrainedExamples`: what each training step was
handed), across a straight run and runs stopped mid-epoch then continued on another per-rank batch size or number of
ranks; the union is each epoch's permutation exactly once. Where the global batch is kept (2 ranks × b → 1 × 2b and
back) the resumed run's weights equal the straight run's: in float64 (``trainer.precision=64-true``, every run of a
proof, the straight one too) to `EXACT`, an algebraic identity (the same examples' gradients summed in other groupings:
the runs part only by rounding, ~1e-16 relative a step), which holds on any CPU's kernels.
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from multiloss import train
from multiloss.callbacks import RunPreempted
from multiloss.config import ConfigError
from multiloss.data.order import EpochOrder
from tests.conftest import QUIET, load_weights, run_cli
from tests.helpers import ID_EXAMPLES as N
from tests.helpers import ID_TRAIN as TRAIN
from tests.helpers import balancer_states, recording_ids, started_balancer_states, trained_examples, write_id_data
from tests.helpers import epoch_orders as _orders
from tests.rank_pool import pooled_train

EXACT = 1e-10  # float64: equal up to rounding, on any CPU
F64 = "trainer.precision=64-true"  # a proof's runs: the module, its batches and its steps in float64
SIGTERM_AT_STEP_5 = ("+callbacks.signal._target_=tests.helpers.SignalAt", "+callbacks.signal.step=5")


@pytest.fixture(scope="module")
def id_data(tmp_path_factory) -> Path:
    return write_id_data(tmp_path_factory.mktemp("ids") / "ids.npz")


RECIPE = {
    "accumulation": ("recipe=accumulation", "model.accumulate_grad_batches=1", "model.net.width=16"),
    "multihead": ("recipe=multihead", "model.net.width=16"),
    "weighted": ("recipe=weighted", "model.net.width=16", "balancer=uncertainty"),
    "gan": ("recipe=gan", "model.data_dim=64", "model.generator.width=16", "model.discriminator.width=16"),
    # ADA's adaptive p (its sign sums over the ranks, its interval in D steps), a lazy R1 and G's EMA
    "gan_ada_ema": (
        *("recipe=gan", "model.data_dim=64", "model.generator.width=16", "model.discriminator.width=16"),
        *("model.loss=nonsaturating", "model.penalty=r1", "model.penalty_every=2"),
        *("+model.augment.policy=[color,translation,cutout]", "+model.augment.p=0.2", "+model.augment.ada_target=0.6"),
        *("+model.augment.ada_interval=2", "+model.augment.ada_kimg=1", "+model.g_ema.half_life_images=500"),
    ),
    # MoCo keeps a K × n average per rank at scope=rank
    "weighted_moco": ("recipe=weighted", "model.net.width=16", "balancer=moco"),
}


def _common(id_data: Path, record: Path, recipe: str = "accumulation") -> tuple[str, ...]:
    return (*RECIPE[recipe], *recording_ids(id_data, record), "trainer.limit_val_batches=1", "~callbacks.loss_curves")


def _assert_each_example_once(seen: dict[int, list[int]], epochs: int) -> None:
    assert sorted(seen) == list(range(epochs))
    for epoch, ids in seen.items():
        assert len(ids) == TRAIN and len(set(ids)) == TRAIN, (epoch, len(ids), len(set(ids)))


def test_any_stop_continues_on_any_shape_each_example_once():
    """The order's arithmetic alone, every stop of an epoch: the examples before the stop (the first ``consumed`` of
    the permutation) and those every new rank draws after it are the permutation, each once."""
    for n, (w, b), (w2, b2) in itertools.product(
        (7, 37, 160), [(1, 4), (2, 2), (2, 3), (4, 2), (3, 5)], [(1, 4), (2, 2), (2, 3), (4, 2), (3, 5)]
    ):
        before = EpochOrder(n, world_size=w, rank=0, batch_size=b, shuffle=True, seed=1, drop_last=False)
        for batches in range(before.batches()):
            consumed = before.consumed(0, batches)
            after = []
            for rank in range(w2):
                order = EpochOrder(n, world_size=w2, rank=rank, batch_size=b2, shuffle=True, seed=1, drop_last=False)
                order.continue_at(consumed, None)
                mine = list(order)
                assert -(-len(mine) // b2) == order.batches(consumed)  # every rank takes the same steps
                after += mine
            ids = before.permutation(0)[:consumed].tolist() + after
            left = n - consumed
            if 0 < left % (w2 * b2) < w2:  # fewer left than ranks: the ranks without one repeat one (said so)
                assert sorted(set(ids)) == list(range(n)) and len(ids) == n + w2 - left % (w2 * b2)
            else:
                assert sorted(ids) == list(range(n)), (n, w, b, w2, b2, batches)


@pytest.mark.parametrize(("batch_after", "stop"), [(12, "max_steps"), (7, "max_steps"), (12, "sigterm")])
def test_a_run_stopped_mid_epoch_continues_on_another_batch_size_each_example_once(
    make_cfg, tmp_path, id_data, batch_after, stop
):
    """8 a batch with 2 loader workers (which fetch ahead of the step), stopped mid-epoch by ``trainer.max_steps=5``
    (40 of 160 examples) or by a SIGTERM as step 5's batch starts (it trains: 48), then 12 or 7 a batch (7 does not
    divide the 120 left): the two runs' examples are each epoch's permutation, in its order, once."""
    record, run = tmp_path / "ids", tmp_path / "run"
    common = (*_common(id_data, record), "trainer=cpu", "data.num_workers=2", "trainer.max_epochs=2")
    if stop == "sigterm":
        with pytest.raises(RunPreempted):
            train(make_cfg(*common, "data.batch_size=8", *SIGTERM_AT_STEP_5, output_dir=run))
    else:
        train(make_cfg(*common, "data.batch_size=8", "trainer.max_steps=5", output_dir=run))
    position = torch.load(run / "checkpoints/last.ckpt", weights_only=True)["loops"]["fit_loop"]["state_dict"]
    consumed = position["combined_loader"][0]["position"]["consumed"]
    assert consumed == (48 if stop == "sigterm" else 40)  # the signal's batch trains before the run stops
    assert trained_examples(record) == {0: _orders(1)[0][:consumed]}
    train(make_cfg(*common, f"data.batch_size={batch_after}", "trainer.max_steps=-1", "ckpt_path=last", output_dir=run))
    assert trained_examples(record) == _orders(2)  # the first ones, then the rest; the next epoch whole
    steps = consumed // 8 + -(-(TRAIN - consumed) // batch_after) + -(-TRAIN // batch_after)
    assert torch.load(run / "checkpoints/last.ckpt", weights_only=True)["global_step"] == steps


def _same_weights(a: Path, b: Path) -> float:
    """The largest difference of two float64 runs' floating-point weights and buffers, each in its own dtype (a cast
    to float32 would round away the very differences the proof bounds); their other tensors (counts) equal."""
    wa, wb = load_weights(a / "checkpoints/last.ckpt"), load_weights(b / "checkpoints/last.ckpt")
    assert wa.keys() == wb.keys()
    tensors = [k for k in wa if isinstance(wa[k], torch.Tensor)]
    assert all(wa[k].dtype == wb[k].dtype for k in tensors)
    floats = [k for k in tensors if wa[k].is_floating_point()]
    assert floats and {wa[k].dtype for k in floats} == {torch.float64}  # the runs were float64 end to end
    assert all(torch.equal(wa[k], wb[k]) for k in tensors if k not in floats), "a count differs"
    return max((wa[k] - wb[k]).abs().max().item() for k in floats)


ONE = {"ddp": ("trainer=cpu",), "fsdp2": ("trainer=fsdp_cpu", "trainer.devices=1")}
TWO = {"ddp": ("trainer=ddp_cpu",), "fsdp2": ("trainer=fsdp_cpu",)}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_two_ranks_to_one_and_one_to_two_keep_the_global_batch_and_equal_the_straight_run(
    make_cfg, tmp_path, id_data, kind
):
    """2 ranks × 8 stopped at step 3 (48 of 160 examples) and continued on 1 × 16; 1 × 16 stopped there and continued
    on 2 × 8 (the pool's two real ranks, 2 loader workers each; under FSDP2 DCP reads the shards onto the new ranks);
    and 2 × 8 continued on 1 × 8 accumulating 2 batches a step: all three equal the straight 1 × 16 run to `EXACT` in
    every weight (float64), and each trains every example of both epochs once."""
    common = (*_common(id_data, tmp_path / "straight_ids"), "data.num_workers=2", F64)
    straight = tmp_path / "straight"
    train(make_cfg(*common, *ONE["ddp"], "data.batch_size=16", "trainer.max_epochs=2", output_dir=straight))
    end = ("trainer.max_epochs=2", "trainer.max_steps=-1", "ckpt_path=last")
    for name, first, then in (
        ("two_to_one", (*TWO[kind], "data.batch_size=8"), (*ONE[kind], "data.batch_size=16")),
        ("one_to_two", (*ONE[kind], "data.batch_size=16"), (*TWO[kind], "data.batch_size=8")),
        # the global batch kept by accumulating instead: 2 ranks × 8 → 1 × 8 × k=2 (global = b × W × k)
        (
            "two_to_one_accumulating",
            (*TWO[kind], "data.batch_size=8"),
            (*ONE[kind], "data.batch_size=8", "model.accumulate_grad_batches=2"),
        ),
    ):
        run, record = tmp_path / name, tmp_path / f"{name}_ids"
        for shape, bound in ((first, ("trainer.max_steps=3",)), (then, end)):
            overrides = (*_common(id_data, record), "data.num_workers=2", F64, *shape, *bound)
            if shape[0] == TWO[kind][0] and "trainer.devices=1" not in shape:
                pooled_train(run, *QUIET, *overrides, cwd=tmp_path)
            else:
                train(make_cfg(*overrides, output_dir=run))
        seen = trained_examples(record)
        assert len(list(record.glob("trained_rank*.jsonl"))) == 2  # rank 1 trained too
        assert {epoch: sorted(ids) for epoch, ids in seen.items()} == {e: sorted(o) for e, o in _orders(2).items()}
        worst = _same_weights(straight, run)
        print(f"{kind} {name}: largest weight difference from the straight run {worst:.2g}")  # for the record (-s)
        assert worst <= EXACT, f"{name}: weights differ from the straight run's by up to {worst:.3g}"


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["multihead", "weighted", "gan", "gan_ada_ema"])
def test_every_recipe_continues_two_ranks_on_one_as_the_straight_run(make_cfg, tmp_path, id_data, recipe):
    """Each recipe's state follows the new shape (the GAN's noise drawn for the global batch and split by stride as
    the examples are, its critic and generator steps, ADA's p and sign sums, G's EMA; a balancer's state): 2 ranks × 8
    stopped at step 3, continued on 1 × 16, equals the straight 1 × 16 run; each example once."""
    straight, run, record = tmp_path / "straight", tmp_path / "run", tmp_path / "ids"
    epochs = ("trainer.max_epochs=2", "trainer.max_steps=-1")
    train(
        make_cfg(
            *_common(id_data, tmp_path / "straight_ids", recipe),
            F64,
            "trainer=cpu",
            "data.batch_size=16",
            *epochs,
            output_dir=straight,
        )
    )
    mine = (*_common(id_data, record, recipe), F64)
    pooled_train(run, *QUIET, *mine, "trainer=ddp_cpu", "data.batch_size=8", "trainer.max_steps=3", cwd=tmp_path)
    train(make_cfg(*mine, "trainer=cpu", "data.batch_size=16", *epochs, "ckpt_path=last", output_dir=run))
    seen = trained_examples(record)
    assert {epoch: sorted(ids) for epoch, ids in seen.items()} == {e: sorted(o) for e, o in _orders(2).items()}
    worst = _same_weights(straight, run)
    print(f"{recipe} 2 → 1: largest weight difference from the straight run {worst:.2g}")  # for the record (-s)
    assert worst <= EXACT
    if recipe == "gan_ada_ema":  # the states compared above were live: p moved, the EMA is there
        weights = load_weights(run / "checkpoints/last.ckpt")
        assert float(weights["augment.p"]) != pytest.approx(0.2)
        assert any(k.startswith("generator_ema.") for k in weights)


@pytest.mark.distributed
@pytest.mark.slow
def test_a_balancers_per_rank_state_follows_its_rule_on_fewer_and_on_more_ranks(make_cfg, tmp_path, id_data):
    """MoCo at ``scope=rank`` keeps each rank's own K × n average, all of them in the checkpoint. 2 ranks × 8 stopped
    at step 3 and continued on 1 × 16: the rank starts from rank 0's average (rank 1's is dropped); 1 × 16 stopped at
    step 3 and continued on 2 × 8: both ranks start from its one average (a rank the checkpoint did not have takes
    rank 0's). The rule docs/reliability.md states."""
    mine = _common(id_data, tmp_path / "ids", "weighted_moco")
    start = ("+callbacks.start._target_=tests.helpers.BalancerStartState", f"+callbacks.start.dirpath={tmp_path}")
    two_to_one, one_to_two = tmp_path / "two_to_one", tmp_path / "one_to_two"
    pooled_train(two_to_one, *QUIET, *mine, "trainer=ddp_cpu", "data.batch_size=8", "trainer.max_steps=3")
    saved = balancer_states(two_to_one / "checkpoints/last.ckpt")
    assert len(saved) == 2 and not torch.equal(saved[0]["average"], saved[1]["average"])  # two ranks' own
    on = ("trainer.max_steps=4", "ckpt_path=last", f"+callbacks.start.name={two_to_one.name}")
    train(make_cfg(*mine, *start, "trainer=cpu", "data.batch_size=16", *on, output_dir=two_to_one))
    (resumed,) = started_balancer_states(tmp_path, two_to_one.name)
    assert torch.equal(resumed["average"], saved[0]["average"]) and resumed["steps"] == saved[0]["steps"] == 3

    train(make_cfg(*mine, "trainer=cpu", "data.batch_size=16", "trainer.max_steps=3", output_dir=one_to_two))
    (one,) = balancer_states(one_to_two / "checkpoints/last.ckpt")
    on = ("trainer.max_steps=4", "ckpt_path=last", f"+callbacks.start.name={one_to_two.name}")
    pooled_train(one_to_two, *QUIET, *mine, *start, "trainer=ddp_cpu", "data.batch_size=8", *on)
    both = started_balancer_states(tmp_path, one_to_two.name)
    assert len(both) == 2 and all(torch.equal(state["average"], one["average"]) for state in both)


TBPTT = ("recipe=tbptt", "trainer=cpu", "model.net.hidden_size=16", "data.seq_len=32", "model.sample_length=5")


def test_tbptt_windows_continue_on_another_batch_size_and_its_streams_are_refused_by_name(make_cfg, tmp_path):
    """tbptt's shuffled windows (``data.layout=sequences``: a fresh state each) continue mid-epoch on another batch
    size as any examples do; its streams (the hidden state carried from window to window, each rank its own streams)
    are refused mid-epoch, naming why, before anything is written — and continue on their own shape."""
    windows = tmp_path / "windows"
    train(make_cfg(*TBPTT, "data.batch_size=16", "trainer.max_steps=3", output_dir=windows))
    first = torch.load(windows / "checkpoints/last.ckpt", weights_only=True)
    train(make_cfg(*TBPTT, "data.batch_size=24", "trainer.max_epochs=1", "ckpt_path=last", output_dir=windows))
    position = first["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["position"]
    steps = 3 + -(-(position["examples"] - position["consumed"]) // 24)
    assert position["consumed"] == 3 * 16
    assert torch.load(windows / "checkpoints/last.ckpt", weights_only=True)["global_step"] == steps

    streams = tmp_path / "streams"
    train(make_cfg(*TBPTT, "data.layout=streams", "data.batch_size=4", "trainer.max_steps=2", output_dir=streams))
    record = (streams / ".hydra/config.yaml").read_text()
    with pytest.raises(ConfigError, match="carries its token streams' hidden state from window to window") as err:
        train(make_cfg(*TBPTT, "data.layout=streams", "data.batch_size=2", "ckpt_path=last", output_dir=streams))
    assert (err.value.key, err.value.value) == ("data.batch_size", 2)
    assert (streams / ".hydra/config.yaml").read_text() == record


@pytest.mark.distributed
@pytest.mark.slow
def test_tbptt_windows_continue_two_ranks_on_one_as_the_straight_run(make_cfg, tmp_path):
    """tbptt's windows on 2 ranks × 8 stopped at step 3 and continued on 1 × 16 equal the straight 1 × 16 run (its
    truncated backward passes, window by window, on the same examples in the same global batches), in float64."""
    mine = (*(o for o in TBPTT if o != "trainer=cpu"), F64)
    straight, run = tmp_path / "straight", tmp_path / "run"
    train(make_cfg(*mine, "trainer=cpu", "data.batch_size=16", "trainer.max_steps=6", output_dir=straight))
    pooled_train(run, *QUIET, *mine, "trainer=ddp_cpu", "data.batch_size=8", "trainer.max_steps=3", cwd=tmp_path)
    train(make_cfg(*mine, "trainer=cpu", "data.batch_size=16", "trainer.max_steps=6", "ckpt_path=last", output_dir=run))
    worst = _same_weights(straight, run)
    print(f"tbptt 2 → 1: largest weight difference from the straight run {worst:.2g}")  # for the record (-s)
    assert worst <= EXACT


@pytest.mark.distributed
@pytest.mark.slow
def test_two_ranks_continue_on_four_with_a_batch_that_does_not_divide_what_is_left(tmp_path, id_data):
    """2 ranks × 8 stopped at step 3 (48 examples), continued by ``python train.py`` on 4 ranks × 5 (Lightning's
    launcher starts them): the 112 left are 5 global batches of 20 and one of 12 (3 a rank, none repeated); the next
    epoch 8 of 20. Each example once, every rank trained."""
    run, record = tmp_path / "run", tmp_path / "ids"
    mine = (*_common(id_data, record), "data.num_workers=2", "trainer.max_epochs=2")
    pooled_train(run, *QUIET, *mine, "trainer=ddp_cpu", "data.batch_size=8", "trainer.max_steps=3", cwd=tmp_path)
    four = ("trainer=ddp_cpu", "trainer.devices=4", "data.batch_size=5", "trainer.max_steps=-1", "ckpt_path=last")
    proc = run_cli(*QUIET, *mine, *four, f"hydra.run.dir={run}", cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert len(list(record.glob("trained_rank*.jsonl"))) == 4
    seen = trained_examples(record)
    assert {epoch: sorted(ids) for epoch, ids in seen.items()} == {e: sorted(o) for e, o in _orders(2).items()}
    assert torch.load(run / "checkpoints/last.ckpt", weights_only=True)["global_step"] == 3 + 6 + 8


def test_a_mid_epoch_resume_on_data_of_another_size_is_refused_before_anything_is_written(make_cfg, tmp_path):
    """The place is a count of the data's examples: the file grown under its path would name other examples (at an
    epoch's end the next epoch starts on whatever the data is)."""
    path, run = tmp_path / "d.npz", tmp_path / "run"
    rng = np.random.default_rng(0)
    np.savez(path, x=rng.random((N, 64)).astype(np.float32), y=np.arange(N) % 10)
    common = (*RECIPE["accumulation"], "data=npz", f"data.path={path}", "trainer=cpu", "data.batch_size=8")
    train(make_cfg(*common, "trainer.max_steps=3", output_dir=run))
    np.savez(path, x=rng.random((N + 50, 64)).astype(np.float32), y=np.arange(N + 50) % 10)
    record = (run / ".hydra/config.yaml").read_text()
    with pytest.raises(ConfigError, match="the checkpoint's run trained on, 160 training examples") as err:
        train(make_cfg(*common, "trainer.max_steps=6", "ckpt_path=last", output_dir=run))
    assert (err.value.key, err.value.value) == ("data", "200 training examples")
    assert (run / ".hydra/config.yaml").read_text() == record


def test_global_batch_size_derives_the_accumulation_and_keeps_it_through_a_resume_on_another_batch(
    make_cfg, tmp_path, id_data, caplog
):
    """``global_batch_size=16``: 8 a batch accumulates 2 (said in one line); stopped at step 3 and continued at 16 a
    batch, k is derived again (1) from the global batch the checkpoint's run carries — the straight 1 × 16 run's
    weights (float64, to `EXACT`). A global batch that the per-rank batch does not divide is refused, naming it,
    before anything is written."""
    common = (*_common(id_data, tmp_path / "ids"), "trainer=cpu", "trainer.max_epochs=2", F64)
    straight, run = tmp_path / "straight", tmp_path / "run"
    train(make_cfg(*common, "data.batch_size=16", output_dir=straight))
    with caplog.at_level(logging.INFO, logger="multiloss"):
        train(make_cfg(*common, "global_batch_size=16", "data.batch_size=8", "trainer.max_steps=3", output_dir=run))
    assert "global batch 16 = 8 a rank × 1 rank(s) × model.accumulate_grad_batches=2" in caplog.text
    saved = torch.load(run / "checkpoints/last.ckpt", weights_only=True)
    assert saved["hyper_parameters"]["accumulate_grad_batches"] == 2
    assert saved["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["position"]["consumed"] == 48
    train(make_cfg(*common, "data.batch_size=16", "trainer.max_steps=-1", "ckpt_path=last", output_dir=run))
    worst = _same_weights(straight, run)
    print(f"global_batch_size 8 × k2 → 16: largest weight difference from the straight run {worst:.2g}")  # (-s)
    assert worst <= EXACT

    with pytest.raises(ConfigError, match=r"a multiple of data\.batch_size × ranks = 12 × 1 = 12") as err:
        train(make_cfg(*common, "global_batch_size=16", "data.batch_size=12", output_dir=tmp_path / "refused"))
    assert (err.value.key, err.value.value) == ("global_batch_size", 16)
    assert not (tmp_path / "refused").exists()
