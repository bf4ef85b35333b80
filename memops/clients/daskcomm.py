"""A client for the Dask comm protocol that never unpickles and bounds what a reply may allocate.

Every address that memops talks to is written by a user (``spec.scheduler.address``), so the
peer is hostile input. distributed's own ``rpc`` is not fit for that: it accepts pickle by
default, ``clean_exception`` unpickles an error reply's ``exception`` whatever the
deserializers, a ``__Pickled__`` part is unpickled even with ``deserialize=False``, and its TCP
comm allocates whatever frame size the peer declares. This module speaks the same wire format
itself, over asyncio streams (``tcp://`` and ``tls://``), and:

- decodes only the message's first frame, with msgpack, refusing extension types: a part that
  distributed marks as serialized or pickled (``{"__Serialized__": n}``, ``{"__Pickled__": n}``)
  or as an enum (which would import a module) becomes an :class:`Opaque` placeholder, whose
  frames are never read as anything but bytes. A reply that holds one is refused
  (:class:`Misbehaved`) unless the caller asked for it (``run_function``, whose ``result`` is
  pickled by design: the caller reads only its plain ``status``);
- turns an error reply (``{"status": "uncaught-error", ...}``) into :class:`RemoteError`, whose
  message holds only the reply's plain text fields, never its ``exception`` or ``traceback``;
- bounds what each reply may build, by the call's :class:`Limit`: the bytes that it may declare
  (a larger reply is refused *before* it is read), its frames, the longest array, and the Python
  objects that decoding it may create, counted while it decodes, so that a reply of small
  objects (1 byte each on the wire, 50 to 80 bytes each in Python) is refused long before it
  could take the process down. Decoding goes in slices, each a few milliseconds of work, and
  :func:`read_message` lets the event loop run between them.
- says nothing that the peer chose in its exceptions' messages (no size it declared, no text it
  sent): what it concluded, and the limit that it applied.

Used by :mod:`memops.clients.daskrpc` (the operator) and, as source text, by the safety net's preStop
hook (:data:`memops.clients.prestop_hook.PRE_STOP_SCRIPT`), which runs in a worker's container with only a
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
import dataclasses
import os
import ssl
import struct
import sys
import tempfile
from typing import Any

import msgpack

KiB, MiB = 2**10, 2**20


@dataclasses.dataclass(frozen=True)
class Limit:
    """What one reply may build. Each call says which it needs (:meth:`Comm.call`'s ``limit``).

    Why these bounds: every msgpack object takes at least one byte on the wire and 50 to 80
    bytes once decoded (an empty map is 1 byte and a 64-byte dict, plus its slot in its
    container), so the bytes alone would let a reply grow 80 times its size: 8 MiB of empty maps
    took 650 MiB and 7 s of the event loop. ``objects`` counts what decoding has created (the
    interpreter's small-object blocks, each at most 512 bytes, and an object for every 8 slots of
    the arrays; a string or bytes longer than that costs about its own bytes on the wire, which
    ``bytes`` bounds), and decoding stops as soon as it is over. ``items`` bounds one array,
    which msgpack allocates ahead of its items when its header arrives (from msgpack 1.2.4, at
    most 10,000 of them): nested 1,024 deep (msgpack's own limit), arrays that hold nothing yet
    cost ``8 * min(items, 10000)`` bytes each, so ``items`` stays small except where a reply
    carries key lists.
    """

    bytes: int
    """The most that the reply may declare, its frames together; a larger one is refused unread."""
    objects: int
    """The most Python objects that decoding it may create (about 60 to 100 bytes each)."""
    items: int
    """The longest array in it (a map's entries count as objects: a map is not allocated ahead)."""


HANDSHAKE = Limit(bytes=64 * KiB, objects=2**12, items=64)
"""The peer's handshake: three small fields."""
SMALL = Limit(bytes=256 * KiB, objects=2**14, items=1024)
"""What a call gets unless it says otherwise: ``events`` of the agent's install marker,
``run_function``'s ``status`` (its pickled ``result`` is a frame that is never decoded), anything
of a few fields."""
WORKERS = Limit(bytes=8 * MiB, objects=2**19, items=4096)
"""A reply of a few fields for every worker: ``identity`` (about 1 KiB and 40 objects a worker
at rest, a few times that busy: some 3,000 busy workers), ``retire_workers`` (an identity per
retired worker), the agent's drain states, relief's and replication's figures. Decoded, at most
about 40 MiB of objects, and 32 MiB of arrays nested empty."""
KEYS = Limit(bytes=16 * MiB, objects=2**20, items=2**16)
"""A reply that grows with the keys: the agent's ``holdings`` (the placement of the drained
workers' keys), ``processing`` (the tasks on each worker), and the fallback's ``who_has`` and
``nbytes`` (about 45 bytes and 3 objects a key: some 300,000 keys) for schedulers that refuse
``run_function``. Decoded, at most about 80 MiB of objects; a larger one is refused, with a
message saying so, rather than decoded into more memory than the operator has (512 MiB, about
120 at rest). Its arrays may be long (a worker may be processing thousands of tasks): msgpack
from 1.2.4 allocates at most 10,000 items of an array ahead of its contents, which keeps arrays
nested empty to 80 MiB too (the operator's image has it: ``pyproject.toml``)."""

MAX_MESSAGE_BYTES = KEYS.bytes
"""The most that any reply may declare (:data:`KEYS`); most calls allow much less."""

MAX_FRAMES = 64
"""The most frames a reply may have. Frame 0 is the message; the others belong to serialized or
pickled parts (one or two each), which memops' calls never ask for and never decode. Each frame
costs a length and a view in memory: 8 MiB of one-byte frames took 186 MiB."""

IN_FLIGHT_OBJECTS = 2**21
"""The most objects that all the replies being decoded at one time may build together (about
160 MiB at worst, beside some 120 MiB at rest in the operator's 512 MiB). Each reply has its own
limit, but many policies may aim at hostile peers at once: a reply that would take the sum over
this is refused like one over its own limit, at once rather than waiting for room, so that a peer
that trickles its reply can make others fail only while it holds its share, never stall them."""

MAP_ENTRY_SLOTS = 6
"""What a map's entry costs, in 8-byte slots: its hash, key and value pointers and its index, in
a table that the interpreter allocates outside its small-object blocks once the map is large
(keys and values such as small ints, one-character strings or None create no object at all)."""

SLICE_BYTES = 8 * KiB
"""Decoding goes this many bytes of the frame at a time: a few milliseconds even for the
costliest objects (empty maps, about 0.4 µs each with the hook), then the event loop runs."""

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


_in_flight = 0
"""Objects of the decodings in progress (:data:`IN_FLIGHT_OBJECTS`); the event loop's thread only."""


class _Decoding:
    """One frame's decoding, a slice at a time, within a :class:`Limit`.

    msgpack's Unpacker, fed a slice at a time, keeps a partly decoded message between slices, so
    the work can stop after any slice, and the frame never needs to be held whole. Each slice's
    new objects are counted (the interpreter's allocated blocks, before and after: nothing else
    runs in between). Placeholders for opaque parts are made here (the map hook), so that no
    second walk of the decoded message is needed; the first one is kept in ``opaque``.
    """

    def __init__(self, size: int, limit: Limit):
        self.size = size
        self.limit = limit
        self.opaque: Opaque | None = None
        self.created = 0
        self.done = False
        self.value: Any = None
        self.slots = 0
        self.held = 0
        self.unpacker = msgpack.Unpacker(
            object_hook=self._map,
            list_hook=self._array,
            use_list=False,  # as distributed: arrays become tuples, which may be map keys
            raw=False,
            strict_map_key=False,
            # One string may be as long as the frame (``bytes`` bounds it); the buffer starts small
            # (msgpack's default is 1 MiB, and 0 would mean no maximum).
            max_buffer_size=max(size, 1),
            read_size=min(max(size, 1), 2 * SLICE_BYTES),
            max_str_len=size,
            max_bin_len=size,
            max_array_len=min(limit.items, size),
            max_map_len=min(limit.objects, size // 2),  # a map is not allocated ahead of its entries
            max_ext_len=0,  # distributed sends no extension types: one is refused, never turned into objects
        )

    def _map(self, obj: dict[Any, Any]) -> Any:
        self.slots += MAP_ENTRY_SLOTS * len(obj)
        for marker in _OPAQUE_MARKERS:
            if marker in obj:
                opaque = Opaque(marker)
                self.opaque = self.opaque or opaque
                return opaque
        if "__Set__" in obj:  # how distributed sends a set: plain data, kept as a tuple
            items = obj.get("as-list")
            if isinstance(items, (list, tuple)):
                return tuple(items)
            self.opaque = self.opaque or Opaque("__Set__")
            return self.opaque
        return obj

    def _array(self, items: tuple[Any, ...]) -> tuple[Any, ...]:
        # An array of nils, trues or small ints costs 8 bytes an item (its slots), where the
        # items cost nothing and take one byte each on the wire; the slots of a long array are
        # no small-object block either. Counted here, an object for every 8 slots.
        self.slots += len(items)
        return items

    def feed(self, chunk: bytes | bytearray | memoryview) -> None:
        """Decode the next slice of the frame (at most :data:`SLICE_BYTES`)."""
        if self.done:
            raise Misbehaved("a reply whose first frame holds more than one message")
        before = sys.getallocatedblocks()
        try:
            self.unpacker.feed(chunk)
            self.value = self.unpacker.unpack()
            self.done = True
        except msgpack.OutOfData:
            pass
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            # Not msgpack, an extension type, a container over the limit, an unhashable key: the
            # peer's bytes are not quoted (the exception's text may hold them).
            raise Misbehaved("a reply that is not plain msgpack within this call's limits") from exc
        grown = sys.getallocatedblocks() - before
        self.created += grown
        if self.created + self.slots // 8 > self.limit.objects:
            raise Misbehaved(f"a reply that decodes into more than {self.limit.objects} objects")
        self._hold(self.created + self.slots // 8)

    def _hold(self, objects: int) -> None:
        """Count this decoding's objects in :data:`IN_FLIGHT_OBJECTS`, which all share."""
        global _in_flight
        _in_flight += objects - self.held
        self.held = objects
        if _in_flight > IN_FLIGHT_OBJECTS:
            raise Misbehaved("a reply decoded while others take the room that all replies share")

    def release(self) -> None:
        """This decoding is over (its objects belong to the caller now, or are garbage)."""
        global _in_flight
        _in_flight -= self.held
        self.held = 0
        if self.done and self.unpacker.tell() != self.size:
            raise Misbehaved("a reply whose first frame holds more than one message")

    def result(self) -> Any:
        """The message, once the whole frame was fed."""
        if not self.done:
            raise Misbehaved("a reply whose first frame ends in the middle of its message")
        return self.value


def decode(frame: bytes | bytearray | memoryview, limit: Limit = SMALL) -> Any:
    """A message's first frame, as plain Python data (maps, tuples, str, bytes, numbers), at once.

    Serialized, pickled and enum parts are :class:`Opaque` placeholders. Raises :class:`Misbehaved`
    for a frame that is not msgpack, or that would build more than ``limit`` allows.
    """
    view = memoryview(frame).cast("B")
    decoding = _Decoding(len(view), limit)
    try:
        for start in range(0, len(view), SLICE_BYTES):
            decoding.feed(view[start : start + SLICE_BYTES])
    finally:
        decoding.release()
    return decoding.result()


def encode(message: Any) -> bytes:
    """One message, ready to write: the length header, the prelude and its one msgpack frame."""
    frame: bytes = msgpack.packb(message, use_bin_type=True)
    prelude = _LENGTH.pack(1) + _LENGTH.pack(len(frame))
    return _LENGTH.pack(len(prelude) + len(frame)) + prelude + frame


def error_text(reply: dict[Any, Any]) -> str:
    """An error reply's plain text fields; its pickled ``exception`` and ``traceback`` are ignored.

    The peer's own words: for a log, or for a message about a peer that the caller trusts.
    """
    texts = [reply.get(field) for field in ("exception_text", "text")]
    text = "; ".join(t for t in texts if isinstance(t, str) and t) or "an error, without text"
    return text[:ERROR_TEXT_CHARS]


async def _read(reader: asyncio.StreamReader, limit: Limit) -> tuple[Any, Opaque | None]:
    """One message and its first opaque part, decoded as it arrives; its sizes over ``limit``
    are refused unread.

    The first frame is decoded a slice at a time, the event loop running between slices, and
    never held whole; the other frames (serialized or pickled parts) are read and dropped.
    """
    try:
        (first,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
        if first > limit.bytes:
            raise Misbehaved(f"a reply over this call's limit of {limit.bytes} bytes")
        if first < 2 * _LENGTH.size:
            raise Misbehaved("a reply too short for its frame count")
        (count,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
        if not 1 <= count <= MAX_FRAMES:
            raise Misbehaved(f"a reply that does not have 1 to {MAX_FRAMES} frames")
        prelude = _LENGTH.size * (1 + count)
        if prelude > first:
            raise Misbehaved("a reply too short for its frame count")
        lengths = struct.unpack(f"{count}Q", await reader.readexactly(prelude - _LENGTH.size))
        if sum(lengths) + prelude > limit.bytes:
            raise Misbehaved(f"a reply over this call's limit of {limit.bytes} bytes")
        # As distributed's unpack_frames: the frames that fit in the first block are in it, the
        # rest follow, each on its own. Either way the frames come in order, the first first.
        block, inside = first - prelude, 0
        for length in lengths:
            if inside == block:
                break
            if inside + length > block:
                raise Misbehaved("a reply whose frames do not fit its block")
            inside += length
        if inside != block:
            raise Misbehaved("a reply whose block holds more than its frames")
        decoding = _Decoding(lengths[0], limit)
        try:
            for start in range(0, lengths[0], SLICE_BYTES):
                decoding.feed(await reader.readexactly(min(SLICE_BYTES, lengths[0] - start)))
                await asyncio.sleep(0)  # the slice may have been in the buffer already
        finally:
            decoding.release()
        value = decoding.result()
        rest = sum(lengths[1:])
        while rest:
            rest -= len(await reader.readexactly(min(SLICE_BYTES, rest)))
    except asyncio.IncompleteReadError as exc:
        raise Closed("the connection closed in the middle of a reply") from exc
    return value, decoding.opaque


async def read_message(reader: asyncio.StreamReader, limit: Limit = SMALL) -> Any:
    """One message from the stream, within ``limit``: a declared size above it is refused before
    any allocation, and decoding stops as soon as it builds more than it allows."""
    value, _ = await _read(reader, limit)
    return value


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

    async def call(self, op: str, *, allow_opaque: bool = False, limit: Limit = SMALL, **arguments: Any) -> Any:
        """``op`` with these arguments; the handler's answer, as plain data.

        ``limit`` is what the reply may build (:data:`SMALL` unless the call needs more).
        Raises :class:`RemoteError` for an error reply (its message holds the peer's text),
        :class:`Misbehaved` for a reply that is over ``limit``, not msgpack, or (unless
        ``allow_opaque``) holds serialized or pickled parts.
        """
        self.writer.write(encode({"op": op, "reply": True, **arguments}))
        await self.writer.drain()
        reply, opaque = await _read(self.reader, limit)
        if isinstance(reply, dict) and reply.get("status") == "uncaught-error":
            raise RemoteError(f"{op}: {error_text(reply)}")
        if opaque is not None and not allow_opaque:
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
            theirs, opaque = await _read(reader, HANDSHAKE)
            if not isinstance(theirs, dict) or opaque is not None:
                raise Misbehaved("a handshake that is not a plain map")
        except BaseException:
            writer.close()
            raise
        return comm

    return await asyncio.wait_for(handshake(), timeout)
