"""Pure decisions of a RetirementRequest: each worker's fate and the request's outcome."""

import pytest

from memops import specs
from memops.decisions import drain_decisions, objects, snapshots

A, B = "tcp://a", "tcp://b"


def draining(pod: str, address: str, unique: int = 0) -> specs.WorkerStatus:
    return specs.WorkerStatus(pod=pod, address=address, state=specs.WorkerState.DRAINING, uniqueBytes=unique)


def snap(
    workers: list[tuple[str, str, int, int]], who_has: dict[str, tuple[str, ...]], nbytes: dict[str, int]
) -> snapshots.SchedulerSnapshot:
    return snapshots.SchedulerSnapshot(
        workers=tuple(snapshots.WorkerInfo(name=n, address=a, unique_bytes=u, unique_keys=k) for n, a, u, k in workers),
        who_has=who_has,
        nbytes=nbytes,
    )


TIMED_OUT = specs.WorkerReason.TIMED_OUT


def cause(reason: specs.WorkerReason, nbytes: int = 0, **fields: object) -> specs.WorkerCause:
    return specs.WorkerCause.model_validate({"reason": reason, "bytes": nbytes, "keys": 1 if nbytes else 0, **fields})


def drained(pod: str) -> specs.WorkerStatus:
    worker = specs.WorkerStatus(
        pod=pod, state=specs.WorkerState.DRAINING, removable=True, cause=cause(specs.WorkerReason.DRAINED)
    )
    return worker.model_copy(update={"message": drain_decisions.render(worker)})


BEFORE = snap([("pa", A, 30, 2), ("pb", B, 0, 0)], {"x": (A,), "y": (A,)}, {"x": 10, "y": 20})


def judge(
    after: snapshots.SchedulerSnapshot,
    retired: list[str],
    on_timeout: specs.OnTimeout = specs.OnTimeout.ABORT,
    timed_out: bool = False,
) -> specs.WorkerStatus:
    [worker] = drain_decisions.judge_drain(
        [draining("pa", A, 30)], before=BEFORE, after=after, retired=retired, timed_out=timed_out, on_timeout=on_timeout
    )
    return worker


def test_retired_worker_is_removable_with_bytes_moved() -> None:
    after = snap([("pb", B, 30, 2)], {"x": (B,), "y": (B,)}, {"x": 10, "y": 20})
    worker = judge(after, [A])
    assert worker.removable and worker.state == specs.WorkerState.DRAINING
    assert (worker.bytesMoved, worker.bytesLost) == (30, 0)
    assert "retired" in worker.message


def test_keys_handed_over_by_link_are_recorded_on_the_pod() -> None:
    after = snap([("pb", B, 30, 2)], {"x": (B,), "y": (B,)}, {"x": 10, "y": 20})
    [worker] = drain_decisions.judge_drain(
        [draining("pa", A, 30)],
        before=BEFORE,
        after=after,
        retired=[A],
        timed_out=False,
        on_timeout=specs.OnTimeout.ABORT,
        linked={A: (1, 20), "tcp://another-pod": (5, 500)},
    )
    assert worker.removable and (worker.bytesMoved, worker.keysLinked, worker.bytesLinked) == (30, 1, 20)
    assert judge(after, [A]).bytesLinked == 0, "nothing linked: nothing recorded"


def test_worker_that_died_is_removable_and_its_loss_recorded() -> None:
    after = snap([("pb", B, 10, 1), ("pa", "tcp://a-restarted", 0, 0)], {"x": (B,), "y": ()}, {"x": 10})
    worker = judge(after, [A])  # the scheduler reports a dead worker as retired
    assert worker.removable
    assert (worker.bytesMoved, worker.bytesLost, worker.keysLost) == (10, 20, 1)
    assert "died" in worker.message


@pytest.mark.parametrize("timed_out", [False, True], ids=["no-recipients", "timed-out"])
def test_abort_keeps_a_worker_that_still_holds_unique_data(timed_out: bool) -> None:
    worker = judge(BEFORE, [], timed_out=timed_out)
    assert worker.state == specs.WorkerState.KEPT and not worker.removable
    assert ("spec.timeout" in worker.message) == timed_out
    assert "30 bytes" in worker.message


def test_force_removes_and_records_the_loss() -> None:
    worker = judge(BEFORE, [], on_timeout=specs.OnTimeout.FORCE)
    assert worker.state == specs.WorkerState.FORCED and worker.removable
    assert (worker.bytesLost, worker.keysLost) == (30, 2)


@pytest.mark.parametrize(
    "on_timeout, state",
    [(specs.OnTimeout.ABORT, specs.WorkerState.KEPT), (specs.OnTimeout.FORCE, specs.WorkerState.FORCED)],
    ids=["kept", "forced"],
)
def test_what_memops_drain_left_at_its_deadline_is_recorded(
    on_timeout: specs.OnTimeout, state: specs.WorkerState
) -> None:
    after = snap([("pa", A, 20, 1), ("pb", B, 10, 1)], {"x": (B,), "y": (A,)}, {"x": 10, "y": 20})
    [worker] = drain_decisions.judge_drain(
        [draining("pa", A, 30)],
        before=BEFORE,
        after=after,
        retired=[],
        timed_out=True,
        on_timeout=on_timeout,
        lost_at_deadline={A: (1, 20), B: (5, 50)},
    )
    assert worker.state == state
    assert worker.lostAtDeadline == specs.LostAtDeadline(keys=1, bytes=20, cause="deadline")


def test_a_retired_worker_has_nothing_left_at_a_deadline() -> None:
    after = snap([("pb", B, 30, 2)], {"x": (B,), "y": (B,)}, {"x": 10, "y": 20})
    [worker] = drain_decisions.judge_drain(
        [draining("pa", A, 30)],
        before=BEFORE,
        after=after,
        retired=[A],
        timed_out=False,
        on_timeout=specs.OnTimeout.ABORT,
        lost_at_deadline={B: (1, 1)},
    )
    assert worker.removable and worker.lostAtDeadline is None


def test_a_restarted_worker_holding_new_data_keeps_the_pod() -> None:
    after = snap([("pb", B, 30, 2), ("pa", "tcp://a2", 5, 1)], {"x": (B,), "y": (B,), "n": ("tcp://a2",)}, {"n": 5})
    assert judge(after, [A]).state == specs.WorkerState.KEPT


def test_unconnected_pod_is_removable_at_once() -> None:
    [worker] = drain_decisions.judge_drain(
        [draining("fresh", "")],
        before=BEFORE,
        after=BEFORE,
        retired=[],
        timed_out=False,
        on_timeout=specs.OnTimeout.ABORT,
    )
    assert worker.removable and worker.bytesMoved == 0


@pytest.mark.parametrize(
    ("on_timeout", "state", "lost"),
    [(specs.OnTimeout.ABORT, specs.WorkerState.KEPT, 0), (specs.OnTimeout.FORCE, specs.WorkerState.FORCED, 30)],
    ids=["abort", "force"],
)
def test_unreachable_scheduler_at_the_deadline(
    on_timeout: specs.OnTimeout, state: specs.WorkerState, lost: int
) -> None:
    [worker] = drain_decisions.judge_unreachable([draining("pa", A, 30)], on_timeout=on_timeout, reason="gone")
    assert (worker.state, worker.bytesLost) == (state, lost)
    assert "unreachable" in worker.message


def test_removal_bookkeeping() -> None:
    workers = [
        drained("a"),
        specs.WorkerStatus(pod="b", state=specs.WorkerState.FORCED, removable=True, cause=cause(TIMED_OUT, 5)),
        specs.WorkerStatus(pod="c", state=specs.WorkerState.KEPT),
    ]
    assert drain_decisions.to_remove(workers) == ["a", "b"]
    after = drain_decisions.mark_removed(workers, ["a", "b"])
    assert [(w.state, w.podRemoved) for w in after] == [
        (specs.WorkerState.RETIRED, True),
        (specs.WorkerState.FORCED, True),
        (specs.WorkerState.KEPT, False),
    ]
    assert after[0].message == "drained: the scheduler retired the worker; its pod was removed"
    assert after[1].message == (
        "the drain did not finish within spec.timeout (the scheduler may still finish it); onTimeout is Force:"
        " removed the pod with 5 bytes (1 keys) that exist nowhere else"
    )
    assert drain_decisions.to_remove(after) == []


@pytest.mark.parametrize(
    ("states", "requested", "phase", "fragment"),
    [
        pytest.param(["Retired", "Retired"], 2, "Succeeded", "retired 2 of 2", id="all-retired"),
        pytest.param(["Retired", "Kept"], 2, "Failed", "kept 1", id="one-kept"),
        pytest.param(["Retired"], 2, "Failed", "only 1 of 2", id="too-few-candidates"),
        pytest.param(["Retired", "Forced"], 2, "Succeeded", "removed by force", id="forced"),
    ],
)
def test_conclude(states: list[str], requested: int, phase: str, fragment: str) -> None:
    status = specs.RetirementRequestStatus(
        workers=[
            specs.WorkerStatus(pod=f"p{i}", state=specs.WorkerState(s), bytesLost=5 * (s == "Forced"))
            for i, s in enumerate(states)
        ]
    )
    concluded = drain_decisions.conclude(status, requested=requested, at="2026-01-01T00:00:00Z")
    assert concluded.phase == phase
    assert fragment in concluded.message
    assert concluded.completionTime == "2026-01-01T00:00:00Z"


def test_claims_by_other_requests() -> None:
    pods = [
        {"metadata": {"name": "a", "annotations": {objects.CLAIM_ANNOTATION: "mine"}}},
        {"metadata": {"name": "b", "annotations": {objects.CLAIM_ANNOTATION: "theirs"}}},
        {"metadata": {"name": "c"}},
    ]
    assert drain_decisions.claimed_by_others(pods, "mine") == {"b"}


def test_spec_change_on_a_finished_request_is_refused() -> None:
    from memops.controllers.retirement import refused_change

    finished = {"phase": "Succeeded", "observedGeneration": 1, "conditions": []}
    [condition] = refused_change(finished, generation=2) or []
    assert (condition["type"], condition["status"], condition["observedGeneration"]) == (
        "SpecChangeRejected",
        "True",
        2,
    )
    assert refused_change(finished, generation=1) is None
    assert refused_change({"phase": "Draining", "observedGeneration": 1}, generation=2) is None
    assert refused_change({"phase": "Pending"}, generation=2) is None


def test_pods_blocked_until_the_deadline_are_kept_with_the_reason() -> None:
    workers = [drained("a")]
    [kept] = drain_decisions.keep_blocked(workers, "waiting: pods x are not ready")
    assert kept.state == specs.WorkerState.KEPT and not kept.removable
    assert kept.message == "drained: the scheduler retired the worker; pod kept at spec.timeout, pods x are not ready"


def test_a_pod_named_twice_is_removed_once() -> None:
    twice = [
        specs.WorkerStatus(pod="p", state=specs.WorkerState.DRAINING, removable=True),
        specs.WorkerStatus(pod="p", state=specs.WorkerState.DRAINING, removable=True),
        specs.WorkerStatus(pod="q", state=specs.WorkerState.DRAINING, removable=True),
    ]
    assert drain_decisions.to_remove(twice) == ["p", "q"]


def test_a_failed_request_keeps_every_pod_whose_removal_was_not_ordered() -> None:
    workers = [
        draining("a", A, 10),
        drained("b"),
        drained("c"),
        specs.WorkerStatus(pod="d", state=specs.WorkerState.RETIRED, removable=True, podRemoved=True),
    ]
    kept = drain_decisions.keep_unfinished(workers, "SecretUnusable: gone", ordered=["c"])
    assert [(w.pod, w.state, w.removable) for w in kept] == [
        ("a", specs.WorkerState.KEPT, False),
        ("b", specs.WorkerState.KEPT, False),
        ("c", specs.WorkerState.DRAINING, True),
        ("d", specs.WorkerState.RETIRED, True),
    ]
    assert kept[1].message == "drained: the scheduler retired the worker; pod kept: SecretUnusable: gone"


C0, C1 = "tcp://10.0.0.3:4000", "tcp://10.0.0.3:4001"  # one pod, dask worker --nworkers 2, no --name
PODS = [snapshots.PodInfo("pc", ips=("10.0.0.3",)), snapshots.PodInfo("pb", ips=("10.0.0.2",))]
TWO_BEFORE = snap([(C0, C0, 10, 1), (C1, C1, 20, 1), ("pb", B, 0, 0)], {"x": (C0,), "y": (C1,)}, {"x": 10, "y": 20})


@pytest.mark.parametrize(
    ("after", "retired", "state", "removable", "moved"),
    [
        pytest.param(
            snap([("pb", B, 30, 2)], {"x": (B,), "y": (B,)}, {"x": 10, "y": 20}),
            [C0, C1],
            specs.WorkerState.DRAINING,
            True,
            30,
            id="both-retired",
        ),
        pytest.param(
            snap([(C1, C1, 20, 1), ("pb", B, 10, 1)], {"x": (B,), "y": (C1,)}, {"x": 10, "y": 20}),
            [C0],
            specs.WorkerState.KEPT,
            False,
            10,
            id="one-left-holding-data",
        ),
    ],
)
def test_a_pod_with_several_workers_is_removable_only_when_all_are_drained(
    after: snapshots.SchedulerSnapshot, retired: list[str], state: specs.WorkerState, removable: bool, moved: int
) -> None:
    [entry] = [drain_decisions.entry("pc", snapshots.workers_by_pod(PODS, TWO_BEFORE.workers)["pc"])]
    assert (entry.address, entry.addresses, entry.uniqueBytes) == (C0, [C0, C1], 30)
    [worker] = drain_decisions.judge_drain(
        [entry],
        before=TWO_BEFORE,
        after=after,
        retired=retired,
        timed_out=False,
        on_timeout=specs.OnTimeout.ABORT,
        located=snapshots.workers_by_pod(PODS, after.workers),
    )
    assert (worker.state, worker.removable, worker.bytesMoved) == (state, removable, moved)


def test_a_chosen_running_pod_without_an_identifiable_worker_is_kept_with_the_cause() -> None:
    entry = drain_decisions.entry("silent", (), unknown=True)
    assert entry.state == specs.WorkerState.KEPT and not entry.removable
    assert "no connected worker has their IP" in entry.message


@pytest.mark.parametrize(
    ("nbytes", "shown"),
    [
        pytest.param(0, "0", id="nothing"),
        pytest.param(512, "512", id="bytes"),
        pytest.param(134217728, "128Mi", id="exact-mebibytes"),
        pytest.param(3 * 2**29, "1.5Gi", id="one-decimal-below-ten"),
        pytest.param(150_000_000, "143Mi", id="rounded"),
        pytest.param(5 * 2**40, "5Ti", id="tebibytes"),
    ],
)
def test_moved_bytes_are_shown_as_a_quantity(nbytes: int, shown: str) -> None:
    assert drain_decisions.quantity(nbytes) == shown
    status = specs.RetirementRequestStatus(workers=[specs.WorkerStatus(pod="a", bytesMoved=nbytes)])
    assert drain_decisions.conclude(status, requested=1, at="2026-01-01T00:00:00Z").moved == shown


R, S = specs.WorkerReason, specs.WorkerState
DRAINED = "drained: the scheduler retired the worker"
WHY_TIMEOUT = "the drain did not finish within spec.timeout (the scheduler may still finish it)"
WHY_NOWHERE = "the scheduler could not retire the worker: its unique data had nowhere to go"
DIED = (
    "the worker left the scheduler during the drain (it died): 7 bytes (1 keys) that had not moved yet were"
    " lost with it"
)


FAILED = {"kept": specs.KeptReason.REQUEST_FAILED, "keptDetail": "SecretUnusable: gone"}
BLOCKED = {"kept": specs.KeptReason.REMOVAL_BLOCKED, "keptDetail": "pods x are not ready"}
HELD = "30 bytes (1 keys) that exist nowhere else"
UNREACHABLE = "the scheduler was unreachable until spec.timeout (refused)"
# id: (state, removable, pod removed, cause, message)
RENDERED = {
    "draining": (S.DRAINING, False, False, cause(R.DRAINING), "draining"),
    "no-worker": (S.DRAINING, False, False, cause(R.NO_WORKER), "no connected worker, nothing to drain"),
    "no-worker-removing": (
        *(S.DRAINING, True, False, cause(R.NO_WORKER)),
        "no connected worker, nothing to drain; removing its pod",
    ),
    "drained-removing": (*(S.DRAINING, True, False, cause(R.DRAINED)), f"{DRAINED}; removing its pod"),
    "drained-removed": (*(S.RETIRED, True, True, cause(R.DRAINED)), f"{DRAINED}; its pod was removed"),
    "died-removing": (
        *(S.DRAINING, True, False, cause(R.DIED, 7)),
        f"{DIED}; its pod holds no unique data now; removing its pod",
    ),
    "died-removed": (
        *(S.RETIRED, True, True, cause(R.DIED, 7)),
        f"{DIED}; its pod holds no unique data now; its pod was removed",
    ),
    "kept-nowhere-to-go": (
        *(S.KEPT, False, False, cause(R.NOWHERE_TO_GO, 30)),
        f"{WHY_NOWHERE}; kept its pod, which holds {HELD}",
    ),
    "kept-timed-out": (
        *(S.KEPT, False, False, cause(R.TIMED_OUT, 30)),
        f"{WHY_TIMEOUT}; kept its pod, which holds {HELD}",
    ),
    "forced-removing": (
        *(S.FORCED, True, False, cause(R.TIMED_OUT, 30)),
        f"{WHY_TIMEOUT}; onTimeout is Force: removing the pod with {HELD}",
    ),
    "forced-removed": (
        *(S.FORCED, True, True, cause(R.NOWHERE_TO_GO, 30)),
        f"{WHY_NOWHERE}; onTimeout is Force: removed the pod with {HELD}",
    ),
    "unreachable-kept": (
        *(S.KEPT, False, False, cause(R.UNREACHABLE, 30, detail="refused")),
        f"{UNREACHABLE}; kept the pod, since nothing confirms that its data moved",
    ),
    "unreachable-forced-removed": (
        *(S.FORCED, True, True, cause(R.UNREACHABLE, 30, detail="refused")),
        f"{UNREACHABLE}; onTimeout is Force: removed the pod; up to 30 bytes may be lost",
    ),
    "kept-request-failed": (
        *(S.KEPT, False, False, cause(R.DRAINED, **FAILED)),
        f"{DRAINED}; pod kept: SecretUnusable: gone",
    ),
    "kept-removal-blocked": (
        *(S.KEPT, False, False, cause(R.DIED, 7, **BLOCKED)),
        f"{DIED}; pod kept at spec.timeout, pods x are not ready",
    ),
    "unidentified": (S.KEPT, False, False, cause(R.UNIDENTIFIED), drain_decisions.unidentified_message(["p"])),
}


@pytest.mark.parametrize(("state", "removable", "removed", "worker_cause", "message"), RENDERED.values(), ids=RENDERED)
def test_a_workers_message_is_rendered_from_its_cause(
    state: specs.WorkerState, removable: bool, removed: bool, worker_cause: specs.WorkerCause, message: str
) -> None:
    worker = specs.WorkerStatus(pod="p", state=state, removable=removable, podRemoved=removed, cause=worker_cause)
    assert drain_decisions.render(worker) == message


def test_a_status_written_before_causes_keeps_its_message() -> None:
    legacy = specs.WorkerStatus(pod="p", state=S.DRAINING, removable=True, message="drained; removing its pod")
    [removed] = drain_decisions.mark_removed([legacy], ["p"])
    assert (removed.state, removed.podRemoved, removed.message) == (S.RETIRED, True, "drained; removing its pod")
    [kept] = drain_decisions.keep_blocked([legacy], "waiting: pods x are not ready")
    assert (kept.state, kept.removable, kept.message) == (S.KEPT, False, "drained; removing its pod")


def test_the_cause_survives_a_round_trip_through_the_status() -> None:
    [worker] = drain_decisions.judge_unreachable([draining("pa", A, 30)], on_timeout=specs.OnTimeout.FORCE, reason="x")
    again = specs.WorkerStatus.model_validate(worker.model_dump(mode="json", exclude_none=True))
    [removed] = drain_decisions.mark_removed([again], ["pa"])
    assert removed.cause == specs.WorkerCause(reason=R.UNREACHABLE, bytes=30, detail="x")
    assert "removed the pod; up to 30 bytes may be lost" in removed.message
