"""Graph-aware placement on a real scheduler with real worker processes, installed over the comm
through the agent, as the operator installs it. Work stealing and queuing are Dask's defaults."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import dask
import dask.array as da
import numpy as np
import pytest
from distributed import Client
from distributed.diagnostics.plugin import SchedulerPlugin
from memops_sandbox import dask_direct

from memops.scheduler import placement
from tests import polling
from tests.scheduler import processes

OWNER = "default/placement"
MIB = 2**20

pytestmark = pytest.mark.dask_cluster(workers=4, wait=True)


async def moved(client: Client) -> int:
    """Bytes that every worker fetched from another since it started."""

    def fetched(dask_worker: Any) -> int:
        return sum(int(entry["total"]) for entry in dask_worker.transfer_incoming_log)

    return sum((await client.run(fetched)).values())


def plugin_of(cluster: processes.Cluster) -> placement.PlacementPlugin:
    plugin = cluster.scheduler.plugins[placement.NAME]
    assert isinstance(plugin, placement.PlacementPlugin)
    return plugin


def slow(block: np.ndarray, seconds: float = 0.05) -> np.ndarray:
    time.sleep(seconds)
    return block + 1


async def test_the_seeds_sum_moves_almost_nothing_and_placement_off_is_stock(cluster: processes.Cluster) -> None:
    """The seed's sum over one axis (160 column chunks of 1 MiB here): stock Dask moves most of
    the data between workers (queuing sends each chunk to the least busy worker, its neighbours
    elsewhere); under placement at most 5% of the array moves, the answer is the same. Removed, it
    leaves nothing behind, and the next graph gets no restriction."""
    client = cluster.client
    x = da.ones((131_072, 160), chunks=(131_072, 1))  # 1 MiB per chunk, 160 MiB
    size = x.nbytes
    figures = await dask_direct.configure_placement(cluster.address, enabled=True, owner=OWNER)
    assert figures is not None and figures["graphsPlaced"] == 0 and figures["owner"] == OWNER
    before = await moved(client)
    assert await client.compute(x.sum(axis=1).sum()) == size / 8
    placed = await moved(client) - before
    figures = await dask_direct.configure_placement(cluster.address, enabled=True, owner=OWNER)
    assert figures is not None and figures["graphsPlaced"] == 1 and figures["groups"] >= 4, figures
    assert placed <= 0.05 * size, f"{placed / MIB:.1f} MiB of {size / MIB:.0f} MiB moved under placement"
    print(f"placement: {placed / MIB:.1f} MiB of {size / MIB:.0f} MiB moved; {figures}")
    # Off: the plugin goes, and a graph runs as stock Dask runs it, with no restriction.
    assert await dask_direct.configure_placement(cluster.address, enabled=False, owner=OWNER) is None
    assert placement.NAME not in cluster.scheduler.plugins
    # 160 independent chunks: placed, each would be restricted to a worker.
    persisted = client.persist(x + 2)
    await persisted
    keys = [f.key for f in client.futures_of(persisted)]
    assert len(keys) == 160
    assert all(not cluster.scheduler.tasks[k].worker_restrictions for k in keys)
    del persisted


class RootsProcessing(SchedulerPlugin):
    """The most root tasks (no dependencies) that one worker was processing at once."""

    name = "test-roots-processing"

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.on: dict[Any, str] = {}
        self.most = 0

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        if start == "processing":
            self.on.pop(key, None)
        ts = self.scheduler.tasks.get(key)
        if finish == "processing" and ts is not None and not ts.dependencies and ts.processing_on is not None:
            self.on[key] = ts.processing_on.address
            self.most = max(self.most, sum(1 for w in self.on.values() if w == self.on[key]))


async def most_roots_processing(cluster: processes.Cluster, graph: Any) -> tuple[int, Any]:
    recorder = RootsProcessing(cluster.scheduler)
    cluster.scheduler.add_plugin(recorder)
    try:
        result = await cluster.client.compute(graph)
    finally:
        cluster.scheduler.remove_plugin(RootsProcessing.name)
    return recorder.most, result


async def test_a_groups_roots_are_sent_as_dasks_queuing_sends_roots(cluster: processes.Cluster) -> None:
    """Restricted to its worker, a group's roots are not queued by Dask: sent at once, the worker
    would compute root after root while each reduction is a round trip away, and partial results
    pile up. Placement holds them back: no worker processes more roots at once than queuing would
    send it (``worker-saturation`` 1.1 times one thread: 2) and one more per thread. Under
    ``worker-saturation: inf`` (queuing off, as co-assignment runs) none is held; nor are the roots
    of a group whose roots turn out small (their sum under ``UNPACED_BYTES``)."""
    await dask_direct.configure_placement(cluster.address, enabled=True, owner=OWNER)
    bound = 2 + placement.AHEAD
    x = da.ones((1_048_576, 160), chunks=(1_048_576, 1))  # 8 MiB per chunk: 20 roots a group, 160 MiB
    most, total = await most_roots_processing(cluster, x.sum(axis=1).sum())
    assert total == x.size
    assert most <= bound, f"{most} roots processing at once on one worker"
    saturation = cluster.scheduler.WORKER_SATURATION
    cluster.scheduler.WORKER_SATURATION = float("inf")
    try:
        most_inf, total = await most_roots_processing(cluster, (x + 1).sum(axis=1).sum())
    finally:
        cluster.scheduler.WORKER_SATURATION = saturation
    assert total == 2 * x.size
    assert most_inf > bound, f"queuing off: {most_inf} roots at most at once on one worker"
    small = da.ones((16_384, 160), chunks=(16_384, 1))  # 128 KiB per chunk
    most_small, total = await most_roots_processing(cluster, small.sum(axis=1).sum())
    assert total == small.size
    assert most_small > bound, f"small roots: {most_small} at most at once on one worker"
    print(f"roots at once on one worker: {most} paced, {most_inf} with worker-saturation inf, {most_small} small")
    figures = await dask_direct.configure_placement(cluster.address, enabled=True, owner=OWNER)
    assert figures is not None and figures["graphsPlaced"] >= 3, figures
    assert not plugin_of(cluster).held, "nothing is left held back once the graphs are done"


async def test_a_shuffle_and_an_opted_out_graph_are_left_to_dask(cluster: processes.Cluster) -> None:
    client = cluster.client
    await dask_direct.configure_placement(cluster.address, enabled=True, owner=OWNER)
    x = da.random.random((64, 64), chunks=(8, 8))
    # A transpose and matrix product: every output block needs a row and a column of blocks.
    assert np.allclose(await client.compute((x @ x.T).sum()), (lambda a: (a @ a.T).sum())(await client.compute(x)))
    # Opted out as Dask annotations go: on the tasks that the computation sends (the context is
    # open when it is computed; array optimization drops layer annotations made before).
    with dask.annotate(memops_placement=False):
        y = da.ones((1024, 32), chunks=(1024, 1)).sum(axis=1)
        assert (await client.compute(y.sum())) == 1024 * 32
    # A P2P rechunk restricts its own tasks at its barrier: Dask's to place.
    z = da.random.random((64, 64), chunks=(64, 1))
    rechunked = z.rechunk((1, 64), method="p2p")
    assert np.allclose(await client.compute(rechunked.sum(axis=1)), await client.compute(z.sum(axis=1)))
    figures = await dask_direct.configure_placement(cluster.address, enabled=True, owner=OWNER)
    assert figures is not None
    left = figures["graphsLeft"]
    assert left.get("does not partition", 0) >= 1 and left.get("opted out") == 1, figures
    assert left.get("a P2P shuffle") == 1, figures
    assert figures["tasksPlaced"] == 0 or figures["graphsPlaced"] >= 1, figures


async def test_data_computed_before_stays_where_it_is(cluster: processes.Cluster) -> None:
    """A computation over a persisted array: each group goes where its chunks are, so nothing but
    the reduction's partial sums moves, as with stock Dask."""
    client = cluster.client
    x = client.persist(da.random.random((16_384, 64), chunks=(16_384, 1)))  # 128 KiB chunks, 8 MiB
    await x
    await dask_direct.configure_placement(cluster.address, enabled=True, owner=OWNER)
    before = await moved(client)
    total = await client.compute((x * 2).sum())
    assert np.isclose(total, 2 * await client.compute(x.sum()))
    placed = await moved(client) - before
    figures = await dask_direct.configure_placement(cluster.address, enabled=True, owner=OWNER)
    assert figures is not None and figures["graphsPlaced"] >= 1, figures
    assert placed <= 0.05 * x.nbytes, f"{placed / MIB:.2f} MiB of {x.nbytes / MIB:.0f} MiB moved"


async def test_groups_leave_retiring_workers_and_nothing_waits_for_them(cluster: processes.Cluster) -> None:
    """Two of four workers retire in the middle of a placed computation (as Dask retires them,
    data first): the computation ends with the right answer, nothing waits for a worker that is
    gone, and their groups moved to running workers."""
    client = cluster.client
    await dask_direct.configure_placement(cluster.address, enabled=True, owner=OWNER)
    x = da.ones((4096, 64), chunks=(4096, 1))
    y = x.map_blocks(slow, dtype=x.dtype).map_blocks(slow, dtype=x.dtype).sum(axis=1).sum()
    future = client.compute(y)
    scheduler = cluster.scheduler
    homes = await polling.poll(
        lambda: len(set(plugin_of(cluster).home.values())) == 4 and set(plugin_of(cluster).home.values()),
        timeout=30,
        what="groups placed on the four workers",
    )
    await asyncio.sleep(0.5)
    leaving = sorted(homes)[:2]
    await client.retire_workers(leaving, close_workers=True)
    assert await asyncio.wait_for(future, 60) == 4096 * 64 * 3
    assert plugin_of(cluster).figures.rehomed >= 2, plugin_of(cluster).figures
    assert not scheduler.unrunnable, scheduler.unrunnable
    assert not set(leaving) & set(scheduler.workers)
    del future
    await polling.poll(lambda: plugin_of(cluster).home == {}, timeout=30, what="groups to go with their tasks")


@pytest.mark.dask_cluster(workers=2)
async def test_a_worker_that_joins_takes_new_groups_and_independent_chains_move_nothing(
    cluster: processes.Cluster,
) -> None:
    client, scheduler = cluster.client, cluster.scheduler
    await dask_direct.configure_placement(cluster.address, enabled=True, owner=OWNER)
    assert await client.compute(da.ones((4096, 16), chunks=(4096, 1)).map_blocks(slow, dtype=float).sum()) == 4096 * 32
    joined = processes.spawn(cluster.address, "joined")
    try:
        await client.wait_for_workers(3, timeout=60)
        address = (await cluster.addresses())["joined"]
        before = await moved(client)
        chains = da.ones((4096, 30), chunks=(4096, 1)).map_blocks(slow, dtype=float)
        persisted = client.persist(chains)
        await persisted
        who_has = await client.who_has(persisted)
        holders = [set(h) for h in who_has.values()]
        assert all(len(h) == 1 for h in holders), who_has
        counts = {a: sum(a in h for h in holders) for a in scheduler.workers}
        assert counts[address] >= 30 // 3 - 2, counts
        # Each chain ran where its chunk was made: nothing moved.
        assert await moved(client) == before
        del persisted
    finally:
        processes.kill(joined)


@pytest.mark.dask_cluster(spawn=("killed",))
async def test_a_worker_killed_mid_computation_leaves_no_task_waiting_for_it(cluster: processes.Cluster) -> None:
    """A worker that dies (SIGKILL) with groups of a placed computation: Dask recomputes what it
    held, its groups move to the running workers, and the computation ends."""
    client = cluster.client
    await dask_direct.configure_placement(cluster.address, enabled=True, owner=OWNER)
    x = da.ones((4096, 80), chunks=(4096, 1))
    y = x.map_blocks(slow, 0.1, dtype=x.dtype).sum(axis=1).sum()
    future = client.compute(y)
    killed = (await cluster.addresses())["killed"]
    await polling.poll(
        lambda: killed in plugin_of(cluster).home.values(), timeout=30, what="a group on the worker to kill"
    )
    await asyncio.sleep(0.3)
    processes.kill(cluster.spawned["killed"])
    assert await asyncio.wait_for(future, 60) == 4096 * 80 * 2
    assert plugin_of(cluster).figures.rehomed >= 1
    assert not cluster.scheduler.unrunnable
