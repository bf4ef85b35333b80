"""Which departures the agent records are new losses of a policy's workload, whose pod, and why."""

from __future__ import annotations

import datetime
from typing import Any

import pytest

from memops import specs
from memops.decisions import timestamps, worker_loss_decisions

DEPLOYMENT = specs.WorkloadRef(kind=specs.WorkloadKind.DEPLOYMENT, name="dask-worker")
T0 = 1_800_000_000.0  # the departures' time (the scheduler's clock)


def at(seconds: float) -> str:
    return timestamps.render(datetime.datetime.fromtimestamp(seconds, datetime.UTC))


def record(**fields: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "address": "tcp://10.1.0.7:40000",
        "name": "tcp://10.1.0.7:40000",  # the Dask Helm chart's workers: no --name
        "time": T0,
        "keys": 3,
        "bytes": 300,
        "irreplaceableKeys": 2,
        "drain": "",
    }
    entry.update(fields)
    return entry


def terminated(reason: str, finished: float, code: int = 137) -> dict[str, Any]:
    return {"terminated": {"reason": reason, "exitCode": code, "finishedAt": at(finished)}}


def pod(
    name: str = "dask-worker-6d9f8-abcde",
    ip: str = "10.1.0.7",
    *,
    last: dict[str, Any] | None = None,
    state: dict[str, Any] | None = None,
    reason: str = "",
    phase: str = "Running",
    deleting: bool = False,
    restarts: int = 1,
    env: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name}
    if deleting:
        metadata["deletionTimestamp"] = at(T0)
    status: dict[str, Any] = {
        "phase": phase,
        "podIP": ip,
        "containerStatuses": [
            {"name": "worker", "restartCount": restarts, "state": state or {"running": {}}, "lastState": last or {}}
        ],
    }
    if reason:
        status["reason"] = reason
    return {"metadata": metadata, "spec": {"containers": [{"name": "worker", "env": env or []}]}, "status": status}


def decide(
    records: list[dict[str, Any]],
    pods: list[dict[str, Any]],
    previous: list[specs.WorkerLoss] | None = None,
    *,
    now: float = T0 + 60,
    since: float = 0.0,
    known: dict[str, str] | None = None,
    limit: int = worker_loss_decisions.KEPT,
) -> worker_loss_decisions.Decision:
    return worker_loss_decisions.decide(
        worker_loss_decisions.parse(records),
        pods,
        DEPLOYMENT,
        previous or [],
        now=now,
        since=since,
        known=known,
        limit=limit,
    )


@pytest.mark.parametrize(
    ("the_pod", "reason", "exit_code"),
    [
        pytest.param(pod(last=terminated("OOMKilled", T0 + 1)), "OOMKilled", 137, id="oom-killed-and-restarted"),
        pytest.param(pod(state=terminated("OOMKilled", T0)), "OOMKilled", 137, id="oom-killed-not-restarted-yet"),
        pytest.param(
            # Under cgroup v1 the kernel kills the biggest process: the container may exit 0, still OOMKilled.
            pod(last=terminated("OOMKilled", T0, code=0)),
            "OOMKilled",
            0,
            id="oom-killed-exit-0",
        ),
        pytest.param(pod(last=terminated("Error", T0 - 2, code=1)), "Error", 1, id="container-error"),
        pytest.param(
            pod(state=terminated("Error", T0), reason="Evicted", phase="Failed"), "Evicted", 137, id="evicted"
        ),
        pytest.param(pod(deleting=True), "Deleted", None, id="being-deleted"),
        pytest.param(
            pod(deleting=True, state=terminated("OOMKilled", T0)), "OOMKilled", 137, id="oom-killed-while-deleted"
        ),
        pytest.param(None, "Deleted", None, id="gone"),
        pytest.param(pod(), "Unknown", None, id="container-kept-running"),
        pytest.param(
            # A restart long before says nothing of this departure (a nanny's kill inside a running container).
            pod(last=terminated("OOMKilled", T0 - 3600)),
            "Unknown",
            None,
            id="an-old-restart",
        ),
    ],
)
def test_the_reason_comes_from_the_pod(the_pod: dict[str, Any] | None, reason: str, exit_code: int | None) -> None:
    assert worker_loss_decisions.reason_of(the_pod, T0) == (reason, exit_code)


def test_an_oom_killed_worker_is_recorded_with_its_pod_reason_and_figures() -> None:
    decision = decide([record()], [pod(last=terminated("OOMKilled", T0 + 1), restarts=2)])
    loss = specs.WorkerLoss(
        pod="dask-worker-6d9f8-abcde",
        time=at(T0),
        reason="OOMKilled",
        exitCode=137,
        keys=3,
        bytes=300,
        irreplaceableKeys=2,
    )
    assert decision.losses == decision.new == [loss]
    assert decision.settled == T0
    assert decision.messages == [
        f"the worker in pod dask-worker-6d9f8-abcde left at {at(T0)}: OOMKilled (exit code 137, 2 restarts);"
        " it took 3 keys (300 bytes) held nowhere else, 2 of which cannot be recomputed"
    ]


@pytest.mark.parametrize(
    ("records", "pods", "known", "found"),
    [
        pytest.param([record()], [pod()], {}, "dask-worker-6d9f8-abcde", id="by-the-pod-ip"),
        pytest.param(
            [record(address="tcp://10.9.9.9:1", name="dask-worker-6d9f8-abcde")],
            [pod(ip="10.1.0.7")],
            {},
            "dask-worker-6d9f8-abcde",
            id="by-the-pods-name",
        ),
        pytest.param(
            [record(address="tcp://10.9.9.9:1", name="group-worker-a")],
            [pod(env=[{"name": "DASK_WORKER_NAME", "value": "group-worker-a"}])],
            {},
            "dask-worker-6d9f8-abcde",
            id="by-dask-worker-name",
        ),
        pytest.param(
            [record()], [], {"tcp://10.1.0.7:40000": "dask-worker-6d9f8-zzzzz"}, "dask-worker-6d9f8-zzzzz", id="known"
        ),
        pytest.param(
            [record(name="dask-worker-6d9f8-yyyyy")], [], {}, "dask-worker-6d9f8-yyyyy", id="gone-named-after-its-pod"
        ),
        pytest.param(
            # The pod of another Deployment, found by the last tenancy check: not this policy's.
            [record()],
            [],
            {"tcp://10.1.0.7:40000": "dask-worker-big-6d9f8-zzzzz"},
            None,
            id="another-workloads-pod",
        ),
        pytest.param([record()], [], {}, None, id="nobody-knows"),
        pytest.param(
            # A terminated pod keeps its IP until a live pod of the workload takes it.
            [record()],
            [pod("dask-worker-6d9f8-old", phase="Failed"), pod("dask-worker-6d9f8-new")],
            {},
            "dask-worker-6d9f8-new",
            id="a-live-pod-first",
        ),
    ],
)
def test_a_record_is_matched_to_its_pod(
    records: list[dict[str, Any]], pods: list[dict[str, Any]], known: dict[str, str], found: str | None
) -> None:
    decision = decide(records, pods, known=known)
    assert [loss.pod for loss in decision.losses] == ([found] if found else [])
    assert decision.settled == T0  # decided either way


@pytest.mark.parametrize(
    "entry",
    [
        pytest.param(record(drain="draining"), id="memops-drain-reports-worker-left"),
        pytest.param(record(drain="deadline"), id="memops-drain-reports-lost-at-deadline"),
        pytest.param(record(keys=0, bytes=0, irreplaceableKeys=0), id="nothing-lost"),
        pytest.param(record(time=T0 - 10), id="before-since"),
    ],
)
def test_what_is_not_a_new_loss(entry: dict[str, Any]) -> None:
    decision = decide([entry], [pod(last=terminated("OOMKilled", T0))], since=T0 - 5)
    assert decision.losses == decision.new == []


@pytest.mark.parametrize(
    "entry",
    [
        pytest.param("not a map", id="not-a-map"),
        pytest.param(record(address=7), id="address-not-text"),
        pytest.param(record(name=None), id="name-not-text"),
        pytest.param(record(keys=-1), id="negative"),
        pytest.param(record(bytes=True), id="bool"),
        pytest.param(record(keys=2**64), id="too-large"),
        pytest.param(record(time="now"), id="time-not-a-number"),
        pytest.param(record(time=2**40), id="time-out-of-range"),
        pytest.param(record(drain=["x"]), id="drain-not-text"),
        pytest.param({k: v for k, v in record().items() if k != "bytes"}, id="missing-field"),
    ],
)
def test_a_hostile_record_is_skipped(entry: Any) -> None:
    assert worker_loss_decisions.parse([entry, record(address="tcp://10.1.0.8:1")])[0].address == "tcp://10.1.0.8:1"


def test_hostile_figures_are_bounded() -> None:
    (parsed,) = worker_loss_decisions.parse([record(address="x" * 10_000, keys=2, irreplaceableKeys=9)])
    assert len(parsed.address) == worker_loss_decisions.TEXT
    assert parsed.irreplaceable == 2  # never more than the keys
    assert worker_loss_decisions.parse({"not": "a list"}) == []


def test_a_loss_is_recorded_once_across_passes_and_restarts() -> None:
    pods = [pod(last=terminated("OOMKilled", T0))]
    first = decide([record()], pods)
    # The next pass, or a restarted operator (settled back at the policy's creation): nothing new.
    again = decide([record()], pods, first.losses)
    assert again.losses == first.losses and again.new == [] and again.messages == []


def test_the_latest_are_kept_and_a_dropped_one_is_not_counted_again() -> None:
    pods = [pod(f"dask-worker-6d9f8-{i}", f"10.1.0.{i}", last=terminated("OOMKilled", T0 + i)) for i in range(4)]
    records = [record(address=f"tcp://10.1.0.{i}:1", time=T0 + i) for i in range(3)]
    kept = decide(records, pods, limit=2).losses
    assert [loss.pod for loss in kept] == ["dask-worker-6d9f8-1", "dask-worker-6d9f8-2"]  # newest last
    assert decide(records, pods, kept, limit=2).new == []
    newer = decide([*records, record(address="tcp://10.1.0.3:1", time=T0 + 3)], pods, kept, limit=2)
    assert [loss.pod for loss in newer.new] == ["dask-worker-6d9f8-3"]
    assert [loss.pod for loss in newer.losses] == ["dask-worker-6d9f8-2", "dask-worker-6d9f8-3"]


def test_two_workers_of_one_pod_that_left_together_are_one_entry() -> None:
    records = [record(), record(address="tcp://10.1.0.7:40001", keys=1, bytes=5, irreplaceableKeys=0)]
    (loss,) = decide(records, [pod(last=terminated("OOMKilled", T0))]).losses
    assert (loss.keys, loss.bytes, loss.irreplaceableKeys) == (4, 305, 2)


def test_a_pod_that_does_not_say_why_yet_is_waited_for() -> None:
    """The kubelet reports a container's end a moment after the scheduler saw its worker go."""
    later = record(address="tcp://10.1.0.8:1", time=T0 + 1)
    pods = [pod(), pod("dask-worker-6d9f8-other", "10.1.0.8", last=terminated("OOMKilled", T0 + 1))]
    early = decide([record(), later], pods, now=T0 + 5)
    # The second is recorded; the first waits, and holds back how far the records are decided.
    assert [loss.pod for loss in early.losses] == ["dask-worker-6d9f8-other"] and early.settled == 0.0
    reported = [pod(last=terminated("OOMKilled", T0)), pods[1]]
    assert [loss.reason for loss in decide([record(), later], reported, early.losses, now=T0 + 6).new] == ["OOMKilled"]
    unknown = decide([record(), later], pods, early.losses, now=T0 + worker_loss_decisions.SETTLE_SECONDS + 1)
    assert [loss.reason for loss in unknown.new] == ["Unknown"] and unknown.settled == T0 + 1


def test_new_losses_are_those_the_old_status_did_not_list() -> None:
    one, two = (
        specs.WorkerLoss(pod=p, time=at(T0), reason="OOMKilled", keys=1, bytes=1, irreplaceableKeys=0)
        for p in ("a", "b")
    )
    assert worker_loss_decisions.new_losses([one], [one, two]) == [two]
    assert worker_loss_decisions.new_losses([one, two], [two]) == []
