"""A balancer's keys and saved state under faults: a wrong value of a method's inner component is named by its own
key; a run continued under another method, or from a damaged method state, is refused before anything is written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from multiloss import testing, train
from multiloss.balancers.protocol import PACKED, pack_state, unpack_state
from multiloss.config import ConfigError
from tests.conftest import QUIET, run_cli

pytest.importorskip("torchjd")
SHORT = (*QUIET, "~callbacks.loss_curves", "trainer=cpu", "trainer.num_sanity_val_steps=0", "trainer.max_steps=3")
EXACT = 1e-10  # float64: equal up to rounding, on any CPU


@pytest.mark.parametrize(
    ("overrides", "key", "value"),
    [
        (("balancer=cagrad", "model.balancer.aggregator.c=-1"), "model.balancer.aggregator.c", -1),
        (("balancer=stch", "model.balancer.scalarizer.mu=-1"), "model.balancer.scalarizer.mu", -1),
    ],
)
def test_an_inner_components_value_is_named_by_its_own_key(tmp_path, overrides, key, value):
    cfg = testing.compose("recipe=weighted", *overrides, output_dir=tmp_path)
    with pytest.raises(ConfigError) as err:
        testing.build(cfg)
    assert (err.value.key, err.value.value) == (key, value)
    assert ("accepts" in err.value.accepted and "must" in err.value.accepted) or "positive" in err.value.accepted


@pytest.mark.parametrize(
    ("overrides", "key", "value"),
    [
        (("balancer=stch", "model.balancer.convention=paper"), "model.balancer.convention", "paper"),
        (("balancer=excess_mtl", "model.balancer.convention=lib"), "model.balancer.convention", "lib"),
        (
            ("balancer=stch", "model.balancer.convention=libmtl", "model.balancer.warmup_epochs=-1"),
            "model.balancer.warmup_epochs",
            -1,
        ),
        (
            ("balancer=stch", "model.balancer.convention=libmtl", "model.balancer.scalarizer.mu=0"),
            "model.balancer.scalarizer.mu",
            0,
        ),
        (
            ("balancer=excess_mtl", "model.balancer.aggregator.robust_step_size=0"),
            "model.balancer.aggregator.robust_step_size",
            0,
        ),
    ],
)
def test_a_convention_and_its_options_are_checked_by_key(tmp_path, overrides, key, value):
    cfg = testing.compose("recipe=weighted", *overrides, output_dir=tmp_path)
    with pytest.raises(ConfigError) as err:
        testing.build(cfg)
    assert (err.value.key, err.value.value) == (key, value)


@pytest.mark.parametrize("name", ["stch", "excess_mtl", "cagrad", "aligned_mtl", "nash_mtl", "fairgrad"])
def test_every_convention_libmtl_setting_builds_from_the_shell(tmp_path, name):
    """``model.balancer.convention=libmtl`` from the shell builds LibMTL's form of each method (the weighted
    recipe's three digit tasks: K = 3)."""
    from multiloss.balancers.gradients import libmtl_aligned_mtl
    from multiloss.balancers.scalarized import LibMTLSTCH

    cfg = testing.compose(
        "recipe=weighted", f"balancer={name}", "model.balancer.convention=libmtl", output_dir=tmp_path
    )
    _, model = testing.build(cfg)
    balancer = model.balancer
    assert balancer.convention == "libmtl"
    if name == "stch":
        assert isinstance(balancer.scalarizer, LibMTLSTCH) and balancer.scalarizer.warmup_epochs == 4
        return
    form = (balancer.shared_factor, balancer.heads_weighted, balancer.libmtl_weighting)
    assert (
        form
        == {
            "excess_mtl": (3.0, True, None),  # weights summing to K, heads weighted
            "cagrad": (1 / (1 + 0.5**2), False, None),  # rescale=1: ÷ (1 + c²)
            "aligned_mtl": (1.0, False, libmtl_aligned_mtl),  # B.sum(0), float32's tolerance
            "nash_mtl": (1.0, True, None),  # Σ αᵢLᵢ backwarded: heads weighted
            "fairgrad": (1.0, True, None),
        }[name]
    )


def _trained(tmp_path: Path, *overrides: str) -> Path:
    out = tmp_path / "run"
    train(testing.compose(*SHORT, *overrides, output_dir=out))
    return out / "checkpoints/last.ckpt"


@pytest.mark.parametrize(
    ("recipe", "before", "after", "said"),
    [
        ("multihead", "uncertainty", "fixed", "its balancer state is Uncertainty's, this run builds Fixed"),
        ("weighted", "famo", "pcgrad", "is Scalarized(scalarizer=FAMO)'s, this run builds PCGrad"),
        ("weighted", "moco", "db_mtl", "its balancer state is MoCo's, this run builds DBMTL"),  # the same entries
    ],
)
def test_a_run_continued_under_another_method_is_refused_before_anything_is_written(
    tmp_path, recipe, before, after, said
):
    ckpt = _trained(tmp_path, f"recipe={recipe}", f"balancer={before}")
    proc = run_cli(
        *SHORT,
        f"recipe={recipe}",
        f"balancer={after}",
        f"ckpt_path={ckpt}",
        f"hydra.run.dir={ckpt.parents[1]}",
        "trainer.max_steps=6",
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and said in proc.stderr, proc.stderr[-2000:]
    assert "continue with that run's balancer" in proc.stderr
    assert sorted(p.name for p in (ckpt.parents[1] / "csv").iterdir()) == ["version_0"]  # no new version written


def _repacked(ckpt: Path, out: Path, change) -> Path:
    checkpoint = torch.load(ckpt, weights_only=True)
    checkpoint["state_dict"] = change(checkpoint["state_dict"])
    torch.save(checkpoint, out)
    return out


def _with_state(state: dict, edit) -> dict:
    extra = state["balancer._extra_state"]
    assert PACKED in extra
    inner = unpack_state(extra)
    edit(inner)
    return {**state, "balancer._extra_state": pack_state(inner)}


@pytest.mark.parametrize(
    ("recipe", "balancer", "damage", "said"),
    [
        ("multihead", "moco", lambda s: {k: v for k, v in s.items() if k != "balancer._extra_state"}, "holds nothing"),
        ("weighted", "moco", lambda s: _with_state(s, lambda i: i.update(lambd=torch.ones(4) / 4)), "lambd is (4,)"),
        (
            "weighted",
            "gradvac",
            lambda s: _with_state(s, lambda i: i["weighting.weighting"].update(_phi_t=torch.zeros(3, 2))),
            "_phi_t is (3, 2), not (K, K)",
        ),
    ],
)
def test_a_damaged_method_state_is_refused_naming_what_differs(tmp_path, recipe, balancer, damage, said):
    ckpt = _trained(tmp_path, f"recipe={recipe}", f"balancer={balancer}")
    damaged = _repacked(ckpt, tmp_path / "damaged.ckpt", damage)
    cfg = testing.compose(
        *SHORT,
        f"recipe={recipe}",
        f"balancer={balancer}",
        f"ckpt_path={damaged}",
        "trainer.max_steps=6",
        output_dir=tmp_path / "on",
    )
    with pytest.raises(ConfigError, match=said.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")) as err:
        train(cfg)
    assert err.value.key == "ckpt_path"
    assert not (tmp_path / "on" / "csv").exists()


def test_mocos_logged_weights_are_the_lambda_its_step_used():
    """MoCo updates λ inside its rule: the weights a step reports are that λ (base × λ), not the step before's."""
    from torch import nn

    from multiloss.balancers import MoCo, balance
    from multiloss.parallel.parallelism import Parallelism

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    balancer = MoCo(["a", "b"], [1.0, 1.0], net=net)
    x = torch.randn(16, 4)
    for _ in range(3):
        out = net(x)
        losses = {"a": out[:, 0].square().mean(), "b": (out[:, 1] - 1).square().mean()}
        balanced = balance(balancer, losses, net, Parallelism(None), 0, None, None, None)
        assert torch.equal(balanced.weights, balancer.base * balancer.lambd)


def test_a_deep_copy_of_a_net_between_its_forward_and_the_step_works_and_records_nothing():
    """The layer Gramian's hooks record where a forward's outputs sit in its graph: a deep copy of the net in between
    (an EMA copy) copies nothing of that graph, and the copy's forwards are not recorded."""
    import copy

    from torch import nn

    from multiloss.balancers.layer_gramian import LayerGramian

    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    recorder = LayerGramian(net)
    net(torch.randn(3, 4))
    recorded = dict(recorder.cuts)
    assert recorded  # the Linear, ReLU and Linear outputs (the Sequential's is the last Linear's)
    twin = copy.deepcopy(net)  # raised before: a recorded output is not a leaf
    twin(torch.randn(3, 4))
    assert recorder.cuts == recorded
    recorder.remove()
    net(torch.randn(3, 4))
    assert recorder.cuts == {} and not net[0]._forward_hooks


def test_the_shipped_mlp_with_batch_norm_keeps_the_gramian_segment_by_segment(tmp_path):
    """``model.net.batch_norm=true`` (BatchNorm1d in the shared trunk) no longer sends a Gramian rule to the K
    gradients: no fallback said, and the run equals the rule on the K gradients (float64: ``trainer.precision=64-true``,
    equal to rounding)."""
    import warnings

    runs = {}
    for gramian in ("layers", "gradients"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            runs[gramian] = _trained(
                tmp_path / gramian,
                "recipe=weighted",
                "balancer=pcgrad",
                "model.net.batch_norm=true",
                "optimizer=sgd",
                "trainer.precision=64-true",
                f"model.balancer.gramian={gramian}",
            )
        assert not [w for w in caught if "model.balancer" in str(w.message)], gramian
    layers, gradients = (torch.load(runs[g], weights_only=False)["state_dict"] for g in ("layers", "gradients"))
    moved = [k for k in layers if k.startswith("net.trunk") and k.endswith("weight")]
    tensors = [k for k, v in layers.items() if isinstance(v, torch.Tensor) and v.is_floating_point()]
    assert all(layers[k].dtype == torch.float64 for k in moved)
    assert moved and max(float((layers[k] - gradients[k]).abs().max()) for k in tensors) <= EXACT  # measured 1.4e-16
