"""Why not: what a MemoryPolicy pass holds back, by which rule (``status.heldBack``), and the events
that say so once; from the pure decisions, and through a whole pass' :func:`policy_decisions.decide`."""

from __future__ import annotations

from typing import Any

import pytest

from memops import specs
from memops.decisions import (
    autoscaling,
    drain_decisions,
    held_back,
    node_pressure,
    objects,
    policy_decisions,
    recycle_decisions,
)
from tests.unit.policy_inputs import GIB, NOW, OWNER, ago, pass_inputs, policy_spec

Rule = specs.HeldBackRule


def _kept(pod: str, reason: specs.WorkerReason, kept: specs.KeptReason | None = None) -> dict[str, Any]:
    cause = specs.WorkerCause(reason=reason, bytes=64 * 2**20, keys=64, kept=kept, keptDetail="x" if kept else "")
    worker = specs.WorkerStatus(pod=pod, state=specs.WorkerState.KEPT, cause=cause)
    worker.message = drain_decisions.render(worker)
    return worker.model_dump(mode="json")


def _failed(*workers: dict[str, Any], generation: int = 3, seconds_ago: float = 10) -> objects.Obj:
    """The policy's scale-down RetirementRequest, Failed ``ago`` seconds before NOW."""
    return {
        "metadata": {
            "name": f"p-g{generation}-0",
            "labels": {objects.POLICY_LABEL: "p"},
            "annotations": {objects.GENERATION_ANNOTATION: str(generation)},
        },
        "spec": {"count": 2},
        "status": {
            "phase": "Failed",
            "completionTime": ago(seconds_ago),
            "message": "only 0 of 2 workers could be chosen and retired",
            "workers": list(workers),
        },
    }


def _held(decision: policy_decisions.Decision) -> list[tuple[str, str, int]]:
    return [(h.pod, h.rule.value, h.workers) for h in decision.status.heldBack]


# -- the pure decisions ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("worker", "rule"),
    [
        pytest.param(_kept("w-1", specs.WorkerReason.NOWHERE_TO_GO), Rule.NOWHERE_TO_GO, id="no-room-for-its-data"),
        pytest.param(_kept("w-1", specs.WorkerReason.TIMED_OUT), Rule.DRAIN_TIMED_OUT, id="timed-out"),
        pytest.param(_kept("w-1", specs.WorkerReason.UNREACHABLE), Rule.DRAIN_UNREACHABLE, id="unreachable"),
        pytest.param(_kept("w-1", specs.WorkerReason.UNIDENTIFIED), Rule.WORKER_UNIDENTIFIED, id="not-identified"),
        pytest.param(
            _kept("w-1", specs.WorkerReason.DRAINING, specs.KeptReason.REQUEST_FAILED),
            Rule.REQUEST_FAILED,
            id="request-failed",
        ),
        pytest.param(
            _kept("w-1", specs.WorkerReason.DRAINED, specs.KeptReason.REMOVAL_BLOCKED),
            Rule.REMOVAL_BLOCKED,
            id="removal-blocked",
        ),
    ],
)
def test_a_pod_that_the_failed_drain_kept_is_held_by_the_rule_of_its_cause(
    worker: dict[str, Any], rule: specs.HeldBackRule
) -> None:
    retired = {"pod": "w-2", "state": "Retired", "cause": {"reason": "Drained"}}
    [hold] = held_back.failed_drain(_failed(worker, retired), retry_at="T", workers=2)
    assert (hold.pod, hold.rule, hold.workers) == ("w-1", rule, 1)
    # The drain's own words about the pod, the request that kept it, and when the scale-down tries again.
    assert hold.message.startswith(worker["message"])
    assert "(RetirementRequest p-g3-0)" in hold.message and "tries again at T," in hold.message


def test_a_failed_drain_that_kept_no_pod_holds_the_scale_down_count() -> None:
    [hold] = held_back.failed_drain(_failed(), retry_at="T", workers=2)
    assert (hold.pod, hold.rule, hold.workers) == ("", Rule.DRAIN_FAILED, 2)
    assert "only 0 of 2 workers could be chosen" in hold.message and "again at T," in hold.message


def test_a_malformed_request_status_is_a_count_not_a_crash() -> None:
    request = _failed()
    request["status"]["workers"] = [{"pod": 7, "state": "Sideways"}]
    [hold] = held_back.failed_drain(request, retry_at="T", workers=1)
    assert (hold.pod, hold.rule) == ("", Rule.DRAIN_FAILED)


AUTOSCALE = specs.AutoscaleSpec(maxReplicas=8, minReplicas=1, targetMemoryUtilization=50)


@pytest.mark.parametrize(
    ("recommendation", "expected"),
    [
        pytest.param(autoscaling.Recommendation(4, "", raw=1), ("", Rule.STABILIZATION_WINDOW, 3), id="window"),
        pytest.param(
            autoscaling.Recommendation(3, "", raw=1, limits=(autoscaling.Limit.MIN_REPLICAS,)),
            ("", Rule.MIN_REPLICAS, 2),
            id="min-replicas",
        ),
        pytest.param(
            autoscaling.Recommendation(3, "", raw=1, limits=(autoscaling.Limit.SCALE_DOWN_POLICIES,)),
            ("", Rule.SCALE_DOWN_POLICIES, 2),
            id="a-disruption-bound",
        ),
        pytest.param(
            # The memory in use raised the count, then minReplicas raised it further: the last one sets it.
            autoscaling.Recommendation(
                3, "", raw=1, limits=(autoscaling.Limit.MEMORY_IN_USE, autoscaling.Limit.MIN_REPLICAS)
            ),
            ("", Rule.MIN_REPLICAS, 2),
            id="the-last-raise-binds",
        ),
        pytest.param(
            autoscaling.Recommendation(2, "", raw=1, limits=(autoscaling.Limit.MEMORY_IN_USE,)),
            ("", Rule.MEMORY_IN_USE, 1),
            id="memory-in-use",
        ),
        pytest.param(autoscaling.Recommendation(2, "", raw=2), None, id="nothing-held"),
        pytest.param(autoscaling.Recommendation(6, "", raw=6), None, id="a-scale-up-holds-nothing"),
    ],
)
def test_autoscaling_holds_the_workers_the_metric_alone_would_remove(
    recommendation: autoscaling.Recommendation, expected: tuple[str, specs.HeldBackRule, int] | None
) -> None:
    holds = held_back.autoscaled(recommendation, current=4, spec=AUTOSCALE)
    assert [(h.pod, h.rule, h.workers) for h in holds] == ([expected] if expected else [])
    if expected:
        assert holds[0].message.startswith(f"the memory metric asks for {recommendation.raw} of the 4 workers")


def _verdict(pod: str, severity: float = 1.0) -> recycle_decisions.Verdict:
    return recycle_decisions.Verdict(pod=pod, reason="MaxAge", message="old", severity=severity)


def test_recycling_holds_the_due_workers_it_does_not_mark_and_says_why() -> None:
    due = [_verdict("a", 3), _verdict("b", 2), _verdict("c", 1)]
    chosen = recycle_decisions.plan_recycle(due, recycling=0, max_unavailable=1, in_shuffle={"a"})
    assert [v.pod for v in chosen] == ["b"]
    holds = held_back.recycling(due, chosen={v.pod for v in chosen}, shuffling={"a"}, max_unavailable=1)
    assert [(h.pod, h.rule) for h in holds] == [("a", Rule.IN_SHUFFLE), ("c", Rule.MAX_UNAVAILABLE)]
    assert holds[1].message == "due for recycling (MaxAge: old); spec.recycle.maxUnavailable (1) are being recycled"
    running = held_back.recycling(due, chosen=None, shuffling=(), max_unavailable=1)
    assert {h.rule for h in running} == {Rule.OTHER_DRAIN_RUNNING} and len(running) == 3


def test_a_marked_worker_waits_for_its_replacements() -> None:
    plan = recycle_decisions.plan_replacement(marked=["old"], requested=set(), connected_unmarked=3, desired=4, surge=1)
    assert plan.waiting == ("old",) and plan.drain == ()
    [hold] = held_back.awaiting_replacements({"old": {"reason": "MaxAge"}}, plan.waiting, connected=3, desired=4)
    assert (hold.pod, hold.rule) == ("old", Rule.AWAITING_REPLACEMENTS) and "(3 of 4 workers)" in hold.message
    replaced = recycle_decisions.plan_replacement(
        marked=["old"], requested=set(), connected_unmarked=4, desired=4, surge=1
    )
    assert replaced.waiting == () and replaced.drain == ("old",)


def test_a_victim_of_the_kubelet_with_no_room_elsewhere_is_held() -> None:
    prediction = node_pressure.Prediction(node="n1", headroom=0, signal="memory.available", victims=(), ours=("w-1",))
    seen = node_pressure.Seen(predictions=(prediction,), unique={"w-1": 600 * 2**20}, room={"n2": 100 * 2**20})
    planned = node_pressure.plan(OWNER, policy_spec(), seen, [], NOW)
    [hold] = held_back.node_pressure(planned.held)
    assert (hold.pod, hold.rule) == ("w-1", Rule.NO_ROOM_ON_OTHER_NODES)
    assert hold.message == planned.refused[0]


def test_the_status_is_a_set_by_pod_bounded_and_said_once() -> None:
    holds = [
        held_back.Hold("w-2", Rule.NOWHERE_TO_GO, "no room"),
        held_back.Hold("w-2", Rule.MAX_UNAVAILABLE, "second: left out"),  # the pass' first hold of a pod wins
        held_back.Hold("", Rule.MIN_REPLICAS, "min", workers=2),
        held_back.Hold("w-1", Rule.IN_SHUFFLE, "shuffle"),
    ]
    entries, events = held_back.status(holds, [], "t1")
    assert [(e.pod, e.rule, e.workers, e.since) for e in entries] == [
        ("", Rule.MIN_REPLICAS, 2, "t1"),
        ("w-1", Rule.IN_SHUFFLE, 1, "t1"),
        ("w-2", Rule.NOWHERE_TO_GO, 1, "t1"),
    ]
    assert [(e.type, e.reason, e.message) for e in events] == [
        ("Normal", "MinReplicas", "a scale-down of 2 workers held back: min"),
        ("Normal", "InShuffle", "w-1 held back: shuffle"),
        ("Warning", "NowhereToGo", "w-2 held back: no room"),
    ]
    # The next pass: the same holds say nothing again and keep their start; a new rule for a pod is said.
    again = [held_back.Hold("w-1", Rule.MAX_UNAVAILABLE, "room"), held_back.Hold("w-2", Rule.NOWHERE_TO_GO, "x")]
    later, said = held_back.status(again, entries, "t2")
    assert [(e.pod, e.rule, e.since) for e in later] == [
        ("w-1", Rule.MAX_UNAVAILABLE, "t2"),
        ("w-2", Rule.NOWHERE_TO_GO, "t1"),
    ]
    assert [(e.reason, e.message) for e in said] == [("MaxUnavailable", "w-1 held back: room")]
    many = [held_back.Hold(f"w-{i:03}", Rule.IN_SHUFFLE, "x" * 5000) for i in range(100)]
    bounded, said = held_back.status(many, [], "t")
    assert len(bounded) == len(said) == specs.MAX_HELD_BACK and bounded[0].pod == "w-000"
    assert len(bounded[0].message) == held_back.MAX_MESSAGE


# -- through a whole pass -------------------------------------------------------------------------


def test_a_pass_that_waits_after_a_failed_drain_names_the_kept_pod_and_says_it_once() -> None:
    """replicas 2 of 4; the last scale-down kept w-1, whose data had nowhere to go, 10 s ago."""
    inputs = pass_inputs(policy_spec(replicas=2), requests=(_failed(_kept("w-1", specs.WorkerReason.NOWHERE_TO_GO)),))
    decision = policy_decisions.decide(inputs)
    assert decision.action == "Wait" and _held(decision) == [("w-1", "NowhereToGo", 1)]
    assert f"tries again at {ago(-50)}," in decision.status.heldBack[0].message
    assert [(e.type, e.reason) for e in decision.events] == [("Warning", "NowhereToGo")]
    # The next pass reads the status it wrote: the hold goes on as it was (no write for it), unsaid.
    again = policy_decisions.decide(
        pass_inputs(policy_spec(replicas=2), requests=inputs.requests, status=decision.status, now=NOW + 2)
    )
    assert again.status.heldBack == decision.status.heldBack and again.events == ()
    # A spec change lifts the cooldown: the scale-down drains again, and nothing is held back.
    changed = policy_decisions.decide(
        pass_inputs(policy_spec(replicas=2), requests=inputs.requests, status=decision.status, generation=4)
    )
    assert changed.action == "ScaleDown" and changed.status.heldBack == []


def test_a_pass_names_the_stabilization_window_and_min_replicas() -> None:
    """5% of the memory asks for 1 worker of 4; a recommendation of 4 a minute ago keeps all 4, and
    without it minReplicas 3 keeps 3."""
    autoscale = {"maxReplicas": 8, "minReplicas": 1, "targetMemoryUtilization": 50}
    usage = autoscaling.Usage(workers=4, held=int(0.4 * GIB), limit=8 * GIB)
    history = specs.MemoryPolicyStatus(recommendations=[specs.Recommendation(time=NOW - 60, replicas=4)])
    windowed = policy_decisions.decide(pass_inputs(policy_spec(autoscale=autoscale), usage=usage, status=history))
    assert windowed.action == "None" and _held(windowed) == [("", "StabilizationWindow", 3)]
    assert "stabilization window (300 s) keeps 4" in windowed.status.heldBack[0].message
    floor = policy_decisions.decide(pass_inputs(policy_spec(autoscale=autoscale | {"minReplicas": 3}), usage=usage))
    assert floor.action == "ScaleDown" and _held(floor) == [("", "MinReplicas", 2)]


def test_a_policy_that_cannot_act_holds_nothing_back() -> None:
    status = specs.MemoryPolicyStatus(heldBack=[specs.HeldBack(pod="w-1", rule=Rule.NOWHERE_TO_GO)])
    blocked = policy_decisions.not_ready(status, policy_decisions.NotReady("WorkloadNotFound", "gone"), 3)
    assert blocked.heldBack == []
