"""``kubectl drain`` of a node whose Dask workers hold unique data: stock Kubernetes against memops.

Side by side on the upstream control plane (two Nodes): the same workers, the same scattered
keys (each on one worker only), the same ``kubectl drain <node> --ignore-daemonsets
--pod-selector=app=dask-worker`` (the node's workers: the Dask scheduler and the operator are pods
of the sandbox's Nodes too, where a cluster runs them apart). Stock:
the evicted workers' keys are lost. memops: the eviction gate refuses with 429 until the node's
workers are drained, ``kubectl drain`` retries on its own and completes; no key is lost. Printed:
keys lost and the drain's wall time, for each.

    python bench/node_drain.py --workers 4 --keys 20   # the figures in docs/performance.md
    python bench/node_drain.py --workers 4 --keys 2    # the small pass CI runs
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import benchkit
import distributed
import yaml

KUBECTL = str(Path(sys.executable).parent / "kubectl")


def placement(sandbox: benchkit.Sandbox) -> dict[str, str]:
    pods = yaml.safe_load(benchkit.kubectl(sandbox.env, "get", "pods", "-l", "app=dask-worker", "-o", "yaml"))
    return {
        p["metadata"]["name"]: p["spec"]["nodeName"]
        for p in pods["items"]
        if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
    }


def spread(sandbox: benchkit.Sandbox, client: distributed.Client, workers: int) -> None:
    """Workers on both nodes, so that the drained node's data has somewhere to go: kube-scheduler's
    spreading is only a preference, and on a busy machine it may put every pod on one node."""
    if len(set(placement(sandbox).values())) > 1:
        return
    benchkit.spread_over_nodes(sandbox)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        placed = placement(sandbox)
        if len(placed) == workers and len(set(placed.values())) == 2 and set(benchkit.workers(client)) == set(placed):
            return
        time.sleep(1)
    raise RuntimeError("the workers did not spread over both nodes")


def one_run(workers: int, keys: int, *, memops: bool) -> tuple[int, int, float]:
    """(keys scattered, keys lost, seconds kubectl drain took)."""
    args = ["--nodes", "2", *([] if memops else ["--no-operator"])]
    with benchkit.running_sandbox(workers, *args) as sandbox:
        if memops:
            benchkit.apply_policy(sandbox, "bench", drain={"timeout": "2m"})
        with distributed.Client(sandbox.address, timeout=30) as client:
            client.wait_for_workers(workers, timeout=120)
            spread(sandbox, client, workers)
            names = benchkit.workers(client)
            futures = []
            for name, address in names.items():
                values = {f"{name}-{i}": os.urandom(256 * 1024) for i in range(keys)}
                futures += list(client.scatter(values, workers=[address], hash=False, broadcast=False).values())
            node = sorted(set(placement(sandbox).values()))[0]
            began = time.monotonic()
            subprocess.run(
                [KUBECTL, "drain", node, "--ignore-daemonsets", "--pod-selector=app=dask-worker", "--timeout=170s"],
                env=sandbox.env,
                check=True,
                capture_output=True,
                timeout=200,
            )
            seconds = time.monotonic() - began
            deadline = time.monotonic() + 30
            lost: list[str] = []
            while time.monotonic() < deadline:  # stock: the evicted workers leave the scheduler shortly after
                who_has = client.sync(client.scheduler.who_has, keys=[f.key for f in futures])
                lost = [k for k, holders in who_has.items() if not holders]
                if lost or memops:  # memops admitted the evictions only once the workers had left
                    break
                time.sleep(1)
            return len(futures), len(lost), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--keys", type=int, default=20, help="keys of 256 KiB scattered on each worker")
    args = parser.parse_args()
    for label, memops in (("stock", False), ("memops", True)):
        total, lost, seconds = one_run(args.workers, args.keys, memops=memops)
        print(f"{label:7s} kubectl drain: {seconds:6.1f} s, keys lost {lost} of {total}")


if __name__ == "__main__":
    main()
