"""Autograd pitfalls in a training step — the recipes' or a user's own — come with their cause and fix.

Each case below is a classic mistake, made in a user's subclass or network and
run through the real `multiloss.train`: PyTorch's error keeps its type and message, and gets a
`multiloss:` note naming the cause and the fix (never "use retain_graph=True"). A graph kept alive
from step to step (``total += loss``) is warned about.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from multiloss.recipes.multihead import MultiHead
from multiloss.recipes.weighted import WeightedMultiTask

from multiloss import train
from multiloss.nets import DeepSupervisionMLP
from multiloss.pitfalls import explanation

SMALL = ("model.net.width=16", "trainer.accelerator=cpu", "trainer.max_steps=3", "trainer.limit_val_batches=0")


class PerHeadBackward(MultiHead):
    """The first loop everyone writes: one backward per head, no retain_graph."""

    def training_step(self, batch: Any, batch_idx: int) -> None:
        batch = self.prepare_batch(batch)
        for logits in self.net(batch["x"]):
            self.manual_backward(F.cross_entropy(logits, batch["y"]))
        self.optimizers().step()


class InPlaceActivation(DeepSupervisionMLP):
    """A net that scales an activation in place after a head read it (the head saved it for its backward)."""

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        logits = []
        for block, head in zip(self.blocks, self.heads):
            x = block(x)
            logits.append(head(x))
            x.mul_(2.0)
        return logits


class VectorBackward(WeightedMultiTask):
    """The vector of task losses backwarded as it is, without its weights."""

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        loss.backward()


class FrozenForward(DeepSupervisionMLP):
    """A forward under no_grad: the loss has no graph to any weight."""

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        with torch.no_grad():
            return super().forward(x)


class RunningLoss(MultiHead):
    """`total += loss` without .item(), and backward(retain_graph=True), the usual remedy for the error a
    later backward through `total` raises: every step's graph and its activations stay alive."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.running = torch.zeros(())

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self.running = self.running + loss
        loss.backward(retain_graph=True)


CASES = [
    (("recipe=multihead", f"model._target_={__name__}.PerHeadBackward"), "graph a second time", "call backward once"),
    (("recipe=multihead", f"model.net._target_={__name__}.InPlaceActivation"), "inplace operation", "clone()"),
    (("recipe=weighted", f"model._target_={__name__}.VectorBackward"), "only for scalar outputs", "grad_tensors"),
    (("recipe=multihead", f"model.net._target_={__name__}.FrozenForward"), "does not require grad", "no_grad"),
]


@pytest.mark.parametrize(("overrides", "torch_says", "fix"), CASES, ids=["per-head", "in-place", "vector", "frozen"])
def test_the_error_keeps_its_message_and_gets_cause_and_fix(make_cfg, tmp_path, overrides, torch_says, fix):
    with pytest.raises(RuntimeError, match=torch_says) as err:
        train(make_cfg(*overrides, *SMALL, output_dir=tmp_path))
    notes = "\n".join(getattr(err.value, "__notes__", [])) or str(err.value)
    assert notes.startswith("multiloss: ") and fix in notes
    assert "retain_graph=True only hides" in notes or "retain_graph" not in notes  # never offered as the fix


def test_unrelated_errors_get_no_note():
    assert explanation(RuntimeError("CUDA out of memory")) is None
    assert explanation(ValueError("Trying to backward through the graph a second time")) is not None


def test_a_graph_kept_from_step_to_step_is_warned_about(make_cfg, tmp_path):
    with pytest.warns(UserWarning, match="keeps alive after each step grows"):
        train(
            make_cfg(
                "recipe=multihead",
                f"model._target_={__name__}.RunningLoss",
                *SMALL[:-2],
                "trainer.max_steps=10",
                "trainer.limit_val_batches=0",
                output_dir=tmp_path,
            )
        )


def test_a_healthy_run_is_not_warned_about(make_cfg, tmp_path, recwarn):
    train(
        make_cfg(
            "recipe=tbptt",
            "model.net.hidden_size=16",
            "data.seq_len=32",
            "data.batch_size=4",
            "trainer.accelerator=cpu",
            "trainer.max_steps=12",
            "trainer.limit_val_batches=0",
            "model.sample_length=5",
            output_dir=tmp_path,
        )
    )
    assert not [w for w in recwarn if "keeps alive" in str(w.message)]
