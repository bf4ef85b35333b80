"""What a MemoryPolicy's pass found, turned into its status and events: whether the scheduler was
reached, the workers' memory, the preStop hooks that failed and what the preStop drains lost, and
the workers lost on their own.

Pure, like :mod:`memops.decisions.policy_decisions`, which applies :func:`observe` first: the
read (:class:`memops.controllers.policy.Policy`) gathers :class:`Findings` and sets no field of the
status itself, so that every condition, event and loss comes out of one decision.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from memops import specs
from memops.decisions import conditions, objects, safetynet, worker_loss_decisions


@dataclasses.dataclass(frozen=True)
class SchedulerSeen:
    """How the pass reached the scheduler: ``Connected``, or the reason it could not."""

    reason: str = "Connected"
    message: str = ""
    foreign: bool = False  # not shown to be the namespace's: nothing is read from it or kept about it

    @property
    def reachable(self) -> bool:
        return self.reason == "Connected"


def scheduler_reachable(found: list[specs.Condition], seen: SchedulerSeen, generation: int) -> list[specs.Condition]:
    """The ``SchedulerReachable`` condition, from what the pass saw."""
    return conditions.set_condition(
        found, "SchedulerReachable", seen.reachable, reason=seen.reason, message=seen.message, generation=generation
    )


@dataclasses.dataclass(frozen=True)
class Departures:
    """The workers that left on their own and may be new to the status, with what tells whose they were."""

    pending: tuple[worker_loss_decisions.Departure, ...]  # worker_loss_decisions.pending of the agent's records
    pods: tuple[Mapping[str, Any], ...]  # the workload's pods (listed only when ``pending`` is not empty)
    since: float  # the records before this were decided by an earlier pass
    known: Mapping[str, str] = dataclasses.field(default_factory=dict)  # worker address -> pod, from tenancy checks


@dataclasses.dataclass(frozen=True)
class Findings:
    """What the read found beyond the status as written last; a None field was not read this pass."""

    selector: str | None = None  # the workload's pods' label selector (status.selector, for the scale subresource)
    scheduler: SchedulerSeen | None = None  # None: the pass did not try to reach it
    memory: specs.MemoryStatus | None = None  # the workers' memory, when the scheduler was reached
    # The agent's drain_status (hostile input), when the scheduler was reached and runs memops' agent.
    drains: Mapping[str, Any] | None = None
    hook_events: tuple[Mapping[str, Any], ...] | None = None  # the namespace's FailedPreStopHook events
    departures: Departures | None = None


@dataclasses.dataclass(frozen=True)
class Observed:
    """The status with the findings in it, the Warning events of what is new, and the time up to
    which the workers' departures are decided (None: unchanged)."""

    status: specs.MemoryPolicyStatus
    events: tuple[objects.Event, ...] = ()
    settled: float | None = None


def observe(
    status: specs.MemoryPolicyStatus,
    findings: Findings,
    workload: specs.WorkloadRef,
    *,
    generation: int,
    now: float,
) -> Observed:
    """``status`` (not changed) with what the pass of ``generation`` found: ``selector``,
    ``SchedulerReachable``, ``memory`` (none kept from a scheduler that is not the namespace's),
    ``safetyNet`` and ``workerLosses``."""
    status = status.model_copy(deep=True, update={"observedGeneration": generation})
    if findings.selector is not None:
        status.selector = findings.selector
    seen = findings.scheduler
    if seen is not None:
        status.conditions = scheduler_reachable(status.conditions, seen, generation)
        if seen.foreign:
            status.memory = None
        elif findings.memory is not None:
            status.memory = findings.memory
    events: list[objects.Event] = []
    if findings.hook_events is not None:
        status.safetyNet, posted = _failed_hooks(status.safetyNet, findings.hook_events, workload)
        events += posted
    if findings.drains is not None:
        status.safetyNet = _hook_losses(status.safetyNet, findings.drains, workload)
    settled = None
    if findings.departures is not None:
        losses = _worker_losses(status.workerLosses, findings.departures, workload, now)
        status.workerLosses, settled = losses.losses, losses.settled
        events += (objects.Event("Warning", worker_loss_decisions.EVENT_REASON, text) for text in losses.messages)
    return Observed(status, tuple(events), settled)


def _failed_hooks(
    current: specs.SafetyNetStatus | None, events: Sequence[Mapping[str, Any]], workload: specs.WorkloadRef
) -> tuple[specs.SafetyNetStatus | None, list[objects.Event]]:
    """The workload's pods that left with a failed preStop hook, from the kubelet's events; each
    one new to the status is a Warning: such a pod was removed without the safety net's drain."""
    previous = current.failedHooks if current is not None else []
    hooks = safetynet.failed_hooks(events, workload, previous)
    posted = [
        objects.Event(
            "Warning",
            safetynet.FAILED_PRE_STOP_HOOK,
            f"pod {hook.pod} left with a failed preStop hook at {hook.time}: the safety net did"
            " not drain it, and data held only there may be lost",
        )
        for hook in hooks
        if hook not in previous
    ]
    if not hooks:
        return current, posted
    return (current or specs.SafetyNetStatus()).model_copy(update={"failedHooks": hooks}), posted


def _hook_losses(
    current: specs.SafetyNetStatus | None, drains: Mapping[str, Any], workload: specs.WorkloadRef
) -> specs.SafetyNetStatus | None:
    """``current`` with the latest losses of the workload's preStop drains."""
    previous = current.lostAtDeadline if current is not None else []
    losses = safetynet.hook_losses(drains, workload, previous)
    if losses == previous:
        return current
    return (current or specs.SafetyNetStatus()).model_copy(update={"lostAtDeadline": losses})


def _worker_losses(
    current: list[specs.WorkerLoss], departures: Departures, workload: specs.WorkloadRef, now: float
) -> worker_loss_decisions.Decision:
    if not departures.pending:
        return worker_loss_decisions.Decision(list(current), [], [], departures.since)
    return worker_loss_decisions.decide(
        departures.pending,
        departures.pods,
        workload,
        current,
        now=now,
        since=departures.since,
        known=departures.known,
    )
