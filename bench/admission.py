"""Memory-aware task admission against stock Dask, and against stock Dask told every task's true peak.

Each workload runs in four modes, each time on a fresh ``LocalCluster`` (two worker processes of
four threads and 1 GiB each, under their nannies, which kill a worker past 95% of it; no Kubernetes):

- ``stock``: Dask's defaults;
- ``oracle``: stock Dask with worker resources set by hand to the true peaks: the workers supply
  ``MEM`` = 0.8 GiB (the pause threshold's bytes) and each spike task asks for ``MEM`` = its
  allocation (ordinary tasks ask for nothing). What a user who knew every peak in advance could
  write: the lower bound on the time that admission can reach on the spiky workload;
- ``memops``: the defaults plus :mod:`memops.scheduler.admission` and its worker plugin, installed
  over the comm as the agent installs it (``small`` 128 MiB, probing on, no preemptible task), and
  waited for until both workers supply its resource, before the computation. Every prefix starts
  unprofiled: its first task on a worker runs alone (a probe);
- ``memops-run``: the same with ``unprofiled: Run``: a prefix never seen runs as stock Dask runs it
  until it has a profile (no probe round; its first wave is not admitted).

The workloads are :mod:`memops_sandbox.spiky`'s: 40 ordinary tasks whose 8 MiB results stay in
memory, then 16 spike tasks that each read one of them and sleep 1.5 s, holding a 300 MiB
allocation meanwhile (``spiky``) or none (``flat``: the same graph and sleeps, nothing to admit,
so what admission costs where it has nothing to do).

Measured per workload, mode and run (every worker has imported numpy before):

- the outcome: finished, failed (the exception's type, e.g. ``KilledWorker``), or timed out (a
  ``--timeout`` on the gather); and whether the spikes' sum is the right one;
- workers killed: workers that left the scheduler (a ``remove_worker`` hook of a scheduler
  plugin; the nanny's kill and restart of a worker is one);
- KilledWorker: tasks that went to ``erred``;
- task-seconds recomputed: for each key, the compute seconds (the ``startstops`` of its
  processing -> memory transition) of every completion after its first: results lost with a
  killed worker and computed again. Time spent by a task that was killed mid-run is not counted;
- peak MiB per worker: the largest ``ws.memory.process`` the scheduler held for each worker name
  (a restarted worker keeps its name), sampled every 0.1 s. It is what the workers' heartbeats
  reported (every 0.5 s on a cluster this small), so a spike shorter than a heartbeat, or the
  growth that got a worker killed before it reported it, may not show;
- wall time, from the first submission to the last result (the spikes gathered, the ordinary
  tasks waited for).

Goals: on ``spiky``, memops finishes with no worker killed where stock fails, in at most 1.3 times
the oracle's time; on ``flat``, memops takes at most 1.05 times stock's. With ``--repeat N`` each
mode runs N times (the modes' order turning from run to run) and the table gives medians of wall
time; the ratios are of those medians, with each run's own ratio in brackets.

    python bench/admission.py               # the figures in docs/performance.md
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import distributed
from distributed.diagnostics.plugin import SchedulerPlugin
from memops_sandbox import dask_direct, spiky

from memops.worker import admission as worker_admission

MIB = 2**20
GIB = 2**30
WORKERS = 2
THREADS = 4
MEMORY_LIMIT = "1GiB"
ORDINARY = 40
SPIKES = 16
HOLD = 300 * MIB
SECONDS = 1.5
WORKLOADS: dict[str, int] = {"spiky": HOLD, "flat": 0}
"""Each workload's allocation per spike task."""
MODES = ("stock", "oracle", "memops", "memops-run")
ORACLE_SUPPLY = 0.8 * GIB
"""The ``MEM`` each worker supplies under ``oracle``: the pause threshold's bytes."""
SETTINGS: dict[str, Any] = {"small": 128 * MIB, "preemptAbove": 0.9, "preemptible": [], "maxRetries": 3, "probe": True}
OWNER = "bench/tasks"
SAMPLE_SECONDS = 0.1
ORACLE_GOAL = 1.3  # memops / oracle, spiky
FLAT_GOAL = 1.05  # memops / stock, flat


def _warm(dask_worker: Any = None) -> bool:
    """Import what the tasks need, so that no measured task pays for it."""
    import numpy  # noqa: F401

    return True


class Recorder(SchedulerPlugin):
    """Workers that left, tasks that erred, and compute seconds of every completion after a key's first."""

    name = "bench-admission-recorder"

    def __init__(self) -> None:
        self.left = 0
        self.erred: set[Hashable] = set()
        self.completions: Counter[Hashable] = Counter()
        self.recomputed = 0.0

    def remove_worker(self, scheduler: Any, worker: str, **kwargs: Any) -> None:
        self.left += 1

    def transition(self, key: Hashable, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        if finish == "erred":
            self.erred.add(key)
        elif start == "processing" and finish == "memory":
            self.completions[key] += 1
            if self.completions[key] > 1:
                self.recomputed += sum(
                    float(s["stop"]) - float(s["start"])
                    for s in kwargs.get("startstops") or ()
                    if s.get("action") == "compute"
                )


async def sample_peaks(scheduler: Any, peaks: dict[str, int], stop: asyncio.Event) -> None:
    """The largest process memory the scheduler heard of, per worker name, every :data:`SAMPLE_SECONDS`."""
    while not stop.is_set():
        for ws in list(scheduler.workers.values()):
            name = str(ws.name)
            peaks[name] = max(peaks.get(name, 0), int(ws.memory.process))
        try:
            await asyncio.wait_for(stop.wait(), SAMPLE_SECONDS)
        except TimeoutError:
            pass


def submit_reserved(client: distributed.Client, *, hold: int) -> tuple[Sequence[Any], Sequence[Any]]:
    """:func:`spiky.submit`, each spike asking for ``MEM`` = ``hold`` (when it holds anything)."""
    base = [client.submit(spiky.ordinary, i, pure=False) for i in range(ORDINARY)]
    extra: dict[str, Any] = {"resources": {"MEM": hold}} if hold else {}
    tops = [
        client.submit(spiky.spike, i, base[i % ORDINARY], hold=hold, seconds=SECONDS, pure=False, **extra)
        for i in range(SPIKES)
    ]
    return base, tops


@dataclass
class Row:
    workload: str
    mode: str
    run: int
    outcome: str  # "finished", "failed (KilledWorker)", "timeout"
    right: bool
    killed: int
    erred: int
    recomputed: float
    peaks: dict[str, int]
    seconds: float
    figures: dict[str, Any] | None = field(default=None)

    @property
    def finished(self) -> bool:
        return self.outcome == "finished"


async def install(cluster: distributed.LocalCluster, mode: str) -> dict[str, Any] | None:
    """Admission with :data:`SETTINGS` (``memops-run``: with ``unprofiled: Run``, no probes), or its
    figures if installed already."""
    settings = {**SETTINGS, "probe": mode != "memops-run"}
    return await dask_direct.configure_admission(cluster.scheduler_address, settings=settings, owner=OWNER)


async def supplied(cluster: distributed.LocalCluster, timeout: float = 30) -> None:
    """Until every worker supplies admission's resource (its plugin is set up)."""
    deadline = time.monotonic() + timeout
    while len(cluster.scheduler.resources.get(worker_admission.RESOURCE, {})) < WORKERS:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the workers did not supply {worker_admission.RESOURCE} within {timeout} s")
        await asyncio.sleep(0.1)


async def run(workload: str, mode: str, number: int, timeout: float) -> Row:
    hold = WORKLOADS[workload]
    options: dict[str, Any] = {"resources": {"MEM": ORACLE_SUPPLY}} if mode == "oracle" else {}
    async with (
        distributed.LocalCluster(
            n_workers=WORKERS,
            threads_per_worker=THREADS,
            memory_limit=MEMORY_LIMIT,
            processes=True,
            dashboard_address=None,
            asynchronous=True,
            **options,
        ) as cluster,
        distributed.Client(cluster, asynchronous=True) as client,
    ):
        await client.wait_for_workers(WORKERS, timeout=60)
        await client.run(_warm)
        if mode.startswith("memops"):
            await install(cluster, mode)
            await supplied(cluster)
        recorder = Recorder()
        cluster.scheduler.add_plugin(recorder, name=Recorder.name)
        peaks: dict[str, int] = {}
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_peaks(cluster.scheduler, peaks, stop))
        started = time.perf_counter()
        if mode == "oracle":
            base, tops = submit_reserved(client, hold=hold)
        else:
            base, tops = spiky.submit(client, ordinary_tasks=ORDINARY, spikes=SPIKES, hold=hold, seconds=SECONDS)
        right = False
        try:
            results = await asyncio.wait_for(client.gather(tops), timeout)
            await asyncio.wait_for(distributed.wait(base), max(1.0, timeout - (time.perf_counter() - started)))
            outcome = "finished"
            right = sum(results) == spiky.expected(SPIKES, ORDINARY) and all(f.status == "finished" for f in base)
        except TimeoutError:
            outcome = f"timeout ({timeout:.0f} s)"
        except Exception as exc:  # the computation's own failure (KilledWorker, ...)
            outcome = f"failed ({type(exc).__name__})"
        seconds = time.perf_counter() - started
        stop.set()
        await sampler
        row = Row(
            workload,
            mode,
            number,
            outcome,
            right,
            recorder.left,
            len(recorder.erred),
            recorder.recomputed,
            peaks,
            seconds,
        )
        if mode.startswith("memops"):
            try:
                row.figures = await install(cluster, mode)
            except Exception as exc:
                print(f"  (admission's figures not read: {type(exc).__name__}: {exc})", flush=True)
        await client.cancel([*base, *tops])
    return row


def peaks_text(peaks: dict[str, int]) -> str:
    return " / ".join(f"{peaks[name] / MIB:.0f}" for name in sorted(peaks)) or "-"


def figures_text(figures: dict[str, Any] | None) -> str:
    if not figures:
        return ""
    top = ", ".join(f"{e['prefix']} {e['peakBytes'] / MIB:.0f} MiB" for e in figures.get("top", []))
    return f"; admission: {figures.get('tasksProbed')} probed, {figures.get('tasksAdmitted')} admitted, profiles {top}"


def of(rows: Sequence[Row], workload: str, mode: str) -> list[Row]:
    return [r for r in rows if r.workload == workload and r.mode == mode]


def wall(rows: Sequence[Row]) -> float:
    """The median wall time of the runs that finished right, or of all if none did."""
    good = [r.seconds for r in rows if r.finished and r.right]
    return statistics.median(good or [r.seconds for r in rows])


def ratio(rows: Sequence[Row], workload: str, mode: str, anchor: str) -> tuple[float, list[float]]:
    """``mode``'s median wall time over ``anchor``'s, and each run's own ratio."""
    ours, theirs = of(rows, workload, mode), of(rows, workload, anchor)
    runs = sorted({r.run for r in ours} & {r.run for r in theirs})
    each = [next(r.seconds for r in ours if r.run == n) / next(r.seconds for r in theirs if r.run == n) for n in runs]
    return wall(ours) / wall(theirs), each


def outcomes(mine: Sequence[Row]) -> str:
    if len(mine) == 1:
        return mine[0].outcome
    return ", ".join(f"{n} {what}" for what, n in Counter(r.outcome for r in mine).items())


def table(rows: Sequence[Row]) -> list[str]:
    lines = [
        "| workload | mode | outcome | right | workers killed | KilledWorker | task-s recomputed | peak MiB per worker"
        " | wall s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for workload in WORKLOADS:
        for mode in MODES:
            mine = of(rows, workload, mode)
            right = sum(r.right for r in mine)
            peaks = {k: max(r.peaks.get(k, 0) for r in mine) for k in set().union(*(r.peaks for r in mine))}
            lines.append(
                f"| {workload} | {mode} | {outcomes(mine)} | {'yes' if right == len(mine) else f'{right}/{len(mine)}'}"
                f" | {max(r.killed for r in mine)} | {max(r.erred for r in mine)}"
                f" | {max(r.recomputed for r in mine):.1f}"
                f" | {peaks_text(peaks)}"
                f" | {wall(mine):.2f} |"
            )
    return lines


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def goals(rows: Sequence[Row]) -> list[str]:
    lines = []
    for workload, mode, anchor, goal in (
        ("spiky", "memops", "oracle", ORACLE_GOAL),
        ("flat", "memops", "stock", FLAT_GOAL),
        ("flat", "memops-run", "stock", FLAT_GOAL),
    ):
        value, each = ratio(rows, workload, mode, anchor)
        runs = f" [{', '.join(f'{v:.2f}' for v in each)}]" if len(each) > 1 else ""
        failed = [m for m in (mode, anchor) if not all(r.finished and r.right for r in of(rows, workload, m))]
        caveat = f" ({' and '.join(failed)} did not finish right in every run)" if failed else ""
        lines.append(
            f"- {workload}: {mode} wall / {anchor} wall = {value:.2f}{runs} (goal <= {goal}: {verdict(value <= goal)})"
            + caveat
        )
    memops, stock = of(rows, "spiky", "memops"), of(rows, "spiky", "stock")
    clean = sum(r.finished and r.right and r.killed == 0 for r in memops)
    stock_failed = sum(not r.finished for r in stock)
    lines.append(
        f"- spiky: memops finished right with 0 workers killed in {clean} of {len(memops)} runs; stock failed in"
        f" {stock_failed} of {len(stock)} ({verdict(clean == len(memops) and stock_failed == len(stock))})"
    )
    return lines


async def amain(repeat: int, timeout: float) -> list[Row]:
    rows = []
    for number in range(repeat):
        # The modes' order turns from run to run, so that none always runs first.
        modes = list(MODES)[number % len(MODES) :] + list(MODES)[: number % len(MODES)]
        for workload in WORKLOADS:
            for mode in modes:
                row = await run(workload, mode, number, timeout)
                rows.append(row)
                print(
                    f"run {number} {workload} {mode}: {row.outcome}, right {row.right}, {row.seconds:.2f} s,"
                    f" {row.killed} workers killed, {row.erred} erred, {row.recomputed:.1f} task-s recomputed,"
                    f" peak MiB {peaks_text(row.peaks)}{figures_text(row.figures)}",
                    flush=True,
                )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1, help="runs of every workload and mode (default: 1)")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds allowed to each gather (default: 180)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    rows = asyncio.run(amain(args.repeat, args.timeout))
    runs = f"median wall time of {args.repeat} runs, the worst of the other columns" if args.repeat > 1 else "one run"
    print(
        f"\n{WORKERS} workers x {THREADS} threads x {MEMORY_LIMIT} (LocalCluster, nannies), a fresh cluster per"
        f" workload, mode and run; {ORDINARY} ordinary tasks of 8 MiB, then {SPIKES} spikes of {SECONDS} s holding"
        f" {HOLD // MIB} MiB (spiky) or nothing (flat);"
        f" {runs}."
        f" Peak: the scheduler's heartbeat view of each worker's process memory, sampled every {SAMPLE_SECONDS} s.\n"
    )
    print("\n".join(table(rows)))
    print("\nGoals:\n")
    print("\n".join(goals(rows)))
    print(f"\n({time.perf_counter() - started:.0f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
