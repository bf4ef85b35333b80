"""What decoding a reply may build: maps of objects that cost nothing to create, one long string,
and all the replies decoded at one time together (:mod:`memops.clients.daskcomm`)."""

from __future__ import annotations

import gc
import tracemalloc
from typing import Any

import msgpack
import pytest

from memops.clients import daskcomm

MiB = 2**20


def cheap_map() -> dict[Any, None]:
    """A map of some 260 entries whose keys and values the interpreter never creates anew (small
    ints, one-character strings, None, (), ""): its entries' table is the only cost."""
    one: dict[Any, None] = {k: None for k in range(-5, 128)}
    one.update({chr(c): None for c in range(0x20, 0x7F)})
    one.update({k: None for k in (True, (), "", b"")})
    return one


def map_bomb(size: int, items: int) -> bytes:
    """A frame of about ``size`` bytes: rows of ``items`` copies of :func:`cheap_map`."""
    one = cheap_map()
    per = len(msgpack.packb(one))
    count = (size - 1024) // per
    rows = [tuple([one] * items) for _ in range(count // items)]
    return msgpack.packb({i: row for i, row in enumerate(rows)})


@pytest.mark.parametrize("limit", [daskcomm.WORKERS, daskcomm.KEYS], ids=["WORKERS", "KEYS"])
def test_maps_of_free_objects_count_their_entries(limit: daskcomm.Limit) -> None:
    """Each cheap map is about 520 bytes on the wire and 10 KiB of table: 7 MiB of them once
    decoded into 119 MiB under WORKERS, whose objects are meant to stay near 40 MiB."""
    frame = map_bomb(limit.bytes, min(limit.items, 4096))
    gc.collect()
    tracemalloc.start()
    try:
        with pytest.raises(daskcomm.Misbehaved, match="objects"):
            daskcomm.decode(frame, limit)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 128 * limit.objects, f"{peak / MiB:.0f} MiB"


def test_a_long_string_within_the_limit_is_read() -> None:
    """A key or an error text longer than one slice of decoding is plain data, not misbehaviour."""
    frame = msgpack.packb({"key": "x" * 100_000, "blob": b"y" * 100_000})
    assert daskcomm.decode(frame, daskcomm.KEYS) == {"key": "x" * 100_000, "blob": b"y" * 100_000}


def test_replies_decoded_at_one_time_share_one_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decoding in progress holds its objects in the shared budget; another one that would take
    the sum over it is refused at once, and the room comes back when the first ends."""
    monkeypatch.setattr(daskcomm, "IN_FLIGHT_OBJECTS", 40_000)
    monkeypatch.setattr(daskcomm, "_in_flight", 0)  # the process' own count, whatever ran before
    big = msgpack.packb([{"a": i, "b": str(i)} for i in range(20_000)])
    first = daskcomm._Decoding(len(big), daskcomm.KEYS)
    view = memoryview(big)
    start = 0
    while start < len(big) - daskcomm.SLICE_BYTES and first.held < 30_000:
        first.feed(view[start : start + daskcomm.SLICE_BYTES])
        start += daskcomm.SLICE_BYTES
    assert first.held >= 30_000
    with pytest.raises(daskcomm.Misbehaved, match="room"):
        daskcomm.decode(big, daskcomm.KEYS)
    first.release()
    assert len(daskcomm.decode(msgpack.packb([{"a": i} for i in range(1000)]), daskcomm.KEYS)) == 1000
    assert daskcomm._in_flight == 0


def test_every_decoding_gives_its_room_back() -> None:
    """Refused or read, a reply leaves nothing of itself in the shared count."""
    before = daskcomm._in_flight
    daskcomm.decode(msgpack.packb([{"a": i} for i in range(5000)]), daskcomm.KEYS)
    with pytest.raises(daskcomm.Misbehaved):
        daskcomm.decode(map_bomb(daskcomm.WORKERS.bytes, 1024), daskcomm.WORKERS)
    assert daskcomm._in_flight == before
