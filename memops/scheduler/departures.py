"""Workers that left the scheduler with keys that no other worker held: a bounded record, in the scheduler.

A worker killed by the kernel's OOM killer, by its nanny at the terminate threshold, or with its
pod (an eviction, a deletion) takes the keys it alone held with it. The scheduler says so only
in its log and in its event log (``remove-worker``, with the keys it will recompute and the
scattered keys it lost, by name and without sizes). This plugin keeps, for each such departure,
the worker's address and name, the scheduler's time, and what it alone held then: keys, bytes,
and how many of them cannot be recomputed. The operator reads them (the agent's ``departures``)
into the MemoryPolicy's status (:mod:`memops.decisions.worker_loss_decisions`).

Where it hooks: ``Scheduler.remove_worker`` clears the worker's replicas (``remove_replica`` for
each key it held) before it calls the plugins' ``remove_worker``, so that hook no longer sees
what the worker held. It logs the ``remove-worker`` event in between, synchronously, before the
keys are transitioned: the plugins' ``log_event`` hook then sees the keys that lost their last
replica (``lost-computed-tasks``, ``lost-scattered-tasks``) while their TaskStates still hold
their sizes and inputs. A departure costs the keys it lost (and their inputs), never the
cluster's keys; every other event costs one comparison.

Bounded: at most :data:`KEPT` records (a deque), each of fixed-size fields (strings cut to
:data:`TEXT`). Departures that lost nothing are not kept: workers retired empty, or scaled away
idle, would otherwise push the losses out of the deque.

A departure whose keys memops' own drain reports already (the worker was being drained, or its
drain stopped at its deadline a moment before: a RetirementRequest's ``bytesLost``, the safety
net's ``lostAtDeadline``) carries that drain's state in ``drain``, so that the operator counts it once.

Like :mod:`drain`, this imports nothing from memops beyond this package: the operator sends it by
value with the agent (:mod:`memops.scheduler.agent`), whose ``install`` adds the plugin.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterable, Mapping
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin

from memops.scheduler import drain

NAME = "memops-departures"
KEPT = 256
"""Departures kept, the latest: the operator reads them every pass (seconds apart), so this covers
far more departures than can happen between two passes, and bounds the reply."""
TEXT = 256
"""A worker's address and name are cut to this many characters."""
DRAIN_REPORTED_SECONDS = 300.0
"""A worker that leaves within this long after memops' drain of it stopped at its deadline leaves
as that drain's report said (its pod was going: a preStop hook's grace, a RetirementRequest's
forced removal): the drain's report counts the loss."""


class Record:
    """One departure, as :func:`report` sends it."""

    __slots__ = ("address", "bytes", "drain", "irreplaceable", "keys", "name", "time")

    def __init__(
        self, address: str, name: str, when: float, keys: int, nbytes: int, irreplaceable: int, drain: str = ""
    ):
        self.address = address[:TEXT]
        self.name = name[:TEXT]
        self.time = when
        self.keys = keys
        self.bytes = nbytes
        self.irreplaceable = irreplaceable
        self.drain = drain[:16]

    def plain(self) -> dict[str, Any]:
        return {
            "address": self.address,
            "name": self.name,
            "time": round(self.time, 3),
            "keys": self.keys,
            "bytes": self.bytes,
            "irreplaceableKeys": self.irreplaceable,
            "drain": self.drain,
        }


def lost_figures(tasks: Mapping[Any, Any], computed: Iterable[Any], scattered: Iterable[Any]) -> tuple[int, int, int]:
    """(keys, bytes, keys that cannot be recomputed) of the keys a departure lost, from the
    scheduler's ``tasks`` before they are transitioned. Scattered keys cannot be recomputed; a
    computed key cannot when it has inputs and none of them is held anywhere (released, or lost
    with it): :func:`memops.scheduler.drain`'s criterion, reading holders rather than states, as the
    inputs lost in the same departure are still "memory" at this moment."""
    keys = nbytes = irreplaceable = 0
    for key, scattered_key in [(k, False) for k in computed] + [(k, True) for k in scattered]:
        keys += 1
        ts = tasks.get(key)
        if ts is None:
            irreplaceable += 1
            continue
        nbytes += max(int(ts.nbytes), 0)
        if scattered_key or ts.run_spec is None:
            irreplaceable += 1
            continue
        deps = ts.dependencies
        if deps and not any(dep.who_has for dep in deps):
            irreplaceable += 1
    return keys, nbytes, irreplaceable


def drain_state(dask_scheduler: Any, address: str, now: float) -> str:
    """memops' drain of ``address`` at its departure, when that drain reports what it loses:
    ``draining`` (its ``worker left``), ``deadline`` (stopped at its deadline within
    :data:`DRAIN_REPORTED_SECONDS`), else empty."""
    plugin = dask_scheduler.plugins.get(drain.NAME)
    drained = getattr(plugin, "workers", {}).get(address) if plugin is not None else None
    if drained is None:
        return ""
    if drained.state == drain.State.DRAINING:
        return "draining"
    if drained.state == drain.State.DEADLINE and now - drained.ended_at <= DRAIN_REPORTED_SECONDS:
        return "deadline"
    return ""


class DeparturesPlugin(SchedulerPlugin):
    """Keeps :data:`KEPT` departures that lost keys (:class:`Record`), oldest first."""

    def __init__(self, dask_scheduler: Any):
        self.scheduler = dask_scheduler
        self.records: collections.deque[Record] = collections.deque(maxlen=KEPT)
        # The scheduler forgets a worker's name before it logs the departure: kept here, one per worker.
        self.names: dict[str, str] = {a: str(ws.name) for a, ws in dask_scheduler.workers.items()}

    def add_worker(self, scheduler: Any = None, worker: str = "") -> None:
        ws = self.scheduler.workers.get(worker)
        if ws is not None:
            self.names[worker] = str(ws.name)

    def remove_worker(self, scheduler: Any = None, worker: str = "", **kwargs: Any) -> None:
        self.names.pop(worker, None)  # after log_event (a worker that lost nothing logs no record)

    def log_event(self, topic: str, msg: Any) -> None:
        # Called for every event the scheduler logs: one comparison unless it is a departure.
        if topic != "all" or not isinstance(msg, dict) or msg.get("action") != "remove-worker":
            return
        address = str(msg.get("worker", ""))
        computed = msg.get("lost-computed-tasks") or ()
        scattered = msg.get("lost-scattered-tasks") or ()
        if not computed and not scattered:
            return
        keys, nbytes, irreplaceable = lost_figures(self.scheduler.tasks, computed, scattered)
        now = time.time()
        self.records.append(
            Record(
                address,
                self.names.get(address, ""),
                now,
                keys,
                nbytes,
                irreplaceable,
                drain_state(self.scheduler, address, now),
            )
        )

    def report(self, since: float = 0.0) -> list[dict[str, Any]]:
        return [r.plain() for r in self.records if r.time > since]


def install(dask_scheduler: Any) -> DeparturesPlugin:
    """Add the plugin (the agent's ``install``); one already there (an agent installed again, of
    this version or another) is replaced, and its records kept."""
    old = dask_scheduler.plugins.get(NAME)
    if isinstance(old, DeparturesPlugin):
        return old
    plugin = DeparturesPlugin(dask_scheduler)
    for record in getattr(old, "records", ()):
        if isinstance(record, Record) or all(hasattr(record, a) for a in Record.__slots__):
            plugin.records.append(record)
    if old is not None:
        dask_scheduler.remove_plugin(name=NAME)
    dask_scheduler.add_plugin(plugin, name=NAME)
    return plugin


def report(dask_scheduler: Any, since: float = 0.0) -> list[dict[str, Any]]:
    """Run on the scheduler (by the agent's ``departures`` operation): the departures kept, after
    ``since`` (the scheduler's clock), oldest first, as plain data."""
    plugin = dask_scheduler.plugins.get(NAME)
    if plugin is None:
        plugin = install(dask_scheduler)
    return plugin.report(float(since))  # type: ignore[no-any-return]
