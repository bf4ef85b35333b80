"""A TCP forwarder on loopback that sends each connection where its owner says: the first to one
scheduler, the later ones to another. What an ExternalName Service or a DNS name that a tenant
switches does, and what a tenant's own TCP proxy at one fixed IP can do (so pinning the address'
IP would not help): one address, a different scheduler behind each connection.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence


class Forwarder:
    """Connection ``i`` goes to ``targets[i]``, and every one after the last to the last target."""

    def __init__(self, targets: Sequence[str]):
        self.targets = [_host_port(t) for t in targets]
        self.routed: list[str] = []  # where each connection went, in order ("host:port")
        self.address = ""
        self._tasks: set[asyncio.Task[None]] = set()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host, port = self.targets[min(len(self.routed), len(self.targets) - 1)]
        self.routed.append(f"{host}:{port}")
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
        server = await asyncio.start_server(self._track, "127.0.0.1", 0)
        self.address = f"tcp://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        try:
            yield self
        finally:
            server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await server.wait_closed()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError):
        while chunk := await reader.read(65536):
            writer.write(chunk)
            await writer.drain()


def _host_port(address: str) -> tuple[str, int]:
    host, port = address.split("://", 1)[-1].rsplit(":", 1)
    return host, int(port)
