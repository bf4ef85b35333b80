"""The ruled keys of replication targets, kept up to date from the scheduler's own changes.

A replication pass (:mod:`memops.scheduler.replication`) needs the ruled keys, how many copies
each has against its target, and which of them are off target. Reading every key for that costs
seconds at a million keys. :class:`Index` keeps those answers and updates them from what changes:

- replicas: the scheduler records every copy gained or lost in three methods of its own
  (``add_replica``, ``remove_replica``, ``remove_all_replicas``: a task reaching memory, a
  worker's ``add-keys``, the AMM's copies and drops, a worker removed, a key released or
  forgotten). :meth:`Index.attach` wraps them on the scheduler instance so that each call notes
  its ``TaskState`` (a set add); a plugin's ``transition`` hook would miss most of them, since
  a copy made or dropped is no transition;
- workers: which workers are leaving (retired or closing) and which a pod rule marks, compared
  once a pass (one read per worker); the keys of a worker that changed are read again;
- rules: a key rule's keys are found through the index's own sets of the keys in memory by
  (prefix, scattered), a pod rule's through its workers' keys; only those are read again.

:meth:`Index.update` reads noted keys for at most :data:`READ_SECONDS` a pass, so a pass costs
what changed and its time stays bounded when much changes at once (a rule over 100,000 keys, or
the first build): the rest are read on the next passes. :func:`recompute` is the full scan that
the index stands for; tests compare the two. The same hooks keep the workers' holdings
(:class:`memops.scheduler.holdings.Shares`: each worker's bytes that another also holds), which
the agent answers from while a rule is in force.

Imports only the standard library and its siblings :mod:`rules` and :mod:`holdings`: the operator sends it by value
with memops' agent. Nothing here reads what a peer sent but the scheduler's own objects.
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from memops.scheduler import holdings
from memops.scheduler import rules as ruling

MAX_READS_PER_PASS = 50_000
READ_SECONDS = 0.02
"""Noted keys that one pass reads: at most this many, for at most this long (a few µs each): bounds
a pass after a rule over many keys, a lost worker or the first build; the rest are read on the
next passes."""
_SLICE = 256  # keys read between two looks at the clock: a slice takes a few ms on a busy machine
HOOKED = ("add_replica", "remove_replica", "remove_all_replicas")
_MISSING: Any = object()


class Entry:
    """One ruled key in memory, as the index last read it (read-only; slots: a million of them may exist)."""

    __slots__ = ("count", "extra", "generation", "goal", "nbytes", "off", "over", "under")
    compared = ("count", "extra", "goal", "nbytes", "off", "over", "under")

    def __init__(
        self, goal: ruling.Target, count: int, nbytes: int, off: bool, under: bool, over: bool, generation: int = 0
    ):
        self.generation = generation  # the Index' generation (its rules) when read
        self.goal = goal
        self.count = count  # copies held
        self.nbytes = nbytes
        self.off = (
            off  # handed to the decision: not at target, a copy on its way, a holder leaving, or only on marked pods
        )
        self.under = under  # fewer copies than its target, or every copy on a marked pod
        self.over = over  # more copies than its target
        self.extra = nbytes * (count - 1)  # bytes of its copies beyond the first

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Entry) and all(getattr(self, a) == getattr(other, a) for a in self.compared)

    def __repr__(self) -> str:
        return "Entry(" + ", ".join(f"{a}={getattr(self, a)!r}" for a in self.__slots__) + ")"


@dataclasses.dataclass
class Totals:
    """Sums over every indexed key, kept with the index."""

    under: int = 0
    bytes_under: int = 0
    over: int = 0
    bytes_over: int = 0
    spent: int = 0  # bytes of copies beyond the first

    def add(self, entry: Entry, sign: int) -> None:
        if entry.under:
            self.under += sign
            self.bytes_under += sign * entry.nbytes
        elif entry.over:
            self.over += sign
            self.bytes_over += sign * entry.nbytes * (entry.count - entry.goal.replicas)
        self.spent += sign * entry.extra


class Index:
    """Ruled keys in memory (:attr:`entries`), those off target (:attr:`off`, oldest read first)
    and their :class:`Totals`, for one scheduler and one set of rules."""

    def __init__(self, rules: ruling.Rules):
        self.rules = rules
        self.generation = 0  # one more with each change of rules: an Entry read before may be stale
        self.scheduler: Any = None
        self.entries: dict[Any, Entry] = {}  # TaskState -> Entry
        # TaskStates whose Entry is off, in the order they were read. An OrderedDict: a dict whose
        # front was deleted from walks over the holes on every iteration from the front.
        self.off: OrderedDict[Any, None] = OrderedDict()
        self.totals = Totals()
        self.held: dict[tuple[Any, bool], set[Any]] = {}  # (TaskPrefix, scattered) -> its keys in memory
        self.noted: set[Any] = set()  # TaskStates changed since they were read (the hooks add to it)
        self.backlog: list[Any] = []  # TaskStates to read again in bulk (the first build, a rule)
        self.cursor = 0
        self.wanted_by_group: dict[tuple[Any, bool], int] = {}
        self.goals: dict[tuple[int, tuple[int, ...]], ruling.Target | None] = {}
        self.marked_by_rule: list[set[Any]] = []  # the WorkerStates that each pod rule marks
        self.marked: set[Any] = set()
        self.leaving: set[Any] = set()  # WorkerStates being retired or closed
        self.in_flight: Mapping[Any, Any] = {}  # key -> copy on its way (the policy's): such a key is off
        self.shares = holdings.Shares()  # the workers' replicated bytes, from the same hooks
        self.hooks: dict[str, tuple[Any, Any]] = {}  # method name -> (the scheduler's, the wrapper)
        self.active = [False]  # read by the wrappers: off once detached

    def __repr__(self) -> str:
        return f"Index(ruled={len(self.entries)}, off={len(self.off)}, pending={self.pending})"

    @property
    def pending(self) -> int:
        """Keys noted but not read yet."""
        return len(self.noted) + len(self.backlog) - self.cursor

    # -- following the scheduler -----------------------------------------------------------------

    def attach(self, scheduler: Any) -> None:
        """Start following ``scheduler``: wrap its replica methods, and queue every key for a first read."""
        if self.scheduler is scheduler and self.active[0]:
            return
        self.detach()
        self.scheduler = scheduler
        self.active = active = [True]
        noted, changed = self.noted, self.shares.noted
        for name in HOOKED:
            original = getattr(scheduler, name)
            wrapper = _note_after(original, noted, changed, active)
            setattr(scheduler, name, wrapper)
            self.hooks[name] = (original, wrapper)
        self.entries, self.off, self.totals, self.held = {}, OrderedDict(), Totals(), {}
        self.noted.clear()
        self.shares.reset(scheduler.replicated_tasks)
        self.backlog, self.cursor = list(scheduler.tasks.values()), 0
        self.leaving, self.marked_by_rule, self.marked = set(), [], set()
        self.follow_workers(scheduler.workers)

    def detach(self) -> None:
        """Stop following: the scheduler's methods back as they were (or, if something wrapped
        them since, ours left in place doing nothing more), and the index emptied."""
        self.active[0] = False
        scheduler = self.scheduler
        for name, (original, wrapper) in self.hooks.items():
            if scheduler is not None and vars(scheduler).get(name) is wrapper:
                if getattr(original, "__self__", None) is scheduler and original.__func__ is getattr(
                    type(scheduler), name, None
                ):
                    delattr(scheduler, name)  # the class' own method again
                else:
                    setattr(scheduler, name, original)
        self.hooks = {}
        self.scheduler = None
        self.entries, self.off, self.totals, self.held = {}, OrderedDict(), Totals(), {}
        self.noted.clear()
        self.shares.reset()
        self.backlog, self.cursor = [], 0

    @property
    def attached(self) -> bool:
        return self.scheduler is not None and self.active[0]

    def retune(self, rules: ruling.Rules) -> None:
        """New rules: queue the keys whose target may change, and only those."""
        old, self.rules = self.rules, rules
        if rules == old:
            return
        self.goals = {}
        self.generation += 1
        if rules.default != old.default:
            self.wanted_by_group = {}
            self._queue(self.held.values())
        elif rules.keys != old.keys:
            # Every cached group is forgotten (one not held now may be ruled now), and those held
            # whose target changed are read again.
            before, self.wanted_by_group = self.wanted_by_group, {}
            self._queue(keys for group, keys in self.held.items() if self.wanted_of(group) != before.get(group))
        if rules.pods != old.pods and self.scheduler is not None:
            workers = self.scheduler.workers
            addresses = set().union(*(rule.workers for rule in (*old.pods, *rules.pods)))
            self._queue(workers[a].has_what for a in addresses if a in workers)
        if self.scheduler is not None:
            self.follow_workers(self.scheduler.workers)

    def _queue(self, groups: Iterable[Iterable[Any]]) -> None:
        if self.cursor:
            del self.backlog[: self.cursor]
            self.cursor = 0
        for keys in groups:
            self.backlog.extend(keys)

    def follow_workers(self, workers: Mapping[str, Any]) -> None:
        """Which workers are leaving and which the pod rules mark, now: one read per worker; the keys
        of those that changed are noted."""
        leaving = {ws for ws in workers.values() if ws.status.name not in ("running", "paused")}
        marked_by_rule = [{workers[a] for a in rule.workers if a in workers} for rule in self.rules.pods]
        changed = leaving ^ self.leaving
        for before, now in zip(self.marked_by_rule, marked_by_rule, strict=False):
            changed |= before ^ now
        if len(self.marked_by_rule) != len(marked_by_rule):
            changed |= set().union(*self.marked_by_rule, *marked_by_rule)
        self.leaving, self.marked_by_rule = leaving, marked_by_rule
        self.marked = set().union(*marked_by_rule)
        for ws in changed:
            self.noted.update(ws.has_what)

    def update(self, limit: int = MAX_READS_PER_PASS, seconds: float = READ_SECONDS) -> int:
        """Read the noted keys again, changes first, then the backlog: at most ``limit`` of them,
        for about ``seconds`` (checked every :data:`_SLICE` keys); how many."""
        started = time.perf_counter()
        if self.scheduler is not None:
            self.follow_workers(self.scheduler.workers)
        read = 0
        noted, backlog = self.noted, self.backlog
        while (noted or self.cursor < len(backlog)) and read < limit:
            if read and time.perf_counter() - started > seconds:
                break
            chunk = min(_SLICE, limit - read)
            if noted:
                for _ in range(min(chunk, len(noted))):
                    self.read(noted.pop())
                    read += 1
            else:
                end = min(self.cursor + chunk, len(backlog))
                for ts in backlog[self.cursor : end]:
                    self.read(ts)
                read += end - self.cursor
                self.cursor = end
        if self.cursor >= len(backlog):
            self.backlog, self.cursor = [], 0
        return read

    # -- one key -----------------------------------------------------------------------------------

    def wanted_of(self, group: tuple[Any, bool]) -> int:
        """What the key rules want of a (TaskPrefix, scattered) group: :func:`rules.key_target`, cached."""
        wanted = self.wanted_by_group.get(group)
        if wanted is None:
            wanted = self.wanted_by_group[group] = ruling.key_target(self.rules, group[0].name, group[1])
        return wanted

    def wanted(self, ts: Any) -> int:
        return self.wanted_of((ts.prefix, ts.run_spec is None))

    def classify(self, ts: Any, group: tuple[Any, bool] | None = None) -> Entry | None:
        """``ts`` as an :class:`Entry` from its state now, or None when no rule covers it (or it
        is in memory nowhere). The one reading that :meth:`read` and :func:`recompute` share.
        Read for every key that changes: kept to plain lookups (``group``: its (prefix, scattered))."""
        who_has = ts.who_has
        if not who_has:
            return None
        if group is None:
            group = (ts.prefix, ts.run_spec is None)
        wanted = self.wanted_by_group.get(group)
        if wanted is None:
            wanted = self.wanted_of(group)
        if not wanted and self.rules.default == 1 and self.marked.isdisjoint(who_has):
            return None  # the hot path: an unruled key on no marked pod
        if self.marked_by_rule:
            matched = tuple(i for i, marked in enumerate(self.marked_by_rule) if not marked.isdisjoint(who_has))
        else:
            matched = ()
        goal = self.goals.get((wanted, matched), _MISSING)
        if goal is _MISSING:
            goal = self.goals[wanted, matched] = ruling.target(self.rules, wanted, [ws.address for ws in who_has])
        if goal is None:
            return None
        count, replicas, away = len(who_has), goal.replicas, goal.away
        only_marked = bool(away) and all(ws.address in away for ws in who_has)
        off = (
            count != replicas
            or ts.key in self.in_flight
            or not self.leaving.isdisjoint(who_has)
            or (bool(away) and who_has <= self.marked)
        )
        return Entry(
            goal, count, ts.get_nbytes(), off, count < replicas or only_marked, count > replicas, self.generation
        )

    def read(self, ts: Any) -> Entry | None:
        """Read ``ts`` again: its place among the keys in memory, its entry, the totals."""
        group = (ts.prefix, ts.run_spec is None)
        held = self.held
        if ts.who_has:
            keys = held.get(group)
            if keys is None:
                keys = held[group] = set()
            keys.add(ts)
        else:
            for scattered in (False, True):  # either, should its run_spec have changed while held
                keys = held.get((ts.prefix, scattered))
                if keys is not None:
                    keys.discard(ts)
                    if not keys:
                        del held[ts.prefix, scattered]
        totals = self.totals
        old = self.entries.pop(ts, None)
        if old is not None:
            totals.add(old, -1)
            if old.off:
                del self.off[ts]
        entry = self.classify(ts, group)
        if entry is not None:
            self.entries[ts] = entry
            totals.add(entry, 1)
            if entry.off:
                self.off[ts] = None
        return entry

    def note(self, ts: Any) -> None:
        """Read ``ts`` again on the next :meth:`update` (a copy planned for it, say)."""
        self.noted.add(ts)


def _note_after(
    original: Callable[..., Any], noted: set[Any], changed: set[Any], active: list[bool]
) -> Callable[..., Any]:
    """``original`` (one of the scheduler's replica methods), then its TaskState noted (for the
    index, and for its :class:`~memops.scheduler.holdings.Shares`)."""

    def hook(ts: Any, *args: Any) -> Any:
        result = original(ts, *args)
        if active[0]:
            noted.add(ts)
            changed.add(ts)
        return result

    return hook


def recompute(index: Index, tasks: Iterable[Any]) -> tuple[dict[Any, Entry], set[Any], Totals]:
    """What the index stands for, read from every key: its entries, the keys off target and the
    totals. The full scan: for tests and benchmarks, never a pass."""
    entries: dict[Any, Entry] = {}
    totals = Totals()
    for ts in tasks:
        entry = index.classify(ts)
        if entry is not None:
            entries[ts] = entry
            totals.add(entry, 1)
    return entries, {ts for ts, e in entries.items() if e.off}, totals
