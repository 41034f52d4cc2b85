"""What a config's Trainer settings say about its processes, read from the config alone (nothing imported)."""

from __future__ import annotations

from typing import Any

from multiloss.config.errors import ConfigError

_SHARDED = ("multiloss.parallel.fsdp.FSDPStrategy", "ModelParallelStrategy")


def is_sharded(trainer_cfg: Any) -> bool:
    """Whether ``trainer_cfg`` trains sharded (FSDP2: multiloss's strategy or Lightning's ModelParallelStrategy)."""
    strategy = trainer_cfg.get("strategy")
    target = strategy.get("_target_", "") if hasattr(strategy, "get") else ""
    return isinstance(target, str) and (target == _SHARDED[0] or target.endswith(_SHARDED[1]))


def check_sharded_run(trainer_cfg: Any, cuda_available: bool | None = None) -> None:
    """Refuse, before Lightning builds the Trainer, a sharded run's precision the CPU cannot train in: gloo has no
    bf16 collectives for FSDP2's reduce-scatter, and Lightning's ModelParallelStrategy refuses 16-mixed (its own
    message then suggests bf16, which the CPU cannot do either). Nothing for another strategy.

    ``cuda_available``: torch's answer once imported; None asks the torch build (`multiloss.config.machine`), and
    where that cannot tell, a run on ``accelerator=auto`` is left to the later check.
    """
    if not is_sharded(trainer_cfg):
        return
    if cuda_available is None:
        from multiloss.config.machine import cuda_available as built_for_cuda

        cuda_available = built_for_cuda()
    accelerator = str(trainer_cfg.get("accelerator", "auto"))
    if accelerator == "auto" and cuda_available is None:
        return
    on_cpu = accelerator == "cpu" or (accelerator == "auto" and not cuda_available)
    precision = str(trainer_cfg.get("precision", "32-true"))
    if on_cpu and precision not in ("32-true", "32", "64-true", "64"):
        raise ConfigError(
            "trainer.precision",
            precision,
            "32-true with trainer=fsdp_cpu (on GPUs, trainer=fsdp takes bf16-mixed)",
            "gloo, the CPU's backend, has no bf16 collectives for FSDP2's reduce-scatter, and Lightning's "
            "ModelParallelStrategy does not support 16-mixed",
        )
