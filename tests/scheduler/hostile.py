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
"""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import struct
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import msgpack
from distributed.core import Server
from distributed.protocol import to_serialize

ROUTES = ("serialized", "error", "huge-gib", "huge-tib", "huge-frame")
GiB = 2**30


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
async def serving(route: str, marker: Path) -> AsyncIterator[str]:
    """The hostile scheduler's address while the block runs."""
    assert route in ROUTES, route
    if route.startswith("huge"):
        raw = await asyncio.start_server(lambda r, w: _raw(route, r, w), "127.0.0.1", 0)
        try:
            yield f"tcp://127.0.0.1:{raw.sockets[0].getsockname()[1]}"
        finally:
            raw.close()
        return

    def identity(**_: Any) -> Any:
        if route == "serialized":
            return to_serialize(Marker(marker))
        return {"status": "uncaught-error", "exception": pickle.dumps(Marker(marker)), "traceback": None}

    server = Server({"identity": identity})
    await server.listen("tcp://127.0.0.1:0")
    try:
        yield server.address
    finally:
        await server.close()


@contextlib.contextmanager
def in_thread(route: str, marker: Path) -> Iterator[str]:
    """:func:`serving` on its own event loop in a thread, for tests that are not async."""
    ready: list[str] = []
    started = threading.Event()
    stop: list[asyncio.Event] = []

    async def main() -> None:
        stop.append(asyncio.Event())
        async with serving(route, marker) as address:
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
