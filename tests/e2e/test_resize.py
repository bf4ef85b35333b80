"""In-place growth on real Nodes: a worker whose data grows past its container's memory limit.

Stock, the nanny kills the worker at 95% of the limit (Dask's terminate threshold) and the keys
only it held are gone. Under a MemoryPolicy with ``spec.resize`` memops grows the pod's memory
through ``pods/resize`` before that, the kubelet writes the new limit into the container's cgroup,
and memops tells Dask: the same container goes on (restartCount 0, same container ID), nothing is
moved and nothing lost, and the limit Dask reports is the container's new one. Spilling is off on
these workers (as for data that cannot spill: one large object, or no local disk), so memory is
all that holds the data.
"""

from __future__ import annotations

import copy
import os
import time
from typing import Any

import distributed
import pytest
from memops_sandbox import common as sandbox_cli
from memops_sandbox import nodes as real_nodes

from memops.specs.common import parse_quantity
from tests import polling
from tests.e2e.conftest import Sandbox
from tests.e2e.data import Holdings
from tests.e2e.test_real_nodes import cgroup_limit
from tests.e2e.test_recycle import make_leak

MiB = 2**20
LIMIT = 512 * MiB
CHUNK = 16 * MiB


def unspilling_workload(sandbox: Sandbox, name: str) -> None:
    """One worker pod of the sandbox's Dask image, ``LIMIT`` of memory, spilling off."""
    body = copy.deepcopy(
        sandbox_cli.worker_deployment(sandbox.scheduler_address, 1, image=sandbox_cli.DASK_IMAGE, namespace=None)
    )
    body["metadata"]["name"] = body["spec"]["template"]["metadata"]["labels"]["app"] = name
    body["metadata"]["labels"] = body["spec"]["selector"]["matchLabels"] = {"app": name}
    [container] = body["spec"]["template"]["spec"]["containers"]
    container["resources"]["limits"]["memory"] = str(LIMIT)
    container["resources"].setdefault("requests", {})["memory"] = str(LIMIT)
    container["env"] = [
        *container.get("env", []),
        {"name": "DASK_DISTRIBUTED__WORKER__MEMORY__TARGET", "value": "False"},
        {"name": "DASK_DISTRIBUTED__WORKER__MEMORY__SPILL", "value": "False"},
    ]
    sandbox.apply(body)


def only_pod(sandbox: Sandbox, app: str) -> dict[str, Any]:
    [pod] = [p for p in sandbox.get("pods", "-l", f"app={app}")["items"] if not p["metadata"].get("deletionTimestamp")]
    return dict(pod)


def worker_info(client: distributed.Client, name: str) -> dict[str, Any] | None:
    """The scheduler's view of the worker named ``name`` (its address under ``address``)."""
    for address, info in client.scheduler_info(n_workers=-1)["workers"].items():
        if str(info["name"]) == name:
            return {**info, "address": address}
    return None


def fill(client: distributed.Client, holdings: Holdings, pod: str, until: float, ceiling: int) -> None:
    """Scatter ``CHUNK``-sized unique keys onto ``pod``'s worker until Dask sees its process memory
    over ``until`` of its limit, or ``ceiling`` bytes of keys are there, or the worker is gone (killed
    before the fill got there: the caller's assertions on its keys say whether that was allowed)."""
    while sum(len(holdings.values[k]) for k in holdings.keys_of(pod)) < ceiling:
        info = worker_info(client, pod)
        if info is None:
            print(f"{pod}'s worker left during the fill, with {len(holdings.keys_of(pod))} chunks sent")
            return
        if info["metrics"]["memory"] > until * info["memory_limit"]:
            return
        key = f"{pod}-{len(holdings.keys_of(pod))}"
        value = os.urandom(CHUNK)
        scattered = client.scatter({key: value}, workers=[info["address"]], hash=False, broadcast=False)
        holdings.futures[key], holdings.values[key], holdings.owner[key] = scattered[key], value, pod
        # The worker's next heartbeat carries its memory, with this chunk, to the scheduler (its
        # process memory need not grow by the chunk: the allocator may reuse what the transfer
        # freed, so the loop asks again). A heartbeat in flight as the scatter returned is older.
        stored = time.time()
        polling.wait_for(
            lambda stored=stored: (now := worker_info(client, pod)) is None or now["last_seen"] > stored + 0.2,
            timeout=30,
            what=f"{pod}'s heartbeat after the new chunk",
        )


def leak(client: distributed.Client, holdings: Holdings, pod: str, nbytes: int) -> None:
    """Grow ``pod``'s worker process by ``nbytes`` that nothing can move or spill (a library's
    buffers, a task's intermediates), ``CHUNK`` at a time with a heartbeat after each, so that the
    scheduler and the nanny see every step. Stops early when the worker is gone."""
    grow = make_leak()
    for step in range(1, nbytes // CHUNK + 1):
        deadline = time.monotonic() + 60
        while True:
            info = worker_info(client, pod)
            if info is None or holdings.lost():
                return
            try:
                client.run(grow, step * CHUNK, workers=[info["address"]])
                break
            except OSError:  # the worker died before it answered (looked at again), or no answer in time
                if time.monotonic() > deadline:
                    raise
        stored = time.time()
        polling.wait_for(
            lambda stored=stored, address=info["address"]: (
                (now := worker_info(client, pod)) is None
                or now["address"] != address
                or now["last_seen"] > stored + 0.2
            ),
            timeout=30,
            what=f"{pod}'s heartbeat after the leak's step",
        )


@pytest.mark.quiet("it waits on the nanny's 100 ms memory check, as the test below races it")
def test_without_a_policy_the_nanny_kills_the_worker_and_its_keys_are_lost(real_sandbox: Sandbox) -> None:
    sandbox = real_sandbox
    unspilling_workload(sandbox, "stock")
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        client.wait_for_workers(5, timeout=120)
        pod = only_pod(sandbox, "stock")["metadata"]["name"]
        holdings = Holdings(client)
        fill(client, holdings, pod, until=0.76, ceiling=LIMIT)
        # Past the pause threshold a worker takes no more keys; what its process holds besides
        # them goes on growing, past the kill.
        leak(client, holdings, pod, LIMIT // 4)
        sandbox.wait_for(lambda: holdings.lost(), timeout=120, what="the nanny to kill the worker")
        assert set(holdings.lost()) <= set(holdings.keys_of(pod)) and holdings.lost()


@pytest.mark.quiet("it races the nanny's 100 ms memory check: no other namespace starts meanwhile")
def test_a_policy_grows_the_worker_in_place_before_the_nanny_kills_it(real_sandbox: Sandbox) -> None:
    sandbox = real_sandbox
    unspilling_workload(sandbox, "grown")
    policy = {
        "apiVersion": "memops.dev/v1alpha1",
        "kind": "MemoryPolicy",
        "metadata": {"name": "grown"},
        "spec": {
            "scheduler": {"address": "tcp://dask-scheduler:8786"},
            "workload": {"kind": "Deployment", "name": "grown"},
            "resize": {"maxLimit": "2Gi"},
        },
    }
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        client.wait_for_workers(5, timeout=120)
        pod = only_pod(sandbox, "grown")
        name = pod["metadata"]["name"]
        [before] = pod["status"]["containerStatuses"]
        sandbox.apply(policy)
        sandbox.wait_for(
            lambda: any(
                c["type"] == "SchedulerReachable" and c["status"] == "True"
                for c in sandbox.get("mempol", "grown").get("status", {}).get("conditions", [])
            ),
            what="the policy to reach the scheduler",
        )
        holdings = Holdings(client)
        # Over growAbove (75%), under the pause threshold (80%).
        fill(client, holdings, name, until=0.76, ceiling=LIMIT)

        def grown() -> int:
            info = worker_info(client, name)
            return int(info["memory_limit"]) if info is not None and info["memory_limit"] > LIMIT else 0

        try:
            new_limit = sandbox.wait_for(grown, timeout=120, what="Dask to report a grown limit")
        except AssertionError as error:  # what the policy saw and did, and the worker's memory now
            status = sandbox.get("mempol", "grown").get("status", {})
            seen = {k: status.get(k) for k in ("resize", "heldBack", "pressure", "message")}
            info = worker_info(client, name)
            worker = info and info["metrics"]
            raise AssertionError(f"{error}; the policy's status: {seen}; the worker: {worker}") from None
        # Now more than the old limit's worth of keys: the old container would have been killed.
        fill(client, holdings, name, until=0.7, ceiling=LIMIT)
        assert sum(len(v) for v in holdings.values.values()) + 100 * MiB > LIMIT

        pod = only_pod(sandbox, "grown")
        [after] = pod["status"]["containerStatuses"]
        assert (after["containerID"], after["restartCount"]) == (before["containerID"], 0), after
        assert parse_quantity(pod["spec"]["containers"][0]["resources"]["limits"]["memory"]) == new_limit
        assert cgroup_limit(real_nodes.container_pid(after["containerID"])) == new_limit
        assert worker_info(client, name) is not None
        holdings.assert_all_correct()
        status = sandbox.get("mempol", "grown")["status"]
        assert any(w["pod"] == name for w in status["resize"]["workers"]), status["resize"]
        assert not status.get("pressure", {}).get("keysMoved"), "nothing was moved: the worker grew"
