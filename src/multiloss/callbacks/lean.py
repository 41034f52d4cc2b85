"""A callback that costs nothing on the per-batch hooks it does not use.

Lightning calls every hook of every callback, in a profiler context (``_call_callback_hooks``):
about 6 µs a callback a hook, no-op hooks included, and a training step calls six or more of them
(batch start and end, before and after each backward, before each optimizer step). Five always-on
callbacks that do nothing on most of those made a third of multiloss's cost per step on a small
model. Lightning skips a hook attribute that is not callable, so `LeanCallback` sets every per-batch
hook its subclass does not define to None; an instance may do the same for a hook it has finished
with (the graph-leak detector after its first batches).
"""

from __future__ import annotations

import lightning as L

# The hooks Lightning calls per batch, or per backward and optimizer step within one.
PER_BATCH_HOOKS = (
    "on_train_batch_start",
    "on_train_batch_end",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_validation_batch_start",
    "on_validation_batch_end",
    "on_test_batch_start",
    "on_test_batch_end",
    "on_predict_batch_start",
    "on_predict_batch_end",
)


class LeanCallback(L.Callback):
    """A Lightning callback whose per-batch hooks, where its class does not define them, are None (skipped)."""

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        for hook in PER_BATCH_HOOKS:
            if getattr(cls, hook) is getattr(L.Callback, hook):
                setattr(cls, hook, None)
