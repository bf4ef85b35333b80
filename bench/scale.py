"""Replication targets at scale: per-pass cost of the index against a full scan, in the same run.

Each size is a real ``distributed.Scheduler`` (constructed, not started: no worker process), its
bookkeeping fed as ``bench/decision_cost.py`` feeds distributed's own ``WorkerState`` and
``TaskState`` objects, here placed through the scheduler's own ``add_replica`` /
``remove_replica``: 1,000 keys a worker up to 1,000,000 keys, one in ten under a prefix rule
(``replicas: 2``) and held twice, one worker holding 10,000 of those copies (or all it can at the
small sizes). :class:`memops.scheduler.replication.Replication` runs as its AMM runs it (a
generator answered with the suggested worker), every pass on an asyncio loop whose stalls a
5 ms ticker measures; suggestions are enacted in the bookkeeping at once (``add_replica`` /
``remove_replica``, as the scheduler records a worker's ``add-keys`` or the AMM's drops), so the
time to restore is the passes' own, with no transfer.

Columns, ms unless said:

- build: the index' first reading of every key (passes of at most 50,000 keys each): passes, and
  the longest;
- at target: a pass with every ruled key at its target (median of 5), and memops' share of the
  scheduler's CPU at rest (that pass every ``--interval`` seconds);
- after rule: the first pass after the rule becomes ``replicas: 3`` (every ruled key under);
- after loss: the first pass after the worker with the 10,000 copies is removed (as
  ``Scheduler.remove_worker`` removes its keys), and the seconds until every ruled key has its
  two copies again, passes as replication's AMM runs them (a tick every ``BUSY_INTERVAL``, a pass
  when :meth:`~memops.scheduler.replication.Replication.due`: at once while copies are moving,
  else every ``--interval`` seconds, and a pass' own spacing, ``MAX_SHARE``, kept), with the
  longest event-loop stall meanwhile and the garbage collector's longest pause (*gc pause*; a
  collection over a million TaskStates stalls the loop whatever runs); a pass with keys to decide
  first reads every worker's memory, as the AMM's ``run_once`` does before its policies;
- holdings: what the agent answers (:func:`memops.scheduler.holdings.of_scheduler`) while a rule is
  in force: the index' :class:`~memops.scheduler.holdings.Shares`, at rest (median of 3) and right
  after the loss (what changed: the lost worker's keys); *holdings scan*: the sum over every
  replicated key (:func:`memops.scheduler.holdings.holdings`, what it answers without a rule);
- drain: memops' drain (:class:`memops.scheduler.drain.DrainPlugin`) of 1% of the workers at once
  (at least one; 1,000 keys each), passes one after the other, every copy asked for landing before
  the next: the first pass, the longest, and how many;
- full scan: the same pass, reading every key first, as a pass without the index must to be
  exact (before the index, a pass read the ruled keys found so far plus a rolling 50,000-key
  slice of the rest, and found a new rule's keys over 20 passes), at target (median of 3) and
  after the loss; printed as a ratio over the index' pass at target and after the loss.

    python bench/scale.py                 # the table in docs/performance.md (10 to 3,000 workers)
    python bench/scale.py --small         # the small pass CI runs (10 and 100 workers)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import itertools
import logging
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import benchkit
import dask
from distributed import Scheduler
from distributed.core import Status
from distributed.scheduler import TaskGroup, TaskPrefix, TaskState, WorkerState

from memops.scheduler import drain, holdings, replication
from memops.scheduler import rules as ruling

SIZES = (10, 100, 1000, 3000)
KEYS_PER_WORKER = 1000
MAX_KEYS = 1_000_000
RULED_EVERY = 10
HEAVY_COPIES = 10_000
MEMORY_LIMIT = 64 * 2**30
RULE = {"keys": [{"prefix": "x-ruled", "replicas": 2}], "maxReplicatedFraction": 0.5, "ceiling": 0.9}
MORE = {"keys": [{"prefix": "x-ruled", "replicas": 3}], "maxReplicatedFraction": 0.5, "ceiling": 0.9}


@dataclass
class Row:
    workers: int
    keys: int
    ruled: int
    lost: int = 0
    figures: dict[str, float] = field(default_factory=dict)


def build(workers: int, keys: int, seed: int = 0) -> tuple[Scheduler, WorkerState, list[TaskState]]:
    """A scheduler's bookkeeping: ruled keys on two workers each (the heavy worker holding up to
    :data:`HEAVY_COPIES` of them), the rest on one."""
    rng = random.Random(seed)
    with dask.config.set({"distributed.scheduler.active-memory-manager.start": False}):  # only memops' pass runs
        scheduler = Scheduler(dashboard=False, dashboard_address="127.0.0.1:0", validate=False)
    states = []
    for i in range(workers):
        address = f"tcp://10.0.{i // 250}.{i % 250}:8786"
        ws = WorkerState(
            address=address,
            status=Status.running,
            pid=0,
            name=f"w-{i}",
            memory_limit=MEMORY_LIMIT,
            local_directory="",
            nanny=None,
            server_id=f"server-{i}",
            scheduler=scheduler,
        )
        ws.metrics = {"memory": 0, "spilled_bytes": {"memory": 0, "disk": 0}}  # as a first heartbeat sets them
        scheduler.workers[address] = ws
        scheduler.running.add(ws)  # as add_worker does for a running worker
        states.append(ws)
    heavy = states[0]
    others = states[1:]
    prefixes = {"x": TaskPrefix("x"), "x-ruled": TaskPrefix("x-ruled")}
    groups: dict[str, TaskGroup] = {}
    ruled: list[TaskState] = []
    for k in range(keys):
        is_ruled = k % RULED_EVERY == RULED_EVERY // 2
        name = f"x{'-ruled' if is_ruled else ''}-{k // 1000}"
        prefix = prefixes["x-ruled" if is_ruled else "x"]
        group = groups.get(name) or groups.setdefault(name, TaskGroup(name, prefix))
        ts = TaskState((name, k % 1000), None, "memory", group, False)
        ts.nbytes = rng.randint(1_000, 100_000)
        scheduler.tasks[ts.key] = ts
        if is_ruled:
            first = heavy if len(ruled) < HEAVY_COPIES else rng.choice(others)
            second = rng.choice(others)
            while second is first:
                second = rng.choice(others)
            scheduler.add_replica(ts, first)
            scheduler.add_replica(ts, second)
            ruled.append(ts)
        else:
            scheduler.add_replica(ts, rng.choice(others))
    return scheduler, heavy, ruled


class Driver:
    """Runs the policy's passes as its AMM would, and enacts what it suggests in the bookkeeping."""

    def __init__(self, scheduler: Scheduler, rules: dict[str, Any], interval: float = replication.INTERVAL):
        self.scheduler = scheduler
        places = {a: (f"node-{i}", f"zone-{i % 3}") for i, a in enumerate(scheduler.workers)}
        self.policy = replication.Replication(ruling.parse(rules), places)
        self.policy.manager = _Manager(scheduler)  # type: ignore[assignment]
        self.policy.interval = interval
        self.chosen: list[tuple[str, TaskState, WorkerState]] = []
        self.longest_collection = 0.0  # ms: the garbage collector's longest pause during the restore

    def run(self, *, enact: bool = True, spaced: bool = False) -> float:
        """One pass, as :class:`memops.scheduler.replication.ReplicationManager` runs it; ms. Its
        suggestions are accepted (the first candidate) and kept for :meth:`enact`; without
        ``enact``, each is answered None (as if no worker fitted), and nothing changes."""

        started = time.perf_counter()
        if not spaced:
            self.policy.next_pass = 0.0  # run, however long the last pass (the restore keeps the spacing)
        elif started < self.policy.next_pass:
            return 0.0
        if not self.policy.prepare(self.scheduler):
            return (time.perf_counter() - started) * 1000  # every ruled key at its target
        # As the AMM's run_once does before its policies: every worker's memory.
        workers_memory = {ws: ws.memory.optimistic for ws in self.scheduler.workers.values()}
        chosen = []
        passes = self.policy.run()
        with contextlib.suppress(StopIteration):
            suggestion = next(passes)
            while True:
                answer = next(iter(suggestion.candidates)) if enact and suggestion.candidates else None
                if answer is not None:
                    chosen.append((suggestion.op, suggestion.ts, answer))
                suggestion = passes.send(answer)
        self.chosen = chosen
        del workers_memory
        return (time.perf_counter() - started) * 1000

    def enact(self) -> None:
        """What the last pass suggested, as the scheduler records it: the workers' ``add-keys``
        for copies, the AMM's own ``remove_replica`` for drops."""
        for op, ts, ws in self.chosen:
            if op == "replicate" and ws not in (ts.who_has or ()):
                self.scheduler.add_replica(ts, ws)
            elif op == "drop" and ws in (ts.who_has or ()) and len(ts.who_has or ()) > 1:
                self.scheduler.remove_replica(ts, ws)
        self.chosen = []

    async def enact_in_batches(self, size: int = 256) -> None:
        """:meth:`enact`, a batch of suggestions per turn of the loop, as workers' messages arrive."""
        chosen, self.chosen = self.chosen, []
        for start in range(0, len(chosen), size):
            self.chosen = chosen[start : start + size]
            self.enact()
            await asyncio.sleep(0)

    def full_pass(self) -> float:
        """A pass that reads every key first, as a pass without the index must to be exact, then
        decides as the index' pass does; ms. Nothing is enacted."""
        index = self.policy.index
        index._queue([list(self.scheduler.tasks.values())])
        update = index.update
        index.update = functools.partial(update, limit=2**62, seconds=float("inf"))  # type: ignore[method-assign]
        try:
            return self.run(enact=False)
        finally:
            del index.update

    def settle(self, limit: int = 200) -> tuple[int, float]:
        """Passes until the index has read everything and nothing is off target: how many, the longest (ms)."""
        longest, n = 0.0, 0
        index = self.policy.index
        while n < limit and (n == 0 or index.pending or index.off):
            longest = max(longest, self.run())
            self.enact()
            n += 1
        return n, longest


class _Manager:
    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler


def remove_worker(scheduler: Scheduler, ws: WorkerState) -> int:
    """As ``Scheduler.remove_worker`` updates the bookkeeping: its replicas removed, keys left with
    none forgotten; the ruled copies lost."""
    lost_copies, lost = 0, []
    for ts in list(ws.has_what):
        scheduler.remove_replica(ts, ws)
        lost_copies += ts.prefix.name == "x-ruled"
        if not ts.who_has:
            lost.append(ts.key)
    del scheduler.workers[ws.address]
    scheduler.running.discard(ws)
    scheduler._transitions(dict.fromkeys(lost, "forgotten"), {}, {}, "bench-scale")
    return lost_copies


def restored(ruled: Sequence[TaskState]) -> bool:
    return all(len(ts.who_has or ()) >= 2 for ts in ruled)


async def restore(
    driver: Driver, ruled: Sequence[TaskState], interval: float, timeout: float
) -> tuple[float, list[float], float, float]:
    """Passes every ``interval`` seconds on this loop until every ruled key is back at two copies:
    seconds from the loss, each pass' ms, the longest event-loop stall (ms) meanwhile, and a full
    scan's pass (ms) right after the first."""
    stalls = [0.0]
    anchors = [0]  # how many anchor passes ran: a tick across one is not the scheduler's stall
    stop = asyncio.Event()

    async def ticker() -> None:
        while not stop.is_set():
            started, before = time.perf_counter(), anchors[0]
            await asyncio.sleep(0.005)
            if anchors[0] == before:
                stalls[0] = max(stalls[0], (time.perf_counter() - started - 0.005) * 1000)

    watch = asyncio.create_task(ticker())
    collections = Collections()
    await asyncio.sleep(0.02)  # the ticker ticking
    started = time.perf_counter()
    passes: list[float] = []
    scans: list[float] = []
    try:
        while not restored(ruled):
            if time.perf_counter() - started > timeout:
                raise SystemExit(f"lost copies not back within {timeout}s")
            if passes:
                await asyncio.sleep(replication.BUSY_INTERVAL)  # the AMM's tick
                if not driver.policy.due(time.perf_counter()):
                    continue
            passes.append(driver.run(spaced=True))
            if len(passes) == 1:
                # The anchor, on the same state: a pass reading every key (its time left out of the restore's).
                chosen, paused, next_pass = driver.chosen, time.perf_counter(), driver.policy.next_pass
                anchors[0] += 1
                scans.append(driver.full_pass())
                driver.chosen, driver.policy.next_pass = chosen, next_pass + time.perf_counter() - paused
                started += time.perf_counter() - paused
            await asyncio.sleep(0)
            await driver.enact_in_batches()
    finally:
        stop.set()
        await watch
        collections.stop()
    driver.longest_collection = collections.longest
    return time.perf_counter() - started, passes, stalls[0], scans[0]


class Collections:
    """The longest of the garbage collector's pauses (ms) while it is kept: a stall of the loop that
    is no pass' own (a collection over a million TaskStates lands in whatever runs)."""

    def __init__(self) -> None:
        self.longest = 0.0
        self.began = 0.0
        gc.callbacks.append(self.callback)

    def callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self.began = time.perf_counter()
        else:
            self.longest = max(self.longest, (time.perf_counter() - self.began) * 1000)

    def stop(self) -> None:
        gc.callbacks.remove(self.callback)


async def measure(workers: int, interval: float) -> Row:
    keys = min(workers * KEYS_PER_WORKER, MAX_KEYS)
    scheduler, heavy, ruled = build(workers, keys)
    gc.collect()  # the build's garbage, collected before anything is timed (a scheduler at rest has none)
    row = Row(workers, keys, len(ruled))
    f = row.figures
    try:
        driver = Driver(scheduler, RULE, interval)
        index = driver.policy.index
        f["build passes"], f["build longest"] = driver.settle()
        assert not index.off and len(index.entries) == len(ruled), index
        f["at target"] = statistics.median(driver.run() for _ in range(5))
        f["share at rest %"] = f["at target"] / (interval * 1000) * 100
        f["full scan"] = statistics.median(driver.full_pass() for _ in range(3))
        shares = index.shares
        f["holdings scan"] = benchkit.median_ms(
            lambda: holdings.holdings(scheduler.workers.values(), scheduler.replicated_tasks)
        )
        shares.holdings(scheduler.workers.values())  # what the build noted, read once (as on the first ask)
        f["holdings"] = benchkit.median_ms(lambda: shares.holdings(scheduler.workers.values()))
        # A rule: every ruled key now wants three copies. Its first pass; then back, and settled.
        gc.collect()  # the scans' garbage above, collected first (as before the loss below)
        driver.policy.retune(ruling.parse(MORE), driver.policy.places)
        f["after rule"] = driver.run(enact=False)
        rule_passes = 1
        while index.pending:
            driver.run(enact=False)
            rule_passes += 1
        f["rule passes"] = rule_passes  # until every ruled key is read under the new rule
        driver.policy.retune(ruling.parse(RULE), driver.policy.places)
        driver.settle()
        # The loss: the worker with the most ruled copies, removed as the scheduler removes it.
        gc.collect()
        row.lost = remove_worker(scheduler, heavy)
        f["holdings after loss"] = benchkit.median_ms(lambda: shares.holdings(scheduler.workers.values()), runs=1)
        survivors = [ts for ts in ruled if ts.who_has]
        seconds, passes, stall, f["full scan after loss"] = await restore(driver, survivors, interval, timeout=120)
        f["after loss"] = passes[0]
        f["restore s"], f["restore passes"], f["stall"] = seconds, len(passes), stall
        f["gc pause"] = driver.longest_collection
        driver.policy.index.detach()
        # Drains: 1% of the workers at once (at least one), every key copied as soon as asked.
        f["drain first"], f["drain longest"], f["drain passes"] = await drain_passes(scheduler, max(workers // 100, 1))
    finally:
        await scheduler.close()
        scheduler.http_server.stop()  # listening since construction; close() stops only a started scheduler's
    return row


class _Stream:
    """A worker's batched stream as the drain writes to it: what it asks is kept, to be enacted."""

    def __init__(self, address: str, sent: list[tuple[str, dict[str, Any]]]):
        self.address, self.sent = address, sent

    def send(self, *messages: dict[str, Any]) -> None:
        self.sent.extend((self.address, m) for m in messages)

    def closed(self) -> bool:
        return True

    def abort(self) -> None:
        pass


async def drain_passes(scheduler: Scheduler, count: int, limit: int = 500) -> tuple[float, float, int]:
    """memops' drain (:class:`memops.scheduler.drain.DrainPlugin`) of ``count`` workers, its passes
    run one after the other, every copy it asks for landing before the next (``add_replica``, as a
    recipient's ``add-keys`` does): the first pass (ms), the longest (ms), and how many passes."""
    sent: list[tuple[str, dict[str, Any]]] = []
    for address in scheduler.workers:
        scheduler.stream_comms[address] = _Stream(address, sent)  # type: ignore[assignment]
    plugin = drain.DrainPlugin(scheduler)
    plugin.handover = False  # no worker to ask where its keys are spilled
    plugin.task = asyncio.get_running_loop().create_future()  # its own loop not started: passes run here
    plugin.add(list(scheduler.workers)[1 : 1 + count], 600.0, {}, close=False, restore=True)
    times: list[float] = []
    while len(times) < limit and any(d.state == drain.State.DRAINING for d in plugin.workers.values()):
        sent.clear()
        started = time.perf_counter()
        await plugin.step()
        times.append((time.perf_counter() - started) * 1000)
        for address, message in sent:
            if message.get("op") != "acquire-replicas":
                continue
            ws = scheduler.workers[address]
            for key in message["who_has"]:
                ts = scheduler.tasks.get(key)
                if ts is not None and ts.who_has and ws not in ts.who_has:
                    scheduler.add_replica(ts, ws)
    plugin.task.cancel()
    states = {d.state for d in plugin.workers.values()}
    assert states == {drain.State.DONE}, states
    return times[0], max(times), len(times)


COLUMNS = (
    ("build passes", "{:.0f}"),
    ("build longest", "{:.1f}"),
    ("at target", "{:.2f}"),
    ("share at rest %", "{:.3f}"),
    ("after rule", "{:.1f}"),
    ("rule passes", "{:.0f}"),
    ("after loss", "{:.1f}"),
    ("restore s", "{:.2f}"),
    ("restore passes", "{:.0f}"),
    ("stall", "{:.1f}"),
    ("gc pause", "{:.1f}"),
    ("holdings", "{:.1f}"),
    ("holdings after loss", "{:.1f}"),
    ("holdings scan", "{:.1f}"),
    ("drain first", "{:.1f}"),
    ("drain longest", "{:.1f}"),
    ("drain passes", "{:.0f}"),
    ("full scan", "{:.0f}"),
    ("scan / at target", "{:.0f}x"),
    ("scan / after loss", "{:.1f}x"),
)


def table(rows: Sequence[Row], interval: float) -> str:
    lines = [
        f"Replication at scale (ms unless said; passes every {interval:g} s; one key in {RULED_EVERY} ruled,"
        " replicas: 2; a full scan reads every key)",
        "",
        "| workers | keys | ruled | copies lost | " + " | ".join(c for c, _ in COLUMNS) + " |",
        "|" + " --- |" * (len(COLUMNS) + 4),
    ]
    for row in rows:
        f = row.figures
        f["scan / at target"] = f["full scan"] / max(f["at target"], 1e-6)
        f["scan / after loss"] = f["full scan after loss"] / max(f["after loss"], 1e-6)
        cells = " | ".join(fmt.format(f[c]) for c, fmt in COLUMNS)
        lines.append(f"| {row.workers:,} | {row.keys:,} | {row.ruled:,} | {row.lost:,} | {cells} |")
    lines += ["", *growth(rows)]
    return "\n".join(lines)


def growth(rows: Sequence[Row]) -> list[str]:
    """Where a cost grows faster than what it reads: each column's growth over the keys' (or,
    when the keys stay, the workers'), between consecutive sizes."""
    notes = []
    for column in ("at target", "after rule", "after loss", "holdings", "holdings scan", "drain longest", "full scan"):
        for a, b in itertools.pairwise(rows):
            base = b.keys / a.keys if b.keys != a.keys else b.workers / a.workers
            ratio = b.figures[column] / max(a.figures[column], 1e-6)
            if ratio > 1.5 * base and b.figures[column] > 1.0:
                what = "keys" if b.keys != a.keys else "workers"
                notes.append(
                    f"- {column}: x{ratio:.1f} from {a.workers:,} to {b.workers:,} workers, {what} x{base:.1f}:"
                    " faster than linear"
                )
    return notes or ["- no column grew faster than linearly (more than 1.5 times what it reads) between sizes"]


async def run(sizes: Sequence[int], interval: float) -> str:
    rows = []
    for workers in sizes:
        rows.append(await measure(workers, interval))
        print(f"{workers} workers done", file=sys.stderr, flush=True)
    return table(rows, interval)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="10 and 100 workers (CI)")
    parser.add_argument("--sizes", type=int, nargs="*", help="worker counts (default: 10 100 1000 3000)")
    parser.add_argument(
        "--interval", type=float, default=replication.INTERVAL, help="seconds between passes (the plugin's default)"
    )
    args = parser.parse_args(argv)
    logging.getLogger("distributed").setLevel(logging.WARNING)
    sizes = args.sizes or ((10, 100) if args.small else SIZES)
    print(asyncio.run(run(sizes, args.interval)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
