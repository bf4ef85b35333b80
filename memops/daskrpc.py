"""The operator's only channel to a Dask scheduler: its own comm handlers, over tcp:// or tls://.

Called by the controllers and the sandbox. Never the scheduler's HTTP API (off by default,
and unauthenticated) and never a pickled function run on the scheduler: only handlers that
every stock scheduler serves (``identity``, ``who_has``, ``nbytes``, ``retire_workers``).
No user data passes through here: ``retire_workers`` moves it worker to worker.

What the scheduler does (distributed 2026.8.0, ``Scheduler.retire_workers``): each worker
becomes ``closing_gracefully`` and gets an AMM ``RetireWorker`` policy; the call returns when
every policy is done, listing only the workers it retired. A worker whose unique data has
nowhere to go is set back to its previous status and left out. A worker that dies during
the drain counts as done, and is listed as retired. The call has no timeout and keeps running
on the scheduler after the caller stops waiting: there is no handler that cancels it.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from distributed.comm.core import CommClosedError
from distributed.core import rpc
from distributed.security import Security

from memops import planning


class SchedulerUnreachable(Exception):
    """The scheduler did not answer over the comm."""

    def __init__(self, address: str, cause: BaseException | str):
        detail = cause if isinstance(cause, str) else (f"{type(cause).__name__}: {cause}".rstrip(": ") or "no answer")
        super().__init__(f"cannot reach the Dask scheduler at {address}: {detail}")
        self.address = address


@dataclass(frozen=True)
class RetireOutcome:
    retired: tuple[str, ...]
    not_retired: tuple[str, ...]
    timed_out: bool
    seconds: float


_COMM_ERRORS = (OSError, CommClosedError, TimeoutError)


def security_from_secret(data: Mapping[str, str]) -> Security:
    """A client ``Security`` from a Kubernetes Secret's ``data`` (base64 ca.crt, tls.crt, tls.key)."""

    def pem(key: str) -> str:
        if key not in data:
            raise ValueError(f"the scheduler's TLS Secret has no {key!r}")
        return base64.b64decode(data[key]).decode()

    return Security(
        tls_ca_file=pem("ca.crt"),
        tls_client_cert=pem("tls.crt"),
        tls_client_key=pem("tls.key"),
        require_encryption=True,
    )


def _connect(address: str, security: Security | None, timeout: float) -> rpc:
    if address.startswith("tls://") and security is None:
        raise SchedulerUnreachable(address, "a tls:// scheduler needs client certificates (spec.scheduler.tls)")
    return rpc(address, timeout=timeout, connection_args=(security or Security()).get_connection_args("client"))


async def fetch_snapshot(
    address: str, *, security: Security | None = None, timeout: float = 10, keys: bool = True
) -> planning.SchedulerSnapshot:
    """The workers, who holds which key, and key sizes, from one connection.

    With ``keys=False`` only the workers and their memory: cheap whatever the number of keys.
    """
    scheduler = _connect(address, security, timeout)
    try:
        async with asyncio.timeout(timeout):
            identity = await scheduler.identity()
            who_has_raw = await scheduler.who_has() if keys else {}
            processing = await scheduler.processing() if keys else {}
            nbytes_raw = await scheduler.nbytes(summary=False) if keys else {}
    except _COMM_ERRORS as exc:
        raise SchedulerUnreachable(address, exc) from exc
    finally:
        await scheduler.close_rpc()
    who_has = {str(k): tuple(v) for k, v in who_has_raw.items()}
    nbytes = {str(k): int(v) for k, v in nbytes_raw.items()}
    unique = planning.unique_holdings(who_has, nbytes)
    held: dict[str, int] = {}
    for holders in who_has.values():
        for holder in holders:
            held[holder] = held.get(holder, 0) + 1
    workers = []
    for worker_address, info in identity.get("workers", {}).items():
        metrics = info.get("metrics", {})
        unique_bytes, unique_keys = unique.get(worker_address, (0, 0))
        workers.append(
            planning.WorkerInfo(
                name=str(info.get("name", worker_address)),
                address=worker_address,
                memory_limit=int(info.get("memory_limit") or 0),
                managed_bytes=int(metrics.get("managed_bytes", 0)),
                unique_bytes=unique_bytes,
                unique_keys=unique_keys,
                nkeys=held.get(worker_address, 0),
                status=str(info.get("status", "running")),
                process_bytes=int(metrics.get("memory", 0)),
                spilled_bytes=int((metrics.get("spilled_bytes") or {}).get("disk", 0)),
                in_shuffle=planning.in_shuffle([str(k) for k in processing.get(worker_address, ())]),
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


async def retire_workers(
    address: str, worker_addresses: Sequence[str], *, security: Security | None = None, timeout: float
) -> RetireOutcome:
    """Drain and close these workers through the scheduler's AMM; stop waiting after ``timeout``.

    Calling it again for a worker that is still being retired is safe: the scheduler adds one
    more RetireWorker policy for it, and both finish together.
    """
    start = time.monotonic()
    if not worker_addresses:
        return RetireOutcome((), (), False, 0.0)
    connect_timeout = min(max(timeout, 1.0), 10.0)
    scheduler = _connect(address, security, connect_timeout)
    try:
        # Connect first, with its own timeout: "unreachable" must not read as "drain too slow".
        await asyncio.wait_for(scheduler.identity(n_workers=0), connect_timeout)
    except _COMM_ERRORS as exc:
        await scheduler.close_rpc()
        raise SchedulerUnreachable(address, exc) from exc
    try:
        result = await asyncio.wait_for(
            scheduler.retire_workers(
                workers=list(worker_addresses),
                close_workers=True,
                remove=True,
                stimulus_id=f"memops-retire-{time.time()}",
            ),
            timeout=timeout,
        )
    except TimeoutError:
        return RetireOutcome((), tuple(worker_addresses), True, time.monotonic() - start)
    except _COMM_ERRORS as exc:
        raise SchedulerUnreachable(address, exc) from exc
    finally:
        await scheduler.close_rpc()
    retired = tuple(a for a in worker_addresses if a in result)
    not_retired = tuple(a for a in worker_addresses if a not in result)
    return RetireOutcome(retired, not_retired, False, time.monotonic() - start)
