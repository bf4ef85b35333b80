"""What memops reports of a worker that the kernel's OOM killer took, under a MemoryPolicy, on real Nodes.

The worker's container has a real memory limit, and Dask's own memory management is off
(``--memory-limit 0``, no nanny), so the kernel kills it when its data grows past the limit; the
keys that only it held go with it. memops did not drain it: its agent in the scheduler records the
departure, and the policy's pass reports it: ``status.workerLosses`` (the pod, ``OOMKilled``, the
keys and bytes lost), a ``WorkerLost`` Warning on the policy, and the
``memops_worker_losses_total`` and ``memops_worker_lost_bytes_total`` metrics, once each.
The workers are not named after their pods (the Dask Helm chart's arguments): memops finds the
pod by the IP in the worker's address.
"""

from __future__ import annotations

import copy
from typing import Any

import distributed
from memops_sandbox import common as sandbox_cli

from memops.decisions import snapshots
from tests import polling
from tests.e2e import windows
from tests.e2e.conftest import Sandbox
from tests.e2e.data import Holdings
from tests.e2e.test_metrics import scrape, value
from tests.e2e.test_policy import condition, memory_policy

MiB = 2**20
KEYS = 4


def tight_workload(scheduler_address: str) -> dict[str, Any]:
    """One worker pod of 192 MiB that the kernel kills when its data grows past that, not named after its pod."""
    body = copy.deepcopy(sandbox_cli.worker_deployment(scheduler_address, 1, namespace=None))
    body["metadata"]["name"] = body["spec"]["template"]["metadata"]["labels"]["app"] = "tight"
    body["metadata"]["labels"] = body["spec"]["selector"]["matchLabels"] = {"app": "tight"}
    [container] = body["spec"]["template"]["spec"]["containers"]
    args = list(container["args"])
    if "--name" in args:  # as the Dask Helm chart's workers: named by Dask, not after the pod
        del args[args.index("--name") : args.index("--name") + 2]
    args[args.index("--memory-limit") + 1] = "0"
    container["args"] = [*args, "--no-nanny"]
    container["resources"] = {"limits": {"memory": str(192 * MiB)}}
    return body


def test_a_worker_oom_killed_under_a_policy_is_reported_once(real_sandbox: Sandbox) -> None:
    sandbox = real_sandbox
    sandbox.apply(tight_workload(sandbox.scheduler_address))
    sandbox.apply(memory_policy("tight", sandbox.scheduler_address, workload="tight"))
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        client.wait_for_workers(5, timeout=120)
        [pod] = sandbox.get("pods", "-l", "app=tight")["items"]
        name, ip = pod["metadata"]["name"], snapshots.canonical_ip(pod["status"]["podIP"])
        # The policy's pass reached the scheduler, and installed memops' agent there: it records
        # departures from then on.
        sandbox.wait_for(
            lambda: (c := condition(sandbox, "tight", "SchedulerReachable")) and c["status"] == "True",
            what="the policy to reach the scheduler",
        )
        before = scrape(sandbox)
        [address] = [a for a in client.scheduler_info(n_workers=-1)["workers"] if snapshots.address_host(a) == ip]
        holdings = Holdings(client)
        values = {f"{name}-{i}": bytes([i]) * MiB for i in range(KEYS)}
        futures = client.scatter(values, workers=[address], hash=False, broadcast=False)
        holdings.futures.update(futures)
        holdings.values.update(values)
        holdings.owner.update(dict.fromkeys(values, name))

        def grow(size: int) -> int:
            import numpy as np  # a buffer of touched pages: counted by the kernel at once

            return int(np.ones(size, dtype=np.uint8).sum())

        client.submit(grow, 256 * MiB, workers=[address], pure=False)

        def last_state() -> dict[str, Any] | None:
            [status] = sandbox.get("pod", name)["status"]["containerStatuses"]
            found: dict[str, Any] | None = status.get("lastState", {}).get("terminated")
            return found

        killed = sandbox.wait_for(last_state, what=f"{name}'s container OOM-killed")
        assert killed["reason"] == "OOMKilled", killed
        sandbox.wait_for(lambda: sorted(holdings.lost()) == sorted(values), what="its keys gone with it")

        def recorded() -> list[dict[str, Any]]:
            found: list[dict[str, Any]] = sandbox.get("mempol", "tight").get("status", {}).get("workerLosses", [])
            return found

        try:
            [loss] = sandbox.wait_for(recorded, timeout=120, what="the loss in the policy's status")
        except AssertionError:
            print(sandbox.operator_log()[-5000:])
            raise
    assert loss["pod"] == name and loss["reason"] == "OOMKilled", loss
    assert (loss["keys"], loss["irreplaceableKeys"]) == (KEYS, KEYS), loss  # scattered: none can be recomputed
    assert loss["bytes"] >= KEYS * MiB, loss

    def said() -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = sandbox.get(
            "events", "--field-selector", "reason=WorkerLost,involvedObject.name=tight"
        )["items"]
        return found

    # Kopf posts an event from a queue of its own, a moment after the status write that holds the
    # loss (CI once read the events before it had).
    events = sandbox.wait_for(said, timeout=30, what="the WorkerLost event")
    assert len(events) == 1 and name in events[0]["message"] and "OOMKilled" in events[0]["message"], events
    after = scrape(sandbox)
    labels = {"namespace": sandbox.namespace, "policy": "tight", "reason": "OOMKilled"}
    assert (
        value(after, "memops_worker_losses_total", **labels)
        == value(before, "memops_worker_losses_total", **labels) + 1
    )
    lost_bytes = value(after, "memops_worker_lost_bytes_total", **labels)
    assert lost_bytes == value(before, "memops_worker_lost_bytes_total", **labels) + loss["bytes"]
    # Once: the passes to come (each reads the agent's departures again) add nothing.
    polling.stays(
        lambda: (
            recorded() == [loss]
            and value(scrape(sandbox), "memops_worker_losses_total", **labels)
            == value(after, "memops_worker_losses_total", **labels)
            and len(sandbox.get("events", "--field-selector", "reason=WorkerLost,involvedObject.name=tight")["items"])
            == 1
        ),
        seconds=windows.POLICY_PASS,
        what="the loss recorded, counted and said once",
    )
