"""A worker's memory limit changed on the fly, on a real scheduler with real nannies and workers.

One worker process under a nanny, no spilling (its memory stays in the process), the AMM off.
Memory is held in the worker's process by a bytes object that touches every page. Whether the
nanny would kill the worker, and whether the worker pauses, is asked of their own memory
monitors, called once on purpose (the nanny runs in this process; the worker's through
``client.run``): the same code that their periodic callbacks run, with no waiting for a tick.
"""

from __future__ import annotations

from typing import Any

import pytest
from distributed import Client, LocalCluster
from memops_sandbox import dask_direct

from memops.clients import daskrpc
from memops.scheduler import agent, worker_limits
from tests import polling
from tests.scheduler import processes, test_without_memops

MiB = 2**20
OLD = 256 * MiB
NEW = 512 * MiB
CONFIG = {
    "distributed.worker.memory.target": False,
    "distributed.worker.memory.spill": False,
    "distributed.worker.memory.pause": 0.8,
    "distributed.worker.memory.terminate": 0.95,
    "distributed.scheduler.active-memory-manager.start": False,
}


pytestmark = pytest.mark.dask_cluster(workers=1, config=CONFIG, memory_limit=OLD, wait=True)


def hold(nbytes: int, dask_worker: Any = None) -> int:
    """Hold ``nbytes`` more in the worker's process (every page touched); its RSS after."""
    held = dask_worker.__dict__.setdefault("_test_held", [])
    if nbytes > 0:
        held.append(b"\x01" * nbytes)
    return int(dask_worker.monitor.get_process_memory())


def paused_after_check(dask_worker: Any) -> tuple[str, int, int]:
    """The worker's memory monitor's pause decision, made now: (status, memory, limit)."""
    memory = dask_worker.monitor.get_process_memory()
    dask_worker.memory_manager._maybe_pause_or_unpause(dask_worker, memory)
    return dask_worker.status.name, int(memory), int(dask_worker.memory_manager.memory_limit)


async def rss_to(client: Client, address: str, target: int) -> int:
    """Raise the worker's RSS to about ``target`` bytes; its RSS after."""
    now = (await client.run(hold, 0, workers=[address]))[address]
    return int((await client.run(hold, max(target - now, 0), workers=[address]))[address])


def nanny_kills(nanny: Any) -> bool:
    """Whether the nanny's memory monitor, run now, sends the worker SIGTERM."""
    pid = nanny.process.process.pid
    before = nanny.memory_manager._last_terminated_pid
    nanny.memory_manager.memory_monitor(nanny)
    return bool(nanny.memory_manager._last_terminated_pid == pid != before)


async def reported_limit(client: Client, address: str) -> int:
    """The worker's memory limit as ``Client.scheduler_info`` reports it (an asynchronous client's
    ``scheduler_info()`` returns its cache: this asks the scheduler, as a synchronous one does)."""
    identity = await client.scheduler.identity(n_workers=-1)
    return int(identity["workers"][address]["memory_limit"])


async def call_agent(local: LocalCluster, **arguments: Any) -> dict[str, Any]:
    """The agent's ``resize`` operation, as the operator calls it (the handler, in the scheduler)."""
    scheduler = local.scheduler
    agent.install(scheduler)
    reply = await scheduler.handlers[agent.NAME](operation="resize", **arguments)
    assert reply["agent"] == agent.VERSION
    return dict(reply["result"])


async def test_growth_reaches_the_scheduler_the_worker_and_the_nanny(cluster: tuple[LocalCluster, Client]) -> None:
    """After a growth, the scheduler reports the new limit, the worker's thresholds follow it,
    and the nanny's kill threshold too."""
    local, client = cluster
    [address] = local.scheduler.workers
    total = local.scheduler.total_memory

    reply = await call_agent(local, worker=address, memory_limit=NEW, maximum=NEW)

    assert reply["refused"] is None, reply
    assert reply["applied"] == ["nanny", "worker", "scheduler"]
    assert reply["previous"] == OLD
    assert await reported_limit(client, address) == NEW
    assert local.scheduler.total_memory == total + NEW - OLD
    limits = await client.run(lambda dask_worker: dask_worker.memory_manager.memory_limit)
    assert limits == {address: NEW}
    [nanny] = local.workers.values()
    assert nanny.memory_manager.memory_limit == NEW


async def test_a_grown_worker_survives_above_the_old_kill_threshold_and_pauses_at_the_new_one(
    cluster: tuple[LocalCluster, Client],
) -> None:
    """Grown from 256 to 512 MiB: with its RSS between 95% of the old limit and 80% of the new
    one the nanny does not kill it and it runs; past 80% of the new limit it pauses."""
    local, client = cluster
    [address] = local.scheduler.workers
    [nanny] = local.workers.values()
    reply = await call_agent(local, worker=address, memory_limit=NEW, maximum=NEW)
    assert reply["applied"] == ["nanny", "worker", "scheduler"], reply
    pid = nanny.process.process.pid

    rss = await rss_to(client, address, int(0.95 * OLD) + 32 * MiB)
    assert 0.95 * OLD < rss < 0.8 * NEW, rss
    assert not nanny_kills(nanny), "the nanny kills at 95% of the old limit"
    status, memory, limit = (await client.run(paused_after_check, workers=[address]))[address]
    assert (status, limit) == ("running", NEW), (status, memory, limit)

    rss = await rss_to(client, address, int(0.8 * NEW) + 24 * MiB)
    assert 0.8 * NEW < rss < 0.95 * NEW, rss
    status, memory, limit = (await client.run(paused_after_check, workers=[address]))[address]
    assert status == "paused", (status, memory, limit)
    assert not nanny_kills(nanny)
    await polling.poll(
        lambda: local.scheduler.workers[address].status.name == "paused",
        timeout=20,
        what="the scheduler sees the pause",
    )
    assert nanny.process.process.pid == pid, "the worker was never restarted"


async def test_a_shrunk_worker_pauses_at_the_smaller_limit(cluster: tuple[LocalCluster, Client]) -> None:
    """Shrunk from 256 to 160 MiB while its memory is below 80% of 160 MiB: the shrink is taken
    (worker, nanny, scheduler); past 80% of 160 MiB, which is below 80% of 256, it pauses."""
    local, client = cluster
    [address] = local.scheduler.workers
    [nanny] = local.workers.values()
    small = 160 * MiB
    rss = await rss_to(client, address, 0)
    if rss > 0.7 * small:
        pytest.skip(f"the worker's resting RSS ({rss} bytes) leaves no room under 80% of {small} bytes")

    reply = await call_agent(local, worker=address, memory_limit=small, maximum=NEW)

    assert reply["refused"] is None, reply
    assert reply["applied"] == ["worker", "nanny", "scheduler"]
    assert await reported_limit(client, address) == small
    assert nanny.memory_manager.memory_limit == small
    rss = await rss_to(client, address, int(0.8 * small) + 8 * MiB)
    assert 0.8 * small < rss < 0.8 * OLD, rss
    status, memory, limit = (await client.run(paused_after_check, workers=[address]))[address]
    assert (status, limit) == ("paused", small), (status, memory, limit)


async def test_a_shrink_below_the_worker_s_memory_is_refused_and_changes_nothing(
    cluster: tuple[LocalCluster, Client],
) -> None:
    """A worker whose memory is over the pause threshold of the smaller limit refuses it: no
    part takes it, so the nanny does not kill it at once."""
    local, client = cluster
    [address] = local.scheduler.workers
    [nanny] = local.workers.values()
    rss = await rss_to(client, address, 160 * MiB)
    small = int(rss / 0.8) - 16 * MiB  # its memory is over 80% of it

    reply = await call_agent(local, worker=address, memory_limit=small, maximum=NEW)

    assert reply["applied"] == [], reply
    assert reply["refused"].startswith("worker: "), reply
    assert await reported_limit(client, address) == OLD
    assert nanny.memory_manager.memory_limit == OLD
    assert (await client.run(lambda dask_worker: dask_worker.memory_manager.memory_limit)) == {address: OLD}


@pytest.mark.parametrize(
    ("limit", "maximum", "why"),
    [
        pytest.param(0, NEW, "positive", id="zero"),
        pytest.param(-MiB, NEW, "positive", id="negative"),
        pytest.param(float(NEW), NEW, "positive", id="float"),
        pytest.param(True, NEW, "positive", id="bool"),
        pytest.param("512Mi", NEW, "positive", id="string"),
        pytest.param(NEW + 1, NEW, "above the maximum", id="above-maximum"),
        pytest.param(NEW, None, "maximum", id="no-maximum"),
    ],
)
def test_limits_are_validated(limit: Any, maximum: Any, why: str) -> None:
    with pytest.raises(worker_limits.LimitError, match=why):
        worker_limits.checked_limit(limit, maximum)


async def test_an_invalid_limit_or_unknown_worker_changes_nothing(cluster: tuple[LocalCluster, Client]) -> None:
    local, client = cluster
    [address] = local.scheduler.workers
    above = await call_agent(local, worker=address, memory_limit=NEW * 2, maximum=NEW)
    unknown = await call_agent(local, worker="tcp://127.0.0.1:1", memory_limit=NEW, maximum=NEW)
    assert (above["applied"], unknown["applied"]) == ([], [])
    assert "above the maximum" in above["refused"] and unknown["refused"] == "no such worker"
    assert await reported_limit(client, address) == OLD


async def test_a_worker_restarted_by_its_nanny_keeps_the_new_limit(cluster: tuple[LocalCluster, Client]) -> None:
    """The nanny starts a new worker process with its own copy of the limit: the grown one."""
    local, client = cluster
    [address] = local.scheduler.workers
    reply = await call_agent(local, worker=address, memory_limit=NEW, maximum=NEW)
    assert reply["applied"] == ["nanny", "worker", "scheduler"], reply

    await client.restart_workers([address])

    [again] = local.scheduler.workers
    assert await reported_limit(client, again) == NEW
    assert (await client.run(lambda dask_worker: dask_worker.memory_manager.memory_limit)) == {again: NEW}


async def test_the_operator_resizes_a_worker_where_memops_is_not_installed(unused_tcp_port: int) -> None:
    """Through the operator's comm (msgpack only) to a scheduler, a nanny and a worker in which
    ``import memops`` fails: the plugins arrive by value, and every part takes the limit."""
    address = f"tcp://127.0.0.1:{unused_tcp_port}"
    scheduler = test_without_memops.stock(
        "distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", str(unused_tcp_port)
    )
    worker = test_without_memops.stock(
        "distributed.cli.dask_worker", address, "--nthreads", "1", "--memory-limit", str(OLD), *processes.OPTIONS
    )
    try:

        async def workers() -> list[Any]:
            try:
                return list((await dask_direct.fetch_snapshot(address, timeout=5)).workers)
            except daskrpc.SchedulerUnreachable:
                return []

        [before] = await polling.poll(workers, timeout=60, what="the worker", interval=0.2)
        assert before.memory_limit == OLD
        async with dask_direct.connect(address, timeout=10) as connected:
            reply = await connected.resize_worker(before.address, memory_limit=NEW, maximum=NEW, timeout=40)
        assert reply["refused"] is None, reply
        assert list(reply["applied"]) == ["nanny", "worker", "scheduler"]
        assert reply["parts"]["nanny"]["limit"] == reply["parts"]["worker"]["limit"] == NEW
        [after] = await workers()
        assert (after.address, after.memory_limit) == (before.address, NEW)
    finally:
        for process in (worker, scheduler):
            processes.kill(process)


@pytest.mark.dask_cluster(
    config={**CONFIG, "distributed.worker.memory.target": 0.6, "distributed.worker.memory.transfer": 0.1}
)
async def test_what_the_worker_computed_from_its_limit_at_start_follows(cluster: tuple[LocalCluster, Client]) -> None:
    """The spill buffer's target (``target`` of the limit) and the limit on incoming transfers
    (``transfer`` of it) were computed once, at start: both follow the new limit."""
    local, client = cluster
    [address] = local.scheduler.workers

    def figures(dask_worker: Any) -> tuple[int, int]:
        return int(dask_worker.data.n), int(dask_worker.state.transfer_incoming_bytes_limit)

    assert (await client.run(figures))[address] == (int(0.6 * OLD), int(0.1 * OLD))
    reply = await call_agent(local, worker=address, memory_limit=NEW, maximum=NEW)
    assert reply["applied"] == ["nanny", "worker", "scheduler"], reply
    assert (await client.run(figures))[address] == (int(0.6 * NEW), int(0.1 * NEW))
