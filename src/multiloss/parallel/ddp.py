"""Lightning's DDP, with two things multiloss's recipes need from it.

1. **Hydra jobs, not command lines.** Lightning's subprocess launcher starts ranks > 0 by re-running
   ``sys.argv``. Under ``python train.py -m seed=1,2 trainer=ddp_cpu`` that is the whole sweep, so
   every job's child ranks launch the sweep again. Here the children re-run *the job*: its own
   overrides (``seed=1``) and its own output dir (the sweep subdir), as a plain run.
2. **One DDP wrapper per network** for modules with several optimizers (the GAN). One wrapper
   around the whole module expects every parameter to get a gradient in every backward; the
   discriminator step never reaches the generator, so stock DDP needs the slower
   ``find_unused_parameters=True`` (a graph walk per backward). A module that lists
   ``ddp_submodules`` gets each listed network wrapped on its own, and calls a network through
   `synced` where its gradients must be averaged across ranks: each backward then reaches exactly
   the parameters its wrapper expects.

Every configuration that ends in Lightning's DDP (``trainer.strategy=ddp``, a DDP alias, or ``auto``
with several devices) is built as this strategy by `multiloss.train` (`multiloss_ddp`).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Generator
from contextlib import ExitStack, contextmanager
from typing import Any

import lightning as L
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from multiloss import lightning_internals as internals
from multiloss.config import ConfigError
from multiloss.parallel import early_ranks, ports
from multiloss.parallel.child_command import PARENT, job_command
from multiloss.parallel.rendezvous import RendezvousIncomplete, start_process_group

_WRAPPERS = "_multiloss_ddp_wrappers"


def ddp_wrappers(module: L.LightningModule) -> dict[str, DistributedDataParallel]:
    """The per-network DDP wrappers `DDPStrategy` gave ``module`` (name -> wrapper); empty otherwise."""
    return getattr(module, _WRAPPERS, {})


def synced(module: L.LightningModule, name: str) -> nn.Module:
    """The network ``name`` of ``module`` as its own DDP wrapper when there is one, else the network itself.

    Call a network through this when its parameters' gradients must be averaged across ranks in the
    backward that follows; call it directly (``self.discriminator(x)``) when they must not (the
    generator step's pass through a discriminator whose parameters are frozen for that step).
    """
    wrapper = ddp_wrappers(module).get(name)
    return wrapper if wrapper is not None else getattr(module, name)


class HydraJobLauncher(internals.ScriptLauncher):
    """Lightning's script launcher, starting each child with `job_command` (the Hydra job, not the command line), or
    taking over the ranks `multiloss.parallel.early_ranks` started with the same command before the imports.

    After the job it leaves the launching process as it found it, so the next job of a sweep in
    the same process launches its own ranks again (see `finish`).
    """

    command = staticmethod(job_command)
    # After this process failed: how long its ranks get to end by themselves (an error they meet too, a stall they
    # report) before they are killed. A rank waiting for this one in a collective would otherwise wait out the
    # whole collective_timeout, and this process (waiting for it) with it.
    GRACE_AFTER_FAILURE_S = 30.0

    def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        env_before = early_ranks.saved_environment()
        environment = self.cluster_environment
        ranks = early_ranks.adopt(self.num_processes, self.num_nodes, type(environment) is LightningEnvironment)
        if ranks is not None:  # already started: this process becomes their rank zero, as Lightning's launch makes it
            self._env_before, self.failed, self.procs = env_before, False, ranks.procs
            internals.watch_children(self.procs)
        return super().launch(function, *args, trainer=trainer, **kwargs)

    def before_launch(self) -> None:
        self._env_before = early_ranks.saved_environment()
        self.failed = False
        if self.num_nodes == 1:
            # This run's alone: an identity nobody else has, and (unless the user gave one) a port held from now until
            # rank 0's store listens on it, where Lightning's find_free_network_port binds, closes and hopes.
            os.environ[ports.RUN_ID] = ports.new_run_id()
            if "MASTER_PORT" not in os.environ and isinstance(self.cluster_environment, LightningEnvironment):
                os.environ["MASTER_PORT"] = str(ports.hold())
        os.environ[PARENT] = str(os.getpid())  # copied into the children's environment, then taken back (`finish`)

    def note_failure(self, exception: BaseException | None = None) -> None:
        """This process's run failed: `finish` waits a bounded time for the ranks it started, or none at all when
        the ranks never met (a port someone else holds, a store of another run): nothing this process could still
        give them, and its message says why for all of them."""
        self.failed = True
        self.before_meeting = isinstance(exception, RendezvousIncomplete)

    def finish(self) -> None:
        """Undo what launching did to this process: the job's process group and environment.

        Lightning sets LOCAL_RANK & co. in the launching process and leaves its process group up;
        the next job would then believe its ranks were started for it ("LOCAL_RANK" set means
        "processes created externally") and wait for ranks that never come, or reuse a group whose
        peers have exited.
        """
        ports.release()  # a port held for a store that never listened (the launch failed before)
        if self.procs:
            if getattr(self, "before_meeting", False):
                early_ranks.kill(self.procs)  # they joined nothing and hold nothing
            deadline = time.monotonic() + self.GRACE_AFTER_FAILURE_S if getattr(self, "failed", False) else None
            for proc in self.procs:
                try:
                    proc.wait(None if deadline is None else max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    proc.kill()  # waiting for this process in a collective that will never complete
                    proc.wait()
            internals.destroy_process_group()
        for key, value in getattr(self, "_env_before", {}).items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class HydraJobStrategy:
    """What multiloss's strategies share: ranks started as Hydra jobs (`HydraJobLauncher`, installed by
    `multiloss.parallel.parallelism.strategy_of`), a failure noted for the launcher, the child ranks waited for at
    teardown."""

    launcher: Any
    # Seconds the ranks wait for each other before the process group is made (`multiloss.parallel.rendezvous`).
    rendezvous_timeout: float = 300.0

    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)  # type: ignore[misc]
        if isinstance(self.launcher, HydraJobLauncher):
            self.launcher.note_failure(exception)

    def teardown(self) -> None:
        super().teardown()  # type: ignore[misc]
        if isinstance(self.launcher, HydraJobLauncher):
            self.launcher.finish()


class DDPStrategy(HydraJobStrategy, LightningDDPStrategy):
    """Lightning's `DDPStrategy` (all its arguments) that launches Hydra jobs and wraps networks one by one."""

    strategy_name = "multiloss_ddp"

    def setup_distributed(self) -> None:
        start_process_group(self)
        super().setup_distributed()

    def configure_ddp(self) -> None:
        _survive_detail_debug(self)
        module = self.lightning_module
        names = getattr(module, "ddp_submodules", ())  # a multiloss Recipe's (any other module: one wrapper)
        if not names:
            super().configure_ddp()
            return
        wrappers = {name: internals.wrap_in_ddp(self, getattr(module, name)) for name in names}
        # A plain attribute, not a submodule: the module's state_dict (and so every checkpoint)
        # keeps the same keys on one device and on many.
        object.__setattr__(module, _WRAPPERS, wrappers)

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        wrappers = ddp_wrappers(self.lightning_module)
        if not wrappers:
            with super().block_backward_sync():
                yield
            return
        with ExitStack() as stack:
            for wrapper in wrappers.values():
                stack.enter_context(wrapper.no_sync())
            yield

    def teardown(self) -> None:
        module = self.lightning_module
        if module is not None and hasattr(module, _WRAPPERS):
            object.__delattr__(module, _WRAPPERS)
        super().teardown()


def _survive_detail_debug(strategy: LightningDDPStrategy) -> None:
    """Let DDP be built on a gloo group under ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (the collective checker).

    DETAIL wraps the group's backend in torch's ProcessGroupWrapper, which checks before every collective
    that all ranks issue the same one with the same shapes. torch 2.13's DDP then dies with SIGSEGV while
    building its usage log (``c10d::Logger::set_env_variables``, reading gloo's thread count from the wrapper
    as if it were gloo's own backend): measured on a one-rank gloo group with a plain ``nn.Linear``. That log
    (construction data: sizes, env vars) is only printed under INFO/DETAIL; without it DDP trains the same.
    """
    import torch.distributed as dist

    if os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() != "DETAIL" or strategy.root_device.type != "cpu":
        return
    if getattr(dist.Logger, "_multiloss_quiet", False):
        return

    class _ConstructionUnlogged(dist.Logger):  # type: ignore[misc,name-defined]
        _multiloss_quiet = True

        def set_construction_data_and_log(self, *args: Any, **kwargs: Any) -> None:
            return None

    dist.Logger = _ConstructionUnlogged  # type: ignore[misc]  # DDP builds `dist.Logger(reducer)` at construction


def multiloss_ddp(trainer: L.Trainer, requested: Any) -> DDPStrategy | None:
    """multiloss's `DDPStrategy` in place of the Lightning one ``trainer`` picked; None if it picked another.

    Whatever ends in Lightning's DDP — ``strategy=ddp``, an alias such as
    ``ddp_find_unused_parameters_true``, or ``auto`` with ``devices`` > 1 — gets multiloss's, with the
    same DDP arguments (a ``_target_`` node naming a strategy class is built as given). Spawned or
    forked processes (``ddp_spawn``, ``ddp_fork``, ``ddp_notebook``) cannot resolve the run dir's Hydra
    interpolations and are refused by name.

    Raises:
        ConfigError: a DDP strategy that starts its processes other than as scripts.
    """
    strategy = trainer.strategy
    # A strategy given as a `_target_` node is the user's deliberate choice, Lightning's own class included.
    if type(strategy) is not LightningDDPStrategy or not isinstance(requested, str):
        return None
    settings = internals.ddp_settings(strategy)
    start_method = settings.pop("start_method")
    if start_method != "popen":
        raise ConfigError(
            "trainer.strategy",
            requested,
            "ddp (or trainer=ddp / trainer=ddp_cpu): processes started as scripts, one Hydra job each",
            f"its processes are started by {start_method}, which cannot rebuild a Hydra run "
            "(the run dir's ${hydra:...} interpolations do not resolve there)",
        )
    ddp = DDPStrategy(**settings)
    return ddp
