"""A RetirementRequest step's decision: from the facts it read to the status it writes and its effects.

Tables over :mod:`memops.decisions.retirement_decisions`; the reasons, messages and condition types are the
ones the request's status has always carried (the e2e suite reads the same through the API).
"""

from __future__ import annotations

import datetime

import pytest

from memops import specs
from memops.decisions import conditions, objects, retirement_decisions, snapshots, tenancy, timestamps

NOW = datetime.datetime(2026, 1, 1, 12, 0, tzinfo=datetime.UTC)
LATER = NOW + datetime.timedelta(minutes=5)
EARLIER = NOW - datetime.timedelta(minutes=5)
SPEC = specs.RetirementRequestSpec.model_validate(
    {"scheduler": {"address": "tcp://s:8786"}, "workload": {"kind": "Deployment", "name": "w"}, "count": 1}
)
Blocker = retirement_decisions.Blocker


def pod(name: str, claimed_by: str | None = None) -> dict[str, object]:
    annotations = {objects.CLAIM_ANNOTATION: claimed_by} if claimed_by else {}
    return {"metadata": {"name": name, "annotations": annotations}, "status": {"podIP": "10.0.0.1"}}


def condition(status: specs.RetirementRequestStatus, type_: str) -> tuple[str, str, str] | None:
    found = conditions.get_condition(status.conditions, type_)
    return None if found is None else (found.status, found.reason, found.message)


def draining(pod: str, **fields: object) -> specs.WorkerStatus:
    return specs.WorkerStatus(pod=pod, address=f"tcp://{pod}", state=specs.WorkerState.DRAINING, **fields)  # type: ignore[arg-type]


def started(*workers: specs.WorkerStatus, **fields: object) -> specs.RetirementRequestStatus:
    update = {
        "phase": specs.Phase.DRAINING,
        "observedGeneration": 1,
        "deadline": timestamps.render(LATER),
        "requested": len(workers),
        "workers": list(workers),
        **fields,
    }
    return specs.RetirementRequestStatus().model_copy(update=update)


@pytest.mark.parametrize(
    ("blocker", "deadline", "phase", "reachable", "failed"),
    [
        pytest.param(
            Blocker("WorkloadNotFound", "spec.workload.name: gone"),
            LATER,
            specs.Phase.FAILED,
            None,
            ("True", "WorkloadNotFound", "spec.workload.name: gone"),
            id="fatal-at-once",
        ),
        pytest.param(
            Blocker.unreachable("refused"),
            LATER,
            specs.Phase.PENDING,
            ("False", "SchedulerUnreachable", "spec.scheduler.address: refused; retrying until 2026-01-01T12:05:00Z"),
            None,
            id="unreachable-before-the-deadline",
        ),
        pytest.param(
            Blocker.unreachable("refused"),
            EARLIER,
            specs.Phase.FAILED,
            ("False", "SchedulerUnreachable", "spec.scheduler.address: refused; retrying until 2026-01-01T11:55:00Z"),
            ("True", "SchedulerUnreachable", "spec.scheduler.address: refused"),
            id="unreachable-at-the-deadline",
        ),
        pytest.param(
            Blocker.unvouched(tenancy.Verdict(tenancy.Reason.FOREIGN, "not ours")),
            LATER,
            specs.Phase.PENDING,
            ("False", "ForeignScheduler", "spec.scheduler.address: not ours; retrying until 2026-01-01T12:05:00Z"),
            None,
            id="unvouched-before-the-deadline",
        ),
    ],
)
def test_a_blocked_start(
    blocker: retirement_decisions.Blocker,
    deadline: datetime.datetime,
    phase: specs.Phase,
    reachable: tuple[str, str, str] | None,
    failed: tuple[str, str, str] | None,
) -> None:
    facts = retirement_decisions.StartFacts(blocker=blocker)
    decision = retirement_decisions.start(
        SPEC, specs.RetirementRequestStatus(), facts, name="r", generation=1, deadline=deadline, now=NOW
    )
    assert decision.status.phase == phase
    assert condition(decision.status, "SchedulerReachable") == reachable
    assert condition(decision.status, "Failed") == failed
    assert decision.claim == ()
    assert [e.reason for e in decision.events] == ([failed[1]] if failed else [])
    assert decision.finished == (failed[1] if failed else None)


@pytest.mark.parametrize(
    ("workers", "pods", "expected"),
    [
        pytest.param(["a"], [pod("a")], None, id="a-free-pod"),
        pytest.param(
            ["a", "x"],
            [pod("a")],
            ("WorkerNotFound", "spec.workers[1]: pod 'x' is not a running pod of Deployment 'w'"),
            id="not-a-pod-of-the-workload",
        ),
        pytest.param(
            ["a"],
            [pod("a", claimed_by="other")],
            ("WorkerClaimed", "spec.workers[0]: pod 'a' is already being retired by another RetirementRequest"),
            id="claimed-by-another-request",
        ),
    ],
)
def test_named_workers(workers: list[str], pods: list[dict[str, object]], expected: tuple[str, str] | None) -> None:
    spec = SPEC.model_copy(update={"workers": workers, "count": None})
    names = [str(p["metadata"]["name"]) for p in pods]  # type: ignore[index]
    taken = {n for p, n in zip(pods, names, strict=True) if p["metadata"]["annotations"]}  # type: ignore[index]
    refused = retirement_decisions.named_workers_refused(spec, names, taken)
    assert (None if refused is None else (refused.reason, refused.message)) == expected


def test_a_start_claims_the_chosen_pods_and_says_draining() -> None:
    snapshot = snapshots.SchedulerSnapshot(workers=(snapshots.WorkerInfo(name="a", address="tcp://10.0.0.1:1"),))
    facts = retirement_decisions.StartFacts(
        pods=[pod("a"), pod("b")], infos=[snapshots.PodInfo(name="a"), snapshots.PodInfo(name="b")], snapshot=snapshot
    )
    spec = SPEC.model_copy(update={"workers": ["a"], "count": None})
    decision = retirement_decisions.start(
        spec, specs.RetirementRequestStatus(), facts, name="r", generation=3, deadline=LATER, now=NOW
    )
    assert decision.status.phase == specs.Phase.DRAINING
    assert [p["metadata"]["name"] for p in decision.claim] == ["a"]
    assert (decision.status.observedGeneration, decision.status.requested) == (3, 1)
    assert condition(decision.status, "Draining") == ("True", "DrainStarted", "draining 1 workers: a")
    assert condition(decision.status, "SchedulerReachable") == ("True", "Connected", "")
    assert [(e.type, e.reason) for e in decision.events] == [("Normal", "DrainStarted")]
    assert decision.started and decision.finished is None


def test_no_worker_to_choose_fails() -> None:
    facts = retirement_decisions.StartFacts(snapshot=snapshots.SchedulerSnapshot(workers=()))
    decision = retirement_decisions.start(
        SPEC, specs.RetirementRequestStatus(), facts, name="r", generation=1, deadline=LATER, now=NOW
    )
    assert condition(decision.status, "Failed") == (
        "True",
        "NoWorkers",
        "no worker could be chosen: every pod is taken or none exists",
    )


@pytest.mark.parametrize(
    ("facts", "now", "draining_reason", "kept", "scale_down"),
    [
        pytest.param(
            retirement_decisions.RemovalFacts(outranking=["p"]), NOW, "WaitingForPods", False, None, id="outranked"
        ),
        pytest.param(
            retirement_decisions.RemovalFacts(outranking=["p"]), LATER, "DrainStarted", True, None, id="outranked-late"
        ),
        pytest.param(
            retirement_decisions.RemovalFacts(foreign="Deployment 'x' is not the workload's"),
            NOW,
            "ForeignDeployment",
            True,
            None,
            id="foreign-deployment",
        ),
        pytest.param(
            retirement_decisions.RemovalFacts(deployments=["d-a"], replicas=3),
            NOW,
            "DrainStarted",
            False,
            (["a"], 3, 2, ["d-a"]),
            id="recorded",
        ),
    ],
)
def test_a_scale_down_is_recorded_unless_blocked(
    facts: retirement_decisions.RemovalFacts,
    now: datetime.datetime,
    draining_reason: str,
    kept: bool,
    scale_down: tuple[list[str], int, int, list[str]] | None,
) -> None:
    status = started(draining("a", removable=True))
    status.conditions = conditions.set_condition([], "Draining", True, reason="DrainStarted", generation=1)
    decision = retirement_decisions.plan_scale_down(status, facts, deadline=LATER, now=now)
    assert condition(decision.status, "Draining")[1] == draining_reason  # type: ignore[index]
    assert (decision.status.workers[0].state == specs.WorkerState.KEPT) == kept
    recorded = decision.status.scaleDown
    assert (
        None if recorded is None else (recorded.pods, recorded.replicasFrom, recorded.replicasTo, recorded.deployments)
    ) == scale_down
    assert decision.mark_for_deletion == (tuple(scale_down[0]) if scale_down else ())


@pytest.mark.parametrize(
    ("now", "reachable", "state"),
    [
        pytest.param(
            NOW,
            ("False", "SchedulerUnreachable", f"refused; retrying until {timestamps.render(LATER)}"),
            specs.WorkerState.DRAINING,
            id="before-the-deadline",
        ),
        pytest.param(LATER, None, specs.WorkerState.KEPT, id="at-the-deadline"),
    ],
)
def test_a_drain_without_its_scheduler(
    now: datetime.datetime, reachable: tuple[str, str, str] | None, state: specs.WorkerState
) -> None:
    decision = retirement_decisions.drain_blocked(
        started(draining("a")), Blocker.unreachable("refused"), deadline=LATER, now=now
    )
    assert condition(decision.status, "SchedulerReachable") == reachable
    assert decision.status.workers[0].state == state


@pytest.mark.parametrize(
    ("workers", "phase", "complete", "failed", "data_lost", "finished"),
    [
        pytest.param(
            [specs.WorkerStatus(pod="a", state=specs.WorkerState.RETIRED, podRemoved=True)],
            specs.Phase.SUCCEEDED,
            ("True", "Retired"),
            None,
            None,
            "Retired",
            id="retired",
        ),
        pytest.param(
            [specs.WorkerStatus(pod="a", state=specs.WorkerState.KEPT)],
            specs.Phase.FAILED,
            None,
            ("True", "WorkersKept"),
            None,
            "WorkersKept",
            id="kept",
        ),
        pytest.param(
            [specs.WorkerStatus(pod="a", state=specs.WorkerState.FORCED, podRemoved=True, bytesLost=7)],
            specs.Phase.SUCCEEDED,
            ("True", "Retired"),
            None,
            ("True", "Forced", "7 bytes lost by forced removal (onTimeout: Force)"),
            "Retired",
            id="forced",
        ),
    ],
)
def test_the_conclusion_derives_its_conditions(
    workers: list[specs.WorkerStatus],
    phase: specs.Phase,
    complete: tuple[str, str] | None,
    failed: tuple[str, str] | None,
    data_lost: tuple[str, str, str] | None,
    finished: str,
) -> None:
    decision = retirement_decisions.conclude(started(*workers), now=NOW)
    status = decision.status
    assert status.phase == phase
    assert condition(status, "Draining") == ("False", "Finished", status.message)
    assert (condition(status, "Complete") or (None,))[:2] in (complete, (None,))
    assert (condition(status, "Failed") or (None,))[:2] in (failed, (None,))
    assert condition(status, "DataLost") == data_lost
    assert decision.finished == finished
    assert decision.release is not None and decision.release.pods == tuple(w.pod for w in workers if not w.podRemoved)


def test_a_failure_keeps_the_unordered_pods_and_gives_their_claims_back() -> None:
    status = started(draining("a"), draining("b", removable=True))
    status.scaleDown = specs.ScaleDown(pods=["b"], replicasFrom=2, replicasTo=1)
    decision = retirement_decisions.fail(status, "ApiError", "boom", generation=1, now=NOW)
    assert [w.state for w in decision.status.workers] == [specs.WorkerState.KEPT, specs.WorkerState.DRAINING]
    assert decision.release == retirement_decisions.Release(("a",), tolerate_errors=True)
    assert condition(decision.status, "Failed") == ("True", "ApiError", "boom")
    assert condition(decision.status, "Draining") is None  # a failure leaves the drain's condition as it was


@pytest.mark.parametrize(
    ("retrying", "expected"),
    [
        pytest.param(True, ("False", "Recovered", ""), id="was-retrying"),
        pytest.param(False, None, id="was-not"),
    ],
)
def test_a_step_that_went_through_clears_retrying(retrying: bool, expected: tuple[str, str, str] | None) -> None:
    status = started(draining("a"))
    if retrying:
        status.conditions = conditions.set_condition([], "Retrying", True, reason="ApiError", generation=1)
    summarized = retirement_decisions.summarize(status, was_retrying=retrying)
    assert condition(summarized, "Retrying") == expected
    assert condition(summarized, "Ready") == ("False", "Draining", "")
    assert condition(summarized, "Reconciling") == ("True", "Draining", "")
