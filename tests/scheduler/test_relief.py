"""Pressure relief on a real scheduler with real nannies and workers, installed over the comm.

The workers' own spill, pause and terminate thresholds are off, so that only relief acts on a
worker whose process memory passes relieveAbove. Memory is what the scheduler sees: the
process memory from each worker's heartbeats.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Any

import dask
import pytest
from distributed import Client, LocalCluster

from memops import daskrpc

LIMIT = 512 * 2**20
CHUNK = 8 * 2**20
ABOVE, TO = 0.6, 0.45


@pytest.fixture
async def cluster() -> AsyncIterator[tuple[str, Client]]:
    with dask.config.set(
        {
            "distributed.worker.memory.target": False,
            "distributed.worker.memory.spill": False,
            "distributed.worker.memory.pause": False,
            "distributed.worker.memory.terminate": False,
            "distributed.worker.memory.monitor-interval": "50ms",
            "distributed.scheduler.active-memory-manager.start": False,
        }
    ):
        async with LocalCluster(
            n_workers=3,
            processes=True,
            threads_per_worker=1,
            memory_limit=LIMIT,
            dashboard_address=None,
            asynchronous=True,
        ) as local:
            async with Client(local, asynchronous=True) as client:
                yield local.scheduler_address, client


async def process_memory(client: Client) -> dict[str, int]:
    info = await client.scheduler.identity()
    return {address: int(w["metrics"]["memory"]) for address, w in info["workers"].items()}


async def wait_until(predicate: Any, timeout: float, what: str) -> Any:
    async with asyncio.timeout(timeout):
        while not (value := await predicate()):
            await asyncio.sleep(0.2)
    return value


async def load(client: Client, address: str, share: float) -> dict[str, Any]:
    """Unique data on one worker until its process memory, as the scheduler sees it, is over ``share``."""
    futures: dict[str, Any] = {}
    while (await process_memory(client))[address] < share * LIMIT:
        values = {f"{address}-{len(futures) + i}": os.urandom(CHUNK) for i in range(4)}
        futures.update(await client.scatter(values, workers=[address], hash=False))
        await asyncio.sleep(0.6)  # a heartbeat, so the scheduler sees the new memory
    return futures


async def test_keys_move_off_a_hot_worker_until_it_is_under_relieve_to(cluster: tuple[str, Client]) -> None:
    address, client = cluster
    hot, *peers = sorted(await process_memory(client))
    futures = await load(client, hot, ABOVE + 0.08)
    originals = await client.gather(list(futures.values()))
    assert await daskrpc.configure_relief(address, above=ABOVE, to=TO) is not None

    async def relieved() -> bool:
        memory = await process_memory(client)
        return memory[hot] < TO * LIMIT + CHUNK  # under relieveTo, give or take the key in flight

    await wait_until(relieved, 30, "the hot worker to be relieved")
    state = await daskrpc.configure_relief(address, above=ABOVE, to=TO)
    assert state is not None and state["keysMoved"] > 0 and state["bytesMoved"] >= state["keysMoved"] * CHUNK
    # Nothing lost, every value intact, and each key in one place again (the hot copy dropped).
    who_has = await client.scheduler.who_has(keys=list(futures))
    assert all(len(holders) >= 1 for holders in who_has.values())
    assert await client.gather(list(futures.values())) == originals
    moved = [k for k, holders in who_has.items() if hot not in holders]
    assert len(moved) >= state["keysMoved"] - 1
    # No peer was pushed over relieveAbove.
    memory = await process_memory(client)
    assert all(memory[p] <= ABOVE * LIMIT for p in peers), memory


async def test_starved_when_no_peer_has_room_and_removal_stops_relief(cluster: tuple[str, Client]) -> None:
    address, client = cluster
    workers = sorted(await process_memory(client))
    futures = {}
    for worker in workers:  # every worker over relieveAbove: nowhere to go
        futures.update(await load(client, worker, ABOVE + 0.03))

    async def starved() -> list[str] | None:
        state = await daskrpc.configure_relief(address, above=ABOVE, to=TO)
        return state["starved"] if state and state["starved"] else None

    assert sorted(await wait_until(starved, 20, "relief to report starvation")) == workers
    state = await daskrpc.configure_relief(address, above=ABOVE, to=TO)
    assert state is not None and state["keysMoved"] == 0
    # Removal: the plugin goes, and configuring again starts from zero.
    assert await daskrpc.configure_relief(address, above=None, to=None) is None
    plugins = await client.run_on_scheduler(lambda dask_scheduler: sorted(dask_scheduler.plugins))
    assert "memops-pressure-relief" not in plugins
