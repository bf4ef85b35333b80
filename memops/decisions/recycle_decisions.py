"""Pure decisions of recycling: which workers leak, which are too old, which to replace now.

:mod:`memops.controllers.policy` samples every worker's memory from the scheduler on each
pass, keeps the samples in a :class:`Window`, and asks :func:`detect` and :func:`plan_recycle`
what to do. No I/O.

What "unmanaged" means here is what the scheduler means (``distributed.scheduler.WorkerState.memory``):
the worker process' memory minus the Dask data it holds in memory. The scheduler's
``unmanaged_old`` is the minimum of that over the last ``distributed.worker.memory.recent-to-old-time``
(30 s): memory that has stayed. A rule that needs unmanaged memory above a threshold *for ten
minutes* asks that the minimum over ten minutes be above it, which implies ``unmanaged_old`` was
above it throughout, so :func:`detect` works on the plain samples and takes minima itself.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Collection, Iterable, Mapping, Sequence

from memops import specs
from memops.decisions import snapshots

RECENT_TO_OLD_SECONDS = 30.0
"""The scheduler's default ``recent-to-old-time``: unmanaged memory older than this is "old"."""

MIN_GROWTH_SAMPLES = 5
MIN_GROWTH_FIT = 0.8
"""A rise counts as steady only when a straight line explains this much of its variance (r²)."""

MIN_COVERAGE = 0.8
"""A window whose samples span less than this share of it is too short to judge."""

MAX_AGE_STAGGER = 0.1
"""Each worker's age limit is brought forward by up to this share of ``maxAge``, by its name."""


@dataclasses.dataclass(frozen=True)
class Sample:
    time: float  # Unix seconds
    unmanaged: int  # process memory minus the Dask data held in memory
    limit: int  # the worker's memory limit


@dataclasses.dataclass(frozen=True)
class Verdict:
    pod: str
    reason: str  # UnmanagedMemory, Growth or MaxAge
    message: str
    severity: float  # larger is more urgent; MaxAge always ranks below a leak


class Window:
    """Per worker, the samples of the last ``seconds``, at least ``spacing`` apart.

    Kept by the policy's daemon between passes. It is a measurement, not intent: after an
    operator restart it starts empty, which only delays a verdict (a rule needs a full window
    of evidence), never hastens one.
    """

    def __init__(self, seconds: float, spacing: float):
        self.seconds = seconds
        self.spacing = spacing
        self.samples: dict[str, list[Sample]] = {}

    def add(self, workers: Iterable[snapshots.WorkerInfo], now: float) -> None:
        seen = set()
        for worker in workers:
            seen.add(worker.name)
            series = self.samples.setdefault(worker.name, [])
            if series and now - series[-1].time < self.spacing:
                continue
            series.append(Sample(time=now, unmanaged=worker.unmanaged_bytes, limit=worker.memory_limit))
            # Keep one sample from before the window: it stands for the window's start.
            while len(series) > 1 and series[1].time <= now - self.seconds:
                series.pop(0)
        for gone in set(self.samples) - seen:
            del self.samples[gone]  # a worker that left (or restarted) starts from nothing


def window_for(spec: specs.RecycleSpec) -> Window:
    """A window long enough for every rule of ``spec``, with about a hundred samples in it."""
    seconds = RECENT_TO_OLD_SECONDS
    if spec.unmanagedMemory is not None:
        seconds = max(seconds, specs.parse_duration(spec.unmanagedMemory.for_).total_seconds())
    if spec.growth is not None:
        seconds = max(seconds, specs.parse_duration(spec.growth.window).total_seconds())
    return Window(seconds=seconds, spacing=min(30.0, max(1.0, seconds / 100)))


def unmanaged_old(samples: Sequence[Sample], now: float) -> int:
    """The scheduler's ``unmanaged_old``: the least unmanaged memory over the last 30 s."""
    recent = [s.unmanaged for s in samples if s.time >= now - RECENT_TO_OLD_SECONDS]
    return min(recent) if recent else 0


def _covered(samples: Sequence[Sample], now: float, seconds: float, coverage: float) -> list[Sample]:
    """The samples of the last ``seconds``, led by the last one taken before the window began
    (samples come a poll apart, so the window's start falls between two of them); none unless
    they reach back ``coverage`` of the window."""
    start = now - seconds
    before = [s for s in samples if s.time <= start]
    inside = before[-1:] + [s for s in samples if s.time > start]
    if len(inside) < 2 or now - inside[0].time < coverage * seconds:
        return []
    return inside


def _percent(value: float, limit: int) -> float:
    return 100.0 * value / limit if limit else 0.0


def sustained(samples: Sequence[Sample], rule: specs.UnmanagedMemoryRule, now: float) -> Verdict | None:
    seconds = specs.parse_duration(rule.for_).total_seconds()
    inside = _covered(samples, now, seconds, coverage=1.0)
    if not inside or not inside[-1].limit:
        return None
    least = min(_percent(s.unmanaged, s.limit) for s in inside)
    threshold = specs.parse_percent(rule.above)
    if least <= threshold:
        return None
    return Verdict(
        pod="",
        reason="UnmanagedMemory",
        message=f"unmanaged memory stayed above {rule.above} of the limit for {rule.for_} (at least {least:.0f}%)",
        severity=least,
    )


def fit(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares slope (per unit of x) and r² of the points."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    syy = sum((y - mean_y) ** 2 for _, y in points)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in points)
    if sxx == 0:
        return 0.0, 0.0
    slope = sxy / sxx
    r2 = 1.0 if syy == 0 else (sxy * sxy) / (sxx * syy)
    return slope, r2


def growth(samples: Sequence[Sample], rule: specs.GrowthRule, now: float) -> Verdict | None:
    seconds = specs.parse_duration(rule.window).total_seconds()
    inside = _covered(samples, now, seconds, coverage=MIN_COVERAGE)
    if len(inside) < MIN_GROWTH_SAMPLES or not inside[-1].limit:
        return None
    points = [((s.time - inside[0].time) / 3600.0, _percent(s.unmanaged, s.limit)) for s in inside]
    slope, r2 = fit(points)
    threshold = specs.parse_percent(rule.perHour)
    if slope < threshold or r2 < MIN_GROWTH_FIT:
        return None
    return Verdict(
        pod="",
        reason="Growth",
        message=(
            f"unmanaged memory rose {slope:.1f}% of the limit per hour over {rule.window}"
            f" (r²={r2:.2f}), above {rule.perHour} per hour"
        ),
        severity=_percent(inside[-1].unmanaged, inside[-1].limit),
    )


def stagger(pod: str) -> float:
    """A fraction in [0, 1) fixed by the pod's name, so workers created together age apart."""
    return int.from_bytes(hashlib.sha256(pod.encode()).digest()[:4], "big") / 2**32


def too_old(pod: str, age_seconds: float | None, max_age: str) -> Verdict | None:
    if age_seconds is None:
        return None
    limit = specs.parse_duration(max_age).total_seconds()
    deadline = limit * (1 - MAX_AGE_STAGGER * stagger(pod))
    if age_seconds < deadline:
        return None
    return Verdict(
        pod="",
        reason="MaxAge",
        message=f"the worker is {age_seconds / 3600:.1f}h old; maxAge {max_age}, staggered to {deadline / 3600:.1f}h",
        severity=-1.0,
    )


def detect(
    pod: str, samples: Sequence[Sample], spec: specs.RecycleSpec, now: float, age_seconds: float | None
) -> Verdict | None:
    """Whether this worker should be recycled, and why; the first rule that holds wins."""
    found = None
    if spec.unmanagedMemory is not None:
        found = sustained(samples, spec.unmanagedMemory, now)
    if found is None and spec.growth is not None:
        found = growth(samples, spec.growth, now)
    if found is None and spec.maxAge is not None:
        found = too_old(pod, age_seconds, spec.maxAge)
    return dataclasses.replace(found, pod=pod) if found is not None else None


def plan_recycle(
    verdicts: Iterable[Verdict], *, recycling: int, max_unavailable: int, in_shuffle: Collection[str] = ()
) -> list[Verdict]:
    """The workers to start recycling now: the most urgent first, never more than
    ``max_unavailable`` at once counting those already under way, and never a worker in the
    middle of a P2P shuffle (it will be there on a later pass, when the shuffle is over)."""
    room = max_unavailable - recycling
    if room <= 0:
        return []
    ready = [v for v in verdicts if v.pod not in in_shuffle]
    return sorted(ready, key=lambda v: (-v.severity, v.pod))[:room]


def annotation_percent(samples: Mapping[str, Sequence[Sample]], pod: str, now: float) -> str | None:
    """What the pod's ``memops.dev/unmanaged-memory`` annotation shows: unmanaged_old over the limit."""
    series = samples.get(pod)
    if not series or not series[-1].limit:
        return None
    return f"{round(_percent(unmanaged_old(series, now), series[-1].limit))}%"


@dataclasses.dataclass(frozen=True)
class Replacement:
    extra: int  # workers to run above the desired count while replacements start
    drain: tuple[str, ...]  # marked pods whose drain may start now
    message: str
    waiting: tuple[str, ...] = ()  # marked pods whose drain waits for replacements to connect


def plan_replacement(
    *, marked: Sequence[str], requested: Collection[str], connected_unmarked: int, desired: int, surge: int
) -> Replacement:
    """How to replace the marked workers the safe way.

    Raise the count by up to ``surge`` first; drain a marked worker once enough unmarked
    workers are connected to carry the desired capacity without it (at once when ``surge`` is
    0: then capacity dips while the old worker drains, which is what the user chose). Pods in
    ``requested`` already have their RetirementRequest.
    """
    extra = min(surge, len(marked))
    waiting = [pod for pod in marked if pod not in requested]
    if not waiting:
        return Replacement(extra, (), f"draining {len(marked)} recycled workers" if marked else "")
    if surge and connected_unmarked < desired:
        return Replacement(
            extra,
            (),
            f"waiting for replacements to connect ({connected_unmarked} of {desired} workers) before draining"
            f" {', '.join(waiting)}",
            tuple(waiting),
        )
    return Replacement(extra, tuple(waiting), f"draining {', '.join(waiting)} to recycle")
