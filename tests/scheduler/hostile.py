"""A hostile "scheduler" on loopback: what anyone who may write ``spec.scheduler.address`` can run.

Routes (what it answers to ``identity``, the first call every memops client makes):

- ``serialized``: a ``to_serialize``-wrapped object, as a real distributed ``Server`` sends it
  (pickled, in a ``__Serialized__`` part); unpickling it creates the marker file;
- ``error``: ``{"status": "uncaught-error", "exception": <pickle bytes>}``, which distributed's
  ``clean_exception`` unpickles whatever the deserializers; unpickling creates the marker file;
- ``huge-gib``, ``huge-tib``: an 8-byte length header declaring a 1 GiB or 1 TiB message, then
  nothing (a raw server: no Dask server sends that);
- ``huge-frame``: a small first block whose prelude declares a second frame of 1 TiB.

The first two are a real distributed ``Server`` with one handler; nothing of Dask is mocked.

:func:`bombing` serves replies that stay under a size limit and still cost what a process has:
a msgpack array of empty maps (1 byte each on the wire, about 70 in Python) or a prelude of
one-byte frames, as the answer to one chosen operation; the others get what a scheduler without
memops' agent and with ``run_function`` blocked answers. :func:`not_a_scheduler` serves what
else may listen at an address: a silent port, one that speaks garbage, an HTTP server.
"""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import socket
import struct
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import msgpack
from distributed.core import Server
from distributed.protocol import to_serialize

from memops.scheduler import agent

ROUTES = ("serialized", "error", "huge-gib", "huge-tib", "huge-frame")
MiB, GiB = 2**20, 2**30


class Marker:
    """Creates its file when unpickled: the proof that a peer's pickle ran."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.path,))


def _frame(message: Any) -> bytes:
    payload = msgpack.packb(message, use_bin_type=True)
    prelude = struct.pack("QQ", 1, len(payload))
    return struct.pack("Q", len(prelude) + len(payload)) + prelude + payload


async def _raw(route: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answer the handshake as a scheduler does, then declare an enormous reply and stall."""
    handshake = {"compression": None, "python": (3, 11, 0), "pickle-protocol": 5}
    try:
        (size,) = struct.unpack("Q", await reader.readexactly(8))
        await reader.readexactly(size)
        writer.write(_frame(handshake))
        (size,) = struct.unpack("Q", await reader.readexactly(8))
        await reader.readexactly(size)
        if route == "huge-frame":
            payload = msgpack.packb({"op": "x"}, use_bin_type=True)
            prelude = struct.pack("QQQ", 2, len(payload), 2**40)
            writer.write(struct.pack("Q", len(prelude) + len(payload)) + prelude + payload)
        else:
            writer.write(struct.pack("Q", GiB if route == "huge-gib" else 2**40))
        await writer.drain()
        await reader.read()  # hold the connection open until the client gives up
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


@contextlib.asynccontextmanager
async def serving(route: str, marker: Path, host: str = "127.0.0.1") -> AsyncIterator[str]:
    """The hostile scheduler's address, on ``host``, while the block runs."""
    assert route in ROUTES, route
    if route.startswith("huge"):
        raw = await asyncio.start_server(lambda r, w: _raw(route, r, w), host, 0)
        try:
            yield f"tcp://{host}:{raw.sockets[0].getsockname()[1]}"
        finally:
            raw.close()
        return

    def identity(**_: Any) -> Any:
        if route == "serialized":
            return to_serialize(Marker(marker))
        return {"status": "uncaught-error", "exception": pickle.dumps(Marker(marker)), "traceback": None}

    server = Server({"identity": identity})
    await server.listen(f"tcp://{host}:0")
    try:
        yield server.address
    finally:
        await server.close()


@contextlib.contextmanager
def in_thread(route: str, marker: Path, host: str = "127.0.0.1") -> Iterator[str]:
    """:func:`serving` on its own event loop in a thread, for tests that are not async."""
    ready: list[str] = []
    started = threading.Event()
    stop: list[asyncio.Event] = []

    async def main() -> None:
        stop.append(asyncio.Event())
        async with serving(route, marker, host) as address:
            ready.append(address)
            started.set()
            await stop[0].wait()

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert started.wait(30), "the hostile scheduler did not start"
    try:
        yield ready[0]
    finally:
        loop.call_soon_threadsafe(stop[0].set)
        thread.join(30)
        loop.close()


BOMBS = ("maps", "rows", "frames", "nested")
"""What a bomb is made of: empty maps in one array, empty maps in rows of 1,000 (each array
short), one-byte frames, or arrays nested 1,000 deep that each declare ``items`` entries (which
msgpack allocates as the header arrives), then nils."""
_ROW = b"\xdc" + struct.pack(">H", 1000) + b"\x80" * 1000
CHUNK = 2**20


def bomb_chunks(kind: str, size: int, items: int = 1024) -> Iterator[bytes]:
    """A message of ``size`` bytes after its 8-byte length header, made of ``kind``; in chunks,
    so that the server never holds it whole."""
    if kind == "nested":
        headers = (b"\xdd" + struct.pack(">I", items)) * 1000
        yield struct.pack("QQQ", size, 1, size - 16) + headers
        left = size - 16 - len(headers)
        while left > 0:
            yield b"\xc0" * min(CHUNK, left)
            left -= CHUNK
        return
    if kind == "rows":  # [[row, row, ... up to 1,000 rows], ...]
        rows = (size - 16 - 5) // len(_ROW)
        per_group = min(1000, rows)
        groups = rows // per_group
        payload = 5 + groups * (3 + per_group * len(_ROW))
        yield struct.pack("QQQ", 16 + payload, 1, payload) + b"\xdd" + struct.pack(">I", groups)
        for _ in range(groups):
            yield b"\xdc" + struct.pack(">H", per_group)
            for start in range(0, per_group, 500):
                yield _ROW * min(500, per_group - start)
        return
    if kind == "maps":
        payload = size - 16  # the prelude: one frame, its length
        yield struct.pack("QQQ", size, 1, payload) + b"\xdd" + struct.pack(">I", payload - 5)
        left = payload - 5
    else:
        count = (size - 8) // 9  # a length of 8 bytes and a frame of 1 byte each
        yield struct.pack("QQ", 8 + 9 * count, count)
        for start in range(0, count, CHUNK // 8):
            yield struct.pack("Q", 1) * min(CHUNK // 8, count - start)
        left = count
    while left > 0:  # one-byte frames, or empty maps (0x80 is both)
        yield b"\x80" * min(CHUNK, left)
        left -= CHUNK


IDENTITY = {
    "type": "Scheduler",
    "id": "Scheduler-hostile",
    "address": "tcp://127.0.0.1:1",
    "workers": {
        "tcp://127.0.0.1:2": {"name": "worker-0", "memory_limit": 2**30, "status": "running", "metrics": {}},
    },
}


async def _bomber(
    op: str, kind: str, size: int, items: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    """Speak the comm as a scheduler does; answer ``op`` with the bomb."""
    handshake = {"compression": None, "python": (3, 11, 0), "pickle-protocol": 5}
    try:
        (length,) = struct.unpack("Q", await reader.readexactly(8))
        await reader.readexactly(length)
        writer.write(_frame(handshake))
        while True:
            (length,) = struct.unpack("Q", await reader.readexactly(8))
            block = await reader.readexactly(length)
            request = msgpack.unpackb(block[16:], raw=False, strict_map_key=False)
            asked = request.get("op")
            if asked == "close":
                break
            if asked == op:
                for chunk in bomb_chunks(kind, size, items):
                    writer.write(chunk)
                    await writer.drain()
                continue
            if asked == "identity":
                answer: Any = IDENTITY
            elif asked in ("processing", "nbytes", "who_has"):
                answer = {}
            elif asked == "events":  # the agent's install marker: its handler is asked at once
                answer = [[0.0, {"action": "installed", "agent": agent.VERSION}]]
            elif asked == "run_function":  # as a scheduler that blocks it
                answer = {"status": "uncaught-error", "exception_text": "run_function is blocked", "text": ""}
            else:  # memops_agent, on a scheduler without memops' agent: an unknown handler
                answer = None
            writer.write(_frame(answer))
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


@contextlib.asynccontextmanager
async def bombing(op: str, kind: str, size: int, items: int = 1024) -> AsyncIterator[str]:
    """A "scheduler" that answers ``op`` with a bomb of ``kind`` whose message is ``size`` bytes."""
    assert kind in BOMBS, kind
    server = await asyncio.start_server(lambda r, w: _bomber(op, kind, size, items, r, w), "127.0.0.1", 0)
    try:
        yield f"tcp://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


PEERS = ("refused", "silent", "garbage", "http")
"""What may listen at an address that is not a Dask scheduler's: nothing, a port that accepts
and never answers, one that answers garbage (an SSH banner), an HTTP server."""
BANNER = b"SSH-2.0-OpenSSH_9.2p1 Debian-2+deb12u3 4242\r\n"


async def _silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.read()  # until the client gives up
    writer.close()


async def _garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(BANNER)
    await writer.drain()
    await reader.read()
    writer.close()


async def _http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """As an HTTP server answers a request line it cannot parse."""
    await reader.read(1)
    body = b"<html><title>400 Bad Request</title><center>nginx/1.25.3</center></html>"
    writer.write(
        b"HTTP/1.1 400 Bad Request\r\nServer: nginx/1.25.3\r\nContent-Type: text/html\r\n"
        + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
        + body
    )
    await writer.drain()
    writer.close()


@contextlib.asynccontextmanager
async def not_a_scheduler(peer: str) -> AsyncIterator[str]:
    """The address of a ``peer`` of :data:`PEERS` while the block runs."""
    if peer == "refused":
        with socket.socket() as sock:  # a port that nobody listens on
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        yield f"tcp://127.0.0.1:{port}"
        return
    serve = {"silent": _silent, "garbage": _garbage, "http": _http}[peer]
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"tcp://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


@contextlib.asynccontextmanager
async def raising(text: str) -> AsyncIterator[str]:
    """A real distributed ``Server`` whose ``identity`` raises with ``text``: its error reply
    carries the text (``exception_text``, ``traceback_text``), as any handler's error does."""

    def identity(**_: Any) -> Any:
        raise RuntimeError(text)

    server = Server({"identity": identity})
    await server.listen("tcp://127.0.0.1:0")
    try:
        yield server.address
    finally:
        await server.close()
