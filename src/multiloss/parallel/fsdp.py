"""`FSDPStrategy`: the Lightning strategy of sharded training (``trainer=fsdp`` / ``fsdp_cpu``), FSDP2 on every rank.

Lightning's `ModelParallelStrategy` with every rank data-parallel, ranks started as Hydra jobs, the
torchrun join, the no-sync block of a micro-batch that does not step, and a checkpoint directory put in
place whole. What it does to the recipe's networks is `multiloss.parallel.sharding`'s (through
`multiloss.parallel.parallelism.Sharded`).
"""

from __future__ import annotations

import shutil
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lightning.pytorch.strategies import ModelParallelStrategy

from multiloss import lightning_internals as internals
from multiloss.parallel.ddp import HydraJobStrategy
from multiloss.parallel.rendezvous import start_process_group
from multiloss.parallel.sharding import HELD_WHOLE


class FSDPStrategy(HydraJobStrategy, ModelParallelStrategy):
    """Lightning's `ModelParallelStrategy` (all its arguments) with every rank data-parallel (FSDP2 alone, no tensor
    parallelism), Hydra-job-aware child launching, and the no-sync block of the micro-batches that do not step."""

    strategy_name = "multiloss_fsdp"

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("tensor_parallel_size", 1)
        super().__init__(**kwargs)

    def setup_environment(self) -> None:
        # Lightning's ModelParallelStrategy starts no launcher in ranks > 0, so only rank 0 got its share of the
        # cores (rank 1 ran on all of them: oversubscribed, and its matmuls summed in another order than DDP's).
        internals.set_threads_per_rank(self.num_processes)
        # ModelParallelStrategy starts its process group here (its _setup_distributed), not in setup_distributed:
        # ours first, its ranks met with a bounded wait (multiloss.parallel.rendezvous).
        start_process_group(self)
        internals.use_data_parallel_world(self)  # data_parallel_size: all ranks (Lightning's "auto": the nodes)
        super().setup_environment()

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """FSDP2's no_sync: the sharded modules keep this backward's gradients unreduced (accumulated)."""
        units = [
            m
            for m in self.lightning_module.modules()
            if hasattr(m, "set_requires_gradient_sync") and not getattr(m, HELD_WHOLE, False)
        ]  # a component held whole (LocalGradients) never syncs on FSDP2's schedule: left alone
        for unit in units:
            unit.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for unit in units:
                unit.set_requires_gradient_sync(True, recurse=False)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Lightning's sharded save into a staging directory beside ``filepath``, then put in its place whole.

        Written in place, a save cut short (a kill, a full disk) left old and new shards mixed under the old
        ``.metadata``; and a file ``last.ckpt`` (the run continued from a DDP or one-device run) was deleted by each
        rank in turn before the shards went in. Here the checkpoint is the old one or the new one (a file or a
        directory, either way: `multiloss.saving.checkpoints.replace`). Every rank calls it (Lightning saves on all)."""
        if not internals.saves_distributed_checkpoint(self):
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        from multiloss.saving.checkpoints import replace

        target = Path(self.broadcast(str(filepath)))
        staging = target.with_name(f".{target.name}.partial")
        if self.global_rank == 0 and staging.exists():  # a save killed before its end
            shutil.rmtree(staging) if staging.is_dir() else staging.unlink()
        self.barrier("multiloss_checkpoint_staging")
        super().save_checkpoint(checkpoint, staging, storage_options)
        self.barrier("multiloss_checkpoint_written")
        if self.global_rank == 0:
            replace(staging, target)
        self.barrier("multiloss_checkpoint_in_place")
        return None
