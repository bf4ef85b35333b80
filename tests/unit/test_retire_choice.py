"""Which workers a RetirementRequest with ``count`` retires: the cheapest pods, never one that may hide data."""

import pytest

from memops.decisions import retire_choice, snapshots
from tests.unit.test_snapshots import PODS, snapshot


@pytest.mark.parametrize(
    ("pods", "workers", "count", "exclude", "expected"),
    [
        pytest.param(
            ["a", "b", "c"], [("a", 30, 30), ("b", 10, 10), ("c", 20, 20)], 2, (), ["b", "c"], id="fewest-unique-bytes"
        ),
        pytest.param(["a", "b", "new"], [("a", 0, 0), ("b", 5, 5)], 1, (), ["new"], id="unconnected-pod-first"),
        pytest.param(["a", "b"], [("a", 10, 900), ("b", 10, 100)], 1, (), ["b"], id="tie-broken-by-managed-bytes"),
        pytest.param(["b", "a"], [("a", 10, 10), ("b", 10, 10)], 1, (), ["a"], id="tie-broken-by-name"),
        pytest.param(
            ["a", "b", "c"], [("a", 1, 1), ("b", 2, 2), ("c", 3, 3)], 2, ("a",), ["b", "c"], id="claimed-excluded"
        ),
        pytest.param(["a", "b"], [("a", 1, 1), ("b", 2, 2)], 5, (), ["a", "b"], id="fewer-candidates-than-count"),
        pytest.param(["a"], [("a", 1, 1)], 0, (), [], id="count-zero"),
        pytest.param(["a"], [("a", 1, 1)], -1, (), [], id="count-negative"),
        pytest.param(["z-new", "a", "b-new"], [("a", 0, 0)], 3, (), ["b-new", "z-new", "a"], id="unconnected-by-name"),
        pytest.param(["a", "new"], [("a", 0, 0)], 1, ("new",), ["a"], id="claimed-unconnected-excluded"),
        pytest.param(["a", "b"], [("a", 1, 1), ("b", 2, 2)], 2, ("a", "b"), [], id="all-claimed"),
        pytest.param(["b"], [("a", 0, 0), ("b", 9, 9)], 1, (), ["b"], id="only-pods-of-the-workload"),
    ],
)
def test_choose_workers(
    pods: list[str], workers: list[tuple[str, int, int]], count: int, exclude: tuple[str, ...], expected: list[str]
) -> None:
    assert retire_choice.choose_workers(pods, snapshot(*workers), count, exclude=exclude) == expected


def test_choose_workers_at_a_thousand_workers() -> None:
    """Pods without a worker first, claimed pods never; its cost is measured in bench/decision_cost.py."""
    names = [f"w-{i}" for i in range(1000)]
    workers = tuple(
        snapshots.WorkerInfo(name=n, address=f"tcp://{n}", unique_bytes=1000 * (i * 7919 % 1000), unique_keys=1000)
        for i, n in enumerate(names)
    )
    snap = snapshots.SchedulerSnapshot(workers=workers)
    pods = [*names, *(f"pending-{i}" for i in range(50))]
    chosen = retire_choice.choose_workers(pods, snap, 100, exclude=names[:10])
    assert chosen[:50] == sorted(f"pending-{i}" for i in range(50))
    assert len(chosen) == 100 and not set(chosen) & set(names[:10])
    cheapest = sorted(names[10:], key=lambda n: (snap.by_name(n).unique_bytes, n))  # type: ignore[union-attr]
    assert chosen[50:] == cheapest[:50]


def test_workers_in_a_shuffle_come_last_when_another_would_do() -> None:
    snap = snapshots.SchedulerSnapshot(
        workers=(
            snapshots.WorkerInfo(name="busy", address="tcp://busy", unique_bytes=0, in_shuffle=True),
            snapshots.WorkerInfo(name="full", address="tcp://full", unique_bytes=10**9),
        )
    )
    assert retire_choice.choose_workers(["busy", "full"], snap, 1) == ["full"]
    assert retire_choice.choose_workers(["busy", "full"], snap, 2) == ["full", "busy"], (
        "when needed, it is still chosen"
    )


def test_a_running_pod_without_an_identifiable_worker_is_never_chosen_as_empty() -> None:
    workers = [
        snapshots.WorkerInfo("tcp://10.0.0.1:4000", "tcp://10.0.0.1:4000", unique_bytes=10),
        snapshots.WorkerInfo("two-0", "tcp://10.0.0.2:4000", unique_bytes=3),
        snapshots.WorkerInfo("two-1", "tcp://10.0.0.2:4001", unique_bytes=9),
        snapshots.WorkerInfo("group-worker-x", "tcp://10.0.0.3:4000", unique_bytes=1),
    ]
    located = snapshots.workers_by_pod(PODS, workers)
    unknown = retire_choice.unidentified(PODS, located)
    assert unknown == ["silent"], "Pending and terminated pods run no worker; only a Running one may hide data"
    names = [p.name for p in PODS if p.phase != "Failed"]
    chosen = retire_choice.choose_workers(
        names, snapshots.SchedulerSnapshot(tuple(workers)), 5, unknown, located=located
    )
    # The pending pod holds nothing; a pod with two workers costs their sum (12 > 10).
    assert chosen == ["pending", "by-name", "by-ip", "two"]
