"""What this machine can run on, told without importing torch: what the installed torch build was made for.

A CPU build of torch (``torch/version.py``: ``cuda``, ``hip`` and ``xpu`` all None) drives no GPU on any machine,
so ``trainer.accelerator=gpu`` is refused before torch is imported. With a GPU build, whether a GPU is there is
torch's to say once imported (None here).
"""

from __future__ import annotations

import sys

from multiloss.config import source

# Lightning's own accelerators (``AcceleratorRegistry.available_accelerators()`` of Lightning 2.6; a test compares).
LIGHTNING_ACCELERATORS = frozenset({"cpu", "cuda", "mps", "tpu"})


def torch_build() -> dict[str, object] | None:
    """The installed torch's ``version.py`` (``cuda``, ``hip``, ``xpu``), read from its source; None if unreadable."""
    module = source.parsed("torch.version")
    if module is None:
        return None
    found = {
        name: source.literal(module, getattr(source.lookup(module, name), "expr", None))
        for name in ("cuda", "hip", "xpu")
    }
    return None if source.UNKNOWN in found.values() else found


def cuda_available() -> bool | None:
    """False where torch can drive no GPU (a CPU build), None where only torch can tell."""
    build = torch_build()
    if build is None or any(build.values()):
        return None
    return False


def accelerators() -> tuple[frozenset[str], list[str]] | None:
    """(Lightning's accelerator names, those usable here) on a machine where a CPU build of torch makes the answer
    plain, else None."""
    if cuda_available() is not False or sys.platform == "darwin" or source.module_exists("torch_xla"):
        return None
    return LIGHTNING_ACCELERATORS, ["cpu"]
