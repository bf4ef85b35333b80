"""Cost of the pure deciding functions on synthetic scheduler states, 10 to 1,000 workers.

Anchor: the goal of 100 ms per decision at 1,000 workers and 1,000,000 keys. Each figure is
the median of several runs of the same call on the same state, measured in this process.

    python bench/decision_cost.py                 # up to 1,000 workers, 1,000,000 keys
    python bench/decision_cost.py --keys 100000   # the small pass CI runs
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import sys
import time
from collections.abc import Callable

from memops import planning


def synthetic(workers: int, keys: int, seed: int = 0) -> tuple[planning.SchedulerSnapshot, list[str]]:
    rng = random.Random(seed)
    addresses = [f"tcp://10.0.{i // 250}.{i % 250}:8786" for i in range(workers)]
    who_has: dict[str, tuple[str, ...]] = {}
    nbytes: dict[str, int] = {}
    for k in range(keys):
        key = f"('x-{k // 1000}', {k % 1000})"
        # One key in ten has a second replica, as after a shuffle or a ReduceReplicas lag.
        holders = rng.sample(addresses, 2) if k % 10 == 0 else [rng.choice(addresses)]
        who_has[key] = tuple(holders)
        nbytes[key] = rng.randint(1_000, 10_000_000)
    unique = planning.unique_holdings(who_has, nbytes)
    infos = tuple(
        planning.WorkerInfo(
            name=f"w-{i}", address=a, unique_bytes=unique.get(a, (0, 0))[0], unique_keys=unique.get(a, (0, 0))[1]
        )
        for i, a in enumerate(addresses)
    )
    pods = [w.name for w in infos] + [f"pending-{i}" for i in range(workers // 20)]
    return planning.SchedulerSnapshot(infos, who_has, nbytes), pods


def median_ms(call: Callable[[], object], runs: int = 5) -> float:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        call()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    args = parser.parse_args()
    print(f"\nDecision cost, median ms of 5 runs; {args.keys:,} keys; goal < 100 ms at 1,000 workers\n")
    print(f"{'workers':>8} {'choose_workers':>15} {'unique_holdings':>16} {'bytes_moved':>12} {'vs goal':>8}")
    for workers in (10, 100, 1000):
        snapshot, pods = synthetic(workers, args.keys)
        address = snapshot.workers[0].address
        choose = median_ms(functools.partial(planning.choose_workers, pods, snapshot, max(workers // 10, 1)))
        unique = median_ms(functools.partial(planning.unique_holdings, snapshot.who_has, snapshot.nbytes))
        moved = median_ms(
            functools.partial(planning.bytes_moved, snapshot.who_has, snapshot.who_has, snapshot.nbytes, address)
        )
        worst = max(choose, unique, moved)
        print(f"{workers:>8} {choose:>15.2f} {unique:>16.1f} {moved:>12.1f} {100 / worst:>7.1f}x")
    print("\n'vs goal' is 100 ms over the slowest of the three: above 1x meets the goal.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
