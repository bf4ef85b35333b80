"""Keys lost and tasks recomputed under a seeded sequence of scale changes: a plain Deployment
against a MemoryPolicy.

Every worker holds unique, unrecomputable (scattered) data and persisted results (recomputable,
at a cost), and a computation runs across every scale change. The same seeded sequence of
replica counts is applied twice, in the same run: once with ``kubectl scale deployment`` (the
anchor: what an HPA or a person does today), once through the policy, rotating through
``kubectl scale mempol``, edits of ``spec.replicas`` (what a GitOps commit does) and direct
``kubectl scale deployment`` around memops (drained by the safety net's preStop hook, then
restored to the policy's count). After
each step the data is topped up on every worker, and at the end the keys that no worker
holds any more are counted, and the persisted results that the scheduler had to compute again.

    python bench/churn.py --workers 8                 # the figure in docs/performance.md
    python bench/churn.py --workers 4 --steps 3       # the small pass CI runs
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import benchkit
import distributed
from memops_sandbox import common as sandbox

KEYS_PER_WORKER = 5
SIZE = 256 * 1024
PERSISTED_PER_WORKER = 4


def block(i: int) -> bytes:
    return os.urandom(SIZE) + i.to_bytes(4, "big")


def work(i: int) -> int:
    time.sleep(0.05)  # a task that takes a moment, so some are always running when workers go
    return i


def settle(client: distributed.Client, env: dict[str, str], replicas: int) -> None:
    """Wait until the Deployment runs ``replicas`` pods, all with a connected worker, and no drain runs."""
    deadline = time.monotonic() + 60 + sandbox.start_allowance(replicas)  # new pods start their workers meanwhile
    while time.monotonic() < deadline:
        pods = [
            p
            # The workers' pods (on real Nodes the Dask scheduler is a pod too).
            for p in json.loads(benchkit.kubectl(env, "get", "pods", "-l", "app=dask-worker", "-o", "json"))["items"]
            if not p["metadata"].get("deletionTimestamp")
        ]
        requests = json.loads(benchkit.kubectl(env, "get", "retire", "-o", "json"))["items"]
        busy = [r for r in requests if r.get("status", {}).get("phase") not in ("Succeeded", "Failed")]
        workers = client.scheduler_info(n_workers=-1)["workers"]
        if len(pods) == replicas and len(workers) == replicas and not busy:
            return
        time.sleep(0.3)
    raise RuntimeError(f"the cluster did not settle at {replicas} workers")


def top_up(client: distributed.Client, futures: dict[str, distributed.Future], tag: str) -> None:
    for address in client.scheduler_info(n_workers=-1)["workers"]:
        values = {f"{tag}-{address}-{i}": os.urandom(SIZE) for i in range(KEYS_PER_WORKER)}
        try:
            futures.update(client.scatter(values, workers=[address], hash=False))
        except KeyError:
            continue  # the worker left between the listing and the scatter: nothing was placed


def lost(client: distributed.Client, futures: dict[str, distributed.Future]) -> int:
    who_has = client.sync(client.scheduler.who_has, keys=list(futures))
    return sum(1 for holders in who_has.values() if not holders)


def run(workers: int, sequence: list[int], *, through_policy: bool) -> tuple[int, int, int]:
    with benchkit.running_sandbox(workers) as box:
        env, address = box.env, box.address
        with distributed.Client(address, timeout=30) as client:
            futures: dict[str, distributed.Future] = {}
            if through_policy:
                benchkit.apply_policy(box, "churn", replicas=workers, drain={"timeout": "2m"})
                # The sandbox's first pods predate the policy: replace them (they hold nothing yet),
                # so that every worker pod carries the safety net that direct scale-downs rely on.
                benchkit.kubectl(env, "scale", "deployment/dask-worker", "--replicas=0")
                settle(client, env, workers)
            top_up(client, futures, "start")
            count = PERSISTED_PER_WORKER * workers
            benchkit.count_computations(client, "persisted-")
            persisted = client.map(block, range(count), key=[f"persisted-{i}" for i in range(count)])
            distributed.wait(persisted)
            desired = workers
            for step, replicas in enumerate(sequence):
                running = client.map(work, range(40), key=[f"work-{step}-{i}" for i in range(40)])
                if not through_policy:
                    benchkit.kubectl(env, "scale", "deployment/dask-worker", f"--replicas={replicas}")
                    desired = replicas
                elif step % 3 == 0:
                    benchkit.kubectl(env, "scale", "mempol/churn", f"--replicas={replicas}")
                    desired = replicas
                elif step % 3 == 1:
                    patch = json.dumps({"spec": {"replicas": replicas}})
                    benchkit.kubectl(env, "patch", "mempol/churn", "--type=merge", "-p", patch)
                    desired = replicas
                else:
                    # Around memops, and always down: the preStop hook drains the removed pods,
                    # then the policy restores its own count.
                    direct = max(min(replicas, desired - 1), 1)
                    benchkit.kubectl(env, "scale", "deployment/dask-worker", f"--replicas={direct}")
                settle(client, env, desired)
                distributed.wait(running, timeout=120)
                top_up(client, futures, f"step{step}")
            distributed.wait(persisted, timeout=120)
            return lost(client, futures), len(futures), benchkit.recomputed(client)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    sequence = [rng.randint(max(args.workers // 4, 1), args.workers) for _ in range(args.steps)]
    baseline = run(args.workers, sequence, through_policy=False)
    memops = run(args.workers, sequence, through_policy=True)
    print(
        f"\nScale sequence {sequence} from {args.workers} workers (seed {args.seed}); {KEYS_PER_WORKER} unique"
        f" scattered keys per worker after every step, {PERSISTED_PER_WORKER * args.workers} persisted results,"
        " 40 tasks running across each step\n"
    )
    print(f"{'path':42} {'keys lost':>10} {'of':>6} {'persisted recomputed':>21}")
    for label, (lost_keys, total, again) in (
        ("kubectl scale deployment (anchor)", baseline),
        ("MemoryPolicy (scale / spec edit / direct)", memops),
    ):
        print(f"{label:42} {lost_keys:>10} {total:>6} {again:>21}")
    return 0 if memops[0] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
