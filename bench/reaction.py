"""Reaction times of the operator, as distributions over repeated runs in one sandbox.

1. ``kubectl apply`` of a RetirementRequest -> the first byte moving (a key gets a second holder);
2. the drain finished (every key held elsewhere) -> the pod gone from the API;
3. ``kubectl scale mempol`` down -> the policy's RetirementRequest created.

Goals: under 1 s, under 2 s, under 1 s. The anchor is the goal; each figure includes the
``kubectl`` process itself, as a user's command would. The API is polled directly (HTTP) so that
polling costs milliseconds, not a kubectl start.

    python bench/reaction.py --runs 20   # the figures in the README
    python bench/reaction.py --runs 2    # the small pass CI runs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import benchkit
import distributed
import yaml

POLL = 0.005


class Api:
    """Just enough HTTP to poll the sandbox's API server without starting kubectl."""

    def __init__(self, kubeconfig: Path):
        config = yaml.safe_load(kubeconfig.read_text())
        self.server = config["clusters"][0]["cluster"]["server"]
        self.token = config["users"][0]["user"]["token"]

    def get(self, path: str) -> dict[str, Any] | None:
        request = urllib.request.Request(self.server + path, headers={"Authorization": f"Bearer {self.token}"})
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                result: dict[str, Any] = json.loads(response.read())
                return result
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise


def wait(predicate: Any, timeout: float = 120) -> float:
    deadline = time.perf_counter() + timeout
    while not predicate():
        if time.perf_counter() > deadline:
            raise RuntimeError("timed out")
        time.sleep(POLL)
    return time.perf_counter()


def retire_once(
    client: distributed.Client, api: Api, env: dict[str, str], address: str, run: int
) -> tuple[float, float]:
    pods = sorted(benchkit.workers(client))
    pod = pods[0]
    [future] = client.scatter([os.urandom(2**20)], workers=[benchkit.workers(client)[pod]], hash=False)
    key = future.key
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
    applied = time.perf_counter()
    benchkit.kubectl(env, "apply", "-f", "-", stdin=yaml.safe_dump(request))
    first = wait(
        lambda: (
            len(client.sync(client.scheduler.who_has, keys=[key])[key]) > 1
            or benchkit.workers(client).get(pod) not in client.sync(client.scheduler.who_has, keys=[key])[key]
        )
    )
    moved = wait(lambda: benchkit.workers(client).get(pod) is None)
    gone = wait(lambda: api.get(f"/api/v1/namespaces/default/pods/{pod}") is None)
    assert client.gather(future) is not None
    benchkit.kubectl(env, "scale", "deployment/dask-worker", f"--replicas={len(pods)}")
    wait(lambda: len(benchkit.workers(client)) == len(pods))
    return first - applied, gone - moved


def scale_once(client: distributed.Client, api: Api, env: dict[str, str], replicas: int, run: int) -> float:
    before = {
        r["metadata"]["name"]
        for r in (
            api.get(
                "/apis/memops.dev/v1alpha1/namespaces/default/retirementrequests?labelSelector=memops.dev/policy=react"
            )
            or {}
        ).get("items", [])
    }
    started = time.perf_counter()
    benchkit.kubectl(env, "scale", "mempol/react", f"--replicas={replicas - 1}")

    def created() -> bool:
        items = (
            api.get(
                "/apis/memops.dev/v1alpha1/namespaces/default/retirementrequests?labelSelector=memops.dev/policy=react"
            )
            or {}
        ).get("items", [])
        return any(r["metadata"]["name"] not in before for r in items)

    reacted = wait(created)
    wait(lambda: len(benchkit.workers(client)) == replicas - 1, timeout=120)
    benchkit.kubectl(env, "scale", "mempol/react", f"--replicas={replicas}")
    wait(lambda: len(benchkit.workers(client)) == replicas, timeout=120)
    return reacted - started


def summary(label: str, goal: float, values: list[float]) -> str:
    values = sorted(values)
    p90 = values[min(len(values) - 1, int(0.9 * len(values)))]
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
        api = Api(box.state / "kubeconfig")
        with distributed.Client(address, timeout=30) as client:
            retire = [retire_once(client, api, env, address, run) for run in range(args.runs)]
            policy = {
                "apiVersion": "memops.dev/v1alpha1",
                "kind": "MemoryPolicy",
                "metadata": {"name": "react", "namespace": "default"},
                "spec": {
                    "scheduler": {"address": address},
                    "workload": {"kind": "Deployment", "name": "dask-worker"},
                    "replicas": 3,
                },
            }
            benchkit.kubectl(env, "apply", "-f", "-", stdin=yaml.safe_dump(policy))
            scale = [scale_once(client, api, env, 3, run) for run in range(args.runs)]
    print(f"\nOperator reaction times over {args.runs} runs, seconds (goal: the anchor; 'vs goal' = goal / median)\n")
    print(f"{'':40} {'median':>7} {'p90':>7} {'max':>7} {'goal':>6} {'vs goal':>8}")
    print(summary("kubectl apply retire -> first byte moving", 1.0, [r[0] for r in retire]))
    print(summary("drain finished -> pod gone", 2.0, [r[1] for r in retire]))
    print(summary("kubectl scale mempol -> request created", 1.0, scale))
    return 0


if __name__ == "__main__":
    sys.exit(main())
