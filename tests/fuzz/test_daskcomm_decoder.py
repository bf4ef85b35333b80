"""memops.clients.daskcomm's decoder against arbitrary bytes and hostile msgpack: only its typed errors.

Whatever a peer sends, :func:`memops.clients.daskcomm.decode` and :func:`memops.clients.daskcomm.read_message`
return plain data or raise :class:`~memops.clients.daskcomm.Misbehaved` (or, for a stream that ends,
:class:`~memops.clients.daskcomm.Closed`), never anything else, and never build more than the
:class:`~memops.clients.daskcomm.Limit` allows. Each property has a fixed budget of examples and is
derandomized: a run takes a few seconds and finds the same things every time. What a run found
is kept below as a regression test.
"""

from __future__ import annotations

import asyncio
import struct
import tracemalloc
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memops.clients import daskcomm

TINY = daskcomm.Limit(bytes=64 * 2**10, objects=512, items=64)
"""Small enough that hostile examples reach every bound."""
FUZZ = settings(
    max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow], database=None
)
SLOT = 8


def peak_bound(limit: daskcomm.Limit, size: int) -> int:
    """The most that decoding ``size`` bytes within ``limit`` may allocate: its objects at 128
    bytes, arrays nested 1,024 deep and empty, the slices in flight and the input itself."""
    return 128 * limit.objects + 1024 * SLOT * min(limit.items, 10_000) + 4 * daskcomm.SLICE_BYTES + 2 * size


def decode_within(frame: bytes, limit: daskcomm.Limit = TINY) -> Any:
    """:func:`memops.clients.daskcomm.decode`, checking what it allocated (traced for it alone); None
    for Misbehaved."""
    tracemalloc.start()
    try:
        return daskcomm.decode(frame, limit)
    except daskcomm.Misbehaved:
        return None
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < peak_bound(limit, len(frame)), f"{peak} bytes for {len(frame)}"


@FUZZ
@given(st.binary(max_size=4096))
def test_arbitrary_bytes_decode_or_misbehave(frame: bytes) -> None:
    decode_within(frame)


# Hostile msgpack: the markers that distributed gives meaning to, sets, extension types,
# unhashable keys (a map or an array holding one), deep nesting, every scalar type.
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.binary(max_size=20),
    st.builds(msgpack.ExtType, st.integers(min_value=0, max_value=127), st.binary(max_size=8)),
)
MARKERS = ("__Serialized__", "__Pickled__", "__Enum__", "__Set__", "as-list")


def hostile(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.lists(children, max_size=80),
        st.dictionaries(
            st.one_of(st.text(max_size=5), st.integers(-(2**63), 2**63 - 1), st.sampled_from(MARKERS)),
            children,
            max_size=8,
        ),
        st.builds(lambda v: {"__Set__": True, "as-list": v}, children),
        st.builds(lambda m, v: {m: v}, st.sampled_from(MARKERS), children),
    )


messages = st.recursive(scalars, hostile, max_leaves=60)


def pack(message: Any) -> bytes:
    # Map keys that msgpack itself cannot pack (a map in a key) are packed by hand: a peer can.
    return msgpack.packb(message, use_bin_type=True, strict_types=False)


@FUZZ
@given(messages, st.data())
def test_hostile_msgpack_decodes_or_misbehaves(message: Any, data: st.DataObject) -> None:
    frame = bytearray(pack(message))
    # Mutations: cut the frame short, flip a byte, append garbage, repeat it.
    mutation = data.draw(st.sampled_from(["none", "cut", "flip", "append", "twice"]))
    if mutation == "cut" and frame:
        del frame[data.draw(st.integers(min_value=0, max_value=len(frame) - 1)) :]
    elif mutation == "flip" and frame:
        frame[data.draw(st.integers(min_value=0, max_value=len(frame) - 1))] = data.draw(st.integers(0, 255))
    elif mutation == "append":
        frame += data.draw(st.binary(min_size=1, max_size=16))
    elif mutation == "twice":
        frame.extend(bytes(frame))
    decoded = decode_within(bytes(frame), daskcomm.Limit(bytes=2**20, objects=2**14, items=1024))
    if mutation == "none" and decoded is not None:
        assert_same(decoded, message)


def assert_same(decoded: Any, message: Any) -> None:
    """What decoding gives for a plain message: arrays as tuples, markers as placeholders."""
    if isinstance(message, dict):
        if any(marker in message for marker in ("__Serialized__", "__Pickled__", "__Enum__")):
            assert isinstance(decoded, daskcomm.Opaque)
        elif "__Set__" in message:
            assert isinstance(decoded, (tuple, daskcomm.Opaque))
        else:
            assert isinstance(decoded, dict) and len(decoded) == len(message)
    elif isinstance(message, list):
        assert isinstance(decoded, tuple) and len(decoded) == len(message)
        for item, original in zip(decoded, message, strict=True):
            assert_same(item, original)
    elif isinstance(message, float) and message != message:
        assert decoded != decoded
    else:
        assert decoded == message


def envelope(frames: list[bytes], count: int | None = None, declared: int | None = None) -> bytes:
    """Frames in the comm's envelope; ``count`` and ``declared`` may lie."""
    lengths = [len(f) for f in frames]
    prelude = struct.pack(f"{1 + len(lengths)}Q", len(lengths) if count is None else count, *lengths)
    body = prelude + b"".join(frames)
    return struct.pack("Q", len(body) if declared is None else declared) + body


async def read(stream: bytes, limit: daskcomm.Limit) -> Any:
    reader = asyncio.StreamReader(limit=2**16)
    reader.feed_data(stream)
    reader.feed_eof()
    return await daskcomm.read_message(reader, limit)


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    try:
        yield loop
    finally:
        loop.close()


def read_within(loop: asyncio.AbstractEventLoop, stream: bytes, limit: daskcomm.Limit = TINY) -> Any:
    tracemalloc.start()
    try:
        return loop.run_until_complete(read(stream, limit))
    except (daskcomm.Misbehaved, daskcomm.Closed):
        return None
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < peak_bound(limit, len(stream)), f"{peak} bytes for {len(stream)}"


@FUZZ
@given(st.binary(max_size=4096))
def test_an_arbitrary_stream_reads_or_misbehaves(loop: asyncio.AbstractEventLoop, stream: bytes) -> None:
    read_within(loop, stream)


@FUZZ
@given(
    messages,
    st.lists(st.binary(max_size=64), max_size=4),
    st.one_of(st.none(), st.integers(min_value=0, max_value=2**64 - 1)),
    st.one_of(st.none(), st.integers(min_value=0, max_value=2**64 - 1), st.integers(min_value=0, max_value=300)),
)
def test_a_lying_envelope_reads_or_misbehaves(
    loop: asyncio.AbstractEventLoop,
    message: Any,
    more: list[bytes],
    count: int | None,
    declared: int | None,
) -> None:
    stream = envelope([pack(message), *more], count=count, declared=declared)
    read_within(loop, stream)


# -- pinned: inputs that the properties above are meant to reach -------------------------------
# (A run of 3,000 examples a property, not derandomized, found nothing more in the decoder.)


@pytest.mark.parametrize(
    "frame",
    [
        pytest.param(b"", id="empty"),
        pytest.param(b"\xdd\xff\xff\xff\xff" + b"\xc0" * 100, id="array-declaring-4-billion-items"),
        pytest.param(b"\xdf\xff\xff\xff\xff" + b"\xc0" * 100, id="map-declaring-4-billion-entries"),
        pytest.param(b"\xd4\x01\x00", id="extension-type"),
        pytest.param(b"\x81\x80\x01", id="map-as-a-map-key"),
        pytest.param(b"\x81\x91\x80\x01", id="array-holding-a-map-as-a-map-key"),
        pytest.param(b"\xc0\xc0", id="two-messages"),
        pytest.param(b"\x91" * 2000 + b"\xc0", id="nested-2000-deep"),
        pytest.param(b"\xa5abc", id="string-cut-short"),
        pytest.param(b"\xc1", id="never-used-byte"),
        pytest.param(b"\xa2\xff\xfe", id="string-not-utf8"),
    ],
)
def test_a_hostile_frame_misbehaves(frame: bytes) -> None:
    with pytest.raises(daskcomm.Misbehaved):
        daskcomm.decode(frame, TINY)
    assert decode_within(frame) is None


def test_a_plain_message_within_the_limit_decodes() -> None:
    message = {"op": "x", "workers": {"tcp://a:1": {"name": "w", "metrics": {"memory": 2**40}}}, "n": (1, 2.5)}
    assert daskcomm.decode(pack(message), TINY) == message


@pytest.mark.parametrize(
    ("stream", "error"),
    [
        pytest.param(b"", daskcomm.Closed, id="nothing"),
        pytest.param(struct.pack("Q", 2**63), daskcomm.Misbehaved, id="a-size-over-the-limit"),
        pytest.param(envelope([b"\xc0"], count=0), daskcomm.Misbehaved, id="no-frames"),
        pytest.param(envelope([b"\xc0"] * 65), daskcomm.Misbehaved, id="too-many-frames"),
        pytest.param(envelope([b"\xc0"], count=2**40), daskcomm.Misbehaved, id="frame-count-lies"),
        pytest.param(envelope([b"\xc0", b"ab"], declared=8 * 3 + 2), daskcomm.Misbehaved, id="frames-past-the-block"),
        pytest.param(envelope([b"\xc0"])[:-1], daskcomm.Closed, id="cut-short"),
    ],
)
def test_a_hostile_envelope_misbehaves(loop: asyncio.AbstractEventLoop, stream: bytes, error: type[Exception]) -> None:
    with pytest.raises(error):
        loop.run_until_complete(read(stream, TINY))
