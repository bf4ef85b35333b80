"""Recipients' shares: does one drain finish sooner when its keys are spread evenly over the recipients?

A drained worker's keys are fetched by each recipient from the one sender, one message of at most
``distributed.worker.transfer.message-bytes-limit`` in flight per recipient at a time, so a drain
lasts about as long as the busiest recipient's share. This measures it with no drain policy in
between: real Dask worker processes (a ``LocalCluster``, no Kubernetes), one worker holding SIZE in
keys of KEY bytes, and the scheduler's own ``request_acquire_replicas`` (what the AMM and memops'
drain send) asking the three other workers for every key, split in fixed shares:

- even (anchor): a third each, what memops' drain gives recipients with room below their target;
- two: half each to two recipients, the third idle;
- skewed: 22/22/56%, a split that giving the most headroom first made (one recipient had just
  started, the others held a previous drain's memory).

The time is first key in flight -> last key in memory, timed inside the workers; each split's
ratio to the even split is taken within a run, and the splits' order alternates between runs.

    python bench/recipient_shares.py                         # 1 GiB in 1 MiB keys, 6 runs
    python bench/recipient_shares.py --size-mib 64 --runs 1  # the small pass CI runs
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import dask
import distributed
from distributed.diagnostics.plugin import WorkerPlugin

MIB = 2**20
SPLITS: dict[str, tuple[int, ...]] = {"even": (1, 1, 1), "two": (1, 1, 0), "skewed": (22, 22, 56)}


class Clock(WorkerPlugin):
    """Records, on each worker, when a key goes into flight and when it reaches memory."""

    name = "memops-bench-shares-clock"

    def __init__(self) -> None:
        self.events: list[tuple[float, str]] = []

    def transition(self, key: Any, start: str, finish: str, **kwargs: Any) -> None:
        if finish in ("flight", "memory"):
            self.events.append((time.time(), finish))


def _take(dask_worker: Any = None) -> list[tuple[float, str]]:
    plugin = dask_worker.plugins[Clock.name]
    events, plugin.events = plugin.events, []
    return list(events)


def shares(count: int, weights: Sequence[int]) -> list[int]:
    """``count`` keys split by ``weights``, the remainder to the last recipient with a weight."""
    total = sum(weights)
    split = [count * w // total for w in weights]
    last = max(i for i, w in enumerate(weights) if w)
    split[last] += count - sum(split)
    return split


def _ask(
    dask_scheduler: Any = None, targets: Sequence[str] = (), keys: Sequence[Any] = (), split: Sequence[int] = ()
) -> None:
    start = 0
    for target, count in zip(targets, split, strict=True):
        if count:
            dask_scheduler.request_acquire_replicas(
                target, list(keys[start : start + count]), stimulus_id=f"shares-{time.time()}"
            )
        start += count


async def measure(
    client: distributed.Client, source: str, targets: list[str], keys: int, key_size: int, split: Sequence[int]
) -> float:
    payload = [bytes([i % 251]) * (key_size - 8) + i.to_bytes(8, "little") for i in range(keys)]
    futures = await client.scatter(payload, workers=[source], hash=False)
    del payload
    await client.run(_take)
    wanted = [f.key for f in futures]
    await client.run_on_scheduler(_ask, targets=targets, keys=wanted, split=split)
    async with asyncio.timeout(300):
        while True:
            holders = await client.who_has(futures)
            if all(len(holders[k]) >= 2 for k in wanted):
                break
            await asyncio.sleep(0.02)
    events = [e for evs in (await client.run(_take)).values() for e in evs]
    first = min(t for t, f in events if f == "flight")
    last = max(t for t, f in events if f == "memory")
    await client.cancel(futures)
    await asyncio.sleep(0.5)
    return last - first


async def bench(size: int, key_size: int, runs: int) -> dict[str, list[float]]:
    keys = max(size // key_size, 1)
    results: dict[str, list[float]] = {name: [] for name in SPLITS}
    # No AMM: its ReduceReplicas would drop the copies being counted.
    with dask.config.set({"distributed.scheduler.active-memory-manager.start": False}):
        async with (
            distributed.LocalCluster(
                n_workers=4,
                threads_per_worker=1,
                processes=True,
                memory_limit=f"{max(4 * size // 2**30, 2)}GiB",
                dashboard_address=None,
                asynchronous=True,
            ) as cluster,
            distributed.Client(cluster, asynchronous=True) as client,
        ):
            await client.register_plugin(Clock())
            source, *targets = sorted(cluster.scheduler.workers)
            for run in range(runs):
                order = list(SPLITS) if run % 2 == 0 else list(reversed(SPLITS))
                for name in order:
                    seconds = await measure(client, source, targets, keys, key_size, shares(keys, SPLITS[name]))
                    results[name].append(seconds)
                    print(f"run {run} {name}: {seconds:.3f} s", flush=True)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--key-kib", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=6)
    args = parser.parse_args(argv)
    size, key_size = args.size_mib * MIB, args.key_kib * 1024
    results = asyncio.run(bench(size, key_size, args.runs))
    even = results["even"]
    print(f"\n{args.size_mib} MiB in {args.key_kib} KiB keys, one sender, three recipients, median of {args.runs} runs")
    print("time: first key in flight -> last key in memory; ratio to the even split within each run\n")
    print("| split | shares | seconds | time / even (range) |")
    print("| --- | --- | --- | --- |")
    for name, times in results.items():
        ratios = [t / e for t, e in zip(times, even, strict=True)]
        print(
            f"| {name} | {'/'.join(str(w) for w in SPLITS[name])} | {statistics.median(times):.3f} |"
            f" {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
