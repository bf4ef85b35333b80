"""Memory-aware task admission on a real scheduler with real worker processes of 1 GiB and 4 threads
(the nanny kills one past 95%), installed over the comm through the agent, as the operator installs
it. The workload is the issue's: 40 ordinary tasks whose 8 MiB results stay in memory, then 16
tasks that each hold 300 MiB for 1.5 s."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from distributed import KilledWorker
from distributed.diagnostics.plugin import SchedulerPlugin
from memops_sandbox import dask_direct, spiky

from memops.scheduler import admission, agent
from memops.worker import admission as worker_admission
from tests import polling
from tests.scheduler import processes

OWNER = "default/tasks"
MIB = 2**20
SETTINGS: dict[str, Any] = {"small": 128 * MIB, "preemptAbove": 0.9, "preemptible": [], "maxRetries": 3, "probe": True}

pytestmark = pytest.mark.dask_cluster(workers=2, wait=True, memory_limit="1GiB", threads_per_worker=4)


class Departures(SchedulerPlugin):
    """Counts the workers that left the scheduler (a nanny's kill and restart is one)."""

    def __init__(self) -> None:
        self.left = 0

    def remove_worker(self, scheduler: Any, worker: str, **kwargs: Any) -> None:
        self.left += 1


def watch(cluster: processes.Cluster) -> Departures:
    plugin = Departures()
    cluster.scheduler.add_plugin(plugin, name="test-departures")
    return plugin


async def install(cluster: processes.Cluster, settings: dict[str, Any] | None = SETTINGS) -> dict[str, Any] | None:
    figures = await dask_direct.configure_admission(cluster.address, settings=settings, owner=OWNER)
    if settings is not None:
        # Each worker supplies the resource once its plugin is set up.
        await polling.poll(
            lambda: len(cluster.scheduler.resources.get(worker_admission.RESOURCE, {})) == 2,
            timeout=30,
            what="both workers supply memops' resource",
        )
    return figures


async def test_stock_dask_kills_the_workers_on_the_spiky_workload(cluster: processes.Cluster) -> None:
    """The anchor: stock Dask starts four spikes on a worker at once, the nanny kills it, and the
    computation fails with KilledWorker (or finishes after recomputing: either way, workers died)."""
    departures = watch(cluster)
    base, tops = spiky.submit(cluster.client)
    await cluster.client.gather(base)
    try:
        total = sum(await cluster.client.gather(tops))
        outcome = f"finished after recomputing ({total})"
    except KilledWorker as exc:
        outcome = f"KilledWorker: {str(exc)[:80]}"
    print(f"stock Dask: {outcome}; {departures.left} workers left the scheduler")
    assert departures.left >= 1


async def test_admission_finishes_the_spiky_workload_with_no_worker_killed(cluster: processes.Cluster) -> None:
    """Under admission the first spike of a worker runs alone (a probe), the next ones where their
    profiled peak fits: the right answer, no worker killed, every ordinary key still in memory."""
    departures = watch(cluster)
    await install(cluster)
    base, tops = spiky.submit(cluster.client)
    await cluster.client.gather(base)
    assert sum(await cluster.client.gather(tops)) == spiky.expected(16, 40)
    assert departures.left == 0
    # Not "where it was": a spike that read an ordinary key on the other worker made a copy there,
    # and Dask's own Active Memory Manager (ReduceReplicas) may keep that copy instead of the first.
    states = {f.key: cluster.scheduler.tasks[f.key] for f in base}
    assert all(ts.state == "memory" and ts.who_has for ts in states.values()), states
    figures = await install(cluster)
    assert figures is not None
    top = {entry["prefix"]: entry["peakBytes"] for entry in figures["top"]}
    print(f"profiles: {figures['top']}; probed {figures['tasksProbed']}, admitted {figures['tasksAdmitted']}")
    assert top["spike"] >= 250 * MIB
    assert top.get("ordinary", 0) < top["spike"] / 2


async def test_a_second_run_reserves_the_profiled_peak_and_removal_leaves_stock_dask(
    cluster: processes.Cluster,
) -> None:
    """Once profiled, a spike reserves its peak in the scheduler (no probe), an ordinary task
    nothing. Removed, admission leaves no plugin and no reservation: the next graph is stock."""
    await install(cluster)
    base, tops = spiky.submit(cluster.client, spikes=4)
    assert sum(await cluster.client.gather(tops)) == spiky.expected(4, 40)
    await polling.poll(
        lambda: admission_plugin(cluster).profiles.peak("spike") is not None, timeout=10, what="a spike profile"
    )
    more = [cluster.client.submit(spiky.spike, 100 + i, base[i], pure=False) for i in range(2)]
    extra = cluster.client.submit(spiky.ordinary, 99, pure=False)
    await asyncio.sleep(0.2)
    restrictions = {f.key: cluster.scheduler.tasks[f.key].resource_restrictions for f in [*more, extra]}
    assert all(restrictions[f.key][worker_admission.RESOURCE] >= 250 * MIB for f in more), restrictions
    assert not restrictions[extra.key], restrictions
    await cluster.client.gather([*more, extra])

    assert await install(cluster, None) is None
    assert admission.NAME not in cluster.scheduler.plugins
    assert worker_admission.NAME not in cluster.scheduler.worker_plugins
    after = cluster.client.submit(spiky.spike, 200, base[0], hold=0, seconds=0, pure=False)
    await cluster.client.gather(after)
    assert not cluster.scheduler.tasks[after.key].resource_restrictions


@pytest.mark.dask_cluster(workers=1)
async def test_preemption_stops_a_growing_task_before_the_nanny_and_it_runs_again(
    cluster: processes.Cluster,
) -> None:
    """Four tasks that each grow to 300 MiB in small Python steps start at once on one worker of
    1 GiB (``unprofiled: Run``: no probe). Above 70% of the limit the newest preemptible one is
    stopped and rescheduled; every task finishes, no worker is killed."""
    departures = watch(cluster)
    settings = {**SETTINGS, "probe": False, "preemptAbove": 0.7, "preemptible": ["gr*"]}
    await dask_direct.configure_admission(cluster.address, settings=settings, owner=OWNER)
    await polling.poll(
        lambda: len(cluster.scheduler.resources.get(worker_admission.RESOURCE, {})) == 1,
        timeout=30,
        what="the worker supplies memops' resource",
    )
    futures = [cluster.client.submit(spiky.grow, i, pure=False) for i in range(4)]
    results = await asyncio.wait_for(cluster.client.gather(futures), 120)
    assert results == [pytest.approx(30.0 + i) for i in range(4)]
    assert departures.left == 0
    figures = await dask_direct.configure_admission(cluster.address, settings=settings, owner=OWNER)
    assert figures is not None
    print(f"preempted {figures['preempted']}, profiles {figures['top']}")
    assert figures["preempted"] >= 1


HELD: list[bytearray] = []
"""In the worker process: memory that no task holds (a leak, or what the process keeps)."""


def _hold_all_but(room: int) -> int:
    """Hold what leaves ``room`` bytes under the pause threshold (80% of 1 GiB); the process' memory."""
    import psutil  # type: ignore[import-untyped]

    rss = int(psutil.Process().memory_info().rss)
    HELD.append(bytearray(max(0, int(0.8 * 2**30) - rss - room)))
    return int(psutil.Process().memory_info().rss)


def _room(dask_worker: Any) -> float:
    return float(dask_worker.state.available_resources.get(worker_admission.RESOURCE, 0.0))


async def _short_of(cluster: processes.Cluster, nbytes: int) -> bool:
    rooms = await cluster.client.run(_room)
    return bool(rooms) and all(room < nbytes for room in rooms.values())


@pytest.mark.dask_cluster(workers=1)
async def test_memory_that_no_task_holds_delays_a_task_but_not_for_ever(cluster: processes.Cluster) -> None:
    """The worker's process holds memory that no task does, up to 100 MiB under its pause threshold
    (80% of 1 GiB): the room no longer holds a profiled task of 200 MiB. With nothing
    restricted running, the task waits, the worker gives freed memory back, and past
    ``STALL_SECONDS`` the task starts with the room there is (before: it waited for ever); the
    worker lives."""
    departures = watch(cluster)
    settings = {**SETTINGS, "probe": False, "preemptAbove": None}
    await dask_direct.configure_admission(cluster.address, settings=settings, owner=OWNER)
    await polling.poll(
        lambda: len(cluster.scheduler.resources.get(worker_admission.RESOURCE, {})) == 1,
        timeout=30,
        what="the worker supplies memops' resource",
    )
    assert await cluster.client.submit(spiky.grow, 0, hold=200 * MIB, pure=False) == pytest.approx(30.0)
    await polling.poll(
        lambda: admission_plugin(cluster).profiles.peak(spiky.grow.__name__) is not None,
        timeout=30,
        what="the prefix's profile",
    )
    held = await cluster.client.run(_hold_all_but, 100 * MIB)
    print(f"the worker's process: {max(held.values()) / MIB:.0f} MiB")
    # The room the worker's tick last counted, from its memory sampled every 20 ms: until it counts
    # what was just held, a task that arrives finds the room of before (CI once saw it start at once).
    await polling.poll(
        lambda: _short_of(cluster, 200 * MIB), timeout=10, what="the worker's room to count the memory held"
    )
    started = asyncio.get_running_loop().time()
    result = await asyncio.wait_for(cluster.client.submit(spiky.grow, 1, hold=200 * MIB, pure=False), 120)
    waited = asyncio.get_running_loop().time() - started
    print(f"the task ran after {waited:.1f} s")
    assert result == pytest.approx(31.0)
    assert waited >= worker_admission.STALL_SECONDS, "it waited for the room first"
    assert departures.left == 0


@pytest.mark.dask_cluster(workers=1)
async def test_a_worker_grown_in_place_takes_a_task_that_fitted_no_worker(cluster: processes.Cluster) -> None:
    """A prefix profiled at 900 MiB fits no worker of 1 GiB (its capacity is the pause threshold's
    819 MiB): its task waits, counted as demand. Once the worker's limit is grown in place to
    1.5 GiB (the agent's ``resize``, as memops does after the kubelet applied the pod's), the
    worker tells the scheduler its new capacity and the task runs there (before, the scheduler kept
    the capacity of the worker's start, and the task waited for ever)."""
    settings = {**SETTINGS, "probe": False, "preemptAbove": None}
    await dask_direct.configure_admission(cluster.address, settings=settings, owner=OWNER)
    [address] = cluster.scheduler.workers
    supplied = cluster.scheduler.resources
    await polling.poll(
        lambda: address in supplied.get(worker_admission.RESOURCE, {}), timeout=30, what="the worker's resource"
    )
    assert supplied[worker_admission.RESOURCE][address] == pytest.approx(0.8 * 2**30)
    admission_plugin(cluster).profiles.add(spiky.grow.__name__, 900 * MIB)
    future = cluster.client.submit(spiky.grow, 0, hold=100 * MIB, pure=False)
    await polling.poll(
        lambda: admission_plugin(cluster).plain()["demandTasks"] == 1, timeout=30, what="the task counted as demand"
    )
    assert admission_plugin(cluster).plain()["demandBytes"] == 900 * MIB
    await asyncio.sleep(1)
    assert cluster.scheduler.tasks[future.key].state == "no-worker"

    agent.install(cluster.scheduler)
    grown = 3 * 2**29
    reply = await cluster.scheduler.handlers[agent.NAME](
        operation="resize", worker=address, memory_limit=grown, maximum=grown
    )
    assert reply["result"]["refused"] is None, reply

    assert await asyncio.wait_for(future, 60) == pytest.approx(30.0)
    assert supplied[worker_admission.RESOURCE][address] == pytest.approx(0.8 * grown)
    assert admission_plugin(cluster).plain()["demandTasks"] == 0


def admission_plugin(cluster: processes.Cluster) -> admission.AdmissionPlugin:
    plugin = cluster.scheduler.plugins[admission.NAME]
    assert isinstance(plugin, admission.AdmissionPlugin)
    return plugin


@pytest.mark.dask_cluster(workers=1, memory_limit="1GiB", threads_per_worker=1)
async def test_a_hostile_worker_report_builds_nothing_unbounded(cluster: processes.Cluster) -> None:
    """Reports on the admission topic are a peer's: names too long, figures out of range or of the
    wrong type are refused, one report gives at most 64 peaks, and a million prefixes keep at most
    4,096 profiles. A report that claims another worker's address is not read."""
    await dask_direct.configure_admission(cluster.address, settings=SETTINGS, owner=OWNER)
    plugin = admission_plugin(cluster)
    worker = next(iter(cluster.scheduler.workers))
    scheduler = cluster.scheduler
    scheduler.log_event(worker_admission.TOPIC, {"worker": "tcp://10.0.0.1:1", "peaks": [["stolen", 1]]})
    scheduler.log_event(
        worker_admission.TOPIC,
        {"worker": worker, "peaks": [["x" * 10_000, 1], ["neg", -1], ["huge", 2**60], ["str", "9"], "junk", ["ok", 5]]},
    )
    assert set(plugin.profiles.peaks) == {"ok"}
    scheduler.log_event(worker_admission.TOPIC, {"worker": worker, "peaks": [[f"p{i}", i] for i in range(100_000)]})
    assert len(plugin.profiles.peaks) == 1 + worker_admission.MAX_REPORTED
    for start in range(0, 1_000_000, 50_000):
        for i in range(start, start + 50_000, worker_admission.MAX_REPORTED):
            plugin.profiles.add(f"q{i}", i)
    assert len(plugin.profiles.peaks) == worker_admission.MAX_PREFIXES
    scheduler.log_event(worker_admission.TOPIC, {"worker": worker, "preempted": "many", "waiting": 2**60})
    assert plugin.preempted.get(worker, 0) == 0 and plugin.waiting.get(worker, 0) == 0
