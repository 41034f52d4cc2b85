"""The weighted recipe's tasks: a loss on one of the net's outputs against one batch key, and a weight.

A ``tasks`` config (group ``tasks``, package ``model.tasks``) maps each task's name, which is also
the key of its output in the net's dict, to:

    loss         the dotted path of a loss callable (``torch.nn.functional.cross_entropy``) or a config
                 with ``_target_`` (``{_target_: torch.nn.BCEWithLogitsLoss, pos_weight: ...}``);
                 called as ``loss(output, batch[target])``, it returns the batch's mean loss (a scalar)
    target       the batch key holding the task's target
    weight       its weight wᵢ in Σ wᵢ·lossᵢ: a finite number ≥ 0 (0 switches the task off); default 1
    metric       optional: a torchmetrics metric config, updated on validation as ``metric(output, target)``; or a
                 mapping of log names to such configs (several numbers of one task: NYUv2's segmentation logs
                 ``val/miou/<task>`` and ``val/pixel_acc/<task>``), held as a ``torchmetrics.MetricCollection``
    metric_name  optional: the metric's log name, ``val/<metric_name>/<task>``; default: from its class
    activation   optional: a callable applied to the output before the metric only (``torch.sigmoid``
                 turns a binary logit into the probability ``BinaryAccuracy`` expects)
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn
from torchmetrics import Metric, MetricCollection

from multiloss.building.components import build_callable
from multiloss.config import ConfigError, require

FIELDS = ("loss", "target", "weight", "metric", "metric_name", "activation")


@dataclass
class Task:
    name: str
    loss: Callable[..., Any]
    target: str
    weight: float
    metric: Metric | MetricCollection | None = None
    metric_name: str | None = None
    activation: Callable[..., Any] | None = None

    def logged(self) -> list[tuple[str, Metric]]:
        """Each metric of the task with its log name (``val/<name>/<task>``)."""
        if isinstance(self.metric, MetricCollection):
            return list(self.metric.items(keep_base=True))
        return [] if self.metric is None else [(str(self.metric_name), self.metric)]


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


def _metric(spec: Any, key: str) -> Metric:
    metric = build_callable(spec, key)
    require(isinstance(metric, Metric), key, spec, "a torchmetrics Metric", f"it built a {type(metric).__name__}")
    return metric


def build_tasks(spec: Mapping[str, Any]) -> dict[str, Task]:
    """Every task of a ``tasks`` config, checked; `ConfigError` keys are ``tasks.<name>.<field>``."""
    require(
        isinstance(spec, Mapping) and len(spec) > 0,
        "tasks",
        spec,
        "a mapping task name -> {loss, target, weight, metric}; e.g. tasks=digits",
    )
    tasks = {}
    for name, entry in spec.items():
        key = f"tasks.{name}"
        require(isinstance(entry, Mapping), key, entry, f"a mapping with keys {', '.join(FIELDS)}")
        unknown = sorted(set(entry) - set(FIELDS))
        if unknown:
            raise ConfigError(
                f"{key}.{unknown[0]}", entry[unknown[0]], f"task keys: {', '.join(FIELDS)}", "unknown key"
            )
        for needed in ("loss", "target"):
            require(entry.get(needed) is not None, f"{key}.{needed}", None, _NEEDED[needed], "not set")
        require(isinstance(entry["target"], str), f"{key}.target", entry["target"], "a batch key (a string)")
        weight = entry.get("weight", 1.0)
        require(
            isinstance(weight, int | float) and not isinstance(weight, bool) and 0 <= weight < math.inf,
            f"{key}.weight",
            weight,
            "a finite number ≥ 0 (0 switches the task off)",
        )
        metric = None
        given = entry.get("metric")
        if isinstance(given, Mapping) and "_target_" not in given:  # several: log name -> metric config
            require(len(given) > 0, f"{key}.metric", given, "a metric config, or a mapping log name -> metric config")
            members = {str(n): _metric(spec, f"{key}.metric.{n}") for n, spec in given.items()}
            metric = MetricCollection(members, compute_groups=False)
        elif given is not None:
            metric = _metric(given, f"{key}.metric")
        activation = entry.get("activation")
        tasks[name] = Task(
            name=str(name),
            loss=build_callable(entry["loss"], f"{key}.loss"),
            target=entry["target"],
            weight=float(weight),
            metric=metric,
            metric_name=entry.get("metric_name")
            or (_snake(type(metric).__name__) if isinstance(metric, Metric) else None),
            activation=None if activation is None else build_callable(activation, f"{key}.activation"),
        )
    require(
        sum(t.weight for t in tasks.values()) > 0,
        "tasks",
        {n: t.weight for n, t in tasks.items()},
        "at least one task with a positive weight",
        "every weight is 0",
    )
    return tasks


_NEEDED = {
    "loss": "the dotted path of a loss callable (e.g. torch.nn.functional.cross_entropy) or a config with _target_",
    "target": "the batch key holding this task's target (e.g. y)",
}


def loss_modules(tasks: Mapping[str, Task]) -> nn.ModuleDict:
    """The tasks' losses that are modules (``BCEWithLogitsLoss(pos_weight=...)``), so they follow the device."""
    return nn.ModuleDict({name: t.loss for name, t in tasks.items() if isinstance(t.loss, nn.Module)})
