"""The operator's only channel to a Dask scheduler: its own comm handlers, over tcp:// or tls://.

Called by the controllers and the sandbox. Never the scheduler's HTTP API (off by default,
and unauthenticated): only handlers that every stock scheduler serves (``identity``,
``who_has``, ``processing``, ``nbytes``, ``retire_workers``, ``run_function``), and the one
that pressure relief adds. Two of memops' functions run on the scheduler, sent by value
(pickled with their module) through ``run_function``: :func:`memops.scheduler.holdings.summarize`
(what each worker holds alone, summed where the scheduler's own bookkeeping makes it cheap)
and :func:`memops.scheduler.relief.configure` (when relief is not installed yet). A scheduler
whose ``distributed.scheduler.blocked-handlers`` lists ``run_function`` refuses them
(:class:`SchedulerRefused`): the sums are then done here from ``who_has``, and relief is not
installed. No user data passes through here: ``retire_workers`` and pressure relief move it
worker to worker.

What the scheduler does (distributed 2026.8.0, ``Scheduler.retire_workers``): each worker
becomes ``closing_gracefully`` at once and gets an AMM ``RetireWorker`` policy; the call
returns when every policy is done, as ``{address: worker identity}`` of the workers it
retired (with ``close_workers=True, remove=True``: closed, nanny included, and removed).

- A worker whose unique data has nowhere to go (every other worker paused or itself
  retiring) or that holds an actor is left out of the result and set back to the status it
  had *when that call began*. The scheduler asks the worker, and the worker reports back,
  so the scheduler shows the old status a moment after the call returns.
- A worker that dies during the drain counts as done, and is listed as retired.
- Unknown addresses are ignored; if none is known the call returns ``{}`` at once.
- It has no timeout, and it keeps running on the scheduler after the caller stops waiting
  or disconnects: the handler is awaited by the connection's task, which notices the closed
  connection only when it writes the answer. The worker stays ``closing_gracefully`` (no new
  tasks, never chosen as a recipient) until the drain ends, then is closed, or set back.
  No handler cancels a retirement: ``amm_handler`` only starts or stops the whole AMM.
- Calling it again for a worker that is already ``closing_gracefully`` adds a second
  RetireWorker policy. When the data moves, both calls report it retired. When it cannot
  move, *both* calls set the worker back, the first to its old status and the second to
  ``closing_gracefully`` (its status when the second call began), in whichever order their
  polling loops wake: about half the time the worker is left ``closing_gracefully`` for
  good, with no retirement running. :func:`retire_workers` therefore never retires a worker
  that is already leaving; it waits for it to leave or come back.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import cloudpickle
from distributed.comm.core import CommClosedError
from distributed.core import rpc
from distributed.protocol.pickle import dumps
from distributed.security import Security

from memops import planning
from memops.scheduler import holdings, relief

logger = logging.getLogger(__name__)

# Sent to the scheduler by value, so that it needs only distributed, not memops.
cloudpickle.register_pickle_by_value(holdings)
cloudpickle.register_pickle_by_value(relief)


class SchedulerUnreachable(Exception):
    """The scheduler did not answer over the comm."""

    def __init__(self, address: str, cause: BaseException | str):
        detail = cause if isinstance(cause, str) else (f"{type(cause).__name__}: {cause}".rstrip(": ") or "no answer")
        super().__init__(f"cannot reach the Dask scheduler at {address}: {detail}")
        self.address = address


@dataclass(frozen=True)
class RetireOutcome:
    """What :func:`retire_workers` learnt, by worker address."""

    retired: tuple[str, ...]
    """Left the scheduler after a retirement: its data moved (or it died while draining)."""
    not_retired: tuple[str, ...]
    """Still connected: its data had nowhere to go, or (``timed_out``) it is still draining."""
    timed_out: bool
    seconds: float
    absent: tuple[str, ...] = ()
    """Unknown to the scheduler when we asked: retired earlier, or died. Nothing to do."""


_COMM_ERRORS = (OSError, CommClosedError, TimeoutError)


def security_from_pem(ca: str, cert: str, key: str) -> Security:
    """A client ``Security`` from PEM texts (the CA, the client certificate and its key).

    ``Security`` takes PEM contents as well as paths (it tells them apart by the newline)
    and writes a certificate held in memory to a private temporary directory only while it
    loads it, so nothing is written here.
    """
    for what, text in (("CA certificate", ca), ("client certificate", cert), ("client key", key)):
        if "-----BEGIN" not in text:
            raise ValueError(f"the {what} is not PEM text")
    return Security(tls_ca_file=ca, tls_client_cert=cert, tls_client_key=key, require_encryption=True)


def security_from_secret(data: Mapping[str, str]) -> Security:
    """A client ``Security`` from a Kubernetes Secret's ``data`` (base64 ca.crt, tls.crt, tls.key)."""

    def pem(key: str) -> str:
        if key not in data:
            raise ValueError(f"the scheduler's TLS Secret has no {key!r}")
        return base64.b64decode(data[key]).decode()

    return security_from_pem(pem("ca.crt"), pem("tls.crt"), pem("tls.key"))


def _connect(address: str, security: Security | None, timeout: float) -> rpc:
    if address.startswith("tls://") and security is None:
        raise SchedulerUnreachable(address, "a tls:// scheduler needs client certificates (spec.scheduler.tls)")
    return rpc(address, timeout=timeout, connection_args=(security or Security()).get_connection_args("client"))


async def fetch_snapshot(
    address: str,
    *,
    security: Security | None = None,
    timeout: float = 10,
    keys: bool = True,
    processing: bool | None = None,
    placement_of: Collection[str] = (),
    placement: Collection[Hashable] = (),
) -> planning.SchedulerSnapshot:
    """The workers and their memory, from one connection.

    With ``keys`` (the default) also the bytes and keys each worker holds, and holds alone, and
    who holds which key (``who_has`` and ``nbytes``) for the keys that the workers at
    ``placement_of`` hold and for the keys in ``placement``: what a drain's report compares
    before and after. With ``keys=False`` only the workers and their memory. ``processing``
    (default: as ``keys``) also asks which workers run a shuffle's tasks.

    The sums run inside the scheduler (:mod:`memops.scheduler.holdings`, sent by value through
    ``run_function``), where they cost the workers and the replicated keys rather than every
    key. A scheduler that refuses ``run_function`` is asked for ``who_has`` and ``nbytes`` of
    every key instead, and the sums are done here: the same figures, at a cost that grows with
    the keys, and ``who_has`` then covers every key.
    """
    processing = keys if processing is None else processing
    scheduler = _connect(address, security, timeout)
    summary: dict[str, Any] | None = None
    who_has_raw: Mapping[Any, Sequence[str]] = {}
    nbytes_raw: Mapping[Any, int] = {}
    try:
        async with asyncio.timeout(timeout):
            identity = await scheduler.identity()
            running = await scheduler.processing() if processing else {}
            if keys:
                try:
                    summary = await _run(
                        scheduler, holdings.summarize, workers=list(placement_of), keys=list(placement)
                    )
                except SchedulerRefused as exc:
                    logger.info("summing holdings from who_has instead: %s", exc)
                    who_has_raw = await scheduler.who_has()
                    nbytes_raw = await scheduler.nbytes(summary=False)
    except _COMM_ERRORS as exc:
        raise SchedulerUnreachable(address, exc) from exc
    finally:
        await scheduler.close_rpc()
    if summary is not None:
        figures: dict[str, tuple[int, ...]] = {a: tuple(int(x) for x in h) for a, h in summary["holdings"].items()}
        who_has = {k: tuple(holders) for k, (_, holders) in summary["placement"].items()}
        nbytes = {k: int(size) for k, (size, _) in summary["placement"].items()}
    else:
        who_has = {k: tuple(v) for k, v in who_has_raw.items()}
        nbytes = {k: int(v) for k, v in nbytes_raw.items()}
        figures = dict(planning.holdings(who_has, nbytes))
    workers = []
    for worker_address, info in identity.get("workers", {}).items():
        metrics = info.get("metrics", {})
        spilled = metrics.get("spilled_bytes") or {}
        # As the scheduler computes WorkerState.memory.unmanaged: the process' memory minus the
        # Dask data it holds in memory (what it spilled counts in managed_bytes but not in RSS).
        in_memory = int(metrics.get("managed_bytes", 0)) - int(spilled.get("memory", 0))
        held_bytes, held_keys, unique_bytes, unique_keys = figures.get(worker_address, (0, 0, 0, 0))
        workers.append(
            planning.WorkerInfo(
                name=str(info.get("name", worker_address)),
                address=worker_address,
                memory_limit=int(info.get("memory_limit") or 0),
                managed_bytes=held_bytes if keys else int(metrics.get("managed_bytes", 0)),
                unique_bytes=unique_bytes,
                unique_keys=unique_keys,
                nkeys=held_keys,
                status=str(info.get("status", "running")),
                process_bytes=int(metrics.get("memory", 0)),
                spilled_bytes=int(spilled.get("disk", 0)),
                unmanaged_bytes=max(0, int(metrics.get("memory", 0)) - in_memory),
                in_shuffle=planning.in_shuffle([str(k) for k in running.get(worker_address, ())]),
            )
        )
    return planning.SchedulerSnapshot(workers=tuple(workers), who_has=who_has, nbytes=nbytes)


async def ping(address: str, *, security: Security | None = None, timeout: float = 5) -> int:
    """The number of workers the scheduler has; cheap, whatever the number of keys."""
    scheduler = _connect(address, security, timeout)
    try:
        async with asyncio.timeout(timeout):
            identity = await scheduler.identity(n_workers=0)
    except _COMM_ERRORS as exc:
        raise SchedulerUnreachable(address, exc) from exc
    finally:
        await scheduler.close_rpc()
    return int(identity.get("n_workers", 0))


LEAVING = frozenset({"closing_gracefully", "closing", "closed"})
"""Worker statuses meaning that something already retires or closes the worker."""

POLL_SECONDS = 0.5


async def _statuses(scheduler: rpc) -> dict[str, str]:
    """Address -> status of every connected worker."""
    identity = await scheduler.identity()
    return {address: str(info.get("status", "")) for address, info in identity.get("workers", {}).items()}


async def retire_workers(
    address: str, worker_addresses: Sequence[str], *, security: Security | None = None, timeout: float
) -> RetireOutcome:
    """Drain and close these workers through the scheduler's AMM; stop waiting after ``timeout``.

    Workers that are running or paused are retired with one ``retire_workers`` call
    (``close_workers=True, remove=True``). Workers already leaving (``closing_gracefully``,
    for example drained by this operator before it restarted) are not retired a second time,
    which could leave them ``closing_gracefully`` for good (see the module docstring): we wait
    until they leave the scheduler (retired) or come back to running or paused (that
    retirement found no room for their data: not retired). Calling this again is therefore
    safe at any time. A worker stuck ``closing_gracefully`` with nothing retiring it stays so
    until ``timeout``.

    On timeout (``timed_out=True``) a worker that has left the scheduler counts as retired,
    the others as not retired. The scheduler goes on draining them after we stop waiting and
    nothing can cancel that: each is closed once its data has moved (its pod's container then
    exits, and restarts unless the pod is deleted), or set back to running or paused if the
    data has nowhere to go. A ``timeout`` of 0 starts no retirement and only reports.

    Raises :class:`SchedulerUnreachable` when the scheduler does not answer.
    """
    start = time.monotonic()
    wanted = list(dict.fromkeys(worker_addresses))
    if not wanted:
        return RetireOutcome((), (), False, 0.0)
    connect_timeout = min(max(timeout, 1.0), 10.0)
    scheduler = _connect(address, security, connect_timeout)
    retired: set[str] = set()
    not_retired: set[str] = set()
    try:
        try:
            # Connect first, with its own timeout: "unreachable" must not read as "drain too slow".
            statuses = await asyncio.wait_for(_statuses(scheduler), connect_timeout)
        except _COMM_ERRORS as exc:
            raise SchedulerUnreachable(address, exc) from exc
        absent = tuple(a for a in wanted if a not in statuses)
        leaving = [a for a in wanted if statuses.get(a) in LEAVING]
        fresh = [a for a in wanted if a in statuses and a not in leaving]
        deadline = start + timeout

        async def retire_fresh() -> None:
            result = await scheduler.retire_workers(
                workers=fresh, close_workers=True, remove=True, stimulus_id=f"memops-retire-{time.time()}"
            )
            retired.update(a for a in fresh if a in result)
            not_retired.update(a for a in fresh if a not in result)

        async def await_leaving() -> None:
            pending = set(leaving)
            while pending:
                await asyncio.sleep(POLL_SECONDS)
                now = await _statuses(scheduler)
                retired.update(a for a in pending if a not in now)
                not_retired.update(a for a in pending if a in now and now[a] not in LEAVING)
                pending -= retired | not_retired

        timed_out = False
        try:
            # One after the other is enough: the scheduler drains both groups at once anyway.
            for step, needed in ((retire_fresh, fresh), (await_leaving, leaving)):
                if not needed:
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:  # never start a retirement that we would not wait for
                    raise TimeoutError
                await asyncio.wait_for(step(), remaining)
        except TimeoutError:
            timed_out = True
            try:
                now = await asyncio.wait_for(_statuses(scheduler), connect_timeout)
            except _COMM_ERRORS:
                now = dict.fromkeys(wanted, "")  # no news: claim nothing
            retired.update(a for a in wanted if a not in now and a not in absent)
        except _COMM_ERRORS as exc:
            raise SchedulerUnreachable(address, exc) from exc
    finally:
        await scheduler.close_rpc()
    return RetireOutcome(
        retired=tuple(a for a in wanted if a in retired),
        not_retired=tuple(a for a in wanted if a not in retired and a not in absent),
        timed_out=timed_out,
        seconds=time.monotonic() - start,
        absent=absent,
    )


class SchedulerRefused(Exception):
    """The scheduler answered, with an error (for example, it does not accept pickled code)."""


async def configure_relief(
    address: str,
    *,
    security: Security | None = None,
    above: float | None,
    to: float | None,
    owner: str,
    timeout: float = 5,
) -> dict[str, Any] | None:
    """Install, retune or (``above=None``) remove pressure relief in the scheduler; its state.

    Installed relief serves its own comm handler, which this calls first: a plain RPC, so
    that the operator's pass sends no code (``run_function`` logs every call on the scheduler,
    code included). A scheduler without the handler (new, or restarted) gets the code by value
    (cloudpickle) through ``run_function``, so it needs only ``distributed``. Relief that another
    ``owner`` installed is left alone; its state says whose it is. Returns None when no relief is
    installed. Raises :class:`SchedulerRefused` when the scheduler does not run the code.
    """
    scheduler = _connect(address, security, timeout)
    try:
        async with asyncio.timeout(timeout):
            state = await _call(scheduler, relief.NAME, above=above, to=to, owner=owner)
            if state is None and above is not None:
                try:
                    state = await _run(scheduler, relief.configure, above=above, to=to, owner=owner)
                except SchedulerRefused as exc:
                    raise SchedulerRefused(f"pressure relief could not be installed: {exc}") from exc
    except _COMM_ERRORS as exc:
        raise SchedulerUnreachable(address, exc) from exc
    finally:
        await scheduler.close_rpc()
    if not state:
        return None  # {}: the handler removed it
    # The handler's answer comes through msgpack, which turns lists into tuples.
    return {key: list(value) if isinstance(value, tuple) else value for key, value in state.items()}


async def _run(scheduler: rpc, function: Callable[..., Any], **kwargs: Any) -> Any:
    """``function(dask_scheduler, **kwargs)`` run on the scheduler (``run_function``): its result.

    Raises :class:`SchedulerRefused` when the scheduler does not run it (``run_function`` in
    ``distributed.scheduler.blocked-handlers``) or the function raised there.
    """
    response = await _call(scheduler, "run_function", function=dumps(function), kwargs=dumps(kwargs))
    if not isinstance(response, dict) or response.get("status") != "OK":
        exception = response.get("exception") if isinstance(response, dict) else response
        raise SchedulerRefused(f"run_function of {function.__name__}: {exception!r}")
    return response.get("result")


async def _call(scheduler: rpc, op: str, **kwargs: Any) -> Any:
    """One comm call; the scheduler's error (a refused or failing handler) as :class:`SchedulerRefused`."""
    try:
        return await getattr(scheduler, op)(**kwargs)
    except _COMM_ERRORS:
        raise
    except Exception as exc:
        raise SchedulerRefused(f"the scheduler refused {op}: {type(exc).__name__}: {exc}") from exc
