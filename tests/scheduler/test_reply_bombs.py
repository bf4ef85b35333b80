"""Replies that stay under a size limit and would still take the operator down: refused, cheaply.

A "scheduler" (:func:`tests.scheduler.hostile.bombing`) answers one operation with a msgpack
array of empty maps (1 byte each on the wire, about 70 in Python: 8 MiB once took 650 MiB and
stalled the event loop 7 s) or with a prelude of one-byte frames (8 MiB took 186 MiB). Each of
the operator's calls meets the bomb at the old 64 MiB cap and at its own limit: the call fails
with :class:`memops.clients.daskrpc.SchedulerMisbehaved`, what it allocated stays within the call's
:class:`memops.clients.daskcomm.Limit` (a few MiB for what is refused unread), and the event loop that
serves the webhooks never stalls for 100 ms. The preStop hook, which carries the same client as
source, is run as the kubelet runs it against the same bombs.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import pytest
from memops_sandbox import dask_direct

from memops.clients import daskcomm, daskrpc
from tests.scheduler import hostile
from tests.scheduler.test_hostile_scheduler import run_hook

MiB = 2**20
CAP = 64 * MiB
"""The cap that every reply had before each call got its own limit."""
SECONDS = 30
WORKER = "tcp://127.0.0.1:2"  # the one worker of the hostile scheduler's identity


@dataclass(frozen=True)
class Call:
    op: str
    """The operation whose answer is the bomb."""
    limit: daskcomm.Limit
    """The limit that the call's reply gets."""
    run: Callable[[str], Awaitable[object]]


CALLS = {
    "ping": Call("identity", daskcomm.WORKERS, lambda a: dask_direct.ping(a, timeout=SECONDS)),
    "events": Call("events", daskcomm.SMALL, lambda a: dask_direct.fetch_snapshot(a, timeout=SECONDS)),
    "fetch_snapshot": Call("identity", daskcomm.WORKERS, lambda a: dask_direct.fetch_snapshot(a, timeout=SECONDS)),
    "retire_workers": Call(
        "identity", daskcomm.WORKERS, lambda a: dask_direct.retire_workers(a, [WORKER], timeout=SECONDS)
    ),
    "holdings": Call("memops_agent", daskcomm.KEYS, lambda a: dask_direct.fetch_snapshot(a, timeout=SECONDS)),
    "start_drain": Call(
        "memops_agent",
        daskcomm.WORKERS,
        lambda a: dask_direct.start_drain(a, [WORKER], deadline=5, timeout=SECONDS),
    ),
    "who_has": Call("who_has", daskcomm.KEYS, lambda a: dask_direct.fetch_snapshot(a, timeout=SECONDS)),
}
"""Each call of the operator, by the operation whose answer is the bomb: ``events`` is the read of
the agent's install marker (the first call of a snapshot's agent path), ``holdings`` the agent's
(its first agent call), ``who_has`` the fallback of a scheduler without the agent that blocks
``run_function``."""


ONE_A_LIMIT = ["events", "fetch_snapshot", "start_drain", "holdings"]
"""A call for each limit, and for the agent's path: where the decoding runs to its budget (slow
under tracemalloc), one call a limit is enough."""


def budget(limit: daskcomm.Limit) -> int:
    """What a reply may cost within ``limit``: its objects at 128 bytes each, arrays nested
    1,024 deep that hold nothing yet, and 2 MiB for the connection and the slices in flight
    (the frame is decoded as it arrives, never held whole)."""
    return 128 * limit.objects + 1024 * 8 * min(limit.items, 10_000) + 2 * MiB


@contextlib.asynccontextmanager
async def ticking() -> AsyncIterator[list[float]]:
    """The longest gap between the wake-ups of a task that asks to wake every millisecond,
    while the block runs (in the list's one item, in seconds)."""
    longest = [0.0]
    loop = asyncio.get_running_loop()

    async def tick() -> None:
        last = loop.time()
        while True:
            await asyncio.sleep(0.001)
            now = loop.time()
            longest[0] = max(longest[0], now - last)
            last = now

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.01)
    try:
        yield longest
    finally:
        ticker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await ticker


async def peak_of(call: Callable[[], Awaitable[object]]) -> tuple[BaseException, int]:
    """The exception that ``call`` raised and the most it allocated meanwhile, in bytes. The agent's
    code, which a call may send first, is pickled before: what it sends is not the reply."""
    daskrpc.agent_payload()
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        with pytest.raises(daskrpc.SchedulerMisbehaved) as raised:
            await call()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return raised.value, peak - base


@pytest.mark.parametrize("kind", hostile.BOMBS)
@pytest.mark.parametrize("name", CALLS)
async def test_a_bomb_at_the_old_cap_is_refused_unread(name: str, kind: str) -> None:
    call = CALLS[name]
    async with hostile.bombing(call.op, kind, CAP) as address:
        error, grown = await peak_of(lambda: call.run(address))
    assert f"over this call's limit of {call.limit.bytes} bytes" in str(error), error
    assert grown < 4 * MiB, f"{grown / MiB:.1f} MiB allocated for a reply refused unread"


@pytest.mark.parametrize("name", CALLS)
async def test_many_frames_within_the_limit_are_refused_from_the_prelude(name: str) -> None:
    call = CALLS[name]
    async with hostile.bombing(call.op, "frames", call.limit.bytes) as address:
        error, grown = await peak_of(lambda: call.run(address))
    assert f"does not have 1 to {daskcomm.MAX_FRAMES} frames" in str(error), error
    assert grown < 4 * MiB, f"{grown / MiB:.1f} MiB allocated for a prelude of one-byte frames"


@pytest.mark.parametrize("name", CALLS)
async def test_one_long_array_within_the_limit_is_refused_at_its_header(name: str) -> None:
    call = CALLS[name]
    async with hostile.bombing(call.op, "maps", call.limit.bytes) as address:
        error, grown = await peak_of(lambda: call.run(address))
    assert "not plain msgpack within this call's limits" in str(error), error
    assert grown < 4 * MiB, f"{grown / MiB:.1f} MiB allocated for {call.limit}"


@pytest.mark.parametrize("name", ONE_A_LIMIT)
async def test_empty_maps_within_the_limit_stop_at_the_object_budget(name: str) -> None:
    call = CALLS[name]
    async with hostile.bombing(call.op, "rows", call.limit.bytes) as address:
        error, grown = await peak_of(lambda: call.run(address))
    assert f"decodes into more than {call.limit.objects} objects" in str(error), error
    assert grown < budget(call.limit), f"{grown / MiB:.1f} MiB allocated for {call.limit}"


@pytest.mark.parametrize("name", ONE_A_LIMIT)
async def test_arrays_nested_deep_cost_no_more_than_their_limit(name: str) -> None:
    """Each array header allocates room for the items it declares, before they arrive."""
    call = CALLS[name]
    async with hostile.bombing(call.op, "nested", call.limit.bytes, items=call.limit.items) as address:
        _, grown = await peak_of(lambda: call.run(address))
    assert grown < budget(call.limit), f"{grown / MiB:.1f} MiB allocated for {call.limit}"


@pytest.mark.parametrize("name", [n for n in CALLS if n != "who_has"])
async def test_decoding_a_bomb_never_stalls_the_event_loop(name: str) -> None:
    """The loop serves the webhooks: it wakes within a quarter of a second throughout (the decoding
    goes in slices; on a loaded two-core machine the gaps between them alone reach 100 ms).

    A full collection of the garbage collector walks every object of the process, at whatever
    allocation triggers it: collected first, so that the gaps measured are the decoding's.
    (``who_has`` is left out: on its way, installing the agent pickles it on the loop, for up to
    a quarter of a second the first time; ``holdings`` decodes within the same limit.)
    """
    call = CALLS[name]
    gc.collect()
    async with hostile.bombing(call.op, "rows", call.limit.bytes) as address, ticking() as longest:
        with pytest.raises(daskrpc.SchedulerMisbehaved, match="objects"):
            await call.run(address)
    assert longest[0] < 0.25, f"the event loop stalled {longest[0] * 1000:.0f} ms"


def test_a_legitimate_reply_decodes_at_a_tenth_of_its_budget() -> None:
    """A thousand workers' identity, as a busy scheduler sends it, is far from WORKERS' limits."""
    worker = {
        "type": "Worker",
        "id": "Worker-0f3c",
        "host": "10.1.2.3",
        "resources": {},
        "local_directory": "/tmp/dask-scratch-space/worker-x",
        "name": "dask-worker-abcdef-12345",
        "nthreads": 4,
        "memory_limit": 8 * 2**30,
        "last_seen": 1.7e9,
        "services": {"dashboard": 8787},
        "metrics": {
            "task_counts": {"memory": 120, "executing": 4, "ready": 10},
            "bandwidth": {"total": 1e8, "workers": {f"tcp://10.1.2.{i}:40000": 1e8 for i in range(20)}, "types": {}},
            "digests_total_since_heartbeat": {f"tick-{i}": 0.1 for i in range(20)},
            "managed_bytes": 2**30,
            "spilled_bytes": {"memory": 0, "disk": 0},
            "transfer": {"incoming_bytes": 0, "incoming_count": 0, "outgoing_bytes": 0, "outgoing_count": 0},
            "event_loop_interval": 0.02,
            "cpu": 100.0,
            "memory": 3 * 2**30,
            "time": 1.7e9,
            "host_net_io": {"read_bps": 0.0, "write_bps": 0.0},
            "host_disk_io": {"read_bps": 0.0, "write_bps": 0.0},
            "num_fds": 40,
        },
        "status": "running",
        "nanny": "tcp://10.1.2.3:40001",
    }
    identity = {"type": "Scheduler", "workers": {f"tcp://10.1.{i // 250}.{i % 250}:40000": worker for i in range(1000)}}
    frame = daskcomm.msgpack.packb(identity, use_bin_type=True)
    decoding = daskcomm._Decoding(len(frame), daskcomm.WORKERS)
    try:
        for start in range(0, len(frame), daskcomm.SLICE_BYTES):
            decoding.feed(frame[start : start + daskcomm.SLICE_BYTES])
        counted = decoding.held  # objects and slots: what the limit compares
    finally:
        decoding.release()
    assert decoding.result()["workers"].keys() == identity["workers"].keys()
    assert len(frame) < daskcomm.WORKERS.bytes / 2, len(frame)
    assert counted < daskcomm.WORKERS.objects / 2, counted


@pytest.mark.parametrize(
    ("kind", "size"),
    [
        pytest.param("maps", CAP, id="maps-at-the-old-cap"),
        pytest.param("frames", daskcomm.WORKERS.bytes, id="frames-within-the-limit"),
        pytest.param("rows", daskcomm.WORKERS.bytes, id="rows-of-maps-within-the-limit"),
        pytest.param("nested", daskcomm.WORKERS.bytes, id="arrays-nested-within-the-limit"),
    ],
)
async def test_the_prestop_hook_refuses_a_bomb(kind: str, size: int) -> None:
    async with hostile.not_a_scheduler("refused") as nobody:
        _, _, baseline = await run_hook(nobody)
    async with hostile.bombing("identity", kind, size) as address:
        code, text, maxrss = await run_hook(address)
    assert code != 0 and "Misbehaved: " in text, text
    # The hook reads identity with short arrays (its image's msgpack may allocate them whole).
    hook = daskcomm.Limit(bytes=daskcomm.WORKERS.bytes, objects=daskcomm.WORKERS.objects, items=daskcomm.SMALL.items)
    bound = 4 * MiB if size == CAP or kind == "frames" else budget(hook)
    assert maxrss - baseline < bound, f"{(maxrss - baseline) / MiB:.1f} MiB for one reply"
