"""Pressure relief: an Active Memory Manager policy that runs inside the scheduler.

When a worker's process memory passes ``above`` (a share of its memory limit), keys move from
it to workers with headroom, worker to worker, until it is under ``to``: before it spills,
pauses (80%) or its nanny kills it (95%). An operator round trip is too slow for that, so this
runs in the scheduler, on its own Active Memory Manager with a short interval.

Replicate, then drop: a key on the hot worker is first copied to a peer (``replicate``); once
the copy exists the hot worker's replica is dropped (``drop`` with the hot worker as the only
candidate), on the next cycle after the copy lands. A key therefore always has at least one
copy. The scheduler's own ReduceReplicas (every 2 s by default), if it sees the two copies
first, drops the one on the worker with the most memory in bytes: the hot one, unless the
recipient has a larger limit and more bytes; then relief sees the key alone on the hot worker
again and moves it again later. Workers being retired or closed (RetireWorker's
``closing_gracefully``) are neither relieved nor sent keys, and a copy held only by such a
worker does not count as a copy. Paused workers are relieved (a paused worker still serves
its data, and ReduceReplicas drops from it first too) but are never sent keys. No key is sent
to a worker that it would push over ``above``, nor to a worker that was itself relieved in the
last 30 s (it filled up once and may again; keys sent back would only move twice). When keys
are left on a hot worker because no peer has room for them, the worker is *starved*: the
operator then asks for more workers.

The module imports nothing from memops but :mod:`memops.scheduler.transfers` (sent with it):
the operator sends it to the scheduler by value over the comm, with memops' agent
(:mod:`memops.scheduler.agent`), so a stock Dask image runs it; the agent's comm handler
answers the operator's calls (:func:`configure`). :func:`choose` is pure and decides
everything; :class:`PressureRelief` only reads the scheduler's state for it and turns its plan
into AMM suggestions.
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from collections.abc import Collection, Generator, Mapping, Sequence
from typing import Any

from distributed.active_memory_manager import ActiveMemoryManagerExtension, ActiveMemoryManagerPolicy, Suggestion
from distributed.diagnostics.plugin import SchedulerPlugin

from memops.scheduler import transfers

NAME = "memops-pressure-relief"
LANDING = 2.0
"""A copy on its way costs its recipient about twice its size: the frames received, then the
object made from them (and the allocator does not hand the frames back to the system at once)."""


def landing_cost(landed: float, heard: float) -> float:
    """What a copy costs its recipient in multiples of its size, beyond the process memory that
    the scheduler last heard from it (``heard``: the heartbeat's wall-clock time): the whole
    :data:`LANDING` while on its way (``landed`` 0) and after it landed until a heartbeat has
    shown it; nothing after. The scheduler's ``optimistic`` memory does not cover a key landed
    since the heartbeat: ``MemoryState`` caps it at the process memory, so it is never the larger
    of the two (counting such a key at ``LANDING - 1`` let a peer go past ``above``)."""
    return LANDING if not landed or landed > heard else 0.0


FORGET_SECONDS = 60.0
"""How long a move that relief gave up on is still followed, to count it if the key leaves."""
COOLING_SECONDS = 30.0
"""A worker relieved this recently is sent no keys (see :func:`choose`'s ``cooling``)."""
IN_FLIGHT_SECONDS = 5.0
"""How long a planned copy or drop may take, plus its transfer time
(:mod:`memops.scheduler.transfers`), before relief gives up on it (the copy went nowhere, or the
worker kept its replica) and plans that key afresh."""


@dataclasses.dataclass(frozen=True)
class Load:
    """One worker as relief sees it."""

    name: str
    process: int  # bytes: the process' memory as the scheduler last learnt it
    limit: int  # bytes: the worker's memory limit (0: none, never relieved nor a recipient)
    running: bool = True  # False: paused or leaving: it is sent no keys
    leaving: bool = False  # being retired or closed: left alone entirely


@dataclasses.dataclass(frozen=True)
class Key:
    key: str
    nbytes: int
    holders: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Plan:
    drops: tuple[tuple[str, str], ...] = ()  # (key, hot worker): a copy on a staying peer exists already
    copies: tuple[tuple[str, str, str], ...] = ()  # (key, hot worker, recipient)
    hot: tuple[str, ...] = ()  # the workers being relieved; pass them back as ``relieving`` next time
    starved: tuple[str, ...] = ()  # hot workers that keep keys that no peer has room for


def _size(key: Key) -> int:
    return key.nbytes


def needs_relief(
    worker: Load, *, above: float, to: float, freed: Mapping[str, int], relieving: Collection[str]
) -> bool:
    """Over ``above``, or still over ``to`` after it went over ``above`` (``relieving``), counting
    the bytes already on their way off it as gone."""
    if worker.leaving or not worker.limit:
        return False
    left = worker.process - freed.get(worker.name, 0)
    return left > above * worker.limit or (worker.name in relieving and left > to * worker.limit)


def _rooms(
    workers: Sequence[Load], excluded: Collection[str], incoming: Mapping[str, int], *, above: float
) -> list[tuple[float, str]]:
    """The peers that may take keys (running, staying, limited, not ``excluded``) as a heap of
    (minus their headroom under ``above``, name): the most room first, so that a key that does
    not fit on the first fits nowhere."""
    rooms = [
        (w.process + incoming.get(w.name, 0) - above * w.limit, w.name)
        for w in workers
        if w.running and not w.leaving and w.limit and w.name not in excluded
    ]
    heapq.heapify(rooms)
    return rooms


def _recipient(rooms: list[tuple[float, str]], cost: int) -> str | None:
    """The peer with the most room, if the copy fits there (:func:`transfers.choose_recipient`): the heap's
    top alone is offered, as the most room first means that no other peer fits it either."""
    return transfers.choose_recipient(
        (name for _, name in rooms[:1]), has_room=lambda _: cost <= -rooms[0][0], by_room=True
    )


def _plan_moves(
    worker: str,
    keys: Sequence[Key],
    *,
    need: int,
    rooms: list[tuple[float, str]],
    leaving: Collection[str],
    landing: float,
) -> tuple[list[tuple[str, str]], list[tuple[str, str, str]], bool, int]:
    """One hot worker's moves until ``need`` bytes are off it: drops of the keys with a copy on
    another staying worker first (no transfer), then copies of the largest keys, each to the peer
    with the most room (``rooms``, a heap, updated). Returns the drops, the copies, whether a key
    fitted on no peer, and the bytes still to move."""
    largest_first = sorted(keys, key=_size, reverse=True)  # stable: ties keep their order
    elsewhere: list[Key] = []
    only_here: list[Key] = []
    for key in largest_first:
        copied = len(key.holders) > 1 and any(h != worker and h not in leaving for h in key.holders)
        (elsewhere if copied else only_here).append(key)
    drops: list[tuple[str, str]] = []
    copies: list[tuple[str, str, str]] = []
    unplaced = False
    for key in elsewhere:
        if need <= 0:
            break
        drops.append((key.key, worker))
        need -= key.nbytes
    for key in only_here:
        if need <= 0:
            break
        cost = int(landing * key.nbytes)
        recipient = _recipient(rooms, cost)
        if recipient is None:
            unplaced = True
            continue  # a smaller key may still fit somewhere
        minus_room, _ = heapq.heappop(rooms)
        heapq.heappush(rooms, (minus_room + cost, recipient))
        copies.append((key.key, worker, recipient))
        need -= key.nbytes
    return drops, copies, unplaced, need


def choose(
    workers: Sequence[Load],
    keys: Mapping[str, Sequence[Key]],
    *,
    above: float,
    to: float,
    freed: Mapping[str, int] | None = None,
    incoming: Mapping[str, int] | None = None,
    relieving: Collection[str] = (),
    cooling: Collection[str] = (),
    landing: float = 1.0,
) -> Plan:
    """What to move off the workers that need relief so that each ends under ``to``.

    ``keys[worker]``: the keys in memory on that worker (only those of the workers that need
    relief are read). ``freed`` / ``incoming``: bytes already on their way off / onto a worker
    (planned earlier, not yet in its reported memory). ``relieving``: the workers that the last
    plan was relieving (its ``hot``): they go on until under ``to``, not only until under ``above``.
    ``cooling``: workers relieved a short while ago, which are sent no keys: they filled up once
    and may again (a worker that tasks keep landing on), and keys sent back to them would move
    twice, or back and forth. ``landing``: what a copy costs its recipient while it arrives, in
    multiples of the key's size (``incoming`` is counted so already).

    Keys with a copy on another staying worker are dropped first (no transfer); then the largest
    keys are copied, each to the running peer with the most headroom under ``above`` (bytes), if
    it stays under ``above`` with it. A worker that still needs relief once its keys are all planned is not starved (its
    memory is not Dask data, which moving cannot help); one whose keys fit on no peer is, and it
    stays among the workers being relieved until it is under ``to``.
    """
    freed = freed or {}
    leaving = {w.name for w in workers if w.leaving}
    candidates = sorted(
        (w for w in workers if needs_relief(w, above=above, to=to, freed=freed, relieving=relieving)),
        key=lambda w: (w.limit * above - w.process, w.name),  # the most over first
    )
    rooms = _rooms(workers, {w.name for w in candidates} | set(cooling), incoming or {}, above=above)
    drops: list[tuple[str, str]] = []
    copies: list[tuple[str, str, str]] = []
    hot: list[str] = []
    starved: list[str] = []
    for worker in candidates:
        need = worker.process - freed.get(worker.name, 0) - int(to * worker.limit)
        planned_drops, planned_copies, unplaced, need = _plan_moves(
            worker.name, keys.get(worker.name, ()), need=need, rooms=rooms, leaving=leaving, landing=landing
        )
        drops += planned_drops
        copies += planned_copies
        starving = need > 0 and unplaced
        # Over relieveAbove it is hot whatever happens; between the two thresholds only while
        # there is something to do, so that a worker whose memory is not keys is let go.
        if (
            worker.process - freed.get(worker.name, 0) > above * worker.limit
            or planned_drops
            or planned_copies
            or starving
        ):
            hot.append(worker.name)
        if starving:
            starved.append(worker.name)
    return Plan(tuple(drops), tuple(copies), tuple(hot), tuple(starved))


@dataclasses.dataclass
class Move:
    """One key on its way off a hot worker, as :class:`PressureRelief` follows it."""

    source: str  # the hot worker's address
    nbytes: int
    target: str  # the recipient of its copy; "" when a copy existed already (a plain drop)
    planned: float  # wall clock, as WorkerState.last_seen
    dropping: bool = False  # the hot worker's replica has been asked to go
    left: float = 0.0  # when the key was seen gone from the hot worker (0: not yet)
    landed: float = 0.0  # when its copy was seen on the recipient (0: not yet)

    def expired(self, now: float) -> bool:
        """Given up: the copy never landed (the recipient went away, or a drop was refused)."""
        return not self.left and transfers.expired(self.planned, self.nbytes, IN_FLIGHT_SECONDS, now)


class PressureRelief(ActiveMemoryManagerPolicy):
    """The AMM policy: reads the scheduler's state, asks :func:`choose`, suggests the moves."""

    def __init__(self, above: float, to: float):
        self.above = above
        self.to = to
        self.keys_moved = 0
        self.bytes_moved = 0
        self.hot: tuple[str, ...] = ()
        self.starved: tuple[str, ...] = ()
        self.moves: dict[Any, Move] = {}  # by task key
        self.relieved: dict[str, float] = {}  # worker address -> when it was last relieved (wall clock)

    def __repr__(self) -> str:
        return (
            f"PressureRelief(above={self.above}, to={self.to}, moved={self.keys_moved} keys/{self.bytes_moved} B,"
            f" hot={list(self.hot)}, starved={list(self.starved)}, moving={len(self.moves)})"
        )

    def run(self) -> Generator[Suggestion, Any, None]:
        """Follow the moves under way, then plan afresh for the workers that need relief (:func:`choose`)."""
        scheduler = self.manager.scheduler
        now = time.time()  # wall clock, as WorkerState.last_seen (the last heartbeat)
        by_address = dict(scheduler.workers)
        freed, incoming = yield from self._follow(by_address, now)
        # Process memory is as old as the last heartbeat; what landed since is in ``incoming``.
        loads = [
            Load(
                ws.address,
                int(ws.memory.process),
                int(ws.memory_limit or 0),
                running=ws in scheduler.running,
                leaving=ws.status.name not in ("running", "paused"),
            )
            for ws in by_address.values()
        ]
        relieving = set(self.hot)
        self.relieved.update(dict.fromkeys(relieving, now))
        self.relieved = {w: t for w, t in self.relieved.items() if now - t < COOLING_SECONDS and w in by_address}
        hot = [w.name for w in loads if needs_relief(w, above=self.above, to=self.to, freed=freed, relieving=relieving)]
        if not hot:
            self.hot, self.starved = (), ()
            return
        tasks, keys = self._keys(hot, by_address, now)
        plan = choose(
            loads,
            keys,
            above=self.above,
            to=self.to,
            freed=freed,
            incoming=incoming,
            relieving=relieving,
            cooling=set(self.relieved),
            landing=LANDING,
        )
        self.hot, self.starved = plan.hot, plan.starved
        for key, source in plan.drops:
            ts = tasks[key]
            if (yield Suggestion("drop", ts, {by_address[source]})) is not None:
                self.moves[ts.key] = Move(source, int(ts.nbytes), "", now, dropping=True)
        for key, source, target in plan.copies:
            ts = tasks[key]
            chosen = yield Suggestion("replicate", ts, {by_address[target]})
            if chosen is not None:
                self.moves[ts.key] = Move(source, int(ts.nbytes), chosen.address, now)

    def _follow(
        self, by_address: Mapping[str, Any], now: float
    ) -> Generator[Suggestion, Any, tuple[dict[str, int], dict[str, int]]]:
        """The moves under way: counted once their key left the hot worker, its replica dropped
        once the copy landed, forgotten once both workers' memory shows them. Returns the bytes
        still leaving each hot worker and still coming to each recipient."""
        scheduler = self.manager.scheduler
        freed: dict[str, int] = {}
        incoming: dict[str, int] = {}
        for key, move in list(self.moves.items()):
            ts = scheduler.tasks.get(key)
            hot_ws = by_address.get(move.source)
            holders = (ts.who_has or set()) if ts is not None else set()
            if ts is None or hot_ws is None or now > move.planned + FORGET_SECONDS:
                del self.moves[key]  # released, its worker gone, or long given up on
                continue
            if not move.left and hot_ws not in holders:
                # Gone from the hot worker: dropped by this policy, or by ReduceReplicas once
                # the copy existed (even after relief gave up waiting for it). Either way a move
                # that relief made; count it once.
                move.left = now
                self.keys_moved += 1
                self.bytes_moved += move.nbytes
            if move.expired(now):
                continue  # given up on: planned afresh, and only kept to be counted if it leaves
            if not move.left and not move.dropping and len(holders) >= 2:
                # The copy has landed (or existed): drop the hot worker's replica now.
                move.dropping = (yield Suggestion("drop", ts, {hot_ws})) is not None
            # Leaving bytes count until the worker's memory shows them gone: while the key is on
            # it, and after it left until the next heartbeat (process memory is a heartbeat old).
            gone_shown = bool(move.left) and move.left <= hot_ws.last_seen
            if not gone_shown:
                freed[move.source] = freed.get(move.source, 0) + move.nbytes
            # Bytes coming to a recipient count until its process memory shows them: on their
            # way, and after they landed until its next heartbeat (landing_cost). A key gone from
            # the hot worker that never reached the recipient is not coming to it any more.
            recipient = by_address.get(move.target)
            cost = 0.0
            if recipient is not None:
                if recipient in holders and not move.landed:
                    move.landed = now
                if move.landed or not gone_shown:
                    cost = landing_cost(move.landed, recipient.last_seen)
                    incoming[move.target] = incoming.get(move.target, 0) + int(cost * move.nbytes)
            if gone_shown and not cost:
                del self.moves[key]  # both workers' memory shows it: done
        return freed, incoming

    def _keys(
        self, hot: Sequence[str], by_address: Mapping[str, Any], now: float
    ) -> tuple[dict[str, Any], dict[str, list[Key]]]:
        """The hot workers' keys in memory that are not already on their way, as :func:`choose`
        reads them (names as strings), and the tasks by those names."""
        tasks = {}
        keys: dict[str, list[Key]] = {}
        for address in hot:
            keys[address] = []
            for ts in by_address[address].has_what:
                if ts.key in self.moves and not self.moves[ts.key].expired(now):
                    continue  # already on its way
                tasks[str(ts.key)] = ts  # choose() speaks strings
                keys[address].append(Key(str(ts.key), int(ts.nbytes), tuple(w.address for w in ts.who_has or ())))
        return tasks, keys

    def state(self) -> dict[str, Any]:
        return {
            "above": self.above,
            "to": self.to,
            "keysMoved": self.keys_moved,
            "bytesMoved": self.bytes_moved,
            "hot": list(self.hot),
            "starved": list(self.starved),
        }


class ReliefPlugin(SchedulerPlugin):
    """Runs :class:`PressureRelief` on its own Active Memory Manager every ``interval`` seconds.

    Its own manager, not the scheduler's: that one runs every 2 s by default, and the nanny's
    monitor every 100 ms. Kept in ``scheduler.plugins`` under :data:`NAME`, so that it is found
    again, and stopped with the scheduler. memops' agent (:mod:`memops.scheduler.agent`) calls
    :func:`configure` for the operator, so relief is retuned, read and removed by a plain RPC.
    ``owner`` names the MemoryPolicy that installed it: one scheduler has one relief, which only
    its owner retunes or removes.
    """

    name = NAME

    def __init__(self, scheduler: Any, above: float, to: float, interval: float, owner: str = ""):
        self.scheduler = scheduler
        self.owner = owner
        self.interval = interval
        self.policy = PressureRelief(above, to)
        self.manager = ActiveMemoryManagerExtension(
            scheduler, {self.policy}, register=False, start=True, interval=interval
        )

    async def close(self) -> None:
        self.manager.stop()


def configure(
    dask_scheduler: Any, above: float | None, to: float | None, owner: str = "", interval: float = 0.25
) -> dict[str, Any] | None:
    """Run on the scheduler (by the agent's ``relief`` operation): install, retune or
    (``above=None``) remove relief.

    Idempotent, so the operator calls it on every pass: a restarted scheduler gets relief back,
    a changed policy retunes it in place. Returns the thresholds, counters and owner, or None if
    there is no relief (removed, or never installed). Relief that another ``owner`` installed is
    left as it is, and its state returned, so that two policies on one scheduler never take turns.
    """
    plugin = dask_scheduler.plugins.get(NAME)
    if plugin is not None and getattr(plugin, "owner", "") not in ("", owner):
        return {**plugin.policy.state(), "owner": plugin.owner}
    if above is None or to is None:
        if plugin is not None:
            plugin.manager.stop()
            dask_scheduler.remove_plugin(NAME)
        dask_scheduler.handlers.pop(NAME, None)  # relief's own handler, from before the agent
        return None
    if plugin is None:
        plugin = ReliefPlugin(dask_scheduler, above, to, interval, owner)
        dask_scheduler.add_plugin(plugin, name=NAME)
    plugin.owner = owner
    plugin.policy.above, plugin.policy.to = above, to
    return {**plugin.policy.state(), "owner": owner}
