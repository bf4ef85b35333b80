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
        "holdings": holdings(dask_scheduler.workers.values(), dask_scheduler.replicated_tasks),
        "placement": placement(dask_scheduler.tasks, wanted),
    }
