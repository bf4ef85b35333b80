"""The tenancy rule: a resource acts only on a scheduler whose workers are all pods of its namespace, by IP."""

import pytest

from memops import snapshots, tenancy

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


def test_the_message_counts_and_names_a_few_foreign_workers() -> None:
    workers = [W(f"x{i}", f"tcp://10.9.0.{i}:4000") for i in range(5)] + [W("w-a", "tcp://10.0.0.1:4000")]
    verdict = tenancy.check(workers, MINE, "team-a")
    assert verdict.message.startswith("5 of the scheduler's 6 workers are not pods of namespace team-a")
    assert "tcp://10.9.0.0:4000, tcp://10.9.0.1:4000, tcp://10.9.0.2:4000, ..." in verdict.message
    assert "10.9.0.3" not in verdict.message
