"""Cost of the pure deciding functions on synthetic scheduler states, 10 to 1,000 workers.

Anchor: the goal of 100 ms per decision at 1,000 workers and 1,000,000 keys. Each figure is
the median of several runs of the same call on the same state, measured in this process.

- ``choose_workers``: which pods a RetirementRequest with ``count`` retires (a tenth of them);
- holdings, in the scheduler: bytes and keys each worker holds, and holds alone, as
  :func:`memops.scheduler.holdings.holdings` sums them inside the scheduler, here on
  distributed's own ``WorkerState`` and ``TaskState`` objects holding the synthetic placement
  (its cost follows the replicated keys: one key in ten has two copies here);
- ``snapshots.holdings``, the fallback: the same figures summed in the operator from
  ``who_has`` of every key, for a scheduler that refuses ``run_function`` (not in "slowest");
- ``bytes_moved``: a finished drain's report for one worker, over the placement the operator
  fetches for it (the keys of that worker);
- ``desired_replicas``: one autoscaling decision (``usage_of`` the workers, then the HPA
  algorithm over a full 300 s stabilization window of recommendations and 15 s of scale events);
- recycle pass: what a policy's recycling pass decides on every worker: ``Window.add`` of this
  pass' samples to a full window (unmanagedMemory for 10m, growth over 30m: about 100 samples a
  worker), ``detect`` for every worker (samples chosen so that no rule fires and every rule is
  evaluated in full, the worst case), and ``plan_recycle``.

- replication pass: one pass of replication targets' AMM policy inside the scheduler
  (:class:`memops.scheduler.replication.Replication`: the ruled keys off target that its index
  names, then :func:`~memops.scheduler.replication.decide`), on the same ``TaskState`` objects. "All under
  target": a rule (``replicas: 2``) on the key prefix of one key in ten and a pod rule marking a
  tenth of the workers, just applied, so every ruled key needs a copy (the worst case); "at
  target": the same keys ruled, each at its target (the steady state). Its suggestions are not
  enacted here.
  Not in "slowest": it runs in the scheduler, not in the operator's decision (``bench/scale.py``
  measures it at scale).

    python bench/decision_cost.py --output bench/results/decision_cost.md   # the table in docs/performance.md
    python bench/decision_cost.py --keys 100000                            # the small pass CI runs
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import sys
import time
import types
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import benchkit
from distributed.core import Status
from distributed.scheduler import TaskGroup, TaskPrefix, TaskState, WorkerState

from memops import specs
from memops.decisions import autoscaling, recycle_decisions, retire_choice, snapshots
from memops.scheduler import holdings, replication
from memops.scheduler import rules as replication_rules

WORKER_COUNTS = (10, 30, 100, 300, 1000)
GOAL_MS = 100.0
MEMORY_LIMIT = 4 * 2**30


@dataclass
class State:
    snapshot: snapshots.SchedulerSnapshot  # every key placed: the fallback's input
    pods: list[str]
    scheduler_workers: list[WorkerState]  # distributed's own objects, as the scheduler holds them
    replicated: set[TaskState]
    drained: snapshots.SchedulerSnapshot  # the placement the operator fetches to report one worker's drain
    tasks: list[TaskState]  # every key in memory, as scheduler.tasks holds them


def synthetic(workers: int, keys: int, replicated_every: int = 10, seed: int = 0) -> State:
    rng = random.Random(seed)
    addresses = [f"tcp://10.0.{i // 250}.{i % 250}:8786" for i in range(workers)]
    scheduler_workers = [
        WorkerState(
            address=a,
            status=Status.running,
            pid=0,
            name=f"w-{i}",
            memory_limit=MEMORY_LIMIT,
            local_directory="",
            nanny=None,
            server_id=f"server-{i}",  # WorkerStates are equal when their server_id is
        )
        for i, a in enumerate(addresses)
    ]
    by_address = {ws.address: ws for ws in scheduler_workers}
    groups: dict[str, TaskGroup] = {}
    prefixes = {"x": TaskPrefix("x"), "x-ruled": TaskPrefix("x-ruled")}
    tasks: list[TaskState] = []
    replicated: set[TaskState] = set()
    who_has: dict[tuple[str, int], tuple[str, ...]] = {}
    nbytes: dict[tuple[str, int], int] = {}
    for k in range(keys):
        name = f"x-{k // 1000}"
        key = (name, k % 1000)
        # One key in ten (by default) has a second replica, as after a shuffle or a ReduceReplicas lag.
        holders = rng.sample(addresses, 2) if k % replicated_every == 0 else [rng.choice(addresses)]
        who_has[key] = tuple(holders)
        nbytes[key] = rng.randint(1_000, 10_000_000)
        prefix = prefixes["x-ruled" if k % 10 == 5 else "x"]  # one key in ten under a key rule
        group = groups.get(name + prefix.name) or groups.setdefault(name + prefix.name, TaskGroup(name, prefix))
        ts = TaskState(key, None, "memory", group, False)
        tasks.append(ts)
        ts.nbytes = nbytes[key]
        for address in holders:
            by_address[address].add_replica(ts)  # as the scheduler does: has_what, nbytes, who_has
        if len(holders) > 1:
            replicated.add(ts)
    figures = snapshots.holdings(who_has, nbytes)
    infos = tuple(
        snapshots.WorkerInfo(
            name=f"w-{i}",
            address=a,
            memory_limit=MEMORY_LIMIT,
            unique_bytes=figures.get(a, (0, 0, 0, 0))[2],
            unique_keys=figures.get(a, (0, 0, 0, 0))[3],
            process_bytes=rng.randint(MEMORY_LIMIT // 4, MEMORY_LIMIT // 2),
            unmanaged_bytes=rng.randint(MEMORY_LIMIT // 20, MEMORY_LIMIT // 10),
        )
        for i, a in enumerate(addresses)
    )
    pods = [w.name for w in infos] + [f"pending-{i}" for i in range(workers // 20)]
    first = by_address[addresses[0]]
    placed = {ts.key: who_has[ts.key] for ts in first.has_what}
    drained = snapshots.SchedulerSnapshot(infos, placed, {k: nbytes[k] for k in placed})
    snapshot = snapshots.SchedulerSnapshot(infos, who_has, nbytes)
    return State(snapshot, pods, scheduler_workers, replicated, drained, tasks)


AUTOSCALE = specs.AutoscaleSpec(minReplicas=1, maxReplicas=2000, targetMemoryUtilization=60)
RECYCLE = specs.RecycleSpec.model_validate(
    {"unmanagedMemory": {"above": "30%", "for": "10m"}, "growth": {"perHour": "5%", "window": "30m"}, "maxAge": "24h"}
)


def autoscale_inputs(workers: int, now: float) -> tuple[list[specs.Recommendation], list[specs.ScaleEvent]]:
    """A full history: a recommendation every 2 s over the 300 s scale-down window, and 15 s of events."""
    rng = random.Random(1)
    history = [
        specs.Recommendation(time=now - 2 * i, replicas=max(workers + rng.randint(-5, 5), 1)) for i in range(150)
    ]
    events = [specs.ScaleEvent(time=now - i, change=rng.choice((-1, 1))) for i in range(15)]
    return history, events


def desired(
    snapshot: snapshots.SchedulerSnapshot,
    history: list[specs.Recommendation],
    events: list[specs.ScaleEvent],
    now: float,
) -> None:
    autoscaling.desired_replicas(
        current=len(snapshot.workers),
        usage=autoscaling.usage_of(snapshot.workers),
        spec=AUTOSCALE,
        history=history,
        events=events,
        now=now,
    )


def full_window(snapshot: snapshots.SchedulerSnapshot, now: float) -> recycle_decisions.Window:
    """A window as a policy's daemon holds it after half an hour: flat, noisy unmanaged memory,
    under every threshold, so ``detect`` evaluates every rule without a verdict."""
    window = recycle_decisions.window_for(RECYCLE)
    rng = random.Random(2)
    for worker in snapshot.workers:
        window.samples[worker.name] = [
            recycle_decisions.Sample(
                time=now - window.seconds - window.spacing + i * window.spacing,
                unmanaged=int(MEMORY_LIMIT * rng.uniform(0.05, 0.1)),
                limit=MEMORY_LIMIT,
            )
            for i in range(int(window.seconds / window.spacing) + 1)
        ]
    return window


def recycle_pass(snapshot: snapshots.SchedulerSnapshot, window: recycle_decisions.Window, now: float) -> None:
    window.add(snapshot.workers, now)
    verdicts = [
        verdict
        for worker in snapshot.workers
        if (verdict := recycle_decisions.detect(worker.name, window.samples.get(worker.name, []), RECYCLE, now, 3600.0))
    ]
    recycle_decisions.plan_recycle(verdicts, recycling=0, max_unavailable=1)


COLUMNS = ("choose_workers", "holdings, in the scheduler", "bytes_moved", "desired_replicas", "recycle pass")
FALLBACK = "snapshots.holdings (fallback)"
REPLICATION = "replication pass, all under target (scheduler)"
REPLICATION_STEADY = "replication pass, at target (scheduler)"


def measure(workers: int, keys: int, replicated_every: int = 10) -> dict[str, float]:
    state = synthetic(workers, keys, replicated_every)
    snapshot, drained = state.snapshot, state.drained
    address = snapshot.workers[0].address
    now = time.time()
    history, events = autoscale_inputs(workers, now)
    windows = iter([full_window(snapshot, now) for _ in range(5)])  # one fresh window per timed run
    return {
        "choose_workers": benchkit.median_ms(
            functools.partial(retire_choice.choose_workers, state.pods, snapshot, max(workers // 10, 1)), runs=5
        ),
        "holdings, in the scheduler": benchkit.median_ms(
            functools.partial(holdings.holdings, state.scheduler_workers, state.replicated), runs=5
        ),
        "bytes_moved": benchkit.median_ms(
            functools.partial(snapshots.bytes_moved, drained.who_has, drained.who_has, drained.nbytes, address), runs=5
        ),
        "desired_replicas": benchkit.median_ms(functools.partial(desired, snapshot, history, events, now), runs=5),
        "recycle pass": benchkit.median_ms(lambda: recycle_pass(snapshot, next(windows), now + 20), runs=5),
        FALLBACK: benchkit.median_ms(functools.partial(snapshots.holdings, snapshot.who_has, snapshot.nbytes), runs=5),
        REPLICATION: statistics.median(replication_pass(state) for _ in range(3)),
        REPLICATION_STEADY: statistics.median(replication_pass(state, at_target=True) for _ in range(3)),
    }


def replication_pass(state: State, *, at_target: bool = False) -> float:
    """ms of one pass of the replication policy's deciding part, once its index has read every key
    (``bench/scale.py`` measures the passes after a change). Every ruled key is under its target
    (a rule just applied: the worst case), or, with ``at_target``, at it (the steady state: one
    copy wanted, one held)."""
    workers = state.scheduler_workers
    marked = [ws.address for ws in workers[: max(len(workers) // 10, 1)]]
    rules = replication_rules.parse(
        {"keys": [{"prefix": "x-ruled", "replicas": 1}], "default": 1}
        if at_target
        else {"keys": [{"prefix": "x-ruled", "replicas": 2}], "pods": [{"workers": marked, "replicas": 2}]}
    )
    places = {ws.address: (f"node-{i}", f"zone-{i % 3}") for i, ws in enumerate(workers)}
    policy = replication.Replication(rules, places)
    tasks = {ts.key: ts for ts in state.tasks}
    by_address = {ws.address: ws for ws in workers}
    # What the index reads of a scheduler: its tasks and workers; its replica methods (wrapped so
    # that each change is noted) do nothing here, where nothing changes.
    view = types.SimpleNamespace(
        tasks=tasks,
        workers=by_address,
        replicated_tasks=state.replicated,
        add_replica=_unchanged,
        remove_replica=_unchanged,
        remove_all_replicas=_unchanged,
    )
    policy.index.attach(view)
    while policy.index.pending:  # the first build: every key read, over as many passes as it takes
        policy.index.update()
    started = time.perf_counter()
    policy.index.update()
    items = policy.items(time.time())
    loads = [replication.Worker(ws.address, ws.nbytes, MEMORY_LIMIT * 4) for ws in workers]
    replication.decide(loads, items, max_fraction=0.3, ceiling=0.7, spent=policy.rest.spent)
    return (time.perf_counter() - started) * 1000  # one pass, not the build that found them


def _unchanged(*args: object) -> None:
    return None


def table(results: dict[int, dict[str, float]], keys: int, replicated_every: int = 10) -> str:
    columns = (*COLUMNS, FALLBACK, REPLICATION, REPLICATION_STEADY)
    lines = [
        f"Decision cost, ms (median of 5 runs) at {keys:,} keys, one in {replicated_every} with two copies;"
        f" goal under {GOAL_MS:.0f} ms at 1,000 workers.",
        "",
        "| workers | " + " | ".join(columns) + " | slowest vs goal |",
        "|" + " --- |" * (len(columns) + 2),
    ]
    for workers, row in results.items():
        cells = " | ".join(f"{row[c]:.2f}" if row[c] < 10 else f"{row[c]:.0f}" for c in columns)
        slowest = max(COLUMNS, key=lambda c: row[c])
        lines.append(f"| {workers:,} | {cells} | {GOAL_MS / row[slowest]:.2f}x ({slowest}) |")
    lines += [
        "",
        "'slowest vs goal' is 100 ms over the slowest decision on memops' own path: 1x or more meets the goal.",
        "Holdings in the scheduler grow with the replicated keys (the scheduler's ReduceReplicas drops extra copies",
        "every 2 s, so a tenth is a pessimistic share), plus a little with the workers;",
        "choose_workers with the workers, bytes_moved with the keys of the drained worker; desired_replicas and",
        "the recycle pass with the workers only. The fallback, for a scheduler that refuses run_function, sums",
        "who_has of every key in the operator. The replication pass runs inside the scheduler and reads the ruled",
        "keys off target that its index names (one key in ten ruled by prefix, a tenth of the workers marked by a",
        "pod rule), at most 2,500 of them; bench/scale.py measures it after a rule, a loss, and against a full scan.",
    ]
    return "\n".join(lines)


def plot(results: dict[int, dict[str, float]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for column in (*COLUMNS, FALLBACK, REPLICATION, REPLICATION_STEADY):
        axes.plot(list(results), [row[column] for row in results.values()], marker="o", label=column)
    axes.axhline(GOAL_MS, color="grey", linestyle="--", label="goal")
    axes.set(xscale="log", yscale="log", xlabel="workers", ylabel="ms (median)", title="memops decision cost")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--replicated-every", type=int, default=10, help="one key in N has a second copy")
    parser.add_argument("--output", type=Path, help="also write the table here (markdown), and a .png if matplotlib is")
    args = parser.parse_args(argv)
    results = {workers: measure(workers, args.keys, args.replicated_every) for workers in WORKER_COUNTS}
    text = table(results, args.keys, args.replicated_every)
    print("\n" + text)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text + "\n")
        png = args.output.with_suffix(".png")
        print(
            f"\nwrote {args.output}" + (f" and {png}" if plot(results, png) else " (matplotlib not installed: no plot)")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
