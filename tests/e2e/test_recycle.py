"""Recycling end to end: a worker that leaks is replaced (surge, drain, remove) with nothing lost."""

from __future__ import annotations

import json
from typing import Any

import distributed

from tests.e2e.conftest import Sandbox
from tests.e2e.data import scatter_unique, workers_by_name
from tests.e2e.test_policy import memory_policy, owned_requests

MIB = 2**20


def make_leak() -> Any:
    """A function that grows what a module-level list keeps alive to ``total`` bytes (no further if
    it holds that already), as a leaky library would, and returns the size: a call repeated because
    its answer came late leaks nothing twice.

    Made here, not at module level, so that it travels by value: the workers cannot import the
    tests. The bytes are ones, not zeros, so the pages are touched and count as the process' memory.
    """

    def leak(total: int) -> int:
        import distributed as anchor

        kept: list[bytes] = anchor.__dict__.setdefault("_test_leak", [])
        held = sum(map(len, kept))
        if held < total:
            kept.append(b"\x01" * (total - held))
        return max(held, total)

    return leak


def test_a_leaking_worker_is_recycled_surge_first_and_nothing_is_lost(sandbox: Sandbox) -> None:
    pods = sandbox.pods()
    leaker = pods[0]
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        holdings = scatter_unique(client, dict.fromkeys(pods, 4))
        # The sandbox's workers have a 1 GiB limit and start near 15% of it: 400 MiB more is a leak.
        client.run(make_leak(), 400 * MIB, workers=[workers_by_name(client)[leaker]])
        policy = memory_policy(
            "leaky",
            sandbox.scheduler_address,
            replicas=len(pods),
            recycle={"unmanagedMemory": {"above": "35%", "for": "6s"}, "maxUnavailable": 1, "surge": 1},
        )
        sandbox.apply(policy)

        marked = sandbox.wait_for(
            lambda: (
                (p := sandbox.get("pod", leaker))["metadata"].get("annotations", {}).get("memops.dev/recycle") and p
            ),
            what="the leaking worker to be marked for recycling",
        )
        mark = json.loads(marked["metadata"]["annotations"]["memops.dev/recycle"])
        assert mark["reason"] == "UnmanagedMemory", mark
        # Surge first: a replacement comes up before the old worker is drained.
        sandbox.wait_for(lambda: sandbox.replicas() == len(pods) + 1, what="the surge replacement")

        def recycled() -> dict[str, Any] | None:
            status = sandbox.get("mempol", "leaky").get("status", {})
            recent = (status.get("recycle") or {}).get("recent") or []
            return status if recent else None

        status = sandbox.wait_for(recycled, timeout=120, what="the recycling to be recorded")
        [entry] = status["recycle"]["recent"]
        assert (entry["pod"], entry["reason"], entry["outcome"]) == (leaker, "UnmanagedMemory", "Recycled")
        assert entry["seconds"] is not None and entry["seconds"] >= 0
        assert status["recycle"]["total"] == 1
        sandbox.wait_for(lambda: sandbox.replicas() == len(pods), what="back to the desired count")
        sandbox.wait_for(lambda: leaker not in sandbox.pods(), what="the leaking pod to be gone")
        assert len(sandbox.pods()) == len(pods)

        [request] = [r for r in owned_requests(sandbox, "leaky") if r["spec"].get("workers") == [leaker]]
        assert request["metadata"]["labels"]["memops.dev/purpose"] == "recycle"
        assert request["status"]["phase"] == "Succeeded"
        holdings.assert_all_correct()

        # The survivors show their measured unmanaged memory, for `kubectl get pods -o custom-columns`.
        shown = sandbox.kubectl(
            "get",
            "pods",
            "-l",
            "app=dask-worker",
            "-o",
            "custom-columns=NAME:.metadata.name,UNMANAGED:.metadata.annotations.memops\\.dev/unmanaged-memory",
        ).stdout
        assert all(line.split()[1].endswith("%") for line in shown.splitlines()[1:]), shown
        events = sandbox.kubectl("get", "events", "--field-selector", "involvedObject.name=leaky").stdout
        assert "Recycling" in events and "Recycled" in events, events
