"""Pure decisions of a MemoryPolicy's scaling: go up directly, go down only through a drain.

:mod:`memops.controllers.policy` reads the workload, the policy's RetirementRequests and the
other objects that touch the same workload, and asks these functions what to do. No I/O.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping
from typing import Any

from memops import specs

FAILURE_COOLDOWN_SECONDS = 60.0
"""After a scale-down's drain failed, wait this long (or for a spec change) before another try,
so that a policy whose data has nowhere to go does not create a request every few seconds."""


class Action(enum.StrEnum):
    NONE = "None"
    SCALE_UP = "ScaleUp"
    SCALE_DOWN = "ScaleDown"
    WAIT = "Wait"


@dataclasses.dataclass(frozen=True)
class Decision:
    action: Action
    replicas: int  # the target for SCALE_UP; how many workers to retire for SCALE_DOWN
    reason: str
    message: str


def plan_scale(
    *,
    current: int,
    desired: int,
    draining: int,
    last_failure_age: float | None,
    failed_generation: int | None,
    generation: int,
) -> Decision:
    """What to do now to move the workload from ``current`` replicas to ``desired``.

    ``draining`` counts workers in RetirementRequests of this policy that have not finished:
    while any runs, nothing else starts (its scale-down lowers ``current`` when it is done).
    A failed drain holds further scale-downs back for :data:`FAILURE_COOLDOWN_SECONDS`,
    unless the spec changed since.
    """
    if draining:
        return Decision(Action.WAIT, 0, "Draining", f"waiting for the drain of {draining} workers to finish")
    if desired > current:
        return Decision(Action.SCALE_UP, desired, "ScaleUp", f"scaling up from {current} to {desired} workers")
    if desired < current:
        held_back = (
            last_failure_age is not None
            and last_failure_age < FAILURE_COOLDOWN_SECONDS
            and failed_generation == generation
        )
        if held_back:
            return Decision(
                Action.WAIT,
                0,
                "DrainFailed",
                f"the last drain failed {last_failure_age:.0f}s ago; retrying after"
                f" {FAILURE_COOLDOWN_SECONDS:.0f}s or on a spec change",
            )
        count = current - desired
        return Decision(
            Action.SCALE_DOWN, count, "ScaleDown", f"scaling down from {current} to {desired}: draining {count} workers"
        )
    return Decision(Action.NONE, 0, "Steady", f"{current} workers, as desired")


def competing_policies(me: Mapping[str, Any], policies: Iterable[Mapping[str, Any]]) -> list[str]:
    """Names of older policies on the same workload: the oldest policy wins, the others wait."""
    workload = me.get("spec", {}).get("workload")
    mine = (me["metadata"].get("creationTimestamp", ""), me["metadata"]["name"])
    older = []
    for other in policies:
        if other["metadata"]["name"] == me["metadata"]["name"] or other.get("spec", {}).get("workload") != workload:
            continue
        if (other["metadata"].get("creationTimestamp", ""), other["metadata"]["name"]) < mine:
            older.append(str(other["metadata"]["name"]))
    return sorted(older)


def autoscalers_on(workload: specs.WorkloadRef, hpas: Iterable[Mapping[str, Any]]) -> list[str]:
    """HorizontalPodAutoscalers that scale the workload directly, around the policy."""
    return sorted(
        str(h["metadata"]["name"])
        for h in hpas
        if h.get("spec", {}).get("scaleTargetRef", {}).get("kind") == workload.kind.value
        and h.get("spec", {}).get("scaleTargetRef", {}).get("name") == workload.name
    )
