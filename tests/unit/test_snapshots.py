"""Which workers to retire, and what moved or was lost: pure functions over scheduler snapshots."""

import pytest

from memops.decisions import snapshots


def snapshot(
    *workers: tuple[str, int, int], who_has: dict[str, tuple[str, ...]] | None = None
) -> snapshots.SchedulerSnapshot:
    """Workers as (name, unique bytes, managed bytes); the address is tcp://<name>."""
    return snapshots.SchedulerSnapshot(
        workers=tuple(
            snapshots.WorkerInfo(name=n, address=f"tcp://{n}", unique_bytes=u, managed_bytes=m) for n, u, m in workers
        ),
        who_has=who_has or {},
    )


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
    assert snapshots.choose_workers(pods, snapshot(*workers), count, exclude=exclude) == expected


def test_holdings_count_only_single_copies_as_unique() -> None:
    who_has = {"x": ("tcp://a",), "y": ("tcp://a", "tcp://b"), "z": ("tcp://b",), "gone": ()}
    nbytes = {"x": 10, "y": 100, "z": 7}
    assert snapshots.holdings(who_has, nbytes) == {"tcp://a": (110, 2, 10, 1), "tcp://b": (107, 2, 7, 1)}


BEFORE = {"x": ("tcp://a",), "y": ("tcp://a",), "z": ("tcp://a", "tcp://b"), "w": ("tcp://b",)}
NBYTES = {"x": 10, "y": 20, "z": 40, "w": 80}


@pytest.mark.parametrize(
    ("after", "moved", "lost"),
    [
        pytest.param(
            {"x": ("tcp://b",), "y": ("tcp://c",), "z": ("tcp://b",), "w": ("tcp://b",)},
            (30, 2),
            (0, 0),
            id="all-moved",
        ),
        pytest.param(
            {"x": ("tcp://b",), "y": (), "z": ("tcp://b",), "w": ("tcp://b",)}, (10, 1), (20, 1), id="one-lost"
        ),
        pytest.param(
            {"x": ("tcp://a",), "y": ("tcp://a",), "z": ("tcp://a", "tcp://b")},
            (0, 0),
            (0, 0),
            id="still-only-there-is-neither",
        ),
        pytest.param(
            {"x": ("tcp://a", "tcp://b"), "y": ("tcp://a",), "z": ()}, (10, 1), (0, 0), id="copied-but-not-dropped-yet"
        ),
        pytest.param({"z": ("tcp://b",), "w": ("tcp://b",)}, (0, 0), (30, 2), id="forgotten-counts-as-lost"),
        pytest.param({"x": (), "y": (), "z": (), "w": ()}, (0, 0), (30, 2), id="no-holder-left"),
    ],
)
def test_bytes_moved_and_lost(after: dict[str, tuple[str, ...]], moved: tuple[int, int], lost: tuple[int, int]) -> None:
    assert snapshots.bytes_moved(BEFORE, after, NBYTES, "tcp://a") == moved
    assert snapshots.bytes_lost(BEFORE, after, NBYTES, "tcp://a") == lost


def test_bytes_moved_ignores_keys_that_had_replicas_before() -> None:
    """Key z had a copy on b before: retiring a never put it at risk, so it is neither moved nor lost."""
    after = {"z": ("tcp://b",)}
    assert snapshots.bytes_moved(BEFORE, after, NBYTES, "tcp://a") == (0, 0)
    assert snapshots.bytes_lost({"z": BEFORE["z"]}, {}, NBYTES, "tcp://a") == (0, 0)


def test_lookups_by_name_and_address() -> None:
    snap = snapshot(("a", 1, 1), ("b", 2, 2))
    assert snap.by_name("b") == snap.by_address("tcp://b") == snap.workers[1]
    assert snap.by_name("tcp://b") is None and snap.by_address("b") is None and snap.by_name("zz") is None


def test_choose_workers_at_a_thousand_workers() -> None:
    """Pods without a worker first, claimed pods never; its cost is measured in bench/decision_cost.py."""
    names = [f"w-{i}" for i in range(1000)]
    workers = tuple(
        snapshots.WorkerInfo(name=n, address=f"tcp://{n}", unique_bytes=1000 * (i * 7919 % 1000), unique_keys=1000)
        for i, n in enumerate(names)
    )
    snap = snapshots.SchedulerSnapshot(workers=workers)
    pods = [*names, *(f"pending-{i}" for i in range(50))]
    chosen = snapshots.choose_workers(pods, snap, 100, exclude=names[:10])
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
    assert snapshots.choose_workers(["busy", "full"], snap, 1) == ["full"]
    assert snapshots.choose_workers(["busy", "full"], snap, 2) == ["full", "busy"], "when needed, it is still chosen"


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        pytest.param(["('shuffle-transfer-1a2b', 3)"], True, id="transfer"),
        pytest.param(["shuffle-barrier-1a2b"], True, id="barrier"),
        pytest.param(["('sum-agg-9f', 0)", "x"], False, id="other-tasks"),
        pytest.param([], False, id="idle"),
    ],
)
def test_in_shuffle(keys: list[str], expected: bool) -> None:
    assert snapshots.in_shuffle(keys) is expected


PODS = [
    snapshots.PodInfo("by-ip", ips=("10.0.0.1",)),
    snapshots.PodInfo("two", ips=("10.0.0.2",)),
    snapshots.PodInfo("by-name", ips=("10.0.0.3",), worker_names=("group-worker-x",)),
    snapshots.PodInfo("silent", ips=("10.0.0.4",)),
    snapshots.PodInfo("pending", ips=("10.0.0.5",), phase="Pending"),
    snapshots.PodInfo("old", ips=("10.0.0.6",), phase="Failed"),
]


@pytest.mark.parametrize(
    ("worker", "pod"),
    [
        pytest.param(snapshots.WorkerInfo("tcp://10.0.0.1:4000", "tcp://10.0.0.1:4000"), "by-ip", id="unnamed-by-ip"),
        pytest.param(snapshots.WorkerInfo("two-0", "tcp://10.0.0.2:4000"), "two", id="nworkers-first"),
        pytest.param(snapshots.WorkerInfo("two-1", "tcp://10.0.0.2:4001"), "two", id="nworkers-second"),
        pytest.param(snapshots.WorkerInfo("silent", "tcp://10.0.0.1:4002"), "by-ip", id="address-beats-name"),
        pytest.param(snapshots.WorkerInfo("group-worker-x", "tcp://127.0.0.1:1"), "by-name", id="dask-worker-name"),
        pytest.param(snapshots.WorkerInfo("x", "tcp://10.0.0.6:4000"), None, id="terminated-pod-owns-no-ip"),
    ],
)
def test_workers_by_pod(worker: snapshots.WorkerInfo, pod: str | None) -> None:
    located = snapshots.workers_by_pod(PODS, [worker])
    assert [p for p, ws in located.items() if worker in ws] == ([pod] if pod else [])


def test_a_running_pod_without_an_identifiable_worker_is_never_chosen_as_empty() -> None:
    workers = [
        snapshots.WorkerInfo("tcp://10.0.0.1:4000", "tcp://10.0.0.1:4000", unique_bytes=10),
        snapshots.WorkerInfo("two-0", "tcp://10.0.0.2:4000", unique_bytes=3),
        snapshots.WorkerInfo("two-1", "tcp://10.0.0.2:4001", unique_bytes=9),
        snapshots.WorkerInfo("group-worker-x", "tcp://10.0.0.3:4000", unique_bytes=1),
    ]
    located = snapshots.workers_by_pod(PODS, workers)
    unknown = snapshots.unidentified(PODS, located)
    assert unknown == ["silent"], "Pending and terminated pods run no worker; only a Running one may hide data"
    names = [p.name for p in PODS if p.phase != "Failed"]
    chosen = snapshots.choose_workers(names, snapshots.SchedulerSnapshot(tuple(workers)), 5, unknown, located=located)
    # The pending pod holds nothing; a pod with two workers costs their sum (12 > 10).
    assert chosen == ["pending", "by-name", "by-ip", "two"]


@pytest.mark.parametrize(
    ("address", "host"),
    [
        pytest.param("tcp://10.0.0.1:8786", "10.0.0.1", id="tcp"),
        pytest.param("tls://[fd00::0:1]:8786", "fd00::1", id="ipv6-canonical"),
        pytest.param("tcp://dask-worker-0:8786", "dask-worker-0", id="hostname"),
    ],
)
def test_address_host(address: str, host: str) -> None:
    assert snapshots.address_host(address) == host


def test_nodes_of_workers_for_recipients_off_a_dying_node() -> None:
    pods = [
        snapshots.PodInfo("a", ips=("10.0.0.1",), node="node-a"),
        snapshots.PodInfo("b", ips=("10.0.0.2",), node="node-b"),
        snapshots.PodInfo("unscheduled", ips=(), phase="Pending"),
        snapshots.PodInfo("old", ips=("10.0.0.3",), phase="Failed", node="node-a"),
    ]
    workers = [
        snapshots.WorkerInfo("a", "tcp://10.0.0.1:4000"),
        snapshots.WorkerInfo("a-1", "tcp://10.0.0.1:4001"),
        snapshots.WorkerInfo("b", "tcp://10.0.0.2:4000"),
        snapshots.WorkerInfo("stranger", "tcp://10.9.9.9:4000"),
    ]
    assert snapshots.nodes_of_workers(pods, workers) == {
        "tcp://10.0.0.1:4000": "node-a",
        "tcp://10.0.0.1:4001": "node-a",
        "tcp://10.0.0.2:4000": "node-b",
    }
