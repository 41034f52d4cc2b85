"""`Parallelism`: how a run's ranks share the work — one device, DDP or FSDP2 — decided once, from the Trainer.

The one place that answers "is this run sharded?" (`Parallelism.sharded`), and the one owner of what a
recipe's step needs from the parallel engine: the no-sync block of a micro-batch that does not step,
the components held whole for their step under FSDP2 (`multiloss.parallel.sharding.LocalGradients`), the
networks' sharding at ``configure_model``, the averaging of a balancer's unsharded gradients before each
optimizer step. `strategy_of` puts multiloss's own strategies (Hydra-job launching, one DDP wrapper per
network, FSDP2 with all ranks data-parallel) in place of Lightning's, once, when the Trainer is built.
The strategies themselves (`multiloss.parallel.ddp.DDPStrategy`, `multiloss.parallel.fsdp.FSDPStrategy`) own
the launch, the torchrun join and the teardown.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import lightning as L
from lightning.pytorch.strategies import ModelParallelStrategy

from multiloss import lightning_internals as internals
from multiloss.parallel import early_ranks, sharding

NOTHING = contextlib.nullcontext()  # reusable: a block that changes nothing
_ATTRIBUTE = "_multiloss_parallelism"  # where a strategy keeps the one Parallelism chosen for it


class Parallelism:
    """One device or DDP: nothing is sharded; a micro-batch that does not step skips DDP's all-reduce."""

    sharded: ClassVar[bool] = False

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self.held: dict[str, sharding.LocalGradients] = {}  # the components held whole for their step, by name

    def no_sync(self, active: bool = True) -> Any:
        """A block whose backward no rank reduces (DDP's ``no_sync``, FSDP2's ``set_requires_gradient_sync(False)``)
        when ``active``: its gradients stay in ``.grad`` and the next synced backward reduces their sum."""
        if not active or self.strategy is None:
            return NOTHING
        return internals.no_gradient_sync(self.strategy)

    def held_whole(self, stepping: bool, components: Sequence[str] | None = None) -> Any:
        """A block around the forward and backward(s) of ``components`` (None: every one held whole): under FSDP2 their
        gradients are handed over at its end, averaged into the shards when ``stepping``; nothing otherwise."""
        if not self.held:  # one device, DDP, or nothing held whole: every step's case
            return NOTHING
        held = list(self.held.values()) if components is None else [self.held[n] for n in components if n in self.held]
        if not held:
            return NOTHING
        stack = contextlib.ExitStack()
        for component in held:
            stack.enter_context(component.step(stepping))
        return stack

    def check(self, recipe: Any, trainer: L.Trainer) -> None:
        """What this engine says of ``recipe`` before training: nothing to refuse; its FSDP2 options unused."""
        if recipe.fsdp["shard"] is not None or recipe.fsdp["checkpoint"]:
            from lightning.pytorch.utilities import rank_zero_warn

            rank_zero_warn(
                f"model.fsdp={dict(recipe.fsdp)} applies under trainer=fsdp / fsdp_cpu only: "
                f"{type(trainer.strategy).__name__} ignores it"
            )

    def prepare(self, recipe: Any) -> None:
        """Lightning's ``configure_model``: the networks made ready for this engine (FSDP2: sharded, once)."""

    def before_optimizer_step(self, optimizer: Any, mean_over_ranks: Callable[[Any], Any]) -> None:
        """What the optimizer's gradients need before its step beyond what the engine's backward did."""


class Sharded(Parallelism):
    """FSDP2: every network sharded on its own (`multiloss.parallel.sharding`); each rank draws and evaluates through
    gathers."""

    sharded = True

    def check(self, recipe: Any, trainer: L.Trainer) -> None:
        recipe.check_sharding(trainer)  # what FSDP2 cannot do in this recipe's step

    def prepare(self, recipe: Any) -> None:
        if (before := getattr(recipe, _ATTRIBUTE, None)) is not None:  # fitted again: sharded once, its held kept
            self.held = before.held
            return
        trainer = recipe.trainer
        self.held = sharding.shard_components(
            recipe,
            recipe.components,
            recipe.device_mesh["data_parallel"],
            shard=recipe.fsdp["shard"],
            recompute=recipe.fsdp["checkpoint"],
            mp_policy=sharding.mixed_precision_policy(trainer),
            held_whole=recipe.held_whole(trainer),
        )
        object.__setattr__(recipe, _ATTRIBUTE, self)  # a plain attribute, not a submodule

    def before_optimizer_step(self, optimizer: Any, mean_over_ranks: Callable[[Any], Any]) -> None:
        # FSDP2 reduces the gradients of the parameters it shards; any other (a balancer's) is averaged here, as DDP
        # would have averaged it.
        sharding.average_unsharded_gradients(optimizer, mean_over_ranks)


def engine(cfg: Any, build: Callable[..., L.Trainer], cuda_available: bool, recipe: Any = None) -> L.Trainer:
    """The run's parallel engine, decided once from its composed config, and the Trainer that runs on it.

    A sharded run's refusals first (`multiloss.config.parallel.check_sharded_run`, which the check before the imports
    makes from the same config), then the Trainer ``build(**overrides)`` makes on multiloss's strategy
    (`strategy_of`), its collectives' and its rendezvous' timeouts, the `Parallelism` every later reader gets from it
    (`parallelism_of`: the recipe's step, the sample writers) without deciding again, and what it says of
    ``recipe`` (a multiloss `Recipe` to train): FSDP2's refusals of its step, before training starts (every rank, one
    message), or the ``model.fsdp`` options another engine ignores.
    """
    from datetime import timedelta

    from multiloss.config.parallel import check_sharded_run

    check_sharded_run(cfg.trainer, cuda_available=cuda_available)
    trainer = strategy_of(build, cfg.trainer.get("strategy"))
    strategy = trainer.strategy
    node = cfg.trainer.get("strategy")
    if not (hasattr(node, "get") and node.get("timeout") is not None):  # a strategy's own timeout wins
        internals.set_process_group_timeout(strategy, timedelta(seconds=cfg.get("collective_timeout", 1800)))
    if hasattr(strategy, "rendezvous_timeout"):  # multiloss's strategies: the ranks meet before the group is made
        strategy.rendezvous_timeout = float(cfg.get("rendezvous_timeout", 300))
    decided = _decided(strategy)
    setattr(strategy, _ATTRIBUTE, decided)
    if recipe is not None and hasattr(recipe, "check_sharding"):
        decided.check(recipe, trainer)
    return trainer


def _decided(strategy: Any) -> Parallelism:
    return (Sharded if isinstance(strategy, ModelParallelStrategy) else Parallelism)(strategy)


def parallelism_of(trainer: L.Trainer | None) -> Parallelism:
    """The `Parallelism` `engine` decided for ``trainer`` (kept on its strategy); one device without a Trainer, and
    decided here, once, for a Trainer built elsewhere (a user's own, `Recipe` used outside `multiloss.train`)."""
    if trainer is None:
        return Parallelism(None)
    strategy = trainer.strategy
    chosen = getattr(strategy, _ATTRIBUTE, None)
    if chosen is None:
        chosen = _decided(strategy)
        setattr(strategy, _ATTRIBUTE, chosen)
    return chosen


def strategy_of(build: Callable[..., L.Trainer], requested: Any) -> L.Trainer:
    """The Trainer ``build(**overrides)`` makes, on multiloss's strategy for the engine it picked: whatever ends in
    Lightning's DDP runs as `multiloss.parallel.ddp.DDPStrategy` (built again with it); both it and
    `multiloss.parallel.fsdp.FSDPStrategy` start their ranks as Hydra jobs
    (`multiloss.parallel.ddp.HydraJobLauncher`)."""
    from multiloss.parallel.ddp import HydraJobLauncher, HydraJobStrategy, multiloss_ddp

    trainer = build()
    if (ddp := multiloss_ddp(trainer, requested)) is not None:
        trainer = build(strategy=ddp)
    launches_hydra_jobs = isinstance(trainer.strategy, HydraJobStrategy)
    if launches_hydra_jobs:
        internals.use_launcher(trainer.strategy, HydraJobLauncher)
    # Ranks started before the imports (multiloss.parallel.early_ranks) that this strategy will not take over: stopped
    # now.
    early_ranks.settle(trainer.strategy, launches_hydra_jobs)
    return trainer
