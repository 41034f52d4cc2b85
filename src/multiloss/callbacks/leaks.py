"""A graph kept alive from one step to the next, with its activations: the memory leak of ``retain_graph=True``.

A backward frees the activations its graph saved, and the graph goes when nothing refers to it.
A graph that is both kept and retained — ``total += loss`` (no ``.item()``) or a state carried into
the next step without ``detach()``, with ``backward(retain_graph=True)``, the remedy the error
message suggests — keeps every step's activations: memory grows step after step until the process
dies. (Kept without ``retain_graph``, a graph holds only its small nodes; backward through it then
fails instead, and `multiloss.pitfalls` explains that error.)

`GraphLeakDetector` watches the first ``steps`` training batches: a forward hook on every module
notes (by weak reference) the tensors the modules return, and after each batch it adds up the
bytes of those still alive. Growing batch after batch means graphs are being kept: it warns, once.
(Not ``saved_tensors_hooks``: with those installed, autograd stops checking saved tensors for
in-place changes, and the detector would hide the error the in-place pitfall needs.) A compiled
component (``model.compile=true``) is not hooked: each added or removed hook would make
``torch.compile`` recompile it; the rest of the module still is.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection

from multiloss import lightning_internals as internals
from multiloss.callbacks.lean import LeanCallback


class GraphLeakDetector(LeanCallback):
    """Warns when the activations still alive after a training batch grow over the first ``steps`` batches."""

    def __init__(self, steps: int = 8) -> None:
        self.steps = steps
        self.outputs: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
        self.after_batch: list[int] = []
        self._hooks: list[Any] = []

    def _note(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        def keep(t: torch.Tensor) -> torch.Tensor:
            if t.requires_grad:
                self.outputs[id(t)] = t
            return t

        apply_to_collection(output, torch.Tensor, keep)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._hooks:
            self._hooks = [m.register_forward_hook(self._note) for m in _eager_modules(pl_module)]

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._hooks:
            return
        self._remove()
        self.after_batch.append(sum(t.numel() * t.element_size() for t in list(self.outputs.values())))
        if len(self.after_batch) == self.steps:
            self._verdict()
            self.outputs = weakref.WeakValueDictionary()
            # Done: Lightning skips a hook that is None (multiloss.callbacks.lean), so the rest of the run
            # pays nothing for this callback.
            self.on_train_batch_start = self.on_train_batch_end = None

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._remove()

    def _remove(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _verdict(self) -> None:
        held = self.after_batch
        if held[-1] > 0 and all(b > a for a, b in itertools.pairwise(held)):
            rank_zero_warn(
                f"multiloss: the memory autograd keeps alive after each step grows ({held[0] / 2**20:.3f} MiB "
                f"of activations after batch 1, {held[-1] / 2**20:.3f} MiB after batch {len(held)}): every "
                "step's graph is kept. Typical causes: accumulating a loss for logging without .item() or "
                ".detach() (total += loss), a state carried into the next step without .detach(), or "
                "backward(retain_graph=True) on a graph that stays referenced. Detach what crosses steps; "
                "retain_graph=True is not the fix."
            )


def _eager_modules(module: torch.nn.Module) -> list[torch.nn.Module]:
    """``module`` and its submodules, less those compiled with ``Module.compile()`` and everything inside them."""
    compiled = [name for name, m in module.named_modules() if internals.is_compiled(m)]
    return [
        m
        for name, m in module.named_modules()
        if not any(name == c or name.startswith(f"{c}.") or c == "" for c in compiled)
    ]
