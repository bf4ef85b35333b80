"""Reaction times of the operator, as distributions over repeated runs in one sandbox.

1. ``kubectl apply`` of a RetirementRequest -> the first byte moving (the worker's key goes into
   flight towards another worker); and the same from the API server's watch event (the create
   complete, from its audit log: what the operator's watch receives), goal 0.1 s;
2. the drain finished (that key in memory on the other worker) -> the pod gone from the API;
3. ``kubectl scale mempol`` down -> the policy's RetirementRequest created.

Goals: under 1 s, under 2 s, under 1 s. The anchor is the goal; each figure includes the
``kubectl`` process itself, as a user's command would. The moments data moves are recorded inside
the workers (``throughput.TransferClock``); the API is polled directly (HTTP) so that polling
costs milliseconds, not a kubectl start.

    python bench/reaction.py --runs 20   # the figures in docs/performance.md
    python bench/reaction.py --runs 2    # the small pass CI runs
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from typing import Any

import benchkit
import distributed
import throughput
import yaml

POLL = 0.005
REQUESTS = "/apis/memops.dev/v1alpha1/namespaces/default/retirementrequests?labelSelector=memops.dev/policy=react"


def wait(predicate: Any, timeout: float = 120) -> float:
    deadline = time.time() + timeout
    while not predicate():
        if time.time() > deadline:
            raise RuntimeError("timed out")
        time.sleep(POLL)
    return time.time()


def settled(client: distributed.Client, api: throughput.Api, count: int) -> dict[str, str]:
    """Wait until ``count`` workers are connected, one per live pod: a drained worker's container may
    restart it for a moment before its pod is deleted, and that worker must not be picked."""
    found: dict[str, str] = {}

    def ready() -> bool:
        nonlocal found
        found = benchkit.workers(client)
        # The workers' pods (on real Nodes the Dask scheduler is a pod too).
        listed = (api.get("/api/v1/namespaces/default/pods?labelSelector=app%3Ddask-worker") or {}).get("items", [])
        live = {p["metadata"]["name"] for p in listed if not p["metadata"].get("deletionTimestamp")}
        return len(found) == count and set(found) == live

    wait(ready)
    return found


def retire_once(
    box: benchkit.Sandbox, client: distributed.Client, api: throughput.Api, run: int, count: int
) -> tuple[float, float, float]:
    """Seconds: kubectl apply -> first byte; the drain finished -> the pod gone; the watch
    event -> first byte."""
    env, address = box.env, box.address
    by_pod = settled(client, api, count)
    pod = sorted(by_pod)[0]
    key = f"tp-react-{run}"
    [future] = client.scatter({key: os.urandom(2**20)}, workers=[by_pod[pod]], hash=False).values()
    request = {
        "apiVersion": "memops.dev/v1alpha1",
        "kind": "RetirementRequest",
        "metadata": {"name": f"react-{run}", "namespace": "default"},
        "spec": {
            "scheduler": {"address": address},
            "workload": {"kind": "Deployment", "name": "dask-worker"},
            "workers": [pod],
        },
    }
    throughput.collect(client)
    applied = time.time()
    benchkit.kubectl(env, "apply", "-f", "-", stdin=yaml.safe_dump(request))
    gone = wait(lambda: api.get(f"/api/v1/namespaces/default/pods/{pod}") is None)
    # When the key went into flight towards another worker, and reached its memory: timed there.
    first, moved = throughput.drain_window(throughput.collect(client), applied, key)
    assert client.gather(future) is not None
    benchkit.kubectl(env, "scale", "deployment/dask-worker", f"--replicas={count}")
    event = benchkit.created_at(box, "retirementrequests", f"react-{run}")
    return first - applied, gone - moved, first - event


def scale_once(client: distributed.Client, api: throughput.Api, env: dict[str, str], replicas: int, run: int) -> float:
    before = {r["metadata"]["name"] for r in (api.get(REQUESTS) or {}).get("items", [])}
    started = time.time()
    benchkit.kubectl(env, "scale", "mempol/react", f"--replicas={replicas - 1}")

    def created() -> bool:
        items = (api.get(REQUESTS) or {}).get("items", [])
        return any(r["metadata"]["name"] not in before for r in items)

    reacted = wait(created)

    def finished() -> bool:  # the policy drains one request at a time: let this one end first
        items = (api.get(REQUESTS) or {}).get("items", [])
        return all((r.get("status") or {}).get("phase") in ("Succeeded", "Failed") for r in items)

    wait(finished)
    settled(client, api, replicas - 1)
    benchkit.kubectl(env, "scale", "mempol/react", f"--replicas={replicas}")
    settled(client, api, replicas)
    return reacted - started


def summary(label: str, goal: float, values: list[float]) -> str:
    values = sorted(values)
    p90 = values[math.ceil(0.9 * len(values)) - 1]  # nearest rank
    return (
        f"{label:40} {statistics.median(values):7.3f} {p90:7.3f} {values[-1]:7.3f} {goal:6.1f}"
        f" {goal / statistics.median(values):7.1f}x"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    with benchkit.running_sandbox(3) as box:
        env, address = box.env, box.address
        api = throughput.Api(box.state / "kubeconfig")
        with distributed.Client(address, timeout=30) as client:
            throughput.start(client)
            retire = [retire_once(box, client, api, run, 3) for run in range(args.runs)]
            settled(client, api, 3)
            benchkit.apply_policy(box, "react", replicas=3)
            scale = [scale_once(client, api, env, 3, run) for run in range(args.runs)]
    print(f"\nOperator reaction times over {args.runs} runs, seconds (goal: the anchor; 'vs goal' = goal / median)\n")
    print(f"{'':40} {'median':>7} {'p90':>7} {'max':>7} {'goal':>6} {'vs goal':>8}")
    print(summary("kubectl apply retire -> first byte moving", 1.0, [r[0] for r in retire]))
    print(summary("watch event -> first byte moving", 0.1, [r[2] for r in retire]))
    print(summary("drain finished -> pod gone", 2.0, [r[1] for r in retire]))
    print(summary("kubectl scale mempol -> request created", 1.0, scale))
    return 0


if __name__ == "__main__":
    sys.exit(main())
