"""A worker whose data grows past its container's memory limit: stock Dask, memops' relief, and memops'
in-place growth, in one run.

Each mode is a sandbox on real Nodes: 2 peer worker pods (1 GiB each) and one worker pod of its own
Deployment with a ``--limit-mib`` container limit, Dask's limit read from the container, spilling off
(as for data that cannot spill), on the same scheduler. Unique 16 MiB keys are scattered onto that
worker until its process memory passes 76% of its limit, then its process grows by a quarter of the
limit that nothing can move (a leak, 16 MiB at a time, a heartbeat and ``--pace`` seconds after each step), as
``tests/e2e/test_resize.py`` and ``tests/e2e/test_pressure.py`` do. Stock: no operator. Relief: a
MemoryPolicy with ``spec.pressure`` (70% -> 50%). Growth: one with ``spec.resize`` (``maxLimit``
2 GiB, growing above 75%). Printed for each: seconds from the worker's first heartbeat over 75% of
its limit to its first one back under it (time to relief), bytes moved off it, whether the nanny
or the kernel killed it, the container's restarts, and keys lost.

    python bench/growth.py                  # the figures in docs/performance.md
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from typing import Any

import benchkit
import distributed
import yaml
from memops_sandbox import common as sandbox

MIB = 2**20
CHUNK = 16 * MIB
OVER = 0.75
MODES = ("stock", "relief", "growth")


def workload(address: str, limit: int) -> dict[str, Any]:
    body = copy.deepcopy(sandbox.worker_deployment(address, 1, image=sandbox.DASK_IMAGE))
    body["metadata"]["name"] = body["spec"]["template"]["metadata"]["labels"]["app"] = "hot"
    body["metadata"]["labels"] = body["spec"]["selector"]["matchLabels"] = {"app": "hot"}
    [container] = body["spec"]["template"]["spec"]["containers"]
    container["resources"]["limits"]["memory"] = str(limit)
    container["resources"].setdefault("requests", {})["memory"] = str(limit)
    container["env"] = [
        *container.get("env", []),
        {"name": "DASK_DISTRIBUTED__WORKER__MEMORY__TARGET", "value": "False"},
        {"name": "DASK_DISTRIBUTED__WORKER__MEMORY__SPILL", "value": "False"},
    ]
    return dict(body)


def leak() -> Any:
    """Made here, so that it travels by value: the workers cannot import the benchmarks."""

    def grow(nbytes: int) -> int:
        import distributed as anchor

        kept: list[bytes] = anchor.__dict__.setdefault("_bench_leak", [])
        kept.append(b"\x01" * nbytes)
        return sum(map(len, kept))

    return grow


class Watch:
    """The hot worker as the scheduler sees it, heartbeat by heartbeat."""

    def __init__(self, client: distributed.Client, pod: str):
        self.client, self.pod = client, pod
        self.address: str | None = None
        self.over: float | None = None  # first heartbeat over OVER of its limit (monotonic)
        self.relieved: float | None = None  # first heartbeat back under it after that
        self.killed = False

    def info(self) -> dict[str, Any] | None:
        for address, info in self.client.scheduler_info(n_workers=-1)["workers"].items():
            if str(info["name"]) == self.pod:
                return {**info, "address": address}
        return None

    def sample(self) -> dict[str, Any] | None:
        info = self.info()
        if info is None or (self.address is not None and info["address"] != self.address):
            self.killed = True  # gone, or its nanny started another worker process
            return None
        self.address = info["address"]
        share = info["metrics"]["memory"] / info["memory_limit"]
        now = time.monotonic()
        if share > OVER and self.over is None:
            self.over = now
        elif share < OVER and self.over is not None and self.relieved is None:
            self.relieved = now
        return info

    def heartbeat(self) -> dict[str, Any] | None:
        """The worker's first heartbeat after now (its memory with the last step in it)."""
        stored = time.time()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            info = self.sample()
            if info is None or info["last_seen"] > stored + 0.2:
                return info
            time.sleep(0.1)
        raise TimeoutError(f"no heartbeat from {self.pod} in 30 s")


def run(mode: str, limit: int, pace: float) -> dict[str, Any]:
    # Growth patches pods/resize, which the chart grants only with rbac.podResize, and only in the
    # namespaces the administrator lists (resize.namespaces).
    growth = ["--set", "rbac.podResize=true", "--set", 'resize.namespaces=["*"]']
    operator = {"stock": ["--no-operator"], "relief": [], "growth": growth}[mode]
    args = ["--worker-memory", "1GiB", *operator]
    with benchkit.running_sandbox(2, *args) as box, distributed.Client(box.address, timeout=30) as client:
        benchkit.kubectl(box.env, "apply", "-f", "-", stdin=yaml.safe_dump(workload(box.address, limit)))
        client.wait_for_workers(3, timeout=120)
        if mode != "stock":
            spec: dict[str, Any] = (
                {"pressure": {"relieveAbove": "70%", "relieveTo": "50%"}}
                if mode == "relief"
                else {"resize": {"maxLimit": "2Gi"}}
            )
            policy = benchkit.memory_policy("hot", "tcp://dask-scheduler:8786", workload="hot", **spec)
            benchkit.kubectl(box.env, "apply", "-f", "-", stdin=yaml.safe_dump(policy))
            deadline = time.monotonic() + 60
            while not any(
                c["type"] == "SchedulerReachable" and c["status"] == "True"
                for c in json.loads(benchkit.kubectl(box.env, "get", "mempol", "hot", "-o", "json"))
                .get("status", {})
                .get("conditions", [])
            ):
                if time.monotonic() > deadline:
                    raise RuntimeError("the policy never reached the scheduler")
                time.sleep(0.5)
        pods = json.loads(benchkit.kubectl(box.env, "get", "pods", "-l", "app=hot", "-o", "json"))["items"]
        [pod] = [p["metadata"]["name"] for p in pods]
        watch = Watch(client, pod)
        futures: dict[str, distributed.Future] = {}
        info = watch.sample()
        # Keys until its process memory passes 76% of its limit (or a limit's worth of keys is there).
        while info is not None and len(futures) * CHUNK < limit:
            if info["metrics"]["memory"] > 0.76 * info["memory_limit"]:
                break
            key = f"hot-{len(futures)}"
            futures.update(client.scatter({key: os.urandom(CHUNK)}, workers=[info["address"]], hash=False))
            info = watch.heartbeat()
        # Then what nothing can move, a step at a time.
        for _ in range(limit // 4 // CHUNK):
            if info is None:
                break
            try:
                client.run(leak(), CHUNK, workers=[info["address"]])
            except OSError:
                pass  # killed as it answered: the next sample says so
            info = watch.heartbeat()
            for _ in range(int(pace * 10)):  # the leak's pace, watched
                if watch.sample() is None:
                    break
                time.sleep(0.1)
        for _ in range(50):  # the last moves land, the last heartbeats arrive
            if watch.sample() is None or watch.relieved is not None:
                break
            time.sleep(0.1)
        who_has = client.sync(client.scheduler.who_has, keys=list(futures))
        lost = sum(1 for holders in who_has.values() if not holders)
        moved = sum(CHUNK for holders in who_has.values() if holders and watch.address not in holders)
        pods = json.loads(benchkit.kubectl(box.env, "get", "pods", "-l", "app=hot", "-o", "json"))["items"]
        statuses = [s for p in pods for s in p.get("status", {}).get("containerStatuses") or []]
        final = watch.info()
        # What the policy could not do (a refused resize, say), so that a leg that failed says why.
        complaints = []
        if mode != "stock":
            status = json.loads(benchkit.kubectl(box.env, "get", "mempol", "hot", "-o", "json")).get("status", {})
            said = {part: (status.get(part) or {}).get("message") for part in ("resize", "pressure")}
            complaints = [f"status.{part}.message: {message}" for part, message in said.items() if message]
            ready = [c for c in status.get("conditions", []) if c["type"] == "Ready" and c["status"] != "True"]
            complaints += [f"Ready False: {c.get('message', '')}" for c in ready]
        return {
            "complaints": complaints,
            "mode": mode,
            "keys": len(futures),
            "over": watch.over,
            "relief": None if watch.over is None or watch.relieved is None else watch.relieved - watch.over,
            "moved": moved,
            "killed": watch.killed,
            "restarts": sum(int(s.get("restartCount", 0)) for s in statuses),
            "lost": lost,
            "limit": int(final["memory_limit"]) if final is not None else None,
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit-mib", type=int, default=512, help="the growing worker's container limit")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument(
        "--pace", type=float, default=3.0, help="seconds between the leak's 16 MiB steps, after each heartbeat"
    )
    args = parser.parse_args()
    limit = args.limit_mib * MIB
    rows = [run(mode, limit, args.pace) for mode in args.modes]
    print(f"One worker of {args.limit_mib} MiB, spilling off: keys to 76% of its limit, then a leak of a quarter")
    print(
        "| mode | keys | time to relief, s | MiB moved off it | killed | restarts | keys lost | its limit at the end |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        relief = "never" if row["relief"] is None else f"{row['relief']:.1f}"
        relief = "stayed under 75%" if row["over"] is None else relief
        end = "gone" if row["limit"] is None else f"{row['limit'] // MIB} MiB"
        print(
            f"| {row['mode']} | {row['keys']} | {relief} | {row['moved'] // MIB} | {'yes' if row['killed'] else 'no'}"
            f" | {row['restarts']} | {row['lost']} | {end} |"
        )
    for row in rows:
        for complaint in row["complaints"]:
            print(f"- {row['mode']}: the policy's {complaint}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
