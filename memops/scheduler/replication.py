"""Replication targets: an Active Memory Manager policy that keeps ruled keys at N copies.

The MemoryPolicy's ``spec.replication`` says which keys matter: by Dask key prefix
(``key_split``), by a glob over that prefix, ``scattered`` data (no task to
recompute it), or any key held on pods that a pod rule marks (spot or preemptible nodes: such
a key must also exist on a pod outside them). The operator evaluates the pod rules (it knows
pods, nodes and their labels) and sends plain data: the addresses that each pod rule marks, and
each worker's node and zone. Key rules are evaluated here, by the pure :mod:`rules`.

Each pass (:class:`Replication`, on its own Active Memory Manager) reads the ruled keys off
their target, which an index kept from the scheduler's own changes names
(:mod:`memops.scheduler.replication_index`: a pass costs what changed, not what exists), and
asks the pure :func:`decide` for copies and drops:

- a key under its target is copied to a running worker with headroom under ``ceiling``
  (pressure relief's threshold): a worker on another node first, then in another zone, then
  the emptiest; never a worker being retired or closed, never a pod that the key's pod rule
  asks copies to be away from; a copy lost with its worker is made again on the next pass;
- a key above its target loses copies, the least useful first (on a marked pod, then sharing
  a node or zone with another copy, then the fullest worker), never its last copy outside the
  marked pods;
- the extra copies of ruled keys never take more than ``max_fraction`` of the cluster's memory;
  when that budget is short, keys that cannot be recomputed (scattered, or whose dependencies
  are gone) are served first, then by recompute cost per byte.

Exactly one policy decides each key: while a rule is in force (:func:`in_force`), the
scheduler's stock ``ReduceReplicas`` in ``manager.policies`` is replaced by :class:`DeferRuled`,
a ReduceReplicas that logs as the stock one, runs it unchanged and withholds its suggestions for
ruled keys; removing the rules (or replication) puts the stock instance back. Unruled keys keep
ReduceReplicas' one copy. With no rule in force, replication changes nothing in the scheduler's
AMM and runs no pass of its own: it only reports what each worker holds.

Like :mod:`relief`, this imports nothing from memops: the operator sends it by value with
memops' agent (:mod:`memops.scheduler.agent`), whose ``replication`` operation calls
:func:`configure`.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import time
from collections.abc import Generator, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any, NamedTuple

from distributed.active_memory_manager import (
    ActiveMemoryManagerExtension,
    ActiveMemoryManagerPolicy,
    ReduceReplicas,
    Suggestion,
)
from distributed.diagnostics.plugin import SchedulerPlugin

from memops.rulesyntax import bounds
from memops.scheduler import holdings, replication_index, transfers
from memops.scheduler import rules as ruling

NAME = "memops-replication"
MAX_COPIES_PER_PASS = 2500
"""Copies planned in one pass: bounds a pass' time (a recipient search may read every worker)
and the transfers started at once; the rest follow on the next passes."""
MAX_ITEMS_PER_PASS = 2_500
"""Ruled keys off their target that one pass hands to :func:`decide` (which copies at most
:data:`MAX_COPIES_PER_PASS` of them anyway): a rule just applied to 100,000 keys keeps a pass
bounded, and the rest are served on the next passes, those read longest ago first. Which keys come
first is then that order, not :func:`value_order`, until they fit."""
PASS_SECONDS = 0.04
"""A pass' own time, about: the index reads changes for at most its ``READ_SECONDS``
(:mod:`memops.scheduler.replication_index`), and the keys handed to :func:`decide` are as many as
the rest of it fits, by what a key cost in the passes before (:attr:`Replication.item_seconds`), so
that a pass after a rule or a loss stays under a tenth of a second on a busy machine too."""
MIN_ITEMS_PER_PASS = 64
"""Keys handed over in a pass however slow the last one was: the copies always progress."""
ITEM_SECONDS = 20e-6
"""What one key handed over costs (reading it, deciding, suggesting) before a pass has measured it."""
MAX_ITEM_SECONDS = 200e-6
"""What one key handed over is taken to cost at most, whatever a pass measured."""
SHARES_NOTED = 50_000
SHARES_READ = 5_000
"""The index' :class:`~memops.scheduler.holdings.Shares` reads what changed when holdings are asked
for; beyond :data:`SHARES_NOTED` keys waiting, a pass reads :data:`SHARES_READ` of them (a few ms)."""
MAX_SHARE = 0.2
"""A pass that takes t seconds is followed by none for t / MAX_SHARE: a backstop that keeps
replication to this share of the scheduler's event loop should passes grow long. Passes cost what
changed (under 1 ms at rest at a million keys); right after a loss or a rule they take about
:data:`PASS_SECONDS`, and this lets them run every few tenths of a second until the copies are back."""
INTERVAL = 0.5
"""Seconds between passes at rest."""
BUSY_INTERVAL = 0.1
"""Seconds between passes while keys are off target and the last pass moved some (a lost worker's
copies, a new rule): replication's AMM ticks this often, and a tick at rest runs nothing (not even
the AMM's reading of every worker's memory) until :data:`INTERVAL` has passed."""
LANDING = 2.0
"""A copy costs its recipient about twice its size while it lands (as in :mod:`relief`)."""
IN_FLIGHT_SECONDS = 5.0
"""A planned copy counts as a holder for this long (plus its size at this rate), so that a copy
still on its way is not planned a second time."""

Rules = ruling.Rules
Target = ruling.Target
RuleError = bounds.RuleError


@dataclasses.dataclass(frozen=True)
class Worker:
    address: str
    memory: int  # bytes, as the scheduler last learnt them (plus what is on its way to it)
    limit: int  # bytes (0: none: never a recipient)
    node: str = ""
    zone: str = ""
    running: bool = True  # False: paused, or being retired or closed: sent nothing
    leaving: bool = False  # being retired or closed: its copies do not count


class Item(NamedTuple):
    """A ruled key handed to :func:`decide` (a named tuple: a pass makes thousands of them)."""

    key: str
    nbytes: int
    holders: tuple[str, ...]
    target: Target
    recomputable: bool = True
    cost: float = 0.0  # seconds of compute per byte to make it again


@dataclasses.dataclass(frozen=True)
class Plan:
    copies: tuple[tuple[str, str], ...] = ()  # (key, recipient)
    drops: tuple[tuple[str, str], ...] = ()  # (key, holder)
    unserved: tuple[str, ...] = ()  # under target, and no copy planned (no room, or no budget)
    spent: int = 0  # bytes of extra copies of ruled keys, with the planned copies and drops
    budget: int = 0


def value_order(item: Item) -> tuple[bool, float, str]:
    """Keys that cannot be recomputed first, then the costliest to recompute per byte."""
    return (item.recomputable, -item.cost, item.key)


def _drop_order(holder: str, item: Item, workers: Mapping[str, Worker], holders: Sequence[str]) -> tuple[Any, ...]:
    w = workers[holder]
    others = [workers[h] for h in holders if h != holder]
    return (
        holder not in item.target.away,  # a copy on a marked pod is the first to go
        not any(o.node == w.node and w.node for o in others),  # then one that shares a node
        not any(o.zone == w.zone and w.zone for o in others),
        -(w.memory / w.limit if w.limit else 1.0),  # then the fullest
        holder,
    )


def decide(
    workers: Sequence[Worker],
    items: Iterable[Item],
    *,
    max_fraction: float,
    ceiling: float,
    landing: float = LANDING,
    max_copies: int = MAX_COPIES_PER_PASS,
    spent: int = 0,
) -> Plan:
    """Copies and drops that bring every item to its target; pure.

    ``items``: ruled keys in memory, each with its holders (copies on their way included); the
    caller may leave out keys at their target, whose extra copies' bytes it passes as ``spent``.
    Copies held by leaving workers do not count. Drops come first (they free budget); then the
    keys under target, in :func:`value_order`, each copy to the best recipient (another node,
    then another zone, then the least full; staying under ``ceiling`` with ``landing`` times the
    key's size), while the extra copies stay within ``max_fraction`` of the staying workers'
    memory limits.
    """
    by_address = {w.address: w for w in workers}
    leaving = {w.address for w in workers if w.leaving}
    budget = int(max_fraction * sum(w.limit for w in workers if not w.leaving))
    drops, under, spent = _drops(items, by_address, leaving, spent)
    copies, unserved, spent = _copies(
        under, workers, by_address, budget=budget, ceiling=ceiling, landing=landing, max_copies=max_copies, spent=spent
    )
    return Plan(tuple(copies), tuple(drops), tuple(unserved), spent, budget)


def _drops(
    items: Iterable[Item], by_address: Mapping[str, Worker], leaving: AbstractSet[str], spent: int
) -> tuple[list[tuple[str, str]], list[tuple[Item, list[str], int]], int]:
    """:func:`decide`'s first half: the extra copies to drop, the keys under target (with their
    staying holders and how many copies they lack), and the extra copies' bytes then."""
    drops: list[tuple[str, str]] = []
    under: list[tuple[Item, list[str], int]] = []
    for item in items:
        holders = [h for h in item.holders if h in by_address and h not in leaving]
        spent += item.nbytes * max(len(holders) - 1, 0)
        away = item.target.away
        outside = [h for h in holders if h not in away]
        need = item.target.replicas - len(holders)
        if away and not outside:
            need = max(need, 1)
        if need > 0:
            under.append((item, holders, need))
            continue
        excess = len(holders) - item.target.replicas
        while excess > 0:
            holder = min(holders, key=lambda h: _drop_order(h, item, by_address, holders))
            if away and outside == [holder]:
                break  # never the last copy outside the marked pods
            drops.append((item.key, holder))
            holders.remove(holder)
            outside = [h for h in holders if h not in away]
            spent -= item.nbytes
            excess -= 1
    return drops, under, spent


def _copies(
    under: list[tuple[Item, list[str], int]],
    workers: Sequence[Worker],
    by_address: Mapping[str, Worker],
    *,
    budget: int,
    ceiling: float,
    landing: float,
    max_copies: int,
    spent: int,
) -> tuple[list[tuple[str, str]], list[str], int]:
    """:func:`decide`'s second half: each key under target, in :func:`value_order`, copied to
    the best recipient within the budget; the copies, the keys none could take, the bytes spent."""
    projected = {w.address: w.memory for w in workers}
    candidates = [w for w in workers if w.running and not w.leaving and w.limit]
    copies: list[tuple[str, str]] = []
    unserved: list[str] = []
    # The recipients by fullness, kept sorted as copies land: the one that took a copy moves to its
    # new place (a bisect, not a sort of every worker: a pass plans thousands of copies).
    ranks = sorted((projected[w.address] / w.limit, w.address) for w in candidates)
    by_rank = {w.address: w for w in candidates}
    order = [by_rank[address] for _, address in ranks]
    # The best a recipient can score on placement: a new node (new zone) only where pods say where they run.
    floor = (not any(w.node for w in candidates), not any(w.zone for w in candidates))
    for item, holders, need in sorted(under, key=lambda u: value_order(u[0])):
        served = False
        for _ in range(need):
            cost = int(landing * item.nbytes)
            if len(copies) >= max_copies or (holders and spent + item.nbytes > budget):
                break
            recipient = _best_recipient(item, holders, order, by_address, projected, cost, ceiling, floor)
            if recipient is None:
                break
            copies.append((item.key, recipient.address))
            old = (projected[recipient.address] / recipient.limit, recipient.address)
            projected[recipient.address] += cost
            new = (projected[recipient.address] / recipient.limit, recipient.address)
            at = bisect.bisect_left(ranks, old)
            del ranks[at], order[at]
            at = bisect.bisect_left(ranks, new)
            ranks.insert(at, new)
            order.insert(at, recipient)
            spent += item.nbytes if holders else 0
            holders = [*holders, recipient.address]
            served = True
        if not served:
            unserved.append(item.key)
    return copies, unserved, spent


def _best_recipient(
    item: Item,
    holders: Sequence[str],
    order: Sequence[Worker],
    by_address: Mapping[str, Worker],
    projected: Mapping[str, int],
    cost: int,
    ceiling: float,
    floor: tuple[bool, bool],
) -> Worker | None:
    """Another node, then another zone, then the least full, staying under ``ceiling``
    (:func:`transfers.choose_recipient`: ``order`` is by fullness, so the first of the best placement wins)."""
    nodes = {by_address[h].node for h in holders if by_address[h].node}
    zones = {by_address[h].zone for h in holders if by_address[h].zone}

    def placement(address: str) -> tuple[bool, bool]:
        w = by_address[address]
        return (w.node in nodes or not w.node, w.zone in zones or not w.zone)

    address = transfers.choose_recipient(
        (w.address for w in order),
        excluded=(holders, item.target.away),
        has_room=lambda a: projected[a] + cost <= ceiling * by_address[a].limit,
        rank=placement,
        best_rank=floor,
    )
    return None if address is None else by_address[address]


# -- inside the scheduler ---------------------------------------------------------------------------


def _recomputable(ts: Any) -> bool:
    if ts.run_spec is None:
        return False  # scattered: no task makes it again
    return all(dep.who_has or dep.state in ("processing", "waiting") for dep in ts.dependencies)


def _cost(ts: Any, nbytes: int) -> float:
    duration = float(ts.prefix.duration_average)
    return max(duration, 0.0) / max(nbytes, 1)


@dataclasses.dataclass
class Figures:
    """What the last pass saw, for the operator's status and the pods' annotations."""

    keys_under: int = 0
    bytes_under: int = 0
    keys_over: int = 0
    bytes_over: int = 0
    spent: int = 0
    budget: int = 0
    ruled_keys: int = 0
    copies: int = 0  # copies made so far
    bytes_copied: int = 0
    drops: int = 0
    vetoed: int = 0  # ReduceReplicas' drops of ruled keys withheld so far
    seconds: float = 0.0  # the last pass' decision time
    workers: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    """Address -> [bytes it holds that have another copy, ruled keys it holds under target, its
    target]; :func:`configure` adds the bytes it holds alone."""

    def plain(self) -> dict[str, Any]:
        return {
            "keysUnder": self.keys_under,
            "bytesUnder": self.bytes_under,
            "keysOver": self.keys_over,
            "bytesOver": self.bytes_over,
            "bytesSpent": self.spent,
            "budgetBytes": self.budget,
            "ruledKeys": self.ruled_keys,
            "copies": self.copies,
            "bytesCopied": self.bytes_copied,
            "drops": self.drops,
            "vetoed": self.vetoed,
            "seconds": self.seconds,
            "workers": {a: list(v) for a, v in self.workers.items()},
        }


class Replication(ActiveMemoryManagerPolicy):
    """The AMM policy: reads the ruled keys off target from its :class:`~replication_index.Index`,
    asks :func:`decide`, suggests copies and drops."""

    def __init__(self, rules: Rules, places: Mapping[str, tuple[str, str]] | None = None):
        self.rules = rules
        self.places = dict(places or {})  # address -> (node, zone)
        self.figures = Figures()
        self.targets: dict[tuple[Any, bool], int] = {}  # (TaskPrefix, scattered) -> key_target; reset with the rules
        self.in_flight: dict[Any, tuple[str, float, int]] = {}  # key -> (recipient, deadline, nbytes)
        self.index = replication_index.Index(rules)
        self.index.in_flight = self.in_flight  # a key with a copy on its way is off target until it lands
        self.rest = replication_index.Totals()  # the index' totals less the keys handed to decide()
        self.next_pass = 0.0  # perf_counter: no pass before this (see MAX_SHARE)
        self.item_seconds = ITEM_SECONDS  # a key handed over, as the last passes measured it (see PASS_SECONDS)
        self.interval = INTERVAL  # seconds between passes at rest
        self.last_pass = float("-inf")  # perf_counter when the last pass started
        self.moved = False  # whether the last pass suggested a copy or a drop that the AMM took
        self.prepared: float | None = None  # perf_counter when prepare() found keys off target, for run()

    def __repr__(self) -> str:
        figures = self.figures
        return f"Replication(default={self.rules.default}, ruled={figures.ruled_keys}, under={figures.keys_under})"

    def retune(self, rules: Rules, places: Mapping[str, tuple[str, str]]) -> None:
        if rules != self.rules:
            self.targets = {}
            self.index.retune(rules)  # only the keys whose target may change are read again
        self.rules, self.places = rules, dict(places)

    def wanted(self, ts: Any) -> int:
        scattered = ts.run_spec is None
        cached = (ts.prefix, scattered)
        wanted = self.targets.get(cached)
        if wanted is None:
            wanted = self.targets[cached] = ruling.key_target(self.rules, ts.prefix.name, scattered)
        return wanted

    def ruled(self, ts: Any) -> bool:
        """Whether this policy decides ``ts`` (read by :class:`DeferRuled` for ReduceReplicas)."""
        if self.wanted(ts):
            return True
        holders = [ws.address for ws in ts.who_has or ()]
        return ruling.target(self.rules, 0, holders) is not None

    def items(self, now: float, limit: int = MAX_ITEMS_PER_PASS) -> list[Item]:
        """The ruled keys off target as :class:`Item`, copies on their way counted as holders: at
        most ``limit``, those handed over longest ago first (each goes to the back; one noted since
        it was read, read under other rules, or with a copy on its way, is read again first). Also
        sets :attr:`rest`."""
        index = self.index
        items: list[Item] = []
        rest = dataclasses.replace(index.totals)
        off, entries, noted, generation = index.off, index.entries, index.noted, index.generation
        in_flight = self.in_flight
        for ts in list(itertools.islice(off, limit)):
            holders = [ws.address for ws in ts.who_has or ()]
            flight = in_flight.get(ts.key) if in_flight else None
            entry: replication_index.Entry | None = entries[ts]
            assert entry is not None
            if flight is not None or entry.generation != generation or ts in noted:
                if flight is not None and (now > flight[1] or flight[0] in holders):
                    del in_flight[ts.key]
                    flight = None
                noted.discard(ts)
                # Changed since read (a copy landed, its flight expired), or read under other rules.
                entry = index.read(ts)
                if entry is None or not entry.off:
                    continue  # at target after all
            else:
                off.move_to_end(ts)  # the next pass hands others over first
            rest.add(entry, -1)
            if flight is not None:
                holders.append(flight[0])
            nbytes = entry.nbytes
            items.append(Item(ts.key, nbytes, tuple(holders), entry.goal, _recomputable(ts), _cost(ts, nbytes)))
        self.rest = rest
        return items

    def item_limit(self, started: float) -> int:
        """How many keys this pass hands to :func:`decide`: what is left of :data:`PASS_SECONDS`
        since ``started`` (perf_counter), at what a key cost in the last passes."""
        left = PASS_SECONDS - (time.perf_counter() - started)
        return max(MIN_ITEMS_PER_PASS, min(MAX_ITEMS_PER_PASS, int(left / self.item_seconds)))

    def measured(self, items: int, seconds: float) -> None:
        """A pass handed over ``items`` keys in ``seconds`` (reading, deciding, suggesting; the
        workers' listing left out): what a key costs, weighed with the passes before. A pass of a
        few keys says little (what remains fixed weighs more than its keys), and one stalled by the
        garbage collector or a busy machine no more than :data:`MAX_ITEM_SECONDS` a key."""
        if items >= MIN_ITEMS_PER_PASS:
            seconds = min(seconds / items, MAX_ITEM_SECONDS)
            self.item_seconds = 0.5 * self.item_seconds + 0.5 * seconds

    def workers(self, scheduler: Any) -> list[Worker]:
        running = scheduler.running
        result = []
        for ws in scheduler.workers.values():
            node, zone = self.places.get(ws.address, ("", ""))
            result.append(
                Worker(
                    ws.address,
                    max(int(ws.memory.process), int(ws.memory.optimistic)),
                    int(ws.memory_limit or 0),
                    node,
                    zone,
                    running=ws in running,
                    leaving=ws.status.name not in ("running", "paused"),
                )
            )
        return result

    def due(self, now: float) -> bool:
        """Whether a pass runs at this tick (``now``: perf_counter): never before the last long
        pass' spacing (:data:`MAX_SHARE`); then at once while keys are off target and the last pass
        moved some, or a rule's keys wait to be read; else every :attr:`interval`."""
        if now < self.next_pass:
            return False
        index = self.index
        if not index.attached or (index.off and self.moved) or index.backlog:
            return True
        return now >= self.last_pass + self.interval - BUSY_INTERVAL / 2

    def prepare(self, scheduler: Any) -> bool:
        """A pass' first half: the index read up to now and, with every ruled key at its target (the
        common case), the figures; whether keys are off target (then :meth:`run` decides them)."""
        started = self.last_pass = time.perf_counter()
        self.prepared = None
        index = self.index
        if index.scheduler is not scheduler or not index.attached:
            index.attach(scheduler)  # the first pass: every key is read, over the next passes
        index.update()
        if len(index.shares.noted) > SHARES_NOTED:
            index.shares.update(SHARES_READ)  # keeps what it holds bounded however rarely holdings are asked for
        if index.off:
            self.prepared = started
            return True
        self.moved = False
        self.rest = dataclasses.replace(index.totals)
        self.figures.seconds = time.perf_counter() - started
        self.next_pass = started + self.figures.seconds / MAX_SHARE
        limits = sum(int(ws.memory_limit or 0) for ws in scheduler.workers.values() if ws not in index.leaving)
        budget = int(self.rules.max_fraction * limits)
        self.account([], Plan(spent=index.totals.spent, budget=budget), scheduler.workers)
        return False

    def run(self) -> Generator[Suggestion, Any, None]:
        scheduler = self.manager.scheduler
        started = self.prepared
        if started is None:  # run by an AMM that did not call prepare() first
            if time.perf_counter() < self.next_pass or not self.prepare(scheduler):
                return  # spaced after a long pass (see MAX_SHARE), or nothing off target
            started = self.prepared
            assert started is not None
        self.prepared = None
        index = self.index
        now = time.time()
        handing = time.perf_counter()
        items = self.items(now, self.item_limit(started))
        listing = time.perf_counter()
        workers = self.workers(scheduler)
        fixed = time.perf_counter() - listing  # the workers' listing: a cost of the pass, not of its keys
        plan = decide(
            workers,
            items,
            max_fraction=self.rules.max_fraction,
            ceiling=self.rules.ceiling,
            spent=self.rest.spent,
        )
        self.figures.seconds = time.perf_counter() - started
        self.next_pass = started + self.figures.seconds / MAX_SHARE
        self.account(items, plan, [w.address for w in workers])
        tasks = scheduler.tasks
        by_address = scheduler.workers
        moved = False
        for key, holder in plan.drops:
            ts, ws = tasks.get(key), by_address.get(holder)
            if ts is not None and ws is not None and (yield Suggestion("drop", ts, {ws})) is not None:
                self.figures.drops += 1
                moved = True
        for key, recipient in plan.copies:
            ts, ws = tasks.get(key), by_address.get(recipient)
            if ts is None or ws is None:
                continue
            if (yield Suggestion("replicate", ts, {ws})) is not None:
                nbytes = ts.get_nbytes()
                deadline = transfers.given_up_at(now, nbytes, IN_FLIGHT_SECONDS)
                self.in_flight[key] = (recipient, deadline, nbytes)
                index.note(ts)  # off target while its copy is on its way (read on the next pass)
                self.figures.copies += 1
                self.figures.bytes_copied += nbytes
                moved = True
        self.moved = moved
        self.measured(len(items), time.perf_counter() - handing - fixed)

    def account(self, items: Sequence[Item], plan: Plan, addresses: Iterable[str]) -> None:
        figures = self.figures
        rest = self.rest
        figures.spent, figures.budget = plan.spent, plan.budget
        figures.ruled_keys = len(self.index.entries)
        figures.keys_under, figures.bytes_under = rest.under, rest.bytes_under
        figures.keys_over, figures.bytes_over = rest.over, rest.bytes_over
        per_worker = {a: [0, 0, self.rules.default] for a in addresses}
        for rule in self.rules.pods:
            for address in rule.workers & per_worker.keys():
                per_worker[address][2] = max(per_worker[address][2], rule.replicas)
        for item in items:
            count = len(item.holders)
            away = item.target.away
            under = count < item.target.replicas or bool(away and all(h in away for h in item.holders))
            if under:
                figures.keys_under += 1
                figures.bytes_under += item.nbytes
            elif count > item.target.replicas:
                figures.keys_over += 1
                figures.bytes_over += item.nbytes * (count - item.target.replicas)
            for h in item.holders:
                row = per_worker.get(h)
                if row is not None:
                    row[1] += bool(under)
        figures.workers = per_worker


def in_force(rules: Rules) -> bool:
    """Whether any key can be ruled: a default above 1, a key rule, or a pod rule that marks a pod.

    Without one, :meth:`Replication.ruled` is false for every key: replication leaves the
    scheduler's AMM exactly as it was (no :class:`DeferRuled`, its own manager stopped)."""
    return rules.default > 1 or bool(rules.keys) or any(rule.workers for rule in rules.pods)


class DeferRuled(ReduceReplicas):
    """The scheduler's stock ReduceReplicas, run unchanged, without its suggestions for the keys
    that :class:`Replication` decides: the two never fight over a key.

    A ReduceReplicas still (``isinstance``), which logs as the stock one does ("Running policy:
    ReduceReplicas()"), so that code and people reading the AMM find what Dask put there. It
    stands in for ``stock``, the scheduler's own instance, which :func:`unwrap_reduce_replicas`
    puts back, the very object."""

    def __init__(self, stock: ReduceReplicas, replication: Replication):
        self.memops_stock = stock
        self.replication = replication

    def __repr__(self) -> str:
        return repr(self.memops_stock)

    def run(self) -> Generator[Suggestion, Any, None]:
        suggestions = super().run()
        try:
            suggestion = next(suggestions)
            while True:
                if self.replication.ruled(suggestion.ts):
                    self.replication.figures.vetoed += 1
                    answer = None  # as if the manager had found no worker to drop from
                else:
                    answer = yield suggestion
                suggestion = suggestions.send(answer)
        except StopIteration:
            return


def _stock_manager(scheduler: Any) -> Any:
    return scheduler.extensions.get("amm")


def _stands_in_for(policy: Any) -> Any:
    """The stock ReduceReplicas that this policy of memops stands in for, or None.

    By attribute, not by class: the agent arrives by value, so an agent installed by another
    operator process (an older one's ``SkipRuled`` included) defines classes of its own."""
    if type(policy) is ReduceReplicas:
        return None
    for attribute in ("memops_stock", "inner"):
        stock = getattr(policy, attribute, None)
        if type(stock) is ReduceReplicas and hasattr(policy, "replication"):
            return stock
    return None


def wrap_reduce_replicas(scheduler: Any, replication: Replication) -> int:
    """Put :class:`DeferRuled` in place of every stock ReduceReplicas of the scheduler's AMM."""
    manager = _stock_manager(scheduler)
    if manager is None:
        return 0
    wrapped = 0
    for policy in list(manager.policies):
        stock = _stands_in_for(policy)
        if isinstance(policy, DeferRuled):
            policy.replication = replication
            continue
        if stock is None and type(policy) is not ReduceReplicas:
            continue  # another policy, or a subclass of ReduceReplicas that someone chose
        manager.policies.discard(policy)
        manager.add_policy(DeferRuled(stock or policy, replication))
        wrapped += 1
    return wrapped


def unwrap_reduce_replicas(scheduler: Any) -> None:
    """Put back the stock ReduceReplicas, the same objects, where memops' policies stand in for them."""
    manager = _stock_manager(scheduler)
    if manager is None:
        return
    for policy in list(manager.policies):
        stock = _stands_in_for(policy)
        if stock is not None:
            manager.policies.discard(policy)
            manager.add_policy(stock)


class ReplicationManager(ActiveMemoryManagerExtension):
    """Replication's own AMM: ticks every :data:`BUSY_INTERVAL`, and runs (reading every worker's
    memory, as an AMM does before its policies) only when :meth:`Replication.due` and
    :meth:`Replication.prepare` say there are keys to decide."""

    replication: Replication

    def run_once(self) -> None:
        replication = self.replication
        if replication.due(time.perf_counter()) and replication.prepare(self.scheduler):
            super().run_once()


class ReplicationPlugin(SchedulerPlugin):
    """Runs :class:`Replication` on its own AMM every ``interval`` seconds (kept in
    ``scheduler.plugins`` under :data:`NAME`, stopped with the scheduler)."""

    name = NAME

    def __init__(
        self, scheduler: Any, rules: Rules, places: Mapping[str, tuple[str, str]], interval: float, owner: str
    ):
        self.scheduler = scheduler
        self.owner = owner
        self.policy = Replication(rules, places)
        self.policy.interval = interval
        self.manager = ReplicationManager(
            scheduler, {self.policy}, register=False, start=False, interval=min(interval, BUSY_INTERVAL)
        )  # started by configure() while a rule is in force
        self.manager.replication = self.policy

    async def close(self) -> None:
        self.manager.stop()
        self.policy.index.detach()


def configure(
    dask_scheduler: Any,
    rules: Mapping[str, Any] | None,
    places: Mapping[str, Sequence[str]] | None = None,
    owner: str = "",
    interval: float = INTERVAL,
) -> dict[str, Any] | None:
    """Run on the scheduler (by the agent's ``replication`` operation): install, retune or
    (``rules=None``) remove replication; its figures, or None once removed.

    Idempotent, called on every policy pass. Rules are checked here again (:func:`memops.scheduler.rules.parse`); a
    refused rule raises :class:`RuleError`, which the agent returns as an error. Replication
    that another ``owner`` installed is left alone, and its figures returned with its owner.
    """
    plugin = dask_scheduler.plugins.get(NAME)
    if plugin is not None and plugin.owner not in ("", owner):
        return {**plugin.policy.figures.plain(), "owner": plugin.owner}
    if plugin is not None and (rules is None or not hasattr(plugin.policy, "index")):
        # Removed, or installed by an older agent (which scanned keys): a new one takes its place.
        plugin.manager.stop()
        index = getattr(plugin.policy, "index", None)
        if index is not None:
            index.detach()
        dask_scheduler.remove_plugin(NAME)
        plugin = None
    if rules is None:
        unwrap_reduce_replicas(dask_scheduler)
        return None
    parsed = ruling.parse(rules)
    where = {str(a): (str(p[0]), str(p[1])) for a, p in (places or {}).items()}
    if plugin is None:
        plugin = ReplicationPlugin(dask_scheduler, parsed, where, interval, owner)
        dask_scheduler.add_plugin(plugin, name=NAME)
    plugin.owner = owner
    plugin.policy.retune(parsed, where)
    if in_force(parsed):
        plugin.manager.start()
        wrap_reduce_replicas(dask_scheduler, plugin.policy)
    else:
        # Nothing is ruled: the scheduler's AMM as Dask made it (its replica methods included),
        # and no pass of memops' own.
        plugin.manager.stop()
        plugin.policy.index.detach()
        unwrap_reduce_replicas(dask_scheduler)
    figures = {**plugin.policy.figures.plain(), "owner": owner}
    # Each worker's bytes held alone and with copies elsewhere, now (cheap: what changed since the
    # last pass, from the index' Shares, or without a rule the scheduler's replicated keys).
    held = holdings.of_scheduler(dask_scheduler)
    workers = figures["workers"]
    figures["workers"] = {
        a: [int(h[0] - h[2]), *workers.get(a, [0, 0, parsed.default])[1:3], int(h[2])] for a, h in held.items()
    }
    return figures
