"""The replication index (:mod:`memops.scheduler.replication_index`) always equals a full scan,
and so do the workers' holdings that it keeps (:class:`memops.scheduler.holdings.Shares`).

Random sequences of what changes a scheduler's placement of keys — keys reaching memory (computed
or scattered), copies made and dropped, keys released and forgotten, workers joining, leaving
(their keys removed as ``Scheduler.remove_worker`` removes them), starting to retire and coming
back, and rule edits (default, prefix, glob and scattered key rules, pod rules marking workers
present, gone or yet to come) — applied to a real ``distributed.Scheduler``'s own bookkeeping
(``add_replica``, ``remove_replica``, its transitions), not started. After every step the index
reads what it noted (in random-sized slices, as passes do) and is compared with
:func:`~memops.scheduler.replication_index.recompute`, which reads every key.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import Any

import dask
import distributed
from distributed import Client, LocalCluster, Scheduler
from distributed.core import Status
from distributed.scheduler import WorkerState
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from memops_sandbox import dask_direct

from memops.scheduler import holdings, replication, replication_index
from memops.scheduler import rules as ruling
from tests import polling

PREFIXES = ("load", "train", "other")
KEY_RULES = (
    {"prefix": "load", "replicas": 2},
    {"glob": "tr*", "replicas": 3},
    {"scattered": True, "replicas": 2},
)
WORKERS = 8  # addresses tcp://w0:1 ... tcp://w7:1, joining and leaving


def address(i: int) -> str:
    return f"tcp://w{i}:1"


def computed(x: int) -> int:  # the run_spec of a computed key: something can make it again
    return x


def run_spec() -> Any:
    from dask._task_spec import Task

    return Task("k", computed, 1)


key_steps = st.tuples(
    st.just("key"), st.sampled_from(PREFIXES), st.booleans(), st.integers(0, WORKERS - 1), st.integers(1, 10**6)
)
steps = st.one_of(
    key_steps,
    st.tuples(st.just("copy"), st.integers(0, 40), st.integers(0, WORKERS - 1)),
    st.tuples(st.just("drop"), st.integers(0, 40), st.integers(0, WORKERS - 1)),
    st.tuples(st.just("forget"), st.integers(0, 40)),
    st.tuples(st.just("join"), st.integers(0, WORKERS - 1)),
    st.tuples(st.just("leave"), st.integers(0, WORKERS - 1)),
    st.tuples(st.just("status"), st.integers(0, WORKERS - 1), st.booleans()),
    st.tuples(
        st.just("rules"),
        st.integers(1, 2),
        st.lists(st.integers(0, len(KEY_RULES) - 1), max_size=3, unique=True),
        st.lists(st.frozensets(st.integers(0, WORKERS - 1), max_size=3), max_size=2),
    ),
)


class Cluster:
    """A real Scheduler's bookkeeping, changed as the scheduler changes it."""

    def __init__(self, scheduler: Scheduler):
        self.s = scheduler
        self.serial = 0

    def keys(self) -> list[Any]:
        return list(self.s.tasks.values())

    def apply(self, step: tuple[Any, ...], index: replication_index.Index) -> None:
        s, kind = self.s, step[0]
        if kind == "key":
            _, prefix, scattered, w, nbytes = step
            ws = s.workers.get(address(w))
            if ws is None:
                return
            self.serial += 1
            ts = s.new_task(f"{prefix}-{self.serial}", None if scattered else run_spec(), "memory")
            ts.set_nbytes(nbytes)
            s.add_replica(ts, ws)  # as update_data (scatter) and _add_to_memory do
        elif kind in ("copy", "drop"):
            _, k, w = step
            tasks, ws = self.keys(), s.workers.get(address(w))
            if not tasks or ws is None:
                return
            ts = tasks[k % len(tasks)]
            if not ts.who_has:
                return
            if kind == "copy" and ws not in ts.who_has:
                s.add_replica(ts, ws)
            elif kind == "drop" and ws in ts.who_has and len(ts.who_has) > 1:
                s.remove_replica(ts, ws)
        elif kind == "forget":
            tasks = self.keys()
            if tasks:
                s._transitions({tasks[step[1] % len(tasks)].key: "forgotten"}, {}, {}, "test")
        elif kind == "join":
            a = address(step[1])
            if a not in s.workers:
                s.workers[a] = WorkerState(
                    address=a,
                    status=Status.running,
                    pid=0,
                    name=a,
                    memory_limit=2**30,
                    local_directory="",
                    nanny=None,
                    server_id=f"{a}-{self.serial}",
                    scheduler=s,
                )
                self.serial += 1
        elif kind == "leave":
            ws = s.workers.get(address(step[1]))
            if ws is None:
                return
            lost = []
            for ts in list(ws.has_what):  # as Scheduler.remove_worker does
                s.remove_replica(ts, ws)
                if not ts.who_has:
                    lost.append(ts.key)
            del s.workers[ws.address]
            if lost:
                s._transitions(dict.fromkeys(lost, "forgotten"), {}, {}, "test")
        elif kind == "status":
            ws = s.workers.get(address(step[1]))
            if ws is not None:
                ws.status = Status.closing_gracefully if step[2] else Status.running
        elif kind == "rules":
            _, default, keys, pods = step
            rules = ruling.parse(
                {
                    "default": default,
                    "keys": [KEY_RULES[i] for i in keys],
                    "pods": [{"workers": [address(w) for w in sorted(p)], "replicas": 2} for p in pods],
                }
            )
            index.retune(rules)


def check(index: replication_index.Index, scheduler: Scheduler) -> None:
    entries, off, totals = replication_index.recompute(index, scheduler.tasks.values())
    assert index.entries == entries
    assert set(index.off) == off
    assert index.totals == totals
    held = {ts for keys in index.held.values() for ts in keys}
    assert held == {ts for ts in scheduler.tasks.values() if ts.who_has}
    # The workers' holdings, from what changed, equal the sum over every replicated key.
    workers = scheduler.workers.values()
    assert index.shares.holdings(workers) == holdings.holdings(workers, scheduler.replicated_tasks)


async def run(initial: list[tuple[Any, ...]], sequence: list[tuple[Any, ...]], limits: list[int]) -> None:
    scheduler = Scheduler(dashboard=False, dashboard_address="127.0.0.1:0", validate=False)
    try:
        cluster = Cluster(scheduler)
        index = replication_index.Index(ruling.parse({"keys": [KEY_RULES[0]]}))
        for i in range(3):
            cluster.apply(("join", i), index)
        for step in initial:  # keys in memory before the index follows the scheduler: its first build
            cluster.apply(step, index)
        index.attach(scheduler)
        for n, step in enumerate(sequence):
            cluster.apply(step, index)
            event(step[0])
            limit = limits[n % len(limits)]
            # The workers' status and marks are read at the start of each update: a worker whose
            # status changed notes all its keys, which may be more than one slice.
            index.update(limit, seconds=60)
            while index.pending:  # read in slices, as passes do
                index.update(limit, seconds=60)
                index.shares.update(limit)  # as a pass reads a slice of them when many wait
            check(index, scheduler)
        index.detach()
        assert "add_replica" not in vars(scheduler), "the scheduler's own methods are back"
    finally:
        await scheduler.close()
        scheduler.http_server.stop()  # listening since construction; close() stops only a started scheduler's


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    initial=st.lists(key_steps, max_size=10),
    sequence=st.lists(steps, min_size=5, max_size=60),
    limits=st.lists(st.integers(1, 7), min_size=1, max_size=3),
)
# A worker that stops running notes its three keys, read one at a time.
@example(
    initial=[("key", "load", False, 0, 1)],
    sequence=[("key", "load", False, 0, 1), ("copy", 0, 1), ("key", "load", False, 0, 1), ("status", 0, True)],
    limits=[1],
)
def test_the_index_equals_a_full_recomputation_after_every_step(
    initial: list[tuple[Any, ...]], sequence: list[tuple[Any, ...]], limits: list[int]
) -> None:
    asyncio.run(run(initial, sequence, limits))


# -- a real scheduler with 50 workers ---------------------------------------------------------------


async def wait_until(predicate: Callable[[], Awaitable[Any]], timeout: float, what: str) -> None:
    await polling.poll(predicate, timeout=timeout, what=what)


def agrees(scheduler: Scheduler) -> int:
    """On the scheduler's event loop, between two of its steps: the index, once it has read what it
    noted, equals a full scan on every key; how many keys are ruled."""
    index = scheduler.plugins[replication.NAME].policy.index
    if not replication.in_force(index.rules):
        # No rule in force: the scheduler's own methods, and nothing indexed.
        assert not index.attached and not index.entries and "add_replica" not in vars(scheduler)
        return 0
    if not index.attached:
        return -1  # in force since this step: the next pass attaches it
    while index.pending:
        index.update(seconds=60)
    index.update()  # the workers' status and marks, as a pass reads them
    check(index, scheduler)
    # What the agent answers for holdings: the index' Shares while a rule is in force.
    assert holdings.followed(scheduler) is index.shares
    workers = scheduler.workers.values()
    assert holdings.summarize(scheduler)["holdings"] == holdings.holdings(workers, scheduler.replicated_tasks)
    return len(index.entries)


async def test_a_real_scheduler_with_50_workers_agrees_with_a_full_scan_through_losses_joins_and_rules() -> None:
    """50 workers (``nthreads=1``, in this process: ``processes=False``, which keeps 50 workers
    affordable on two cores; the scheduler, its AMM, memops' agent over the comm and the workers'
    transfers are all real). Random losses (a worker closed without retiring, its keys removed by
    the scheduler's own ``remove_worker``), joins, and rule edits; after each, and while memops' passes
    copy and drop, the index agrees with a full scan on every key."""
    rng = random.Random(30)
    with dask.config.set(
        {
            "distributed.scheduler.active-memory-manager.start": True,
            "distributed.scheduler.active-memory-manager.interval": "500ms",
        }
    ):
        async with (
            LocalCluster(
                n_workers=50,
                processes=False,
                threads_per_worker=1,
                # All 50 workers share this process, so each one's memory is the whole process':
                # with the default limit (the machine's memory over 50, ~490 MiB here) a test
                # process grown past 80% of that by earlier tests pauses them all, and a paused
                # worker takes no copy.
                memory_limit="8GiB",
                protocol="tcp",  # memops speaks tcp:// (or tls://) only, as to any scheduler
                host="127.0.0.1",
                dashboard_address="127.0.0.1:0",
                asynchronous=True,
            ) as local,
            Client(local, asynchronous=True) as client,
        ):
            scheduler = local.scheduler
            assert scheduler is not None
            address = scheduler.address
            ruled = [client.submit(bytes, 1000, key=f"load-parquet-{i}", pure=False) for i in range(300)]
            other = [client.submit(bytes, 1000, key=f"other-{i}", pure=False) for i in range(700)]
            scattered = await client.scatter([bytes(500)] * 200, hash=False)
            await distributed.wait(ruled + other)
            rules: dict[str, Any] = {"keys": [{"prefix": "load-parquet", "replicas": 2}], "maxReplicatedFraction": 0.5}
            assert (
                await dask_direct.configure_replication(address, rules=rules, places={}, owner="test", timeout=30)
                is not None
            )

            async def settled() -> bool:
                who_has = await client.scheduler.who_has(keys=[str(f.key) for f in ruled])
                return all(len(h) >= 2 for h in who_has.values())

            await wait_until(settled, 180, "ruled keys at two copies")  # a bound, not a speed: CI runs builds beside
            assert agrees(scheduler) >= 300
            for _ in range(12):
                what = rng.choice(("lose", "lose", "join", "rule", "rule"))
                if what == "lose" and len(scheduler.workers) > 20:
                    name = rng.choice(list(local.workers))
                    await local.workers.pop(name).close(nanny=False, executor_wait=False)
                elif what == "join":
                    await local.scale(len(local.workers) + rng.randint(1, 3))
                else:
                    workers = sorted(scheduler.workers)
                    rules = {
                        "default": rng.choice((1, 1, 2)),
                        "keys": rng.sample(
                            [
                                {"prefix": "load-parquet", "replicas": rng.randint(1, 3)},
                                {"glob": "oth*", "replicas": 2},
                                {"scattered": True, "replicas": 2},
                            ],
                            rng.randint(0, 2),
                        ),
                        "pods": [{"workers": rng.sample(workers, 5), "replicas": 2}] if rng.random() < 0.5 else [],
                        "maxReplicatedFraction": 0.5,
                    }
                    await dask_direct.configure_replication(address, rules=rules, places={}, owner="test", timeout=30)
                print(
                    what, len(scheduler.workers), len(scheduler.tasks), agrees(scheduler)
                )  # at once, whatever the passes do
                await asyncio.sleep(rng.uniform(0.2, 1.5))  # passes copy and drop meanwhile
                agrees(scheduler)
            assert scattered and other  # held to the end
