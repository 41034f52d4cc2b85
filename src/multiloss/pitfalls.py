"""Autograd's errors, explained in the terms of the pitfall behind them, with the fix.

PyTorch's own advice for the most common one, "Specify retain_graph=True", silences the error and
keeps the wrong gradient or a growing graph alive: the explanations here name the cause and the
fix that multiloss's recipes use instead, and never suggest ``retain_graph=True``. `explain` adds
the explanation to the exception as a note (the original type, message and traceback stay), so
it is printed under PyTorch's message, whoever raised it: a recipe, or a user's own module.
"""

from __future__ import annotations

import re

PITFALLS: tuple[tuple[re.Pattern[str], str], ...] = (
    (
        re.compile(r"backward through the graph a second time|saved tensors after they have already been freed"),
        "a backward went through a graph that an earlier backward had already freed. Typical causes: "
        "one backward per loss on a shared trunk (sum the losses and call backward once, or "
        "torch.autograd.backward(losses, grad_tensors=weights): recipe=multihead / weighted); a generated "
        "tensor shared by two networks' losses (use fake.detach() in the first one: recipe=gan); a "
        "recurrent state carried into the next chunk or batch with its history (hidden = hidden.detach(), "
        "every tensor of it: recipe=tbptt). retain_graph=True only hides this: it keeps the graph alive and "
        "the wrong or ever-growing gradient with it.",
    ),
    (
        re.compile(r"modified by an inplace operation"),
        "a tensor that backward needs was changed in place after it was saved. Typical causes: a loss built "
        "through a network *before* optimizer.step() changed that network's weights, then backward after "
        "the step (build the second loss after the first optimizer step: recipe=gan's order); an in-place "
        "op (x += ..., relu_(), x[idx] = ...) on an activation the graph saved (write y = x + ... or use "
        "x.clone() first); a carried state whose graph reaches weights updated since (detach it). "
        "debug=anomaly names the forward operation that made the tensor.",
    ),
    (
        re.compile(r"grad can be implicitly created only for scalar outputs"),
        "backward() was called on a tensor with more than one element (a vector of losses, or a loss with "
        "reduction='none'). Reduce it to one number (loss.mean(), or the weighted sum), or hand the weights "
        "to autograd: torch.autograd.backward(losses, grad_tensors=weights) (recipe=weighted).",
    ),
    (
        re.compile(r"does not require grad and does not have a grad_fn"),
        "the loss has no graph back to any weight: it was computed under torch.no_grad(), from detached "
        "tensors (.detach(), .item(), .numpy()), or from a network whose parameters are all frozen. "
        "Compute the loss from the network's outputs as tensors, outside no_grad.",
    ),
)


def explanation(err: BaseException) -> str | None:
    """The explanation of ``err``'s autograd pitfall, or None if it is not one of them."""
    text = str(err)
    for pattern, why in PITFALLS:
        if pattern.search(text):
            return f"multiloss: {why}"
    return None


def explain(err: BaseException) -> bool:
    """Attach the explanation to ``err`` as a note (once); return whether it is a known pitfall."""
    why = explanation(err)
    if why is None:
        return False
    if why in getattr(err, "__notes__", []) or (err.args and why in str(err.args[0])):
        return True
    if hasattr(err, "add_note"):  # Python 3.11+: printed under the original message and traceback
        err.add_note(why)
    elif err.args:  # 3.10: into the message itself
        err.args = (f"{err.args[0]}\n\n{why}", *err.args[1:])
    return True
