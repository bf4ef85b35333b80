"""Pure deciding code over what the scheduler knows: which workers to retire, what moved, what was lost.

No I/O and no Dask imports. :mod:`memops.daskrpc` builds a :class:`SchedulerSnapshot` from
what the scheduler answers; the controllers and the benchmarks call the functions here.
Keys are Dask's keys as the scheduler sends them (strings, or tuples of them), worker
addresses are Dask comm addresses, and a
worker's name is its pod's name (:meth:`SchedulerSnapshot.named_by_pod` makes it so where the
workers call themselves otherwise, as dask-kubernetes' do).
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property


@dataclass(frozen=True)
class WorkerInfo:
    """One connected worker, as the scheduler sees it."""

    name: str
    address: str
    memory_limit: int = 0
    managed_bytes: int = 0
    unique_bytes: int = 0
    unique_keys: int = 0
    nkeys: int = 0
    status: str = "running"
    process_bytes: int = 0  # the worker process' RSS, as its last heartbeat reported it
    spilled_bytes: int = 0  # bytes the worker spilled to disk
    unmanaged_bytes: int = 0  # process memory minus the Dask data held in memory (the scheduler's "unmanaged")
    in_shuffle: bool = False  # running a P2P shuffle's tasks: retiring it would stall the shuffle


@dataclass(frozen=True)
class SchedulerSnapshot:
    """The workers and the key placement at one moment."""

    workers: tuple[WorkerInfo, ...]
    who_has: Mapping[Hashable, tuple[str, ...]] = field(default_factory=dict)
    """Who holds which key, for the keys asked for (Dask's keys, as the scheduler names them)."""
    nbytes: Mapping[Hashable, int] = field(default_factory=dict)

    def by_name(self, name: str) -> WorkerInfo | None:
        return self._by_name.get(name)

    def by_address(self, address: str) -> WorkerInfo | None:
        return self._by_address.get(address)

    def named_by_pod(self, pods_by_worker_name: Mapping[str, str]) -> SchedulerSnapshot:
        """The same snapshot with each worker renamed to its pod, where the mapping names it."""
        if not pods_by_worker_name:
            return self
        workers = tuple(
            replace(w, name=pods_by_worker_name[w.name]) if w.name in pods_by_worker_name else w for w in self.workers
        )
        return replace(self, workers=workers)

    # Built once per snapshot: callers look up every pod of a workload, which must not cost
    # workers x pods. The first worker wins when two share a name (it does not happen in Dask,
    # which refuses a second worker with a name already in use).
    @cached_property
    def _by_name(self) -> dict[str, WorkerInfo]:
        return {w.name: w for w in reversed(self.workers)}

    @cached_property
    def _by_address(self) -> dict[str, WorkerInfo]:
        return {w.address: w for w in reversed(self.workers)}


def holdings(
    who_has: Mapping[Hashable, Sequence[str]], nbytes: Mapping[Hashable, int]
) -> dict[str, tuple[int, int, int, int]]:
    """Address -> (bytes held, keys held, bytes held by no other worker, keys held by no other
    worker), in one pass over the keys: the figures :mod:`memops.scheduler.holdings` sums inside
    the scheduler, for a scheduler that does not run it. This one's cost grows with the keys.
    """
    result: dict[str, list[int]] = {}
    for key, holders in who_has.items():
        size = nbytes.get(key, 0)
        alone = len(holders) == 1
        for holder in holders:
            entry = result.get(holder)
            if entry is None:
                entry = result[holder] = [0, 0, 0, 0]
            entry[0] += size
            entry[1] += 1
            if alone:
                entry[2] += size
                entry[3] += 1
    return {address: (e[0], e[1], e[2], e[3]) for address, e in result.items()}


def choose_workers(
    pod_names: Sequence[str], snapshot: SchedulerSnapshot, count: int, exclude: Collection[str] = ()
) -> list[str]:
    """The ``count`` pods whose retirement costs least.

    Pods with no connected worker come first (they hold nothing); then connected workers not
    in the middle of a shuffle before those that are; then fewest unique bytes, then fewest
    managed bytes, then name, so the choice is deterministic. Pods in ``exclude`` (claimed by
    another request) are never chosen. When fewer candidates than ``count`` exist, all of them
    are returned and the caller reports it.
    """
    if count <= 0:
        return []
    excluded = set(exclude)

    def cost(pod: str) -> tuple[int, bool, int, int, str]:
        worker = snapshot.by_name(pod)
        if worker is None:
            return (0, False, 0, 0, pod)
        return (1, worker.in_shuffle, worker.unique_bytes, worker.managed_bytes, pod)

    candidates = sorted((p for p in pod_names if p not in excluded), key=cost)
    return candidates[:count]


SHUFFLE_PREFIXES = ("shuffle-transfer-", "shuffle-barrier-")
"""Key prefixes of dask's P2P shuffle tasks (dask/dataframe/dask_expr/_shuffle.py, distributed/shuffle)."""


def in_shuffle(processing: Sequence[str]) -> bool:
    """Whether a worker processing these (stringified) keys takes part in a P2P shuffle now."""
    return any(prefix in key for key in processing for prefix in SHUFFLE_PREFIXES)


def _unique_keys_of(before: Mapping[Hashable, tuple[str, ...]], address: str) -> list[Hashable]:
    """The keys that ``address`` held and no other worker did."""
    alone = (address,)  # one tuple comparison a key: this runs over every key the worker held
    return [key for key, holders in before.items() if holders == alone]


def bytes_moved(
    before: Mapping[Hashable, tuple[str, ...]],
    after: Mapping[Hashable, tuple[str, ...]],
    nbytes: Mapping[Hashable, int],
    address: str,
) -> tuple[int, int]:
    """Of the keys only ``address`` held before, (bytes, keys) that another worker holds now."""
    alone = (address,)
    moved = [k for k in _unique_keys_of(before, address) if (holders := after.get(k)) and holders != alone]
    return sum(map(nbytes.get, moved, itertools.repeat(0))), len(moved)


def bytes_lost(
    before: Mapping[Hashable, tuple[str, ...]],
    after: Mapping[Hashable, tuple[str, ...]],
    nbytes: Mapping[Hashable, int],
    address: str,
) -> tuple[int, int]:
    """Of the keys only ``address`` held before, (bytes, keys) that no worker holds now.

    A key still held by ``address`` alone is neither moved nor lost: it is still there.
    A key that its client released meanwhile counts as lost: the scheduler forgets lost and
    released keys alike, and overstating a loss is the safe side of the report.
    """
    lost = [k for k in _unique_keys_of(before, address) if not after.get(k)]
    return sum(map(nbytes.get, lost, itertools.repeat(0))), len(lost)
