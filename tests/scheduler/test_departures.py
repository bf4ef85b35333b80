"""Workers that leave the scheduler on their own with keys held nowhere else: what memops' agent records.

A real in-process scheduler, and workers as their own processes (``dask worker``: a nanny and its
worker, in their own session), SIGKILLed together as the kernel's OOM killer or a lost node kills
them: no drain, no nanny left to restart the worker. The agent is installed over the comm, as the
operator does, and its records are read as the operator reads them (a snapshot with the drains).
"""

from __future__ import annotations

import os
import time
from typing import Any

import distributed
import distributed.diagnostics.plugin
import pytest
from memops_sandbox import dask_direct

from memops.decisions import snapshots
from memops.scheduler import departures
from tests import polling
from tests.scheduler import processes
from tests.scheduler.processes import Cluster

CHUNK = 2**20


pytestmark = pytest.mark.dask_cluster(workers=0, spawn=("victim", "survivor"))


async def snapshot(cluster: Cluster, **options: Any) -> snapshots.SchedulerSnapshot:
    return await dask_direct.fetch_snapshot(cluster.address, drains=True, **options)


async def departed(cluster: Cluster) -> list[dict[str, Any]]:
    """The agent's records, once one is there."""

    async def recorded() -> list[dict[str, Any]]:
        return list((await snapshot(cluster, keys=False)).departures or [])

    found: list[dict[str, Any]] = await polling.poll(recorded, timeout=30, what="a departure recorded")
    return found


async def test_a_sigkilled_worker_is_recorded_with_what_it_alone_held(cluster: Cluster) -> None:
    """Scattered keys and a computed key whose input was released (irreplaceable), computed keys
    (recomputed elsewhere) and a key with a copy on the survivor (not lost): the record counts what
    the scheduler held only on the victim, the figures the agent's holdings gave for it a moment before."""
    client = cluster.client
    before = await snapshot(cluster, keys=False)  # installs the agent, as the operator's first pass does
    assert before.departures == []
    addresses = await cluster.addresses()
    victim, survivor = addresses["victim"], addresses["survivor"]
    scattered = await client.scatter([os.urandom(CHUNK) for _ in range(3)], workers=[victim])
    computed = [client.submit(os.urandom, CHUNK, key=f"computed-{i}", workers=[victim]) for i in range(2)]
    shared = client.submit(os.urandom, CHUNK, key="shared", workers=[victim])
    source = client.submit(os.urandom, CHUNK, key="input", workers=[victim])
    derived = client.submit(bytes.upper, source, key="derived", workers=[victim])
    await distributed.wait([*scattered, *computed, shared, derived])
    del source  # released: "derived" cannot be recomputed from it any more
    await polling.poll(
        lambda: cluster.scheduler.tasks["input"].state != "memory", timeout=10, what="the input released"
    )
    await client.replicate([shared], workers=[victim, survivor])
    held = (await snapshot(cluster)).by_address(victim)
    assert held is not None and held.unique_keys == 6 and held.nkeys == 7

    killed = time.time()
    processes.kill(cluster.spawned["victim"])

    (record,) = await departed(cluster)
    assert killed - 1 <= record["time"] <= time.time() + 1
    assert record["address"] == victim and record["name"] == "victim"
    assert (record["keys"], record["bytes"]) == (held.unique_keys, held.unique_bytes)
    assert record["irreplaceableKeys"] == 4  # the scattered ones and "derived"
    assert record["drain"] == ""


@pytest.mark.dask_cluster(spawn=("victim",))
async def test_a_worker_that_dies_while_memops_drains_it_is_marked_as_that_drains(cluster: Cluster) -> None:
    """The drain reports its loss (``worker left``, in a RetirementRequest or the safety net's
    ``lostAtDeadline``): the record says so, so that the operator does not count it twice. The
    drain has no recipient (no other worker), so it is still draining when the worker dies."""
    client = cluster.client
    await snapshot(cluster, keys=False)
    victim = (await cluster.addresses())["victim"]
    held = await client.scatter([os.urandom(CHUNK) for _ in range(2)], workers=[victim])
    async with dask_direct.connect(cluster.address) as scheduler:
        state = await scheduler.start_drain([victim], deadline=120, restore=False)
    assert state[victim]["state"] == "draining"

    processes.kill(cluster.spawned["victim"])

    (record,) = await departed(cluster)
    assert (record["keys"], record["irreplaceableKeys"], record["drain"]) == (len(held), 2, "draining")


async def test_a_worker_that_held_nothing_alone_is_not_recorded(cluster: Cluster) -> None:
    """Workers scaled away idle would otherwise push the losses out of the bounded record."""
    client = cluster.client
    await snapshot(cluster, keys=False)
    addresses = await cluster.addresses()
    shared = client.submit(os.urandom, CHUNK, key="shared", workers=[addresses["victim"]])
    await distributed.wait([shared])
    await client.replicate([shared], workers=list(addresses.values()))
    processes.kill(cluster.spawned["victim"])
    await polling.poll(lambda: len(cluster.scheduler.workers) == 1, timeout=30, what="the victim gone")
    assert (await snapshot(cluster, keys=False)).departures == []
    # Bounded, whatever leaves.
    assert cluster.scheduler.plugins[departures.NAME].records.maxlen == departures.KEPT


async def test_an_agent_installed_again_keeps_the_records() -> None:
    """An operator of another version installs its agent (by value: another class) over the one
    there: the departures recorded so far stay."""
    async with distributed.Scheduler(dashboard_address=":0") as scheduler:

        class Older(distributed.diagnostics.plugin.SchedulerPlugin):
            def __init__(self) -> None:
                self.records = [departures.Record("tcp://10.0.0.1:1", "w", 1.0, 2, 20, 1)]

        scheduler.add_plugin(Older(), name=departures.NAME)
        departures.install(scheduler)
        assert departures.report(scheduler) == [
            {
                "address": "tcp://10.0.0.1:1",
                "name": "w",
                "time": 1.0,
                "keys": 2,
                "bytes": 20,
                "irreplaceableKeys": 1,
                "drain": "",
            }
        ]
        assert departures.report(scheduler, since=1.0) == []
        assert isinstance(scheduler.plugins[departures.NAME], departures.DeparturesPlugin)
