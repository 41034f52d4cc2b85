"""The learning rate a step uses, owned in one place: the configured base × the recipe's rule × the schedule's factor.

Three things set a learning rate, and each owns one factor of it:

- the **base**: the optimizer's config (``model.optimizer.lr``, per param group);
- the **rule**: the recipe's factor (accumulation's scaling by the effective batch, `multiloss.base.lr_scaling`;
  1 in the other recipes), applied once, when the optimizer is built;
- the **schedule**: ``model.scheduler``, a ``torch.optim.lr_scheduler`` that starts from base × rule
  (its ``base_lrs``) and moves the rate by its own factor as the run goes (warm-up, decay, a plateau's cuts).

Nothing else writes ``param_group["lr"]``. A checkpoint keeps the parts (`RatePlan`: the base, the
rule and the schedule as built) beside the optimizer's and the schedule's own states, so a resume
tells the run's *state* (the schedule's progress, a plateau's cuts: continued) from the user's
*decisions* (another base LR, batch size, k, world size or schedule length: applied, one line each
saying what changed and the rate that now applies), and `resume_rates` rewrites the checkpoint's rates
to base × rule × the schedule's factor reached. A schedule of another class than the checkpoint's is
refused: its progress has no meaning for the new one.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any

from multiloss import lightning_internals as internals
from multiloss.base.schedules import CONSTANT, factor_at
from multiloss.config import ConfigError
from multiloss.config.renamed import current_name
from multiloss.saving.saved_state import LR_KEY

log = logging.getLogger("multiloss")


@dataclass
class RatePlan:
    """One optimizer's learning rates as parts: ``base_lrs`` (configured, per group) × ``rule`` × its schedule."""

    key: str  # the optimizer's config key: model.optimizer, model.g_optimizer, ...
    base_lrs: list[float]
    rule: float = 1.0
    rule_inputs: dict[str, Any] = field(default_factory=dict)  # what the rule was computed from, for the messages
    schedule: dict[str, Any] = field(default_factory=lambda: {"_target_": CONSTANT})  # as built, lengths resolved

    def __post_init__(self) -> None:
        # A checkpoint of an earlier layout names its schedule class at the module's old path.
        if isinstance(target := self.schedule.get("_target_"), str):
            self.schedule = {**self.schedule, "_target_": current_name(target)}

    @property
    def scheduled(self) -> bool:
        return self.schedule.get("_target_") != CONSTANT

    def state(self) -> dict[str, Any]:
        return asdict(self)


def apply_rule(optimizer: Any, key: str, rule: float, rule_inputs: dict[str, Any]) -> RatePlan:
    """Multiply each of ``optimizer``'s configured rates by the recipe's ``rule``; the plan of its parts."""
    plan = RatePlan(key, [group["lr"] for group in optimizer.param_groups], rule, rule_inputs)
    if rule != 1:
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * rule
    return plan


def resume_rates(plans: list[RatePlan], schedulers: list[Any], checkpoint: dict[str, Any]) -> list[str]:
    """Rewrite ``checkpoint``'s optimizer and schedule states so each group's rate is the config's base × rule × the
    schedule's factor at the run's point; the changes, one line each (nothing changed: nothing rewritten).

    ``plans`` are this run's, in its optimizers' order (the order Lightning saved their states in), and
    ``schedulers`` the schedules built for them (None for constant). The schedule's factor is the one the
    run had reached (a plateau's cuts included), or, where the config changed the schedule's options,
    the new schedule's at the steps already taken.

    Raises:
        ConfigError: ``model.scheduler`` of another class than the checkpoint's.
    """
    saved_plans = checkpoint.get(LR_KEY) or {}
    optimizer_states = checkpoint.get("optimizer_states") or []
    schedule_states = iter(checkpoint.get("lr_schedulers") or [])
    changes: list[str] = []
    for plan, scheduler, optimizer_state in zip(plans, schedulers, optimizer_states):
        groups = optimizer_state["param_groups"]
        saved = _saved_plan(saved_plans.get(plan.key), plan, groups)
        schedule_state = next(schedule_states, None) if saved.scheduled else None
        schedule_changes = _schedule_changes(plan, saved, schedule_state)
        changes += schedule_changes
        steps_taken = schedule_state.get("last_epoch") if schedule_state else None
        for number, group in enumerate(groups):
            was, now = saved.base_lrs[number] * saved.rule, plan.base_lrs[number] * plan.rule
            reached = group["lr"] / was if was else 1.0
            factor = reached
            if schedule_changes and scheduler is not None and steps_taken is not None:
                factor = factor_at(scheduler, steps_taken, number, default=reached)
            if now == was and factor == reached:
                continue  # bit for bit what the run had: not even rescaled by 1
            group["lr"] = now * factor
            if "initial_lr" in group:
                group["initial_lr"] = now
            if schedule_state is not None:
                for entry in ("base_lrs", internals.SCHEDULER_LAST_RATES):
                    if entry in schedule_state and number < len(schedule_state[entry]):
                        schedule_state[entry][number] = now if entry == "base_lrs" else group["lr"]
            name = plan.key + (f" group {number}" if len(groups) > 1 else "")
            changes.append(_rate_change(name, plan, saved, number, factor, group["lr"]))
    return changes


def _saved_plan(state: dict[str, Any] | None, plan: RatePlan, groups: list[dict[str, Any]]) -> RatePlan:
    if state is not None:
        return RatePlan(**state)
    # A checkpoint from before the parts were kept: its schedule's base is the configured rate × the rule.
    bases = [group.get("initial_lr", group["lr"]) for group in groups]
    return RatePlan(plan.key, bases, 1.0, {}, plan.schedule)


def refuse_other_schedules(plans: list[RatePlan], checkpoint: dict[str, Any]) -> None:
    """`ConfigError` if a plan's schedule is of another class than the checkpoint's (whose ``LR_KEY`` entry says)."""
    saved_plans = checkpoint.get(LR_KEY) or {}
    for plan in plans:
        if (state := saved_plans.get(plan.key)) is not None:
            _same_schedule_class(plan, RatePlan(**state))


def _same_schedule_class(plan: RatePlan, saved: RatePlan) -> None:
    if saved.schedule.get("_target_") != plan.schedule.get("_target_"):
        raise ConfigError(
            "model.scheduler._target_",
            plan.schedule.get("_target_"),
            f"the checkpoint's schedule, {_shown(saved.schedule)}: a resume continues the schedule it trained "
            "under (its progress has no meaning for another); another schedule is a new run",
            "the checkpoint's run was trained under another schedule",
        )


def _schedule_changes(plan: RatePlan, saved: RatePlan, schedule_state: dict[str, Any] | None) -> list[str]:
    _same_schedule_class(plan, saved)
    if schedule_state is not None and plan.scheduled:
        # The configuration is the config's; the progress (steps taken, a plateau's best and cuts) the run's.
        current = plan.schedule
        for key, value in current.items():
            if key in schedule_state and key not in internals.SCHEDULER_PROGRESS:
                schedule_state[key] = value
    return [
        f"model.scheduler.{key}={plan.schedule.get(key)} (the checkpoint's {saved.schedule.get(key)})"
        for key in sorted(set(plan.schedule) | set(saved.schedule))
        if key != "_target_" and plan.schedule.get(key) != saved.schedule.get(key)
    ]


def _rate_change(name: str, plan: RatePlan, saved: RatePlan, number: int, factor: float, rate: float) -> str:
    parts = []
    if plan.base_lrs[number] != saved.base_lrs[number]:
        parts.append(f"{name}.lr={plan.base_lrs[number]:g} (the checkpoint's {saved.base_lrs[number]:g})")
    if plan.rule != saved.rule:
        inputs = ", ".join(f"{k}={v}" for k, v in plan.rule_inputs.items())
        parts.append(f"the recipe's LR factor {plan.rule:g} ({inputs}; the checkpoint's {saved.rule:g})")
    if plan.schedule != saved.schedule:
        parts.append("the schedule's options")
    schedule = f" × the schedule's {factor:g}" if factor != 1 else ""
    return f"{' and '.join(parts)}: {name} now trains at {plan.base_lrs[number]:g} × {plan.rule:g}{schedule} = {rate:g}"


def _shown(schedule: dict[str, Any]) -> str:
    options = ", ".join(f"{k}={v}" for k, v in schedule.items() if k != "_target_")
    return f"{schedule.get('_target_')}({options})"
