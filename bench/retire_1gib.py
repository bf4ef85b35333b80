"""Retire one worker holding SIZE of unique data: memops (a RetirementRequest) against its anchors.

Anchors, measured in the same sandbox and the same run:
- raw: copying the same bytes from one worker to another (``Client.replicate``);
- stock: the scheduler's ``retire_workers`` called directly, which is what memops drives.

memops is timed from ``kubectl apply`` to: the first byte moving (a key gets a second
holder), every key held elsewhere, and ``Succeeded`` (the pod gone). The ratio that matters
is memops' drain (first byte -> all moved) over stock ``retire_workers``.

    python bench/retire_1gib.py                  # 1 GiB, 3 runs
    python bench/retire_1gib.py --size-mib 64 --runs 1   # the small pass CI runs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import benchkit
import distributed
import yaml

CHUNK = 16 * 2**20
POLL_SECONDS = 0.02


def fill(client: distributed.Client, address: str, size: int, tag: str) -> list[distributed.Future]:
    chunk = os.urandom(min(CHUNK, size))
    values = {f"{tag}-{i}": chunk + i.to_bytes(8, "little") for i in range(max(size // CHUNK, 1))}
    return list(client.scatter(values, workers=[address], hash=False).values())


def who_has(client: distributed.Client, keys: list[str]) -> dict[str, list[str]]:
    result: dict[str, list[str]] = client.sync(client.scheduler.who_has, keys=keys)
    return result


def wait_workers(client: distributed.Client, count: int) -> None:
    deadline = time.monotonic() + 60
    while len(benchkit.workers(client)) < count:
        if time.monotonic() > deadline:
            raise RuntimeError("workers did not come back")
        time.sleep(0.1)


def one_run(client: distributed.Client, env: dict[str, str], address: str, size: int, run: int) -> dict[str, float]:
    names = sorted(benchkit.workers(client))
    # Raw anchor: worker-to-worker copy of the same bytes.
    futures = fill(client, benchkit.workers(client)[names[0]], size, f"raw{run}")
    started = time.perf_counter()
    client.replicate(futures, n=2)
    raw = time.perf_counter() - started
    del futures
    time.sleep(0.5)

    # Stock anchor: the scheduler's retire_workers, called directly.
    stock_keep = fill(client, benchkit.workers(client)[names[0]], size, f"stock{run}")
    started = time.perf_counter()
    client.retire_workers(workers=[benchkit.workers(client)[names[0]]], close_workers=True)
    stock = time.perf_counter() - started
    assert len(client.gather(stock_keep)) == len(stock_keep), "no key lost"
    del stock_keep  # released, so that the next worker holds only its own data
    wait_workers(client, len(names))  # the pod's container restarts the worker, empty
    time.sleep(0.5)

    # memops: a RetirementRequest for the worker in pod names[1]. Polled lightly (one
    # who_has of this worker's keys every 20 ms), so that measuring does not slow the scheduler.
    pod = names[1]
    address_before = benchkit.workers(client)[pod]
    keep = fill(client, address_before, size, f"memops{run}")
    keys = [f.key for f in keep]
    request = {
        "apiVersion": "memops.dev/v1alpha1",
        "kind": "RetirementRequest",
        "metadata": {"name": f"bench-{run}", "namespace": "default"},
        "spec": {
            "scheduler": {"address": address},
            "workload": {"kind": "Deployment", "name": "dask-worker"},
            "workers": [pod],
            "timeout": "10m",
        },
    }
    applied = time.perf_counter()
    benchkit.kubectl(env, "apply", "-f", "-", stdin=yaml.safe_dump(request))
    first_byte = moved = 0.0
    while not moved:
        holders = who_has(client, keys).values()
        now = time.perf_counter()
        if not first_byte and any(len(h) > 1 or address_before not in h for h in holders):
            first_byte = now
        if first_byte and all(h and address_before not in h for h in holders):
            moved = now
        time.sleep(POLL_SECONDS)
    succeeded = 0.0
    while not succeeded:
        status = json.loads(benchkit.kubectl(env, "get", "retire", f"bench-{run}", "-o", "json")).get("status", {})
        if status.get("phase") in ("Succeeded", "Failed"):
            assert status["phase"] == "Succeeded", status
            succeeded = time.perf_counter()
        time.sleep(0.05)
    gathered = client.gather(keep)
    assert len(gathered) == len(keep), "no key lost"
    # Put the pod back for the next run.
    benchkit.kubectl(env, "scale", "deployment/dask-worker", f"--replicas={len(names)}")
    wait_workers(client, len(names))
    return {
        "raw_s": raw,
        "stock_s": stock,
        "apply_to_first_byte_s": first_byte - applied,
        "drain_s": moved - first_byte,
        "moved_to_succeeded_s": succeeded - moved,
        "apply_to_succeeded_s": succeeded - applied,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    size = args.size_mib * 2**20
    memory = f"{max(4 * size // 2**30, 2)}GiB"
    with benchkit.running_sandbox(3, "--worker-memory", memory) as box:
        with distributed.Client(box.address, timeout=30) as client:
            results = [one_run(client, box.env, box.address, size, run) for run in range(args.runs)]
    median: dict[str, Any] = {k: statistics.median(r[k] for r in results) for k in results[0]}
    gib = size / 2**30
    print(f"\nRetire one worker holding {args.size_mib} MiB of unique data; median of {args.runs} runs, same sandbox\n")
    print(f"{'measure':38} {'seconds':>9} {'GiB/s':>8} {'vs stock':>9}")
    rows = [
        ("raw worker-to-worker copy (anchor)", median["raw_s"]),
        ("stock retire_workers (anchor)", median["stock_s"]),
        ("memops drain: first byte -> all moved", median["drain_s"]),
    ]
    for label, seconds in rows:
        if seconds < POLL_SECONDS:  # moved within one poll: below what this bench can resolve
            print(f"{label:38} {'< ' + str(POLL_SECONDS):>9} {'-':>8} {'-':>9}")
            continue
        print(f"{label:38} {seconds:9.3f} {gib / seconds:8.2f} {median['stock_s'] / seconds:8.2f}x")
    print(f"{'memops: kubectl apply -> first byte':38} {median['apply_to_first_byte_s']:9.3f}")
    print(f"{'memops: all moved -> Succeeded':38} {median['moved_to_succeeded_s']:9.3f}")
    print(f"{'memops: kubectl apply -> Succeeded':38} {median['apply_to_succeeded_s']:9.3f}")
    print("\nvs stock > 1 means faster than calling retire_workers directly (throughput ratio stock/memops).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
