"""Graph-aware placement through a MemoryPolicy (``spec.placement``) on the sandbox's real scheduler
and worker pods: a computation of independent chains runs under placement while a drained scale-down
retires two of its four workers and the policy then scales back up."""

from __future__ import annotations

import time
from typing import Any

import dask.array as da
import distributed

from tests.e2e.conftest import Sandbox
from tests.e2e.data import scatter_unique
from tests.e2e.test_policy import memory_policy

NAME = "memops-placement"


def placed(client: distributed.Client) -> dict[str, Any]:
    """The placement plugin's groups' homes and what waits for no worker, on the scheduler."""

    def state(dask_scheduler: Any) -> dict[str, Any]:  # nested: sent by value, as tests/ is not importable there
        plugin = dask_scheduler.plugins.get("memops-placement")
        return {
            "homes": sorted(set(plugin.home.values())) if plugin is not None else None,
            "unrunnable": len(dask_scheduler.unrunnable),
        }

    result: dict[str, Any] = client.run_on_scheduler(state)
    return result


def test_groups_follow_a_drained_scale_down_and_a_scale_up_takes_new_groups(sandbox: Sandbox) -> None:
    pods = sandbox.pods()
    sandbox.apply(memory_policy("placed", sandbox.scheduler_address, replicas=4, placement={}))
    sandbox.wait_for(
        lambda: (s := sandbox.get("mempol", "placed").get("status", {})).get("placement") is not None and s,
        what="status.placement",
    )

    def slow(block: Any) -> Any:  # nested: sent by value
        time.sleep(1.0)
        return block + 1

    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        assert placed(client)["homes"] == [], "placement is installed and holds nothing yet"
        holdings = scatter_unique(client, dict.fromkeys(pods, 3))
        chunks = 48
        x = da.ones((1024, chunks), chunks=(1024, 1))
        future = client.compute(x.map_blocks(slow, dtype=float).map_blocks(slow, dtype=float).sum())
        homes = sandbox.wait_for(lambda: len(h := placed(client)["homes"] or []) == 4 and h, what="groups on 4 workers")
        sandbox.kubectl("scale", "mempol/placed", "--replicas=2")
        sandbox.wait_for(lambda: sandbox.replicas() == 2 and len(sandbox.pods()) == 2, what="a drained scale-down")
        assert future.result(timeout=120) == 1024 * chunks * 3
        after = placed(client)
        assert after["unrunnable"] == 0, after
        holdings.assert_all_correct()
        remaining = set(client.scheduler_info()["workers"])
        assert len(remaining) == 2 and len(remaining & set(homes)) == 2, (remaining, homes)
        status = sandbox.wait_for(
            lambda: (
                (p := sandbox.get("mempol", "placed")["status"].get("placement") or {}).get("groupsMoved", 0) >= 1 and p
            ),
            what="status.placement to count the groups that moved",
        )
        assert status["graphsPlaced"] >= 1 and status["tasksPlaced"] >= chunks, status

        sandbox.kubectl("patch", "mempol/placed", "--type=merge", "-p", '{"spec":{"replicas":4}}')
        sandbox.wait_for(lambda: len(client.scheduler_info()["workers"]) == 4, what="four workers again")
        joined = set(client.scheduler_info()["workers"]) - remaining
        chains = client.persist(da.ones((1024, 16), chunks=(1024, 1)).map_blocks(slow, dtype=float))
        distributed.wait(chains, timeout=120)
        holders = {h for hs in client.who_has(chains).values() for h in hs}
        assert joined <= holders, (joined, holders)
        holdings.assert_all_correct()
        del chains, future
    sandbox.kubectl("delete", "mempol/placed")
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        sandbox.wait_for(lambda: placed(client)["homes"] is None, what="placement to leave with the policy")
