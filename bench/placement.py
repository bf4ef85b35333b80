"""Graph-aware placement against stock Dask: bytes moved between workers, peak memory and time.

Each workload runs in three modes, each time on a fresh ``LocalCluster`` (four worker processes
of one thread, 2 GiB each, no Kubernetes):

- ``stock`` (anchor): Dask's defaults, root-task queuing (``worker-saturation: 1.1``);
- ``stock-inf``: ``worker-saturation: inf``, Dask's co-assignment of root tasks, no queuing;
- ``memops``: the defaults plus :mod:`memops.scheduler.placement`, installed on the scheduler with
  ``placement.configure(dask_scheduler, True)`` before the computation, as the agent installs it.

The full pass does this three times (the modes' order turning from run to run) and reports
medians; ``--small`` once, on about a tenth of the data. The workloads (full sizes):

- ``sum-one-axis``: the AutoRestrictor seed's sum over one axis, ``da.ones((rows, 160), chunks=(rows,
  1)).sum(axis=1).sum()``, 10 MB chunks (1 MiB with ``--small``); its chunks are broadcast views,
  so what moves is the partial sums, a chunk's size each;
- ``anomaly``: an array minus its mean over a grouping, then a reduction (the shape of
  dask/dask#10384): 300 MiB of random numbers in 64 chunks of time steps, grouped by time step
  modulo 12 (``x.reshape((t // 12, 12, 200))``), ``(x - x.mean(axis=0)).std()``: every chunk is
  held until the mean is known;
- ``tree-fan-in``: a tree reduction whose fan-in (16) is wider than a worker's threads
  (dask/distributed#7555): ``da.random.random(...).sum(axis=0, split_every=16)`` over 256 chunks of
  2 MB (each chunk's sum is fused with its generation: little is ever held);
- ``shuffle``: a one-stage task shuffle of 32 pandas partitions on an ``id`` column (what
  ``df.shuffle("id", shuffle_method="tasks")`` builds: split each input partition by hash, take
  each piece, concatenate the pieces of each output), then the rows and the sum of a column of
  the outputs; about 300 MB. An all-to-all, where placement must stand aside ("does not
  partition"). Built by hand because ``dask.dataframe`` needs pyarrow, no dependency of this project.
- ``persisted-input``: ``(x * 2).sum()`` of an array persisted just before (250 MiB in 64 chunks,
  persisted in the same mode, not measured): the graph's inputs are in memory already, where
  Dask runs each task beside its input.

Measured per workload, mode and run, around ``client.compute(...).result()`` alone (every worker
has imported numpy, pandas and dask.array before):

- bytes moved: the sum over workers of their ``transfer_incoming_log`` totals, after minus
  before (the log's length raised so that nothing falls out of it);
- peak memory: the largest sum over the four worker processes of their RSS, sampled every
  0.1 s by a thread of this process with psutil (what each worker's monitor reads);
- wall time of the compute, from the submission of the graph to the result;
- under memops, the plugin's figures, read back from the same ``configure`` call: graphs placed
  and left (by reason), and the time the plugin held the scheduler's event loop.

Each result is checked against stock's in the same run (``np.allclose``), and the sum's against
its known value; the ratios are to ``stock`` in the same run. Then placement's own cost:
``placement.group`` on synthetic graphs of 100,000 tasks in this process (median of several
calls), and the plugin's whole ``update_graph`` hook on a real scheduler, for graphs of 10,000
tasks (the default ``maxTasks``) cancelled once placed (with the time spent in a full garbage
collection of the scheduler's process within the longest hold, which a pass that allocates may
trigger). Goals: under 200 ms per 100,000 tasks, no hold of the event loop over 50 ms.

With ``--real-nodes``, the workloads run on the sandbox's real Nodes instead: one scheduler pod and
four worker pods of one thread, with a 2 GiB container limit each (the Dask Helm chart's
Deployment, spread over both Nodes, so that transfers cross the CNI's network), the same workers
for every row, their processes restarted by their nannies before each (``client.restart``); the
mode is set on the running scheduler (its ``WORKER_SATURATION``, and placement installed or
removed, as the agent does); peak memory is the largest sum of the worker containers' memory
cgroups (their processes' anonymous pages, the kernel's count), sampled every 0.1 s.

    python bench/placement.py                 # the full pass: about 4.5 minutes on 2 cores
    python bench/placement.py --small         # the quick pass: under 90 s
    python bench/placement.py --real-nodes    # one run on real Nodes: about 10 minutes
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import gc
import operator
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import benchkit
import cloudpickle
import dask
import dask.array as da
import distributed
import numpy as np
import pandas as pd
import psutil
from dask.delayed import Delayed
from memops_sandbox import nodes as real_nodes

from memops.scheduler import placement

MIB = 2**20
WORKERS = 4
MODES: dict[str, float | str] = {"stock": 1.1, "stock-inf": "inf", "memops": 1.1}
"""Each mode's ``distributed.scheduler.worker-saturation``; memops adds placement to the default."""
SAMPLE_SECONDS = 0.1
NODE_WORKER_MEMORY = "2GiB"
LOG_LENGTH = 100_000
GROUPING_GOAL_MS = 200.0  # per 100,000 tasks
HOLD_GOAL_MS = 50.0


# Run in the workers and on the scheduler.


def _warm(dask_worker: Any = None) -> int:
    """Import what the workloads' tasks need, so that no compute pays for it."""
    import dask.array  # noqa: F401
    import numpy  # noqa: F401
    import pandas  # noqa: F401

    return os.getpid()


def _fetched(dask_worker: Any = None) -> int:
    """Bytes this worker fetched from others since it started."""
    return sum(int(entry["total"]) for entry in dask_worker.transfer_incoming_log)


def _install(dask_scheduler: Any = None) -> dict[str, Any] | None:
    """Install placement (idempotent): returns its figures."""
    return placement.configure(dask_scheduler, True)


def _remove(dask_scheduler: Any = None) -> None:
    placement.configure(dask_scheduler, False)


def _saturation(value: float, dask_scheduler: Any = None) -> None:
    """The mode's ``worker-saturation`` on a running scheduler, between computations (what its
    ``__init__`` sets from the configuration)."""
    dask_scheduler.WORKER_SATURATION = float(value)


def _long_logs(dask_worker: Any = None) -> None:
    """Every transfer stays in this worker's log (1,000 entries by default)."""
    dask_worker.transfer_incoming_log = collections.deque(dask_worker.transfer_incoming_log, maxlen=LOG_LENGTH)


# The workloads.


def sum_one_axis(small: bool) -> tuple[Any, float]:
    rows = 131_072 if small else 1_250_000  # 1 MiB or 10 MB a chunk
    x = da.ones((rows, 160), chunks=(rows, 1))
    return x.sum(axis=1).sum(), float(rows * 160)


def anomaly(small: bool) -> tuple[Any, float | None]:
    chunk = 312 if small else 3_072  # a multiple of 12: each chunk holds whole groups
    steps = 64 * chunk  # 64 chunks, 30 or 300 MiB
    x = da.random.RandomState(7).random((steps, 200), chunks=(chunk, 200))
    grouped = x.reshape((steps // 12, 12, 200))  # time step modulo 12 on the second axis
    return (grouped - grouped.mean(axis=0)).std(), None


def tree_fan_in(small: bool) -> tuple[Any, float | None]:
    chunk = 32 if small else 256  # 256 chunks of 256 KB or 2 MB
    x = da.random.RandomState(8).random((256 * chunk, 1000), chunks=(chunk, 1000))
    return x.sum(axis=0, split_every=16), None


PARTITIONS = 32


def _partition(i: int, rows: int) -> pd.DataFrame:
    rng = np.random.default_rng(1_000 + i)
    return pd.DataFrame(
        {"id": rng.integers(0, 100_000, rows), "x": rng.random(rows), "y": rng.random(rows)},
        index=pd.RangeIndex(i * rows, (i + 1) * rows),
    )


def _split(df: pd.DataFrame, parts: int) -> dict[int, pd.DataFrame]:
    """As dask's ``shuffle_group``: the rows of each output partition, by a hash of the column."""
    target = pd.util.hash_pandas_object(df["id"], index=False).to_numpy() % parts
    return {j: df[target == j] for j in range(parts)}


def _join(*pieces: pd.DataFrame) -> pd.DataFrame:
    return pd.concat(pieces)


def _figures(df: pd.DataFrame) -> np.ndarray:
    return np.array([len(df), df["x"].sum()])


def _total(*figures: np.ndarray) -> np.ndarray:
    return np.asarray(np.sum(figures, axis=0))


def shuffle(small: bool) -> tuple[Any, float | None]:
    rows = 40_000 if small else 400_000  # 24 bytes a row: 30 or 300 MiB
    name = f"shuffle-{rows}"
    graph: dict[Any, Any] = {}
    for i in range(PARTITIONS):
        graph[(f"{name}-input", i)] = (_partition, i, rows)
        graph[(f"{name}-group", i)] = (_split, (f"{name}-input", i), PARTITIONS)
        for j in range(PARTITIONS):
            graph[(f"{name}-split", i, j)] = (operator.getitem, (f"{name}-group", i), j)
    for j in range(PARTITIONS):
        graph[(f"{name}-join", j)] = (_join, *[(f"{name}-split", i, j) for i in range(PARTITIONS)])
        graph[(f"{name}-figures", j)] = (_figures, (f"{name}-join", j))
    graph[(f"{name}-total", 0)] = (_total, *[(f"{name}-figures", j) for j in range(PARTITIONS)])
    return Delayed((f"{name}-total", 0), graph), None


def persisted_input(small: bool) -> tuple[Any, float | None]:
    """Persists its input on the cluster of the current client first (not measured)."""
    chunk = 50 if small else 512  # 64 chunks of 400 KB or 4 MB
    x = da.random.RandomState(9).random((64 * chunk, 1000), chunks=(chunk, 1000)).persist()
    distributed.wait(x)
    return (x * 2).sum(), None


WORKLOADS: dict[str, Callable[[bool], tuple[Any, float | None]]] = {
    "sum-one-axis": sum_one_axis,
    "anomaly": anomaly,
    "tree-fan-in": tree_fan_in,
    "shuffle": shuffle,
    "persisted-input": persisted_input,
}
"""Each builds its collection, and the result it must have (or None: the stock mode's is the reference)."""


# Measuring.


class PeakRss:
    """The largest sum of the RSS of some processes, sampled from a thread."""

    def __init__(self, pids: Sequence[int], interval: float = SAMPLE_SECONDS) -> None:
        self.processes = [psutil.Process(pid) for pid in pids]
        self.interval = interval
        self.idle = self.sample()
        self.peak = self.idle
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> int:
        return sum(p.memory_info().rss for p in self.processes)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self.sample())

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.sample())


class PeakCgroups(PeakRss):
    """The largest sum of some memory cgroups' anonymous pages (containers on real Nodes)."""

    def __init__(self, cgroups: Sequence[Path], interval: float = SAMPLE_SECONDS) -> None:
        self.cgroups = cgroups
        super().__init__((), interval)

    def sample(self) -> int:
        return sum(real_nodes.memory_stat(cgroup)["anon"] for cgroup in self.cgroups)


@dataclass(frozen=True)
class Nodes:
    """The workers on real Nodes: a client of their scheduler, and their containers' cgroups."""

    client: distributed.Client
    cgroups: list[Path]


@contextlib.contextmanager
def real_node_workers() -> Iterator[Nodes]:
    cloudpickle.register_pickle_by_value(placement)  # the scheduler's image has no memops
    with (
        benchkit.running_sandbox(WORKERS, "--worker-memory", NODE_WORKER_MEMORY, "--no-operator") as box,
        distributed.Client(box.address, timeout=60) as client,
    ):
        client.wait_for_workers(WORKERS, timeout=300)
        pods = benchkit.kubectl(
            box.env,
            "get",
            "pods",
            "-l",
            "app=dask-worker",
            "-o",
            "jsonpath={.items[*].status.containerStatuses[0].containerID}",
        )
        cgroups = [real_nodes.memory_cgroup(real_nodes.container_pid(c)) for c in pods.split()]
        yield Nodes(client, cgroups)


@dataclass
class Row:
    workload: str
    mode: str
    moved: int
    idle: int
    peak: int
    seconds: float
    result: Any
    expected: Any = None
    figures: dict[str, Any] | None = None
    run: int = 0
    agrees: bool = True


def cluster(saturation: float | str, logs: bool = True) -> distributed.LocalCluster:
    config: dict[str, Any] = {"distributed.scheduler.worker-saturation": saturation}
    if logs:
        # Every transfer stays in the workers' logs (1,000 entries by default).
        config["distributed.admin.low-level-log-length"] = LOG_LENGTH
    with dask.config.set(config):
        return distributed.LocalCluster(
            n_workers=WORKERS,
            threads_per_worker=1,
            processes=True,
            dashboard_address=None,
            memory_limit="2GiB",
        )


def run(workload: str, mode: str, small: bool, number: int = 0, nodes: Nodes | None = None) -> Row:
    with contextlib.ExitStack() as stack:
        if nodes is None:
            client = stack.enter_context(distributed.Client(stack.enter_context(cluster(MODES[mode]))))
            memory = PeakRss(list(client.run(_warm).values()))
        else:
            client = nodes.client
            client.restart()  # fresh worker processes: nothing held over from the last row
            client.run(_warm)
            client.run(_long_logs)
            client.run_on_scheduler(_saturation, float(MODES[mode]))
            memory = PeakCgroups(nodes.cgroups)
        client.run_on_scheduler(_install if mode == "memops" else _remove)
        collection, expected = WORKLOADS[workload](small)
        before = sum(client.run(_fetched).values())
        with memory:
            started = time.perf_counter()
            result = client.compute(collection).result()
            seconds = time.perf_counter() - started
        moved = sum(client.run(_fetched).values()) - before
        figures = client.run_on_scheduler(_install) if mode == "memops" else None
    return Row(workload, mode, moved, memory.idle, memory.peak, seconds, result, expected, figures, number)


# The grouping's own cost.


def chains(units: int, prefix: str = "") -> tuple[list[Any], dict[Any, list[Any]]]:
    """Independent chains root -> a -> b, and a reduction of every four chains' ``b``: 13 tasks a
    unit, in ``dask.order``'s depth-first order."""
    order: list[Any] = []
    deps: dict[Any, list[Any]] = {}
    for u in range(units):
        for c in range(4 * u, 4 * u + 4):
            root, a, b = (f"{prefix}root", c), (f"{prefix}a", c), (f"{prefix}b", c)
            deps[root], deps[a], deps[b] = [], [root], [a]
            order += [root, a, b]
        deps[(f"{prefix}reduce", u)] = [(f"{prefix}b", c) for c in range(4 * u, 4 * u + 4)]
        order.append((f"{prefix}reduce", u))
    return order, deps


def tree(leaves: int, fan_in: int = 16) -> tuple[list[Any], dict[Any, list[Any]]]:
    """A tree reduction of ``leaves`` roots, ``fan_in`` at a time, level by level."""
    level: list[Any] = [("leaf", i) for i in range(leaves)]
    order = list(level)
    deps: dict[Any, list[Any]] = {key: [] for key in level}
    depth = 0
    while len(level) > 1:
        depth += 1
        parents = []
        for start in range(0, len(level), fan_in):
            key = ("combine", depth, start)
            deps[key] = level[start : start + fan_in]
            parents.append(key)
        order += parents
        level = parents
    return order, deps


class Task:
    """A task as :func:`placement.group` sees a scheduler's task state: its dependencies, the same objects."""

    __slots__ = ("dependencies", "key")

    def __init__(self, key: Any) -> None:
        self.key = key
        self.dependencies: list[Task] = []


DEPENDENCIES = operator.attrgetter("dependencies")


def grouping_cost(runs: int) -> list[str]:
    lines = []
    for label, (order, deps) in (
        ("chains root->a->b, a reduction every 4 chains", chains(7_692)),
        ("tree reduction, fan-in 16", tree(93_750)),
    ):
        # As the scheduler groups its task states: objects told apart by identity.
        tasks = {key: Task(key) for key in order}
        for key in order:
            tasks[key].dependencies = [tasks[d] for d in deps[key]]
        grouping = placement.group(list(tasks.values()), DEPENDENCIES, WORKERS, identity=id)
        ms = benchkit.median_ms(
            functools.partial(placement.group, list(tasks.values()), DEPENDENCIES, WORKERS, identity=id), runs
        )
        per = ms * 100_000 / len(order)
        lines.append(
            f"- `placement.group`, {label}: {len(order):,} tasks, {len(grouping.groups):,} groups,"
            f" {len(grouping.shared):,} shared; {ms:.0f} ms (median of {runs}), {per:.0f} ms per 100,000 tasks"
            f" ({verdict(per < GROUPING_GOAL_MS)})"
        )
    return lines


def _inc(x: int) -> int:
    return x + 1


def hook_graph(units: int, prefix: str) -> tuple[dict[Any, Any], Any, int]:
    """:func:`chains` as a graph of small tasks, and a total of the reductions."""
    order, deps = chains(units, prefix)
    graph: dict[Any, Any] = {}
    for key in order:
        inputs = deps[key]
        if not inputs:
            graph[key] = (_inc, key[1])
        elif len(inputs) == 1:
            graph[key] = (_inc, inputs[0])
        else:
            graph[key] = (sum, list(inputs))
    total = (f"{prefix}total", 0)
    graph[total] = (sum, [key for key in order if key[0] == f"{prefix}reduce"])
    expected = sum(c + 3 for c in range(4 * units))
    return graph, total, expected


def _clock(dask_scheduler: Any = None) -> None:
    """Time each call of the plugin's ``update_graph``, and the garbage collections of the
    scheduler's process within it (one of the oldest generation can take hundreds of ms, and
    falls inside whatever code allocated last)."""
    plugin = dask_scheduler.plugins[placement.NAME]
    collections: list[tuple[float, int]] = []
    started: list[float] = []

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[:] = [time.perf_counter()]
        elif started:
            collections.append((time.perf_counter() - started.pop(), info["generation"]))

    hook = plugin.update_graph

    def timed(*args: Any, **kwargs: Any) -> None:
        collections.clear()
        begun = time.perf_counter()
        try:
            hook(*args, **kwargs)
        finally:
            took = time.perf_counter() - begun
            plugin.bench_holds.append((took, sum(s for s, g in collections if g == 2)))

    # For scale: the synchronous part of the scheduler's own update_graph (task states, plugins,
    # first transitions), which holds the event loop with the plugin's hook inside it.
    create = dask_scheduler._create_taskstate_from_graph

    def created(*args: Any, **kwargs: Any) -> Any:
        begun = time.perf_counter()
        try:
            return create(*args, **kwargs)
        finally:
            plugin.bench_updates.append(time.perf_counter() - begun)

    gc.callbacks.append(on_gc)
    plugin.bench_gc = on_gc
    plugin.bench_holds = []
    plugin.bench_updates = []
    plugin.update_graph = timed
    dask_scheduler._create_taskstate_from_graph = created


def _holds(dask_scheduler: Any = None) -> list[tuple[float, float]]:
    return list(dask_scheduler.plugins[placement.NAME].bench_holds)


def _updates(dask_scheduler: Any = None) -> list[float]:
    return list(dask_scheduler.plugins[placement.NAME].bench_updates)


def _tasks(dask_scheduler: Any = None) -> int:
    return len(dask_scheduler.tasks)


def _unclock(dask_scheduler: Any = None) -> None:
    gc.callbacks.remove(dask_scheduler.plugins[placement.NAME].bench_gc)
    del dask_scheduler._create_taskstate_from_graph


def hook_cost(runs: int, units: int = 769) -> list[str]:
    """The plugin's ``update_graph`` on a real scheduler, for graphs of about 10,000 tasks (the
    default ``maxTasks``): each graph is cancelled once placed (running 10,000 tiny tasks takes
    several seconds here, and adds nothing to what is measured)."""
    with cluster(MODES["memops"], logs=False) as local, distributed.Client(local) as client:
        client.run(_warm)
        client.run_on_scheduler(_install)
        client.run_on_scheduler(_clock)
        tasks = 0
        for r in range(runs):
            graph, total, _ = hook_graph(units, f"hook{r}-")
            tasks = len(graph)
            future = client.compute(Delayed(total, graph))
            deadline = time.monotonic() + 60
            while len(client.run_on_scheduler(_holds)) <= r and time.monotonic() < deadline:
                time.sleep(0.05)
            future.cancel()
            del future
            while client.run_on_scheduler(_tasks):
                time.sleep(0.1)
        holds = client.run_on_scheduler(_holds)
        updates = client.run_on_scheduler(_updates)
        figures = client.run_on_scheduler(_install)
        client.run_on_scheduler(_unclock)
    assert figures is not None and figures["graphs_placed"] == runs, figures
    ms = statistics.median(took for took, _ in holds) * 1000
    per = ms * 100_000 / tasks
    longest = figures["longest"] * 1000
    _, collected = max(holds)
    each = ", ".join(f"{t * 1000:.0f}" for t, _ in holds)
    return [
        f"- the plugin's `update_graph` on a real scheduler (4 workers), graphs of {tasks:,} tasks"
        f" ({figures['groups'] // runs:,} groups each): {ms:.1f} ms (median of {runs}),"
        f" {per:.0f} ms per 100,000 tasks ({verdict(per < GROUPING_GOAL_MS)})",
        f"- its longest hold of the event loop: {longest:.1f} ms ({verdict(longest <= HOLD_GOAL_MS)}), of which"
        f" {collected * 1000:.0f} ms in a full garbage collection of the scheduler's process; each hold: {each} ms",
        f"- for scale, the synchronous part of the scheduler's own update_graph for the same graphs (task states,"
        f" plugins, first transitions; the hook is inside it): {statistics.median(updates) * 1000:.0f} ms (median)",
    ]


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


# Reporting.


def of(rows: list[Row], workload: str, mode: str) -> list[Row]:
    return [r for r in rows if r.workload == workload and r.mode == mode]


def median(rows: list[Row], attribute: str) -> float:
    return float(statistics.median(getattr(r, attribute) for r in rows))


def ratios(rows: list[Row], workload: str, mode: str, attribute: str) -> str:
    """The median over runs of each run's ratio to stock's, and their range with several runs."""
    if mode == "stock":
        return "1.00"
    anchors = {r.run: getattr(r, attribute) for r in of(rows, workload, "stock")}
    least = MIB if attribute == "moved" else 0  # no ratio to (almost) nothing
    values = [getattr(r, attribute) / anchors[r.run] for r in of(rows, workload, mode) if anchors[r.run] > least]
    if not values:
        return "-"
    spread = f" ({min(values):.2f}-{max(values):.2f})" if len(values) > 1 else ""
    return f"{statistics.median(values):.2f}{spread}"


def placement_ms(rows: list[Row]) -> str:
    figures = [r.figures for r in rows if r.figures is not None]
    if not figures:
        return "-"
    ms = statistics.median(f["seconds"] for f in figures) * 1000
    placed = sum(f["graphs_placed"] for f in figures)
    reasons = sorted({reason for f in figures for reason in f["graphs_left"]})
    what = f"placed, {figures[0]['groups']} groups" if placed else f"left: {', '.join(reasons)}"
    if placed and reasons:
        what = f"placed {placed} of {len(figures)}; left: {', '.join(reasons)}"
    return f"{ms:.1f} ({what})"


def table(rows: list[Row], workloads: Sequence[str]) -> list[str]:
    lines = [
        "| workload | mode | MiB moved | moved / stock | peak MiB | peak / stock | seconds | time / stock |"
        " placement ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for workload in workloads:
        for mode in MODES:
            mine = of(rows, workload, mode)
            mark = "" if all(r.agrees for r in mine) else " (WRONG RESULT)"
            lines.append(
                f"| {workload} | {mode}{mark} | {median(mine, 'moved') / MIB:.1f} |"
                f" {ratios(rows, workload, mode, 'moved')} | {median(mine, 'peak') / MIB:.0f} |"
                f" {ratios(rows, workload, mode, 'peak')} | {median(mine, 'seconds'):.2f} |"
                f" {ratios(rows, workload, mode, 'seconds')} | {placement_ms(mine)} |"
            )
    return lines


def goals(rows: list[Row], workloads: Sequence[str]) -> list[str]:
    """Whether memops met its goals, on the medians over runs."""
    lines = []
    for workload in workloads:
        stock, inf, ours = ({a: median(of(rows, workload, m), a) for a in ("moved", "peak", "seconds")} for m in MODES)
        best_time, best_peak = min(stock["seconds"], inf["seconds"]), min(stock["peak"], inf["peak"])
        checks: list[tuple[str, float, float]] = []  # what, ratio, goal
        if workload == "sum-one-axis":
            checks += [
                ("bytes moved / stock's", ours["moved"] / stock["moved"] if stock["moved"] else 0.0, 0.05),
                ("peak / stock's", ours["peak"] / stock["peak"], 1.0),
                ("time / stock's", ours["seconds"] / stock["seconds"], 0.8),
            ]
        checks += [
            ("time / the better stock mode's", ours["seconds"] / best_time, 1.1),
            ("peak / the better stock mode's", ours["peak"] / best_peak, 1.1),
        ]
        missed = sum(value > goal for _, value, goal in checks)
        lines.append(
            f"- {workload}: {'met' if not missed else f'MISSED {missed} of {len(checks)}'}: "
            + "; ".join(f"{what} {value:.3f} (<= {goal}: {verdict(value <= goal)})" for what, value, goal in checks)
        )
    return lines


def agree(rows: list[Row]) -> None:
    """Each result against the value it must have, if known, and against stock's in the same run."""
    reference = {(r.workload, r.run): r.result for r in rows if r.mode == "stock"}
    for r in rows:
        r.agrees = bool(np.allclose(r.result, reference.get((r.workload, r.run), r.result)))
        if r.expected is not None:
            r.agrees = r.agrees and bool(np.allclose(r.result, r.expected))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="about a tenth of the data, one run: the quick pass")
    parser.add_argument("--runs", type=int, help="runs of every workload and mode (default: 3, or 1 with --small)")
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--skip-cost", action="store_true", help="the workloads only, not placement's own cost")
    parser.add_argument("--real-nodes", action="store_true", help="the workloads on the sandbox's real Nodes")
    args = parser.parse_args(argv)
    runs = args.runs or (1 if args.small or args.real_nodes else 3)
    started = time.perf_counter()
    rows = []
    with real_node_workers() if args.real_nodes else contextlib.nullcontext() as nodes:
        for number in range(runs):
            for workload in args.workloads:
                # The modes' order turns from run to run, so that none always runs first.
                modes = list(MODES)[number % len(MODES) :] + list(MODES)[: number % len(MODES)]
                for mode in modes:
                    row = run(workload, mode, args.small, number, nodes)
                    rows.append(row)
                    print(
                        f"run {number} {workload} {mode}: {row.seconds:.2f} s, {row.moved / MIB:.1f} MiB moved,"
                        f" peak {row.peak / MIB:.0f} MiB",
                        flush=True,
                    )
    agree(rows)
    idle = [r.idle / MIB for r in rows]
    where = (
        f"four worker pods of one thread on two real Nodes, {NODE_WORKER_MEMORY} container limit each, their processes"
        " restarted before each workload and mode"
        if args.real_nodes
        else "four workers of one thread, 2 GiB each, a fresh LocalCluster per workload, mode and run"
    )
    memory = "the worker containers' memory cgroups (anonymous pages)" if args.real_nodes else "the workers' RSS"
    print(
        f"\n{'--small: ' if args.small else ''}{where}; {f'median of {runs} runs' if runs > 1 else 'one run'}, ratios"
        " to stock within each run"
        f"{' (range in brackets)' if runs > 1 else ''}; no ratio where stock moved less than 1 MiB. Peak: the largest"
        f" sum of {memory}, sampled every {SAMPLE_SECONDS} s, from {min(idle):.0f}-{max(idle):.0f} MiB before"
        " the compute (a persisted input included). Placement ms: the time the plugin held the scheduler's event"
        " loop, and what it did with the graph.\n"
    )
    print("\n".join(table(rows, args.workloads)))
    print("\nGoals, memops against stock (sum-one-axis) and against the better stock mode (every workload):\n")
    print("\n".join(goals(rows, args.workloads)))
    if not args.skip_cost:
        print(
            f"\nPlacement's own cost; goal: under {GROUPING_GOAL_MS:.0f} ms per 100,000 tasks, and no hold over"
            f" {HOLD_GOAL_MS:.0f} ms:\n",
            flush=True,
        )
        print("\n".join([*grouping_cost(3 if args.small else 5), *hook_cost(3 if args.small else 5)]), flush=True)
    print(f"\n({time.perf_counter() - started:.0f} s in all)")
    return 0 if all(r.agrees for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
