"""One MemoryPolicy pass, decided: the actions, the status fields and the conditions, from what the pass read."""

from __future__ import annotations

from typing import Any

import pytest

from memops import specs
from memops.decisions import autoscaling, conditions, objects, policy_decisions, policy_findings, scaling
from tests.unit.policy_inputs import GIB, NOW, ago, pass_inputs, policy_spec, reachable


def _request(name: str, phase: str | None, *, generation: int = 3, count: int = 1, **labels: str) -> objects.Obj:
    status: dict[str, Any] = {"phase": phase, "completionTime": ago(10)} if phase else {}
    return {
        "metadata": {
            "name": name,
            "labels": {objects.POLICY_LABEL: "p", **labels},
            "annotations": {objects.GENERATION_ANNOTATION: str(generation)},
        },
        "spec": {"count": count},
        "status": status,
    }


def _condition(decision: policy_decisions.Decision, type_: str) -> tuple[str, str]:
    found = conditions.get_condition(decision.status.conditions, type_)
    assert found is not None, type_
    return found.status, found.reason


@pytest.mark.parametrize(
    ("inputs", "action", "desired", "active", "limited", "ready"),
    [
        pytest.param(
            pass_inputs(policy_spec(replicas=4)),
            scaling.Action.NONE,
            4,
            ("False", "Steady"),
            ("False", "NotLimited"),
            ("True", "Managing"),
            id="steady",
        ),
        pytest.param(
            pass_inputs(policy_spec(replicas=6)),
            scaling.Action.SCALE_UP,
            6,
            ("True", "ScaleUp"),
            ("False", "NotLimited"),
            ("True", "Managing"),
            id="scale-up",
        ),
        pytest.param(
            pass_inputs(policy_spec(replicas=2)),
            scaling.Action.SCALE_DOWN,
            2,
            ("True", "ScaleDown"),
            ("False", "NotLimited"),
            ("True", "Managing"),
            id="scale-down",
        ),
        pytest.param(
            pass_inputs(policy_spec(replicas=2), requests=(_request("p-g3-0", None, count=2),)),
            scaling.Action.WAIT,
            2,
            ("True", "Draining"),
            ("False", "NotLimited"),
            ("True", "Managing"),
            id="one-drain-at-a-time",
        ),
        pytest.param(
            pass_inputs(policy_spec(replicas=2), requests=(_request("p-g3-0", "Failed"),)),
            scaling.Action.WAIT,
            2,
            ("True", "DrainFailed"),
            ("True", "DrainFailed"),
            ("True", "Managing"),
            id="failed-drain-limits",
        ),
        pytest.param(
            pass_inputs(policy_spec(replicas=2), requests=(_request("p-g2-0", "Failed", generation=2),)),
            scaling.Action.SCALE_DOWN,
            2,
            ("True", "ScaleDown"),
            ("False", "NotLimited"),
            ("True", "Managing"),
            id="spec-changed-since-the-failure",
        ),
        pytest.param(
            # 90% of the limit with a 50% target asks for 8 workers; maxReplicas caps it at 5.
            pass_inputs(
                policy_spec(autoscale={"maxReplicas": 5, "targetMemoryUtilization": 50}),
                usage=autoscaling.Usage(workers=4, held=int(7.2 * GIB), limit=8 * GIB),
            ),
            scaling.Action.SCALE_UP,
            5,
            ("True", "ScaleUp"),
            ("True", "Limited"),
            ("True", "Managing"),
            id="autoscale-capped-by-max",
        ),
        pytest.param(
            pass_inputs(policy_spec(autoscale={"maxReplicas": 8, "targetMemoryUtilization": 50})),
            scaling.Action.NONE,
            4,
            ("False", "Steady"),
            ("False", "NotLimited"),
            ("True", "Managing"),
            id="autoscale-at-target",
        ),
        pytest.param(
            pass_inputs(policy_spec(replicas=2), status=reachable(False), usage=None),
            scaling.Action.SCALE_DOWN,
            2,
            ("True", "ScaleDown"),
            ("False", "NotLimited"),
            ("False", "SchedulerUnreachable"),
            id="scheduler-unreachable-is-not-ready",
        ),
    ],
)
def test_decide(
    inputs: policy_decisions.Inputs,
    action: scaling.Action,
    desired: int,
    active: tuple[str, str],
    limited: tuple[str, str],
    ready: tuple[str, str],
) -> None:
    decision = policy_decisions.decide(inputs)
    assert (decision.action, decision.desired, decision.status.desiredReplicas) == (action, desired, desired)
    assert _condition(decision, "ScalingActive") == active
    assert _condition(decision, "ScalingLimited") == limited
    assert _condition(decision, "Ready") == ready
    assert decision.scale_up_to == (desired if action == scaling.Action.SCALE_UP else None)
    scale_downs = [r for r in decision.create if "count" in r["spec"]]
    assert [r["spec"]["count"] for r in scale_downs] == ([inputs.current - desired] if action == "ScaleDown" else [])
    acted = action in (scaling.Action.SCALE_UP, scaling.Action.SCALE_DOWN)
    # What a hold says (status.heldBack and its events) is tested in test_held_back.py.
    said = [e.reason for e in decision.events if e.reason not in set(specs.HeldBackRule)]
    assert said == ([active[1]] if acted else [])
    assert bool(decision.status.lastScaleReason) == acted


def test_a_scale_down_request_is_owned_named_and_labelled_by_the_policy() -> None:
    spec = policy_spec(replicas=1, drain={"timeout": "5m", "onTimeout": "Force"})
    decision = policy_decisions.decide(pass_inputs(spec, current=3, requests=(_request("p-g2-0", "Succeeded"),)))
    [request] = decision.create
    assert request["metadata"]["name"] == "p-g3-1"  # generation 3, the policy's second request
    assert request["metadata"]["labels"] == {objects.POLICY_LABEL: "p"}
    assert request["metadata"]["annotations"] == {
        objects.GENERATION_ANNOTATION: "3",
        objects.SCALE_EVENT_ANNOTATION: str(round(NOW, 3)),  # the scale event it is
    }
    assert decision.status.scaleEvents == [specs.ScaleEvent(time=round(NOW, 3), change=-2)]
    [owner] = request["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == ("MemoryPolicy", "p", "u-1", True)
    assert request["spec"] == {
        "scheduler": {"address": "tcp://s:8786"},
        "workload": {"kind": "Deployment", "name": "w"},
        "count": 2,
        "timeout": "5m",
        "onTimeout": "Force",
    }


def _made(moment: str, *, count: int = 2, phase: str | None = None) -> objects.Obj:
    """A scale-down request of the policy, as a pass made it at ``moment``."""
    request = _request("p-g3-0", phase, count=count)
    request["metadata"]["annotations"][objects.SCALE_EVENT_ANNOTATION] = moment
    return request


def test_a_scale_down_whose_status_was_not_written_is_recorded_by_the_next_pass_once() -> None:
    """The pass that made the request could not write its status: the next records the scale event
    and says it; the one after finds it recorded (its time in scaleEvents, or, once it has aged out
    of them, lastScaleTime)."""
    spec = policy_spec(replicas=2)
    made = _made(str(NOW - 3))
    first = policy_decisions.decide(pass_inputs(spec, current=4, requests=(made,)))
    assert first.status.scaleEvents == [specs.ScaleEvent(time=NOW - 3, change=-2)]
    assert first.status.lastScaleReason == "ScaleDown"
    assert [(e.reason, e.message) for e in first.events if e.reason == "ScaleDown"] == [
        ("ScaleDown", "scaling down: draining 2 workers (p-g3-0)")
    ]
    assert first.create == (), "the drain is under way: no second request"
    again = policy_decisions.decide(pass_inputs(spec, current=4, requests=(made,), status=first.status))
    assert again.status.scaleEvents == first.status.scaleEvents
    assert [e for e in again.events if e.reason == "ScaleDown"] == []
    aged = first.status.model_copy(update={"scaleEvents": []})
    later = policy_decisions.decide(
        pass_inputs(spec, current=2, requests=(_made(str(NOW - 3), phase="Succeeded"),), status=aged)
    )
    assert later.status.scaleEvents == [] and [e for e in later.events if e.reason == "ScaleDown"] == []


def _desired_before(replicas: int) -> specs.MemoryPolicyStatus:
    return reachable(True).model_copy(update={"desiredReplicas": replicas})


def test_a_scale_up_whose_status_was_not_written_is_recorded_by_the_next_pass_once() -> None:
    """The pass that raised the replicas from 4 to 5 could not write its status: the next finds 5
    workers where the status last desired 4, records the scale-up and says it; the one after finds
    it recorded."""
    spec = policy_spec(replicas=5)
    first = policy_decisions.decide(pass_inputs(spec, current=5, status=_desired_before(4)))
    assert first.action == scaling.Action.NONE and first.scale_up_to is None
    assert first.status.scaleEvents == [specs.ScaleEvent(time=round(NOW, 3), change=1)]
    assert first.status.lastScaleReason == "ScaleUp" and first.status.desiredReplicas == 5
    assert [e.message for e in first.events if e.reason == "ScaleUp"] == [
        "scaled up from 4 to 5 (the status did not hold it yet)"
    ]
    again = policy_decisions.decide(pass_inputs(spec, current=5, status=first.status))
    assert again.status.scaleEvents == first.status.scaleEvents
    assert [e for e in again.events if e.reason == "ScaleUp"] == []


@pytest.mark.parametrize(
    ("spec", "current", "before"),
    [
        pytest.param(policy_spec(), 6, 4, id="an-adopted-count-follows-the-workload"),
        pytest.param(policy_spec(replicas=4), 4, 0, id="the-first-pass"),
        pytest.param(policy_spec(replicas=4), 6, 4, id="more-than-desired-is-scaled-down"),
    ],
)
def test_more_workers_than_the_status_desired_is_no_scale_up_of_memops_here(
    spec: specs.MemoryPolicySpec, current: int, before: int
) -> None:
    decision = policy_decisions.decide(pass_inputs(spec, current=current, status=_desired_before(before)))
    assert [e for e in decision.events if e.reason == "ScaleUp"] == []
    assert decision.status.lastScaleReason != "ScaleUp"


@pytest.mark.parametrize("moment", ["nan", "inf", "-inf", str(NOW + 60), "soon", "", "1e400"])
def test_a_scale_event_time_no_pass_wrote_records_nothing(moment: str) -> None:
    """The annotation is on an object that a tenant may write: a time that is not a number, or is
    in the future, records nothing and fails nothing."""
    decision = policy_decisions.decide(pass_inputs(policy_spec(replicas=2), current=4, requests=(_made(moment),)))
    assert decision.status.scaleEvents == [] and decision.status.lastScaleReason == ""


def test_an_autoscaler_on_the_workload_is_a_conflict() -> None:
    decision = policy_decisions.decide(pass_inputs(policy_spec(replicas=4), autoscalers=("hpa-a",)))
    assert _condition(decision, "Conflict") == ("True", "AutoscalerOnWorkload")
    conflict = conditions.get_condition(decision.status.conditions, "Conflict")
    assert conflict is not None and "scaleTargetRef at MemoryPolicy 'p'" in conflict.message
    assert _condition(policy_decisions.decide(pass_inputs(policy_spec(replicas=4))), "Conflict") == (
        "False",
        "NoConflict",
    )


def test_a_plain_policy_at_rest_is_steady_and_memory_features_are_not() -> None:
    assert policy_decisions.decide(pass_inputs(policy_spec(replicas=4))).steady
    assert not policy_decisions.decide(pass_inputs(policy_spec(replicas=4), usage=None)).steady
    assert not policy_decisions.decide(pass_inputs(policy_spec(replicas=4, pressure={"relieveAbove": "80%"}))).steady


def _recycling(marks: dict[str, Any], connected: tuple[str, ...] = ()) -> policy_decisions.RecycleSeen:
    pods = tuple(
        policy_decisions.PodSeen(name=f"w-{i}", age=48 * 3600.0 if i == 0 else 60.0, mark=marks.get(f"w-{i}"))
        for i in range(5)  # w-4: the replacement, once it has started
    )
    return policy_decisions.RecycleSeen(pods=pods, samples={}, connected=frozenset(connected), recorded=("old-drain",))


@pytest.mark.parametrize(
    ("marks", "connected", "requests", "marked", "drains", "action", "replicas"),
    [
        pytest.param({}, (), (), ["w-0"], [], scaling.Action.SCALE_UP, 5, id="mark-the-oldest-and-surge"),
        pytest.param(
            {"w-0": {"reason": "MaxAge", "message": "old", "startTime": ago(60)}},
            ("w-1", "w-2", "w-3"),
            (),
            [],
            [],
            scaling.Action.SCALE_UP,
            5,
            id="wait-for-the-replacement",
        ),
        pytest.param(
            {"w-0": {"reason": "MaxAge", "message": "old", "startTime": ago(60)}},
            ("w-1", "w-2", "w-3", "w-4"),
            (),
            [],
            ["w-0"],
            scaling.Action.SCALE_UP,
            5,
            id="drain-once-replaced",
        ),
        pytest.param(
            {},
            (),
            (_request("p-g3-0", None, count=1),),
            [],
            [],
            scaling.Action.WAIT,
            0,
            id="no-marks-during-a-scale-down",
        ),
    ],
)
def test_recycling(
    marks: dict[str, Any],
    connected: tuple[str, ...],
    requests: tuple[objects.Obj, ...],
    marked: list[str],
    drains: list[str],
    action: scaling.Action,
    replicas: int,
) -> None:
    spec = policy_spec(replicas=4, recycle={"maxAge": "24h", "surge": 1})
    inputs = pass_inputs(spec, recycling=_recycling(marks, connected), requests=requests)
    decision = policy_decisions.decide(inputs)
    assert [m.pod for m in decision.marks] == marked
    assert [m.mark["reason"] for m in decision.marks] == ["MaxAge"] * len(marked)
    recycle = [r for r in decision.create if r["metadata"]["labels"].get(objects.PURPOSE_LABEL) == "recycle"]
    assert [r["spec"]["workers"] for r in recycle] == [[pod] for pod in drains]
    assert [r["metadata"]["annotations"][objects.POD_ANNOTATION] for r in recycle] == drains
    assert (decision.action, decision.scale_up_to or 0) == (action, replicas)
    assert decision.recorded == ("old-drain",)
    assert decision.status.recycle is not None
    assert [r.pod for r in decision.status.recycle.recycling] == sorted(set(marks) | set(marked))


def test_a_recycling_policy_keeps_its_surge_on_a_pass_without_the_scheduler() -> None:
    """Five workers (four and a surge): a pass whose scheduler did not answer reads no recycling,
    and does not scale down; the same pass of a policy without recycling does."""
    recycling = policy_spec(replicas=4, recycle={"maxAge": "24h", "surge": 1})
    held = policy_decisions.decide(pass_inputs(recycling, current=5, recycling=None, usage=None, connected=0))
    assert held.action != scaling.Action.SCALE_DOWN
    assert not [r for r in held.create if objects.GENERATION_ANNOTATION in r["metadata"].get("annotations", {})]
    plain = policy_decisions.decide(pass_inputs(policy_spec(replicas=4), current=5, usage=None, connected=0))
    assert plain.action == scaling.Action.SCALE_DOWN


@pytest.mark.parametrize(
    ("blocker", "conflict"),
    [
        pytest.param(policy_decisions.NotReady("InvalidSpec", "spec.replicas: too many"), None, id="invalid-spec"),
        pytest.param(
            policy_decisions.NotReady("Conflict", "spec.workload: MemoryPolicy 'a' already manages it", True),
            ("True", "AnotherPolicy", "spec.workload: MemoryPolicy 'a' already manages it"),
            id="another-policy",
        ),
    ],
)
def test_a_blocked_policy_is_not_ready_and_stalled(
    blocker: policy_decisions.NotReady, conflict: tuple[str, str, str] | None
) -> None:
    status = policy_decisions.not_ready(specs.MemoryPolicyStatus(), blocker, 4)
    found = {c.type: (c.status, c.reason, c.message) for c in status.conditions}
    assert status.message == blocker.message
    assert found["Ready"] == ("False", blocker.reason, blocker.message)
    assert found["Stalled"] == ("True", blocker.reason, blocker.message)
    assert found["Reconciling"][0] == "False"
    assert found.get("Conflict") == conflict
    assert {c.observedGeneration for c in status.conditions} == {4}


@pytest.mark.parametrize(
    ("seen", "expected"),
    [
        pytest.param(policy_findings.SchedulerSeen(), ("True", "Connected", ""), id="connected"),
        pytest.param(
            policy_findings.SchedulerSeen("SchedulerUnreachable", "spec.scheduler.address: refused"),
            ("False", "SchedulerUnreachable", "spec.scheduler.address: refused"),
            id="unreachable",
        ),
        pytest.param(
            policy_findings.SchedulerSeen("ForeignScheduler", "spec.scheduler.address: not ours", foreign=True),
            ("False", "ForeignScheduler", "spec.scheduler.address: not ours"),
            id="foreign",
        ),
    ],
)
def test_the_scheduler_reachable_condition(seen: policy_findings.SchedulerSeen, expected: tuple[str, str, str]) -> None:
    [condition] = policy_findings.scheduler_reachable([], seen, 2)
    assert (condition.type, condition.status, condition.reason, condition.message) == ("SchedulerReachable", *expected)


def test_tasks_that_wait_for_room_scale_an_autoscaled_policy_up_by_one() -> None:
    """Task admission reported, on the last pass, tasks whose peak fits no worker: an autoscaled
    policy asks for one more worker, says why, and asks for no more while it starts."""
    autoscale = {"minReplicas": 1, "maxReplicas": 4, "targetMemoryUtilization": 50}
    waiting = specs.TaskAdmissionStatus(demandTasks=3, demandBytes=300 * 2**20, demandAction="Scale")
    status = reachable(True).model_copy(update={"tasks": waiting})
    spec = policy_spec(autoscale=autoscale, tasks={})
    decision = policy_decisions.decide(pass_inputs(spec, current=2, status=status))
    assert (decision.action, decision.desired, decision.scale_up_to) == (scaling.Action.SCALE_UP, 3, 3)
    assert "3 tasks wait for room that no worker has" in _limited_message(decision)
    starting = policy_decisions.decide(pass_inputs(spec, current=3, connected=2, status=status))
    assert starting.desired == 3 and starting.scale_up_to is None
    # Without spec.tasks (admission off, its figures left over) nothing is raised.
    plain = policy_decisions.decide(pass_inputs(policy_spec(autoscale=autoscale), current=2, status=status))
    assert plain.desired == 2


def _limited_message(decision: policy_decisions.Decision) -> str:
    found = conditions.get_condition(decision.status.conditions, "ScalingLimited")
    return found.message if found is not None else ""
