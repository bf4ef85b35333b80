"""One MemoryPolicy pass, decided: from what the pass read to what it does and what its status says.

Pure: no I/O, and time is ``Inputs.now`` (only a condition that changes is stamped with the
clock, by :func:`memops.decisions.conditions.set_condition`). :class:`memops.controllers.policy.Policy`
reads the cluster and the scheduler into one :class:`Inputs`, calls :func:`decide`, and
applies the :class:`Decision` it returns once (marks, requests, the scale-up, events, the status), as
:func:`memops.decisions.conditions.request_summary` does for a RetirementRequest's conditions.

The order inside :func:`decide` is the order of the policy's promises: the count to steer towards
(``spec.replicas``, or memory-driven autoscaling raised for starved workers), then recycling
(which may ask for workers above that count while replacements start), then one scaling step
(:func:`memops.decisions.scaling.plan_scale`), then what the pass holds back and by which rule
(``status.heldBack``, :mod:`memops.decisions.held_back`), then the conditions, derived from the final state.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import json
from collections.abc import Mapping, Sequence
from typing import Any

from memops import specs
from memops.decisions import (
    autoscaling,
    conditions,
    disruption,
    held_back,
    node_pressure,
    objects,
    policy_findings,
    recycle_decisions,
    resize_decisions,
    scaling,
    shared_spill,
    timestamps,
)


@dataclasses.dataclass(frozen=True)
class PodSeen:
    """A worker pod of the workload, as the recycling pass needs it."""

    name: str
    age: float | None  # seconds since its creation
    mark: Mapping[str, Any] | None  # its memops.dev/recycle annotation, parsed


@dataclasses.dataclass(frozen=True)
class RecycleSeen:
    """What the recycling pass read: only when ``spec.recycle`` is set and the scheduler answered."""

    pods: tuple[PodSeen, ...]
    samples: Mapping[str, Sequence[recycle_decisions.Sample]]  # the memory window, per pod
    shuffling: frozenset[str] = frozenset()  # pods whose workers take part in a shuffle
    connected: frozenset[str] = frozenset()  # pods whose workers are running
    record: specs.RecycleStatus = dataclasses.field(default_factory=specs.RecycleStatus)
    recorded: tuple[str, ...] = ()  # finished drains now in ``record``, to annotate once it is written
    # What the read found to show, applied by the pass' apply (never during the read):
    unmanaged: Mapping[str, str] = dataclasses.field(default_factory=dict)  # pod -> its new unmanaged percent
    ended: tuple[specs.Recycling, ...] = ()  # drains newly in ``record``: an event and a metric each
    unmark: tuple[str, ...] = ()  # pods whose recycling drain failed: their mark is taken off


@dataclasses.dataclass(frozen=True)
class NotReady:
    """Why a policy cannot act this pass (a typed blocker of the read); the status says so."""

    reason: str
    message: str
    conflict: bool = False  # another policy manages the workload: the Conflict condition says so too


def not_ready(status: specs.MemoryPolicyStatus, blocker: NotReady, generation: int) -> specs.MemoryPolicyStatus:
    """The status of a policy that does nothing this pass: not Ready, Stalled, and why."""
    found = status.conditions
    if blocker.conflict:
        found = conditions.set_condition(
            found, "Conflict", True, reason="AnotherPolicy", message=blocker.message, generation=generation
        )
    found = conditions.with_kstatus(found, generation=generation, stalled=(blocker.reason, blocker.message))
    found = conditions.set_condition(
        found, "Ready", False, reason=blocker.reason, message=blocker.message, generation=generation
    )
    # A policy that cannot act holds nothing back: what its last pass held is no longer being decided.
    update = {"observedGeneration": generation, "message": blocker.message, "conditions": found, "heldBack": []}
    return status.model_copy(update=update)


_DEFAULT_PROTECTION = disruption.DEFAULTS.max_seconds  # named here: Inputs' field ``disruption`` hides the module


@dataclasses.dataclass(frozen=True)
class Inputs:
    """Everything one pass decides from."""

    owner: objects.Owner
    generation: int
    spec: specs.MemoryPolicySpec
    status: specs.MemoryPolicyStatus  # as written last
    current: int  # the replicas the workload is asked for
    replicas: int  # the replicas the workload reports
    now: float  # unix seconds
    autoscalers: tuple[str, ...] = ()  # HPAs that scale the workload directly
    usage: autoscaling.Usage | None = None  # the workers' memory; None when the scheduler did not answer
    connected: int = 0  # workers connected to the scheduler
    requests: tuple[objects.Obj, ...] = ()  # the policy's RetirementRequests
    recycling: RecycleSeen | None = None
    template: Mapping[str, Any] | None = None  # the workload's pod spec (spec.sharedSpill); None: not read
    host_roots: frozenset[str] = frozenset()  # the host directories medium Node may mount (memops run's)
    resize: tuple[resize_decisions.WorkerSeen, ...] | None = None  # spec.resize's workers; None: not read
    # The administrator's ceiling on a grown limit in this namespace (memops run --max-resize-limit[-in]);
    # None: growth may not act here (the namespace is not in --resize-in).
    resize_ceiling: int | None = None
    disruption: DisruptionSeen | None = None  # the pods' annotations and unique bytes; None: not read this pass
    # The administrator's bound on the disruption annotations in this namespace (memops run's; 0: off).
    protection: float = _DEFAULT_PROTECTION
    node_pressure: node_pressure.Seen | None = None  # spec.eviction.nodePressure's read; None: not read
    # The scheduler's reachability and memory, failed hooks, drains' and workers' losses (policy_findings.observe).
    findings: policy_findings.Findings = dataclasses.field(default_factory=policy_findings.Findings)


Event = objects.Event  # one event type for both kinds' decisions


@dataclasses.dataclass(frozen=True)
class DisruptionSeen:
    """What the disruption annotations are decided from (:func:`memops.decisions.disruption.plan_annotations`)."""

    pods: Mapping[str, Mapping[str, str]]  # each worker pod's annotations
    # Pod -> bytes its worker holds alone (connected workers only); None: the scheduler was not reached.
    unique: Mapping[str, int] | None
    labels: Mapping[str, Mapping[str, str]] = dataclasses.field(default_factory=dict)  # the worker pods' labels
    # Pods that carry the policy's label (memops.dev/protected-by) but are not its workload's: their
    # annotations, and their labels in ``labels``.
    strays: Mapping[str, Mapping[str, str]] = dataclasses.field(default_factory=dict)

    def seen(self) -> dict[str, disruption.PodSeen]:
        found = {
            name: disruption.PodSeen(annotations, self.labels.get(name, {}), ours=False)
            for name, annotations in self.strays.items()
        }
        found.update(
            (name, disruption.PodSeen(annotations, self.labels.get(name, {})))
            for name, annotations in self.pods.items()
        )
        return found


@dataclasses.dataclass(frozen=True)
class ResizeOrder:
    """One change of a worker's memory for the apply: the container's (``pods/resize``: GROW,
    REVERT), Dask's copies (TELL_DASK), or Dask's then the container's (SHRINK)."""

    pod: str
    address: str
    container: str
    action: resize_decisions.Action
    limit: int
    request: int | None = None


@dataclasses.dataclass(frozen=True)
class Mark:
    """A worker to recycle: its pod gets ``mark`` as its memops.dev/recycle annotation."""

    pod: str
    mark: Mapping[str, str]
    message: str


@dataclasses.dataclass(frozen=True)
class Decision:
    status: specs.MemoryPolicyStatus
    action: scaling.Action
    desired: int
    scale_up_to: int | None = None
    marks: tuple[Mark, ...] = ()
    create: tuple[objects.Obj, ...] = ()  # RetirementRequests: recycling drains, then a scale-down
    events: tuple[Event, ...] = ()
    recorded: tuple[str, ...] = ()  # recycling drains to annotate as recorded after the status is written
    resizes: tuple[ResizeOrder, ...] = ()
    annotations: Mapping[str, disruption.Patch] = dataclasses.field(default_factory=dict)  # pod -> merge-patch
    steady: bool = False  # nothing to do and nothing that samples memory: the next pass may wait longer
    losses_settled: float | None = None  # the workers' departures up to this time are decided; None: unchanged


@dataclasses.dataclass(frozen=True)
class _Recycle:
    extra: int
    message: str
    marks: tuple[Mark, ...]
    create: tuple[objects.Obj, ...]
    record: specs.RecycleStatus
    holds: tuple[held_back.Hold, ...] = ()


def decide(inputs: Inputs) -> Decision:
    spec, generation, now = inputs.spec, inputs.generation, inputs.now
    observed = policy_findings.observe(inputs.status, inputs.findings, spec.workload, generation=generation, now=now)
    status = observed.status
    running = [r for r in inputs.requests if not objects.is_finished(r)]

    resize = _resize(inputs)
    desired, limited, recommended = _aim(inputs, status, demand_served=serves_demand(resize.record, inputs.now))
    recycle = _recycle(inputs, running, desired) if inputs.recycling is not None else None
    if recycle is not None:
        status.recycle = recycle.record
    status.resize = resize.record
    desired += resize.extra
    failed = _latest_failure(inputs.requests)
    target = desired + (recycle.extra if recycle is not None else 0)
    if _unread_additions(inputs):
        # The scheduler did not answer this pass, so a feature that adds workers read nothing: the
        # count may hold its surge, or the worker added for a failed growth. A scale-down now would
        # undo it (and drain a marked worker as a plain scale-down that the recycling record never
        # shows); the next pass that reaches the scheduler decides.
        target = max(target, inputs.current)
    decision = scaling.plan_scale(
        current=inputs.current,
        desired=target,
        draining=sum(_request_size(r) for r in running),
        last_failure_age=_age(failed.get("status", {}).get("completionTime"), now) if failed else None,
        failed_generation=int(failed["metadata"].get("annotations", {}).get(objects.GENERATION_ANNOTATION, 0))
        if failed
        else None,
        generation=generation,
    )
    create = list(recycle.create) if recycle is not None else []
    events = list(observed.events)
    events += (
        [Event("Normal", "Recycling", f"recycling {m.pod}: {m.message}") for m in recycle.marks] if recycle else []
    )
    holds = _held_back(inputs, decision, failed, recommended, wanted=inputs.current - target)
    holds += recycle.holds if recycle is not None else ()
    if inputs.node_pressure is not None:
        planned = node_pressure.plan(inputs.owner, spec, inputs.node_pressure, inputs.requests, now)
        holds += held_back.node_pressure(planned.held)
        create += planned.requests
        status.nodePressure = node_pressure.status(status.nodePressure, inputs.node_pressure, planned, _render(now))
        events += [
            Event("Warning", node_pressure.EVENT_REASON, str(body["metadata"]["annotations"]["memops.dev/why"]))
            for body in planned.requests
        ]
    elif spec.eviction.nodePressure is None:
        status.nodePressure = None
    events += resize.events
    acting = decision.action in (scaling.Action.SCALE_UP, scaling.Action.SCALE_DOWN)
    moment = round(now, 3)  # as a scale-down request's annotation says it
    if decision.action == scaling.Action.SCALE_DOWN:
        create.append(
            objects.policy_request(
                inputs.owner,
                spec,
                # Named by the policy's generation and attempt: a pass that is repeated after a
                # restart gets 409 for the request it already made, instead of making a second.
                name=f"{inputs.owner.name}-g{generation}-{len(inputs.requests)}",
                count=decision.replicas,
                annotations={
                    objects.GENERATION_ANNOTATION: str(generation),
                    objects.SCALE_EVENT_ANNOTATION: f"{moment}",
                },
            )
        )
    events += _record_late_scale_downs(status, inputs.requests, now)
    events += _record_late_scale_up(inputs, status, desired)
    if acting:
        event = specs.ScaleEvent(time=moment, change=desired - inputs.current)
        status.scaleEvents = _recent_events([*status.scaleEvents, event], now, spec)
        status.lastScaleTime = _render(now)
        status.lastScaleReason = decision.reason
        events.append(Event("Normal", decision.reason, decision.message))

    status.heldBack, said = held_back.status(holds, inputs.status.heldBack, _render(now))
    events += said
    status.replicas = inputs.replicas
    status.desiredReplicas = desired
    status.message = decision.message
    recycling_message = recycle.message if recycle is not None else ""
    if recycling_message and decision.action in (scaling.Action.NONE, scaling.Action.WAIT):
        status.message = recycling_message
    working = decision.action != scaling.Action.NONE or bool(recycling_message)
    status.conditions = _conditions(inputs, status, decision, limited, working)
    return Decision(
        status=status,
        action=decision.action,
        desired=desired,
        scale_up_to=decision.replicas if decision.action == scaling.Action.SCALE_UP else None,
        marks=recycle.marks if recycle is not None else (),
        create=tuple(create),
        events=tuple(events),
        recorded=inputs.recycling.recorded if inputs.recycling is not None else (),
        resizes=resize.orders,
        annotations=_disruption(inputs, status),
        losses_settled=observed.settled,
        # Memory-driven features sample the scheduler on every short pass; a plain policy that is
        # where it should be only watches for drift, and its own spec changes wake it at once.
        steady=decision.action == scaling.Action.NONE
        and not running
        and inputs.usage is not None
        and spec.autoscale is None
        and spec.recycle is None
        and spec.pressure is None
        and spec.replication is None
        and spec.resize is None
        and spec.eviction.nodePressure is None,
    )


def _held_back(
    inputs: Inputs,
    decision: scaling.Decision,
    failed: objects.Obj | None,
    recommended: autoscaling.Recommendation | None,
    *,
    wanted: int,
) -> list[held_back.Hold]:
    """The scale-down's holds (of ``wanted`` workers): the pods of a failed drain while the
    scale-down waits out its cooldown, then the workers that autoscaling keeps
    (:mod:`memops.decisions.held_back`)."""
    holds = []
    if decision.reason == "DrainFailed" and failed is not None:
        age = _age(failed.get("status", {}).get("completionTime"), inputs.now) or 0.0
        retry_at = _render(inputs.now - age + scaling.FAILURE_COOLDOWN_SECONDS)
        holds += held_back.failed_drain(failed, retry_at=retry_at, workers=max(wanted, 1))
    holds += held_back.autoscaled(recommended, current=inputs.current, spec=inputs.spec.autoscale)
    return holds


def _disruption(inputs: Inputs, status: specs.MemoryPolicyStatus) -> dict[str, disruption.Patch]:
    seen = inputs.disruption
    if seen is None:
        return {}
    eviction = inputs.spec.eviction
    return disruption.plan_annotations(
        seen.seen(),
        seen.unique,
        policy=inputs.owner.name,
        enabled=eviction.disruptionAnnotations,
        max_seconds=disruption.bound(eviction, inputs.protection),
        now=inputs.now,
        unreachable_since=_unreachable_since(status.conditions) if seen.unique is None else None,
    )


def _unreachable_since(found: list[specs.Condition]) -> float | None:
    """Since when the scheduler has been out of reach, from ``SchedulerReachable``: its state lives in
    the policy's status, so a restarted operator counts on. None (counted as long ago) when the
    condition does not say."""
    reachable = conditions.get_condition(found, "SchedulerReachable")
    if reachable is None or reachable.status == "True":
        return None
    try:
        return timestamps.parse(reachable.lastTransitionTime).timestamp()
    except ValueError:
        return None


def _unread_additions(inputs: Inputs) -> bool:
    """Whether a feature of the policy that may have added workers (recycling's surge, the worker
    added where a growth fell back to a scale-up) read nothing this pass."""
    spec = inputs.spec
    recycling = spec.recycle is not None and inputs.recycling is None
    growth = spec.resize is not None and inputs.resize_ceiling is not None and inputs.resize is None
    return recycling or growth


@dataclasses.dataclass(frozen=True)
class _Resize:
    extra: int = 0  # one more worker: a growth the kubelet would not grant, and no room on the peers
    orders: tuple[ResizeOrder, ...] = ()
    record: specs.ResizeStatus | None = None
    events: tuple[Event, ...] = ()


_FALLBACKS = {
    resize_decisions.Reason.RESIZE_DEFERRED: "the kubelet deferred its growth",
    resize_decisions.Reason.RESIZE_DEFERRED_TOO_LONG: (
        f"the kubelet deferred its growth for over {resize_decisions.DEFERRED_SECONDS:.0f} s and memops took it back"
    ),
    resize_decisions.Reason.RESIZE_INFEASIBLE: "the kubelet refused its growth as infeasible",
    resize_decisions.Reason.RESIZE_FAILED: "the runtime failed to apply its growth",
    resize_decisions.Reason.AT_MAXIMUM: "it is at resize.maxLimit or the administrator's ceiling",
    resize_decisions.Reason.NODE_FULL: "its node can grant no more memory",
}
"""Why a worker over ``growAbove`` was not grown, for the status and the events."""
_ASKS = (resize_decisions.Action.GROW, resize_decisions.Action.SHRINK)
_TAKEN_BACK = {
    resize_decisions.Reason.RESIZE_INFEASIBLE.value: resize_decisions.Reason.RESIZE_INFEASIBLE,
    resize_decisions.Reason.RESIZE_DEFERRED_TOO_LONG.value: resize_decisions.Reason.RESIZE_DEFERRED_TOO_LONG,
}
"""The kubelet's answers after which memops took a growth back, and does not ask it again at once."""
NOT_ALLOWED_EVENT = "ResizeNotAllowed"


def _resize(inputs: Inputs) -> _Resize:
    """Each worker's memory decided (:func:`memops.decisions.resize_decisions.decide`): the orders for
    the apply, ``status.resize``, the events of what changed, and one more worker where a growth fell
    back to a scale-up (kept while that worker's growth still fails, so that the next pass does not
    drain the worker it just added)."""
    spec, old = inputs.spec.resize, inputs.status.resize
    if spec is None:
        return _Resize()
    if inputs.resize_ceiling is None:
        return _not_allowed(inputs.owner.namespace, old)
    if inputs.resize is None:  # not read this pass (no scheduler): as written last
        return _Resize(record=old)
    settings = resize_decisions.within(spec.settings(), inputs.resize_ceiling)
    before = {w.pod: w for w in (old.workers if old is not None else [])}
    demand = task_demand(inputs.spec, inputs.status)
    decisions = [_decide_one(seen, before.get(seen.pod), settings, inputs.now, demand) for seen in inputs.resize]
    if not any(_telling(w, inputs.now) for w in before.values()):
        # (Dask told a new limit lately: the demand in the status may have been read before that.)
        grown = resize_decisions.for_demand(inputs.resize, decisions, demand, settings)
        if grown is not None:
            decisions[grown[0]] = grown[1]
    entries, orders, events, fallbacks, extra = [], [], [], [], 0
    for seen, decision in zip(inputs.resize, decisions, strict=True):
        held = before.get(seen.pod)
        order = _order(seen, decision)
        if order is not None:
            orders.append(order)
        if _kept_worker(decision, held):
            # The worker added for this one stays while its growth still fails, even though the
            # peers (the new worker among them) now have room: else the next pass would drain it.
            decision = dataclasses.replace(decision, action=resize_decisions.Action.SCALE_UP)
        entry = _entry(seen, decision, held, inputs.now)
        if entry is None:
            continue
        entries.append(entry)
        fallback = _fallback_message(seen.pod, decision)
        if fallback:
            fallbacks.append(fallback)
            extra = max(extra, int(decision.action is resize_decisions.Action.SCALE_UP))
        if entry != before.get(seen.pod):  # new, or changed: said once
            events.extend(_resize_events(entry, fallback))
    asked = sum(1 for o in orders if o.action in _ASKS)
    record = specs.ResizeStatus(
        workers=sorted(entries, key=lambda w: w.pod),
        resized=(old.resized if old is not None else 0) + asked,
        message="; ".join(fallbacks),
    )
    return _Resize(extra=extra, orders=tuple(orders), record=record, events=tuple(events))


def task_demand(spec: specs.MemoryPolicySpec, status: specs.MemoryPolicyStatus) -> int:
    """The largest profiled peak of the tasks that wait because it fits no worker (``spec.tasks``),
    as the last pass read it from the scheduler (``status``); 0: none."""
    tasks = status.tasks if spec.tasks is not None else None
    return tasks.demandBytes if tasks is not None and tasks.demandTasks else 0


def _decide_one(
    seen: resize_decisions.WorkerSeen,
    held: specs.ResizedWorker | None,
    settings: specs.ResizeSettings,
    now: float,
    demand: int,
) -> resize_decisions.Decision:
    """One worker's decision, with what its status line remembers: a growth refused lately is not
    asked again yet, a growth for demand carries its reason until Dask has the limit, and a worker
    keeps the capacity that waiting tasks need."""
    Action, Reason = resize_decisions.Action, resize_decisions.Reason
    decision = resize_decisions.decide(seen.inputs, settings)
    if _refused_lately(decision, held, seen.inputs, settings, now):
        assert held is not None
        decision = resize_decisions.refused_lately(seen.inputs, settings, held.message, _TAKEN_BACK[held.reason])
    demanded = held is not None and held.reason == Reason.TASK_DEMAND.value
    if demanded and decision.action in (Action.WAIT, Action.TELL_DASK):
        decision = dataclasses.replace(decision, reason=Reason.TASK_DEMAND)
    return resize_decisions.keeps_for_demand(seen, decision, demand)


def _telling(line: specs.ResizedWorker, now: float) -> bool:
    """Whether the worker's line says that Dask was told its new limit less than
    :data:`memops.decisions.resize_decisions.DEMAND_SETTLE_SECONDS` ago (a grown worker at rest
    keeps that line for as long as it stays grown)."""
    if line.action != resize_decisions.Action.TELL_DASK.value:
        return False
    age = _line_age(line.time, now)
    return age is not None and age < resize_decisions.DEMAND_SETTLE_SECONDS


def serves_demand(record: specs.ResizeStatus | None, now: float) -> bool:
    """Whether a growth in place for task admission's demand is under way (asked, applying, or Dask
    told lately): then no worker is added for that demand, and ``status.tasks`` says Resize."""
    Action = resize_decisions.Action
    return record is not None and any(
        w.reason == resize_decisions.Reason.TASK_DEMAND.value
        and (w.action in (Action.GROW.value, Action.WAIT.value) or _telling(w, now))
        for w in record.workers
    )


def _not_allowed(namespace: str, old: specs.ResizeStatus | None) -> _Resize:
    """Growth in a namespace the administrator did not list: nothing is asked of ``pods/resize`` or
    of Dask, whatever the policy says; the status says why, and an event says it once."""
    message = (
        f"in-place growth is not allowed in namespace {namespace}: the operator's administrator has not"
        " listed it (memops run --resize-in, the chart's resize.namespaces)"
    )
    record = specs.ResizeStatus(resized=old.resized if old is not None else 0, message=message)
    said = old is not None and old.message == message
    return _Resize(record=record, events=() if said else (Event("Warning", NOT_ALLOWED_EVENT, message),))


def _refused_lately(
    decision: resize_decisions.Decision,
    held: specs.ResizedWorker | None,
    inputs: resize_decisions.Inputs,
    settings: specs.ResizeSettings,
    now: float,
) -> bool:
    """A growth asked again soon after memops took it back: within ``cooldown`` of the kubelet
    refusing it as infeasible (it would be refused again, ask after ask), or within
    :data:`memops.decisions.resize_decisions.DEFERRED_RETRY_SECONDS` (or ``cooldown``, if longer)
    of its being deferred too long (it would hold the node's memory again). Counted from the pod's
    stamp (the ask taken back stamped it) or from when the status' line began, whichever is later:
    the pod's owner may rewrite the stamp, not the policy's status."""
    if decision.action is not resize_decisions.Action.GROW or held is None or held.reason not in _TAKEN_BACK:
        return False
    hold = settings.cooldown
    if held.reason == resize_decisions.Reason.RESIZE_DEFERRED_TOO_LONG.value:
        hold = max(hold, resize_decisions.DEFERRED_RETRY_SECONDS)
    since = [s for s in (inputs.seconds_since_resize, _line_age(held.time, now)) if s is not None]
    return any(s < hold for s in since)


def _line_age(text: str, now: float) -> float | None:
    """Seconds since a status line began; None when it does not say (or not readably)."""
    try:
        return _age(text, now)
    except ValueError:
        return None


def _kept_worker(decision: resize_decisions.Decision, held: specs.ResizedWorker | None) -> bool:
    """A fallback to relief for a worker whose growth fell back to one more worker before."""
    Action = resize_decisions.Action
    fell_back = decision.reason in _FALLBACKS and decision.action is Action.RELIEVE
    return fell_back and held is not None and held.action == Action.SCALE_UP.value


def _order(seen: resize_decisions.WorkerSeen, decision: resize_decisions.Decision) -> ResizeOrder | None:
    """What the apply does for one worker's decision; None: nothing."""
    Action = resize_decisions.Action
    container = seen.inputs.container
    if decision.action in (Action.GROW, Action.SHRINK, Action.TELL_DASK) and decision.limit is not None:
        return ResizeOrder(seen.pod, seen.address, seen.container, decision.action, decision.limit, decision.request)
    # An ask taken back: the limit, and the request the node had admitted before it.
    revert = decision.limit if decision.action is Action.REVERT else decision.revert_to
    if revert is not None:
        return ResizeOrder(seen.pod, seen.address, seen.container, Action.REVERT, revert, container.allocated)
    return None


def _entry(
    seen: resize_decisions.WorkerSeen,
    decision: resize_decisions.Decision,
    before: specs.ResizedWorker | None,
    now: float,
) -> specs.ResizedWorker | None:
    """The worker's line in ``status.resize.workers``: what was decided, unless nothing; a grown
    worker at rest keeps its last line for as long as its limit stays above its template's."""
    Action, Reason = resize_decisions.Action, resize_decisions.Reason
    applied = seen.inputs.container.applied_limit
    taken_back = decision.action is Action.NONE and decision.revert_to is not None  # and nothing else
    quiet = (decision.action is Action.NONE and not taken_back) or decision.reason is Reason.PEERS_HAVE_ROOM
    if quiet:
        grown = applied is not None and applied > seen.inputs.baseline_limit
        return before if grown else None
    limit = decision.limit if decision.limit is not None else applied
    entry = specs.ResizedWorker(
        pod=seen.pod,
        action=Action.REVERT.value if taken_back else decision.action.value,
        reason=decision.reason.value,
        limit=resize_decisions.to_quantity(limit) if limit is not None else "",
        message=decision.message,
        time=_render(now),
    )
    if before is not None and before.model_copy(update={"time": entry.time}) == entry:
        return before  # the same as last pass: its time stays when it started
    return entry


def _fallback_message(pod: str, decision: resize_decisions.Decision) -> str:
    """ "w-1: the kubelet deferred its growth (...): relieved by its peers", or "" when no fallback
    (nor an ask taken back)."""
    Action = resize_decisions.Action
    why = _FALLBACKS.get(decision.reason)
    then = {Action.RELIEVE: "relieved by its peers", Action.SCALE_UP: "one more worker"}.get(decision.action)
    if decision.action is Action.NONE and decision.revert_to is not None:  # the worker needs no more
        said = decision.reason is resize_decisions.Reason.RESIZE_DEFERRED_TOO_LONG  # "took it back" already
        then = "no more needed" if said else "taken back"
    if why is None or then is None:
        return ""
    detail = f" ({decision.message})" if decision.message else ""
    return f"{pod}: {why}{detail}: {then}"


def _resize_events(entry: specs.ResizedWorker, fallback: str) -> list[Event]:
    Action = resize_decisions.Action
    if fallback:
        return [Event("Warning", entry.reason, fallback)]
    said = {Action.GROW: ("Grow", "grows to"), Action.SHRINK: ("Shrink", "shrinks to")}
    if entry.action in said:
        reason, verb = said[Action(entry.action)]
        return [Event("Normal", reason, f"{entry.pod} {verb} {entry.limit} ({entry.reason})")]
    return []


def _aim(
    inputs: Inputs, status: specs.MemoryPolicyStatus, *, demand_served: bool = False
) -> tuple[int, str, autoscaling.Recommendation | None]:
    """The count to steer towards, what limited it ("" if nothing did), and autoscaling's
    recommendation (None without it). Updates the autoscaler's recommendation history in ``status``.
    ``demand_served``: a worker grows in place for task admission's demand, so none is added for it."""
    spec = inputs.spec
    desired = spec.replicas if spec.replicas is not None else inputs.current
    if spec.autoscale is None or inputs.usage is None:
        return desired, "", None
    recommended = autoscaling.desired_replicas(
        current=inputs.current,
        usage=inputs.usage,
        spec=spec.autoscale,
        history=status.recommendations,
        events=status.scaleEvents,
        now=inputs.now,
    )
    status.recommendations = _remember(status.recommendations, inputs.now, recommended.raw, spec.autoscale)
    limited = recommended.reason if recommended.limits else ""
    starved = len(status.pressure.starved) if status.pressure is not None else 0
    desired, relief_reason = autoscaling.with_relief(recommended.replicas, inputs.connected, starved, spec.autoscale)
    # As the last pass read them from the scheduler.
    tasks = status.tasks if spec.tasks is not None and not demand_served else None
    desired, demand_reason = autoscaling.with_task_demand(
        desired, inputs.connected, tasks, inputs.usage, spec.autoscale
    )
    return desired, demand_reason or relief_reason or limited, recommended


def _recycle(inputs: Inputs, running: Sequence[objects.Obj], desired: int) -> _Recycle:
    """Which workers to mark for recycling, which marked ones to drain now, and how many to surge."""
    seen, spec, now = inputs.recycling, inputs.spec.recycle, inputs.now
    assert seen is not None and spec is not None
    mine = [r for r in inputs.requests if _labels(r).get(objects.PURPOSE_LABEL) == "recycle"]
    marked: dict[str, Mapping[str, Any]] = {p.name: p.mark for p in seen.pods if p.mark is not None}
    marks: list[Mark] = []
    verdicts = [
        verdict
        for pod in seen.pods
        if pod.name not in marked
        and (verdict := recycle_decisions.detect(pod.name, seen.samples.get(pod.name, []), spec, now, pod.age))
    ]
    chosen: list[recycle_decisions.Verdict] | None = None
    # A scale-down of the policy is draining: no new recycling starts meanwhile.
    if not any(_labels(r).get(objects.PURPOSE_LABEL) != "recycle" for r in running):
        chosen = recycle_decisions.plan_recycle(
            verdicts, recycling=len(marked), max_unavailable=spec.maxUnavailable, in_shuffle=seen.shuffling
        )
        for verdict in chosen:
            mark = {"reason": verdict.reason, "message": verdict.message, "startTime": _render(now)}
            marks.append(Mark(verdict.pod, mark, verdict.message))
            marked[verdict.pod] = mark
    holds = held_back.recycling(
        verdicts,
        chosen=None if chosen is None else {v.pod for v in chosen},
        shuffling=seen.shuffling,
        max_unavailable=spec.maxUnavailable,
    )
    requested = {_recycled_pod(r): str(r["metadata"]["name"]) for r in mine if not objects.is_finished(r)}
    attempts = collections.Counter(_recycled_pod(r) for r in mine)
    connected = len([p for p in seen.pods if p.name in seen.connected - set(marked)])
    plan = recycle_decisions.plan_replacement(
        marked=sorted(marked), requested=requested, connected_unmarked=connected, desired=desired, surge=spec.surge
    )
    holds += held_back.awaiting_replacements(marked, plan.waiting, connected=connected, desired=desired)
    create = []
    for pod in plan.drain:
        requested[pod] = recycle_request_name(inputs.owner.name, pod, attempts[pod])
        create.append(
            objects.policy_request(
                inputs.owner,
                inputs.spec,
                name=requested[pod],
                workers=(pod,),
                labels={objects.PURPOSE_LABEL: "recycle"},
                annotations={objects.RECYCLE_ANNOTATION: json.dumps(marked[pod]), objects.POD_ANNOTATION: pod},
            )
        )
    record = seen.record.model_copy(deep=True)
    record.recycling = [
        specs.Recycling(
            pod=pod,
            reason=str(mark.get("reason", "")),
            message=str(mark.get("message", "")),
            startTime=str(mark.get("startTime", "")),
            request=requested.get(pod, ""),
        )
        for pod, mark in sorted(marked.items())
    ]
    return _Recycle(
        extra=plan.extra,
        message=plan.message,
        marks=tuple(marks),
        create=tuple(create),
        record=record,
        holds=tuple(holds),
    )


def _conditions(
    inputs: Inputs, status: specs.MemoryPolicyStatus, decision: scaling.Decision, limited: str, working: bool
) -> list[specs.Condition]:
    """The policy's conditions, from the pass' final state."""
    generation, workload, found = inputs.generation, inputs.spec.workload, status.conditions
    direct = inputs.autoscalers
    found = conditions.set_condition(
        found,
        "Conflict",
        bool(direct),
        reason="AutoscalerOnWorkload" if direct else "NoConflict",
        message=(
            f"HorizontalPodAutoscaler {', '.join(direct)} scales {workload.kind} {workload.name!r}"
            f" directly, so its scale-downs are not drained: point its scaleTargetRef at MemoryPolicy"
            f" {inputs.owner.name!r} instead"
        )
        if direct
        else "",
        generation=generation,
    )
    found = conditions.set_condition(
        found,
        "ScalingActive",
        decision.action != scaling.Action.NONE,
        reason=decision.reason,
        message=decision.message,
        generation=generation,
    )
    drain_failed = decision.reason == "DrainFailed"
    limited = decision.message if drain_failed else limited
    found = conditions.set_condition(
        found,
        "ScalingLimited",
        bool(limited),
        reason=decision.reason if drain_failed else ("Limited" if limited else "NotLimited"),
        message=limited,
        generation=generation,
    )
    found = _shared_spill_conditions(inputs, found)
    unreachable = conditions.get_condition(found, "SchedulerReachable")
    if unreachable is not None and unreachable.status == "False":
        # Without the scheduler no scale-down can drain and no memory is known: not Ready.
        found = conditions.with_kstatus(found, generation=generation, stalled=(unreachable.reason, unreachable.message))
        return conditions.set_condition(
            found, "Ready", False, reason=unreachable.reason, message=unreachable.message, generation=generation
        )
    found = conditions.with_kstatus(
        found, generation=generation, reconciling=(decision.reason, status.message) if working else None
    )
    return conditions.set_condition(
        found,
        "Ready",
        True,
        reason="Managing",
        message=f"managing {workload.kind} {workload.name!r}",
        generation=generation,
    )


def _shared_spill_conditions(inputs: Inputs, found: list[specs.Condition]) -> list[specs.Condition]:
    """``SharedSpillReady`` (whether the webhook injects the spill: the same verdict as it reaches
    on each pod) and, for medium Node, ``SharedSpillSwappable``; gone when the spec has no spill."""
    spill = inputs.spec.sharedSpill
    verdict = (
        shared_spill.condition(spill, inputs.template, host_roots=inputs.host_roots) if spill is not None else None
    )
    for type_ in shared_spill.CONDITIONS:
        value = None if verdict is None else (verdict.ready if type_ == shared_spill.READY else verdict.swappable)
        if value is None:
            found = [c for c in found if c.type != type_]
        else:
            status, reason, message = value
            found = conditions.set_condition(
                found, type_, status, reason=reason, message=message, generation=inputs.generation
            )
    return found


def recycle_request_name(policy: str, pod: str, attempt: int) -> str:
    # One name per worker and attempt: a pass repeated after a restart gets 409, not a second request.
    # Cut to an object name's 253 characters from the left; a name starts with a letter or digit.
    return f"{policy}-recycle-{pod}-{attempt}"[-253:].lstrip("-.")


def _labels(request: objects.Obj) -> Mapping[str, str]:
    return request["metadata"].get("labels") or {}


def _recycled_pod(request: objects.Obj) -> str:
    return str((request["metadata"].get("annotations") or {}).get(objects.POD_ANNOTATION, ""))


def _render(unix: float) -> str:
    return timestamps.render(datetime.datetime.fromtimestamp(unix, tz=datetime.UTC))


def _age(text: str | None, now: float) -> float | None:
    return now - timestamps.parse(text).timestamp() if text else None


def _remember(
    history: list[specs.Recommendation], now: float, replicas: int, spec: specs.AutoscaleSpec
) -> list[specs.Recommendation]:
    """Keep, for each recommended count, only when it was last recommended within the windows:
    that is all the stabilization (a min and a max over a window) needs."""
    window = max(spec.behavior.scaleUp.stabilizationWindowSeconds, spec.behavior.scaleDown.stabilizationWindowSeconds)
    kept = [r for r in history if r.replicas != replicas and r.time > now - window]
    return [*kept, specs.Recommendation(time=now, replicas=replicas)]


def _record_late_scale_downs(
    status: specs.MemoryPolicyStatus, requests: Sequence[objects.Obj], now: float
) -> list[Event]:
    """The scale-downs whose requests exist but whose events the status does not hold (the pass that
    made them could not write its status): into ``status`` now, and said. Recorded are the events up
    to the latest in ``scaleEvents``, or to the second after ``lastScaleTime`` (which is written to
    the second) once they have aged out of the list. A time that no pass could have written (not a
    number, in the future) is not memops' and records nothing."""
    last = timestamps.parse_or_none(status.lastScaleTime)
    seen = [e.time for e in status.scaleEvents] + ([last.timestamp() + 1] if last is not None else [])
    recorded = max(seen, default=0.0)
    late = []
    for request in requests:
        said = (request.get("metadata", {}).get("annotations") or {}).get(objects.SCALE_EVENT_ANNOTATION)
        try:
            moment = float(said) if isinstance(said, str) else 0.0
        except ValueError:
            continue
        if recorded < moment <= now:  # also false for nan
            late.append((moment, int(request.get("spec", {}).get("count") or 1), str(request["metadata"]["name"])))
    events = []
    for moment, count, name in sorted(late):
        status.scaleEvents = [*status.scaleEvents, specs.ScaleEvent(time=moment, change=-count)]
        status.lastScaleTime, status.lastScaleReason = _render(moment), "ScaleDown"
        events.append(Event("Normal", "ScaleDown", f"scaling down: draining {count} workers ({name})"))
    return events


def _record_late_scale_up(inputs: Inputs, status: specs.MemoryPolicyStatus, desired: int) -> list[Event]:
    """A scale-up that the status does not hold (the pass that raised the replicas could not write
    its status): the workload has more workers than the status last desired, and no more than this
    pass desires. Only where memops decides the count (``spec.replicas`` or ``spec.autoscale``):
    an adopted count follows the workload's, and a count over the desired one is scaled back down.
    Recorded now, the moment the pass finds it."""
    spec, before, current = inputs.spec, inputs.status.desiredReplicas, inputs.current
    if (spec.replicas is None and spec.autoscale is None) or not 0 < before < current <= desired:
        return []
    event = specs.ScaleEvent(time=round(inputs.now, 3), change=current - before)
    status.scaleEvents = _recent_events([*status.scaleEvents, event], inputs.now, spec)
    status.lastScaleTime, status.lastScaleReason = _render(inputs.now), "ScaleUp"
    return [Event("Normal", "ScaleUp", f"scaled up from {before} to {current} (the status did not hold it yet)")]


def _recent_events(events: list[specs.ScaleEvent], now: float, spec: specs.MemoryPolicySpec) -> list[specs.ScaleEvent]:
    rules = spec.autoscale.behavior if spec.autoscale is not None else specs.Behavior()
    period = max((p.periodSeconds for r in (rules.scaleUp, rules.scaleDown) for p in r.policies), default=0)
    return [e for e in events if e.time > now - period]


def _request_size(request: objects.Obj) -> int:
    workers = request.get("status", {}).get("workers")
    return len(workers) if workers else int(request.get("spec", {}).get("count") or 1)


def _latest_failure(requests: Sequence[objects.Obj]) -> objects.Obj | None:
    finished = sorted(
        (r for r in requests if objects.is_finished(r)),
        key=lambda r: r.get("status", {}).get("completionTime", ""),
    )
    return finished[-1] if finished and finished[-1]["status"]["phase"] == specs.Phase.FAILED.value else None
