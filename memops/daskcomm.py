"""A client for the Dask comm protocol that never unpickles and bounds what a reply may allocate.

Every address that memops talks to is written by a user (``spec.scheduler.address``), so the
peer is hostile input. distributed's own ``rpc`` is not fit for that: it accepts pickle by
default, ``clean_exception`` unpickles an error reply's ``exception`` whatever the
deserializers, a ``__Pickled__`` part is unpickled even with ``deserialize=False``, and its TCP
comm allocates whatever frame size the peer declares. This module speaks the same wire format
itself, over asyncio streams (``tcp://`` and ``tls://``), and:

- decodes only the message's first frame, with msgpack and no extension hooks: a part that
  distributed marks as serialized or pickled (``{"__Serialized__": n}``, ``{"__Pickled__": n}``)
  or as an enum (which would import a module) becomes an :class:`Opaque` placeholder, whose
  frames are never read as anything but bytes. A reply that holds one is refused
  (:class:`Misbehaved`) unless the caller asked for it (``run_function``, whose ``result`` is
  pickled by design: the caller reads only its plain ``status``);
- turns an error reply (``{"status": "uncaught-error", ...}``) into :class:`RemoteError`, whose
  message holds only the reply's plain text fields, never its ``exception`` or ``traceback``;
- refuses a reply whose declared size is above :data:`MAX_MESSAGE_BYTES` *before* reading it.

Used by :mod:`memops.daskrpc` (the operator) and, as source text, by the safety net's preStop
hook (:data:`memops.safetynet.PRE_STOP_SCRIPT`), which runs in a worker's container with only a
stock ``distributed`` installed. So this module imports only the standard library and msgpack,
nothing from memops or distributed, and keeps to what Python 3.9 has.

The wire format (distributed 2026.8.0, ``comm/tcp.py``, ``comm/utils.py``, ``protocol/core.py``,
``protocol/utils.py``), for one message:

- 8 bytes: ``N``, an unsigned 64-bit length in the machine's byte order (``struct`` "Q";
  little-endian on every platform Dask runs on);
- ``N`` bytes: the prelude, ``n`` then the ``n`` frame lengths (each "Q" again), followed by the
  first frames, as many as the sender fit into ``N``;
- the remaining frames, each read on its own, by the lengths in the prelude.

Frame 0 is the message in msgpack (binary type on, maps with any key), never compressed;
further frames belong to serialized or pickled parts, with their own sub-headers (compression
markers included), which this module never decodes. On connecting, each side first sends a
handshake message (``compression``, ``python``, ``pickle-protocol``) and reads the other's. A
request is a map with ``op``, ``reply`` and the handler's arguments; ``{"op": "close"}`` ends
the connection.
"""

from __future__ import annotations

import asyncio
import os
import ssl
import struct
import sys
import tempfile
from typing import Any

import msgpack

MAX_MESSAGE_BYTES = 64 * 2**20
"""The most that one reply may declare (its frames together); a larger one is refused unread.

Why 64 MiB: the operator runs with 512 MiB (the chart's limit) and about 120 MiB at rest, and
a decoded reply takes a few times its wire size in Python objects, so a reply much larger than
this would take the operator down whatever it says. No reply on memops' paths comes near it:
``identity`` is a few KiB a worker, the agent's holdings are four numbers a worker plus the
placement of the keys of the workers being drained, ``retire_workers`` one identity a retired
worker, ``run_function`` a pickled ``None``. The one reply that grows with every key is the
fallback's ``who_has`` (about 45 bytes a key), for schedulers that refuse ``run_function``:
above about 1.5 million keys it is refused here, with a message saying so, rather than
decoded into more memory than the operator has."""

HANDSHAKE_BYTES = 64 * 2**10
"""The peer's handshake is three small fields."""

ERROR_TEXT_CHARS = 2000
"""How much of an error reply's text an exception message carries."""

_LENGTH = struct.Struct("Q")
_PICKLE_PROTOCOL = 5


class Misbehaved(Exception):
    """The peer sent what no Dask scheduler sends to this client: refused, not decoded."""


class RemoteError(Exception):
    """The peer answered with an error (a handler that raised, or is blocked)."""


class Closed(ConnectionError):
    """The peer closed the connection before answering."""


class Opaque:
    """Where a reply held a serialized, pickled or enum part: only that it was there.

    Its frames are never decoded (they are the peer's pickle, or whatever it says they are).
    """

    __slots__ = ("marker",)

    def __init__(self, marker: str):
        self.marker = marker

    def __repr__(self) -> str:
        return f"Opaque({self.marker})"


_OPAQUE_MARKERS = ("__Serialized__", "__Pickled__", "__Enum__")


def _decode_map(obj: dict[Any, Any]) -> Any:
    for marker in _OPAQUE_MARKERS:
        if marker in obj:
            return Opaque(marker)
    if "__Set__" in obj:  # how distributed sends a set: plain data, kept as a tuple
        items = obj.get("as-list")
        return tuple(items) if isinstance(items, (list, tuple)) else Opaque("__Set__")
    return obj


def decode(frame: bytes | bytearray | memoryview) -> Any:
    """A message's first frame, as plain Python data (maps, tuples, str, bytes, numbers)."""
    try:
        return msgpack.unpackb(
            frame,
            object_hook=_decode_map,
            use_list=False,  # as distributed: arrays become tuples, which may be map keys
            raw=False,
            strict_map_key=False,
            # msgpack's default: an extension type stays an inert ExtType, never turned into objects
        )
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise Misbehaved(f"a reply that is not msgpack: {type(exc).__name__}: {exc}") from exc


def encode(message: Any) -> bytes:
    """One message, ready to write: the length header, the prelude and its one msgpack frame."""
    frame: bytes = msgpack.packb(message, use_bin_type=True)
    prelude = _LENGTH.pack(1) + _LENGTH.pack(len(frame))
    return _LENGTH.pack(len(prelude) + len(frame)) + prelude + frame


def find_opaque(value: Any) -> Opaque | None:
    """The first :class:`Opaque` part inside a decoded message, if any."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, Opaque):
            return item
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, tuple):
            stack.extend(item)
    return None


def error_text(reply: dict[Any, Any]) -> str:
    """An error reply's plain text fields; its pickled ``exception`` and ``traceback`` are ignored."""
    texts = [reply.get(field) for field in ("exception_text", "text")]
    text = "; ".join(t for t in texts if isinstance(t, str) and t) or "an error, without text"
    return text[:ERROR_TEXT_CHARS]


async def read_message(reader: asyncio.StreamReader, limit: int = MAX_MESSAGE_BYTES) -> Any:
    """One message from the stream; a declared size above ``limit`` is refused before any allocation."""
    try:
        (first,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
        if first > limit:
            raise Misbehaved(f"a reply declared {first} bytes, over the limit of {limit}")
        if first < _LENGTH.size:
            raise Misbehaved(f"a reply declared {first} bytes, too short for its frame count")
        block = await reader.readexactly(first)
        (count,) = _LENGTH.unpack_from(block)
        prelude = _LENGTH.size * (1 + count)
        if count < 1 or prelude > first:
            raise Misbehaved(f"a reply declared {count} frames in {first} bytes")
        lengths = struct.unpack_from(f"{count}Q", block, _LENGTH.size)
        if sum(lengths) + prelude > limit:
            raise Misbehaved(f"a reply declared frames of {sum(lengths)} bytes, over the limit of {limit}")
        frames: list[bytes | memoryview] = []
        view, start = memoryview(block), prelude
        for length in lengths:  # as distributed's unpack_frames: frames inside the first block ...
            if start == first:
                break
            if start + length > first:
                raise Misbehaved("a reply's frame runs past its block")
            frames.append(view[start : start + length])
            start += length
        if start != first:
            raise Misbehaved("a reply's block holds more than its frames")
        for length in lengths[len(frames) :]:  # ... and the rest, each on its own
            frames.append(await reader.readexactly(length))
    except asyncio.IncompleteReadError as exc:
        raise Closed("the connection closed in the middle of a reply") from exc
    return decode(frames[0])


def parse_address(address: str) -> tuple[str, str, int]:
    """``tcp://host:port`` or ``tls://host:port`` (IPv6 in brackets) -> (scheme, host, port)."""
    scheme, sep, rest = address.partition("://")
    if not sep:
        scheme, rest = "tcp", address
    if scheme not in ("tcp", "tls"):
        raise ValueError(f"{address!r}: only tcp:// and tls:// schedulers are supported")
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"{address!r}: expected {scheme}://host:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return scheme, host, int(port)


def ssl_context_from_pem(ca: str, cert: str, key: str) -> ssl.SSLContext:
    """A client TLS context from PEM texts, with distributed's settings (``Security``): the
    cluster's own CA, a client certificate, no hostname check (clusters use IP addresses)."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cadata=ca)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    # load_cert_chain reads files only: the PEM texts live on disk just while it loads them.
    with tempfile.TemporaryDirectory() as directory:
        cert_path, key_path = os.path.join(directory, "tls.crt"), os.path.join(directory, "tls.key")
        for path, text in ((cert_path, cert), (key_path, key)):
            with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as file:
                file.write(text)
        context.load_cert_chain(cert_path, key_path)
    context.verify_mode = ssl.CERT_REQUIRED
    context.check_hostname = False
    context.verify_flags &= ~ssl.VERIFY_X509_STRICT
    return context


class Comm:
    """One connection to a Dask server; calls one at a time."""

    def __init__(self, address: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.address = address
        self.reader = reader
        self.writer = writer

    async def call(self, op: str, *, allow_opaque: bool = False, **arguments: Any) -> Any:
        """``op`` with these arguments; the handler's answer, as plain data.

        Raises :class:`RemoteError` for an error reply, :class:`Misbehaved` for a reply that is
        too large, not msgpack, or (unless ``allow_opaque``) holds serialized or pickled parts.
        """
        self.writer.write(encode({"op": op, "reply": True, **arguments}))
        await self.writer.drain()
        reply = await read_message(self.reader)
        if isinstance(reply, dict) and reply.get("status") == "uncaught-error":
            raise RemoteError(f"{op}: {error_text(reply)}")
        if not allow_opaque:
            opaque = find_opaque(reply)
            if opaque is not None:
                raise Misbehaved(f"the reply to {op} holds a {opaque.marker} part, which is never decoded")
        return reply

    async def close(self) -> None:
        try:
            if not self.writer.is_closing():
                self.writer.write(encode({"op": "close", "reply": False}))
            self.writer.close()
            await asyncio.wait_for(self.writer.wait_closed(), 1)
        except (OSError, asyncio.TimeoutError, ssl.SSLError):  # noqa: UP041 (not TimeoutError before 3.11)
            pass  # closing a connection that is gone already

    async def __aenter__(self) -> Comm:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


async def connect(address: str, *, ssl_context: ssl.SSLContext | None = None, timeout: float = 10) -> Comm:
    """Connect and handshake; a ``tls://`` address needs ``ssl_context``.

    No retries: a refused connection fails at once, and callers decide whether to try again.
    """
    scheme, host, port = parse_address(address)
    if scheme == "tls" and ssl_context is None:
        raise ValueError(f"{address}: a tls:// scheduler needs a client certificate")

    async def handshake() -> Comm:
        reader, writer = await asyncio.open_connection(
            host, port, ssl=ssl_context if scheme == "tls" else None, limit=2**16
        )
        comm = Comm(address, reader, writer)
        try:
            # Our handshake first, as distributed's connect() does; no compression, so that the
            # peer compresses nothing it sends us (only serialized parts are ever compressed).
            version = tuple(sys.version_info)[:3]
            writer.write(encode({"compression": None, "python": version, "pickle-protocol": _PICKLE_PROTOCOL}))
            await writer.drain()
            theirs = await read_message(reader, HANDSHAKE_BYTES)
            if not isinstance(theirs, dict) or find_opaque(theirs) is not None:
                raise Misbehaved(f"a handshake that is not a plain map: {type(theirs).__name__}")
        except BaseException:
            writer.close()
            raise
        return comm

    return await asyncio.wait_for(handshake(), timeout)
