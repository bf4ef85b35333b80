"""The operator's only channel to a Dask scheduler: its own comm handlers, over tcp:// or tls://.

Called by the controllers and the sandbox. Never the scheduler's HTTP API (off by default,
and unauthenticated): only handlers that every stock scheduler serves (``identity``,
``who_has``, ``processing``, ``nbytes``, ``retire_workers``, ``run_function``, ``events``), and the one
that memops' agent adds (:mod:`memops.scheduler.agent`).

The scheduler's address is written by users, so the peer is hostile input: every call goes
through :mod:`memops.clients.daskcomm`, which speaks msgpack only, never unpickles (not even an error
reply's exception), and bounds what each reply may build by the call's
:class:`memops.clients.daskcomm.Limit` (its bytes, before reading it; the objects that decoding it
creates, while decoding). A reply that it refuses, or one of the wrong shape, raises
:class:`SchedulerMisbehaved`; a peer that does not answer the Dask handshake (a closed port, a
silent one, another protocol) raises :class:`SchedulerUnreachable`, all with one message, which
quotes nothing of the peer (:data:`UNREACHABLE`): the details go to the log.

The controllers reach a scheduler only through :func:`vetted`: one connection, on which
``identity`` is judged by the caller's vouch (the tenancy check) before anything else is sent,
and everything else is then asked (:class:`Scheduler`). What answers at an address may change from
one connection to the next, so a check on one connection vouches for nothing on another. There is
no other way in: the sandbox, the tests and the benchmarks, which run their scheduler themselves,
go through :func:`vetted` too, with a vouch that vouches for every worker
(``memops_sandbox.dask_direct``, which the operator never imports).

memops' code reaches a stock scheduler once, by value: the agent (with
:mod:`memops.scheduler.holdings` and :mod:`memops.scheduler.relief`, pickled with cloudpickle)
through ``run_function``, whose reply is pickled by design and is therefore never decoded
beyond its plain ``status``. Everything else is asked of the agent's handler, in plain data:
what each worker holds alone (summed where the scheduler's own bookkeeping makes it cheap),
and pressure relief's configuration. A scheduler without the agent (new, or restarted) gets it
on the first call that needs it. A scheduler whose ``distributed.scheduler.blocked-handlers``
lists ``run_function`` refuses it (:class:`SchedulerRefused`): the sums are then done here from
``who_has`` and ``nbytes`` (plain msgpack replies), in a thread so that the event loop that
serves every other request and the webhook goes on meanwhile, and relief is not installed. No
user data passes through here: ``retire_workers`` and pressure relief move it worker to worker.

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
  good, with no retirement running. :meth:`Scheduler.retire_workers` therefore never retires a
  worker that is already leaving; it waits for it to leave or come back.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import functools
import logging
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import cloudpickle
from distributed.protocol.pickle import dumps
from distributed.security import Security

from memops.clients import daskcomm
from memops.decisions import counts, snapshots, tenancy
from memops.rulesyntax import bounds, globs
from memops.scheduler import (
    admission,
    agent,
    departures,
    drain,
    holdings,
    placement,
    relief,
    replication,
    replication_index,
    rules,
    transfers,
    worker_limits,
)
from memops.worker import accounting, handover, links, maps
from memops.worker import admission as worker_admission
from memops.worker import owner as spill_owner

logger = logging.getLogger(__name__)

# Sent to the scheduler by value, so that it needs only distributed, not memops.
_BY_VALUE = (
    admission,
    worker_admission,
    agent,
    departures,
    drain,
    handover,
    holdings,
    placement,
    relief,
    replication,
    replication_index,
    rules,
    bounds,
    globs,
    worker_limits,
    links,
    maps,
    spill_owner,
    accounting,
)
for _module in (*_BY_VALUE, transfers):
    cloudpickle.register_pickle_by_value(_module)


UNREACHABLE = "unreachable, not a Dask scheduler, or no answer in time"
"""All that a status says of a scheduler that did not answer as one.

A connection refused, one that timed out, a TLS handshake that failed, a name that does not
resolve, a server that speaks another protocol (HTTP, SSH, garbage) and one that stays silent
all read the same: anyone who may write ``spec.scheduler.address`` reads the status, and if it
told these apart the operator would scan ports and read banners across the cluster's network
for them. What happened is in the operator's log."""


class SchedulerUnreachable(Exception):
    """The scheduler did not answer over the comm.

    The message says only what memops concluded: ``cause`` is memops' own words when a str;
    an exception (what the peer or the network did) is never quoted (see :data:`UNREACHABLE`).
    """

    def __init__(self, address: str, cause: BaseException | str):
        said = cause if isinstance(cause, str) else UNREACHABLE
        super().__init__(f"cannot reach the Dask scheduler at {address}: {said}")
        self.address = address


class SchedulerMisbehaved(SchedulerUnreachable):
    """What answered at the scheduler's address sent what no Dask scheduler sends: a reply
    too large, not msgpack, with pickled or serialized parts, of the wrong shape, or an error
    from a handler that every scheduler serves. Nothing of it was decoded or run.

    A kind of :class:`SchedulerUnreachable` (no usable answer), so that every caller keeps
    running and never acts on it; a RetirementRequest that meets it before it starts fails.
    Raised only once the peer has answered the Dask handshake: a peer that does not is
    :class:`SchedulerUnreachable`, like a closed port. Its message holds no text and no number
    that the peer chose: ``cause`` is memops' own words when a str, and a
    :class:`memops.clients.daskcomm.Misbehaved`'s message (which quotes nothing of the peer); any other
    exception reads as a reply of the wrong shape.
    """

    def __init__(self, address: str, cause: BaseException | str):
        if isinstance(cause, (str, daskcomm.Misbehaved)):
            said = str(cause)
        else:
            said = "a reply of the wrong shape"
        Exception.__init__(self, f"the Dask scheduler at {address} sent a reply that memops refuses: {said}")
        self.address = address


def _detail(cause: BaseException) -> str:
    """An exception's type and text, for the operator's log (never for a status)."""
    return f"{type(cause).__name__}: {cause}".rstrip(": ")


@dataclass(frozen=True)
class RetireOutcome:
    """What :meth:`Scheduler.retire_workers` learnt, by worker address."""

    retired: tuple[str, ...]
    """Left the scheduler after a retirement: its data moved (or it died while draining)."""
    not_retired: tuple[str, ...]
    """Still connected: its data had nowhere to go, or (``timed_out``) it is still draining."""
    timed_out: bool
    seconds: float
    absent: tuple[str, ...] = ()
    """Unknown to the scheduler when we asked: retired earlier, or died. Nothing to do."""
    lost_at_deadline: Mapping[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    """Address -> (keys, bytes) held by that worker alone when memops' drain reached its
    deadline (``timed_out``): what its pod would lose if it went now. Empty with the stock path."""
    by_memops: bool = False
    """Drained by memops' own drain (:mod:`memops.scheduler.drain`), not stock ``retire_workers``."""
    linked: Mapping[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    """Address -> (keys, bytes) that memops' drain handed over by link (:mod:`memops.worker.handover`)."""


_COMM_ERRORS = (OSError, TimeoutError)
"""A connection that failed, or closed (daskcomm.Closed is an OSError), or a call that timed out."""


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


async def _connect(address: str, security: Security | None, timeout: float) -> daskcomm.Comm:
    """One connection, within ``timeout``, with every failure as this module's exceptions."""
    if address.startswith("tls://") and security is None:
        raise SchedulerUnreachable(address, "a tls:// scheduler needs client certificates (spec.scheduler.tls)")
    try:
        daskcomm.parse_address(address)
    except ValueError as exc:  # the user's own address, in memops' words
        raise SchedulerUnreachable(address, str(exc)) from exc
    context = security.get_connection_args("client")["ssl_context"] if security is not None else None
    try:
        return await daskcomm.connect(address, ssl_context=context, timeout=timeout)
    except (*_COMM_ERRORS, ValueError, daskcomm.Misbehaved) as exc:
        # Before the Dask handshake: whatever happened reads as one "unreachable" (UNREACHABLE).
        logger.info("the Dask scheduler at %s did not answer as one: %s", address, _detail(exc))
        raise SchedulerUnreachable(address, exc) from exc


@contextlib.contextmanager
def _translated(address: str) -> Iterator[None]:
    """The calls within, with every failure of the comm as this module's exceptions."""
    try:
        yield
    except daskcomm.Misbehaved as exc:
        raise SchedulerMisbehaved(address, exc) from exc
    except daskcomm.RemoteError as exc:
        # The handlers that every scheduler serves do not fail: an error from one is misbehaviour.
        # Its text is the peer's, and the peer may not be vouched for yet: for the log only.
        logger.info("the Dask scheduler at %s answered with an error: %s", address, _detail(exc))
        raise SchedulerMisbehaved(address, "an error from a handler that every Dask scheduler serves") from exc
    except _COMM_ERRORS as exc:
        logger.info("the Dask scheduler at %s stopped answering: %s", address, _detail(exc))
        raise SchedulerUnreachable(address, exc) from exc


def _mapping(address: str, value: Any, what: str) -> Mapping[Any, Any]:
    if not isinstance(value, Mapping):
        raise SchedulerMisbehaved(address, f"{what} is a {type(value).__name__}, not a map")
    return value


Vouch = Callable[[Sequence[snapshots.WorkerInfo]], Awaitable[tenancy.Verdict]]
"""Judges the workers of a scheduler's ``identity`` (the tenancy check: :func:`memops.decisions.tenancy.check`)."""


class Unvouched(Exception):
    """The vouch did not vouch for the scheduler's workers: nothing more was asked of it, and the
    connection is closed. Not a :class:`SchedulerUnreachable`: the scheduler answered."""

    def __init__(self, verdict: tenancy.Verdict, workers: Sequence[snapshots.WorkerInfo]):
        super().__init__(verdict.message)
        self.verdict = verdict
        self.workers = tuple(workers)


class Scheduler:
    """One scheduler, over one connection, on which everything is asked once the vouch said yes.

    Made by :func:`vetted` only (the controllers: every MemoryPolicy pass, its goodbye, every
    RetirementRequest step, the eviction gate; the sandbox, tests and benchmarks with a vouch that
    vouches for every worker). :func:`vetted` connects, asks ``identity`` and has ``vouch`` judge
    its workers before anything else is sent, and every later call goes over that same connection:
    an address that resolves elsewhere on the next connect (an ExternalName Service, DNS, a TCP
    proxy that routes each connection its own way) cannot have one scheduler vouched for and
    another one acted on. ``identity`` read again on the connection (a snapshot) that shows a
    worker not vouched for yet is judged again first. A call that fails in the middle leaves the
    connection in an unknown state (a reply may still come): it is closed, and the next call opens
    a new one, which is vouched for again before anything it says is trusted.

    A new connection of the same handle may only lose workers: one whose ``identity`` shows no
    worker, or only workers vouched for on the handle's last connection, is the same scheduler
    after they left (a retirement that timed out after its last worker had gone; the tenancy
    check would refuse an empty scheduler as ``NoWorkers`` and the retired workers would be
    misjudged as kept). It is taken without asking the vouch, and what it vouches for shrinks to
    what it shows; any other worker on it is judged by the vouch first, as on a first connection.
    """

    def __init__(self, address: str, *, security: Security | None, timeout: float, vouch: Vouch):
        self.address = address
        self.security = security
        self.timeout = timeout
        """For connecting, and the default of each call."""
        self._vouch = vouch
        self._comm: daskcomm.Comm | None = None
        self._identity: Mapping[Any, Any] | None = None  # read by the vouch, not yet used by a snapshot
        self._vouched: frozenset[str] | None = None  # the workers vouched for on this connection
        self._emptied = False  # taken as the same scheduler after every worker left: read, never changed
        self.workers: tuple[snapshots.WorkerInfo, ...] = ()
        """The workers of the last ``identity`` read, as the vouch saw them (no figures)."""
        self.verdict: tenancy.Verdict | None = None
        """The vouch's last verdict on this connection; None until it has judged."""

    async def _open(self) -> None:
        """A new connection, its ``identity`` judged by the vouch before anything else is sent."""
        self._comm = await _connect(self.address, self.security, self.timeout)
        self._identity, self._emptied = None, False
        async with self._using() as comm, asyncio.timeout(self.timeout):
            identity = _mapping(self.address, await comm.call("identity", limit=daskcomm.WORKERS), "identity")
        # What the handle's last connection vouched for (kept through a connection that failed
        # before its identity came): a reconnect that shows only those, or none, has lost
        # workers and gained none (see the class docstring).
        earlier, self._vouched = self._vouched, None
        if earlier is not None:
            shown = frozenset(w.address for w in _identified(self.address, identity, {}, {}, keys=False))
            if shown <= earlier:
                self._vouched, self._emptied = shown, not shown
        await self._judge(identity)
        self._identity = identity

    async def close(self) -> None:
        comm, self._comm, self._identity = self._comm, None, None
        if comm is not None:
            await comm.close()

    async def _judge(self, identity: Mapping[Any, Any]) -> None:
        """Have the vouch judge the workers of ``identity`` that it has not vouched for on this
        connection; raises :class:`Unvouched` (and closes the connection) when it says no."""
        self.workers = workers = _identified(self.address, identity, {}, {}, keys=False)
        addresses = frozenset(w.address for w in workers)
        # Workers that left (a retirement's) change nothing: the connection was vouched for.
        if self._vouched is not None and addresses <= self._vouched:
            return
        try:
            # Outside the calls' timeout and their exceptions: it may ask the API server, whose
            # failure is not the scheduler's.
            self.verdict = verdict = await self._vouch(workers)
        except BaseException:
            await self.close()
            raise
        if not verdict.allowed:
            await self.close()
            # The addresses go to the operator's log only: a status does not name them.
            logger.info(
                "%s not vouched for: %s; its workers not vouched for: %s",
                self.address,
                verdict.message,
                ", ".join(verdict.foreign[:10]) + (", ..." if len(verdict.foreign) > 10 else ""),
            )
            raise Unvouched(verdict, workers)
        self._vouched, self._emptied = addresses, False

    @contextlib.asynccontextmanager
    async def _using(self, *, changes: bool = False) -> AsyncIterator[daskcomm.Comm]:
        """The connection (a new one, vouched for, if the last one was closed), with this module's
        exceptions; one that fails in the middle of a call is closed. ``changes``: the call sends
        code or changes the scheduler, which a connection taken only because its workers all left
        refuses (:class:`Unvouched`, ``NoWorkers``): nothing on it is shown to be the tenant's."""
        if self._comm is None:
            await self._open()
        assert self._comm is not None
        if changes and self._emptied:
            verdict = tenancy.Verdict(
                tenancy.Reason.NO_WORKERS,
                "the scheduler has no worker left, so none can be shown to be a pod of the namespace",
            )
            raise Unvouched(verdict, ())
        try:
            with _translated(self.address):
                yield self._comm
        except SchedulerRefused:
            raise  # an answer: the connection is fine
        except BaseException:
            await self.close()
            raise

    async def identity(self, *, timeout: float | None = None) -> Mapping[Any, Any]:
        """``identity``: the one the vouch judged if no snapshot used it yet, else asked again
        (and judged again if it shows a worker not vouched for on this connection)."""
        if self._comm is None:
            await self._open()
        if self._identity is not None:
            identity, self._identity = self._identity, None
            return identity
        async with self._using() as comm, asyncio.timeout(self.timeout if timeout is None else timeout):
            identity = _mapping(self.address, await comm.call("identity", limit=daskcomm.WORKERS), "identity")
        await self._judge(identity)
        return identity

    async def snapshot(
        self,
        *,
        keys: bool = True,
        processing: bool | None = None,
        placement_of: Collection[str] = (),
        placement: Collection[Hashable] = (),
        drains: bool = False,
        nodes: Callable[[], Mapping[str, str]] | None = None,
        timeout: float | None = None,
    ) -> snapshots.SchedulerSnapshot:
        """The workers and their memory.

        With ``keys`` (the default) also the bytes and keys each worker holds, and holds alone, and
        who holds which key (``who_has`` and ``nbytes``) for the keys that the workers at
        ``placement_of`` hold and for the keys in ``placement``: what a drain's report compares
        before and after. With ``keys=False`` only the workers and their memory. ``processing``
        (default: as ``keys``) also asks which workers run a shuffle's tasks.

        The sums run inside the scheduler (the agent's ``holdings``: :mod:`memops.scheduler.holdings`),
        where they cost the workers and the replicated keys rather than every key. A scheduler that
        refuses ``run_function`` is asked for ``who_has`` and ``nbytes`` of every key instead, and the
        sums are done here, in a thread: the same figures, at a cost that grows with the keys, and
        ``who_has`` then covers every key (within :data:`memops.clients.daskcomm.KEYS`: some 300,000 keys).

        ``drains`` also asks memops' agent for every drain's figures (:meth:`drain_status`, in
        ``drains`` of the snapshot; None where the scheduler does not run the agent), and for the
        workers that left with keys held nowhere else (:mod:`memops.scheduler.departures`, in
        ``departures``; None likewise). ``nodes``
        gives where the workers run (address -> node), sent with the drains' read for the drains
        that start later (:func:`memops.scheduler.drain.status`).

        Raises :class:`SchedulerUnreachable`, :class:`SchedulerMisbehaved` for a reply it refuses,
        or :class:`Unvouched`.
        """
        timeout = self.timeout if timeout is None else timeout
        processing = keys if processing is None else processing
        summary: Mapping[Any, Any] | None = None
        who_has_raw: Mapping[Any, Any] = {}
        nbytes_raw: Mapping[Any, Any] = {}
        running: Mapping[Any, Any] = {}
        drained: dict[str, Any] | None = None
        departed: list[Any] | None = None
        identity = await self.identity(timeout=timeout)
        address = self.address
        async with self._using() as comm, asyncio.timeout(timeout):
            running = (
                _mapping(address, await comm.call("processing", limit=daskcomm.KEYS), "processing")
                if processing
                else {}
            )
            if drains and not self._emptied:
                try:
                    located = dict(nodes()) if nodes is not None else {}
                    drained = _drains(address, await _agent(comm, "drain_status", nodes=located))
                    departed = _departures(address, await _agent(comm, "departures"))
                except SchedulerRefused as exc:
                    logger.info("the drains' status is not read: %s", exc)
            if keys and self._emptied:
                # No worker, and nothing shown to be the tenant's: no code sent, plain reads only.
                who_has_raw = _mapping(address, await comm.call("who_has", limit=daskcomm.KEYS), "who_has")
                nbytes_raw = _mapping(address, await comm.call("nbytes", summary=False, limit=daskcomm.KEYS), "nbytes")
            elif keys:
                try:
                    summary = _mapping(
                        address,
                        await _agent(
                            comm, "holdings", limit=daskcomm.KEYS, workers=list(placement_of), keys=list(placement)
                        ),
                        "the agent's holdings",
                    )
                except SchedulerRefused as exc:
                    logger.info("summing holdings from who_has instead: %s", exc)
                    who_has_raw = _mapping(address, await comm.call("who_has", limit=daskcomm.KEYS), "who_has")
                    nbytes_raw = _mapping(
                        address, await comm.call("nbytes", summary=False, limit=daskcomm.KEYS), "nbytes"
                    )
        try:
            if summary is not None:
                figures, who_has, nbytes = _from_summary(summary)
            else:
                # Off the event loop: at a million keys these sums take seconds of Python, and the
                # loop serves the webhook and every other request meanwhile.
                figures, who_has, nbytes = await asyncio.to_thread(_from_who_has, who_has_raw, nbytes_raw)
        except (TypeError, ValueError, AttributeError) as exc:
            logger.info("the Dask scheduler at %s sent a reply of the wrong shape: %s", address, _detail(exc))
            raise SchedulerMisbehaved(address, exc) from exc
        workers = _identified(address, identity, figures, running, keys=keys)
        return snapshots.SchedulerSnapshot(
            workers=workers, who_has=who_has, nbytes=nbytes, drains=drained, departures=departed
        )

    async def configure_relief(
        self, *, above: float | None, to: float | None, owner: str, timeout: float | None = None
    ) -> dict[str, Any] | None:
        """Install, retune or (``above=None``) remove pressure relief in the scheduler; its state.

        Through the agent's ``relief`` operation: a plain RPC, so that the operator's pass sends no
        code. A scheduler without the agent (new, or restarted) gets it first, by value, so it needs
        only ``distributed``; removing relief installs nothing. Relief that another ``owner``
        installed is left alone; its state says whose it is. Returns None when no relief is
        installed. Raises :class:`SchedulerRefused` when the scheduler does not run the agent.
        """
        address = self.address
        async with self._using(changes=True) as comm, asyncio.timeout(self.timeout if timeout is None else timeout):
            try:
                state = await _agent(comm, "relief", install=above is not None, above=above, to=to, owner=owner)
            except SchedulerRefused as exc:
                raise SchedulerRefused(f"pressure relief could not be installed: {exc}") from exc
        if state is None:
            return None  # no agent, so no relief, and none was asked for
        if not isinstance(state, Mapping):
            raise SchedulerMisbehaved(address, f"the agent's relief state is a {type(state).__name__}, not a map")
        if not state:
            return None  # {}: removed, or never installed
        # The agent's answer comes through msgpack, which turns lists into tuples.
        return {str(key): list(value) if isinstance(value, tuple) else value for key, value in state.items()}

    async def configure_placement(
        self, *, enabled: bool, max_tasks: int, owner: str, timeout: float | None = None
    ) -> dict[str, Any] | None:
        """Install, retune or (``enabled`` false) remove graph-aware placement in the scheduler
        (:mod:`memops.scheduler.placement`); its figures, as plain numbers (None when none is
        installed). Placement that another ``owner`` installed is left alone; the figures then say
        whose it is. Raises :class:`SchedulerRefused` when the scheduler does not run the agent."""
        address = self.address
        async with self._using(changes=True) as comm, asyncio.timeout(self.timeout if timeout is None else timeout):
            figures = await _agent(
                comm, "placement", install=enabled, enabled=enabled, max_tasks=int(max_tasks), owner=owner
            )
        if not figures:
            return None
        if not isinstance(figures, Mapping):
            raise SchedulerMisbehaved(
                address, f"the agent's placement figures are a {type(figures).__name__}, not a map"
            )
        try:
            left = figures.get("graphs_left") or {}
            plain: dict[str, Any] = {
                "graphsPlaced": int(figures["graphs_placed"]),
                # Reasons are the agent's own few words; a peer's map is cut to a few short entries.
                "graphsLeft": {str(k)[:40]: int(v) for k, v in list(dict(left).items())[:8]},
                "groups": int(figures["groups"]),
                "tasksPlaced": int(figures["tasks_placed"]),
                "rehomed": int(figures["rehomed"]),
                "seconds": float(figures["seconds"]),
                "longest": float(figures["longest"]),
                "owner": str(figures.get("owner", ""))[:256],
            }
        except (KeyError, TypeError, ValueError) as exc:
            raise SchedulerMisbehaved(address, f"the agent's placement figures are malformed: {exc}") from exc
        return plain

    async def configure_admission(
        self, *, settings: Mapping[str, Any] | None, owner: str, timeout: float | None = None
    ) -> dict[str, Any] | None:
        """Install, retune or (``settings`` None) remove task admission in the scheduler and its
        workers (:mod:`memops.scheduler.admission`); its figures, bounded and plain (None when none
        is installed). Admission that another ``owner`` installed is left alone; the figures then
        say whose it is. Raises :class:`SchedulerRefused` when the scheduler does not run the agent."""
        address = self.address
        async with self._using(changes=True) as comm, asyncio.timeout(self.timeout if timeout is None else timeout):
            figures = await _agent(
                comm, "admission", install=settings is not None, settings=dict(settings or {}), owner=owner
            )
        if not figures:
            return None
        if not isinstance(figures, Mapping):
            raise SchedulerMisbehaved(
                address, f"the agent's admission figures are a {type(figures).__name__}, not a map"
            )
        try:
            return _plain_admission(figures)
        except (KeyError, TypeError, ValueError) as exc:
            raise SchedulerMisbehaved(address, f"the agent's admission figures are malformed: {exc}") from exc

    async def configure_replication(
        self,
        *,
        rules: Mapping[str, Any] | None,
        places: Mapping[str, tuple[str, str]],
        owner: str,
        timeout: float | None = None,
    ) -> dict[str, Any] | None:
        """Install, retune or (``rules=None``) remove replication targets in the scheduler; its figures.

        Through the agent's ``replication`` operation (:mod:`memops.scheduler.replication`), in
        plain data: the rules (pod rules already turned into worker addresses) and each worker's
        ``(node, zone)``. Replication that another ``owner`` installed is left alone; the figures
        then say whose it is. Returns None when none is installed. Raises :class:`SchedulerRefused`
        when the scheduler does not run the agent, or refuses a rule (the message names its field).
        """
        address = self.address
        async with self._using(changes=True) as comm, asyncio.timeout(self.timeout if timeout is None else timeout):
            figures = await _agent(
                comm,
                "replication",
                install=rules is not None,
                rules=None if rules is None else dict(rules),
                places={a: list(p) for a, p in places.items()},
                owner=owner,
            )
        if figures is None:
            return None
        if not isinstance(figures, Mapping):
            raise SchedulerMisbehaved(
                address, f"the agent's replication figures are a {type(figures).__name__}, not a map"
            )
        if not figures:
            return None
        try:
            # Plain numbers, and per worker a short list of them: anything else is refused here, so
            # that the policy pass never meets it.
            plain: dict[str, Any] = {
                str(k): float(v) if k == "seconds" else int(v)
                for k, v in figures.items()
                if k not in ("owner", "workers")
            }
            plain["owner"] = str(figures.get("owner", ""))
            rows = _mapping(address, figures.get("workers", {}), "the agent's replication figures' workers")
            plain["workers"] = {str(a): [int(x) for x in list(row)[:4]] for a, row in rows.items()}
        except (TypeError, ValueError) as exc:
            raise SchedulerMisbehaved(address, "the agent's replication figures are not plain numbers") from exc
        return plain

    async def start_drain(
        self,
        worker_addresses: Sequence[str] = (),
        *,
        names: Sequence[str] = (),
        deadline: float,
        nodes: Mapping[str, str] | None = None,
        nodes_dying: bool = True,
        close_workers: bool = True,
        restore: bool = False,
        window: int = drain.WINDOW_BYTES,
        origin: str = "",
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """Start memops' drain with a deadline (:mod:`memops.scheduler.drain`) of these workers; returns
        at once with each one's :meth:`drain_status`. Raises :class:`SchedulerRefused` when the
        scheduler does not run memops' agent.

        ``nodes`` adds to what the agent knows of where the workers run, which it keeps while they
        are connected: what earlier callers said, and what each MemoryPolicy pass tells it
        (:meth:`snapshot`'s ``nodes``). ``nodes_dying`` (the default: a preStop hook, a node drain)
        keeps recipients off the drained workers' nodes as the agent knows them, so it matters even
        to a caller that names no node; an ordinary retirement passes False."""
        async with self._using(changes=True) as comm, asyncio.timeout(self.timeout if timeout is None else timeout):
            state = await _agent(
                comm,
                "drain",
                workers=list(worker_addresses),
                names=list(names),
                deadline=float(deadline),
                nodes=dict(nodes or {}),
                nodes_dying=nodes_dying,
                close_workers=close_workers,
                restore=restore,
                window=window,
                origin=origin,
            )
        return dict(_mapping(self.address, state, "the agent's drain state"))

    async def resize_worker(
        self, worker_address: str, *, memory_limit: int, maximum: int, timeout: float | None = None
    ) -> dict[str, Any]:
        """Tell Dask a worker's new memory limit (bytes, at most ``maximum``), once its pod has it:
        the agent's ``resize`` (:mod:`memops.scheduler.worker_limits`) sets its nanny's, its worker's and
        the scheduler's copies. The reply's ``applied`` lists the parts that hold it, ``refused``
        says why the next did not (None when all did). It talks to the worker and its nanny: give
        ``timeout`` room for two calls of :data:`memops.scheduler.worker_limits.CALL_SECONDS`."""
        async with self._using(changes=True) as comm, asyncio.timeout(self.timeout if timeout is None else timeout):
            state = await _agent(
                comm, "resize", worker=str(worker_address), memory_limit=int(memory_limit), maximum=int(maximum)
            )
        return dict(_mapping(self.address, state, "the agent's resize reply"))

    async def install_links(self, *, report: bool = True, timeout: float | None = None) -> dict[str, Any]:
        """Install the plugin that fetches spilled keys from same-node peers by hardlink and reads
        them back as maps (:mod:`memops.worker.links`), on every worker present and future; with
        ``report``, each worker's: ``status`` ``Active``, or ``Refused`` with its ``reason``
        (one call to each worker), else ``{}``."""
        async with self._using(changes=True) as comm, asyncio.timeout(self.timeout if timeout is None else timeout):
            state = await _agent(comm, "links", install=True, report=report)
        return dict(_mapping(self.address, state, "the agent's links reply"))

    async def spill_shares(self, *, timeout: float | None = None) -> dict[str, Any]:
        """Each worker's spilled bytes, each inode once, and its share of its node's spill."""
        async with self._using(changes=True) as comm, asyncio.timeout(self.timeout if timeout is None else timeout):
            state = await _agent(comm, "spill")
        return dict(_mapping(self.address, state, "the agent's spill reply"))

    async def drain_status(
        self, worker_addresses: Sequence[str] = (), *, timeout: float | None = None
    ) -> dict[str, Any]:
        """Each drained worker's state and figures (all of them without ``worker_addresses``)."""
        async with self._using(changes=True) as comm, asyncio.timeout(self.timeout if timeout is None else timeout):
            state = await _agent(comm, "drain_status", workers=list(worker_addresses))
        return dict(_mapping(self.address, state, "the agent's drain status"))

    async def statuses(self, *, timeout: float | None = None) -> dict[str, str]:
        """Address -> status of every connected worker."""
        async with self._using() as comm, asyncio.timeout(self.timeout if timeout is None else timeout):
            return await _statuses(comm)

    async def retire_workers(
        self,
        worker_addresses: Sequence[str],
        *,
        timeout: float,
        nodes: Mapping[str, str] | None = None,
        nodes_dying: bool = True,
        memops_drain: bool = True,
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

        Where the scheduler runs memops' agent, workers that are running or paused are drained by
        memops' drain (:mod:`memops.scheduler.drain`: each key moved once, the keys worth most first,
        recipients spread and, with ``nodes`` (worker address -> node) and ``nodes_dying``, off the
        drained workers' nodes; without ``nodes_dying``, spilled keys to a neighbour on the same node
        by link where the spill filesystem is shared) with ``timeout`` as its deadline: at it the
        drain stops and sets them back to the status they had (``lost_at_deadline`` says what each
        still held alone), so nothing goes on draining them after we stop waiting. Elsewhere (or
        with ``memops_drain=False``) stock ``retire_workers`` does it, as follows.

        Its timed-out path reads the statuses on a new connection, vouched for again (no news,
        and nothing claimed, if it is not). Raises :class:`SchedulerUnreachable` when the
        scheduler does not answer.
        """
        return await _retire_workers(
            self,
            worker_addresses,
            timeout=timeout,
            nodes=nodes,
            nodes_dying=nodes_dying,
            memops_drain=memops_drain,
        )


@contextlib.asynccontextmanager
async def vetted(
    address: str, *, vouch: Vouch, security: Security | None = None, timeout: float = 10
) -> AsyncIterator[Scheduler]:
    """The scheduler at ``address``, once ``vouch`` vouched for the workers of its ``identity`` on
    the connection that everything else then goes over (:class:`Scheduler`). Raises
    :class:`Unvouched` when it does not (nothing else was sent), :class:`SchedulerUnreachable` or
    :class:`SchedulerMisbehaved`, and whatever ``vouch`` raises, as it is."""
    scheduler = Scheduler(address, security=security, timeout=timeout, vouch=vouch)
    try:
        await scheduler._open()
        yield scheduler
    finally:
        await scheduler.close()


def _identified(
    address: str, identity: Mapping[Any, Any], figures: _Figures, running: Mapping[Any, Any], *, keys: bool
) -> tuple[snapshots.WorkerInfo, ...]:
    """The workers of ``identity``, with ``figures`` and ``running``; a reply of the wrong shape
    raises :class:`SchedulerMisbehaved`."""
    try:
        return tuple(
            _workers(_mapping(address, identity.get("workers", {}), "identity's workers"), figures, running, keys)
        )
    except (TypeError, ValueError, AttributeError) as exc:
        logger.info("the Dask scheduler at %s sent a reply of the wrong shape: %s", address, _detail(exc))
        raise SchedulerMisbehaved(address, exc) from exc


def _departures(address: str, state: Any) -> list[Any]:
    """The agent's ``departures`` reply: a list, at most :data:`memops.scheduler.departures.KEPT`
    long (the latest kept). Its entries are hostile input still, each checked where it is read
    (:func:`memops.decisions.worker_loss_decisions.parse`)."""
    if not isinstance(state, (list, tuple)):
        raise SchedulerMisbehaved(address, f"the agent's departures are a {type(state).__name__}, not a list")
    return list(state)[-departures.KEPT :]


def _drains(address: str, state: Any) -> dict[str, Any]:
    """The agent's ``drain_status`` reply: a map by worker address. Its entries are hostile
    input still, each checked where it is read (:func:`memops.decisions.safetynet.hook_losses`)."""
    return {str(a): figures for a, figures in _mapping(address, state, "the agent's drain status").items()}


_Figures = dict[str, tuple[int, ...]]


def _from_summary(summary: Mapping[Any, Any]) -> tuple[_Figures, dict[Hashable, tuple[str, ...]], dict[Hashable, int]]:
    """The agent's holdings reply as (figures, who_has, nbytes)."""
    figures = {str(a): tuple(int(x) for x in h) for a, h in summary["holdings"].items()}
    placement = summary["placement"].items()
    who_has = {k: tuple(str(h) for h in holders) for k, (_, holders) in placement}
    nbytes = {k: int(size) for k, (size, _) in placement}
    return figures, who_has, nbytes


def _from_who_has(
    who_has_raw: Mapping[Any, Any], nbytes_raw: Mapping[Any, Any]
) -> tuple[_Figures, dict[Hashable, tuple[str, ...]], dict[Hashable, int]]:
    """``who_has`` and ``nbytes`` of every key as (figures, who_has, nbytes); cost grows with the keys."""
    who_has = {k: tuple(str(h) for h in v) for k, v in who_has_raw.items()}
    nbytes = {k: int(v) for k, v in nbytes_raw.items()}
    return dict(snapshots.holdings(who_has, nbytes)), who_has, nbytes


def _workers(
    identities: Mapping[Any, Any], figures: _Figures, running: Mapping[Any, Any], keys: bool
) -> list[snapshots.WorkerInfo]:
    workers = []
    for worker_address, info in identities.items():
        metrics = info.get("metrics", {})
        spilled = metrics.get("spilled_bytes") or {}
        # As the scheduler computes WorkerState.memory.unmanaged: the process' memory minus the
        # Dask data it holds in memory (what it spilled counts in managed_bytes but not in RSS).
        in_memory = int(metrics.get("managed_bytes", 0)) - int(spilled.get("memory", 0))
        held_bytes, held_keys, unique_bytes, unique_keys = figures.get(worker_address, (0, 0, 0, 0))
        workers.append(
            snapshots.WorkerInfo(
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
                in_shuffle=snapshots.in_shuffle([str(k) for k in running.get(worker_address, ())]),
            )
        )
    return workers


LEAVING = frozenset({"closing_gracefully", "closing", "closed"})
"""Worker statuses meaning that something already retires or closes the worker."""

POLL_SECONDS = 0.5


async def _statuses(comm: daskcomm.Comm) -> dict[str, str]:
    """Address -> status of every connected worker."""
    identity = await comm.call("identity", limit=daskcomm.WORKERS)
    workers = identity.get("workers", {}) if isinstance(identity, Mapping) else None
    if not isinstance(workers, Mapping):
        raise daskcomm.Misbehaved(f"identity is not a map of workers: {type(identity).__name__}")
    return {
        str(address): str(info.get("status", "")) if isinstance(info, Mapping) else ""
        for address, info in workers.items()
    }


FINISHED = {drain.State.DONE, drain.State.GONE}
"""Drain states of a worker that has left: retired."""
STOPPED = {drain.State.DEADLINE, drain.State.NO_RECIPIENTS}
"""Drain states of a worker that stays, set back to the status it had: not retired."""


async def _drain_by_memops(
    comm: daskcomm.Comm, fresh: Sequence[str], deadline: float, nodes: Mapping[str, str], nodes_dying: bool
) -> tuple[set[str], set[str], dict[str, tuple[int, int]], dict[str, tuple[int, int]]] | None:
    """Drain ``fresh`` with memops' drain, polling until each has left or stopped; None when the
    scheduler does not run memops' agent (the caller then uses stock ``retire_workers``).
    (retired, stopped, lost at the deadline, linked): the last two by address, (keys, bytes).

    The drain's deadline is the caller's: at it the drain stops asking for copies and sets the
    workers back to the status they had, so that no worker is left ``closing_gracefully`` with
    nothing draining it (stock ``retire_workers`` cannot be stopped)."""
    remaining = deadline - time.monotonic()
    # The drain stops a little before the caller stops waiting, so that its report is read.
    seconds = max(remaining - min(1.0, remaining / 10), 0.0)
    try:
        await _agent(
            comm,
            "drain",
            workers=list(fresh),
            deadline=seconds,
            nodes=dict(nodes),
            nodes_dying=nodes_dying,
            close_workers=True,
            restore=True,
        )
    except SchedulerRefused as exc:
        logger.info("retiring with the scheduler's retire_workers instead of memops' drain: %s", exc)
        return None
    retired: set[str] = set()
    stopped: set[str] = set()
    lost: dict[str, tuple[int, int]] = {}
    linked: dict[str, tuple[int, int]] = {}
    while True:
        state = _mapping(comm.address, await _agent(comm, "drain_status", workers=list(fresh)), "drain status")
        for worker in fresh:
            entry = state.get(worker)
            if not isinstance(entry, Mapping):
                retired.add(worker)  # not drained by memops: it left before the drain began
                continue
            if counts.or_zero(entry.get("keysLinked")):
                linked[worker] = (counts.or_zero(entry.get("keysLinked")), counts.or_zero(entry.get("bytesLinked")))
            if entry.get("state") in FINISHED:
                retired.add(worker)
            elif entry.get("state") in STOPPED:
                stopped.add(worker)
                figures = entry.get("lostAtDeadline")
                if entry.get("state") == drain.State.DEADLINE and isinstance(figures, Mapping):
                    lost[worker] = (int(figures.get("keys", 0)), int(figures.get("bytes", 0)))
        if retired | stopped >= set(fresh):
            return retired, stopped, lost, linked
        await asyncio.sleep(POLL_SECONDS / 5)


def connect_timeout(timeout: float) -> float:
    """The timeout of connecting, and of reading the workers' statuses, for a retirement that waits
    ``timeout`` (1 to 10 s): a scheduler that does not answer must not read as a drain too slow."""
    return min(max(timeout, 1.0), 10.0)


async def _retire_workers(
    scheduler: Scheduler,
    worker_addresses: Sequence[str],
    *,
    timeout: float,
    nodes: Mapping[str, str] | None,
    nodes_dying: bool,
    memops_drain: bool,
) -> RetireOutcome:
    start = time.monotonic()
    lost: dict[str, tuple[int, int]] = {}
    linked: dict[str, tuple[int, int]] = {}
    by_memops = False
    wanted = list(dict.fromkeys(worker_addresses))
    if not wanted:
        return RetireOutcome((), (), False, 0.0)
    within = connect_timeout(timeout)
    retired: set[str] = set()
    not_retired: set[str] = set()
    timed_out = False
    # Connected first, with its own timeout: "unreachable" must not read as "drain too slow".
    statuses = await scheduler.statuses(timeout=within)
    async with scheduler._using(changes=True) as comm:
        absent = tuple(a for a in wanted if a not in statuses)
        leaving = [a for a in wanted if statuses.get(a) in LEAVING]
        fresh = [a for a in wanted if a in statuses and a not in leaving]
        deadline = start + timeout

        async def retire_fresh() -> None:
            nonlocal by_memops
            drained = await _drain_by_memops(comm, fresh, deadline, nodes or {}, nodes_dying) if memops_drain else None
            if drained is not None:
                by_memops = True
                retired.update(drained[0])
                not_retired.update(drained[1])
                lost.update(drained[2])
                linked.update(drained[3])
                if drained[2]:
                    raise TimeoutError  # stopped at its deadline: the caller's timeout, reached
                return
            result = await comm.call(
                "retire_workers",
                workers=fresh,
                close_workers=True,
                remove=True,
                stimulus_id=f"memops-retire-{time.time()}",
                limit=daskcomm.WORKERS,
            )
            if not isinstance(result, Mapping):
                raise daskcomm.Misbehaved(f"retire_workers answered a {type(result).__name__}, not a map")
            retired.update(a for a in fresh if a in result)
            not_retired.update(a for a in fresh if a not in result)

        async def await_leaving() -> None:
            pending = set(leaving)
            while pending:
                await asyncio.sleep(POLL_SECONDS)
                now = await _statuses(comm)
                retired.update(a for a in pending if a not in now)
                not_retired.update(a for a in pending if a in now and now[a] not in LEAVING)
                pending -= retired | not_retired

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
    if timed_out:
        # On a new connection, vouched for again before anything it says is trusted: the one
        # above may be in the middle of a reply that never came. One that shows none of the
        # workers, or only some vouched for above, is the same scheduler after they left.
        await scheduler.close()
        try:
            now = await scheduler.statuses(timeout=within)
        except SchedulerMisbehaved:
            raise
        except (SchedulerUnreachable, Unvouched):
            now = dict.fromkeys(wanted, "")  # no news: claim nothing
        retired.update(a for a in wanted if a not in now and a not in absent)
    return RetireOutcome(
        retired=tuple(a for a in wanted if a in retired),
        not_retired=tuple(a for a in wanted if a not in retired and a not in absent),
        timed_out=timed_out,
        seconds=time.monotonic() - start,
        absent=absent,
        lost_at_deadline=lost,
        by_memops=by_memops,
        linked=linked,
    )


class SchedulerRefused(Exception):
    """The scheduler answered, with an error (for example, it does not accept pickled code)."""


@functools.cache
def agent_payload() -> bytes:
    """memops' agent and the modules it takes, pickled by value: once per process, as they never
    change while it runs (half a megabyte, and several to make)."""
    payload: bytes = dumps(agent.install)
    return payload


async def _install_agent(comm: daskcomm.Comm) -> None:
    """Send memops' agent to the scheduler by value (``run_function``) and run its ``install``.

    ``run_function``'s ``result`` is pickled by design: only the reply's plain ``status`` is
    read, and the rest is never decoded. Raises :class:`SchedulerRefused` when the scheduler
    does not run it (``run_function`` in ``distributed.scheduler.blocked-handlers``) or the
    installation raised there.
    """
    try:
        reply = await comm.call("run_function", allow_opaque=True, function=agent_payload())
    except daskcomm.RemoteError as exc:
        raise SchedulerRefused(f"the scheduler refused run_function: {exc}") from exc
    if not isinstance(reply, Mapping):
        raise daskcomm.Misbehaved(f"run_function answered a {type(reply).__name__}, not a map")
    if reply.get("status") != "OK":
        text = daskcomm.error_text(dict(reply))
        raise SchedulerRefused(f"run_function of memops' agent: {reply.get('status')!r}: {text}")


_AGENT_CHECKED: weakref.WeakSet[daskcomm.Comm] = weakref.WeakSet()
"""Connections on which :func:`_agent` has made sure of the agent (asked once per connection)."""


def _installed_version(events: Any) -> int | None:
    """The agent's version from the scheduler's events of :data:`memops.scheduler.agent.EVENTS`
    (``[[time, message], ...]``, oldest first): the last install's, None if there was none.

    Raises :class:`daskcomm.Misbehaved` for a reply that no scheduler sends."""
    if not isinstance(events, (list, tuple)):
        raise daskcomm.Misbehaved(f"events answered a {type(events).__name__}, not a list")
    for event in reversed(events):
        message = event[1] if isinstance(event, (list, tuple)) and len(event) == 2 else None
        version = message.get("agent") if isinstance(message, Mapping) else None
        if isinstance(version, int) and not isinstance(version, bool):
            return version
    return None


async def _agent_installed(comm: daskcomm.Comm) -> int | None:
    """Which version of memops' agent the scheduler runs (None: none), asked without calling it.

    From the marker that :func:`memops.scheduler.agent.install` logs in the scheduler's event log,
    read with the stock ``events`` handler, which logs nothing: calling the agent's handler where
    it is missing would make the scheduler log a warning with a traceback, at every new scheduler.
    Raises :class:`daskcomm.RemoteError` where ``events`` is refused (a blocked handler)."""
    return _installed_version(await comm.call("events", topic=agent.EVENTS))


async def _agent(
    comm: daskcomm.Comm,
    operation: str,
    *,
    install: bool = True,
    limit: daskcomm.Limit = daskcomm.WORKERS,
    **arguments: Any,
) -> Any:
    """One operation of memops' agent (:mod:`memops.scheduler.agent`): its plain ``result``.

    A scheduler without the agent, or with another version of it, gets this one installed first
    (:func:`_agent_installed` tells, once per connection); with ``install=False`` the answer is
    then None. Should the handler still be missing (its reply to an unknown handler is None) or
    be of another version, this one is installed and the operation tried once more.
    """
    if comm not in _AGENT_CHECKED:
        try:
            installed: int | None = await _agent_installed(comm)
        except daskcomm.RemoteError:
            installed = agent.VERSION  # no marker to read: the reply below tells instead
        if installed != agent.VERSION:
            if not install:
                return None
            await _install_agent(comm)
        _AGENT_CHECKED.add(comm)
    for attempt in range(2):
        try:
            reply = await comm.call(agent.NAME, operation=operation, limit=limit, **arguments)
        except daskcomm.RemoteError as exc:
            raise SchedulerRefused(f"memops' agent refused {operation}: {exc}") from exc
        if isinstance(reply, Mapping) and reply.get("agent") == agent.VERSION:
            if "error" in reply and not attempt and install and str(reply["error"]).startswith("unknown operation"):
                # An agent of this version from before the operation was added: install this one.
                await _install_agent(comm)
                continue
            if "error" in reply:
                raise SchedulerRefused(f"memops' agent refused {operation}: {reply['error']}")
            return reply.get("result")
        if attempt or not (reply is None or (isinstance(reply, Mapping) and "agent" in reply)):
            raise daskcomm.Misbehaved(f"memops' agent answered {operation} with a {type(reply).__name__}")
        if not install:
            return None
        await _install_agent(comm)


_ADMISSION_COUNTS = ("tasksAdmitted", "tasksProbed", "preempted", "waiting", "demandTasks", "demandBytes", "profiled")


def _plain_admission(figures: Mapping[str, Any]) -> dict[str, Any]:
    """The agent's admission figures as the status shows them: numbers, and at most
    :data:`~memops.scheduler.admission.TOP` prefixes of bounded length (a tenant's scheduler is a peer)."""
    plain: dict[str, Any] = {name: int(figures[name]) for name in _ADMISSION_COUNTS}
    top = []
    for entry in list(figures.get("top") or ())[: admission.TOP]:
        prefix, peak, seen = entry
        top.append(
            {
                "prefix": str(prefix)[: worker_admission.MAX_PREFIX_CHARS],
                "peakBytes": int(peak),
                "observations": int(seen),
            }
        )
    plain["top"] = top
    plain["owner"] = str(figures.get("owner", ""))[:256]
    return plain
