"""Why not: the removals that a MemoryPolicy pass would make but holds back, each with its rule.

Pure. The rules are enforced where they are decided (:func:`memops.decisions.scaling.plan_scale`'s
cooldown after a failed drain, :func:`memops.decisions.autoscaling.desired_replicas`'s window and
limits, :func:`memops.decisions.recycle_decisions.plan_recycle` and ``plan_replacement``,
:func:`memops.decisions.node_pressure.to_drain`, and a drain's verdict on each worker,
:func:`memops.decisions.drain_decisions.judge_drain`). :func:`memops.decisions.policy_decisions.decide`
hands this module what they decided, and this module alone turns it into what a person reads:
``status.heldBack`` (a set by pod, and one entry without a pod for a scale-down held back before
any worker is chosen) and one Event for each entry that is new, whose reason is the rule.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Mapping, Sequence

import pydantic

from memops import specs
from memops.decisions import autoscaling, drain_decisions, objects, recycle_decisions

Rule = specs.HeldBackRule

MAX_MESSAGE = 1024
"""A hold's message is cut to this many characters: a drain's own words about a pod can be long."""

_CAUSES = {
    specs.WorkerReason.NOWHERE_TO_GO: Rule.NOWHERE_TO_GO,
    specs.WorkerReason.TIMED_OUT: Rule.DRAIN_TIMED_OUT,
    specs.WorkerReason.UNREACHABLE: Rule.DRAIN_UNREACHABLE,
    specs.WorkerReason.UNIDENTIFIED: Rule.WORKER_UNIDENTIFIED,
}
_KEPT = {specs.KeptReason.REQUEST_FAILED: Rule.REQUEST_FAILED, specs.KeptReason.REMOVAL_BLOCKED: Rule.REMOVAL_BLOCKED}
_RAISING = {
    autoscaling.Limit.SCALE_DOWN_POLICIES: Rule.SCALE_DOWN_POLICIES,
    autoscaling.Limit.MEMORY_IN_USE: Rule.MEMORY_IN_USE,
    autoscaling.Limit.MIN_REPLICAS: Rule.MIN_REPLICAS,
}
"""The limits that raise a recommendation, in the order applied: the last one applied sets the count."""

WARNINGS = frozenset({*_CAUSES.values(), *_KEPT.values(), Rule.DRAIN_FAILED, Rule.NO_ROOM_ON_OTHER_NODES})
"""Rules whose hold means data could not move: their events are Warnings; the policy's own bounds are Normal."""


@dataclasses.dataclass(frozen=True)
class Hold:
    """One removal held back: a pod's (``pod``), or ``workers`` of a scale-down not yet chosen (``pod`` "")."""

    pod: str
    rule: specs.HeldBackRule
    message: str
    workers: int = 1


def failed_drain(request: objects.Obj, *, retry_at: str, workers: int) -> list[Hold]:
    """The scale-down waits until ``retry_at`` after its last drain failed: each pod that drain
    kept, with the rule of its cause (the drain's own words about it, :func:`drain_decisions.render`);
    the ``workers`` of the scale-down, when it kept none (no worker could be chosen). The message
    names a time rather than the seconds left, so that it stays the same from pass to pass."""
    name = str(request["metadata"].get("name", ""))
    try:
        status = specs.RetirementRequestStatus.model_validate(request.get("status") or {})
    except pydantic.ValidationError:
        status = specs.RetirementRequestStatus()
    retry = f"the scale-down tries again at {retry_at}, or at once on a spec change"
    holds = [
        Hold(w.pod, _kept_rule(w), f"{drain_decisions.render(w)} (RetirementRequest {name}); {retry}")
        for w in status.workers
        if w.state == specs.WorkerState.KEPT
    ]
    if holds:
        return holds
    said = f": {status.message}" if status.message else ""
    return [Hold("", Rule.DRAIN_FAILED, f"the last drain (RetirementRequest {name}) failed{said}; {retry}", workers)]


def _kept_rule(worker: specs.WorkerStatus) -> specs.HeldBackRule:
    cause = worker.cause
    if cause is None:  # a status written before causes were recorded
        return Rule.REQUEST_FAILED
    if cause.kept is not None:
        return _KEPT[cause.kept]
    return _CAUSES.get(cause.reason, Rule.REQUEST_FAILED)


def autoscaled(
    recommendation: autoscaling.Recommendation | None, *, current: int, spec: specs.AutoscaleSpec | None
) -> list[Hold]:
    """The workers that the memory metric alone would remove (its raw recommendation, below
    ``current``) and autoscaling keeps: by the limit that raised the count last, else by the
    scale-down stabilization window."""
    if recommendation is None or spec is None or recommendation.raw >= current:
        return []
    raw, kept = recommendation.raw, min(recommendation.replicas, current)
    if kept <= raw:
        return []
    raising = [limit for limit in recommendation.limits if limit in _RAISING]
    rule = _RAISING[raising[-1]] if raising else Rule.STABILIZATION_WINDOW
    why = {
        Rule.STABILIZATION_WINDOW: f"the scale-down stabilization window"
        f" ({spec.behavior.scaleDown.stabilizationWindowSeconds} s) keeps {kept}, its highest recommendation",
        Rule.SCALE_DOWN_POLICIES: f"the scale-down policies allow no fewer than {kept} now",
        Rule.MEMORY_IN_USE: f"the memory in use needs {kept} at the target utilization",
        Rule.MIN_REPLICAS: f"minReplicas is {kept}",
    }[rule]
    return [Hold("", rule, f"the memory metric asks for {raw} of the {current} workers; {why}", kept - raw)]


def recycling(
    due: Iterable[recycle_decisions.Verdict],
    *,
    chosen: Collection[str] | None,
    shuffling: Collection[str],
    max_unavailable: int,
) -> list[Hold]:
    """The workers due for recycling that this pass does not mark: all of them while another drain
    of the policy runs (``chosen`` None), else those that :func:`recycle_decisions.plan_recycle`
    did not choose: in a P2P shuffle, or beyond ``maxUnavailable``."""
    holds = []
    for verdict in due:
        if chosen is not None and verdict.pod in chosen:
            continue
        head = f"due for recycling ({verdict.reason}: {verdict.message})"
        if chosen is None:
            rule, why = (
                Rule.OTHER_DRAIN_RUNNING,
                "another drain of the policy (a scale-down, or a Node's) is running, and no recycling starts meanwhile",
            )
        elif verdict.pod in shuffling:
            rule, why = Rule.IN_SHUFFLE, "its worker takes part in a P2P shuffle: it waits for the shuffle to end"
        else:
            rule, why = Rule.MAX_UNAVAILABLE, f"spec.recycle.maxUnavailable ({max_unavailable}) are being recycled"
        holds.append(Hold(verdict.pod, rule, f"{head}; {why}"))
    return holds


def awaiting_replacements(
    marked: Mapping[str, Mapping[str, object]], waiting: Sequence[str], *, connected: int, desired: int
) -> list[Hold]:
    """Marked workers whose drain waits for their replacements to connect (``spec.recycle.surge``)."""
    return [
        Hold(
            pod,
            Rule.AWAITING_REPLACEMENTS,
            f"marked for recycling ({marked.get(pod, {}).get('reason', '')}): its drain waits for replacements to"
            f" connect ({connected} of {desired} workers)",
        )
        for pod in waiting
    ]


def node_pressure(refused: Mapping[str, str]) -> list[Hold]:
    """The kubelet's predicted victims that are not drained: the other Nodes have no room for their data."""
    return [Hold(pod, Rule.NO_ROOM_ON_OTHER_NODES, why) for pod, why in refused.items()]


def status(
    holds: Iterable[Hold], old: Sequence[specs.HeldBack], now: str
) -> tuple[list[specs.HeldBack], tuple[objects.Event, ...]]:
    """``status.heldBack``: the first hold of each pod in the pass' order, the scale-down's count
    first and then by pod, at most :data:`memops.specs.MAX_HELD_BACK`; and an Event for each entry
    whose pod and rule are new (a hold that goes on keeps its ``since`` and says nothing again)."""
    first: dict[str, Hold] = {}
    for hold in holds:
        first.setdefault(hold.pod, hold)
    before = {(entry.pod, entry.rule): entry for entry in old}
    entries, events = [], []
    for hold in sorted(first.values(), key=lambda h: h.pod)[: specs.MAX_HELD_BACK]:
        earlier = before.get((hold.pod, hold.rule))
        message = hold.message[:MAX_MESSAGE]
        entries.append(
            specs.HeldBack(
                pod=hold.pod,
                rule=hold.rule,
                workers=hold.workers,
                message=message,
                since=earlier.since if earlier is not None else now,
            )
        )
        if earlier is None:
            what = f"{hold.pod} held back" if hold.pod else f"a scale-down of {hold.workers} workers held back"
            kind = "Warning" if hold.rule in WARNINGS else "Normal"
            events.append(objects.Event(kind, hold.rule.value, f"{what}: {message}"))
    return entries, tuple(events)
