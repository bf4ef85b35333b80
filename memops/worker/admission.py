"""Memory-aware task admission, the worker's side: profile each task's peak, start a task only where
its peak fits, and preempt a preemptible task before the nanny kills the whole worker.

**Profile.** A thread samples the process' resident memory every :data:`SAMPLE_SECONDS` (one read
of ``/proc/self/statm`` through psutil, about 10 us: 0.05% of one core at 20 ms). A task's peak is
the most it grew the process by while it ran. Where tasks run at once, the growth between two samples
is shared among them by the pages each one's thread touched for the first time meanwhile (its minor
page faults, read from ``/proc/self/task/<tid>/stat``; faults of other threads are shared evenly,
and memory given back is taken from each in proportion to what it holds: :func:`attribute`). A
task's share is never more than the process grew by since it started, the measure where that file
cannot be read. Without the faults, two tasks that ran together would each be seen holding both
tasks' memory: a profile double the truth, and half the tasks admitted. A prefix's profile is the
median of its last :data:`KEPT` observations (:class:`Profiles`).

**Admit.** Dask's own worker resources do the admitting: a task of a profiled prefix whose peak is at
least ``small`` carries the resource :data:`RESOURCE` (bytes) from the scheduler, and Dask's worker
starts it only while that much is available. Here the worker's total of it follows its memory: the
pause threshold's bytes less the process' memory now, less what the running restricted tasks
reserved (Dask subtracts that); what the process grew by since the first of those started counts
once, in their reservations, not twice, and the keys that Dask would spill to disk past its spill
threshold count as room (:func:`room`): a task may make Dask spill, never the nanny kill. A
task of a prefix this worker has profiled since the scheduler restricted it is retuned here before
it starts (a task under ``small`` goes to Dask's ready queue and runs as stock Dask runs it).

**One container, several processes.** ``dask worker --nworkers 2`` (the Dask Helm chart's
``worker.extraArgs``) gives each process the whole ``--memory-limit`` (Dask caps it at the
container's cgroup limit only), while the kernel holds the container's processes together to that
limit. Here a process' limit is its share of the container, the cgroup limit over the worker
processes that share it (:func:`pod_share`: siblings under one ``dask worker``, counted every
:data:`SIBLINGS_SECONDS`), when that is lower: the processes' rooms then add up to the container's,
and they admit no more between them than it holds.

**Probe.** A task of a prefix never profiled arrives asking for the whole capacity of the smallest
worker (the scheduler's probe): here, unless this worker has profiled its prefix since, it
starts only when no other restricted task runs, and takes all the room there is. So the first wave of
an unseen prefix runs one task at a time per worker, not ``nthreads`` at once, until one finished
and gave it a profile. (The scheduler sends no sentinel when the policy sets ``unprofiled: Run``.)

**Preempt.** When the process' memory passes ``preempt_above`` of the limit, the newest running task
that is preemptible (its prefix matches a preemptible glob, or it is annotated
``memops_preemptible``; a higher level goes first) is stopped: :class:`distributed.Reschedule` is
raised in its thread. Dask reschedules it as no failure; its observed growth becomes its prefix's
profile, so that it runs again only where that fits. An exception raised in a thread takes effect
between two Python bytecodes only: a task inside one C call (a NumPy allocation, a pandas merge,
``time.sleep``) is stopped when that call returns, which may be too late. A task is preempted at
most ``max_retries`` times on one worker.

Imports nothing of memops but its siblings (sent by value to a stock Dask image).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fnmatch
import gc
import logging
import re
import statistics
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

logger = logging.getLogger(__name__)

NAME = "memops_admission"
"""The worker plugin's name."""
RESOURCE = "memops-memory"
"""The Dask worker resource, in bytes, that admitted tasks reserve."""
TOPIC = "memops-admission"
"""The event topic on which workers report peaks to the scheduler's plugin."""
OPT_OUT = "memops_admission"
"""``dask.annotate(memops_admission=False)``: these tasks run as stock Dask runs them."""
PREEMPTIBLE = "memops_preemptible"
"""``dask.annotate(memops_preemptible=1)`` (a level, 1 to 9, or True for 1): the task may be preempted."""
UNLIMITED = float("inf")
SAMPLE_SECONDS = 0.02
TICK_SECONDS = 0.05
REPORT_SECONDS = 0.5
STALL_SECONDS = 10.0
"""How long the head of the constrained queue waits, with no restricted task running, for room that
memory no task holds keeps taken (the process' own, unmanaged): the collector and ``malloc_trim`` run
at once, and past this it starts anyway, with the room there is, alone (preemption stands guard).
Without it a worker's process that does not give freed memory back to the system (glibc keeps it)
would keep its queued tasks waiting for ever."""
KEPT = 8
"""Observations kept per prefix."""
MAX_PREFIXES = 4096
"""Prefixes profiled, at most: the least recently observed is forgotten first."""
MAX_PREFIX_CHARS = 200
MAX_PEAK = 2**50
SIBLINGS_SECONDS = 5.0
"""How often the worker processes that share this one's container are counted again."""
MAX_REPORTED = 64
"""Peaks in one report, at most (the scheduler reads no more from one)."""


def bounded_prefix(value: Any) -> str | None:
    """A prefix name as a peer may send it: a string of at most :data:`MAX_PREFIX_CHARS`, or None."""
    if isinstance(value, str) and 0 < len(value) <= MAX_PREFIX_CHARS:
        return value
    return None


def bounded_peak(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_PEAK:
        return value
    return None


@dataclass
class Profiles:
    """Per prefix, its last :data:`KEPT` peaks (bytes), for at most ``limit`` prefixes."""

    limit: int = MAX_PREFIXES
    peaks: OrderedDict[str, deque[int]] = field(default_factory=OrderedDict)

    def add(self, prefix: str, peak: int) -> None:
        kept = self.peaks.pop(prefix, None)
        if kept is None:
            kept = deque(maxlen=KEPT)
        kept.append(peak)
        self.peaks[prefix] = kept
        while len(self.peaks) > self.limit:
            self.peaks.popitem(last=False)

    def peak(self, prefix: str) -> int | None:
        """The prefix's profile: the median of its kept peaks (the higher middle one), or None."""
        kept = self.peaks.get(prefix)
        return int(statistics.median_high(kept)) if kept else None

    def top(self, count: int) -> list[tuple[str, int, int]]:
        """The ``count`` prefixes with the highest profiles: (prefix, peak, observations)."""
        ranked = sorted(((p, self.peak(p) or 0, len(k)) for p, k in self.peaks.items()), key=lambda t: (-t[1], t[0]))
        return ranked[:count]


def requirement(peak: int | None, *, small: int, probe: float | None) -> float | None:
    """What a task of a prefix with this profile reserves: None (no restriction) under ``small``,
    ``probe`` when unprofiled (None: it runs as stock Dask runs it), else its peak."""
    if peak is None:
        return probe
    return float(peak) if peak >= small else None


def room(
    limit: int, pause: float, process: int, running: Iterable[tuple[float, int]] = (), spillable: int = 0
) -> float:
    """The bytes a worker may still give its restricted tasks, up to its pause threshold: the
    threshold less the process' memory, where the memory that the ``running`` restricted tasks
    (reservation, the process' memory when it started) have grown the process by since the first
    of them started is not counted, up to their reservations (Dask subtracts those), and neither is
    what Dask would spill to disk (``spillable``: the keys in memory of a worker that spills)."""
    reserved = 0.0
    first = process
    for amount, started in running:
        reserved += amount
        first = min(first, started)
    credit = min(reserved, max(0, process - first))
    return max(0.0, pause * limit - process + credit + max(0, min(spillable, process - credit)))


def pod_share(own: int, container: int, processes: int) -> int:
    """A worker process' memory limit for admission: its own (``--memory-limit``), or its share of
    the container's limit among the ``processes`` that share the container, whichever is lower."""
    if processes <= 1 or container <= 0 or own <= 0:
        return own
    return min(own, container // processes)


def siblings(process: Any) -> int:
    """The Dask worker processes in this one's container: those its parent (``dask worker``, whose
    nannies start them) started as it started this one (the same command line, numbers aside: the
    pipes that multiprocessing passes). At least 1."""
    import psutil  # type: ignore[import-untyped]

    def shape(p: Any) -> str:
        return re.sub(r"\d+", "#", "\0".join(p.cmdline()))

    try:
        parent = process.parent()
        mine = shape(process)
        if parent is None:
            return 1
        found = 0
        for child in parent.children():
            with contextlib.suppress(psutil.Error):
                found += shape(child) == mine
        return max(1, found)
    except psutil.Error:
        return 1


def attribute(
    held: Mapping[Any, float],
    caps: Mapping[Any, float],
    delta: float,
    faults: Mapping[Any, int],
    other: int,
    fresh: Collection[Any] = (),
    busy: Collection[Any] = (),
) -> dict[Any, float]:
    """What each running task holds after the process' memory changed by ``delta`` bytes: growth is
    shared by the new pages each task's thread touched (``faults``) and those touched elsewhere
    (``other``: shared evenly among the ``fresh`` tasks, whose threads were not counted yet, where
    there are some, else among all), or evenly where no page was touched; memory given back is taken
    from each in proportion to what it ``held``, among the ``busy`` tasks (whose threads ran
    meanwhile: a task asleep frees nothing) where they hold some. Each is kept within 0 and its
    ``caps`` (what the process grew by since that task started)."""
    if not held:
        return {}
    if delta >= 0:
        takers = [key for key in held if key in fresh] or list(held)
        weights = {key: faults.get(key, 0) + (other / len(takers) if key in takers else 0) for key in held}
    else:
        freeing = [key for key in held if key in busy and held[key] > 0] or list(held)
        weights = {key: (held[key] if key in freeing else 0.0) for key in held}
    result = dict(held)
    left, open_ = float(delta), set(held)
    # What one task's cap refuses goes to the others (a task's growth is not lost: that would
    # understate a peak), until every one is at its cap or all is given.
    while open_ and abs(left) > 0.5:
        total, amount, capped = sum(weights[key] for key in open_), left, False
        for key in list(open_):
            share = weights[key] / total if total > 0 else 1 / len(open_)
            value = result[key] + amount * share
            bounded = min(max(0.0, value), max(0.0, caps[key]))
            left -= bounded - result[key]
            result[key] = bounded
            if bounded != value:
                open_.discard(key)
                capped = True
        if not capped:
            break
    return result


def _stat(path: str) -> tuple[int, int] | None:
    """The minor page faults and the CPU ticks (user and system) in a ``/proc`` ``stat`` file (its
    10th, 14th and 15th fields), or None where it cannot be read."""
    try:
        with open(path, "rb") as file:
            fields = file.read().rsplit(b")", 1)[1].split()
        return int(fields[7]), int(fields[11]) + int(fields[12])
    except (OSError, ValueError, IndexError):
        return None


def level(prefix: str, annotation: Any, globs: Collection[str]) -> int:
    """How preemptible a task is: 0 (not), or 1 to 9 (the highest goes first). An annotation wins."""
    if annotation is True:
        return 1
    if isinstance(annotation, int) and not isinstance(annotation, bool):
        return max(0, min(9, annotation))
    if annotation is False:
        return 0
    return 1 if any(fnmatch.fnmatchcase(prefix, g) for g in globs) else 0


def victim(running: Iterable[tuple[Any, float, int]], retries: Mapping[Any, int], max_retries: int) -> Any:
    """The task to preempt among ``running`` (key, start time, level): the highest level, then the
    newest, of those preemptible and preempted fewer than ``max_retries`` times; or None."""
    candidates = [(lvl, started, key) for key, started, lvl in running if lvl > 0 and retries.get(key, 0) < max_retries]
    if not candidates:
        return None
    return max(candidates, key=lambda c: (c[0], c[1]))[2]


def _give_back() -> None:
    """Memory that no object holds, back to the system: the collector's cycles (a preempted task's
    frames), then glibc's free pages (``malloc_trim``; elsewhere, nothing more)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def raise_in_thread(thread_id: int, exception: type[BaseException]) -> bool:
    """Raise ``exception`` in the thread ``thread_id`` at its next bytecode; whether it was found."""
    found = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exception))
    return bool(found == 1)


@dataclass
class Settings:
    small: int = 128 * 2**20
    preempt_above: float = 0.0  # 0: never preempt
    preemptible: tuple[str, ...] = ()
    max_retries: int = 3


@dataclass
class Running:
    key: Any
    prefix: str
    started: float
    rss_start: int
    rss_low: int
    level: int
    reserved: float = 0.0
    grown: int = 0
    """The most it held at once: its peak (:func:`attribute`)."""
    held: float = 0.0
    """What it holds now, of the process' growth since it started (:func:`attribute`)."""
    tid: int | None = None
    """Its thread's native ID, once Dask's executor thread has it."""
    faults: tuple[int, int] | None = None
    """Its thread's minor page faults and CPU ticks at the last sample."""


class Admission:
    """One worker's admission: its profiles, its room, its running tasks."""

    def __init__(self, worker: Any, settings: Settings) -> None:
        import psutil

        self.worker = worker
        self.settings = settings
        self.profiles = Profiles()
        self.process = psutil.Process()
        self.rss = int(self.process.memory_info().rss)
        self.faults: int | None = None
        """The process' minor page faults at the last sample while tasks ran."""
        self.paged = _stat("/proc/self/stat") is not None
        self.departed: list[float] = []
        """What the tasks that ended since the last sample held (appended on the event loop)."""
        """Whether page faults can be read (Linux): else each task is measured by the process' growth."""
        self.sharing = siblings(self.process)
        self.counted = time.monotonic()
        self.running: dict[Any, Running] = {}
        self.retries: OrderedDict[Any, int] = OrderedDict()
        self.signalled: set[Any] = set()
        self.unreported: list[tuple[str, int]] = []
        self.preempted = 0
        self.collect = False
        self.stalled: float | None = None
        """Since when the constrained queue's head waits with no restricted task running (monotonic)."""
        self.reported = 0.0
        self.told = 0.0
        """The capacity the scheduler was last told (:meth:`tell_capacity`)."""
        self.telling: Any = None
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._sample, name="memops-admission", daemon=True)

    # -- memory ---------------------------------------------------------------------------------

    def _sample(self) -> None:
        while not self.stopped.wait(SAMPLE_SECONDS):
            try:
                rss = int(self.process.memory_info().rss)
            except Exception:  # the process is going away
                return
            delta, self.rss = rss - self.rss, rss
            entries = list(self.running.values())
            for entry in entries:
                entry.rss_low = min(entry.rss_low, rss)
            self._attribute(entries, rss, delta)

    def _attribute(self, entries: list[Running], rss: int, delta: int) -> None:
        """Share the change between two samples among the running tasks (:func:`attribute`)."""
        # What the tasks that ended since the last sample held left with them (their results, as
        # Dask's managed memory, stay: over-counted, it is given to the running tasks, not taken).
        departed, self.departed = self.departed, []
        if not entries:
            self.faults = None  # read nothing while no task runs
            return
        total = _stat("/proc/self/stat") if self.paged else None
        if total is None:  # no /proc: each task is measured by the process' growth since it started
            for entry in entries:
                entry.grown = max(entry.grown, rss - entry.rss_low)
            return
        self._find_threads(entries)
        counts: dict[Any, int] = {}
        fresh, busy = [], []
        for entry in entries:
            now = _stat(f"/proc/self/task/{entry.tid}/stat") if entry.tid else None
            if now is None or entry.faults is None:
                fresh.append(entry.key)  # what its thread touched before it was counted is among the others'
                busy.append(entry.key)
            else:
                counts[entry.key] = max(0, now[0] - entry.faults[0])
                if now[1] > entry.faults[1]:
                    busy.append(entry.key)
            entry.faults = now
        other = max(0, total[0] - self.faults - sum(counts.values())) if self.faults is not None else 0
        self.faults = total[0]
        held = attribute(
            {e.key: e.held for e in entries},
            {e.key: rss - e.rss_low for e in entries},
            delta + sum(departed),
            counts,
            other,
            fresh,
            busy,
        )
        for entry in entries:
            entry.held = held[entry.key]
            entry.grown = max(entry.grown, int(entry.held))

    def _find_threads(self, entries: list[Running]) -> None:
        """The native thread IDs of the running tasks' threads, from Dask's executor bookkeeping."""
        missing = {e.key: e for e in entries if e.tid is None}
        if not missing:
            return
        try:
            active = dict(self.worker.active_threads)  # thread ident -> key, kept by the executing threads
        except RuntimeError:  # changed while copied: the next sample
            return
        for ident, key in active.items():
            entry = missing.get(key)
            thread = threading._active.get(ident)  # type: ignore[attr-defined]
            if entry is not None and thread is not None:
                entry.tid = thread.native_id

    def spillable(self) -> int:
        """The bytes of keys in memory that Dask spills to disk past its spill threshold: none when
        the worker does not spill (``distributed.worker.memory.spill: false``, or no spill buffer)."""
        fast = getattr(self.worker.data, "fast", None)
        if fast is None or not getattr(self.worker.memory_manager, "memory_spill_fraction", False):
            return 0
        return int(getattr(fast, "total_weight", 0) or 0)

    @property
    def capacity(self) -> float:
        """What the scheduler sees of this worker: the pause threshold's bytes."""
        return self.pause * self.limit

    @property
    def limit(self) -> int:
        """This process' memory limit for admission (:func:`pod_share`)."""
        from distributed.system import MEMORY_LIMIT

        own = int(getattr(self.worker.memory_manager, "memory_limit", 0) or 0)
        return pod_share(own, MEMORY_LIMIT, self.sharing)

    def count_siblings(self) -> None:
        now = time.monotonic()
        if now - self.counted >= SIBLINGS_SECONDS:
            self.counted = now
            self.sharing = siblings(self.process)

    @property
    def pause(self) -> float:
        fraction = getattr(self.worker.memory_manager, "memory_pause_fraction", False)
        return float(fraction) if fraction else 0.8

    # -- tasks ----------------------------------------------------------------------------------

    def started(self, key: Any) -> None:
        ts = self.worker.state.tasks.get(key)
        if ts is None:
            return
        annotations = ts.annotations or {}
        rss = self.rss
        self.running[key] = Running(
            key,
            ts.prefix,
            time.monotonic(),
            rss,
            rss,
            level(ts.prefix, annotations.get(PREEMPTIBLE), self.settings.preemptible),
            float((ts.resource_restrictions or {}).get(RESOURCE, 0.0)),
        )

    def finished(self, key: Any, finish: str) -> None:
        entry = self.running.pop(key, None)
        self.signalled.discard(key)
        if entry is not None and entry.held:
            self.departed.append(entry.held)
        if entry is None or finish not in ("memory", "rescheduled", "error"):
            return
        peak = entry.grown
        if finish == "rescheduled":
            # Its frames, and what they hold, live on in a reference cycle of its exception until
            # the collector runs: the next tick runs it.
            self.collect = True
            if self.profiles.peak(entry.prefix) is not None:
                return  # stopped before its end: an observation of a part of it, among others'
            if not self.paged:
                # Measured without page faults, tasks that grew together each hold all the growth:
                # shared here, lest a reservation above every worker's capacity leave the task
                # waiting for a worker that never comes.
                peak //= 1 + len(self.running)
        self.profiles.add(entry.prefix, peak)
        self.unreported.append((entry.prefix, peak))
        self.retune(entry.prefix)

    def retune(self, prefix: str | None = None) -> None:
        """Give the waiting tasks of ``prefix`` (or of every prefix) the reservation of this worker's
        profile."""
        for ts in list(self.worker.state.constrained):
            if prefix is None or ts.prefix == prefix:
                self.arrived(ts)

    def arrived(self, ts: Any) -> None:
        """A task waiting in Dask's constrained queue: memops' reservation is retuned to this worker's
        profile of its prefix (a probe waits for its turn); a task under ``small`` leaves for Dask's
        ready queue and runs as stock Dask runs it."""
        restrictions = ts.resource_restrictions or {}
        if set(restrictions) != {RESOURCE} or ts.state != "constrained":
            return  # the user's own resources, or none: not memops'
        if ts in self.worker.state.executing:
            # Dask starts a task within the transition that queues it, before plugins hear of it:
            # it holds its reservation already, and gives back what it took.
            return
        peak = self.profiles.peak(ts.prefix)
        if peak is None:
            if restrictions[RESOURCE] >= self.capacity:
                ts.resource_restrictions = {RESOURCE: UNLIMITED}
            return
        wanted = requirement(peak, small=self.settings.small, probe=None)
        ts.resource_restrictions = {RESOURCE: wanted} if wanted is not None else {}

    # -- the loop's tick ------------------------------------------------------------------------

    async def tell_capacity(self) -> None:
        """Tell the scheduler this worker's capacity (the pause threshold's bytes) again, after its
        memory limit changed (memops grew or shrank the worker in place), so that a task whose peak
        fitted no worker before may now be sent here. The worker's own count of the resource stays
        the room that :meth:`tick` sets (``Worker.set_resources`` would set it to the capacity). A
        tell that fails (the scheduler out of reach) is made again on a later tick."""
        capacity = self.capacity
        resources = {**self.worker.state.total_resources, RESOURCE: capacity}
        try:
            await self.worker.scheduler.set_resources(resources=resources, worker=self.worker.contact_address)
        except OSError as exc:  # distributed's CommClosedError among them
            logger.debug("memops admission: the scheduler was not told the capacity: %s", exc)
            return
        self.told = capacity

    def tick(self) -> None:
        state = self.worker.state
        self.count_siblings()
        if RESOURCE not in state.total_resources or not self.limit:
            return
        if self.capacity != self.told and (self.telling is None or self.telling.done()):
            self.telling = asyncio.ensure_future(self.tell_capacity())
        running = [(e.reserved, e.rss_start) for e in list(self.running.values()) if e.reserved]
        total = room(self.limit, self.pause, self.rss, running, self.spillable())
        state.available_resources[RESOURCE] += total - state.total_resources[RESOURCE]
        state.total_resources[RESOURCE] = total
        if self.collect:
            self.collect = False
            gc.collect()
        self._unblock()
        self._grant_probe()
        self._preempt()
        self._compute()
        self._report()

    def _unblock(self) -> None:
        """A task that reserves nothing goes to Dask's ready queue, where it runs as stock Dask runs
        it, instead of waiting behind a larger one at the head of the constrained queue. Done here,
        outside Dask's transitions, with Dask's count of tasks per state kept."""
        state = self.worker.state
        free = [ts for ts in state.constrained if not ts.resource_restrictions]
        for ts in free:
            ts.resource_restrictions = {}
            state.constrained.discard(ts)
            ts.state = "ready"
            state.ready.add(ts)
        if free:
            state.task_counter.transitions({ts: "constrained" for ts in free})

    def _grant_probe(self) -> None:
        """The probe at the head of the constrained queue starts when no restricted task runs and
        there is room: it takes all of it. So does a profiled task there whose reservation the room
        has not held for :data:`STALL_SECONDS` with no restricted task running: what fills the room
        is then memory that no task holds, which the collector and ``malloc_trim`` are asked to give
        back first."""
        state = self.worker.state
        head = state.constrained.peek() if state.constrained else None
        wanted = (head.resource_restrictions or {}).get(RESOURCE) if head is not None else None
        if wanted is None or any(RESOURCE in (ts.resource_restrictions or {}) for ts in state.executing):
            self.stalled = None
            return
        assert head is not None
        available = state.available_resources[RESOURCE]
        if wanted <= available or available <= 0:
            self.stalled = None  # Dask starts it; or the process is past the pause threshold
            return
        now = time.monotonic()
        if wanted != UNLIMITED and self.stalled is None:
            self.stalled = now
            _give_back()
            return
        if wanted == UNLIMITED or now - (self.stalled or now) >= STALL_SECONDS:
            if wanted != UNLIMITED:
                logger.warning(
                    "memops admits %s with %d bytes of room for its %d: no task holds the rest",
                    head.key,
                    available,
                    wanted,
                )
            head.resource_restrictions = {RESOURCE: available}
            self.stalled = None

    def _preempt(self) -> None:
        threshold = self.settings.preempt_above * self.limit
        if not threshold or self.rss <= threshold:
            return
        running = [(e.key, e.started, e.level) for e in self.running.values() if e.key not in self.signalled]
        key = victim(running, self.retries, self.settings.max_retries)
        if key is None:
            return
        thread_id = next((t for t, k in self.worker.active_threads.items() if k == key), None)
        if thread_id is None:
            return
        from distributed import Reschedule

        if raise_in_thread(thread_id, Reschedule):
            self.signalled.add(key)
            self.retries[key] = self.retries.pop(key, 0) + 1
            while len(self.retries) > MAX_PREFIXES:
                self.retries.popitem(last=False)
            self.preempted += 1
            logger.warning("memops preempted %s at %d bytes", key, self.rss)

    def _compute(self) -> None:
        """Start what the new room admits: Dask re-examines its constrained queue only when a task
        ends or arrives. The stimulus is Dask's unpause, sent only to a worker that runs (it then
        changes nothing but that: its handler sets ``running`` and fills the free threads)."""
        from distributed.worker_state_machine import UnpauseEvent

        state = self.worker.state
        if state.running and (state.constrained or state.ready) and len(state.executing) < state.nthreads:
            self.worker.handle_stimulus(UnpauseEvent(stimulus_id=f"memops-admission-{time.time()}"))

    def _report(self) -> None:
        now = time.monotonic()
        if now - self.reported < REPORT_SECONDS:
            return
        self.reported = now
        waiting = sum(1 for ts in self.worker.state.constrained if RESOURCE in (ts.resource_restrictions or {}))
        peaks, self.unreported = self.unreported[-MAX_REPORTED:], []
        self.worker.log_event(
            TOPIC, {"peaks": [list(p) for p in peaks], "preempted": self.preempted, "waiting": waiting}
        )


class AdmissionPlugin(WorkerPlugin):
    """Registered on every worker by the scheduler's admission (:mod:`memops.scheduler.admission`)."""

    name = NAME

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.admission: Admission | None = None
        self.callback: Any = None

    async def setup(self, worker: Any) -> None:
        from tornado.ioloop import PeriodicCallback

        admission = Admission(worker, self.settings)
        limit = admission.limit
        if not limit:
            logger.warning("memops admission: %s has no memory limit; its tasks are not admitted", worker.address)
            return
        self.admission = admission
        # What the scheduler sees is the capacity (the pause threshold's bytes): whether a task may
        # ever run here. What is free now is this worker's to judge, in ``tick``.
        await worker.set_resources(**{RESOURCE: admission.capacity})
        admission.told = admission.capacity
        worker.log_event(TOPIC, {"peaks": [], "preempted": 0, "waiting": 0})
        admission.thread.start()
        self.callback = PeriodicCallback(admission.tick, TICK_SECONDS * 1000)
        self.callback.start()

    def transition(self, key: Any, start: str, finish: str, **kwargs: Any) -> None:
        admission = self.admission
        if admission is None:
            return
        if finish == "executing":
            admission.started(key)
        elif start == "executing":
            admission.finished(key, finish)
        elif finish == "constrained":
            ts = admission.worker.state.tasks.get(key)
            if ts is not None:
                admission.arrived(ts)

    def teardown(self, worker: Any) -> None:
        if self.callback is not None:
            self.callback.stop()
        admission = self.admission
        if admission is None:
            return
        admission.stopped.set()
        state = worker.state
        # Nothing waits for a probe or a profile once memops is gone, and the resource stays at
        # the worker's capacity, as the scheduler sees it (a task still running gives its
        # reservation back to it).
        for ts in list(state.constrained):
            if set(ts.resource_restrictions or {}) == {RESOURCE} and ts not in state.executing:
                ts.resource_restrictions = {}
        if RESOURCE in state.total_resources:
            state.available_resources[RESOURCE] += admission.capacity - state.total_resources[RESOURCE]
            state.total_resources[RESOURCE] = admission.capacity
        admission._unblock()
        admission._compute()
