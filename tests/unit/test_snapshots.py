"""The scheduler snapshot model: who holds what, which worker is which pod's, what moved or was lost."""

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
