"""A preemption on the upstream control plane: a node's worker pods deleted with a 25 s grace period.

Side by side in one run, three sandboxes (the real kube-apiserver, two Nodes of the node agent,
four ``dask worker`` pods spread two per node), the same data and the same deletion:
``kubectl delete pod <the node's workers> --grace-period=25``, while each holds SIZE of
scattered data (unique: it cannot be recomputed). The node agent runs the preStop hook within
the deletion's grace, then SIGTERM, then SIGKILL when the 25 s are up, as the kubelet does.

- memops: a MemoryPolicy (``drain.timeout: 2m``); its safety net gives the pods a preStop hook
  that asks memops' agent in the scheduler for a drain by value, off the dying node;
- stock: no memops; the Deployment has the preStop hook users write for Dask (a ``Client`` that
  calls ``retire_workers`` on its own worker's name);
- nothing: no memops, no hook: SIGTERM at once (``dask worker`` closes without draining).

Printed: GiB of the node's data still held by the surviving workers once the node's workers
are gone (saved within the window), keys lost, and when the last of them left the scheduler.

    python bench/preemption_plane.py                 # 1 GiB per worker, as in docs/performance.md
    python bench/preemption_plane.py --size-mib 64   # the small pass CI runs
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import benchkit
import distributed
from memops_sandbox import dask_direct

MIB = 2**20
GIB = 2**30
GRACE = 25
MODES = ("memops", "stock", "nothing")

STOCK_HOOK = """
import os, distributed
with distributed.Client(os.environ["DASK_SCHEDULER_ADDRESS"], timeout=10) as client:
    client.retire_workers(names=[os.environ["POD_NAME"]], close_workers=True)
"""
"""The preStop hook that Dask's documentation leads users to: retire this worker by name."""


def pod_patch(mode: str) -> dict[str, Any]:
    """Besides the spread over the nodes: in stock mode the stock hook, with a grace period long
    enough for it (the deletion's 25 s override it)."""
    if mode != "stock":
        return {}
    return {
        "terminationGracePeriodSeconds": 150,
        "containers": [
            {"name": "worker", "lifecycle": {"preStop": {"exec": {"command": ["python", "-c", STOCK_HOOK]}}}}
        ],
    }


@dataclass(frozen=True)
class Outcome:
    mode: str
    saved: int  # bytes of the node's data held by a surviving worker afterwards
    total: int
    lost_keys: int
    seconds: float  # the deletion -> the last of the node's workers left the scheduler
    drain: str = ""  # memops: what its drain reported for the node's workers


def get(sandbox: benchkit.Sandbox, *what: str) -> Any:
    return json.loads(benchkit.kubectl(sandbox.env, "get", *what, "-o", "json"))


def placement(sandbox: benchkit.Sandbox) -> dict[str, str]:
    """Running, undeleted worker pod -> its node."""
    return {
        p["metadata"]["name"]: p["spec"]["nodeName"]
        for p in get(sandbox, "pods", "-l", "app=dask-worker")["items"]
        if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
    }


def wait(predicate: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := predicate():
            return found
        time.sleep(0.5)
    raise RuntimeError(f"timed out waiting for {what}")


def ready(sandbox: benchkit.Sandbox) -> bool:
    conditions = get(sandbox, "memorypolicy", "preemption").get("status", {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def prepare(sandbox: benchkit.Sandbox, client: distributed.Client, mode: str) -> dict[str, str]:
    """The policy (memops), then a rollout to the patched template: pods created after the policy
    get its safety net. Returns the workers' placement once four run, two per node."""
    if mode == "memops":
        benchkit.apply_policy(sandbox, "preemption", drain={"timeout": "2m"})
        wait(lambda: ready(sandbox), 120, "the policy to be Ready")
    # Two workers per node: the scheduler's spreading as a rule.
    benchkit.spread_over_nodes(sandbox, **pod_patch(mode))

    def settled() -> dict[str, str] | None:
        placed = placement(sandbox)
        pods = get(sandbox, "pods", "-l", "app=dask-worker")["items"]
        hooked = all(
            ("preStop" in (p["spec"]["containers"][0].get("lifecycle") or {})) == (mode != "nothing") for p in pods
        )
        counts = sorted(list(placed.values()).count(n) for n in set(placed.values()))
        names = set(benchkit.workers(client))
        return placed if len(pods) == 4 and hooked and counts == [2, 2] and names == set(placed) else None

    return dict(wait(settled, 300, "four workers, two per node"))


def scatter(client: distributed.Client, names: Sequence[str], size: int, key: int) -> list[distributed.Future]:
    addresses = benchkit.workers(client)
    futures: list[distributed.Future] = []
    for name in names:
        base = os.urandom(key)
        count = max(size // key, 1)
        for first in range(0, count, 16):
            batch = {f"{name}-{i}": base[:-8] + i.to_bytes(8, "little") for i in range(first, min(first + 16, count))}
            futures += client.scatter(batch, workers=[addresses[name]], hash=False).values()
    return futures


def preempt(sandbox: benchkit.Sandbox, client: distributed.Client, pods: Sequence[str], mode: str) -> float:
    """``kubectl delete pod --grace-period=25`` of ``pods``; seconds until their workers left."""
    dying = {benchkit.workers(client)[p] for p in pods}
    began = time.monotonic()
    benchkit.kubectl(sandbox.env, "delete", "pod", *pods, f"--grace-period={GRACE}", "--wait=false")
    while time.monotonic() - began < GRACE + 30:
        if not dying & set(client.scheduler_info(n_workers=-1)["workers"]):
            break
        time.sleep(0.1)
    return time.monotonic() - began


def one_run(mode: str, size_mib: int) -> Outcome:
    size = size_mib * MIB
    key = min(8 * MIB, max(size // 8, MIB))
    # Room on a surviving worker for its own share of both dying workers' data, and then some.
    memory = f"{2 * size_mib + 768}MiB"
    args = ["--nodes", "2", "--worker-memory", memory]
    with benchkit.running_sandbox(4, *args, *([] if mode == "memops" else ["--no-operator"])) as sandbox:
        with distributed.Client(sandbox.address, timeout=30) as client:
            placed = prepare(sandbox, client, mode)
            node = sorted(set(placed.values()))[0]
            pods = sorted(p for p, n in placed.items() if n == node)
            futures = scatter(client, pods, size, key)
            seconds = preempt(sandbox, client, pods, mode)
            who_has = client.sync(client.scheduler.who_has, keys=[f.key for f in futures])
            held = [k for k, holders in who_has.items() if holders]
            report = ""
            if mode == "memops":
                states = asyncio.run(dask_direct.drain_status(sandbox.address))
                report = "; ".join(
                    f"{s.get('state')} moved {s.get('keysMoved')} lost {(s.get('lostAtDeadline') or {}).get('keys', 0)}"
                    for s in states.values()
                )
            return Outcome(mode, len(held) * key, len(futures) * key, len(futures) - len(held), seconds, report)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024, help="data on each preempted worker")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    args = parser.parse_args(argv)
    results = []
    for mode in args.modes:
        results.append(one_run(mode, args.size_mib))
        print(results[-1], flush=True)
    print(
        f"\nPreemption on the upstream plane: kubectl delete pod --grace-period={GRACE} of one node's"
        f" 2 workers, {args.size_mib} MiB each\n"
    )
    print("| preStop | GiB saved | of GiB | keys lost | last worker left, s |")
    print("| --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r.mode} | {r.saved / GIB:.2f} | {r.total / GIB:.2f} | {r.lost_keys} | {r.seconds:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
