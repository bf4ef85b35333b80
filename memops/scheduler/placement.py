"""Graph-aware placement in the Dask scheduler: the tasks of a submitted graph that share roots run
on one worker, so that a graph of independent subgraphs moves (almost) nothing between workers.

The idea is the AutoRestrictor plugin's (dask/distributed PR #4864, never merged): group tasks by
the root tasks they depend on and restrict each group to one worker. Where this differs from it:

- **One pass, no partition layer.** The seed finds a "partitioning layer" by walking down from the
  terminal tasks until there are enough of them for the workers, then computes each task's set of
  roots (quadratic in the worst case; about 2 s per 100,000 tasks). Here groups grow bottom-up in
  priority order (``dask.order``'s order is topological) with a union-find of root groups: a task
  whose dependencies lie in one group joins it; a task that joins groups merges them while the
  merged group stays within a fair share of the roots (roots / workers), and is otherwise
  *shared*. The seed's layer and this cap cut the same tree reductions at about the same height.
- **Shared tasks are Dask's.** The seed restricts a task shared between groups to every worker of
  its consumers; here it keeps no restriction, and Dask's own objective places it (where most of
  its input bytes are), which is where its consumers' groups are.
- **Graphs that do not partition are left alone**: where more than a quarter of the graph's edges
  would cross groups (a task-based shuffle, an all-to-all), where a task already carries restrictions
  (user ``workers=``), where the graph holds a P2P barrier (a P2P shuffle or rechunk restricts its
  own tasks, and restarts them when a worker leaves), where a task is annotated
  ``memops_placement=False`` (a user's opt-out), or where the graph is larger than ``max_tasks`` (so
  that the pass never holds the event loop for long; its cost per task is measured in
  ``bench/placement.py``).
- **Data already computed stays where it is.** A group that reads keys in memory from before (a
  persisted array) goes to the running worker that holds them, or, where they are spread over
  workers, is left to Dask; only the others are dealt out (:func:`_homes`).
- **Strict restrictions, kept on running workers.** A loose restriction (``allow_other_workers``)
  lets an idle worker steal a group's roots (no dependencies: the cheapest to steal), and their
  consumers, on the group's worker, then fetch them back: on the seed's sum, 67 to 324 MiB moved
  with loose restrictions, 38 MiB with strict ones. So a group's tasks may run only on its worker,
  and the plugin keeps that worker running: when it pauses, starts retiring, or leaves, or when a
  worker joins a scheduler that had none, each of its groups moves (:func:`rehome`) to the running
  worker that holds most of the group's bytes (where a drain sent them), or else to the least
  subscribed one, and the tasks Dask found no worker for go on at once. Removing placement lifts
  the restrictions it set.

**Roots are paced as queuing paces them.** Dask queues only unrestricted root-ish tasks: a group's
roots, restricted to its worker, would all be sent at once, and the worker, never idle, would
compute the next root before the scheduler had sent the reduction of the last ones (one round trip
later): partial results pile up, the more so the slower the network. So the plugin holds back a
group's roots (no dependencies), restricted to :data:`HELD`, which no worker is: Dask parks them
in ``no-worker``. It sends them on, in priority order and the groups in theirs, while their worker
has fewer tasks processing than Dask's own queuing allows (``worker-saturation`` times its threads,
at least one), plus :data:`AHEAD` per thread, after each task leaves ``processing``
(:meth:`PlacementPlugin.refill`). A group whose roots turn out small (:data:`UNPACED_BYTES`) is sent
on at once. Under ``worker-saturation: inf``, which turns Dask's queuing off, nothing is held.

Like the agent's other modules, this imports nothing from memops beyond its package.
"""

from __future__ import annotations

import math
import operator
import sys
import time
from collections import deque
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.scheduler import _task_slots_available
from distributed.shuffle._core import P2PBarrierTask

NAME = "memops-placement"
"""The scheduler plugin's name."""
OPT_OUT = "memops_placement"
"""The annotation with which a computation opts out: ``dask.annotate(memops_placement=False)``."""
MAX_TASKS = 10_000
"""The largest graph placed, by default: larger ones are left to Dask. Placing holds the scheduler's
event loop about 2 us per task (``bench/placement.py``), so that this bound keeps a hold near 20 ms."""
SLICES = 2
"""Groups per worker, at least: a group holds at most half of a worker's share of the graph's tasks,
so that groups can be dealt out about evenly (a worker idle at the end waits, as it may not steal),
while consecutive groups on one worker keep most of a reduction's next level local (:func:`assign`).
On the seed's sum (160 chunks, four workers) that is ten groups of one subtree of 16 chunks each."""
LOCATED = 0.9
"""A group that reads data computed before goes where at least this share of that data is; else
it is left to Dask."""
CROSSING_LIMIT = 0.25
"""Above this share of a graph's edges between groups, the graph does not partition."""
HELD = "memops-placement-held"
"""The restriction of a root held back (no worker has this address): Dask keeps it in ``no-worker``."""
_HELD = frozenset({HELD})
AHEAD = 1
"""Roots per thread that a worker is sent beyond what Dask's queuing would send it: one keeps each
thread busy through the round trip in which the scheduler sends the next."""
UNPACED_BYTES = 64 * 2**20
"""A group whose roots, each the size of its largest root computed so far, add up to no more than
this is sent on at once: pacing would save less memory than its round trips cost in time (roots
that are their chunks' partial reductions already)."""

T = TypeVar("T", bound=Hashable)


@dataclass
class Grouping(Generic[T]):
    """Which group each task of a graph is in, and which tasks no group holds."""

    groups: list[list[T]]
    shared: list[T]
    edges: int = 0
    crossing: int = 0
    outside: frozenset[int] = frozenset()
    """The groups (by index) with a task that depends on a task outside the graph (computed before)."""

    @property
    def partitions(self) -> bool:
        """Whether placing the groups saves transfers: at least two groups, few crossing edges."""
        return len(self.groups) >= 2 and self.crossing <= CROSSING_LIMIT * max(1, self.edges)


def group(
    order: Sequence[T],
    dependencies: Callable[[T], Iterable[T]],
    workers: int,
    slices: int = SLICES,
    identity: Callable[[T], Hashable] = lambda task: task,
) -> Grouping[T]:
    """Group the tasks of one graph, given in a topological order (every task after its
    dependencies), for ``workers`` workers: a group holds at most ``1 / (workers * slices)`` of the
    graph's tasks. Dependencies outside ``order`` (keys computed before) are ignored. Tasks are told
    apart by ``identity``: the scheduler passes ``id``, which spares hashing its task states in
    Python. Linear in tasks and edges, and written for speed (it runs in ``update_graph``)."""
    cap = max(1, math.ceil(len(order) / (max(1, workers) * max(1, slices))))
    parent: list[int] = []
    size: list[int] = []  # tasks per group, at its representative
    label: dict[Hashable, int] = {}
    is_shared: set[Hashable] = set()
    reads: list[T] = []  # tasks that depend on a task outside the graph
    edges = crossing = 0
    for task in order:
        found = -1
        more: set[int] | None = None
        inner = 0
        for dep in dependencies(task):
            g = label.get(identity(dep))
            if g is None:
                if identity(dep) in is_shared:
                    inner += 1
                else:
                    reads.append(task)  # outside the graph: computed before
                continue
            inner += 1
            while parent[g] != g:
                parent[g] = g = parent[parent[g]]
            if found < 0:
                found = g
            elif g != found:
                if more is None:
                    more = {found}
                more.add(g)
        edges += inner
        if not inner:
            found = len(parent)
            parent.append(found)
            size.append(0)
        elif more is not None:
            if sum(size[g] for g in more) >= cap:
                found = -1
                crossing += inner
            else:
                for g in more:
                    if g != found:
                        parent[g] = found
                        size[found] += size[g]
        if found < 0:
            is_shared.add(identity(task))
        else:
            label[identity(task)] = found
            size[found] += 1
    return _grouping(order, label, parent, reads, identity, Grouping([], [], edges, crossing))


def _grouping(
    order: Sequence[T],
    label: Mapping[Hashable, int],
    parent: list[int],
    reads: Iterable[T],
    identity: Callable[[T], Hashable],
    grouping: Grouping[T],
) -> Grouping[T]:
    """``grouping`` with each group's tasks, in the order given, from each task's label and the
    union-find, the tasks in no group (shared), and the groups that read data computed before."""
    members: dict[int, list[T]] = {}
    for task in order:
        g = label.get(identity(task))
        if g is None:
            grouping.shared.append(task)
            continue
        while parent[g] != g:
            g = parent[g]
        members.setdefault(g, []).append(task)
    index = {g: i for i, g in enumerate(members)}
    outside = set()
    for task in reads:
        g = label.get(identity(task))
        if g is not None:
            while parent[g] != g:
                g = parent[g]
            outside.add(index[g])
    grouping.groups = list(members.values())
    grouping.outside = frozenset(outside)
    return grouping


def assign(sizes: Sequence[int], load: Mapping[str, float], threads: Mapping[str, int]) -> list[str]:
    """A worker for each group, the groups given in priority order (by their first task) with their
    number of tasks: consecutive groups fill one worker to its fair share before the next takes
    over, so that the groups that a reduction combines next are mostly on one worker. The fair share
    is in proportion to threads, of the graph's tasks and of those the workers hold already
    (``load``, tasks by address); the least loaded worker fills first, ties by address, so that
    the assignment is deterministic and a worker that just joined takes the first groups."""
    if not load:
        return []
    total_threads = sum(max(1, threads.get(a, 1)) for a in load)
    total = sum(sizes) + sum(load.values())
    order = sorted(load, key=lambda a: (load[a] / max(1, threads.get(a, 1)), a))
    homes: list[str] = []
    index = 0
    filled = load[order[0]]
    for size in sizes:
        fair = total * max(1, threads.get(order[index], 1)) / total_threads
        # On to the next worker when this group would overfill the current one by more than half of it.
        if index < len(order) - 1 and filled + size / 2 > fair and filled > load[order[index]]:
            index += 1
            filled = load[order[index]]
        homes.append(order[index])
        filled += size
    return homes


@dataclass
class Figures:
    """What placement did, as counters (the agent's ``placement`` operation reports them)."""

    graphs_placed: int = 0
    graphs_left: dict[str, int] = field(default_factory=dict)
    groups: int = 0
    tasks_placed: int = 0
    rehomed: int = 0
    seconds: float = 0.0
    longest: float = 0.0

    def left(self, reason: str) -> None:
        self.graphs_left[reason] = self.graphs_left.get(reason, 0) + 1

    def plain(self) -> dict[str, Any]:
        return {
            "graphs_placed": self.graphs_placed,
            "graphs_left": dict(self.graphs_left),
            "groups": self.groups,
            "tasks_placed": self.tasks_placed,
            "rehomed": self.rehomed,
            "seconds": round(self.seconds, 6),
            "longest": round(self.longest, 6),
        }


WAITING = frozenset({"released", "waiting", "no-worker", "queued"})


class PlacementPlugin(SchedulerPlugin):
    """The scheduler plugin: places each graph as it arrives, and keeps its groups' homes on
    running workers."""

    name = NAME

    def __init__(self, scheduler: Any, max_tasks: int = MAX_TASKS, owner: str = "") -> None:
        self.scheduler = scheduler
        self.max_tasks = max_tasks
        self.owner = owner
        self.figures = Figures()
        # group number -> its tasks, and key -> group number, while the scheduler knows a placed
        # task: at most what the scheduler itself holds, dropped as it forgets tasks.
        self.members: dict[int, list[Any]] = {}
        self.remaining: dict[int, int] = {}
        self.group_of: dict[Hashable, int] = {}
        self.home: dict[int, str] = {}
        self.next_group = 0
        # group number -> its roots held back, in priority order (:meth:`refill`), and the largest
        # output of its roots computed so far.
        self.held: dict[int, deque[Any]] = {}
        self.root_bytes: dict[int, int] = {}
        self.roots: dict[int, int] = {}
        self.refilling = False

    # The scheduler's hooks.

    def update_graph(
        self, scheduler: Any, *, tasks: Collection[Hashable] = (), annotations: Any = None, **_: Any
    ) -> None:
        started = time.perf_counter()
        try:
            self._place(scheduler, tasks, annotations or {})
            if self.held and not self.refilling:
                # The first roots go once Dask has parked them, after this graph's transitions.
                self.refilling = True
                scheduler.loop.add_callback(self.refill)
        finally:
            took = time.perf_counter() - started
            self.figures.seconds += took
            self.figures.longest = max(self.figures.longest, took)

    def transition(self, key: Hashable, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        if start == "processing" and self.held and not self.refilling:
            # A slot may have opened: sent on once this stimulus' transitions are done (a hook may
            # not start transitions of its own).
            self.refilling = True
            self.scheduler.loop.add_callback(self.refill)
        if key not in self.group_of:
            return
        if start == "processing" and finish == "memory" and self.group_of[key] in self.held:
            ts = self.scheduler.tasks.get(key)
            if ts is not None and not ts.dependencies:
                g = self.group_of[key]
                self.root_bytes[g] = max(self.root_bytes.get(g, 0), ts.get_nbytes())
        # Kept until the scheduler forgets the task, not once it is computed: a result lost with
        # its worker is computed again, and must then follow its group's home too.
        if finish == "forgotten":
            g = self.group_of.pop(key)
            self.remaining[g] -= 1
            if self.remaining[g] <= 0:
                del self.members[g], self.home[g], self.remaining[g]
                self.held.pop(g, None)
                self.root_bytes.pop(g, None)
                self.roots.pop(g, None)

    def remove_worker(self, scheduler: Any, worker: str, **_: Any) -> None:
        # Dask has sent the tasks it ran back to waiting, and those of its groups to ``no-worker``.
        rehome(scheduler, [worker])
        self.refill()

    def add_worker(self, scheduler: Any, worker: str) -> None:
        # Groups whose worker left while no other ran wait for this one.
        rehome(scheduler, [])
        self.refill()

    def refill(self) -> None:
        """Send on held roots, the first groups' first, while their worker has a free slot."""
        self.refilling = False
        saturation = float(getattr(self.scheduler, "WORKER_SATURATION", 1.1))
        slots: dict[str, int] = {}
        sent: list[Any] = []
        for number in sorted(self.held):
            home = self.home.get(number, "")
            ws = self.scheduler.workers.get(home)
            if ws is None or ws not in self.scheduler.running:
                continue  # rehome moves the group first
            if home not in slots:
                slots[home] = _slots(ws, saturation)
            queue = self.held[number]
            seen = self.root_bytes.get(number)
            unpaced = seen is not None and seen * self.roots.get(number, 0) <= UNPACED_BYTES
            while queue and (slots[home] > 0 or unpaced):
                ts = queue[0]
                if ts.worker_restrictions != _HELD or ts.state not in WAITING:
                    queue.popleft()  # forgotten, or no longer placement's to hold
                    continue
                if ts.state != "no-worker":
                    break  # not parked yet: Dask has not run this graph's transitions
                queue.popleft()
                ts.worker_restrictions = {home}
                sent.append(ts)
                slots[home] -= 1
            if not queue:
                del self.held[number]
                self.root_bytes.pop(number, None)
                self.roots.pop(number, None)
        _send_on(self.scheduler, sent)

    def log_event(self, topic: Any, msg: Any) -> None:
        # A worker that stops running (paused, retiring: Dask logs the change before it takes the
        # worker out of ``running``) gives its groups up: their next tasks must not wait for it.
        if isinstance(msg, dict) and msg.get("action") == "worker-status-change" and msg.get("status") != "running":
            rehome(self.scheduler, [str(topic)])

    # Placing one graph.

    def _place(self, scheduler: Any, keys: Collection[Hashable], annotations: Mapping[str, Any]) -> None:
        if len(keys) > self.max_tasks:
            self.figures.left("larger than maxTasks")
            return
        opted_out = annotations.get(OPT_OUT) or {}
        if any(value is False or value == "off" for value in opted_out.values()):
            self.figures.left("opted out")
            return
        running = list(scheduler.running)
        if len(running) < 2:
            self.figures.left("fewer than two workers")
            return
        new = self._new_tasks(scheduler.tasks, keys)
        if new is None:
            return
        new.sort(key=_order_key(new, annotations))
        grouping = group(new, _DEPENDENCIES, len(running), identity=id)
        if not grouping.partitions:
            self.figures.left("does not partition")
            return
        # ``group`` keeps the order of its input: the groups come in the priority order of their
        # first tasks, and each group's tasks in priority order.
        homes = _homes(grouping.groups, running, grouping.outside)
        group_of = self.group_of
        placed = 0
        pace = not math.isinf(float(getattr(scheduler, "WORKER_SATURATION", 1.1)))
        parked = set(_HELD)  # one set for every held root, as ``restriction`` below
        for members, home in zip(grouping.groups, homes, strict=True):
            if home is None:
                continue
            placed += len(members)
            number = self.next_group
            self.next_group += 1
            self.members[number] = members
            self.home[number] = home
            self.remaining[number] = len(members)
            # One set for the group's tasks, not one each: Dask replaces a task's restrictions and
            # never changes them in place, and rehome and release replace them too.
            restriction = {home}
            if not pace:
                for ts in members:
                    ts.worker_restrictions = restriction
                    group_of[ts.key] = number
                continue
            held: deque[Any] = deque()
            for ts in members:
                if ts.dependencies:
                    ts.worker_restrictions = restriction
                else:
                    ts.worker_restrictions = parked
                    held.append(ts)
                group_of[ts.key] = number
            if held:
                self.held[number] = held
                self.roots[number] = len(held)
        self.figures.graphs_placed += 1
        self.figures.groups += sum(home is not None for home in homes)
        self.figures.tasks_placed += placed

    def _new_tasks(self, tasks: Mapping[Hashable, Any], keys: Collection[Hashable]) -> list[Any] | None:
        """The graph's tasks still to run, or None (and why, in the figures) where it is Dask's to place."""
        new: list[Any] = []
        append = new.append
        for ts in map(tasks.get, keys):
            if ts is None or ts.run_spec is None or ts.state != "released":
                continue
            if ts.worker_restrictions or ts.host_restrictions or ts.resource_restrictions:
                self.figures.left("restricted already")
                return None
            if isinstance(ts.run_spec, P2PBarrierTask):
                # A P2P shuffle or rechunk restricts its own tasks at its barrier, and restarts
                # them when a worker leaves: it is Dask's to place.
                self.figures.left("a P2P shuffle")
                return None
            append(ts)
        return new


_PRIORITY = operator.attrgetter("priority")
_GENERATION = operator.itemgetter(1)


def _internal(ts: Any) -> int:
    return ts.priority[2]  # type: ignore[no-any-return]


def _order_key(new: Sequence[Any], annotations: Mapping[str, Any]) -> Callable[[Any], Any]:
    """How to put a graph's tasks in priority order. Dask's priority is (-user priority, the graph's
    generation, ``dask.order``'s place); where the first two are the same for every task (no task
    annotated with a priority of its own, none left from an earlier graph), the place alone gives the
    same order, and integers sort in a third of the time of tuples (``bench/placement.py``)."""
    if "priority" in annotations or len(set(map(_GENERATION, map(_PRIORITY, new)))) > 1:
        return _PRIORITY
    return _internal


_DEPENDENCIES = operator.attrgetter("dependencies")


def _homes(groups: Sequence[list[Any]], running: Sequence[Any], outside: Collection[int]) -> list[str | None]:
    """A worker for each group, or None for a group left to Dask. A group that reads data computed
    before (a persisted array) goes to the running worker that holds it, so that the data stays
    where it is; one whose such data is spread over workers is left to Dask, which places each of
    its tasks by where its inputs are. The other groups are dealt by :func:`assign`, counting what
    the first took. Only the groups ``outside`` (by index) read data computed before."""
    load = {ws.address: float(len(ws.processing)) for ws in running}
    threads = {ws.address: ws.nthreads for ws in running}
    homes: list[str | None] = [""] * len(groups)
    for index in sorted(outside):
        members = groups[index]
        held: dict[str, int] = {}
        for ts in members:
            for dts in ts.dependencies:
                if dts.who_has and dts.state == "memory":  # a dependency inside the graph is not computed yet
                    for ws in dts.who_has:
                        if ws.address in load:
                            held[ws.address] = held.get(ws.address, 0) + dts.get_nbytes()
        if held:
            holder = max(sorted(held), key=held.__getitem__)
            if held[holder] < LOCATED * sum(held.values()):
                homes[index] = None
                continue
            homes[index] = holder
            load[holder] += len(members)
    free = [index for index, home in enumerate(homes) if home == ""]
    for index, home in zip(free, assign([len(groups[i]) for i in free], load, threads), strict=True):
        homes[index] = home
    return homes


def rehome(scheduler: Any, leaving: Iterable[str]) -> int:
    """Move the groups whose worker is ``leaving`` (left, paused, or being drained) or no longer
    running to the running worker that holds most of each group's bytes in memory, or else the
    least subscribed one: the waiting tasks' restriction changes, and those Dask had found no
    worker for are sent on. Returns how many groups moved (0 without placement, or with no worker
    running: they move when one joins)."""
    plugin = scheduler.plugins.get(NAME)
    if not isinstance(plugin, PlacementPlugin):
        return 0
    gone = set(leaving)
    running = {ws.address: ws for ws in scheduler.running if ws.address not in gone}
    if not running:
        return 0
    load = {a: len(ws.processing) / max(1, ws.nthreads) for a, ws in running.items()}
    moved = 0
    unrunnable: list[Any] = []
    for number, members in plugin.members.items():
        home = plugin.home[number]
        if home not in running:
            held: dict[str, int] = {}
            for ts in members:
                if ts.state == "memory":
                    for ws in ts.who_has or ():
                        if ws.address in running:
                            held[ws.address] = held.get(ws.address, 0) + ts.get_nbytes()
            home = max(held, key=held.__getitem__) if held else min(sorted(load), key=load.__getitem__)
            plugin.home[number] = home
            load[home] += len(members) / max(1, running[home].nthreads)
            moved += 1
        # Every task that may still run follows its group's home: those that waited, and those
        # that ran on a worker that left, which Dask sent back with their old restriction.
        for ts in members:
            if ts.state in WAITING and ts.worker_restrictions != {home} and ts.worker_restrictions != _HELD:
                ts.worker_restrictions = {home}
                if ts.state == "no-worker":
                    unrunnable.append(ts)
    plugin.figures.rehomed += moved
    _send_on(scheduler, unrunnable)
    return moved


def _slots(ws: Any, saturation: float) -> int:
    """A worker's free slots as Dask's queuing counts them (its own ``_task_slots_available``), plus
    :data:`AHEAD` per thread; unbounded under ``worker-saturation: inf`` (set while roots were held)."""
    if math.isinf(saturation):
        return sys.maxsize
    return int(_task_slots_available(ws, saturation)) + AHEAD * int(ws.nthreads)


def _send_on(scheduler: Any, unrunnable: list[Any]) -> None:
    if unrunnable:
        # As Dask does for a worker that joins (recommendations are processed last first).
        unrunnable.sort(key=lambda ts: ts.priority, reverse=True)
        scheduler.transitions({ts.key: "processing" for ts in unrunnable}, f"memops-placement-{time.time()}")


def release(scheduler: Any, plugin: PlacementPlugin) -> None:
    """Lift every restriction that ``plugin`` set on a task still waiting, so that nothing waits
    for placement once it is removed."""
    unrunnable = []
    for members in plugin.members.values():
        for ts in members:
            if ts.state in WAITING:
                ts.worker_restrictions = set()
                if ts.state == "no-worker":
                    unrunnable.append(ts)
    plugin.members.clear()
    plugin.home.clear()
    plugin.remaining.clear()
    plugin.group_of.clear()
    plugin.held.clear()
    plugin.root_bytes.clear()
    plugin.roots.clear()
    _send_on(scheduler, unrunnable)


def configure(dask_scheduler: Any, enabled: bool, max_tasks: int = MAX_TASKS, owner: str = "") -> dict[str, Any] | None:
    """Run on the scheduler (by the agent's ``placement`` operation): install, retune or remove
    placement. Idempotent; placement that another ``owner`` installed is left as it is. Returns
    the figures, or None once removed: removing it lifts the restrictions it set."""
    plugin = dask_scheduler.plugins.get(NAME)
    if plugin is not None and getattr(plugin, "owner", "") not in ("", owner):
        return {**plugin.figures.plain(), "owner": plugin.owner}
    if not enabled:
        if isinstance(plugin, PlacementPlugin):
            dask_scheduler.remove_plugin(NAME)
            release(dask_scheduler, plugin)
        return None
    if plugin is None:
        plugin = PlacementPlugin(dask_scheduler, max_tasks=max_tasks, owner=owner)
        dask_scheduler.add_plugin(plugin, name=NAME)
    plugin.max_tasks = max(0, int(max_tasks))
    plugin.owner = owner
    return {**plugin.figures.plain(), "owner": owner}
