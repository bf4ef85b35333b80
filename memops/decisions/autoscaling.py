"""Memory-driven autoscaling with the HorizontalPodAutoscaler's algorithm, as pure functions.

The metric is what the scheduler knows: each worker's process memory plus what it spilled
to disk (spilling is memory pressure too), over the workers' memory limits. The rest is the
HPA's, from the Kubernetes documentation and ``pkg/controller/podautoscaler/horizontal.go``:
``ceil(current * utilization / target)`` with a 10% tolerance; the recommendation is
stabilized over the scale-up and scale-down windows; the change is limited by the scaling
policies (``Pods`` / ``Percent`` per period, ``selectPolicy`` Max/Min/Disabled); the result
is clamped to min/max. memops adds one rule: never fewer workers than the data in memory now
needs at the target utilization.

The history that the windows and policies need (recommendations, scale events) is passed in
and returned: the controller keeps it in the MemoryPolicy's status, not in memory.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence

from memops import specs
from memops.decisions import snapshots

TOLERANCE = 0.1


@dataclasses.dataclass(frozen=True)
class Usage:
    """Memory of the connected workers, in bytes."""

    workers: int
    held: int  # process memory + spilled to disk, summed
    limit: int  # memory limits, summed

    @property
    def utilization(self) -> float:
        """Percent of the memory limit held."""
        return 100.0 * self.held / self.limit if self.limit else 0.0


def usage_of(workers: Sequence[snapshots.WorkerInfo]) -> Usage:
    return Usage(
        workers=len(workers),
        held=sum(w.process_bytes + w.spilled_bytes for w in workers),
        limit=sum(w.memory_limit for w in workers),
    )


def metric_recommendation(current: int, usage: Usage, target: float) -> int:
    """``ceil(current * utilization / target)``, or ``current`` within the tolerance."""
    if usage.workers == 0 or usage.limit == 0:
        return current
    ratio = usage.utilization / target
    if abs(ratio - 1.0) <= TOLERANCE:
        return current
    return max(math.ceil(usage.workers * ratio), 0)


def fit_floor(usage: Usage, target: float) -> int:
    """The fewest workers that hold the memory in use now at the target utilization."""
    if usage.workers == 0 or usage.limit == 0:
        return 0
    per_worker = usage.limit / usage.workers
    return math.ceil(usage.held / (per_worker * target / 100.0))


def stabilize(
    recommendation: int, current: int, history: Sequence[specs.Recommendation], now: float, behavior: specs.Behavior
) -> int:
    """``stabilizeRecommendationWithBehaviors``: the lowest recent recommendation bounds a
    scale-up, the highest bounds a scale-down, each over its own window."""
    up = down = recommendation
    for past in history:
        if past.time > now - behavior.scaleUp.stabilizationWindowSeconds:
            up = min(up, past.replicas)
        if past.time > now - behavior.scaleDown.stabilizationWindowSeconds:
            down = max(down, past.replicas)
    result = current
    if result < up:
        result = up
    if result > down:
        result = down
    return result


def _changed_within(events: Sequence[specs.ScaleEvent], period: int, now: float, up: bool) -> int:
    return sum(abs(e.change) for e in events if e.time > now - period and (e.change > 0) == up)


def _period_start(current: int, events: Sequence[specs.ScaleEvent], period: int, now: float) -> int:
    """The replicas at the start of a policy's period: undo what was added and removed since."""
    return current - _changed_within(events, period, now, up=True) + _changed_within(events, period, now, up=False)


def rate_limits(
    current: int, events: Sequence[specs.ScaleEvent], now: float, behavior: specs.Behavior
) -> tuple[int, int]:
    """(lowest, highest) replicas the scaling policies allow now, as upstream computes them."""
    up_rules, down_rules = behavior.scaleUp, behavior.scaleDown
    if up_rules.selectPolicy == specs.SelectPolicy.DISABLED or not up_rules.policies:
        highest = current
    else:
        proposals = []
        for policy in up_rules.policies:
            start = _period_start(current, events, policy.periodSeconds, now)
            if policy.type == specs.PolicyType.PODS:
                proposals.append(start + policy.value)
            else:  # rounded up, or a small percentage would never add a worker
                proposals.append(math.ceil(start * (1 + policy.value / 100)))
        highest = min(proposals) if up_rules.selectPolicy == specs.SelectPolicy.MIN else max(proposals)
    if down_rules.selectPolicy == specs.SelectPolicy.DISABLED or not down_rules.policies:
        lowest = current
    else:
        proposals = []
        for policy in down_rules.policies:
            start = _period_start(current, events, policy.periodSeconds, now)
            if policy.type == specs.PolicyType.PODS:
                proposals.append(start - policy.value)
            else:
                proposals.append(int(start * (1 - policy.value / 100)))
        lowest = max(proposals) if down_rules.selectPolicy == specs.SelectPolicy.MIN else min(proposals)
    return min(lowest, current), max(highest, current)


class Limit(enum.StrEnum):
    """What held a recommendation back from the metric's count (stabilization is not a limit)."""

    SCALE_UP_POLICIES = "ScaleUpPolicies"
    SCALE_DOWN_POLICIES = "ScaleDownPolicies"
    MEMORY_IN_USE = "MemoryInUse"  # the memory in use needs more workers than the metric asks for
    MAX_REPLICAS = "MaxReplicas"
    MIN_REPLICAS = "MinReplicas"


@dataclasses.dataclass(frozen=True)
class Recommendation:
    replicas: int
    reason: str  # for people: the metric, and each step that changed the count
    raw: int  # before stabilization, to be kept in the history
    limits: tuple[Limit, ...] = ()  # what held the count back, in the order applied


def desired_replicas(
    *,
    current: int,
    usage: Usage,
    spec: specs.AutoscaleSpec,
    history: Sequence[specs.Recommendation],
    events: Sequence[specs.ScaleEvent],
    now: float,
) -> Recommendation:
    """The number of workers to steer towards, and why."""
    raw = metric_recommendation(current, usage, spec.targetMemoryUtilization)
    stabilized = stabilize(raw, current, history, now, spec.behavior)
    lowest, highest = rate_limits(current, events, now, spec.behavior)
    desired, reason = (
        stabilized,
        f"memory at {usage.utilization:.0f}% of the limit, target {spec.targetMemoryUtilization}%",
    )
    limits: list[Limit] = []
    if stabilized != raw:
        reason += f"; stabilized from {raw}"
    if desired > highest:
        desired, reason = highest, reason + f"; limited to {highest} by the scale-up policies"
        limits.append(Limit.SCALE_UP_POLICIES)
    if desired < lowest:
        desired, reason = lowest, reason + f"; limited to {lowest} by the scale-down policies"
        limits.append(Limit.SCALE_DOWN_POLICIES)
    floor = fit_floor(usage, spec.targetMemoryUtilization)
    if desired < current and desired < floor:
        desired, reason = min(floor, current), reason + f"; the memory in use needs {floor} workers"
        limits.append(Limit.MEMORY_IN_USE)
    if desired > spec.maxReplicas:
        desired, reason = spec.maxReplicas, reason + f"; capped at maxReplicas {spec.maxReplicas}"
        limits.append(Limit.MAX_REPLICAS)
    if desired < spec.minReplicas:
        desired, reason = spec.minReplicas, reason + f"; raised to minReplicas {spec.minReplicas}"
        limits.append(Limit.MIN_REPLICAS)
    return Recommendation(desired, reason, raw, tuple(limits))


PAUSE = 0.8
"""Dask's default pause threshold (``distributed.worker.memory.pause``): a new worker admits a task
whose profiled peak is under this share of its memory limit, less its own process' memory."""


def with_task_demand(
    desired: int,
    connected: int,
    tasks: specs.TaskAdmissionStatus | None,
    usage: Usage | None,
    spec: specs.AutoscaleSpec | None,
) -> tuple[int, str]:
    """Task admission found tasks whose profiled peak fits no worker (they wait, ``demandTasks``):
    ask for one more worker, within maxReplicas, where a new worker could start the largest of
    them (its peak under the pause threshold of a worker's memory limit). Returns the desired
    count and, if raised, why.

    Counted from the workers connected, as :func:`with_relief`: while the worker asked for starts,
    the same demand asks for no more; once it has joined, the tasks it admits leave the demand."""
    if spec is None or tasks is None or not tasks.demandTasks:
        return desired, ""
    if not new_worker_fits(tasks.demandBytes, usage):
        return desired, ""  # no new worker of this size could start it: more workers would not help
    wanted = min(max(desired, connected + 1), spec.maxReplicas)
    if wanted <= desired:
        return desired, ""
    return wanted, f"raised to {wanted}: {tasks.demandTasks} tasks wait for room that no worker has"


def new_worker_fits(peak: int, usage: Usage | None) -> bool:
    """Whether a new worker, of the connected workers' mean memory limit, could start a task of this
    profiled peak (under its pause threshold)."""
    return usage is not None and usage.workers > 0 and peak <= PAUSE * usage.limit / usage.workers


def with_relief(desired: int, connected: int, starved: int, spec: specs.AutoscaleSpec | None) -> tuple[int, str]:
    """Pressure relief found ``starved`` hot workers with no peer that has room: ask for one more
    worker each, within maxReplicas. Returns the desired count and, if raised, why.

    Counted from the workers connected to the scheduler, not from the replicas asked for: while
    the workers asked for on an earlier pass are starting, the same starvation asks for no more.
    """
    if not starved or spec is None:
        return desired, ""
    wanted = min(max(desired, connected + starved), spec.maxReplicas)
    if wanted <= desired:
        return desired, ""
    return wanted, f"raised to {wanted}: {starved} workers under memory pressure have no peer with room"
