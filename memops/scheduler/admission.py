"""Memory-aware task admission, the scheduler's side: the profiles, and the reservation each new task
carries.

Workers measure each task's peak (:mod:`memops.worker.admission`) and report it on the event topic
:data:`~memops.worker.admission.TOPIC`; this plugin keeps, per task prefix, the median of the last
peaks, for at most :data:`~memops.worker.admission.MAX_PREFIXES` prefixes, reading at most
:data:`~memops.worker.admission.MAX_REPORTED` peaks from one report and refusing any value that is
not a bounded string or number (a tenant's worker is a peer like any other).

When a graph arrives, each new task of a prefix profiled at ``small`` or more reserves its peak of
the worker resource :data:`~memops.worker.admission.RESOURCE` (Dask's ``resources=``, which Dask's
worker honours: it starts the task only where the reservation fits); a task whose peak fits no
worker's capacity waits in Dask's ``no-worker`` state, and is counted as demand. A task of a prefix
never profiled reserves the whole capacity of the smallest worker (a probe: one at a time per
worker), unless the policy says ``unprofiled: Run``. When a profile arrives, the tasks of its prefix
that still wait in the scheduler are retuned to it. Tasks already restricted (a user's
``resources=``, ``workers=``) and tasks annotated ``memops_admission=False`` are left as they are.

Removing admission lifts every reservation it set on a task still waiting, and the worker plugin,
once unregistered, lets its queued tasks run.

Like the agent's other modules, this imports nothing from memops beyond its package and the worker
plugin it installs.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin

from memops.scheduler.placement import HELD
from memops.worker import admission as worker_admission
from memops.worker.admission import RESOURCE, Profiles, Settings, bounded_peak, bounded_prefix, requirement

NAME = "memops-admission"
"""The scheduler plugin's name."""
WAITING = ("released", "waiting", "no-worker")
"""The states in which a task's restrictions may still change."""
TOP = 5
"""Prefixes shown in the policy's status, by peak."""
MAX_PENDING = 1_000_000
"""Tasks followed for a retune, at most; beyond that a probe keeps its reservation until it runs."""


@dataclass
class Figures:
    tasksAdmitted: int = 0
    tasksProbed: int = 0
    preempted: int = 0
    waiting: int = 0
    demandTasks: int = 0
    demandBytes: int = 0


class AdmissionPlugin(SchedulerPlugin):
    """Profiles per prefix, and the reservation of every new task."""

    name = NAME

    def __init__(self, scheduler: Any, *, settings: Settings, probe: bool, owner: str) -> None:
        self.scheduler = scheduler
        self.settings = settings
        self.probe = probe
        self.owner = owner
        self.profiles = Profiles()
        self.figures = Figures()
        self.pending: dict[str, set[Hashable]] = {}
        self.pending_count = 0
        self.preempted: dict[str, int] = {}
        self.waiting: dict[str, int] = {}

    # -- reservations -------------------------------------------------------------------------

    def capacity(self) -> float | None:
        """The smallest capacity among the workers that run the worker plugin (None: none does)."""
        supplied = self.scheduler.resources.get(RESOURCE) or {}
        return min(supplied.values()) if supplied else None

    def update_graph(
        self, scheduler: Any, *, keys: Any = (), tasks: Any = (), annotations: Any = None, **kwargs: Any
    ) -> None:
        opted_out = (annotations or {}).get(worker_admission.OPT_OUT) or {}
        probe = self.capacity() if self.probe else None
        reservations: dict[str, tuple[int | None, float | None]] = {}
        for key in tasks:
            ts = scheduler.tasks.get(key)
            if ts is None or ts.run_spec is None or ts.state != "released" or opted_out.get(key) is False:
                continue
            if ts.resource_restrictions or ts.worker_restrictions or ts.host_restrictions:
                continue
            prefix = ts.prefix.name
            found = reservations.get(prefix)
            if found is None:
                # Once per prefix and graph: a graph has many tasks of few prefixes.
                peak = self.profiles.peak(prefix)
                found = reservations[prefix] = (peak, requirement(peak, small=self.settings.small, probe=probe))
            peak, wanted = found
            if wanted is None:
                continue
            ts.resource_restrictions = {RESOURCE: wanted}
            if peak is None:
                self.figures.tasksProbed += 1
                if self.pending_count < MAX_PENDING:
                    self.pending.setdefault(prefix, set()).add(key)
                    self.pending_count += 1
            else:
                self.figures.tasksAdmitted += 1

    def transition(self, key: Hashable, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        """A task that goes back to waiting (preempted and rescheduled, or its worker left) takes
        its prefix's reservation, which it may not have had when it was submitted."""
        if finish != "waiting":
            return
        ts = self.scheduler.tasks.get(key)
        if ts is None or ts.resource_restrictions or ts.worker_restrictions or ts.host_restrictions:
            return
        peak = self.profiles.peak(ts.prefix.name)
        wanted = requirement(peak, small=self.settings.small, probe=None)
        if wanted is not None and (ts.annotations or {}).get(worker_admission.OPT_OUT) is not False:
            ts.resource_restrictions = {RESOURCE: wanted}

    def retune(self, prefix: str) -> None:
        """The tasks of ``prefix`` that still wait in the scheduler take its new profile."""
        keys = self.pending.pop(prefix, set())
        self.pending_count -= len(keys)
        wanted = requirement(self.profiles.peak(prefix), small=self.settings.small, probe=None)
        unrunnable = []
        for key in keys:
            ts = self.scheduler.tasks.get(key)
            if ts is None or ts.state not in WAITING or set(ts.resource_restrictions or {}) != {RESOURCE}:
                continue
            ts.resource_restrictions = {RESOURCE: wanted} if wanted is not None else None
            if ts.state == "no-worker":
                unrunnable.append(ts)
        _send_on(self.scheduler, unrunnable)

    # -- the workers' reports -----------------------------------------------------------------

    def log_event(self, topic: str, msg: Any) -> None:
        if topic != worker_admission.TOPIC or not isinstance(msg, dict):
            return
        worker = msg.get("worker")
        if not isinstance(worker, str) or worker not in self.scheduler.workers:
            return
        peaks = msg.get("peaks")
        changed: set[str] = set()
        for item in peaks[: worker_admission.MAX_REPORTED] if isinstance(peaks, (list, tuple)) else ():
            if not isinstance(item, (list, tuple)) or len(item) != 2:
                continue
            prefix, peak = bounded_prefix(item[0]), bounded_peak(item[1])
            if prefix is not None and peak is not None:
                self.profiles.add(prefix, peak)
                changed.add(prefix)
        for prefix in changed:
            self.retune(prefix)
        for name, into in (("preempted", self.preempted), ("waiting", self.waiting)):
            value = bounded_peak(msg.get(name))
            if value is not None:
                into[worker] = value
        self._forget_gone()
        self._send_on_runnable()

    def _forget_gone(self) -> None:
        for table in (self.preempted, self.waiting):
            for worker in [w for w in table if w not in self.scheduler.workers]:
                del table[worker]

    def _send_on_runnable(self) -> None:
        """Tasks that found no worker for their reservation go on once one supplies it (a worker that
        joined registers the resource after it joined, and Dask looks again only when one joins)."""
        unrunnable = [
            ts
            for ts in self.scheduler.unrunnable
            if RESOURCE in (ts.resource_restrictions or {}) and self.scheduler.valid_workers(ts)
        ]
        _send_on(self.scheduler, unrunnable)

    def plain(self) -> dict[str, Any]:
        demand = [
            ts.resource_restrictions[RESOURCE]
            for ts in self.scheduler.unrunnable
            if RESOURCE in (ts.resource_restrictions or {}) and HELD not in (ts.worker_restrictions or ())
        ]  # a root that placement holds back waits for its turn, not for room
        self.figures.demandTasks = len(demand)
        self.figures.demandBytes = int(max(demand, default=0))
        self.figures.preempted = sum(self.preempted.values())
        self.figures.waiting = sum(self.waiting.values())
        return {
            **asdict(self.figures),
            "profiled": len(self.profiles.peaks),
            "top": [[p, peak, n] for p, peak, n in self.profiles.top(TOP)],
            "capacity": int(self.capacity() or 0),
            "owner": self.owner,
        }


def settings_from(plain: Any) -> tuple[Settings, bool] | None:
    """The operator's settings (a map: ``small`` bytes, ``preemptAbove`` a share or None,
    ``preemptible`` globs, ``maxRetries``, ``probe``) as the plugins take them; None when not a map.
    Values of the wrong type or out of range take their defaults."""
    if not isinstance(plain, dict):
        return None
    defaults = Settings()
    small = plain.get("small")
    above = plain.get("preemptAbove")
    globs = plain.get("preemptible")
    retries = plain.get("maxRetries")
    settings = Settings(
        small=small if isinstance(small, int) and not isinstance(small, bool) and small >= 0 else defaults.small,
        preempt_above=float(above) if isinstance(above, (int, float)) and 0.5 <= above < 0.95 else 0.0,
        preemptible=tuple(sorted({g for g in globs if bounded_prefix(g)}))[:32]
        if isinstance(globs, (list, tuple))
        else (),
        max_retries=retries if isinstance(retries, int) and 0 <= retries <= 10 else defaults.max_retries,
    )
    return settings, plain.get("probe", True) is not False


def _send_on(scheduler: Any, unrunnable: Iterable[Any]) -> None:
    tasks = sorted(unrunnable, key=lambda ts: ts.priority, reverse=True)
    if tasks:
        scheduler.transitions({ts.key: "processing" for ts in tasks}, f"memops-admission-{time.time()}")


def release(scheduler: Any) -> None:
    """Lift every reservation memops set on a task still waiting in the scheduler."""
    unrunnable = []
    for ts in scheduler.tasks.values():
        if ts.state in WAITING and set(ts.resource_restrictions or {}) == {RESOURCE}:
            ts.resource_restrictions = None
            if ts.state == "no-worker":
                unrunnable.append(ts)
    _send_on(scheduler, unrunnable)


async def configure(
    dask_scheduler: Any, *, enabled: bool, settings: Settings, probe: bool, owner: str
) -> dict[str, Any] | None:
    """Run on the scheduler (by the agent's ``admission`` operation): install, retune or remove
    admission, in the scheduler and (its plugin) in every worker. Idempotent; admission that another
    ``owner`` installed is left as it is. Returns the figures, or None once removed."""
    from distributed.protocol.pickle import dumps

    plugin = dask_scheduler.plugins.get(NAME)
    if plugin is not None and getattr(plugin, "owner", "") not in ("", owner):
        return plugin.plain() if isinstance(plugin, AdmissionPlugin) else {"owner": getattr(plugin, "owner", "")}
    if not enabled:
        if isinstance(plugin, AdmissionPlugin):
            dask_scheduler.remove_plugin(NAME)
            release(dask_scheduler)
            if worker_admission.NAME in dask_scheduler.worker_plugins:
                await dask_scheduler.unregister_worker_plugin(None, worker_admission.NAME)
        return None
    if not isinstance(plugin, AdmissionPlugin):
        plugin = AdmissionPlugin(dask_scheduler, settings=settings, probe=probe, owner=owner)
        dask_scheduler.add_plugin(plugin, name=NAME)
    if worker_admission.NAME not in dask_scheduler.worker_plugins or plugin.settings != settings:
        await dask_scheduler.register_worker_plugin(
            None, dumps(worker_admission.AdmissionPlugin(settings)), name=worker_admission.NAME, idempotent=False
        )
    plugin.settings = settings
    plugin.probe = probe
    plugin.owner = owner
    return plugin.plain()
