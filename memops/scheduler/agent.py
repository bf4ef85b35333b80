"""memops' agent inside the Dask scheduler: one comm handler, :data:`NAME`, for every feature.

The operator installs it once per scheduler, by value through ``run_function``
(:func:`install`), so that a stock scheduler needs only ``distributed``; from then on it calls
the handler, sending no code (``run_function`` logs every call on the scheduler, code
included). ``run_function``'s own reply is pickled by design, so the operator reads only its
plain ``status``; every answer that matters comes from the handler, as plain msgpack data:
maps, lists, strings and numbers. A scheduler restarted since loses the handler; its reply to
an unknown handler is ``None``, and the operator then installs the agent again and retries. The
operator asks first whether the agent is there, in the scheduler's event log (:data:`EVENTS`), so
that normal operation never calls a missing handler (the scheduler logs that as a warning).

Operations (``operation``, its arguments, what ``result`` holds):

- ``holdings`` (``workers``, ``keys``): :func:`memops.scheduler.holdings.summarize`: each
  worker's ``[bytes held, keys held, unique bytes, unique keys]``, and ``[size, holders]`` of
  the keys that ``workers`` hold and of ``keys``;
- ``relief`` (``above``, ``to``, ``owner``): :func:`memops.scheduler.relief.configure`:
  installs, retunes or removes pressure relief; its state, or ``{}`` once removed;
- ``replication`` (``rules``, ``places``, ``owner``): :func:`memops.scheduler.replication.configure`:
  installs, retunes or (``rules`` None) removes replication targets; its figures, or ``{}``
  once removed; a refused rule is an ``error`` naming its field;
- ``drain`` (``workers`` or ``names``, ``deadline`` seconds, ``nodes``, ``close_workers``, ``restore``,
  ``window``, ``origin``, ``handover``):
  :func:`memops.scheduler.drain.start`: starts draining these workers by value, with a deadline,
  and returns at once with their ``drain_status``; spilled keys go by link to recipients that share
  the spill filesystem (:mod:`memops.worker.handover`) unless ``handover`` is false;
- ``drain_status`` (``workers`` or ``names``, or neither for all; ``nodes``): :func:`memops.scheduler.drain.status`:
  per drained worker its state, the keys and bytes still held nowhere else, moved, on their way,
  and lost at the deadline; ``nodes`` (worker address -> node) is recorded first, so that a later
  drain keeps keys off every worker of a dying node, not only those its caller names;
- ``resize`` (``worker``, ``memory_limit``, ``maximum``): :func:`memops.scheduler.worker_limits.resize`: sets
  the worker's memory limit to ``memory_limit`` bytes (at most ``maximum``) in its nanny, its worker and
  the scheduler's ``WorkerState``, after its pod was resized in place; which parts took it;
- ``departures`` (``since``): :func:`memops.scheduler.departures.report`: the latest workers that left
  the scheduler with keys no other worker held (address, name, time, keys, bytes, irreplaceable
  keys, and memops' drain of it, if that drain reports the loss), oldest first;
- ``links`` (``install``, ``report``): :func:`memops.worker.links.install` (unless ``install`` is false)
  registers the plugin that fetches spilled keys from same-node peers by hardlink and reads them back
  as maps; with ``report`` (default), each worker's ``status`` report (``Active``, or ``Refused`` with
  its ``reason``), else ``{}``;
- ``spill``: :func:`memops.worker.links.spill`: each worker's spilled bytes with each inode counted once,
  and its share of its node's spill (an inode that k workers link counts 1/k to each);
- ``placement`` (``enabled``, ``max_tasks``, ``owner``): :func:`memops.scheduler.placement.configure`:
  installs, retunes or removes graph-aware placement; its figures, or ``{}`` once removed;
- ``admission`` (``settings``, ``owner``): :func:`memops.scheduler.admission.configure`: installs,
  retunes or (``settings`` empty) removes memory-aware task admission, in the scheduler and its
  workers; its figures, or ``{}`` once removed;
- ``hello``: the agent's version.

Every reply is ``{"agent": VERSION, "result": ...}``, or ``{"agent": VERSION, "error": text}``
for an operation it does not know. An agent of another version (installed by an older or
newer operator) is replaced by the operator that finds it, as a missing one is installed.

Like :mod:`holdings`, :mod:`relief`, :mod:`drain` and :mod:`departures`, this imports nothing from
memops beyond its siblings in this package, which the operator sends by value with it.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Any

from memops.rulesyntax import bounds
from memops.scheduler import admission, departures, drain, holdings, placement, relief, replication, worker_limits
from memops.worker import admission as worker_admission
from memops.worker import links

NAME = "memops_agent"
VERSION = 14
"""Bumped when an operation's arguments or reply change, or what the agent does in the scheduler
(7: no rule in force leaves the AMM as Dask made it; 8: replication follows an index of the ruled
keys instead of scanning keys; 10: ``resize``; 11: ``departures``; 12: ``links``, ``spill``; 13:
``placement``, and a drain moves the drained workers' placed groups first; 14: ``admission``), so that an older agent
is replaced."""
EVENTS = "memops-agent"
"""The scheduler's event topic where :func:`install` logs ``{"action": "installed", "agent":
VERSION}``. The operator reads it (the stock ``events`` handler, read-only) to learn whether the
agent is installed before it calls the handler: a scheduler asked for a handler it lacks logs a
warning with a traceback. The scheduler's event log starts empty, as its handlers do, so the
marker lives as long as the handler."""


def _plain_holdings(dask_scheduler: Any, workers: Sequence[str] = (), keys: Sequence[Hashable] = ()) -> dict[str, Any]:
    summary = holdings.summarize(dask_scheduler, workers=workers, keys=keys)
    return {
        "holdings": {str(a): [int(x) for x in figures] for a, figures in summary["holdings"].items()},
        "placement": {k: [int(size), [str(h) for h in holders]] for k, (size, holders) in summary["placement"].items()},
    }


def _relief(
    dask_scheduler: Any, above: float | None = None, to: float | None = None, owner: str = ""
) -> dict[str, Any]:
    state = relief.configure(dask_scheduler, above, to, owner) or {}
    return {str(k): list(v) if isinstance(v, (list, tuple)) else v for k, v in state.items()}


def _replication(
    dask_scheduler: Any,
    rules: dict[str, Any] | None = None,
    places: dict[str, Sequence[str]] | None = None,
    owner: str = "",
) -> dict[str, Any]:
    return replication.configure(dask_scheduler, rules, places, owner) or {}


def _drain(
    dask_scheduler: Any,
    workers: Sequence[str] = (),
    names: Sequence[str] = (),
    deadline: float = 60.0,
    nodes: dict[str, str] | None = None,
    close_workers: bool = True,
    restore: bool = False,
    window: int = drain.WINDOW_BYTES,
    origin: str = "",
    handover: bool = True,
    nodes_dying: bool = True,
) -> dict[str, Any]:
    started = drain.start(
        dask_scheduler,
        workers=[str(w) for w in workers],
        names=[str(n) for n in names],
        deadline=float(deadline),
        nodes={str(a): str(n) for a, n in (nodes or {}).items()},
        close=bool(close_workers),
        restore=bool(restore),
        window=int(window),
        origin=str(origin),
        handover=bool(handover),
        nodes_dying=bool(nodes_dying),
    )
    # The drained workers' placed groups go elsewhere now: their next tasks would otherwise make
    # more data on a worker that is being emptied.
    by_name = {str(ws.name): ws.address for ws in dask_scheduler.workers.values()}
    placement.rehome(dask_scheduler, [str(w) for w in workers] + [by_name.get(str(n), "") for n in names])
    return started


def _drain_status(
    dask_scheduler: Any,
    workers: Sequence[str] = (),
    names: Sequence[str] = (),
    nodes: dict[str, str] | None = None,
) -> dict[str, Any]:
    return drain.status(
        dask_scheduler,
        workers=[str(w) for w in workers],
        names=[str(n) for n in names],
        nodes={str(a): str(n) for a, n in (nodes or {}).items()},
    )


async def _resize(
    dask_scheduler: Any, worker: str = "", memory_limit: Any = None, maximum: Any = None
) -> dict[str, Any]:
    # Not ``limit``: the operator's comm takes that name for the size a reply may build.
    return await worker_limits.resize(dask_scheduler, worker=str(worker), memory_limit=memory_limit, maximum=maximum)


def _departures(dask_scheduler: Any, since: Any = 0.0) -> list[dict[str, Any]]:
    return departures.report(dask_scheduler, since=float(since) if isinstance(since, (int, float)) else 0.0)


async def _links(dask_scheduler: Any, install: bool = True, report: bool = True) -> dict[str, Any]:
    if install:
        await links.install(dask_scheduler)
    return await links.statuses(dask_scheduler) if report else {}


async def _spill(dask_scheduler: Any) -> dict[str, Any]:
    return await links.spill(dask_scheduler)


def _placement(
    dask_scheduler: Any, enabled: bool = False, max_tasks: Any = placement.MAX_TASKS, owner: str = ""
) -> dict[str, Any]:
    bounded = int(max_tasks) if isinstance(max_tasks, int) and not isinstance(max_tasks, bool) else placement.MAX_TASKS
    return placement.configure(dask_scheduler, enabled is True, max_tasks=bounded, owner=str(owner)) or {}


async def _admission(dask_scheduler: Any, settings: Any = None, owner: str = "") -> dict[str, Any]:
    chosen = admission.settings_from(settings) if settings else None
    figures = await admission.configure(
        dask_scheduler,
        enabled=chosen is not None,
        settings=chosen[0] if chosen else worker_admission.Settings(),
        probe=chosen[1] if chosen else False,
        owner=str(owner),
    )
    return figures or {}


def _hello(dask_scheduler: Any) -> dict[str, Any]:
    return {"version": VERSION}


OPERATIONS: dict[str, Callable[..., Any]] = {
    "holdings": _plain_holdings,
    "relief": _relief,
    "replication": _replication,
    "drain": _drain,
    "drain_status": _drain_status,
    "resize": _resize,
    "departures": _departures,
    "links": _links,
    "spill": _spill,
    "placement": _placement,
    "admission": _admission,
    "hello": _hello,
}


def handler(dask_scheduler: Any) -> Callable[..., dict[str, Any] | Awaitable[dict[str, Any]]]:
    """The comm handler for this scheduler (named ``handle``: distributed passes the comm only
    to handlers whose first argument is called ``comm``)."""

    def handle(operation: str = "", **arguments: Any) -> dict[str, Any] | Awaitable[dict[str, Any]]:
        function = OPERATIONS.get(operation)
        if function is None:
            return {"agent": VERSION, "error": f"unknown operation {operation!r}"}
        try:
            result = function(dask_scheduler, **arguments)
        except bounds.RuleError as exc:  # a rule refused: the message names its field
            return {"agent": VERSION, "error": str(exc)}
        if inspect.isawaitable(result):
            # An operation that talks to workers (resize): distributed awaits a handler's coroutine.
            return _wrapped(result)
        return {"agent": VERSION, "result": result}

    return handle


async def _wrapped(result: Awaitable[Any]) -> dict[str, Any]:
    return {"agent": VERSION, "result": await result}


def install(dask_scheduler: Any) -> None:
    """Run on the scheduler (``run_function``): register the handler, replacing any older one.

    Idempotent: relief's state lives in its scheduler plugin, not in the handler, so
    installing again loses nothing. Adds the plugin that records workers that leave with keys
    held nowhere else (:mod:`memops.scheduler.departures`), from then on. Returns None, so that
    ``run_function``'s pickled result is as small as a reply can be. Logs the marker that the
    operator reads (:data:`EVENTS`).
    """
    dask_scheduler.handlers[NAME] = handler(dask_scheduler)
    departures.install(dask_scheduler)
    dask_scheduler.log_event(EVENTS, {"action": "installed", "agent": VERSION})
