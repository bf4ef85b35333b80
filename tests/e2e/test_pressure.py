"""Pressure relief through a MemoryPolicy: the operator installs it in the sandbox's real
scheduler, reports it in status.pressure, installs it again when the scheduler has lost it, and
takes it out again when spec.pressure goes or the policy is deleted; and on a worker whose limit
is its container's cgroup limit, relief moves its keys to its peers before the nanny's kill, where
stock Dask loses them (``tests/e2e/test_resize.py``, the same workload without a policy)."""

from __future__ import annotations

from typing import Any

import distributed
import pytest

from tests.e2e.conftest import Sandbox
from tests.e2e.data import Holdings
from tests.e2e.test_policy import memory_policy
from tests.e2e.test_resize import LIMIT, fill, leak, only_pod, unspilling_workload, worker_info

NAME = "memops-pressure-relief"


def relief_on_scheduler(client: distributed.Client) -> dict[str, Any] | None:
    def state(dask_scheduler: Any) -> dict[str, Any] | None:
        plugin = dask_scheduler.plugins.get("memops-pressure-relief")
        return None if plugin is None else {"above": plugin.policy.above, "to": plugin.policy.to}

    result: dict[str, Any] | None = client.run_on_scheduler(state)
    return result


def relief_count(client: distributed.Client) -> int:
    """The keys relief counts as moved, on the scheduler."""

    def count(dask_scheduler: Any) -> int:
        return int(dask_scheduler.plugins[NAME].policy.keys_moved)

    result: int = client.run_on_scheduler(count)
    return result


def test_policy_installs_retunes_and_removes_pressure_relief(sandbox: Sandbox) -> None:
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        sandbox.apply(
            memory_policy(
                "relief", sandbox.scheduler_address, replicas=4, pressure={"relieveAbove": "75%", "relieveTo": "60%"}
            )
        )
        status = sandbox.wait_for(
            lambda: (s := sandbox.get("mempol", "relief").get("status", {})).get("pressure") is not None and s,
            what="status.pressure",
        )
        assert status["pressure"]["keysMoved"] == 0 and status["pressure"]["starved"] == []
        assert relief_on_scheduler(client) == {"above": 0.75, "to": 0.6}

        # A restarted scheduler has no relief: the next pass installs it again. (Taken out here
        # behind the operator's back, as a restart would.)
        def remove_relief(dask_scheduler: Any) -> None:  # nested: sent by value, as tests/ is not importable there
            dask_scheduler.plugins.pop(NAME).manager.stop()
            dask_scheduler.handlers.pop("memops_agent")  # memops' agent, which a restart loses too

        client.run_on_scheduler(remove_relief)
        assert relief_on_scheduler(client) is None
        sandbox.wait_for(lambda: relief_on_scheduler(client) == {"above": 0.75, "to": 0.6}, what="relief re-installed")

        sandbox.kubectl("patch", "mempol/relief", "--type=merge", "-p", '{"spec":{"pressure":{"relieveAbove":"80%"}}}')
        sandbox.wait_for(
            lambda: relief_on_scheduler(client) == {"above": 0.8, "to": 0.6}, what="relief retuned in place"
        )

        sandbox.kubectl("patch", "mempol/relief", "--type=json", "-p", '[{"op":"remove","path":"/spec/pressure"}]')
        sandbox.wait_for(lambda: relief_on_scheduler(client) is None, what="relief removed from the scheduler")
        sandbox.wait_for(
            lambda: "pressure" not in sandbox.get("mempol", "relief").get("status", {}), what="status.pressure gone"
        )

        # Deleting the policy takes its relief out of the scheduler too.
        sandbox.kubectl("patch", "mempol/relief", "--type=merge", "-p", '{"spec":{"pressure":{"relieveAbove":"70%"}}}')
        sandbox.wait_for(lambda: relief_on_scheduler(client) == {"above": 0.7, "to": 0.55}, what="relief installed")
        sandbox.wait_for(lambda: sandbox.get("mempol", "relief").get("status", {}).get("pressure"), what="status")
        sandbox.kubectl("delete", "mempol/relief")
        sandbox.wait_for(lambda: relief_on_scheduler(client) is None, what="relief removed with the policy")


@pytest.mark.quiet("it races the nanny's 100 ms memory check: no other namespace starts meanwhile")
def test_relief_moves_the_keys_of_a_worker_before_its_nanny_kills_it(real_sandbox: Sandbox) -> None:
    """The workload that the nanny kills under stock Dask (``test_resize``'s: a worker with 512 MiB
    of container memory, spilling off, filled with keys to 76% of its limit, then a leak of a
    quarter of it that nothing can move, past the nanny's 95%). Under a policy with
    ``spec.pressure``, relief moves keys from it to its peers whenever it passes 70%, down to 50%:
    the same container goes on with every key, on it or on a peer."""
    sandbox = real_sandbox
    unspilling_workload(sandbox, "relieved")
    pressure = {"relieveAbove": "70%", "relieveTo": "50%"}
    sandbox.apply(memory_policy("relieved", sandbox.scheduler_address, workload="relieved", pressure=pressure))
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        client.wait_for_workers(5, timeout=120)
        sandbox.wait_for(lambda: relief_on_scheduler(client) == {"above": 0.7, "to": 0.5}, what="relief installed")
        pod = only_pod(sandbox, "relieved")
        name = pod["metadata"]["name"]
        [before] = pod["status"]["containerStatuses"]
        info = worker_info(client, name)
        assert info is not None
        holdings = Holdings(client)
        fill(client, holdings, name, until=0.76, ceiling=LIMIT)
        leak(client, holdings, name, LIMIT // 4)

        now = worker_info(client, name)
        assert now is not None and now["address"] == info["address"], "the nanny killed the worker"
        assert now["metrics"]["memory"] < 0.95 * LIMIT, now["metrics"]
        assert not holdings.lost(), holdings.lost()
        holdings.assert_all_correct()
        who_has = client.who_has(list(holdings.futures.values()))
        moved = [key for key in holdings.futures if info["address"] not in who_has[key]]
        assert moved, "relief moved keys off the worker"
        # Relief's own count: a move that outlived its minute is forgotten uncounted, so on a
        # slow machine it may count fewer keys than left the worker, never more.
        counted = relief_count(client)
        assert 0 < counted <= len(holdings.futures), counted

    [after] = only_pod(sandbox, "relieved")["status"]["containerStatuses"]
    assert (after["containerID"], after["restartCount"]) == (before["containerID"], 0), after
    # The operator's next pass reads relief's count from the scheduler into the status.
    status = sandbox.wait_for(
        lambda: (
            (p := sandbox.get("mempol", "relieved").get("status", {}).get("pressure"))
            and p["keysMoved"] >= counted
            and p
        ),
        what=f"status.pressure.keysMoved to show relief's count, {counted} keys moved",
    )
    assert status["bytesMoved"] >= counted * 16 * 2**20, status
