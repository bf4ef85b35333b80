"""What each worker holds, and holds alone, summed inside the scheduler.

Choosing which workers to retire needs each worker's unique bytes. Computed in the operator
from the scheduler's ``who_has``, that costs every key twice: the scheduler builds and sends a
list of holders per key, and the operator sums them (about 0.4 s of Python at a million keys,
before the transfer). The scheduler already keeps, up to date on every replica change, each
worker's total (``WorkerState.nbytes`` and its ``has_what``) and the set of keys with more
than one replica (``replicated_tasks``, for the AMM's ReduceReplicas). A worker's unique bytes
are its total minus its share of the replicated keys, so the sum here costs the workers plus
the replicas of replicated keys, not every key, and the answer is a few numbers per worker.

Like :mod:`memops.scheduler.relief`, this imports nothing from memops: the operator sends it
by value with memops' agent (:mod:`memops.scheduler.agent`), whose ``holdings`` operation
calls :func:`summarize`, so a stock Dask scheduler runs it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Iterable, Mapping
from typing import Any

Holding = tuple[int, int, int, int]
"""(bytes held, keys held, bytes held by no other worker, keys held by no other worker)."""


def holdings(workers: Iterable[Any], replicated: Iterable[Any]) -> dict[str, Holding]:
    """Address -> :data:`Holding`, from the scheduler's WorkerStates and its replicated TaskStates.

    Sizes are ``TaskState.get_nbytes()``, the figure ``WorkerState.nbytes`` sums, so that a
    worker whose keys all have copies elsewhere comes out at exactly 0 unique bytes.
    """
    shared_bytes: defaultdict[str, int] = defaultdict(int)
    shared_keys: defaultdict[str, int] = defaultdict(int)
    for ts in replicated:  # the hot loop: one pass over the replicas of replicated keys
        size = ts.nbytes
        if size < 0:
            size = ts.get_nbytes()
        for ws in ts.who_has or ():
            address = ws.address
            shared_bytes[address] += size
            shared_keys[address] += 1
    result: dict[str, Holding] = {}
    for ws in workers:
        address, held_bytes, held_keys = ws.address, ws.nbytes, len(ws.has_what)
        result[address] = (
            held_bytes,
            held_keys,
            held_bytes - shared_bytes.get(address, 0),
            held_keys - shared_keys.get(address, 0),
        )
    return result


class Shares:
    """What :func:`holdings` sums from every replicated key, kept up to date from the keys whose
    replicas changed: each worker's bytes and keys that another worker also holds.

    Something that follows the scheduler's replica methods (:class:`memops.scheduler.replication_index.Index`,
    while a replication rule is in force) adds each TaskState whose replicas changed to
    :attr:`noted`; :meth:`holdings` reads those again, and only those, so that it costs what
    changed since it was last asked, not every replicated key. Sizes are read as :func:`holdings`
    reads them: a size that the scheduler sets (``TaskState.set_nbytes``) is always followed by
    an ``add_replica`` of that key."""

    def __init__(self) -> None:
        self.noted: set[Any] = set()  # TaskStates whose replicas changed since they were read
        self.counted: dict[Any, tuple[int, tuple[Any, ...]]] = {}  # replicated TaskState -> (size, holders)
        self.shared: dict[Any, list[int]] = {}  # WorkerState -> [bytes, keys] held with a copy elsewhere

    def reset(self, replicated: Iterable[Any] = ()) -> None:
        """Forget what was read; ``replicated`` (the scheduler's replicated keys) read on the next call."""
        self.counted, self.shared = {}, {}
        self.noted.clear()
        self.noted.update(replicated)

    def update(self, limit: int | None = None) -> int:
        """Read the noted keys again (at most ``limit`` of them); how many."""
        noted, counted, shared = self.noted, self.counted, self.shared
        read = len(noted) if limit is None else min(limit, len(noted))
        for _ in range(read):
            ts = noted.pop()
            old = counted.pop(ts, None)
            if old is not None:
                size, holders = old
                for ws in holders:
                    row: list[int] | None = shared[ws]
                    assert row is not None
                    row[0] -= size
                    row[1] -= 1
                    if not row[1]:
                        del shared[ws]
            who_has = ts.who_has
            if who_has is not None and len(who_has) > 1:
                size = ts.nbytes
                if size < 0:
                    size = ts.get_nbytes()
                holders = tuple(who_has)
                counted[ts] = (size, holders)
                for ws in holders:
                    row = shared.get(ws)
                    if row is None:
                        shared[ws] = [size, 1]
                    else:
                        row[0] += size
                        row[1] += 1
        return read

    def holdings(self, workers: Iterable[Any]) -> dict[str, Holding]:
        """:func:`holdings` of these WorkerStates, from what changed since the last call."""
        self.update()
        shared = self.shared
        result: dict[str, Holding] = {}
        for ws in workers:
            held_bytes, held_keys = ws.nbytes, len(ws.has_what)
            row = shared.get(ws)
            if row is None:
                result[ws.address] = (held_bytes, held_keys, held_bytes, held_keys)
            else:
                result[ws.address] = (held_bytes, held_keys, held_bytes - row[0], held_keys - row[1])
        return result


def followed(dask_scheduler: Any) -> Any:
    """The :class:`Shares` that replication keeps up to date on this scheduler, or None (no rule in
    force, or replication installed by an agent that keeps none). Found by attribute, not by
    class: the agent arrives by value, and one that an earlier operator process installed defines
    classes of its own."""
    plugin = (getattr(dask_scheduler, "plugins", None) or {}).get("memops-replication")
    index = getattr(getattr(plugin, "policy", None), "index", None)
    shares = getattr(index, "shares", None)
    if not callable(getattr(shares, "holdings", None)) or not getattr(index, "attached", False):
        return None
    if getattr(index, "scheduler", None) is not dask_scheduler:
        return None
    return shares


def of_scheduler(dask_scheduler: Any) -> dict[str, Holding]:
    """:func:`holdings` of every connected worker: from replication's :class:`Shares` where it keeps
    them (costing what changed), else read from every replicated key."""
    shares = followed(dask_scheduler)
    if shares is not None:
        return shares.holdings(dask_scheduler.workers.values())  # type: ignore[no-any-return]
    return holdings(dask_scheduler.workers.values(), dask_scheduler.replicated_tasks)


def placement(tasks: Mapping[Hashable, Any], keys: Iterable[Hashable]) -> dict[Hashable, tuple[int, list[str]]]:
    """Key -> (its size, the addresses holding it) for these keys; ``(0, [])`` for a key the
    scheduler has forgotten (released, or lost)."""
    result: dict[Hashable, tuple[int, list[str]]] = {}
    for key in keys:
        ts = tasks.get(key)
        if ts is None or not ts.who_has:
            result[key] = (0, [])
        else:
            result[key] = (ts.get_nbytes(), [ws.address for ws in ts.who_has])
    return result


def summarize(
    dask_scheduler: Any, workers: Iterable[str] = (), keys: Iterable[Hashable] = ()
) -> dict[str, dict[Any, Any]]:
    """Run on the scheduler (by the agent): :func:`holdings` of every connected worker, and
    :func:`placement` of the keys that ``workers`` hold and of ``keys``, in one go (the event
    loop runs nothing else meanwhile, so the figures agree with each other)."""
    wanted: dict[Hashable, None] = dict.fromkeys(keys)
    for address in workers:
        ws = dask_scheduler.workers.get(address)
        if ws is not None:
            wanted.update(dict.fromkeys(ts.key for ts in ws.has_what))
    return {
        "holdings": of_scheduler(dask_scheduler),
        "placement": placement(dask_scheduler.tasks, wanted),
    }
