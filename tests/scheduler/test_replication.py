"""Replication targets on a real scheduler, with real workers (``dask worker``: nanny and worker
processes), configured over the comm as the operator does.

The scheduler's own Active Memory Manager runs ReduceReplicas every 300 ms throughout, so that
the tests show the two never fight: ruled keys stay at their target while ReduceReplicas keeps
unruled keys at one copy. Workers are given a node and a zone directly (the operator reads them
from the pods and nodes), so placement on another node and zone is checked here.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import distributed
import pytest
from memops_sandbox import dask_direct

from tests import polling
from tests.scheduler import processes
from tests.scheduler.processes import Cluster

OWNER = "default/replication"
NAMES = ("w0", "w1", "w2", "w3")
PLACES = {
    "w0": ("node-a", "zone-1"),
    "w1": ("node-a", "zone-1"),
    "w2": ("node-b", "zone-1"),
    "w3": ("node-c", "zone-2"),
}
CHUNK = 2**20


pytestmark = pytest.mark.dask_cluster(
    workers=0,
    spawn=NAMES,
    config={
        "distributed.scheduler.active-memory-manager.start": True,
        "distributed.scheduler.active-memory-manager.interval": "300ms",
        "distributed.scheduler.worker-ttl": "5s",
    },
)


async def placement(cluster: Cluster) -> dict[str, tuple[str, str]]:
    return {a: PLACES[n] for n, a in (await cluster.addresses()).items() if n in PLACES}


async def configure(cluster: Cluster, rules: dict[str, Any] | None) -> dict[str, Any] | None:
    return await dask_direct.configure_replication(
        cluster.address, rules=rules, places=await placement(cluster), owner=OWNER
    )


async def holders(cluster: Cluster, keys: list[str]) -> dict[str, list[str]]:
    """Key -> the addresses of the workers that hold it."""
    result: dict[str, list[str]] = await cluster.client.scheduler.who_has(keys=keys)
    return result


RULES = {
    "default": 1,
    "keys": [{"prefix": "load-parquet", "replicas": 2}],
    "maxReplicatedFraction": 0.5,
    "ceiling": 0.9,
}


async def test_ruled_keys_reach_their_target_and_stay_there_while_reduce_replicas_runs(cluster: Cluster) -> None:
    client = cluster.client
    ruled = [client.submit(os.urandom, CHUNK, key=f"load-parquet-{i}") for i in range(8)]
    unruled = [client.submit(os.urandom, CHUNK, key=f"other-{i}") for i in range(8)]
    await distributed.wait(ruled + unruled)
    await client.replicate(unruled, n=3)  # stock Dask's one-shot answer: ReduceReplicas undoes it
    assert await configure(cluster, RULES) is not None
    ruled_keys, unruled_keys = [str(f.key) for f in ruled], [str(f.key) for f in unruled]
    places = await placement(cluster)

    async def at_target() -> bool:
        who_has = await holders(cluster, ruled_keys + unruled_keys)
        return all(len(who_has[k]) == 2 for k in ruled_keys) and all(len(who_has[k]) == 1 for k in unruled_keys)

    await polling.poll(at_target, timeout=30, what="ruled keys at 2 copies, unruled at 1")
    figures = await configure(cluster, RULES)
    assert figures is not None
    vetoed = figures["vetoed"]
    # Stays there while ReduceReplicas runs: it asks to drop every ruled key's second copy on
    # each of its cycles, and each such drop is withheld (counted), never enacted.
    while figures["vetoed"] < vetoed + 5 * len(ruled_keys):
        who_has = await holders(cluster, ruled_keys)
        assert all(len(who_has[k]) == 2 for k in ruled_keys), who_has
        await asyncio.sleep(0.1)
        figures = await configure(cluster, RULES)
        assert figures is not None
    assert figures["keysUnder"] == 0 and figures["keysOver"] == 0
    assert figures["bytesSpent"] >= 8 * CHUNK
    # Each key's two copies are on two nodes (w0 and w1 share node-a).
    who_has = await holders(cluster, ruled_keys)
    assert all(len({places[h][0] for h in who_has[k]}) == 2 for k in ruled_keys), who_has
    # Removed: ReduceReplicas decides every key again, and takes ruled keys back to one copy.
    assert await configure(cluster, None) is None

    async def reduced() -> bool:
        who_has = await holders(cluster, ruled_keys)
        return all(len(who_has[k]) == 1 for k in ruled_keys)

    await polling.poll(reduced, timeout=15, what="ReduceReplicas back in charge of the formerly ruled keys")
    policies = await client.run_on_scheduler(
        lambda dask_scheduler: sorted(type(p).__name__ for p in dask_scheduler.extensions["amm"].policies)
    )
    assert policies == ["ReduceReplicas"]


async def test_a_copy_lost_with_a_sigkilled_worker_is_made_again(cluster: Cluster) -> None:
    client = cluster.client
    ruled = [client.submit(os.urandom, CHUNK, key=f"load-parquet-{i}") for i in range(8)]
    await distributed.wait(ruled)
    keys = [str(f.key) for f in ruled]
    assert await configure(cluster, RULES) is not None

    async def at_target() -> bool:
        who_has = await holders(cluster, keys)
        return all(len(who_has[k]) == 2 for k in keys)

    await polling.poll(at_target, timeout=30, what="2 copies of each ruled key")
    addresses = await cluster.addresses()
    by_address = {a: n for n, a in addresses.items()}
    who_has = await holders(cluster, keys)
    victim = by_address[who_has[keys[0]][0]]
    lost = [k for k in keys if addresses[victim] in who_has[k]]
    processes.kill(cluster.spawned[victim])
    started = time.monotonic()

    async def restored() -> bool:
        now = await holders(cluster, keys)
        return all(len(now[k]) == 2 and addresses[victim] not in now[k] for k in keys)

    await polling.poll(restored, timeout=30, what="the lost copies made again")
    print(f"target restored {time.monotonic() - started:.1f}s after SIGKILL ({len(lost)} copies lost)")
    assert all(len(v) > 0 for v in (await client.gather(ruled)))  # nothing recomputed or lost


async def test_sigkilled_spot_pods_lose_no_key_under_a_pod_rule(cluster: Cluster) -> None:
    client = cluster.client
    addresses = await cluster.addresses()
    spot = [addresses["w0"], addresses["w1"]]
    # Scattered data cannot be recomputed: losing its only copy loses it for good.
    futures = await client.scatter([os.urandom(CHUNK) for _ in range(12)], workers=spot, hash=False)
    keys = [str(f.key) for f in futures]
    rules = {"default": 1, "pods": [{"workers": spot, "replicas": 2}], "maxReplicatedFraction": 0.5, "ceiling": 0.9}
    assert await configure(cluster, rules) is not None

    async def outside() -> bool:
        who_has = await holders(cluster, keys)
        return all(any(h not in spot for h in who_has[k]) for k in keys)

    await polling.poll(outside, timeout=30, what="a copy of each key off the spot pods")
    who_has = await holders(cluster, keys)
    assert all(len(who_has[k]) == 2 for k in keys), who_has  # one copy on a spot pod, one off
    for name in ("w0", "w1"):
        processes.kill(cluster.spawned[name])

    async def gone() -> bool:
        return len(await cluster.addresses()) == 2

    await polling.poll(gone, timeout=30, what="the spot workers gone from the scheduler")
    values = await asyncio.wait_for(client.gather(futures), 30)
    assert len(values) == 12 and all(len(v) == CHUNK for v in values)
