"""The scheduler calls of the sandbox, the tests and the benchmarks, on schedulers they run themselves.

Each goes through :func:`memops.clients.daskrpc.vetted`, the operator's one way to a scheduler,
with a vouch that vouches for every worker (:func:`_any`). What that skips is memops' tenancy
check (:func:`memops.decisions.tenancy.check`: whether the scheduler's workers are pods of a
namespace), and nothing else: the same connection handling (one connection, ``identity`` first,
a new connection vouched for again), the same checks of every reply, the same bounds on what a
reply may build (:class:`memops.clients.daskcomm.Limit`), the same exceptions. The operator never
imports this module (an import contract in pyproject.toml): it has no scheduler that it may
take on trust.

The functions are the methods of :class:`memops.clients.daskrpc.Scheduler` over one connection
each, by address, with their defaults.
"""

# Where this differs from a connection that nobody vouched for (``Scheduler(vouch=None)``, gone):
# - The connection asks ``identity`` (every worker's, within daskcomm.WORKERS) when it opens, and
#   parses its workers: one call more for all but fetch_snapshot (whose snapshot reads that one)
#   and ping (which did its own, smaller call); a workers map of the wrong shape is refused there.
# - A handle that reconnects (after a call that failed, or a retirement that timed out) to a
#   scheduler that shows no worker any more is taken as emptied: calls that change the scheduler
#   then raise Unvouched (NoWorkers), and snapshots send no code. Only connect's handle, used for
#   several calls, can meet that: each other function makes a fresh handle for one call (a first
#   connection is never emptied), and retire_workers' reconnect only reads the statuses.

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from typing import Any

from distributed.security import Security

from memops.clients import daskrpc
from memops.decisions import snapshots, tenancy


async def _any(workers: Sequence[snapshots.WorkerInfo]) -> tenancy.Verdict:
    """Vouches for every worker, without looking: the caller runs the scheduler itself."""
    return tenancy.Verdict(tenancy.Reason.TENANT, "not checked: a scheduler the caller runs")


def connect(
    address: str, *, security: Security | None = None, timeout: float = 10
) -> contextlib.AbstractAsyncContextManager[daskrpc.Scheduler]:
    """The scheduler at ``address`` (:func:`memops.clients.daskrpc.vetted`, every worker vouched for)."""
    return daskrpc.vetted(address, vouch=_any, security=security, timeout=timeout)


async def fetch_snapshot(
    address: str,
    *,
    security: Security | None = None,
    timeout: float = 10,
    keys: bool = True,
    processing: bool | None = None,
    placement_of: Collection[str] = (),
    placement: Collection[Hashable] = (),
    drains: bool = False,
    nodes: Callable[[], Mapping[str, str]] | None = None,
) -> snapshots.SchedulerSnapshot:
    """:meth:`memops.clients.daskrpc.Scheduler.snapshot` over one connection of :func:`connect`."""
    async with connect(address, security=security, timeout=timeout) as scheduler:
        return await scheduler.snapshot(
            keys=keys, processing=processing, placement_of=placement_of, placement=placement, drains=drains, nodes=nodes
        )


async def start_drain(
    address: str,
    worker_addresses: Sequence[str] = (),
    *,
    security: Security | None = None,
    timeout: float = 10,
    **arguments: Any,
) -> dict[str, Any]:
    """:meth:`memops.clients.daskrpc.Scheduler.start_drain` over one connection of :func:`connect`."""
    async with connect(address, security=security, timeout=timeout) as scheduler:
        return await scheduler.start_drain(worker_addresses, **arguments)


async def drain_status(
    address: str, worker_addresses: Sequence[str] = (), *, security: Security | None = None, timeout: float = 10
) -> dict[str, Any]:
    """:meth:`memops.clients.daskrpc.Scheduler.drain_status` over one connection of :func:`connect`."""
    async with connect(address, security=security, timeout=timeout) as scheduler:
        return await scheduler.drain_status(worker_addresses)


async def retire_workers(
    address: str,
    worker_addresses: Sequence[str],
    *,
    security: Security | None = None,
    timeout: float,
    nodes: Mapping[str, str] | None = None,
    nodes_dying: bool = True,
    memops_drain: bool = True,
) -> daskrpc.RetireOutcome:
    """:meth:`memops.clients.daskrpc.Scheduler.retire_workers` over one connection of :func:`connect`,
    which gets the retirement's connect timeout (:func:`memops.clients.daskrpc.connect_timeout`)."""
    async with connect(address, security=security, timeout=daskrpc.connect_timeout(timeout)) as scheduler:
        return await scheduler.retire_workers(
            worker_addresses, timeout=timeout, nodes=nodes, nodes_dying=nodes_dying, memops_drain=memops_drain
        )


async def configure_relief(
    address: str,
    *,
    security: Security | None = None,
    above: float | None,
    to: float | None,
    owner: str,
    timeout: float = 10,
) -> dict[str, Any] | None:
    """:meth:`memops.clients.daskrpc.Scheduler.configure_relief` over one connection of :func:`connect`."""
    async with connect(address, security=security, timeout=timeout) as scheduler:
        return await scheduler.configure_relief(above=above, to=to, owner=owner)


async def configure_replication(
    address: str,
    *,
    security: Security | None = None,
    rules: Mapping[str, Any] | None,
    places: Mapping[str, tuple[str, str]],
    owner: str,
    timeout: float = 10,
) -> dict[str, Any] | None:
    """:meth:`memops.clients.daskrpc.Scheduler.configure_replication` over one connection of :func:`connect`."""
    async with connect(address, security=security, timeout=timeout) as scheduler:
        return await scheduler.configure_replication(rules=rules, places=places, owner=owner)


async def configure_placement(
    address: str,
    *,
    security: Security | None = None,
    enabled: bool,
    max_tasks: int = 10_000,
    owner: str,
    timeout: float = 10,
) -> dict[str, Any] | None:
    """:meth:`memops.clients.daskrpc.Scheduler.configure_placement` over one connection of :func:`connect`."""
    async with connect(address, security=security, timeout=timeout) as scheduler:
        return await scheduler.configure_placement(enabled=enabled, max_tasks=max_tasks, owner=owner)


async def configure_admission(
    address: str,
    *,
    security: Security | None = None,
    settings: Mapping[str, Any] | None,
    owner: str,
    timeout: float = 10,
) -> dict[str, Any] | None:
    """:meth:`memops.clients.daskrpc.Scheduler.configure_admission` over one connection of :func:`connect`."""
    async with connect(address, security=security, timeout=timeout) as scheduler:
        return await scheduler.configure_admission(settings=settings, owner=owner)


async def ping(address: str, *, security: Security | None = None, timeout: float = 10) -> int:
    """The number of workers the scheduler has; cheap, whatever the number of keys.

    Read from the ``identity`` that the connection's vouch judged (every worker's, within
    :data:`memops.clients.daskcomm.WORKERS`), not from one asked with ``n_workers=0`` (no worker's,
    within ``SMALL``): the vetted connection reads the workers anyway, and one way in is worth
    a reply of a few KiB a worker."""
    async with connect(address, security=security, timeout=timeout) as scheduler:
        identity = await scheduler.identity()
    try:
        return int(identity.get("n_workers", 0))
    except (TypeError, ValueError) as exc:
        raise daskrpc.SchedulerMisbehaved(address, "identity's n_workers is not a number") from exc
