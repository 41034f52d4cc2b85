"""Checking a user's components before the first step: run them on two examples, say what they got and returned.

A recipe cannot know a user's network before seeing it run, so each recipe states its components'
contract in ``check_components(batch)``, and `run_check` calls it once on a tiny batch (two
examples, no gradient, eval mode, the random streams restored afterwards) at ``setup``, before any
training or validation step and before `multiloss.train` writes anything into the run dir — or, when
no batch can be had that early, on the first batch that arrives. A component that breaks the
contract is a `ConfigError` naming its key.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import lightning as L
import torch
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision

from multiloss import lightning_internals as internals
from multiloss.config import ConfigError, require
from multiloss.data.batches import as_dict, dataset_tensors, take


def run_check(module: L.LightningModule, check: Callable[[dict[str, Any]], None], batch: Any) -> None:
    """``check`` on two examples of ``batch``; ``module``'s weights, BatchNorm statistics and RNGs stay as they were.

    Under a Trainer whose precision casts the weights and the inputs (``64-true``, ``bf16-true``,
    ``16-true``) the check runs as a step will: the module cast (what Lightning does right after
    ``setup``), the batch cast, in the precision's dtype context (float64 data meet float64 weights).
    """
    batch = take(as_dict(batch), 2)
    trainer = internals.attached_trainer(module)
    plugin = trainer.precision_plugin if trainer is not None else None
    if isinstance(plugin, DoublePrecision | HalfPrecision):
        plugin.convert_module(module)
        batch = plugin.convert_input(batch)
        with plugin.forward_context():
            _run(module, check, batch)
        return
    _run(module, check, batch)


def _run(module: L.LightningModule, check: Callable[[dict[str, Any]], None], batch: dict[str, Any]) -> None:
    was_training = module.training
    # The batch's device, not module.device: at setup Lightning already reports the target device
    # while the weights (and the probe batch) are still on the CPU.
    cuda = {v.device for v in batch.values() if isinstance(v, torch.Tensor) and v.device.type == "cuda"}
    with torch.random.fork_rng(devices=sorted(cuda, key=str)), torch.no_grad():
        module.eval()
        try:
            check(batch)
        finally:
            module.train(was_training)


def check_class_labels(datamodule: Any, classes: int, key: str = "y") -> None:
    """Every integer label of the data in [0, ``classes``): all of it, where the data module holds it in
    memory (the component check sees only two examples)."""
    for labels in dataset_tensors(datamodule, key):
        if labels.is_floating_point() or labels.numel() == 0:
            continue
        low, high = int(labels.min()), int(labels.max())
        require(
            low >= 0 and high < classes,
            "data",
            f"<labels {low}..{high} in {key!r}>",
            f"class ids 0..{classes - 1}: the net gives {classes} logits (model.net)",
            "labels out of range",
        )


def describe_batch(batch: Mapping[str, Any]) -> str:
    """``x: a tensor float32 (2, 64), y: a tensor int64 (2,)``: what a component was given, for error messages."""
    return ", ".join(f"{key}: {describe_output(value)}" for key, value in batch.items())


def describe_output(value: Any) -> str:
    """A short reading of what a network returned: ``tensor float32 (2, 10)``, ``list of 3 tensors``, ..."""
    if isinstance(value, torch.Tensor):
        return f"a tensor {str(value.dtype).removeprefix('torch.')} {tuple(value.shape)}"
    if isinstance(value, Mapping):
        return "a dict {" + ", ".join(f"{k!r}: {describe_output(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return f"a {type(value).__name__} of {len(value)}: [" + ", ".join(describe_output(v) for v in value) + "]"
    return f"a {type(value).__name__}"


def call_component(key: str, target: str, fn: Any, *args: Any, given: str = "") -> Any:
    """``fn(*args)``, with any exception turned into a `ConfigError` under ``key`` saying what it was given."""
    try:
        return fn(*args)
    except ConfigError:
        raise
    except Exception as err:
        raise ConfigError(
            key,
            target,
            f"a component that runs on the data ({given})" if given else "a component that runs",
            f"it failed: {type(err).__name__}: {err}",
        ) from None


def check_rows_independent(
    key: str, target: str, fn: Any, inputs: torch.Tensor, other: torch.Tensor, cause: str
) -> None:
    """The rows of a batch are separate examples: ``fn``'s outputs for rows 1.. stay the same when row 0 changes.

    ``other``: inputs whose row 0 differs from ``inputs``' (only that row is used). Every tensor of
    ``fn``'s output with the batch's rows first is compared, rows 1.. only. A failure is a
    `ConfigError` under ``key`` naming ``cause``.
    """
    if len(inputs) < 2:
        return
    changed = inputs.clone()
    changed[0] = other[0]
    before, after = _leaves(fn(inputs)), _leaves(fn(changed))
    mixed = [
        (a, b)
        for a, b in zip(before, after)
        if a.shape == b.shape and a.dim() > 0 and len(a) == len(inputs) and a.is_floating_point()
    ]
    moved = max(((a[1:] - b[1:]).abs().max().item() for a, b in mixed), default=0.0)
    scale = max((a[1:].abs().max().item() for a, _ in mixed), default=0.0)
    require(
        moved <= 1e-5 * max(scale, 1.0),
        key,
        target,
        "a network whose batch rows are independent examples: changing one sequence leaves every other "
        "sequence's outputs as they were (in eval mode)",
        f"{cause} (changing row 0's input moved row 1's outputs by {moved:.3g})",
    )


def _leaves(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, Mapping):
        return [t for v in output.values() for t in _leaves(v)]
    if isinstance(output, list | tuple):
        return [t for v in output for t in _leaves(v)]
    return []
