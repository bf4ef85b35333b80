"""Leaky and ageing workers: stock Dask against memops' recycling, side by side in one run.

Two scenarios, each run twice on the same sandbox set-up (real scheduler, real nannies and
workers with a 1 GiB limit), once without the operator (stock Dask) and once with a
MemoryPolicy that recycles:

- **leak**: every worker holds unique scattered keys and persisted (recomputable) results;
  one long task on one worker keeps references in a module-level list, as a leaky library
  does, until the process passes the nanny's 95% and is killed. memops' policy
  (``recycle.unmanagedMemory``) replaces that worker first: surge, drain, remove.
- **lifetime**: two workers started together with stock ``--lifetime`` expire together; each
  tries to hand its data to the other, which is leaving too, and closes anyway. memops'
  ``recycle.maxAge`` staggers them and replaces one at a time, surge first.

Printed: keys lost (unique scattered data that no worker holds), tasks recomputed (persisted
results computed more than once), whether the nanny killed a worker, the leaky worker's peak
process memory, and workers recycled.

    python bench/recycle.py                      # the figures in docs/performance.md
    python bench/recycle.py --leak-seconds 40    # a shorter pass
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import benchkit
import distributed

MIB = 2**20
KEYS_PER_WORKER = 8
PERSISTED = 24


def leak_for(seconds: float, mib: int, every: float) -> int:
    """A task that leaks ``mib`` MiB every ``every`` seconds: references kept in a module list."""
    import distributed as anchor

    kept: list[bytes] = anchor.__dict__.setdefault("_bench_leak", [])
    end = time.time() + seconds
    while time.time() < end:
        kept.append(b"\x01" * (mib * MIB))  # ones, so the pages are touched and count as memory
        time.sleep(every)
    return len(kept)


def block(i: int) -> bytes:
    return os.urandom(MIB // 4) + i.to_bytes(4, "big")


def apply_policy(box: benchkit.Sandbox, replicas: int, recycle: dict[str, Any]) -> None:
    benchkit.apply_policy(box, "recycler", replicas=replicas, drain={"timeout": "2m"}, recycle=recycle)


def load(client: distributed.Client) -> tuple[dict[str, distributed.Future], list[distributed.Future]]:
    benchkit.count_computations(client, "persisted-")
    scattered: dict[str, distributed.Future] = {}
    for name, address in benchkit.workers(client).items():
        values = {f"unique-{name}-{i}": os.urandom(MIB) for i in range(KEYS_PER_WORKER)}
        scattered.update(client.scatter(values, workers=[address], hash=False))
    persisted = client.map(block, range(PERSISTED), key=[f"persisted-{i}" for i in range(PERSISTED)])
    distributed.wait(persisted)
    return scattered, persisted


def lost(client: distributed.Client, futures: dict[str, distributed.Future]) -> int:
    who_has = client.sync(client.scheduler.who_has, keys=list(futures))
    return sum(1 for holders in who_has.values() if not holders)


def recycled(env: dict[str, str]) -> int:
    status = json.loads(benchkit.kubectl(env, "get", "mempol", "recycler", "-o", "json")).get("status", {})
    return int((status.get("recycle") or {}).get("total", 0))


def leak(with_memops: bool, seconds: float) -> dict[str, Any]:
    with benchkit.running_sandbox(3, *([] if with_memops else ["--no-operator"])) as box:
        with distributed.Client(box.address, timeout=30) as client:
            if with_memops:
                rule = {"unmanagedMemory": {"above": "40%", "for": "4s"}, "maxUnavailable": 1, "surge": 1}
                apply_policy(box, 3, rule)
            scattered, persisted = load(client)
            name, address = sorted(benchkit.workers(client).items())[0]
            task = client.submit(leak_for, seconds, 10, 0.5, workers=[address], pure=False, key="leaky-task")
            peak, killed, start = 0, False, time.monotonic()
            while time.monotonic() - start < seconds + 15:
                workers = client.scheduler_info(n_workers=-1)["workers"]
                mine = workers.get(address)
                if mine is None:
                    # Gone: recycled by memops, or killed by its nanny (which starts a new worker
                    # process under the same name, at a new address).
                    time.sleep(3)
                    names = {str(i["name"]) for i in client.scheduler_info(n_workers=-1)["workers"].values()}
                    killed = name in names
                    break
                peak = max(peak, int(mine["metrics"]["memory"]))
                time.sleep(0.2)
            client.cancel(task)
            time.sleep(2)
            distributed.wait(persisted, timeout=60)
            return {
                "keys lost": lost(client, scattered),
                "of keys": len(scattered),
                "tasks recomputed": benchkit.recomputed(client),
                "nanny killed": "yes" if killed else "no",
                "peak MiB": peak // MIB,
                "recycled": recycled(box.env) if with_memops else 0,
            }


def lifetime(with_memops: bool, seconds: float) -> dict[str, Any]:
    with benchkit.running_sandbox(2, *([] if with_memops else ["--no-operator"])) as box:
        if with_memops:
            rule = {"maxAge": f"{seconds:.0f}s", "maxUnavailable": 1, "surge": 1}
            apply_policy(box, 2, rule)
        else:
            # Stock Dask: both workers get --lifetime, started together, as a Deployment makes them.
            patch = [
                {"op": "add", "path": "/spec/template/spec/containers/0/args/-", "value": "--lifetime"},
                {"op": "add", "path": "/spec/template/spec/containers/0/args/-", "value": f"{seconds:.0f}s"},
            ]
            benchkit.kubectl(box.env, "patch", "deployment/dask-worker", "--type=json", "-p", json.dumps(patch))
            benchkit.kubectl(box.env, "scale", "deployment/dask-worker", "--replicas=0")
            benchkit.kubectl(box.env, "scale", "deployment/dask-worker", "--replicas=2")
        with distributed.Client(box.address, timeout=30) as client:
            client.wait_for_workers(2, timeout=60)
            scattered, _ = load(client)
            first = set(benchkit.workers(client))
            start = time.monotonic()
            while time.monotonic() - start < 3 * seconds + 30:
                if not first & set(benchkit.workers(client)):
                    break  # both original workers have gone
                time.sleep(0.5)
            time.sleep(3)
            return {
                "keys lost": lost(client, scattered),
                "of keys": len(scattered),
                "tasks recomputed": "",
                "nanny killed": "",
                "peak MiB": "",
                "recycled": recycled(box.env) if with_memops else 0,
            }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leak-seconds", type=float, default=60, help="how long the leaky task runs")
    parser.add_argument("--lifetime", type=float, default=20, help="stock --lifetime, and memops' maxAge, seconds")
    args = parser.parse_args()
    rows = [
        ("leak: stock Dask (nanny at 95%)", leak(False, args.leak_seconds)),
        ("leak: memops recycle.unmanagedMemory", leak(True, args.leak_seconds)),
        (f"lifetime {args.lifetime:.0f}s: stock --lifetime", lifetime(False, args.lifetime)),
        (f"lifetime {args.lifetime:.0f}s: memops recycle.maxAge", lifetime(True, args.lifetime)),
    ]
    columns = ["keys lost", "of keys", "tasks recomputed", "nanny killed", "peak MiB", "recycled"]
    print(f"\n{'scenario':42}" + "".join(f"{c:>17}" for c in columns))
    for label, row in rows:
        print(f"{label:42}" + "".join(f"{row[c]!s:>17}" for c in columns))
    memops_lost = rows[1][1]["keys lost"] + rows[3][1]["keys lost"]
    return 0 if memops_lost == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
