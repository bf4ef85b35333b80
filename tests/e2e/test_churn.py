"""A seeded, randomized sequence of scale changes: a plain Deployment loses data, a policy does not.

Every worker holds unique scattered keys, topped up after every step, while tasks run. The same
sequence is applied twice: with ``kubectl scale deployment`` and no memops (the baseline, which
must lose keys, or this test could not see a loss), then through a MemoryPolicy, rotating
through ``kubectl scale mempol``, ``spec.replicas`` edits and direct scale-downs of the
Deployment around memops (drained by the safety net). ``bench/churn.py`` is the larger version.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Callable
from typing import Any

import distributed
import pytest

from tests.e2e.conftest import Sandbox

SEED = 4  # [2, 3, 1]: down through the policy, up by an edit, down around memops
WORKERS = 4
KEYS = 3
SIZE = 64 * 1024


def sequence() -> list[int]:
    rng = random.Random(SEED)
    steps = [rng.randint(1, WORKERS) for _ in range(3)]
    assert min(steps) < WORKERS, "the seed must give at least one scale-down"
    return steps


def work(i: int) -> int:
    time.sleep(0.05)
    return i


def settle(sandbox: Sandbox, client: distributed.Client, replicas: int) -> None:
    def settled() -> bool:
        requests = sandbox.get("retire")["items"]
        busy = [r for r in requests if r.get("status", {}).get("phase") not in ("Succeeded", "Failed")]
        workers = client.scheduler_info(n_workers=-1)["workers"]
        return len(sandbox.pods()) == replicas and len(workers) == replicas and not busy

    sandbox.wait_for(settled, timeout=120, what=f"{replicas} connected workers and no drain running")


def top_up(client: distributed.Client, futures: dict[str, distributed.Future], tag: str) -> None:
    for address in client.scheduler_info(n_workers=-1)["workers"]:
        values = {f"{tag}-{address}-{i}": os.urandom(SIZE) for i in range(KEYS)}
        try:
            futures.update(client.scatter(values, workers=[address], hash=False))
        except KeyError:
            continue  # the worker left between the listing and the scatter


def lost(client: distributed.Client, futures: dict[str, distributed.Future]) -> int:
    who_has: dict[str, Any] = client.sync(client.scheduler.who_has, keys=list(futures))
    return sum(1 for holders in who_has.values() if not holders)


def churn(sandbox: Sandbox, *, through_policy: bool) -> tuple[int, int]:
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        futures: dict[str, distributed.Future] = {}
        if through_policy:
            sandbox.apply(
                {
                    "apiVersion": "memops.dev/v1alpha1",
                    "kind": "MemoryPolicy",
                    "metadata": {"name": "churn"},
                    "spec": {
                        "scheduler": {"address": sandbox.scheduler_address},
                        "workload": {"kind": "Deployment", "name": "dask-worker"},
                        "replicas": WORKERS,
                        "drain": {"timeout": "2m"},
                    },
                }
            )
            # The first pods predate the policy: replace them while they hold nothing, so every
            # worker pod has the safety net that the direct scale-downs rely on.
            sandbox.kubectl("scale", "deployment/dask-worker", "--replicas=0")
            settle(sandbox, client, WORKERS)
        top_up(client, futures, "start")
        desired = WORKERS
        for step, replicas in enumerate(sequence()):
            running = client.map(work, range(20), key=[f"work-{step}-{i}" for i in range(20)])
            if not through_policy:
                sandbox.kubectl("scale", "deployment/dask-worker", f"--replicas={replicas}")
                desired = replicas
            elif step % 3 == 0:
                sandbox.kubectl("scale", "mempol/churn", f"--replicas={replicas}")
                desired = replicas
            elif step % 3 == 1:
                sandbox.kubectl(
                    "patch", "mempol/churn", "--type=merge", "-p", json.dumps({"spec": {"replicas": replicas}})
                )
                desired = replicas
            else:
                direct = max(min(replicas, desired - 1), 1)
                sandbox.kubectl("scale", "deployment/dask-worker", f"--replicas={direct}")
            settle(sandbox, client, desired)
            distributed.wait(running, timeout=120)
            top_up(client, futures, f"step{step}")
        return lost(client, futures), len(futures)


@pytest.mark.parametrize("through_policy", [False, True], ids=["baseline-deployment", "memorypolicy"])
def test_randomized_scale_changes(sandbox_factory: Callable[..., Sandbox], through_policy: bool) -> None:
    sandbox = sandbox_factory(WORKERS)
    missing, total = churn(sandbox, through_policy=through_policy)
    print(f"{'memops' if through_policy else 'baseline'}: sequence {sequence()}, {missing} of {total} keys lost")
    if through_policy:
        assert missing == 0
    else:
        assert missing > 0, "the baseline must lose keys, or this test could not see a loss"
