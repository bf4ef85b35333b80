"""One worker loaded far beyond the others: stock Dask against memops' pressure relief, side by side.

Each run is a sandbox with 3 real worker pods (nanny + worker, a memory limit each, Dask's
default spill / pause / terminate thresholds). Unique data is scattered onto one worker only
(``workers=``), a chunk at a time, until it was given ``--load`` times its memory limit (each
load is a pair of runs); the other two workers are given nothing. Stock Dask (no operator): the worker spills to disk,
pauses, or is killed. memops: a MemoryPolicy with ``spec.pressure`` has the scheduler move keys
from it to its peers as it fills. Printed for each: the loaded worker's peak process memory
(as the scheduler saw it), its peers' peak, bytes it spilled to disk, whether it paused or was
killed, keys lost, and keys moved by relief.

    python bench/pressure.py                                       # the figures in docs/performance.md
    python bench/pressure.py --load 1.0 --limit-mib 256 --settle 2 # the small pass CI runs
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
CHUNK = 8 * MIB
ABOVE, TO = "55%", "40%"  # below the workers' own spill threshold (60% managed, 70% process)


def run(load: float, limit_mib: int, settle: float, *, relief: bool) -> dict[str, Any]:
    args = ["--worker-memory", f"{limit_mib}MiB", *([] if relief else ["--no-operator"])]
    with benchkit.running_sandbox(3, *args) as box, distributed.Client(box.address, timeout=30) as client:
        client.wait_for_workers(3, timeout=60)
        if relief:
            benchkit.apply_policy(box, "pressure", replicas=3, pressure={"relieveAbove": ABOVE, "relieveTo": TO})
            deadline = time.monotonic() + 60
            while "pressure" not in json.loads(
                benchkit.kubectl(box.env, "get", "mempol", "pressure", "-o", "json")
            ).get("status", {}):
                if time.monotonic() > deadline:
                    raise RuntimeError("the policy never installed pressure relief")
                time.sleep(0.5)
        hot = sorted(client.scheduler_info(n_workers=-1)["workers"])[0]
        futures: dict[str, distributed.Future] = {}
        peak, peers, spilled, paused, killed = 0, 0, 0, False, False

        def sample() -> None:
            nonlocal peak, peers, spilled, paused, killed
            info = client.scheduler_info(n_workers=-1)["workers"]
            peers = max([peers, *(int(w["metrics"]["memory"]) for a, w in info.items() if a != hot)])
            if hot not in info:
                killed = True
                return
            metrics = info[hot]["metrics"]
            peak = max(peak, int(metrics["memory"]))
            spilled = max(spilled, int((metrics.get("spilled_bytes") or {}).get("disk", 0)))
            paused = paused or info[hot].get("status") == "paused"

        total = int(load * limit_mib * MIB)
        placed = 0
        while placed < total and not killed:
            values = {f"unique-{placed // CHUNK}": os.urandom(CHUNK)}
            try:
                futures.update(client.scatter(values, workers=[hot], hash=False, timeout=30))
            except (KeyError, OSError, TimeoutError):
                killed = True  # the worker is gone: nowhere to put it
                break
            placed += CHUNK
            sample()
            time.sleep(0.1)
        for _ in range(int(settle * 10)):  # the last moves land, the last heartbeats arrive
            sample()
            time.sleep(0.1)
        who_has = client.sync(client.scheduler.who_has, keys=list(futures))
        lost = sum(1 for holders in who_has.values() if not holders)
        moved = 0
        if relief:
            status = json.loads(benchkit.kubectl(box.env, "get", "mempol", "pressure", "-o", "json"))["status"]
            moved = int(status["pressure"]["keysMoved"])
        return {
            "placed": placed,
            "keys": len(futures),
            "peak": peak,
            "peers": peers,
            "spilled": spilled,
            "paused": paused,
            "killed": killed,
            "lost": lost,
            "moved": moved,
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--load", type=float, nargs="+", default=[1.0, 1.5], help="data placed on one worker, in memory limits"
    )
    parser.add_argument("--limit-mib", type=int, default=512, help="each worker's memory limit")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds watched after the last chunk")
    args = parser.parse_args()
    rows = []
    for load in args.load:
        for relief in (False, True):
            result = run(load, args.limit_mib, args.settle, relief=relief)
            rows.append(
                (f"{result['placed'] // MIB} MiB, {'memops spec.pressure' if relief else 'stock Dask'}", result)
            )
    print(
        f"\nUnique data scattered onto one of 3 workers ({args.limit_mib} MiB limit each), {CHUNK // MIB} MiB at a"
        f" time; memops relieves above {ABOVE} down to {TO}\n"
    )
    print(
        f"{'':30} {'peak MiB':>9} {'peers MiB':>10} {'spilled MiB':>12} {'paused':>7} {'killed':>7}"
        f" {'keys lost':>10} {'moved':>6}"
    )
    for label, r in rows:
        print(
            f"{label:30} {r['peak'] / MIB:>9.0f} {r['peers'] / MIB:>10.0f} {r['spilled'] / MIB:>12.0f}"
            f" {'yes' if r['paused'] else 'no':>7} {'yes' if r['killed'] else 'no':>7} {r['lost']:>6} of {r['keys']:<3}"
            f" {r['moved']:>6}"
        )
    return 0 if all(r["lost"] == 0 for label, r in rows if "memops" in label) else 1


if __name__ == "__main__":
    sys.exit(main())
