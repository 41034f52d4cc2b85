"""A checkpoint's balancer state checked against the balancer this run builds, before anything is written.

A run continued under another method (``balancer=pcgrad ckpt_path=<a famo run>``), or from a checkpoint whose
method state is damaged (an entry missing, tensors of another task count), would otherwise fail inside Lightning's
load or at the first step, after the run dir's ``.hydra/`` and a new csv version were written. Here the state is
loaded into a throwaway balancer built as the run will build it: its entries, their shapes and its method state
(each of whose per-task tensors has the task count first: what every stateful method keeps — DWA's sums,
MoCo's and DB-MTL's averages, GradVac's, Nash-MTL's and ExcessMTL's, FAMO's) must fit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from multiloss.balancers.protocol import PACKED, PER_RANK, Balancer, unpack_state
from multiloss.config import ConfigError

PREFIX = "balancer."
# Per-task state that is not one number per task: a K × K matrix (GradVac's φ, Nash-MTL's GᵀG at its first step).
SQUARE = ("_phi_t", "init_gtg")
NOT_PER_TASK = ("normalization_factor", "step", "generator")


def describe(spec: Any) -> str:
    """``Scalarized(scalarizer=FAMO)``: a balancer config's class and its inner components' classes, for messages."""
    if not isinstance(spec, Mapping) or "_target_" not in spec:
        return "fixed" if spec is None else type(spec).__name__
    inner = [
        f"{k}={str(v['_target_']).rsplit('.', 1)[-1]}"
        for k, v in spec.items()
        if isinstance(v, Mapping) and "_target_" in v
    ]
    name = str(spec["_target_"]).rsplit(".", 1)[-1]
    return f"{name}({', '.join(inner)})" if inner else name


def check_saved_balancer(
    checkpoint: dict[str, Any], probe: Balancer, ours: Any, path: str, sharded: bool = False
) -> None:
    """Raise `ConfigError` (key ``ckpt_path``) unless the checkpoint's ``balancer.*`` entries load into ``probe`` (a
    balancer built for the checkpoint's tasks as this run builds its own; ``ours``: its config) and its method state
    has the task count. ``sharded``: ``checkpoint`` is a sharded checkpoint's meta (no state entries)."""
    state = checkpoint.get("state_dict", {})
    saved = {k[len(PREFIX) :]: v for k, v in state.items() if k.startswith(PREFIX)}
    fresh = probe.state_dict()
    theirs = describe((checkpoint.get("hyper_parameters") or {}).get("balancer"))
    accepted = (
        f"a checkpoint of a run whose balancer this run's loads ({describe(ours)}): continue with that run's "
        f"balancer ({theirs}: leave model.balancer as the run had it), or start a new run from its weights"
    )

    def refuse(problem: str) -> None:
        raise ConfigError("ckpt_path", path, accepted, problem)

    hyper = (checkpoint.get("hyper_parameters") or {}).get("balancer", ...)
    # One method's state is not another's to continue. A sharded checkpoint's entries are not read here (its meta
    # alone is): there a change of method is refused whatever it held.
    if (saved or sharded) and hyper is not ... and theirs != describe(ours):
        refuse(f"its balancer state is {theirs}'s, this run builds {describe(ours)}")
    if sharded:
        return
    if set(saved) != set(fresh):
        held, kept = sorted(saved) or "nothing", sorted(fresh) or "nothing"
        refuse(f"its balancer state holds {held}, {describe(ours)} keeps {kept}")
    for name, value in fresh.items():
        if isinstance(value, torch.Tensor) and tuple(saved[name].shape) != tuple(value.shape):
            refuse(f"its balancer's {name} is {tuple(saved[name].shape)}, {describe(ours)} keeps {tuple(value.shape)}")
    try:
        probe.load_state_dict(saved, strict=True)
    except Exception as err:
        refuse(f"its balancer state does not load into {describe(ours)}: {type(err).__name__}: {err}")
    extra = saved.get("_extra_state")
    if isinstance(extra, dict) and PACKED in extra:
        unpacked = unpack_state(extra)
        states = unpacked[PER_RANK] if isinstance(unpacked, dict) and PER_RANK in unpacked else [unpacked]
        for rank_state in states:
            if (wrong := _not_per_task(rank_state, len(probe.tasks))) is not None:
                refuse(f"its balancer state is damaged: {wrong} (the run has {len(probe.tasks)} tasks)")


def _not_per_task(state: Any, k: int, where: str = "") -> str | None:
    """The first tensor of a method's state that is not per task (K first; K × K for the square ones), or None."""
    if isinstance(state, Mapping):
        for name, value in state.items():
            if str(name) in NOT_PER_TASK:
                continue
            if (found := _not_per_task(value, k, f"{where}.{name}" if where else str(name))) is not None:
                return found
        return None
    if isinstance(state, Sequence) and not isinstance(state, str | bytes):
        return next((f for i, v in enumerate(state) if (f := _not_per_task(v, k, f"{where}[{i}]")) is not None), None)
    if isinstance(state, torch.Tensor) and state.dim() > 0:
        shape = tuple(state.shape)
        square = any(part in SQUARE for part in where.split("."))
        if shape[0] != k or (square and shape != (k, k)):
            return f"{where} is {shape}, not {'(K, K)' if square else '(K, ...)'}"
    return None
