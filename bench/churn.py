"""Keys lost under a seeded sequence of scale changes: a plain Deployment against a MemoryPolicy.

Every worker holds unique, unrecomputable (scattered) data. The same seeded sequence of
replica counts is applied twice, in the same run: once with ``kubectl scale deployment`` (the
anchor: what an HPA or a person does today), once through the policy, rotating through
``kubectl scale mempol``, edits of ``spec.replicas`` (what a GitOps commit does) and direct
``kubectl scale deployment`` around memops (drained by the safety net's preStop hook, then
restored to the policy's count). After
each step the data is topped up on every worker, and at the end the keys that no worker
holds any more are counted.

    python bench/churn.py --workers 8                 # the figure in the README
    python bench/churn.py --workers 4 --steps 3       # the small pass CI runs
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import distributed
import yaml

from memops import sandbox

KEYS_PER_WORKER = 5
SIZE = 256 * 1024


def kubectl(env: dict[str, str], *args: str, stdin: str | None = None) -> str:
    kubectl_bin = str(Path(sys.executable).parent / "kubectl")
    return subprocess.run([kubectl_bin, *args], input=stdin, env=env, check=True, capture_output=True, text=True).stdout


def settle(client: distributed.Client, env: dict[str, str], replicas: int, timeout: float = 180) -> None:
    """Wait until the Deployment runs ``replicas`` pods, all with a connected worker, and no drain runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pods = [
            p
            for p in json.loads(kubectl(env, "get", "pods", "-o", "json"))["items"]
            if not p["metadata"].get("deletionTimestamp")
        ]
        requests = json.loads(kubectl(env, "get", "retire", "-o", "json"))["items"]
        busy = [r for r in requests if r.get("status", {}).get("phase") not in ("Succeeded", "Failed")]
        workers = client.scheduler_info(n_workers=-1)["workers"]
        if len(pods) == replicas and len(workers) == replicas and not busy:
            return
        time.sleep(0.3)
    raise RuntimeError(f"the cluster did not settle at {replicas} workers")


def top_up(client: distributed.Client, futures: dict[str, distributed.Future], tag: str) -> None:
    for address in client.scheduler_info(n_workers=-1)["workers"]:
        values = {f"{tag}-{address}-{i}": os.urandom(SIZE) for i in range(KEYS_PER_WORKER)}
        futures.update(client.scatter(values, workers=[address], hash=False))


def lost(client: distributed.Client, futures: dict[str, distributed.Future]) -> int:
    who_has = client.sync(client.scheduler.who_has, keys=list(futures))
    return sum(1 for holders in who_has.values() if not holders)


def run(workers: int, sequence: list[int], *, through_policy: bool) -> tuple[int, int]:
    state = Path(tempfile.mkdtemp(prefix="memops-churn-")) / "sandbox"
    process = sandbox.launch(state, workers)
    try:
        env = {**os.environ, "KUBECONFIG": str(state / "kubeconfig"), "KUBECACHEDIR": str(state / "kubecache")}
        address = (state / "scheduler-address").read_text().strip()
        with distributed.Client(address, timeout=30) as client:
            futures: dict[str, distributed.Future] = {}
            if through_policy:
                policy = {
                    "apiVersion": "memops.dev/v1alpha1",
                    "kind": "MemoryPolicy",
                    "metadata": {"name": "churn", "namespace": "default"},
                    "spec": {
                        "scheduler": {"address": address},
                        "workload": {"kind": "Deployment", "name": "dask-worker"},
                        "replicas": workers,
                        "drain": {"timeout": "2m"},
                    },
                }
                kubectl(env, "apply", "-f", "-", stdin=yaml.safe_dump(policy))
                # The sandbox's first pods predate the policy: replace them (they hold nothing yet),
                # so that every worker pod carries the safety net that direct scale-downs rely on.
                kubectl(env, "scale", "deployment/dask-worker", "--replicas=0")
                settle(client, env, workers)
            top_up(client, futures, "start")
            desired = workers
            for step, replicas in enumerate(sequence):
                if not through_policy:
                    kubectl(env, "scale", "deployment/dask-worker", f"--replicas={replicas}")
                    desired = replicas
                elif step % 3 == 0:
                    kubectl(env, "scale", "mempol/churn", f"--replicas={replicas}")
                    desired = replicas
                elif step % 3 == 1:
                    patch = json.dumps({"spec": {"replicas": replicas}})
                    kubectl(env, "patch", "mempol/churn", "--type=merge", "-p", patch)
                    desired = replicas
                else:
                    # Around memops, and always down: the preStop hook drains the removed pods,
                    # then the policy restores its own count.
                    direct = max(min(replicas, desired - 1), 1)
                    kubectl(env, "scale", "deployment/dask-worker", f"--replicas={direct}")
                settle(client, env, desired)
                top_up(client, futures, f"step{step}")
            return lost(client, futures), len(futures)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    sequence = [rng.randint(max(args.workers // 4, 1), args.workers) for _ in range(args.steps)]
    baseline_lost, baseline_total = run(args.workers, sequence, through_policy=False)
    memops_lost, memops_total = run(args.workers, sequence, through_policy=True)
    print(
        f"\nScale sequence {sequence} from {args.workers} workers (seed {args.seed}); {KEYS_PER_WORKER} unique"
        " scattered keys per worker after every step\n"
    )
    print(f"{'path':40} {'keys lost':>10} {'of':>6}")
    print(f"{'kubectl scale deployment (anchor)':40} {baseline_lost:>10} {baseline_total:>6}")
    print(f"{'MemoryPolicy (scale / spec edit / direct)':40} {memops_lost:>10} {memops_total:>6}")
    return 0 if memops_lost == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
