"""A TCP forwarder on loopback that sends each connection where its owner says: the first to one
scheduler, the later ones to another. What an ExternalName Service or a DNS name that a tenant
switches does, and what a tenant's own TCP proxy at one fixed IP can do (so pinning the address'
IP would not help): one address, a different scheduler behind each connection.

And the two tenants' schedulers to put behind it (:func:`two_tenants`): real ``dask scheduler``
processes, each with one ``dask worker`` process that listens on and advertises its own loopback
IP, as a pod advertises its pod IP: tenant A's at :data:`A_IP`, tenant B's at :data:`B_IP`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import cloudpickle
from distributed import Client
from memops_sandbox import dask_direct

from memops.clients import daskrpc
from memops.scheduler import agent
from tests.scheduler import processes

A_IP, B_IP = "127.0.0.2", "127.0.0.3"

# What runs on the schedulers (run_on_scheduler) goes by value: they cannot import the tests.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Forwarder:
    """Connection ``i`` goes to ``targets[i]``, and every one after the last to the last target;
    each ``delay`` seconds after it was accepted (a scheduler slow to answer, as under load)."""

    def __init__(self, targets: Sequence[str], host: str = "127.0.0.1", *, delay: float = 0.0):
        self.targets = [_host_port(t) for t in targets]
        self.host = host  # where it listens
        self.delay = delay
        self.routed: list[str] = []  # where each connection went, in order ("host:port")
        self.address = ""
        self._tasks: set[asyncio.Task[None]] = set()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host, port = self.targets[min(len(self.routed), len(self.targets) - 1)]
        self.routed.append(f"{host}:{port}")
        await asyncio.sleep(self.delay)
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(host, port)
        except OSError:
            writer.close()
            return
        pipes = [
            asyncio.ensure_future(_pipe(reader, upstream_writer)),
            asyncio.ensure_future(_pipe(upstream_reader, writer)),
        ]
        try:
            await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pipe in pipes:
                pipe.cancel()
            for end in (writer, upstream_writer):
                end.close()

    def _track(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.ensure_future(self._serve(reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[Forwarder]:
        server = await asyncio.start_server(self._track, self.host, 0)
        self.address = f"tcp://{self.host}:{server.sockets[0].getsockname()[1]}"
        try:
            yield self
        finally:
            server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await server.wait_closed()


@contextlib.contextmanager
def in_thread(targets: Sequence[str], host: str = "127.0.0.1") -> Iterator[Forwarder]:
    """A :class:`Forwarder` served by an event loop of its own, in a thread: for tests that do not
    run one (the end-to-end scenarios)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="forwarder", daemon=True)
    thread.start()
    forwarder = Forwarder(targets, host)
    serving = forwarder.serving()
    asyncio.run_coroutine_threadsafe(serving.__aenter__(), loop).result(10)
    try:
        yield forwarder
    finally:
        asyncio.run_coroutine_threadsafe(serving.__aexit__(None, None, None), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError):
        while chunk := await reader.read(65536):
            writer.write(chunk)
            await writer.drain()


def _host_port(address: str) -> tuple[str, int]:
    host, port = address.split("://", 1)[-1].rsplit(":", 1)
    return host, int(port)


@dataclass(frozen=True)
class Tenants:
    a: str  # tenant A's scheduler
    a_worker: str  # its worker's address, at A_IP
    b: str  # tenant B's scheduler
    b_worker: str  # its worker's address, at B_IP


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


@contextlib.asynccontextmanager
async def two_tenants(a_worker_name: str = "a-0") -> AsyncIterator[Tenants]:
    """Two schedulers with one worker each (A's named ``a_worker_name``), until the block ends."""
    started: list[Any] = []
    try:
        addresses = []
        for name, host in ((a_worker_name, A_IP), ("b-0", B_IP)):
            port = free_port()
            address = f"tcp://127.0.0.1:{port}"
            started.append(processes.spawn_scheduler(port))
            started.append(processes.spawn(address, name, host=host))
            addresses.append(address)
        for address in addresses:

            async def count(address: str = address) -> int:
                with contextlib.suppress(daskrpc.SchedulerUnreachable):
                    return await dask_direct.ping(address, timeout=2)
                return 0

            await processes.wait_for_workers(count, 1)
        [a_worker] = await on_scheduler(addresses[0], workers)
        [b_worker] = await on_scheduler(addresses[1], workers)
        yield Tenants(a=addresses[0], a_worker=a_worker, b=addresses[1], b_worker=b_worker)
    finally:
        for process in reversed(started):
            processes.kill(process)


def workers(dask_scheduler: Any) -> dict[str, str]:
    """Each worker's address -> its status."""
    return {address: str(ws.status) for address, ws in dask_scheduler.workers.items()}


def memops_in(dask_scheduler: Any) -> bool:
    """Whether anything of memops reached this scheduler: its agent, or a plugin of its drains."""
    return agent.NAME in dask_scheduler.handlers or any("memops" in str(p) for p in dask_scheduler.plugins)


async def on_scheduler(address: str, function: Any) -> Any:
    async with Client(address, asynchronous=True) as dask_client:
        return await dask_client.run_on_scheduler(function)


async def assert_untouched(tenants: Tenants) -> None:
    """B's scheduler holds nothing of memops, and its worker is there and was never drained."""
    assert not await on_scheduler(tenants.b, memops_in), "memops reached tenant B's scheduler"
    assert await on_scheduler(tenants.b, workers) == {tenants.b_worker: "Status.running"}


def slow_retirement_replies(dask_scheduler: Any) -> None:
    """The scheduler retires as it does, and answers ``retire_workers`` a minute later: what a
    reply that does not come in time looks like (a slow network, a busy scheduler)."""
    retire = dask_scheduler.handlers["retire_workers"]

    async def retire_then_wait(**kwargs: Any) -> Any:
        result = await retire(**kwargs)
        await asyncio.sleep(60)
        return result

    dask_scheduler.handlers["retire_workers"] = retire_then_wait
