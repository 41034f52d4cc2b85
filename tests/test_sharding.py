"""Sharded training (FSDP2, ``trainer=fsdp_cpu``: 2 CPU processes, gloo) against DDP (``trainer=ddp_cpu``).

Every recipe, and every balancer, ends with DDP's weights (same seed, data and steps; in float64,
``trainer.precision=64-true``, to `EXACT`; the GAN with G_ema, lazy R1 and ADA to the bit, its EMA and ADA's p
included);
accumulation reduce-scatters once an optimizer step; a sharded run stopped at every kind of stop and resumed
ends with the straight run's weights; the sharded ``last.ckpt`` (a directory, one shard a rank) is verified,
evaluated, loaded and consolidated into one file; what FSDP2 cannot do is refused before a process starts.

Each run is `multiloss.train` on two real ranks kept for the worker's runs (`tests.rank_pool`); what only the
command shows (a SIGTERM's stop, the evaluation's command) runs ``python train.py ...`` as a user starts it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from multiloss.recipes.gan import GAN as GANRecipe

from multiloss import train
from multiloss.cli import consolidate_main
from multiloss.config import ConfigError
from multiloss.data.vocabulary import pydoc_text
from multiloss.saving.checkpoints import verify_checkpoint
from multiloss.saving.saved_state import is_sharded_checkpoint
from tests.conftest import QUIET, ROOT, SMALL_GAN, load_weights, run_cli, train_here
from tests.helpers import logged_rates
from tests.rank_pool import pooled_train

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

FSDP, DDP = ("trainer=fsdp_cpu",), ("trainer=ddp_cpu",)
F64 = "trainer.precision=64-true"  # a proof's runs: the module, its batches and its steps in float64 (FSDP2's too)
# float64: equal up to rounding, on any CPU. FSDP2 and DDP (and one device) sum the same examples' gradients in other
# groupings (a reduce-scatter, an all-reduce, one batch), so they part only by rounding, ~1e-16 relative a step.
EXACT = 1e-10
QUIET_RUN = (*QUIET, "~callbacks.loss_curves", "trainer.num_sanity_val_steps=0", "trainer.limit_val_batches=2")
SMALL_NET = ("model.net.width=16", "data.shuffle=false")
# The GAN on FSDP2's own schedule: no gradient penalty (with one, the critic is held whole: gan-wgan-gp below).
GAN = ("recipe=gan", "model.loss=nonsaturating", "model.penalty=none", *SMALL_GAN, "model.n_plot_samples=0")
# Stacked digits as 3 × 8 × 8 images, for the conv nets.
STACKED_IMAGES = (
    "recipe=gan",
    "data=stacked_digits",
    "data.resolution=8",
    "data.n_samples=512",
    "data.batch_size=16",
    "model.latent_dim=8",
)
RECIPES = {
    "multihead": ("recipe=multihead", *SMALL_NET, "data.batch_size=64", "trainer.max_steps=6"),
    # Units by class (the trunk's blocks; the heads stay in the root's unit), each block's forward recomputed in
    # the backward (DDP ignores the FSDP policy).
    "multihead-checkpointed": (
        "recipe=multihead",
        *SMALL_NET,
        "data.batch_size=64",
        "trainer.max_steps=6",
        "model.fsdp.shard=[Sequential]",
        "model.fsdp.checkpoint=[Sequential]",
    ),
    "weighted": ("recipe=weighted", *SMALL_NET, "data.batch_size=64", "trainer.max_steps=6"),
    # Two epochs: DWA's weights come from the previous epochs' losses.
    "weighted-uncertainty": (
        "recipe=weighted",
        "balancer=uncertainty",
        *SMALL_NET,
        "data.batch_size=64",
        "trainer.max_steps=6",
    ),
    "weighted-dwa": ("recipe=weighted", "balancer=dwa", *SMALL_NET, "data.batch_size=256", "trainer.max_epochs=3"),
    # The gradient balancers: the net held whole for its step (each task's autograd.grad), then reduce-scattered by
    # hand. PCGrad with the conflict monitor on rank zero; GradNorm on a named `shared` layer (parameters found by
    # name on the whole net) with 2 micro-batches a step (the whole gradient summed before the reduce-scatter).
    "weighted-pcgrad": (
        "recipe=weighted",
        "balancer=pcgrad",
        "monitor=conflicts",
        *SMALL_NET,
        "data.batch_size=64",
        "trainer.max_steps=6",
        "trainer.log_every_n_steps=2",
    ),
    "weighted-gradnorm": (
        "recipe=weighted",
        "balancer=gradnorm",
        "model.balancer.shared=[trunk.1]",
        "model.accumulate_grad_batches=2",
        *SMALL_NET,
        "data.batch_size=64",
        "trainer.max_steps=4",
    ),
    "multihead-mgda": ("recipe=multihead", "balancer=mgda", *SMALL_NET, "data.batch_size=64", "trainer.max_steps=6"),
    "accumulation": ("recipe=accumulation", *SMALL_NET, "model.accumulate_grad_batches=2", "trainer.max_steps=4"),
    "gan": (*GAN, "data.n_samples=1024", "data.batch_size=128", "trainer.max_steps=12"),
    # WGAN-GP: the penalty's double backward through a critic held whole for its step, 2 micro-batches a step (its
    # whole gradient summed before the reduce-scatter); G on the critic's noise.
    "gan-wgan-gp": (
        "recipe=gan",
        "model.loss=wgan-gp",
        "model.penalty_weight=0.1",
        "model.n_critic=2",
        "model.g_input=same_z",
        "model.accumulate_grad_batches=2",
        *SMALL_GAN,
        "model.n_plot_samples=0",
        "data.n_samples=1024",
        "data.batch_size=64",
        "trainer.max_steps=12",
    ),
    # The modern options on the digits: hinge, R1 taken lazily (its own D step every 2, the critic held whole), G_ema
    # sharded like G, and ADA: D sees augmented images (DiffAugment's three policies, draws from the checkpointed
    # noise stream sharded like the data), p moved every 2 D steps by the ranks' summed signs (the lazy step's too).
    "gan-modern": (
        "recipe=gan",
        "data=digits",
        "model.data_dim=64",
        "model.latent_dim=8",
        "model.loss=hinge",
        "model.penalty=r1",
        "model.penalty_weight=0.1",
        "model.penalty_every=2",
        "model.n_critic=1",
        "+model.g_ema.half_life_images=100",
        "+model.augment.policy=[color,translation,cutout]",
        "+model.augment.p=0.2",
        "+model.augment.ada_target=0.6",
        "+model.augment.ada_interval=2",
        "+model.augment.ada_kimg=10",  # steps of 0.0128: p moves without reaching 0
        *SMALL_GAN,
        "model.n_plot_samples=0",
        "data.batch_size=32",
        "trainer.max_steps=16",
    ),
    "tbptt": ("recipe=tbptt", "data=text", "data.level=chars", "data.layout=streams", "data.batch_size=4"),
    # R3GAN's and stylegan2-ada's options on the shipped conv nets (stacked digits as 3 × 8 × 8 images): R1 + R2 (D
    # held whole for its step), path length every 2 G steps (G held whole for its Greg step), the schedules over
    # images (rate, γ, β2, the EMA half-life), the gradient clean-up, D and G on their own batches, Adam; and the
    # DCGAN pair on dcgan/main.py's BCE (two backward calls) with G's BatchNorm.
    "gan-stylegan2": (
        *STACKED_IMAGES,
        "generator=stylegan2",
        "discriminator=resnet",
        "model.generator.resolution=8",
        "model.generator.width=8",
        "model.generator.w_dim=8",
        "model.generator.output=sigmoid",
        "model.discriminator.resolution=8",
        "model.discriminator.width=8",
        "model.loss=relativistic",
        "model.penalty=[r1,r2]",
        "model.penalty_weight=0.5",
        "model.n_critic=1",
        "model.g_reg_every=2",
        "+model.path_length.weight=2",
        "model.clean_gradients=true",  # (nan_to_num on each rank's shard of the gradients)
        "model.g_reals=own_batch",  # R3GAN's: D on one batch, G on the next
        "+model.g_ema.half_life_images=1",
        "+model.schedules.gamma={base_value: 0.5, final_value: 0.05, total_nimg: 256}",
        "+model.schedules.beta2={base_value: 0.9, final_value: 0.99, total_nimg: 256}",
        "+model.schedules.ema_half_life={base_value: 0, final_value: 200, total_nimg: 256}",
        "scheduler=images",
        "model.scheduler.total_nimg=256",
        "model.n_plot_samples=0",
        "trainer.max_steps=12",
    ),
    "gan-dcgan": (
        *STACKED_IMAGES,
        "generator=dcgan",
        "discriminator=dcgan",
        "model.generator.resolution=8",
        "model.generator.width=8",
        "model.generator.output=sigmoid",
        "model.discriminator.resolution=8",
        "model.discriminator.width=8",
        "model.discriminator.sigmoid=true",
        "model.loss=bce",
        "model.penalty=none",
        "model.n_critic=1",
        "model.n_plot_samples=0",
        "trainer.max_steps=12",
    ),
}
TBPTT = ("data.seq_len=16", "model.chunk_length=8", "model.net.embedding_dim=8", "model.net.hidden_size=16")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[str, ...]:
    root = tmp_path_factory.mktemp("corpus")
    text = pydoc_text()
    (root / "train.txt").write_text(text[: 8 * 48 + 1])  # 8 streams of 48 characters: 4 a rank, 3 windows of 16
    (root / "valid.txt").write_text(text[1000:1200])
    return (f"data.path={root / 'train.txt'}", f"data.val_path={root / 'valid.txt'}", "model.sample_length=5", *TBPTT)


def _train(out: Path, *overrides: str) -> Path:
    """A 2-rank run of ``python train.py <overrides>`` on this worker's two ranks (`tests.rank_pool`)."""
    return pooled_train(out, *QUIET_RUN, *overrides)


def _worst(a: Path, b: Path, skip: str | None = None) -> float:
    """The largest difference of two runs' weights and buffers (``skip``: names containing it left out), each pair in
    its own dtype (a float32 cast would round away a float64 run's differences); their counts equal."""
    wa, wb = load_weights(a / "checkpoints/last.ckpt"), load_weights(b / "checkpoints/last.ckpt")
    assert wa.keys() == wb.keys()
    names = [k for k in wa if isinstance(wa[k], torch.Tensor) and not (skip and skip in k)]
    assert all(wa[k].dtype == wb[k].dtype for k in names)
    floats = [k for k in names if wa[k].is_floating_point()]
    assert all(torch.equal(wa[k], wb[k]) for k in names if k not in floats), "a count differs"
    return max((wa[k] - wb[k]).abs().max().item() for k in floats)


def _float64(run: Path) -> None:
    """Every floating-point weight and buffer of the run is float64: it ran in float64 end to end."""
    weights = load_weights(run / "checkpoints/last.ckpt")
    assert {v.dtype for v in weights.values() if isinstance(v, torch.Tensor) and v.is_floating_point()} == {
        torch.float64
    }


# Not compared again: multihead and weighted with fixed weights (their steps run in multihead-mgda, multihead-
# checkpointed and weighted-uncertainty, with the default units in the first and last). Nor weighted-upgrad: torchjd's
# aggregator path is multihead-mgda's (the same JacobianDescent), weighted's held net is pcgrad's and gradnorm's.
COMPARED = sorted(set(RECIPES) - {"multihead", "weighted"})


@pytest.mark.parametrize("case", COMPARED)
def test_each_recipe_sharded_ends_with_ddps_weights(tmp_path, corpus, case):
    common = (*RECIPES[case], *(corpus if case == "tbptt" else ()), F64)
    counter = ("+callbacks.count._target_=tests.helpers.ReduceScatterCounter", f"+callbacks.count.dirpath={tmp_path}")
    sharded = _train(tmp_path / "fsdp", *common, *FSDP, *(counter if case == "accumulation" else ()))
    replicated = _train(tmp_path / "ddp", *common, *DDP)

    last = sharded / "checkpoints/last.ckpt"
    assert is_sharded_checkpoint(last)  # every rank wrote its own shard, no gather to rank 0
    assert sorted(p.name for p in last.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    # BatchNorm's running statistics are each rank's own (its own batches) under both engines; DDP's checkpoint holds
    # rank 0's, the sharded one (likely) the copy DCP picks a writer for: 2.7e-3 apart after 12 steps, every weight
    # equal to the bit.
    _float64(sharded)
    worst = _worst(sharded, replicated, skip="running_" if case == "gan-dcgan" else None)
    print(f"{case}: FSDP2 vs DDP, largest weight difference {worst:.2g}")  # for the record (pytest -s)
    assert worst <= EXACT
    if case in ("gan-dcgan", "gan-stylegan2"):
        assert worst == 0.0  # every weight to the bit (the DCGAN's BatchNorm statistics aside: above)
    if case == "gan-modern":
        # The same bits as DDP's (2 ranks: one sum a gradient, in either collective): G, D, G_ema and its image count;
        # ADA's p and its sign sums.
        assert worst == 0.0
        p = load_weights(last)["augment.p"]
        assert p.item() != pytest.approx(0.2) and 0 < p.item() < 0.4, p
    if case == "weighted-dwa":
        # DWA's running sums (a dict of extra state: flattened key by key in a sharded checkpoint) continue
        # exactly from an epoch end: the epoch's mean is the ranks' summed sums over the count, so a resume from
        # their mean gives the same bits (the ranks' reduce is DDP's too). Against the straight run above.
        again = (
            *(o for o in common if o != "trainer.max_epochs=3"),
            *FSDP,
            "callbacks.model_checkpoint.epoch_save_seconds=0",
        )
        run = _train(tmp_path / "resumed", *again, "trainer.max_epochs=2")
        _train(run, *again, "trainer.max_epochs=3", "ckpt_path=last")
        assert _worst(sharded, run) == 0.0
    if case == "accumulation":
        # The micro-batch that does not step skips the reduce-scatter: one a sharded unit an optimizer step.
        for rank in (0, 1):
            counts = json.loads((tmp_path / f"reducescatter_rank{rank}.json").read_text())
            assert counts["optimizer_steps"] == 4 and counts["units"] >= 2, counts
            assert counts["reduces"] == counts["units"] * counts["optimizer_steps"], counts


# WGAN-GP, its critic held whole for its step (the penalty's double backward): 12 steps an epoch.
@pytest.mark.parametrize(("recipe", "balancer"), [("weighted", "pcgrad"), ("multihead", "gradnorm")])
def test_the_sharded_rule_is_one_devices_rule_on_the_global_batch(tmp_path, recipe, balancer):
    """``model.balancer.scope=global`` under FSDP2: each task's gradient reduce-scattered, the rule from the Gramian of
    the shards (the net never held whole): 2 ranks × 64 end with the weights of one device on batches of 128. Under
    DDP (PCGrad) the same scope all-reduces the task gradients: the same weights again. SGD: equal gradients, equal
    weights; in float64, to `EXACT`."""
    common = (f"recipe={recipe}", f"balancer={balancer}", *SMALL_NET, "optimizer=sgd", "trainer.max_steps=6", F64)
    sharded = _train(tmp_path / "fsdp", *common, "model.balancer.scope=global", "data.batch_size=64", *FSDP)
    one = train_here(tmp_path / "one", *QUIET_RUN, *common, "data.batch_size=128", "trainer=cpu")
    _float64(sharded)
    worst = _worst(sharded, one)
    print(f"{balancer} scope=global: FSDP2 2 x 64 vs one device x 128, largest weight difference {worst:.2g}")
    assert worst <= EXACT
    if balancer == "pcgrad":
        replicated = _train(tmp_path / "ddp", *common, "model.balancer.scope=global", "data.batch_size=64", *DDP)
        worst = _worst(replicated, one)
        print(f"{balancer} scope=global: DDP 2 x 64 vs one device x 128, largest weight difference {worst:.2g}")
        assert worst <= EXACT


GAN_RESUMED = (
    "recipe=gan",
    "model.loss=wgan-gp",
    "model.penalty_weight=0.1",
    *SMALL_GAN,
    "model.n_plot_samples=0",
    "data.n_samples=1536",
    "data.batch_size=128",
    "model.n_critic=1",
)
SCHEDULE = ("scheduler=warmup_cosine", "model.scheduler.warmup_steps=4", "model.scheduler.total_steps=40")


def test_a_stateful_rule_resumes_its_ranks_own_state_from_a_sharded_checkpoint(tmp_path):
    """MoCo (``scope=rank``, the net held whole): each rank's K × n averages are its own; the sharded checkpoint holds
    every rank's (packed as bytes: torch.distributed.checkpoint loads into the fresh module's structure, whose
    averages are None before a step) and each rank resumes with its own: 3 + 3 steps end as 6 straight (0.0)."""
    common = ("recipe=weighted", "balancer=moco", *SMALL_NET, "data.batch_size=32", *FSDP)
    straight = _train(tmp_path / "straight", *common, "trainer.max_steps=6")
    first = _train(tmp_path / "first", *common, "trainer.max_steps=3")
    resumed = _train(tmp_path / "resumed", *common, "trainer.max_steps=6", f"ckpt_path={first}/checkpoints/last.ckpt")
    assert _worst(straight, resumed) == 0.0


def _signal_at(step: int) -> tuple[str, ...]:
    return ("+callbacks.signal._target_=tests.helpers.SignalAt", f"+callbacks.signal.step={step}")


def _stopped(out: Path, *overrides: str) -> None:
    proc = run_cli(*QUIET_RUN, *overrides, f"hydra.run.dir={out}", cwd=out.parent, timeout=600)
    assert proc.returncode == 143, proc.stderr[-4000:]  # SIGTERM: saved, then 128 + 15
    assert "run stopped: SIGTERM" in proc.stderr


def test_a_sharded_run_stopped_at_every_kind_of_stop_ends_as_the_straight_run(tmp_path, capsys):
    """The WGAN-GP (two optimizers, each on its own network's shards, the critic held whole) under a warm-up cosine:
    SIGTERM mid-epoch 0, SIGTERM on its last batch, an epoch end, ``max_steps`` mid-epoch 2, then the end — each
    continued with ``ckpt_path=last`` from the sharded checkpoint — ends with the weights and rates of a run never
    stopped."""
    common = (*GAN_RESUMED, *SCHEDULE, *FSDP, "trainer.log_every_n_steps=1", "data.shuffle=false")
    straight = _train(tmp_path / "straight", *common, "trainer.max_epochs=3")
    run = tmp_path / "run"
    _stopped(run, *common, "trainer.max_epochs=3", *_signal_at(6))
    _stopped(run, *common, "trainer.max_epochs=3", "ckpt_path=last", *_signal_at(10))
    assert torch.load(run / "checkpoints/last.ckpt/meta.pt", weights_only=True)["global_step"] == 12
    _train(run, *common, "trainer.max_epochs=2", "ckpt_path=last")
    _train(run, *common, "trainer.max_epochs=3", "trainer.max_steps=30", "ckpt_path=last")
    _train(run, *common, "trainer.max_epochs=3", "ckpt_path=last")

    assert _worst(straight, run) == 0.0
    assert logged_rates(run) == logged_rates(straight)

    # The sharded checkpoint serves as a file would: verified against the model, read whole, consolidated.
    last = run / "checkpoints/last.ckpt"
    module = GANRecipe.load_from_checkpoint(last, weights_only=True)
    assert verify_checkpoint(last, module)["global_step"] == 36
    whole = tmp_path / "whole.ckpt"
    consolidate_main([str(last), str(whole)])  # multiloss-consolidate, in this process (no process group needed)
    single = torch.load(whole, weights_only=True)
    expected = load_weights(last)
    assert all(torch.equal(single["state_dict"][k], v) for k, v in expected.items())
    assert single["global_step"] == 36 and len(single["optimizer_states"]) == 2
    assert all(isinstance(k, int) for k in single["optimizer_states"][0]["state"])  # Optimizer.state_dict's keys
    assert all(torch.equal(module.state_dict()[k], v) for k, v in expected.items())  # load_from_checkpoint
    # One file is never written over.
    with pytest.raises(SystemExit) as refused:
        consolidate_main([str(last), str(whole)])
    assert refused.value.code == 2 and "never overwritten" in capsys.readouterr().err

    # A shard gone: the guard names it before anything runs.
    (last / "__1_0.distcp").rename(tmp_path / "moved.distcp")
    with pytest.raises(ConfigError, match="shard files missing"):
        verify_checkpoint(last, module)


def test_tbptt_streams_sharded_resume_mid_epoch_keeps_the_carried_state(tmp_path, corpus):
    """tbptt's carried hidden state a stream survives a SIGTERM mid-epoch of a sharded run."""
    common = (*RECIPES["tbptt"], *corpus, *FSDP, "trainer.max_epochs=2")
    straight = _train(tmp_path / "straight", *common)
    run = tmp_path / "run"
    _stopped(run, *common, *_signal_at(4))
    _train(run, *common, "ckpt_path=last")
    assert _worst(straight, run) == 0.0


# A script, not `python -c`: Lightning relaunches the other rank with this process's argv.
EVAL = (sys.executable, str(ROOT / "eval.py"))


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (("recipe=multihead", "trainer.precision=bf16-mixed"), "trainer.precision"),
        # Lightning's own refusal of 16-mixed suggested bf16, which the CPU cannot do either.
        (("recipe=multihead", "trainer.precision=16-mixed"), "trainer.precision"),
        # Refused at the first step, after .hydra/ was written: the rule on the shards needs a Gramian weighting.
        (
            (
                "recipe=multihead",
                "balancer=upgrad",
                "model.balancer.aggregator._target_=torchjd.aggregation.Mean",
                "model.balancer.scope=global",
            ),
            "model.balancer.aggregator",
        ),
        (("recipe=multihead", "model.fsdp.shard=[NoSuchBlock]"), "model.fsdp.shard"),
        (
            ("recipe=weighted", "balancer=pcgrad", "model.balancer.scope=global", "model.accumulate_grad_batches=2"),
            "model.balancer.scope",
        ),
    ],
)
def test_what_fsdp2_cannot_do_is_refused_before_a_process_starts(make_cfg, tmp_path, overrides, key):
    with pytest.raises(ConfigError) as err:
        train(make_cfg(*overrides, *FSDP, output_dir=tmp_path / "run"))
    assert err.value.key == key
    assert not (tmp_path / "run").exists()  # nothing written: not even the run dir


def test_a_sharded_checkpoint_continues_under_ddp_and_evaluates_on_one_process_as_under_fsdp(tmp_path):
    """Out of room no more (or moved to a DDP cluster): epoch 1 under FSDP2, its sharded last.ckpt evaluated under
    FSDP2 and on one process (the same metrics), then epoch 2 under DDP *in the same run dir* from that checkpoint,
    read whole, ending at the straight FSDP2 run's weights; then epoch 3 under FSDP2 again there. Each save puts its
    kind of checkpoint (a file, a directory of shards) in place of the other (the outside check: DDP over the shards'
    directory hung after "max_epochs=2 reached"; a file save failed with "Is a directory")."""
    common = (*RECIPES["multihead"][:-1], "data.batch_size=256", "callbacks.model_checkpoint.epoch_save_seconds=0")
    straight = _train(tmp_path / "straight", *common, *FSDP, "trainer.max_epochs=2")
    run = _train(tmp_path / "run", *common, *FSDP, "trainer.max_epochs=1")

    metrics = {}
    for name, trainer in (("fsdp", ()), ("one", ("trainer=cpu",))):
        proc = subprocess.run(
            # The whole validation set: limit_val_batches counts a rank's batches.
            [
                *EVAL,
                f"ckpt_path={run / 'checkpoints/last.ckpt'}",
                *trainer,
                "trainer.limit_val_batches=1.0",
                f"hydra.run.dir={tmp_path / name}",
            ],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        metrics[name] = [line for line in proc.stdout.split("final values")[1].splitlines() if "val/" in line]
    assert metrics["fsdp"] and metrics["fsdp"] == metrics["one"]

    _train(run, *common, *DDP, "trainer.max_epochs=2", "ckpt_path=last")
    assert (run / "checkpoints/last.ckpt").is_file()
    assert _worst(straight, run) == 0.0
    _train(run, *common, *FSDP, "trainer.max_epochs=3", "ckpt_path=last")
    assert is_sharded_checkpoint(run / "checkpoints/last.ckpt")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["last.ckpt"]  # nothing staged or aside left
