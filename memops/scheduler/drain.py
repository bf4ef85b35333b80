"""Drains with a deadline: memops' own retirement, run on the scheduler's event loop.

Stock ``Scheduler.retire_workers`` adds one AMM ``RetireWorker`` policy per worker. On every
AMM cycle that policy suggests a ``replicate`` for every unique key still on the worker, so a
key whose copy is still on its way is asked for again (only ``manager.pending`` of the *same*
cycle is checked): a recipient can receive a key twice (a measured run received 1,314 keys for
1,024 moved). Its recipients are chosen per suggestion by the manager (the least memory, this
cycle only), not spread, and it neither knows a deadline nor which keys are worth most.

This module is a drain loop on the scheduler's event loop instead of an AMM policy, because
what it must control is what the AMM does not let a policy control: *when* a key is asked for
again (the manager forgets a suggestion after the cycle that made it), *how many* bytes are on
their way at once (so that, under a deadline, the keys worth most move first rather than in the
order the recipients happen to fetch them), and *which* recipient takes a key (all the
recipients of one pass, in equal shares). It issues ``acquire-replicas`` through the
scheduler's own ``request_acquire_replicas``, exactly what the AMM's ``_enact_suggestions``
sends, and marks the workers ``closing_gracefully`` as stock does (they take no new tasks, are
never recipients, and the AMM's ReduceReplicas drops their replicas first once copied).

For each worker being drained: its keys held nowhere else are ranked by value (:func:`rank`:
keys that cannot be recomputed first, then by recompute seconds per byte), sent in that order to
recipients off the dying workers' nodes, in equal shares while they have room below their memory
target, then by headroom (:func:`assign`), at most :data:`WINDOW_BYTES` on their way to one
recipient at a time. Each key is asked for once; again only if its recipient leaves or stops
running, or :data:`IN_FLIGHT_SECONDS` (plus its transfer time) pass, or its copy is gone again once
landed (a recipient that began draining too, whose replica the AMM's ReduceReplicas dropped: the
rescan is level-based). At the deadline nothing more is asked for, and what is still held only by
the drained workers is reported lost (cause ``deadline``). A worker whose keys all have a copy
elsewhere is closed and removed (``close``), as stock does.

:func:`rank` and :func:`assign` are pure and decide everything; :class:`DrainPlugin` only reads
the scheduler's state for them. Like :mod:`relief`, this imports nothing from memops beyond
this package: the operator sends it by value with the agent (:mod:`memops.scheduler.agent`),
whose ``drain`` and ``drain_status`` operations call :func:`start` and :func:`status`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import heapq
import logging
import time
from collections import defaultdict
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import dask.config
from distributed.core import Status
from distributed.diagnostics.plugin import SchedulerPlugin

from memops.scheduler import transfers
from memops.worker import handover

logger = logging.getLogger(__name__)

NAME = "memops-drain"
WINDOW_BYTES = 2**30
"""Bytes on their way to one recipient at a time. A recipient fetches the keys of one request
in the order asked (the worker breaks ties between equal priorities oldest first), so that the
keys worth most land first even when all are asked at once; the window only bounds what is
committed to one recipient before it shows that it takes them (a smaller one costs throughput:
each key that lands frees room a pass later)."""
INTERVAL = 0.02
"""Seconds between two passes, at least: what a pass costs is the keys on their way, a few
thousand at most."""
SHARE = 0.05
"""At most this share of the scheduler's time goes to the drain loop: after a pass that took t
seconds, the next waits at least t / SHARE. A pass reads every copy on its way, and passes at
:data:`INTERVAL` over thousands of 1 MiB keys would take CPU that the workers' transfers need on
a small machine (while the recipients have a window's worth queued); as the copies land, passes
get cheaper and closer together, so that the last key landing (the worker's close) is noticed
within about :data:`INTERVAL`, not a fixed back-off later."""
PASS_SECONDS = 0.02
"""A pass asks for keys for about this long (checked between drained workers, and every
:data:`_SLICE` keys of one): at a thousand workers, ten drained at once hold ten thousand keys to
rank and place, a quarter of a second in one pass; the rest are asked for on the next passes, in
their order. A pass' reading of the copies on their way and of the workers is not bounded by it."""
_SLICE = 256
MAX_INTERVAL = 0.5
"""Seconds between two passes, at most (a pass over very many keys)."""
REFILL = 0.5
"""A recipient is given more keys once at most this share of its window is on its way: windows are
refilled in large steps, not by a few keys after every pass (each ask is a pass at the short
interval), and a recipient still has half a window queued when they come."""
IN_FLIGHT_SECONDS = 10.0
"""How long a requested copy may take, plus its transfer time (:mod:`memops.scheduler.transfers`),
before it is asked again."""
NO_RECIPIENT_SECONDS = 5.0
"""How long a drain that sets its worker back when nothing can take its keys (``restore``) waits
for a paused worker to resume first: a recipient that the drain filled pauses until it has spilled."""
RESCAN_SECONDS = 1.0
"""How often a draining worker's keys are read again for keys that appeared since (tasks that
were running on it when the drain began)."""
UNLIMITED = 2**62
"""A recipient's headroom when it has no memory limit."""
SPILL_CHECK_KEYS = 100_000
"""At most this many of a drained worker's keys are asked about at once (whether they are spilled)."""
_PRUNE_KEYS = 10_000
"""At most this many keys are dropped from the head of a drain's order per pass (the rest next pass)."""
HOLD_SECONDS = 2.0
"""How long a drain waits for the hand-over's first answers before it copies keys over the network."""


class State:
    """A drained worker's state, as :func:`status` reports it."""

    DRAINING = "draining"
    DONE = "done"  # every key held only here has a copy elsewhere (closed, with ``close``)
    DEADLINE = "deadline"  # the deadline passed first; ``lost`` says what stayed
    NO_RECIPIENTS = "no-recipients"  # nothing could take its keys; set back to its old status
    GONE = "gone"  # left the scheduler before it was drained (died, or closed by someone else)


@dataclasses.dataclass(frozen=True)
class Key:
    """A key held only by workers being drained, as :func:`rank` sees it."""

    key: str
    nbytes: int
    irreplaceable: bool  # scattered, or its inputs are released: it cannot be recomputed cheaply
    seconds: float = 0.0  # what recomputing it costs (its prefix' average duration; 0: unknown)
    group: str | None = None  # spilled on a filesystem that these recipients share (a link moves it)


@dataclasses.dataclass(frozen=True)
class Recipient:
    name: str
    node: str | None  # None: not known, counts as another node than the dying ones
    headroom: int  # bytes it can still take (memory limit minus memory and what is coming)
    window: int  # bytes that may still be sent its way now (the window minus what is on its way)
    group: str | None = None  # its spill filesystem (:func:`handover.group`)
    room: int | None = None  # bytes it can take before its memory reaches its target (None: its headroom)
    queued: int = 0  # bytes on their way to it already


def value(key: Key) -> tuple[int, float, int, str]:
    """Sort key, the most valuable first: irreplaceable keys, then the most recompute seconds
    per byte moved, then the smallest (more keys per second), then by name (stable tables)."""
    per_byte = key.seconds / max(key.nbytes, 1) if key.seconds > 0 else 0.0
    return (0 if key.irreplaceable else 1, -per_byte, key.nbytes, key.key)


def rank(keys: Iterable[Key]) -> list[Key]:
    """The keys in the order a drain with a deadline moves them (see :func:`value`)."""
    return sorted(keys, key=value)


def assign(
    keys: Sequence[Key], recipients: Sequence[Recipient], dying_nodes: Collection[str], window: int = WINDOW_BYTES
) -> tuple[list[tuple[str, str]], list[str]]:
    """(key, recipient) for the ranked ``keys``, in their order, and the keys that fit nowhere.

    Recipients on nodes other than ``dying_nodes`` (or on no known node) first; those on a dying
    node only when no other has room (headroom: one whose window is full in this pass has room in
    the next, and the key waits for it rather than go to a node that is going). Among them, each
    key goes to the one with the fewest bytes on their way to it (``queued``, counting the keys
    given before it) that has ``room`` for it below its memory target, so that every recipient
    fetches an equal share and they finish together: a recipient gathers from one sender one
    message at a time, and the drain lasts as long as the busiest one's share (1 GiB split
    22/22/56% over three recipients took 1.15x the time of an even split, in
    ``bench/recipient_shares.py``). Once no recipient has room below its target, the one with the
    most headroom takes the key. A recipient's ``window`` bounds what it is given in this pass (a
    key larger than a whole window still goes to an idle recipient, alone); once a window is full,
    keys that find no room wait for the next pass. Unplaced keys: larger than every recipient's
    headroom (a smaller key after it may still fit).

    A key with a ``group`` (spilled where these recipients' spill directories are) goes first to
    a recipient of that group off the dying nodes, the one given the fewest such keys: a link
    costs neither network, nor memory (the key stays spilled), nor window. The caller gives
    keys a group only when their worker's node survives.
    """
    local: defaultdict[str, list[str]] = defaultdict(list)
    for r in recipients:
        if r.group is not None and not (r.node is not None and r.node in dying_nodes):
            local[r.group].append(r.name)
    linked: defaultdict[str, int] = defaultdict(int)
    tiers = (_Tier(window), _Tier(window))
    for r in recipients:
        tiers[1 if r.node is not None and r.node in dying_nodes else 0].add(r)
    chosen: list[tuple[str, str]] = []
    unplaced: list[str] = []
    for key in keys:
        group = local.get(key.group, ()) if key.group is not None else ()
        if (name := transfers.choose_recipient(group, rank=lambda n: (linked[n], n))) is not None:
            linked[name] += 1
            chosen.append((key.key, name))
            continue
        placed = None
        for tier in tiers:
            placed = tier.pick(key.nbytes)
            if placed is not None:
                tier.take(placed, key.nbytes)
                chosen.append((key.key, placed))
                break
            if tier.waiting:  # a recipient here has room in the next pass: not to the next tier
                break
        if placed is None and not any(t.waiting for t in tiers):
            unplaced.append(key.key)
    return chosen, unplaced


@dataclasses.dataclass
class _Place:
    """A recipient as :class:`_Tier` gives it keys."""

    queued: int  # bytes on their way to it
    headroom: int
    room: int  # below its memory target
    left: int  # of its window
    version: int = 0  # its heap entries of another version are stale; -1: it takes nothing more


class _Tier:
    """The recipients of one tier of :func:`assign`, as it gives them keys: two heaps over the same
    recipients, the fewest bytes queued first (among those with room below their target) and the
    most headroom first, whose entries a recipient's later state makes stale (``version``)."""

    def __init__(self, window: int):
        self.window = window
        self.places: dict[str, _Place] = {}
        self.balanced: list[tuple[int, int, str, int]] = []  # (queued, -headroom, name, version)
        self.roomiest: list[tuple[int, str, int]] = []  # (-headroom, name, version)
        self.waiting = False  # a recipient with room whose window is full in this pass

    def add(self, r: Recipient) -> None:
        room = r.headroom if r.room is None else min(r.room, r.headroom)
        self.places[r.name] = _Place(r.queued, r.headroom, room, r.window)
        self._push(r.name)

    def _push(self, name: str) -> None:
        place = self.places[name]
        if place.room > 0:
            heapq.heappush(self.balanced, (place.queued, -place.headroom, name, place.version))
        heapq.heappush(self.roomiest, (-place.headroom, name, place.version))

    def _full(self, place: _Place, nbytes: int) -> bool:
        if place.left < nbytes and place.left < self.window:
            place.version = -1  # its entries are stale: it takes nothing more in this pass
            self.waiting = True
            return True
        return False

    def pick(self, nbytes: int) -> str | None:
        """The recipient for a key of ``nbytes``, or None when none in this tier takes it now
        (:func:`transfers.choose_recipient`): the fewest bytes queued among those with
        room below their target, else the most headroom. One passed over in the balanced heap,
        without room below its target or with its window full, is not balanced further in this
        pass."""
        places = self.places

        def takes(name: str) -> bool:
            return not self._full(places[name], nbytes)

        name = transfers.choose_recipient(
            self._live(self.balanced), has_room=lambda n: places[n].room >= nbytes, takes=takes
        )
        if name is not None:
            return name
        return transfers.choose_recipient(
            self._live(self.roomiest), has_room=lambda n: places[n].headroom >= nbytes, takes=takes, by_room=True
        )

    def _live(self, heap: list[Any]) -> Iterator[str]:
        """The names in ``heap`` (entries ending in name and version), best first, its stale
        entries dropped; an entry that the reader asks past is dropped too."""
        while heap:
            *_, name, version = heap[0]
            if version == self.places[name].version:
                yield name
            heapq.heappop(heap)

    def take(self, name: str, nbytes: int) -> None:
        place = self.places[name]
        place.queued += nbytes
        place.headroom -= nbytes
        place.room -= nbytes
        place.left -= nbytes
        place.version += 1
        self._push(name)


def target_fraction() -> float:
    """The share of a worker's memory limit below which it keeps its data in memory: Dask's
    ``distributed.worker.memory.target`` (where it starts spilling), else ``spill``, else 1."""
    for name in ("target", "spill"):
        value = dask.config.get(f"distributed.worker.memory.{name}", False)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 1:
            return float(value)
    return 1.0


def pace(seconds: float) -> float:
    """Seconds to wait after a pass that took ``seconds`` (see :data:`SHARE`)."""
    return min(max(INTERVAL, seconds / SHARE), MAX_INTERVAL)


@dataclasses.dataclass
class Copy:
    """A key asked of a recipient, followed until it lands."""

    target: str
    nbytes: int
    asked: float  # monotonic
    source: str = ""  # the drained worker it is counted for (its replica may be dropped before we look)
    linked: bool = False  # handed over by a link on a shared spill filesystem, not copied

    def expired(self, now: float) -> bool:
        return transfers.expired(self.asked, self.nbytes, IN_FLIGHT_SECONDS, now)


@dataclasses.dataclass
class Drained:
    """One worker being drained."""

    address: str
    name: str  # the worker's name, by which a preStop hook finds it (also once it is gone)
    node: str | None
    deadline: float  # monotonic
    previous: str  # its status when the drain began, restored if nothing can take its keys
    close: bool
    restore: bool  # at the deadline: set back to ``previous`` (else it stays closing_gracefully)
    state: str = State.DRAINING
    order: list[Any] = dataclasses.field(default_factory=list)  # its keys, ranked, not yet asked for
    scanned: float = 0.0
    started: float = dataclasses.field(default_factory=time.monotonic)
    ended: float = 0.0
    keys_moved: int = 0  # each key once, however often its copy had to be made again
    bytes_moved: int = 0
    moved: set[Any] = dataclasses.field(default_factory=set)  # the keys counted in keys_moved
    keys_linked: int = 0  # of keys_moved: handed over by a link, no byte over the network
    bytes_linked: int = 0
    spilled: set[Any] = dataclasses.field(default_factory=set)  # its keys spilled on a shared filesystem
    spill_checked: float = 0.0
    spill_known: bool = False  # its worker has answered which keys are spilled (or could not)
    spill_task: asyncio.Task[None] | None = None
    asked: int = 0  # acquire-replicas asked, a key asked twice counting twice
    lost_keys: int = 0
    lost_bytes: int = 0
    lost_irreplaceable: int = 0
    lost: list[str] = dataclasses.field(default_factory=list)  # the first few, for the report
    # Keys counted lost at the deadline while a copy was on its way: key -> (bytes, irreplaceable).
    # One that lands after the deadline is moved, not lost.
    lost_on_the_way: dict[Any, tuple[int, int]] = dataclasses.field(default_factory=dict)
    lost_cause: str = "deadline"
    origin: str = ""  # who asked: ``preStop`` for the safety net's hook, else empty (the operator)
    node_dying: bool = True  # its node goes with it (a node drain, a preStop hook): recipients there last
    ended_at: float = 0.0  # wall clock, for the operator's record of what a hook's drain lost
    alone_since: float = 0.0  # monotonic: since when no worker could take its keys (0: one could)


LOST_NAMED = 20
"""The status names this many of the keys lost at the deadline."""


def _irreplaceable(ts: Any) -> bool:
    if ts.run_spec is None:
        return True  # scattered (or its spec is gone): nothing to recompute it from
    deps = ts.dependencies
    return bool(deps) and all(dep.state != "memory" for dep in deps)


def _seconds(ts: Any) -> float:
    prefix = getattr(ts, "prefix", None)
    duration = float(getattr(prefix, "duration_average", -1) or -1)
    return duration if duration > 0 else 0.0


def _nbytes(ts: Any) -> int:
    return int(ts.nbytes) if ts.nbytes >= 0 else int(ts.get_nbytes())


@dataclasses.dataclass
class _Asks:
    """What one pass of :class:`DrainPlugin` reads once and gathers while it goes over the drained workers."""

    dying_nodes: set[str]
    draining: AbstractSet[Any]  # the drained or otherwise leaving workers' WorkerStates: no safe copy
    from_source: Mapping[str, int]  # copies still on their way, by drained worker
    now: float
    until: float = float("inf")  # perf_counter: no more keys asked for in this pass after this (PASS_SECONDS)
    served: int = 0  # drained workers whose keys this pass has read
    batches: defaultdict[str, list[Any]] = dataclasses.field(default_factory=lambda: defaultdict(list))
    links: defaultdict[tuple[str, str], list[Any]] = dataclasses.field(default_factory=lambda: defaultdict(list))


class DrainPlugin(SchedulerPlugin):
    """The drains of one scheduler: one loop, every worker being drained, in ``scheduler.plugins``."""

    name = NAME

    def __init__(self, scheduler: Any):
        self.scheduler = scheduler
        self.workers: dict[str, Drained] = {}
        self.nodes: dict[str, str] = {}
        self.copies: dict[Any, Copy] = {}  # by task key
        self.task: asyncio.Task[None] | None = None
        self.window = WINDOW_BYTES
        self.handover = True  # hand spilled keys over by link where the recipient shares the spill filesystem
        self.installed = False
        self.identities: dict[str, dict[str, Any]] = {}  # worker address -> its spill identity
        self.links: set[asyncio.Task[None]] = set()
        self.identifying: asyncio.Task[None] | None = None
        # Set when a pass should not wait for its pace: a drain added, or a hand-over answer in
        # (the drains held for it go on at once).
        self.wake = asyncio.Event()
        self.turn = 0  # which drained worker a pass serves first

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
        for task in [*self.links, self.identifying, *(d.spill_task for d in self.workers.values())]:
            if task is not None:
                task.cancel()

    async def _identify(self) -> None:
        """Install the hand-over handler on the workers once, and learn each new worker's spill
        identity (a worker that gives none, or no plain one, is one that nothing is linked to)."""
        scheduler = self.scheduler
        if not self.installed:
            try:
                await handover.install(scheduler)
            except Exception:  # a worker that refuses the plugin: no hand-over, the drain goes on
                logger.exception("memops hand-over: the worker plugin could not be installed")
                self.handover = False
                self.wake.set()
                return
            self.installed = True
        for gone in set(self.identities) - set(scheduler.workers):
            del self.identities[gone]
        fresh = [a for a in scheduler.workers if a not in self.identities]
        if fresh:
            found = await asyncio.gather(*(handover.identify(scheduler, a) for a in fresh))
            self.identities.update(zip(fresh, found, strict=True))
        self.wake.set()

    def _group(self, address: str) -> str | None:
        return handover.group(self.identities.get(address)) if self.handover else None

    def _start_background(self, active: Mapping[str, Drained], groups: Collection[str], now: float) -> None:
        """The hand-over's questions to the workers, off the drain loop, so that a worker slow
        to answer never holds the loop: who shares a spill filesystem (new workers), and which of
        a drained worker's keys are spilled (when a recipient shares its filesystem)."""
        loop = asyncio.get_running_loop()
        fresh = not self.installed or any(a not in self.identities for a in self.scheduler.workers)
        if fresh and (self.identifying is None or self.identifying.done()):
            self.identifying = loop.create_task(self._identify())
        for drained in active.values():
            group = self._group(drained.address)
            if group is None or group not in groups:
                drained.spill_known = self.identifying is None or self.identifying.done()
                continue
            busy = drained.spill_task is not None and not drained.spill_task.done()
            if not busy and now - drained.spill_checked >= RESCAN_SECONDS:
                drained.spill_checked = now
                drained.spill_task = loop.create_task(self._check_spilled(drained))

    def _held(self, drained: Drained, now: float) -> bool:
        """Its keys wait for the hand-over's first answers, at most :data:`HOLD_SECONDS`: asked
        for before, a spilled key would be copied over the network instead of linked."""
        return self.handover and not drained.spill_known and now - drained.started < HOLD_SECONDS

    async def _check_spilled(self, drained: Drained) -> None:
        """Which of a drained worker's keys are spilled (asked of the worker)."""
        keys = [k for k in drained.order if k in self.scheduler.tasks][:SPILL_CHECK_KEYS]
        offered: Any = None
        if keys:
            try:
                offered = await handover.call(self.scheduler, drained.address, "offer", keys=keys)
            except handover.Refused as exc:
                logger.info("memops hand-over: no offer from %s (%s)", drained.address, exc)
        if isinstance(offered, (list, tuple)) and len(offered) == len(keys):
            drained.spilled = {k for k, item in zip(keys, offered, strict=True) if item is not None}
        else:
            drained.spilled = set()
        drained.spill_known = True
        self.wake.set()

    async def _link(self, source: str, target: str, keys: list[Any]) -> None:
        """Hand ``keys`` over from ``source`` to ``target`` by link; the rest by the normal transfer."""
        scheduler = self.scheduler
        directory = str(self.identities.get(source, {}).get("directory") or "")
        try:
            _linked, left = await handover.hand_over(scheduler, source, target, keys, directory)
        except Exception:
            logger.exception("memops hand-over from %s to %s failed", source, target)
            left = list(keys)
        now = time.monotonic()
        for key in left:
            copy = self.copies.get(key)
            if copy is not None and copy.target == target:
                self.copies[key] = dataclasses.replace(copy, linked=False, asked=now)
        left = [k for k in left if k in scheduler.tasks]
        if left and target in scheduler.workers:
            scheduler.request_acquire_replicas(target, left, stimulus_id=f"memops-drain-{time.time()}")

    # -- starting ------------------------------------------------------------------------------

    def add(
        self,
        addresses: Iterable[str],
        deadline: float,
        nodes: Mapping[str, str],
        close: bool,
        restore: bool,
        origin: str = "",
        node_dying: bool = True,
    ) -> None:
        scheduler = self.scheduler
        self.nodes.update({str(a): str(n) for a, n in nodes.items() if n})
        now = time.monotonic()
        stimulus_id = f"memops-drain-{time.time()}"
        for address in addresses:
            ws = scheduler.workers.get(address)
            known = self.workers.get(address)
            if ws is None or (known is not None and known.state == State.DRAINING):
                if known is not None:
                    self._merge(known, now + deadline, node_dying, restore)
                continue
            previous = ws.status.name
            if previous not in ("running", "paused"):
                previous = "running"
            self.workers[address] = Drained(
                address,
                str(ws.name),
                self.nodes.get(address),
                now + deadline,
                previous,
                close=close,
                restore=restore,
                origin=origin,
                node_dying=node_dying,
            )
            # As Scheduler.retire_workers: the scheduler's state at once, then the worker's.
            scheduler.handle_worker_status_change(Status.closing_gracefully, ws, stimulus_id)
            scheduler.stream_comms[address].send(
                {"op": "worker-status-change", "status": "closing_gracefully", "stimulus_id": stimulus_id}
            )
        self.wake.set()
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self.loop())

    def locate(self, nodes: Mapping[str, str]) -> None:
        """Where the workers run (address -> node), as the operator reads it from their pods;
        workers that left are forgotten. A drain's caller names only its own workers' nodes (a
        preStop hook: its own), so without this a neighbour on a dying node whose own hook has
        not started yet would look like a worker elsewhere, and take keys that must move again."""
        self.nodes.update({str(a): str(n) for a, n in nodes.items() if n})
        for address in [a for a in self.nodes if a not in self.scheduler.workers]:
            del self.nodes[address]

    def _merge(self, known: Drained, deadline: float, node_dying: bool, restore: bool) -> None:
        """A running drain asked for again (the operator's retirement, then a preStop hook or a
        node drain): the stricter of the two callers wins, whichever came first. The earlier
        deadline, since a caller whose pod is killed at its own deadline cannot wait for a later
        one; a node once said to be dying stays so (its keys not yet asked for go off it), since
        a caller that knows no more than an ordinary retirement cannot bring it back; and a worker
        whose pod is going (``restore`` false) is not set back to running at the deadline."""
        known.deadline = min(known.deadline, deadline)
        known.node_dying = known.node_dying or node_dying
        known.restore = known.restore and restore
        if known.node is None:  # the first caller did not say where the worker runs
            known.node = self.nodes.get(known.address)

    # -- the loop ------------------------------------------------------------------------------

    async def loop(self) -> None:
        while any(d.state == State.DRAINING for d in self.workers.values()):
            self.wake.clear()
            began = time.perf_counter()
            try:
                await self.step()
            except Exception:  # a pass that failed is tried again; the scheduler must go on
                logger.exception("memops drain pass failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), pace(time.perf_counter() - began))

    def _safe(self, ts: Any, draining: AbstractSet[Any]) -> bool:
        """Held by a worker that is not being drained (or forgotten: nothing to move)."""
        # A set comparison, not a loop: this runs for every key of a drained worker, per pass and
        # per status poll, on the scheduler's event loop.
        return ts is None or not ts.who_has or not ts.who_has <= draining

    async def step(self) -> None:
        """One pass, in four phases: copies landed or given up (:meth:`_follow_copies`), the
        recipients and their room (:meth:`_recipients`), keys asked for, one drained worker after
        the other (:meth:`_drain_worker`), and the asks sent (:meth:`_send`)."""
        scheduler = self.scheduler
        now = time.monotonic()
        active = {a: d for a, d in self.workers.items() if d.state == State.DRAINING}
        draining_ws = {scheduler.workers[a] for a in active if a in scheduler.workers}
        # Every worker drained, or in any other way leaving, holds no safe copy.
        leaving = {ws for ws in scheduler.workers.values() if ws.status.name not in ("running", "paused")}
        draining_ws |= leaving
        for address, drained in active.items():
            if address not in scheduler.workers:
                self._gone(drained, now)
        on_way, from_source = self._follow_copies(active, now)
        recipients = self._recipients(draining_ws, on_way)
        groups = {r.group for r in recipients if r.group is not None}
        if self.handover:
            self._start_background(active, groups, now)
        asks = _Asks(
            # Only a drain whose node goes too keeps recipients off it: an ordinary retirement's
            # node stays, and its neighbours take spilled keys by link, at no network cost.
            dying_nodes={d.node for d in active.values() if d.node and d.node_dying},
            draining=draining_ws,
            from_source=from_source,
            now=now,
        )
        asks.until = time.perf_counter() + PASS_SECONDS
        # The drained workers from a turning start: a pass that runs out of time (PASS_SECONDS)
        # serves the others first in the next one.
        turn = self.turn % len(active) if active else 0
        self.turn += 1
        for address, drained in [*list(active.items())[turn:], *list(active.items())[:turn]]:
            if drained.state == State.DRAINING:
                recipients = await self._drain_worker(address, drained, recipients, asks)
        self._send(asks)

    def _follow_copies(self, active: Mapping[str, Drained], now: float) -> tuple[dict[str, int], dict[str, int]]:
        """Copies landed (counted for their drained worker), or given up (asked again: back at the
        head of its order); the bytes still on their way to each recipient, and the copies still
        on their way from each drained worker."""
        scheduler = self.scheduler
        on_way: defaultdict[str, int] = defaultdict(int)
        from_source: defaultdict[str, int] = defaultdict(int)
        for key, copy in list(self.copies.items()):
            ts = scheduler.tasks.get(key)
            target = scheduler.workers.get(copy.target)
            if ts is None or not ts.who_has:
                del self.copies[key]
                continue
            if target is not None and target in ts.who_has:
                del self.copies[key]
                owner = self.workers.get(copy.source)
                if owner is not None:
                    if key not in owner.moved:
                        owner.moved.add(key)
                        owner.keys_moved += 1
                        owner.bytes_moved += copy.nbytes
                        if copy.linked:
                            owner.keys_linked += 1
                            owner.bytes_linked += copy.nbytes
                    landed_late = owner.lost_on_the_way.pop(key, None)
                    if landed_late is not None:
                        owner.lost_keys -= 1
                        owner.lost_bytes -= landed_late[0]
                        owner.lost_irreplaceable -= landed_late[1]
                        if str(key) in owner.lost:
                            owner.lost.remove(str(key))
                continue
            if target is None or target not in scheduler.running or copy.expired(now):
                del self.copies[key]  # asked again below, if still held only by drained workers
                owner = active.get(copy.source)
                if owner is not None:
                    owner.order.insert(0, key)
                continue
            if not copy.linked:  # a link takes neither memory nor the window
                on_way[copy.target] += copy.nbytes
            from_source[copy.source] += 1
        return on_way, from_source

    def _recipients(self, draining: AbstractSet[Any], on_way: Mapping[str, int]) -> list[Recipient]:
        """Running workers that are not drained, with their headroom and window."""
        recipients = []
        target = target_fraction()
        for ws in self.scheduler.running:
            if ws in draining:
                continue
            limit = int(ws.memory_limit or 0)
            queued = on_way.get(ws.address, 0)
            memory = ws.memory  # computed on each read: once per worker and pass
            used = max(int(memory.process), int(memory.optimistic)) + queued
            refill = queued <= self.window * REFILL
            recipients.append(
                Recipient(
                    ws.address,
                    self.nodes.get(ws.address),
                    (limit - used) if limit else UNLIMITED,
                    self.window - queued if refill else 0,
                    self._group(ws.address),
                    room=int(limit * target) - used if limit else UNLIMITED,
                    queued=queued,
                )
            )
        return recipients

    async def _drain_worker(
        self, address: str, drained: Drained, recipients: list[Recipient], asks: _Asks
    ) -> list[Recipient]:
        """One drained worker's part of a pass: stopped at its deadline, finished, given up for
        want of recipients, or its next keys asked for; returns the recipients as the next
        worker's keys see them (their headroom and windows less what this one took)."""
        scheduler, now = self.scheduler, asks.now
        ws = scheduler.workers[address]
        if now >= drained.deadline:
            self._stop_at_deadline(drained, ws, asks.draining, now)
            return recipients
        # This pass' time is up (PASS_SECONDS): no more keys ranked or asked for, served first in
        # the next pass. What needs no time is still decided for every drained worker in each
        # pass, with the recipients the pass began with: a retirement of every worker finds none
        # for all of them at once, as stock (a worker set back to running in one pass must not
        # take the keys of another in the next).
        out_of_time = asks.served > 0 and time.perf_counter() > asks.until
        if not out_of_time and now - drained.scanned > RESCAN_SECONDS:
            self._scan(drained, ws, asks.draining, now)
        if self._held(drained, now):
            return recipients
        # Read every key of the worker only once nothing is left to ask for or on its way.
        self._prune(drained, ws, asks.draining)
        if not drained.order and not asks.from_source.get(address) and self._drained(ws, asks.draining):
            await self._finish(drained, ws, now)
            return recipients
        if not recipients and drained.restore and not self.copies:
            # As stock: nothing can take its keys. But a paused worker may resume (one that
            # the drain itself filled pauses until it has spilled), so give up only when
            # none is paused, or after NO_RECIPIENT_SECONDS with none running.
            drained.alone_since = drained.alone_since or now
            waiting = any(w.status.name == "paused" and w not in asks.draining for w in scheduler.workers.values())
            if not waiting or now - drained.alone_since >= NO_RECIPIENT_SECONDS:
                await self._no_recipients(drained, ws, now)
            return recipients
        drained.alone_since = 0.0
        if out_of_time:
            return recipients
        asks.served += 1  # the first worker of a pass is always served: every drain progresses
        taken = self._ask_keys(address, drained, ws, recipients, asks)
        if not taken:
            return recipients
        return [
            dataclasses.replace(
                r,
                headroom=r.headroom - taken[r.name],
                window=r.window - taken[r.name],
                room=None if r.room is None else r.room - taken[r.name],
                queued=r.queued + taken[r.name],
            )
            if r.name in taken
            else r
            for r in recipients
        ]

    def _ask_keys(
        self, address: str, drained: Drained, ws: Any, recipients: list[Recipient], asks: _Asks
    ) -> defaultdict[str, int]:
        """Keys still to ask for, in rank order: held only by drained workers, not on their way;
        as many as the recipients' windows take (the rest wait, in order). Each is placed
        (:func:`assign`) and queued in ``asks``; returns the bytes each recipient was given."""
        scheduler = self.scheduler
        source_group = self._group(address)
        # Node-local recipients first only where the node survives: a drain whose node is
        # dying (a preStop hook, a node drain) keeps them last (see assign).
        prefer = source_group if drained.node is None or not drained.node_dying else None
        budget = sum(max(r.window, 0) for r in recipients)
        pending: list[Key] = []
        tasks: dict[str, Any] = {}
        kept: list[Any] = []
        index = 0
        until = asks.until
        for index, key in enumerate(drained.order):  # index: read after the loop
            if budget <= 0 or (index % _SLICE == _SLICE - 1 and time.perf_counter() > until):
                break
            if self._settled(key, ws, asks.draining):
                continue  # moved, forgotten, asked for, or left this worker: out of its order
            ts = scheduler.tasks[key]
            nbytes = _nbytes(ts)
            # Already ranked: names, sizes and where it is spilled suffice.
            pending.append(Key(str(key), nbytes, False, group=prefer if key in drained.spilled else None))
            tasks[str(key)] = key
            kept.append(key)
            budget -= nbytes
        else:
            index = len(drained.order)
        if not pending:
            drained.order = drained.order[index:]
            return defaultdict(int)
        chosen, _unplaced = assign(pending, recipients, asks.dying_nodes, self.window)  # the unplaced wait in order
        taken: defaultdict[str, int] = defaultdict(int)
        for name, target in chosen:
            key = tasks[name]
            nbytes = _nbytes(scheduler.tasks[key])
            # Linked wherever the recipient shares the spill filesystem, preferred or not.
            linked = source_group is not None and key in drained.spilled and self._group(target) == source_group
            self.copies[key] = Copy(target, nbytes, asks.now, source=address, linked=linked)
            if linked:
                asks.links[(address, target)].append(key)
            else:
                asks.batches[target].append(key)
                taken[target] += nbytes
            drained.asked += 1
        chosen_keys = {tasks[name] for name, _ in chosen}
        drained.order = [k for k in kept if k not in chosen_keys] + drained.order[index:]
        return taken

    def _send(self, asks: _Asks) -> None:
        """The pass' asks: copies requested of their recipients in one batch each, links started."""
        stimulus_id = f"memops-drain-{time.time()}"
        for target, keys in asks.batches.items():
            self.scheduler.request_acquire_replicas(target, keys, stimulus_id=stimulus_id)
        for (source, target), keys in asks.links.items():
            task = asyncio.get_running_loop().create_task(self._link(source, target, keys))
            self.links.add(task)
            task.add_done_callback(self.links.discard)

    def _prune(self, drained: Drained, ws: Any, draining: AbstractSet[Any]) -> None:
        """Drop the keys at the head of the order that need nothing more (:meth:`_settled`, as
        :meth:`_ask_keys` skips them), up to the first it would ask for: a drain whose keys all
        left while no recipient had room (none running, their windows full) ends, rather than wait
        for one. Cheap: it stops at the first key still at risk."""
        order = drained.order
        index = 0
        while index < len(order) and index < _PRUNE_KEYS and self._settled(order[index], ws, draining):
            index += 1
        if index:
            del order[:index]

    def _settled(self, key: Any, ws: Any, draining: AbstractSet[Any]) -> bool:
        """Whether a key of a drained worker's order needs nothing more from its drain: held by a
        worker that is not drained, forgotten, asked for already, or gone from ``ws``."""
        ts = self.scheduler.tasks.get(key)
        return self._safe(ts, draining) or key in self.copies or ws not in ts.who_has

    def _drained(self, ws: Any, draining: AbstractSet[Any]) -> bool:
        return all(self._safe(ts, draining) for ts in ws.has_what)

    def _scan(self, drained: Drained, ws: Any, draining: AbstractSet[Any], now: float) -> None:
        """Rank the keys held only by drained workers that are neither in this drain's order nor
        on their way: keys that appeared since the last scan (tasks that were running when the
        drain began), and keys whose copy is gone again. A copy that landed on a worker which then
        began draining too has two replicas on leaving workers, and the Active Memory Manager's
        ReduceReplicas drops one, often the recipient's: a rollout of several pods does this while
        the new pods are still starting. Level-based, as stock RetireWorker: what only drained
        workers hold is asked for until it is held elsewhere."""
        drained.scanned = now
        queued = set(drained.order)
        fresh = []
        for ts in ws.has_what:
            if ts.actor or ts.key in queued or ts.key in self.copies or self._safe(ts, draining):
                continue
            fresh.append(Key(str(ts.key), _nbytes(ts), _irreplaceable(ts), _seconds(ts)))
        if fresh:
            by_name = {str(ts.key): ts.key for ts in ws.has_what}
            ranked = [by_name[k.key] for k in rank(fresh)]
            # Appended: keys ranked earlier go first (they were worth the most when the drain began).
            drained.order.extend(ranked)

    def _stop_at_deadline(self, drained: Drained, ws: Any, draining: AbstractSet[Any], now: float) -> None:
        drained.state, drained.ended, drained.ended_at = State.DEADLINE, now, time.time()
        for ts in ws.has_what:
            if self._safe(ts, draining):
                continue
            drained.lost_keys += 1
            drained.lost_bytes += _nbytes(ts)
            drained.lost_irreplaceable += _irreplaceable(ts)
            if len(drained.lost) < LOST_NAMED:
                drained.lost.append(str(ts.key))
            if ts.key in self.copies:
                drained.lost_on_the_way[ts.key] = (_nbytes(ts), int(_irreplaceable(ts)))
        logger.warning(
            "memops drain of %s stopped at its deadline: %d keys (%d bytes) held nowhere else",
            drained.address,
            drained.lost_keys,
            drained.lost_bytes,
        )
        if drained.restore:
            self._set_status(ws, drained.previous)

    def _gone(self, drained: Drained, now: float) -> None:
        """The worker left mid-drain (its pod killed at the end of a short grace period): what it
        alone held and the drain had not moved is lost, cause ``worker left``."""
        drained.state, drained.ended, drained.ended_at = State.GONE, now, time.time()
        left = list(drained.order) + [k for k, c in self.copies.items() if c.source == drained.address]
        for key in left:
            ts = self.scheduler.tasks.get(key)
            if ts is not None and ts.who_has:
                continue  # a copy elsewhere (or recomputed since)
            drained.lost_keys += 1
            drained.lost_bytes += max(int(ts.nbytes), 0) if ts is not None else 0
            drained.lost_irreplaceable += ts is None or ts.run_spec is None
            if len(drained.lost) < LOST_NAMED:
                drained.lost.append(str(key))
        drained.lost_cause = "worker left"

    async def _no_recipients(self, drained: Drained, ws: Any, now: float) -> None:
        drained.state, drained.ended = State.NO_RECIPIENTS, now
        self._set_status(ws, drained.previous)

    def _set_status(self, ws: Any, status: str) -> None:
        stimulus_id = f"memops-drain-{time.time()}"
        self.scheduler.handle_worker_status_change(status, ws, stimulus_id)
        self.scheduler.stream_comms[ws.address].send(
            {"op": "worker-status-change", "status": status, "stimulus_id": stimulus_id}
        )

    async def _finish(self, drained: Drained, ws: Any, now: float) -> None:
        drained.state, drained.ended = State.DONE, now
        if drained.close:
            stimulus_id = f"memops-drain-{time.time()}"
            # As Scheduler._track_retire_worker once RetireWorker is done: closed, nanny included.
            await self.scheduler.remove_worker(ws.address, expected=True, close=True, stimulus_id=stimulus_id)

    # -- reporting -----------------------------------------------------------------------------

    def report(self, addresses: Collection[str] = ()) -> dict[str, Any]:
        scheduler = self.scheduler
        draining = {
            ws for a, d in self.workers.items() if d.state == State.DRAINING and (ws := scheduler.workers.get(a))
        }
        draining |= {ws for ws in scheduler.workers.values() if ws.status.name not in ("running", "paused")}
        now = time.monotonic()
        result: dict[str, Any] = {}
        for address, drained in self.workers.items():
            if addresses and address not in addresses:
                continue
            ws = scheduler.workers.get(address)
            unique_keys = unique_bytes = flight_keys = flight_bytes = 0
            if ws is not None:
                for ts in ws.has_what:
                    if self._safe(ts, draining):
                        continue
                    unique_keys += 1
                    unique_bytes += _nbytes(ts)
                    copy = self.copies.get(ts.key)
                    if copy is not None:
                        flight_keys += 1
                        flight_bytes += copy.nbytes
            result[address] = {
                "state": drained.state,
                "name": drained.name,
                "origin": drained.origin,
                "endedAt": round(drained.ended_at, 3),
                "node": drained.node or "",
                "connected": ws is not None,
                "uniqueKeys": unique_keys,
                "uniqueBytes": unique_bytes,
                "inFlightKeys": flight_keys,
                "inFlightBytes": flight_bytes,
                "keysMoved": drained.keys_moved,
                "bytesMoved": drained.bytes_moved,
                "keysLinked": drained.keys_linked,
                "bytesLinked": drained.bytes_linked,
                "asked": drained.asked,
                "seconds": round((drained.ended or now) - drained.started, 3),
                "deadlineIn": round(drained.deadline - now, 3),
                "lostAtDeadline": {
                    "keys": drained.lost_keys,
                    "bytes": drained.lost_bytes,
                    "irreplaceableKeys": drained.lost_irreplaceable,
                    "someKeys": list(drained.lost),
                    "cause": drained.lost_cause,
                }
                if drained.state in (State.DEADLINE, State.GONE)
                else None,
            }
        return result


def _plugin(dask_scheduler: Any) -> DrainPlugin:
    plugin = dask_scheduler.plugins.get(NAME)
    if plugin is None:
        plugin = DrainPlugin(dask_scheduler)
        dask_scheduler.add_plugin(plugin, name=NAME)
    return plugin  # type: ignore[no-any-return]


def start(
    dask_scheduler: Any,
    workers: Sequence[str] = (),
    names: Sequence[str] = (),
    deadline: float = 60.0,
    nodes: Mapping[str, str] | None = None,
    close: bool = True,
    restore: bool = False,
    window: int = WINDOW_BYTES,
    origin: str = "",
    handover: bool = True,
    nodes_dying: bool = True,
) -> dict[str, Any]:
    """Run on the scheduler (by the agent's ``drain`` operation): start draining these workers
    (by address, or by name), each with ``deadline`` seconds from now; returns at once, with
    :func:`status` of the workers started.

    ``nodes``: worker address (or name) -> its node; a worker not in it counts as on another
    node than the drained ones. ``nodes_dying``: the drained workers' nodes go with them (a node
    drain, a preStop hook), so recipients there take keys only when no other has room; False (an
    ordinary retirement, a scale-down): those nodes stay, and a recipient there that shares the
    spill filesystem takes the spilled keys first, by link. ``close``: close and remove a worker
    once drained. ``restore``: at the deadline, set a worker back to the status it had (so that
    a worker that stays is used again), instead of leaving it ``closing_gracefully`` (its pod is going anyway). A worker
    already being drained keeps its drain, with the earlier of the two deadlines, its node dying
    and its status left at the deadline if either caller says so, and its first caller's ``close``
    and ``origin``. ``window``:
    bytes on their way to one recipient at a time (:data:`WINDOW_BYTES`), for every drain.
    ``origin``: who asked, reported back (``preStop``: the safety net's hook, whose losses the
    operator records in the policy's status, as it cannot see them in a RetirementRequest).
    ``handover``: hand spilled keys over by link to recipients that share the spill filesystem
    (:mod:`memops.worker.handover`), for every drain; False: every key by the normal transfer.
    """
    by_name = {str(ws.name): ws.address for ws in dask_scheduler.workers.values()}
    addresses = [str(a) for a in workers] + [by_name[str(n)] for n in names if str(n) in by_name]
    # A preStop hook knows its worker's name, not its address.
    located = {by_name.get(str(w), str(w)): str(node) for w, node in (nodes or {}).items()}
    plugin = _plugin(dask_scheduler)
    plugin.window = max(int(window), 1)
    plugin.handover = bool(handover)
    plugin.add(
        addresses,
        float(deadline),
        located,
        bool(close),
        bool(restore),
        origin=str(origin)[:32],
        node_dying=bool(nodes_dying),
    )
    return plugin.report(addresses)


def status(
    dask_scheduler: Any,
    workers: Sequence[str] = (),
    names: Sequence[str] = (),
    nodes: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Run on the scheduler (by the agent's ``drain_status`` operation): each drained worker's
    figures (all of them when neither ``workers`` nor ``names`` is given), as plain data.

    ``nodes`` (worker address -> node, as the operator reads it on each pass) is recorded first
    (:meth:`DrainPlugin.locate`), for the drains that callers start later."""
    if nodes:
        _plugin(dask_scheduler).locate(nodes)
    plugin: DrainPlugin | None = dask_scheduler.plugins.get(NAME)
    if plugin is None:
        return {}
    by_name = {str(ws.name): ws.address for ws in dask_scheduler.workers.values()}
    wanted = [str(a) for a in workers] + [by_name.get(str(n), "") for n in names]
    if names:
        # A worker gone is no longer found by name: find it among the drained by its recorded name.
        wanted += [a for a, d in plugin.workers.items() if d.name in names]
    return plugin.report([w for w in wanted if w]) if (workers or names) else plugin.report()
