"""Pressure relief: an Active Memory Manager policy that runs inside the scheduler.

When a worker's process memory passes ``above`` (a share of its memory limit), keys move from
it to workers with headroom, worker to worker, until it is under ``to``: before it spills,
pauses (80%) or its nanny kills it (95%). An operator round trip is too slow for that, so this
runs in the scheduler, on its own Active Memory Manager with a short interval.

Replicate, then drop: a key on the hot worker is first copied to a peer (``replicate``); once
the copy exists the hot worker's replica is dropped (``drop`` with the hot worker as the only
candidate). A key therefore always has at least one copy. The scheduler's own ReduceReplicas,
if it sees the two copies first, drops the one on the most loaded worker: the hot one, so the
two never fight. Workers that are not running (paused, or being retired by RetireWorker) are
neither relieved nor sent keys, and no key is sent to a worker that it would push over
``above``. When no peer has room, the worker is reported as starved: the operator then asks
for more workers.

The module imports nothing from memops: the operator sends it to the scheduler by value over
the comm (``register_scheduler_plugin``), so a stock Dask image runs it. :func:`choose` is
pure and decides everything; :class:`PressureRelief` only reads the scheduler's state for it
and turns its plan into AMM suggestions.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Generator, Mapping, Sequence
from typing import Any

from distributed.active_memory_manager import ActiveMemoryManagerExtension, ActiveMemoryManagerPolicy, Suggestion
from distributed.diagnostics.plugin import SchedulerPlugin

NAME = "memops-pressure-relief"
IN_FLIGHT_SECONDS = 5.0
"""How long a planned copy or drop counts as done. The scheduler learns a worker's process memory
from its heartbeats, so relief that has happened shows there only a beat later."""


@dataclasses.dataclass(frozen=True)
class Load:
    """One worker as relief sees it."""

    name: str
    process: int  # bytes: the process' memory as the last heartbeat reported it
    limit: int  # bytes: the worker's memory limit (0: none, never relieved nor a recipient)
    running: bool = True  # False: paused, or closing (being retired): left alone


@dataclasses.dataclass(frozen=True)
class Key:
    key: str
    nbytes: int
    holders: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Plan:
    drops: tuple[tuple[str, str], ...] = ()  # (key, hot worker): the copy elsewhere exists already
    copies: tuple[tuple[str, str, str], ...] = ()  # (key, hot worker, recipient)
    hot: tuple[str, ...] = ()
    starved: tuple[str, ...] = ()  # hot workers that keep too much: no peer has room


def choose(
    workers: Sequence[Load],
    keys: Mapping[str, Sequence[Key]],
    *,
    above: float,
    to: float,
    freed: Mapping[str, int] | None = None,
    incoming: Mapping[str, int] | None = None,
) -> Plan:
    """What to move off the workers above ``above`` so that each ends under ``to``.

    ``keys[worker]``: the keys in memory on that worker. ``freed`` / ``incoming``: bytes already
    on their way off / onto a worker (planned earlier, not yet in its reported memory).
    Keys that have a copy elsewhere are dropped first (no transfer); then the largest keys are
    copied, each to the running peer with the most headroom that stays under ``above`` with it.
    """
    freed, incoming = freed or {}, incoming or {}
    projected = {w.name: w.process + incoming.get(w.name, 0) for w in workers}
    hot = sorted(
        (w for w in workers if w.running and w.limit and w.process - freed.get(w.name, 0) > above * w.limit),
        key=lambda w: (w.limit * above - w.process, w.name),
    )
    hot_names = {w.name for w in hot}
    peers = [w for w in workers if w.running and w.limit and w.name not in hot_names]
    drops: list[tuple[str, str]] = []
    copies: list[tuple[str, str, str]] = []
    starved: list[str] = []
    for worker in hot:
        need = worker.process - freed.get(worker.name, 0) - int(to * worker.limit)
        on_worker = keys.get(worker.name, ())
        # Keys with a copy elsewhere first: dropping them costs no transfer.
        for key in sorted(on_worker, key=lambda k: (-k.nbytes, k.key)):
            if need <= 0:
                break
            if len(key.holders) > 1:
                drops.append((key.key, worker.name))
                need -= key.nbytes
        for key in sorted(on_worker, key=lambda k: (-k.nbytes, k.key)):
            if need <= 0:
                break
            if len(key.holders) > 1:
                continue
            fits = [p for p in peers if p.name not in key.holders and projected[p.name] + key.nbytes <= above * p.limit]
            if not fits:
                continue  # a smaller key may still fit somewhere
            recipient = min(fits, key=lambda p: (projected[p.name] / p.limit, p.name))
            projected[recipient.name] += key.nbytes
            copies.append((key.key, worker.name, recipient.name))
            need -= key.nbytes
        if need > 0:
            starved.append(worker.name)
    return Plan(tuple(drops), tuple(copies), tuple(w.name for w in hot), tuple(starved))


class PressureRelief(ActiveMemoryManagerPolicy):
    """The AMM policy: reads the scheduler's state, asks :func:`choose`, suggests the moves."""

    def __init__(self, above: float, to: float):
        self.above = above
        self.to = to
        self.keys_moved = 0
        self.bytes_moved = 0
        self.hot: tuple[str, ...] = ()
        self.starved: tuple[str, ...] = ()
        # task key -> (worker it leaves, bytes, worker it goes to or "", when planned: wall clock)
        self.in_flight: dict[Any, tuple[str, int, str, float]] = {}

    def run(self) -> Generator[Suggestion, Any, None]:
        scheduler = self.manager.scheduler
        now = time.time()  # wall clock, as WorkerState.last_seen (the last heartbeat)
        self.in_flight = {k: v for k, v in self.in_flight.items() if now - v[3] < IN_FLIGHT_SECONDS}
        by_address = dict(scheduler.workers)
        # Finish the moves whose copy has landed: drop the hot worker's replica now.
        for key, (source, nbytes, target, _) in list(self.in_flight.items()):
            ts = scheduler.tasks.get(key)
            if not target or ts is None or source not in by_address:
                continue
            holders = ts.who_has or set()
            if by_address[source] in holders and len(holders) >= 2:
                if (yield Suggestion("drop", ts, {by_address[source]})) is not None:
                    self.in_flight[key] = (source, nbytes, "", now)
                    self._count(nbytes)
        freed: dict[str, int] = {}
        incoming: dict[str, int] = {}
        for key, (source, nbytes, target, planned) in self.in_flight.items():
            ws = by_address.get(source)
            ts = scheduler.tasks.get(key)
            # Leaving bytes count until the worker's memory shows them gone: while the key is
            # still on it (its copy is on the way), or until a heartbeat after the drop.
            if ws is not None and (planned > ws.last_seen or (ts is not None and ws in (ts.who_has or ()))):
                freed[source] = freed.get(source, 0) + nbytes
            recipient = by_address.get(target)
            if recipient is not None and planned > recipient.last_seen:
                incoming[target] = incoming.get(target, 0) + nbytes
        # Process memory is as old as the last heartbeat; the managed part of "optimistic" is
        # current (a key counts the moment it lands), so the larger of the two is the estimate.
        loads = [
            Load(
                ws.address,
                max(int(ws.memory.process), int(ws.memory.optimistic)),
                int(ws.memory_limit or 0),
                ws in scheduler.running,
            )
            for ws in by_address.values()
        ]
        hot = [w.name for w in loads if w.limit and w.process > self.above * w.limit]
        if not hot:
            self.hot, self.starved = (), ()
            return
        tasks = {}
        keys: dict[str, list[Key]] = {}
        for address in hot:
            keys[address] = []
            for ts in by_address[address].has_what:
                if ts.key in self.in_flight:
                    continue  # already on its way
                tasks[str(ts.key)] = ts  # choose() speaks strings
                keys[address].append(Key(str(ts.key), int(ts.nbytes), tuple(w.address for w in ts.who_has or ())))
        plan = choose(loads, keys, above=self.above, to=self.to, freed=freed, incoming=incoming)
        self.hot, self.starved = plan.hot, plan.starved
        for key, source in plan.drops:
            ts = tasks[key]
            if (yield Suggestion("drop", ts, {by_address[source]})) is not None:
                self.in_flight[ts.key] = (source, int(ts.nbytes), "", now)
                self._count(int(ts.nbytes))
        for key, source, target in plan.copies:
            ts = tasks[key]
            chosen = yield Suggestion("replicate", ts, {by_address[target]})
            if chosen is not None:
                self.in_flight[ts.key] = (source, int(ts.nbytes), chosen.address, now)

    def _count(self, nbytes: int) -> None:
        self.keys_moved += 1
        self.bytes_moved += nbytes

    def state(self) -> dict[str, Any]:
        return {
            "above": self.above,
            "to": self.to,
            "keysMoved": self.keys_moved,
            "bytesMoved": self.bytes_moved,
            "hot": list(self.hot),
            "starved": list(self.starved),
        }


class ReliefPlugin(SchedulerPlugin):
    """Runs :class:`PressureRelief` on its own Active Memory Manager every ``interval`` seconds.

    Its own manager, not the scheduler's: that one runs every 2 s by default, and the nanny's
    monitor every 100 ms. Kept in ``scheduler.plugins`` under :data:`NAME`, so that it is found
    again, and stopped with the scheduler.
    """

    name = NAME

    def __init__(self, scheduler: Any, above: float, to: float, interval: float):
        self.policy = PressureRelief(above, to)
        self.manager = ActiveMemoryManagerExtension(
            scheduler, {self.policy}, register=False, start=True, interval=interval
        )

    async def close(self) -> None:
        self.manager.stop()


def configure(
    dask_scheduler: Any, above: float | None, to: float | None, interval: float = 0.25
) -> dict[str, Any] | None:
    """Run on the scheduler (``run_function``): install, retune or (``above=None``) remove relief.

    Idempotent, so the operator calls it on every pass: a restarted scheduler gets relief back,
    a changed policy retunes it in place. Returns the thresholds and counters, or None if removed.
    """
    plugin = dask_scheduler.plugins.get(NAME)
    if above is None or to is None:
        if plugin is not None:
            plugin.manager.stop()
            dask_scheduler.remove_plugin(NAME)
        return None
    if plugin is None:
        plugin = ReliefPlugin(dask_scheduler, above, to, interval)
        dask_scheduler.add_plugin(plugin, name=NAME)
    plugin.policy.above, plugin.policy.to = above, to
    state: dict[str, Any] = plugin.policy.state()
    return state
