"""The tenancy rule: a resource acts only on a scheduler whose workers are all pods of its namespace, by IP."""

from typing import Any

import pytest

from memops.controllers import workloads
from memops.decisions import snapshots, tenancy

W = snapshots.WorkerInfo


def pod(name: str, *ips: str, phase: str = "Running") -> snapshots.PodInfo:
    return snapshots.PodInfo(name=name, ips=ips, phase=phase)


MINE = [pod("w-a", "10.0.0.1"), pod("w-b", "10.0.0.2")]


@pytest.mark.parametrize(
    ("workers", "pods", "reason", "foreign"),
    [
        pytest.param(
            [W("w-a", "tcp://10.0.0.1:4000"), W("w-b", "tcp://10.0.0.2:4000")], MINE, "TenantScheduler", (), id="ours"
        ),
        pytest.param(
            [W("x", "tcp://10.0.0.1:4000"), W("y", "tcp://10.0.0.1:4001")],
            MINE,
            "TenantScheduler",
            (),
            id="nworkers-2-unnamed",
        ),
        pytest.param([], MINE, "NoWorkers", (), id="no-workers"),
        pytest.param(
            # Named like our pods, but at another tenant's addresses: names prove nothing.
            [W("w-a", "tcp://10.9.0.1:4000"), W("w-b", "tcp://10.0.0.2:4000")],
            MINE,
            "ForeignScheduler",
            ("tcp://10.9.0.1:4000",),
            id="same-name-other-ip",
        ),
        pytest.param(
            [W("w-a", "tcp://10.0.0.1:4000")],
            [pod("w-a", "10.0.0.1", phase="Succeeded")],
            "ForeignScheduler",
            ("tcp://10.0.0.1:4000",),
            id="terminated-pod-owns-no-ip",
        ),
        pytest.param(
            [W("v6", "tls://[fd00::0:1]:8786")],
            [pod("v6", "10.0.0.9", "fd00::1")],
            "TenantScheduler",
            (),
            id="ipv6-second-pod-ip",
        ),
        pytest.param([W("n", "tcp://localhost:1")], MINE, "ForeignScheduler", ("tcp://localhost:1",), id="hostname"),
    ],
)
def test_check(
    workers: list[snapshots.WorkerInfo], pods: list[snapshots.PodInfo], reason: str, foreign: tuple[str, ...]
) -> None:
    verdict = tenancy.check(workers, pods, "team-a")
    assert (verdict.reason.value, verdict.foreign) == (reason, foreign)
    assert verdict.allowed is (reason == "TenantScheduler")


def test_the_message_counts_the_foreign_workers_and_names_none() -> None:
    """The message lands in a status: the addresses of workers that may be another tenant's stay
    out of it (the verdict keeps them, for the operator's log)."""
    workers = [W(f"x{i}", f"tcp://10.9.0.{i}:4000") for i in range(5)] + [W("w-a", "tcp://10.0.0.1:4000")]
    verdict = tenancy.check(workers, MINE, "team-a")
    assert verdict.message.startswith("5 of the scheduler's 6 workers are not pods of namespace team-a")
    assert "10.9.0." not in verdict.message
    assert verdict.foreign == tuple(f"tcp://10.9.0.{i}:4000" for i in range(5))


NODE_IP = "10.1.0.5"


def raw_pod(ip: str, *, host_network: bool = False, host_ip: str = NODE_IP) -> dict[str, Any]:
    """A Running pod as the API server returns it, on a node whose IP is ``host_ip``."""
    return {
        "metadata": {"name": "w-a"},
        "spec": {"nodeName": "n1", **({"hostNetwork": True} if host_network else {})},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "podIPs": [{"ip": ip}],
            "hostIP": host_ip,
            "hostIPs": [{"ip": host_ip}],
        },
    }


@pytest.mark.parametrize(
    ("pod", "allowed"),
    [
        pytest.param(raw_pod("10.0.0.1"), True, id="own-network"),
        # Another tenant's hostNetwork worker on the same node has the same IP.
        pytest.param(raw_pod(NODE_IP, host_network=True), False, id="host-network"),
        pytest.param(raw_pod(NODE_IP), False, id="pod-ip-is-the-host-ip"),
        pytest.param(raw_pod("fd00::5", host_ip="fd00:0:0::5"), False, id="pod-ip-is-the-host-ip-v6-spelling"),
        pytest.param(raw_pod("10.0.0.1", host_network=True), False, id="host-network-whatever-its-ip"),
    ],
)
def test_a_pod_on_its_nodes_network_vouches_for_no_worker(pod: dict[str, Any], allowed: bool) -> None:
    """A hostNetwork pod's IP is its node's: a worker there may be any namespace's hostNetwork pod."""
    ip = pod["status"]["podIP"]
    worker = W("b-0", f"tcp://[{ip}]:4000" if ":" in ip else f"tcp://{ip}:4000")
    verdict = tenancy.check([worker], [workloads.pod_info(pod)], "team-a")
    assert verdict.allowed is allowed, verdict.message
