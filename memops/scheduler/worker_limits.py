"""Tell Dask a worker's new memory limit, after its pod was resized in place.

A Dask worker reads its memory limit once, at start, and three copies of it then live apart
(dask/distributed#5367, "change the memory limit on the fly", is open):

- the worker's ``memory_manager.memory_limit``: the spill, pause and target thresholds are
  fractions of it, read at every tick of the worker's memory monitor, so they follow a new value;
  two figures were computed from it at start and are set here too: the spill buffer's target
  (``data.n``, ``target`` * limit) and the worker state's ``transfer_incoming_bytes_limit``;
- the nanny's ``memory_manager.memory_limit``: the nanny's own monitor kills the worker when its
  RSS passes ``terminate`` * this copy (it reads it at every tick); the nanny starts its worker
  again (after a kill or a restart) with the arguments it first made its worker process with, so
  the limit among them is set too, and a new limit survives a restart;
- the scheduler's ``WorkerState.memory_limit`` (with ``total_memory``): what relief, replication,
  the drain, rebalance and Dask's adaptive scaling read. A worker that reconnects registers with
  its own (new) copy.

Two halves, both in this module, which imports nothing of memops beyond its siblings (it is sent
by value, as :mod:`memops.worker.handover` is):

- In each worker and each nanny, :class:`WorkerLimitPlugin` and :class:`NannyLimitPlugin`
  (installed by the scheduler on every worker and nanny, present and future, through
  ``register_worker_plugin`` and ``register_nanny_plugin``, so a stock Dask image works) register
  the comm handler :data:`NAME` (argument ``memory_limit``, bytes), which sets that process's copy and
  answers plain data: ``{"result": {"previous": bytes, "limit": bytes, ...}}`` or ``{"error":
  text}``. A decrease is refused, changing nothing, where the process would be over a threshold of
  the smaller limit at once: the worker's memory over ``pause`` * the new limit (it would pause),
  the nanny's view of the worker's RSS over ``terminate`` * the new limit (it would kill it).
- In the scheduler, :func:`resize` (the agent's ``resize`` operation) validates the limit, installs
  both plugins, and sets the three copies in the order that is safe for the direction: a growth
  goes nanny, worker, scheduler (the kill threshold rises before anything may use the room), a
  decrease goes worker, nanny, scheduler (the worker refuses first when it is over the smaller
  limit's pause threshold, before the nanny's kill threshold falls). The scheduler's copy comes
  last in both, so that nothing plans with a limit the worker does not have. A part that fails
  stops the rest; the reply says which parts took it (``applied``), and a caller that retries
  with the same limit finishes the job (a part already at the limit answers as it did).

The kubelet's part (``pods/resize``) comes first for a growth and last for a decrease; that is
the operator's (:mod:`memops.decisions.resize_decisions`), not this module's.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from distributed.diagnostics.plugin import NannyPlugin, WorkerPlugin

from memops.worker.handover import Refused, call_once, plain

logger = logging.getLogger(__name__)

NAME = "memops_resize"
VERSION = 1
CALL_SECONDS = 10.0
"""A worker or nanny that does not answer in this time has not taken the new limit."""
PARTS_GROW = ("nanny", "worker", "scheduler")
PARTS_SHRINK = ("worker", "nanny", "scheduler")


class LimitError(ValueError):
    """A memory limit that is not a positive whole number of bytes within the caller's bound."""


def checked_limit(limit: Any, maximum: Any) -> int:
    """``limit`` as bytes when it is a positive int not above ``maximum`` (a positive int);
    :class:`LimitError` otherwise. Booleans and floats are refused: a limit is a count of bytes."""
    for name, value in (("limit", limit), ("maximum", maximum)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise LimitError(f"{name}: a positive number of bytes, not {value!r}")
    if limit > maximum:
        raise LimitError(f"limit: {limit} bytes is above the maximum of {maximum} bytes")
    return int(limit)


# -- the worker's and the nanny's side ---------------------------------------------------------


def set_worker_limit(worker: Any, limit: int) -> dict[str, Any]:
    """Set the worker's memory manager's limit and what was computed from it at start."""
    manager = worker.memory_manager
    previous = manager.memory_limit
    if not previous:
        # No limit at start: no memory monitor was scheduled, so a limit set now would do nothing.
        return {"error": "the worker runs without a memory limit"}
    pause = manager.memory_pause_fraction
    if limit < previous and pause is not False:
        memory = int(worker.monitor.get_process_memory())
        if memory > pause * limit:
            return {"error": f"the worker's memory ({memory} bytes) is over the pause threshold of {limit} bytes"}
    manager.memory_limit = limit
    fraction = manager.memory_target_fraction or manager.memory_spill_fraction
    data = manager.data
    from distributed.spill import SpillBuffer

    # Only the spill buffer that the memory manager made from the limit; a user's mapping is theirs.
    if isinstance(data, SpillBuffer) and manager.memory_target_fraction:
        data.n = int(limit * fraction)
    transfer = _transfer_fraction()
    state = getattr(worker, "state", None)
    if transfer is not False and state is not None:
        state.transfer_incoming_bytes_limit = int(limit * transfer)
    return {
        "result": {
            "previous": int(previous),
            "limit": int(manager.memory_limit),
            "spill_target": int(data.n) if isinstance(data, SpillBuffer) else None,
            "pause": float(pause) if pause is not False else None,
        }
    }


def _transfer_fraction() -> float | bool:
    import dask.config

    value = dask.config.get("distributed.worker.memory.transfer", default=False)
    return value if value is False else float(value)


def set_nanny_limit(nanny: Any, limit: int) -> dict[str, Any]:
    """Set the nanny's memory manager's limit (its kill threshold is a fraction of it)."""
    manager = nanny.memory_manager
    previous = manager.memory_limit
    if not previous:
        return {"error": "the nanny runs without a memory limit"}
    terminate = manager.memory_terminate_fraction
    if limit < previous and terminate is not False:
        rss = _worker_rss(nanny)
        if rss is not None and rss > terminate * limit:
            return {"error": f"the worker's RSS ({rss} bytes) is over the kill threshold of {limit} bytes"}
    manager.memory_limit = limit
    # The nanny starts its worker again (after a kill, a restart) from the arguments its process
    # object was made with, not from its memory manager: the new limit goes there too.
    kwargs = getattr(getattr(nanny, "process", None), "worker_kwargs", None)
    if isinstance(kwargs, dict) and "memory_limit" in kwargs:
        kwargs["memory_limit"] = limit
    return {"result": {"previous": int(previous), "limit": int(manager.memory_limit)}}


def _worker_rss(nanny: Any) -> int | None:
    """The worker process's RSS as the nanny's monitor reads it, or None when it has none."""
    import psutil  # type: ignore[import-untyped]

    process = getattr(getattr(nanny, "process", None), "process", None)
    pid = getattr(process, "pid", None)
    if pid is None:
        return None
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except (psutil.Error, ProcessLookupError):
        return None


def _handler(apply: Any, server: Any) -> Any:
    def handle(memory_limit: Any = None) -> dict[str, Any]:
        if not isinstance(memory_limit, int) or isinstance(memory_limit, bool) or memory_limit <= 0:
            return {"error": "memory_limit: a positive number of bytes"}
        return dict(apply(server, memory_limit))

    return handle


class WorkerLimitPlugin(WorkerPlugin):
    """Registers the limit handler on a worker (installed by the scheduler)."""

    name = NAME

    def setup(self, worker: Any) -> None:
        worker.handlers[NAME] = _handler(set_worker_limit, worker)

    def teardown(self, worker: Any) -> None:
        worker.handlers.pop(NAME, None)


class NannyLimitPlugin(NannyPlugin):
    """Registers the limit handler on a nanny (installed by the scheduler)."""

    name = NAME

    def setup(self, nanny: Any) -> None:
        nanny.handlers[NAME] = _handler(set_nanny_limit, nanny)

    def teardown(self, nanny: Any) -> None:
        nanny.handlers.pop(NAME, None)


# -- the scheduler's side -----------------------------------------------------------------------


async def install(scheduler: Any) -> None:
    """Register both plugins on every worker and nanny, present and future (idempotent)."""
    from distributed.protocol.pickle import dumps

    if NAME not in scheduler.nanny_plugins:
        await scheduler.register_nanny_plugin(None, dumps(NannyLimitPlugin()), name=NAME, idempotent=True)
    if NAME not in scheduler.worker_plugins:
        await scheduler.register_worker_plugin(None, dumps(WorkerLimitPlugin()), name=NAME, idempotent=True)


async def call(scheduler: Any, address: str, limit: int) -> dict[str, Any]:
    """A worker's or nanny's limit handler's ``result``, checked to be a plain map; :class:`Refused`
    otherwise (its ``error``, a reply of another shape, no answer in :data:`CALL_SECONDS`)."""
    message = {"op": NAME, "memory_limit": limit, "reply": True}
    try:
        reply = await call_once(address, message, scheduler.connection_args, CALL_SECONDS)
    except Exception as exc:
        raise Refused(f"{address}: {type(exc).__name__}: {exc}") from None
    plain(reply)
    if isinstance(reply, dict) and isinstance(reply.get("error"), str):
        raise Refused(f"{address}: {reply['error'][:200]}")
    if not isinstance(reply, dict) or not isinstance(reply.get("result"), dict):
        raise Refused(f"{address}: no result in its reply")
    return dict(reply["result"])


def set_scheduler_limit(scheduler: Any, ws: Any, limit: int) -> dict[str, Any]:
    previous = int(ws.memory_limit or 0)
    ws.memory_limit = limit
    scheduler.total_memory += limit - previous
    return {"previous": previous, "limit": limit}


async def resize(scheduler: Any, worker: str = "", memory_limit: Any = None, maximum: Any = None) -> dict[str, Any]:
    """Set the memory limit of ``worker`` (its address) to ``memory_limit`` bytes, at most ``maximum``,
    in its nanny, its worker and the scheduler (see the module's docstring for the order).

    Returns plain data: ``worker``, ``limit``, ``previous`` (the scheduler's copy before),
    ``applied`` (the parts that hold the limit now, in order), ``refused`` (None, or why the next
    part did not take it) and ``parts`` (each part's answer)."""
    reply: dict[str, Any] = {
        "worker": str(worker),
        "limit": memory_limit if isinstance(memory_limit, int) and not isinstance(memory_limit, bool) else None,
        "previous": None,
        "applied": [],
        "refused": None,
        "parts": {},
    }
    try:
        limit = checked_limit(memory_limit, maximum)
    except LimitError as exc:
        reply["refused"] = str(exc)
        return reply
    ws = scheduler.workers.get(worker) if isinstance(worker, str) else None
    if ws is None:
        reply["refused"] = "no such worker"
        return reply
    previous = int(ws.memory_limit or 0)
    reply["previous"] = previous
    if not previous:
        reply["refused"] = "the worker runs without a memory limit"
        return reply
    try:
        await asyncio.wait_for(install(scheduler), CALL_SECONDS)
    except Exception as exc:  # a plugin that could not be registered: nothing changed
        reply["refused"] = f"the limit handlers could not be installed: {type(exc).__name__}"
        return reply
    for part in PARTS_GROW if limit >= previous else PARTS_SHRINK:
        try:
            if part == "scheduler":
                if scheduler.workers.get(worker) is not ws:
                    raise Refused("the worker left the scheduler")
                answer: dict[str, Any] | None = set_scheduler_limit(scheduler, ws, limit)
            elif part == "nanny":
                answer = await call(scheduler, ws.nanny, limit) if ws.nanny else None
            else:
                answer = await call(scheduler, ws.address, limit)
        except Refused as exc:
            reply["refused"] = f"{part}: {exc}"
            logger.info("memops resize of %s to %d bytes: %s", worker, limit, reply["refused"])
            return reply
        reply["parts"][part] = answer
        if answer is not None:
            reply["applied"].append(part)
    logger.info("memops resize of %s: %d -> %d bytes", worker, previous, limit)
    return reply
