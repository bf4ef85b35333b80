"""What a policy's pass found, into its status and events (:mod:`memops.decisions.policy_findings`),
and through :func:`memops.decisions.policy_decisions.decide`, which applies them first."""

from __future__ import annotations

from typing import Any

import pytest

from memops import specs
from memops.decisions import conditions, policy_decisions, policy_findings, worker_loss_decisions
from tests.unit.policy_inputs import pass_inputs, policy_spec
from tests.unit.test_safetynet import drain, hook_event
from tests.unit.test_worker_loss_decisions import T0, pod, record, terminated

DEPLOYMENT = specs.WorkloadRef(kind=specs.WorkloadKind.DEPLOYMENT, name="dask-worker")
MEMORY = specs.MemoryStatus(bytes=2**30, limitBytes=2**32, percent=25)
UNREACHABLE = policy_findings.SchedulerSeen("SchedulerUnreachable", "spec.scheduler.address: refused")
FOREIGN = policy_findings.SchedulerSeen("ForeignScheduler", "spec.scheduler.address: not ours", foreign=True)


def observe(findings: policy_findings.Findings, status: specs.MemoryPolicyStatus | None = None) -> Any:
    before = status or specs.MemoryPolicyStatus()
    observed = policy_findings.observe(before, findings, DEPLOYMENT, generation=2, now=T0 + 60)
    assert before == (status or specs.MemoryPolicyStatus()), "the status as read is not changed"
    return observed


def reachable(observed: policy_findings.Observed) -> tuple[str, str] | None:
    found = conditions.get_condition(observed.status.conditions, "SchedulerReachable")
    return (found.status, found.reason) if found is not None else None


@pytest.mark.parametrize(
    ("seen", "memory", "expected_memory", "condition"),
    [
        pytest.param(policy_findings.SchedulerSeen(), MEMORY, MEMORY, ("True", "Connected"), id="connected"),
        pytest.param(UNREACHABLE, None, "old", ("False", "SchedulerUnreachable"), id="unreachable-keeps-the-last"),
        pytest.param(FOREIGN, None, None, ("False", "ForeignScheduler"), id="foreign-keeps-nothing"),
        pytest.param(None, None, "old", None, id="not-tried"),
    ],
)
def test_the_scheduler_and_its_memory(
    seen: policy_findings.SchedulerSeen | None,
    memory: specs.MemoryStatus | None,
    expected_memory: Any,
    condition: tuple[str, str] | None,
) -> None:
    old = specs.MemoryStatus(bytes=2**31, limitBytes=2**32, percent=50)
    observed = observe(policy_findings.Findings(scheduler=seen, memory=memory), specs.MemoryPolicyStatus(memory=old))
    assert observed.status.memory == (old if expected_memory == "old" else expected_memory)
    assert reachable(observed) == condition
    assert observed.events == () and observed.settled is None


def test_a_failed_hook_is_listed_and_said_once() -> None:
    events = (hook_event("dask-worker-a1-bbbbb", "T1"), hook_event("other-a1-bbbbb", "T1"))
    first = observe(policy_findings.Findings(hook_events=events))
    assert first.status.safetyNet is not None
    assert [h.pod for h in first.status.safetyNet.failedHooks] == ["dask-worker-a1-bbbbb"]
    assert [(e.type, e.reason) for e in first.events] == [("Warning", "FailedPreStopHook")]
    assert "dask-worker-a1-bbbbb" in first.events[0].message
    again = observe(policy_findings.Findings(hook_events=events), first.status)
    assert again.status == first.status and again.events == ()
    # A pass that does not read the events keeps what the status lists.
    assert observe(policy_findings.Findings(), first.status).status == first.status


def test_what_a_prestop_drain_lost_is_recorded() -> None:
    drains = {"tcp://10.0.0.1:1": drain("dask-worker-5d9c7-abcde"), "tcp://10.0.0.2:1": drain("other-5d9c7-x")}
    observed = observe(policy_findings.Findings(drains=drains))
    assert observed.status.safetyNet is not None
    assert [loss.pod for loss in observed.status.safetyNet.lostAtDeadline] == ["dask-worker-5d9c7-abcde"]
    assert observe(policy_findings.Findings(drains=drains), observed.status).status == observed.status


def test_a_worker_lost_is_recorded_said_once_and_settles() -> None:
    pending = tuple(worker_loss_decisions.pending(worker_loss_decisions.parse([record()]), since=0.0))
    pods = (pod(last=terminated("OOMKilled", T0 + 1), restarts=2),)
    observed = observe(policy_findings.Findings(departures=policy_findings.Departures(pending, pods, since=0.0)))
    assert [(w.pod, w.reason) for w in observed.status.workerLosses] == [("dask-worker-6d9f8-abcde", "OOMKilled")]
    assert [e.reason for e in observed.events] == [worker_loss_decisions.EVENT_REASON]
    assert observed.settled is not None and observed.settled >= T0
    again = observe(
        policy_findings.Findings(departures=policy_findings.Departures(pending, pods, since=0.0)), observed.status
    )
    assert again.status.workerLosses == observed.status.workerLosses and again.events == ()
    # Nothing pending: the status as it was, settled where it was.
    idle = observe(policy_findings.Findings(departures=policy_findings.Departures((), (), since=T0)), observed.status)
    assert idle.status == observed.status and idle.settled == T0


def test_the_pass_decides_from_its_findings() -> None:
    """The read sets no condition and posts no event itself: the decision does both."""
    events = (hook_event("dask-worker-a1-bbbbb", "T1"),)
    findings = policy_findings.Findings(scheduler=UNREACHABLE, hook_events=events)
    spec = policy_spec(replicas=4, workload={"kind": "Deployment", "name": "dask-worker"})
    decision = policy_decisions.decide(pass_inputs(spec, usage=None, connected=0, findings=findings))
    found = {c.type: (c.status, c.reason) for c in decision.status.conditions}
    assert found["SchedulerReachable"] == ("False", "SchedulerUnreachable")
    assert found["Ready"][0] == "False", "without the scheduler no scale-down can drain"
    assert ("Warning", "FailedPreStopHook") in [(e.type, e.reason) for e in decision.events]


def test_the_selector_and_the_generation_observed() -> None:
    old = specs.MemoryPolicyStatus(selector="app=old", observedGeneration=1)
    assert (observe(policy_findings.Findings(selector="app=w"), old).status.selector) == "app=w"
    kept = observe(policy_findings.Findings(), old).status
    assert (kept.selector, kept.observedGeneration) == ("app=old", 2)
