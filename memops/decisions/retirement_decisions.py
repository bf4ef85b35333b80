"""What one step of a RetirementRequest decides: the status it writes and the effects before it.

Pure, like Kubernetes' own controllers computing status: :mod:`memops.controllers.retirement`
reads the facts (:class:`StartFacts`, :class:`RemovalFacts`, the scheduler's answer to a drain),
calls one function here, and applies the :class:`Decision` it returns: claims, the scale-down,
events, and the status last, in one write. The conditions that follow from how a step ends
(``Draining``, ``Complete``, ``Failed``, ``DataLost``, ``Retrying``, and ``Ready``,
``Reconciling``, ``Stalled`` from the phase) are derived here once, in :func:`ended` and
:func:`summarize`, never set by the code that performs effects.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
from collections.abc import Mapping, Sequence

from memops import specs
from memops.decisions import (
    conditions,
    drain_decisions,
    eviction_gate,
    objects,
    retire_choice,
    snapshots,
    tenancy,
    timestamps,
)

Event = objects.Event  # one event type for both kinds' decisions


@dataclasses.dataclass(frozen=True)
class Release:
    """Claims to give back: ``pods`` (None: every pod this request claimed)."""

    pods: tuple[str, ...]
    keep_cost: tuple[str, ...] = ()
    tolerate_errors: bool = False
    """The request is Failed already: a claim that cannot be released only blocks others, so say so and go on."""


@dataclasses.dataclass(frozen=True)
class Decision:
    """What a step does, in the order the controller applies it: effects first, the status last."""

    status: specs.RetirementRequestStatus
    claim: tuple[objects.Obj, ...] = ()
    """Pods to claim for this request before the status says Draining."""
    mark_for_deletion: tuple[str, ...] = ()
    """Pods the ReplicaSet must rank first (pod-deletion-cost), before the scale-down is recorded."""
    release: Release | None = None
    events: tuple[Event, ...] = ()
    started: bool = False
    """A drain began: counted in the metrics."""
    finished: str | None = None
    """The request ended, for this reason: counted in the metrics."""


class BlockerKind(enum.Enum):
    """Why a request cannot start (or go on) now."""

    FATAL = "fatal"  # Failed at once
    UNTIL_DEADLINE = "until-deadline"  # the scheduler: retried until the deadline, then Failed


@dataclasses.dataclass(frozen=True)
class Blocker:
    """A typed reason not to go on: ``reason`` is the condition's and the failure's reason."""

    reason: str
    message: str
    kind: BlockerKind = BlockerKind.FATAL

    @classmethod
    def unvouched(cls, verdict: tenancy.Verdict) -> Blocker:
        return cls(verdict.reason.value, verdict.message, BlockerKind.UNTIL_DEADLINE)

    @classmethod
    def unreachable(cls, error: Exception | str) -> Blocker:
        return cls("SchedulerUnreachable", str(error), BlockerKind.UNTIL_DEADLINE)


@dataclasses.dataclass(frozen=True)
class StartFacts:
    """What a Pending request's start read: a blocker, or the pods and the vetted scheduler's snapshot."""

    blocker: Blocker | None = None
    pods: Sequence[objects.Obj] = ()
    infos: Sequence[snapshots.PodInfo] = ()
    snapshot: snapshots.SchedulerSnapshot | None = None


@dataclasses.dataclass(frozen=True)
class RemovalFacts:
    """What stands before a scale-down is recorded (at most one blocker; else the replicas now)."""

    outranking: Sequence[str] = ()
    foreign: str | None = None
    deployments: Sequence[str] = ()
    replicas: int = 0


# -- the conditions, derived once ----------------------------------------------------------------


class Ending(enum.Enum):
    CONCLUDED = "concluded"  # every worker settled: Complete, or Failed with WorkersKept
    FAILED = "failed"  # stopped early, with a reason of its own


def ended(
    status: specs.RetirementRequestStatus, ending: Ending, *, reason: str = "", generation: int | None = None
) -> list[specs.Condition]:
    """The conditions that say how a request ended."""
    generation = status.observedGeneration if generation is None else generation
    found = status.conditions
    if ending == Ending.FAILED:
        return conditions.set_condition(
            found, "Failed", True, reason=reason, message=status.message, generation=generation
        )
    succeeded = status.phase == specs.Phase.SUCCEEDED
    found = conditions.set_condition(
        found, "Draining", False, reason="Finished", message=status.message, generation=generation
    )
    found = conditions.set_condition(
        found,
        "Complete" if succeeded else "Failed",
        True,
        reason="Retired" if succeeded else "WorkersKept",
        message=status.message,
        generation=generation,
    )
    if status.bytesLost:
        found = conditions.set_condition(
            found,
            "DataLost",
            True,
            reason="Forced",
            message=f"{status.bytesLost} bytes lost by forced removal (onTimeout: Force)",
            generation=generation,
        )
    return found


def summarize(status: specs.RetirementRequestStatus, *, was_retrying: bool = False) -> specs.RetirementRequestStatus:
    """The status as written: a step that went through clears ``Retrying``; then ``Ready``,
    ``Reconciling`` and ``Stalled`` from the phase (:func:`memops.decisions.conditions.request_summary`)."""
    found = status.conditions
    if was_retrying:
        found = conditions.set_condition(
            found, "Retrying", False, reason="Recovered", generation=status.observedGeneration
        )
    status = status.model_copy(update={"conditions": found})
    return status.model_copy(update={"conditions": conditions.request_summary(status)})


def _reachable(
    status: specs.RetirementRequestStatus, value: bool, *, reason: str, message: str = "", generation: int
) -> list[specs.Condition]:
    return conditions.set_condition(
        status.conditions, "SchedulerReachable", value, reason=reason, message=message, generation=generation
    )


def _draining(status: specs.RetirementRequestStatus, *, reason: str, message: str) -> list[specs.Condition]:
    return conditions.set_condition(
        status.conditions, "Draining", True, reason=reason, message=message, generation=status.observedGeneration
    )


# -- failing ---------------------------------------------------------------------------------------


def fail(
    status: specs.RetirementRequestStatus, reason: str, message: str, *, generation: int, now: datetime.datetime
) -> Decision:
    """Failed: every pod whose removal was not ordered is kept, and its claim given back."""
    ordered = set(status.scaleDown.pods) if status.scaleDown is not None else set()
    status = status.model_copy(
        update={
            "phase": specs.Phase.FAILED,
            "message": message,
            "observedGeneration": generation,
            "completionTime": timestamps.render(now),
            # A drain that had started: every pod whose removal was not ordered is kept.
            "workers": drain_decisions.keep_unfinished(status.workers, f"{reason}: {message}", ordered=ordered),
        }
    )
    status.conditions = ended(status, Ending.FAILED, reason=reason, generation=generation)
    kept = tuple(w.pod for w in status.workers if w.state == specs.WorkerState.KEPT)
    return Decision(
        status=status,
        release=Release(kept, tolerate_errors=True) if kept else None,
        events=(Event("Warning", reason, message),),
        finished=reason,
    )


def blocked(
    status: specs.RetirementRequestStatus,
    blocker: Blocker,
    *,
    deadline: datetime.datetime,
    generation: int,
    now: datetime.datetime,
) -> Decision:
    """A start that cannot go on: Failed at once, or (the scheduler) retried until the deadline."""
    message = f"spec.scheduler.address: {blocker.message}"
    if blocker.kind == BlockerKind.FATAL:
        return fail(status, blocker.reason, blocker.message, generation=generation, now=now)
    # Nothing is asked of the scheduler or written about it; a worker may be joining, or its pod just gone.
    status = status.model_copy(deep=True)
    status.conditions = _reachable(
        status,
        False,
        reason=blocker.reason,
        message=f"{message}; retrying until {timestamps.render(deadline)}",
        generation=generation,
    )
    if now >= deadline:
        return fail(status, blocker.reason, message, generation=generation, now=now)
    return Decision(status=status)


def refuse_spec_change(status: specs.RetirementRequestStatus, generation: int) -> tuple[list[specs.Condition], Event]:
    """A spec changed after the drain started: the change is refused, in a condition and an event."""
    message = (
        f"spec changed at generation {generation} after the drain started at generation"
        f" {status.observedGeneration}; a RetirementRequest is one-shot, so the change is ignored:"
        " create a new request instead"
    )
    updated = conditions.set_condition(
        status.conditions, "SpecChangeRejected", True, reason="OneShot", message=message, generation=generation
    )
    return updated, Event("Warning", "SpecChangeRejected", message)


# -- starting --------------------------------------------------------------------------------------


def start(
    spec: specs.RetirementRequestSpec,
    status: specs.RetirementRequestStatus,
    facts: StartFacts,
    *,
    name: str,
    generation: int,
    deadline: datetime.datetime,
    now: datetime.datetime,
) -> Decision:
    """A Pending request: choose its workers and begin their drain, or say why not."""
    if facts.blocker is not None:
        return blocked(status, facts.blocker, deadline=deadline, generation=generation, now=now)
    assert facts.snapshot is not None
    pod_names = [p["metadata"]["name"] for p in facts.pods]
    located = snapshots.workers_by_pod(facts.infos, facts.snapshot.workers)
    unknown = retire_choice.unidentified(facts.infos, located)
    taken = drain_decisions.claimed_by_others(facts.pods, name)
    if spec.workers is not None:
        refused = named_workers_refused(spec, pod_names, taken)
        if refused is not None:
            return fail(status, refused.reason, refused.message, generation=generation, now=now)
        chosen = list(dict.fromkeys(spec.workers))  # a set, whatever let a repeat through
    else:
        assert spec.count is not None
        chosen = retire_choice.choose_workers(
            pod_names, facts.snapshot, spec.count, exclude=taken | set(unknown), located=located
        )
    status = status.model_copy(deep=True)
    if unknown:
        status.conditions = conditions.set_condition(
            status.conditions,
            "WorkersUnidentified",
            True,
            reason="NoWorkerAtPodAddress",
            message=drain_decisions.unidentified_message(unknown),
            generation=generation,
        )
    if not chosen:
        message = "no worker could be chosen: every pod is taken or none exists"
        if unknown:
            message += f"; {drain_decisions.unidentified_message(unknown)}"
        return fail(status, "NoWorkers", message, generation=generation, now=now)
    claim = tuple(p for p in facts.pods if p["metadata"]["name"] in chosen)
    return _started(spec, status, chosen, claim, located, unknown, generation=generation, now=now)


def named_workers_refused(
    spec: specs.RetirementRequestSpec, pod_names: Sequence[str], taken: set[str]
) -> Blocker | None:
    """``spec.workers``: each must be a running pod of the workload that no other request claimed."""
    for index, pod in enumerate(spec.workers or ()):
        if pod not in pod_names:
            return Blocker(
                "WorkerNotFound",
                f"spec.workers[{index}]: pod {pod!r} is not a running"
                f" pod of {spec.workload.kind} {spec.workload.name!r}",
            )
        if pod in taken:
            return Blocker(
                "WorkerClaimed",
                f"spec.workers[{index}]: pod {pod!r} is already being retired by another RetirementRequest",
            )
    return None


def _started(
    spec: specs.RetirementRequestSpec,
    status: specs.RetirementRequestStatus,
    chosen: list[str],
    claim: tuple[objects.Obj, ...],
    located: Mapping[str, Sequence[snapshots.WorkerInfo]],
    unknown: Sequence[str],
    *,
    generation: int,
    now: datetime.datetime,
) -> Decision:
    status = status.model_copy(
        update={
            "phase": specs.Phase.DRAINING,
            "observedGeneration": generation,
            "startTime": timestamps.render(now),
            "deadline": timestamps.render(now + specs.parse_duration(spec.timeout)),
            "onTimeout": spec.onTimeout,
            "acceptedSpec": spec,
            "requested": spec.count if spec.count is not None else len(chosen),
            "workers": [drain_decisions.entry(pod, located.get(pod, ()), unknown=pod in unknown) for pod in chosen],
        }
    )
    status.conditions = _reachable(status, True, reason="Connected", generation=generation)
    status.conditions = _draining(
        status, reason="DrainStarted", message=f"draining {len(chosen)} workers: {', '.join(chosen)}"
    )
    event = Event(
        "Normal", "DrainStarted", f"draining {len(chosen)} workers through the scheduler: {', '.join(chosen)}"
    )
    return Decision(status=status, claim=claim, events=(event,), started=True)


# -- draining --------------------------------------------------------------------------------------


def draining(status: specs.RetirementRequestStatus) -> list[specs.WorkerStatus]:
    """The workers the scheduler still has to retire."""
    return [w for w in status.workers if w.state == specs.WorkerState.DRAINING and not w.removable]


def addresses(workers: Sequence[specs.WorkerStatus]) -> list[str]:
    return [a for w in workers for a in (w.addresses or ([w.address] if w.address else []))]


def drain_blocked(
    status: specs.RetirementRequestStatus,
    blocker: Blocker,
    *,
    deadline: datetime.datetime,
    now: datetime.datetime,
) -> Decision:
    """The scheduler is unreachable, or stopped being shown as this namespace's, mid-drain: retire
    nothing there; at the deadline judge the pods by the onTimeout accepted at the start."""
    status = status.model_copy(deep=True)
    if now < deadline:
        status.conditions = _reachable(
            status,
            False,
            reason=blocker.reason,
            message=f"{blocker.message}; retrying until {status.deadline}",
            generation=status.observedGeneration,
        )
    else:
        on_timeout = status.onTimeout or specs.OnTimeout.ABORT
        status.workers = drain_decisions.judge_unreachable(
            status.workers, on_timeout=on_timeout, reason=blocker.message
        )
    return Decision(status=status)


def drained(status: specs.RetirementRequestStatus, workers: list[specs.WorkerStatus]) -> Decision:
    """The scheduler answered a drain; ``workers`` is :func:`memops.decisions.drain_decisions.judge_drain`'s verdict."""
    status = status.model_copy(update={"workers": workers})
    status.conditions = _reachable(status, True, reason="Connected", generation=status.observedGeneration)
    events = []
    for worker in workers:
        if worker.state == specs.WorkerState.KEPT:
            events.append(Event("Warning", "WorkerKept", f"{worker.pod}: {worker.message}"))
        elif worker.state == specs.WorkerState.FORCED:
            events.append(Event("Warning", "WorkerForced", f"{worker.pod}: {worker.message}"))
    return Decision(status=status, events=tuple(events))


# -- removing --------------------------------------------------------------------------------------


def needs_scale_down(status: specs.RetirementRequestStatus) -> bool:
    """The pods to remove are not all in the scale-down recorded so far."""
    pods = drain_decisions.to_remove(status.workers)
    return status.scaleDown is None or not set(pods) <= set(status.scaleDown.pods)


def plan_scale_down(
    status: specs.RetirementRequestStatus, facts: RemovalFacts, *, deadline: datetime.datetime, now: datetime.datetime
) -> Decision:
    """Record the scale-down before it is ordered (a restarted operator must not lower it twice),
    unless a not-ready pod would be removed first, or a worker Deployment is not the workload's."""
    pods = drain_decisions.to_remove(status.workers)
    status = status.model_copy(deep=True)
    if facts.outranking:
        message = (
            f"waiting: pods {', '.join(facts.outranking)} are not ready, and the ReplicaSet would remove"
            " them before the drained ones"
        )
        if now >= deadline:
            status.workers = drain_decisions.keep_blocked(status.workers, message)
        else:
            status.conditions = _draining(status, reason="WaitingForPods", message=message)
        return Decision(status=status)
    if facts.foreign is not None:
        status.workers = drain_decisions.keep_blocked(status.workers, f"waiting: {facts.foreign}")
        status.conditions = _draining(status, reason="ForeignDeployment", message=f"refused to delete: {facts.foreign}")
        return Decision(status=status)
    status.scaleDown = specs.ScaleDown(
        pods=pods,
        replicasFrom=facts.replicas,
        replicasTo=max(facts.replicas - len(pods), 0),
        deployments=list(facts.deployments),
    )
    return Decision(status=status, mark_for_deletion=tuple(pods))


def removed(status: specs.RetirementRequestStatus, gone: Sequence[str]) -> Decision:
    """The ordered scale-down's pods that are gone now."""
    status = status.model_copy(update={"workers": drain_decisions.mark_removed(status.workers, gone)})
    events = tuple(Event("Normal", "PodRemoved", f"{pod}: drained and removed") for pod in gone)
    return Decision(status=status, events=events)


def left_to_eviction(status: specs.RetirementRequestStatus) -> Decision:
    """An eviction's drain (``removePods: false``): the evicting client removes the pods, which the gate now admits."""
    return Decision(status=status.model_copy(update={"workers": eviction_gate.mark_drained(status.workers)}))


# -- finishing -------------------------------------------------------------------------------------


def conclude(status: specs.RetirementRequestStatus, *, now: datetime.datetime) -> Decision:
    """No worker is draining any more: Succeeded or Failed, by the workers' fates."""
    requested = status.requested or len(status.workers)
    status = drain_decisions.conclude(status, requested=requested, at=timestamps.render(now))
    status.conditions = ended(status, Ending.CONCLUDED)
    succeeded = status.phase == specs.Phase.SUCCEEDED
    release = Release(
        tuple(w.pod for w in status.workers if not w.podRemoved),
        keep_cost=tuple(status.scaleDown.pods) if status.scaleDown is not None else (),
    )
    return Decision(
        status=status,
        release=release,
        events=(Event("Normal" if succeeded else "Warning", "Succeeded" if succeeded else "Failed", status.message),),
        finished="Retired" if succeeded else "WorkersKept",
    )
