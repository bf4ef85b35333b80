"""In-place growth and the disruption annotations through one real MemoryPolicy pass.

Inputs: the upstream control plane (``plane``: etcd and kube-apiserver with memops' CRDs; no
node runs, so no kubelet answers a resize: what is checked is what memops asks of the API server),
a real Dask scheduler and worker in this process, and the real pass
(:class:`memops.controllers.policy.Policy`), as the admin. The worker's pod is written with its IP
(127.0.0.1, the worker's) as a kubelet would, so that the scheduler is shown to be the namespace's;
its container's memory limit is the worker's Dask limit, set so that the test process' memory is
about 80% of it: over ``growAbove`` (75%), with no peer to take its keys. Kopf's event posting is
switched off (it needs a running operator).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kopf
import psutil
import pytest
from distributed import Client, Scheduler, Worker
from kopf._core.engines import posting

from memops import specs
from memops.clients import kube
from memops.controllers import policy
from memops.decisions import objects

LOGGER = logging.getLogger("test")
POD = "w-5d4f8b7c9-abcde"
Mi = 2**20
STEP = 64 * Mi


@pytest.fixture
def no_events() -> None:
    settings = kopf.OperatorSettings()
    settings.posting.enabled = False
    posting.settings_var.set(settings)


@pytest.fixture
async def namespace(plane: Path, request: pytest.FixtureRequest) -> AsyncIterator[tuple[kube.Kube, str]]:
    kube_client = kube.Kube(kube.load_connection(str(plane / "kubeconfig")))
    name = "t-" + hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:12]
    try:
        await kube_client.request("POST", "/api/v1/namespaces", body={"metadata": {"name": name}})
        yield kube_client, name
    finally:
        with contextlib.suppress(kube.ApiError):  # the Node that start_pod made, if it did
            await kube_client.delete(f"/api/v1/nodes/{name}-node")
        await kube_client.close()


async def start_pod(kube_client: kube.Kube, namespace: str, limit: int) -> str:
    """Deployment ``w`` and its one pod, Guaranteed at ``limit`` bytes of memory, Running at 127.0.0.1
    on a Node object of 8Gi allocatable named after the namespace (the API server refuses a resize of
    a pod whose Node does not exist; no kubelet runs it)."""
    node = f"{namespace}-node"
    await kube_client.request("POST", "/api/v1/nodes", body={"metadata": {"name": node}})
    room = {"memory": "8Gi", "cpu": "4", "pods": "110"}
    await kube_client.merge_patch(f"/api/v1/nodes/{node}/status", {"status": {"capacity": room, "allocatable": room}})
    memory = {"memory": str(limit)}
    container = {"name": "worker", "image": "w.invalid/w:1", "resources": {"limits": memory, "requests": memory}}
    template = {"metadata": {"labels": {"app": "w"}}, "spec": {"containers": [container]}}
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "w", "namespace": namespace},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "w"}}, "template": template},
    }
    await kube_client.request("POST", kube.resource_path("apps", "v1", "deployments", namespace), body=deployment)
    pods = kube.resource_path("", "v1", "pods", namespace)
    pod = {"metadata": {"name": POD, **template["metadata"]}, "spec": {**template["spec"], "nodeName": node}}
    await kube_client.request("POST", pods, body=pod)
    running = {"phase": "Running", "podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}]}
    await kube_client.merge_patch(f"{pods}/{POD}/status", {"status": running})
    return f"{pods}/{POD}"


async def one_pass(kube_client: kube.Kube, namespace: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Create or update the policy, run one pass over it as Kopf hands the daemon its body; its status."""
    path = kube.resource_path(specs.GROUP, specs.VERSION, "memorypolicies", namespace)
    current = await kube_client.get_or_none(f"{path}/p")
    if current is None:
        body = {"apiVersion": specs.API_VERSION, "kind": "MemoryPolicy", "metadata": {"name": "p"}, "spec": spec}
        await kube_client.request("POST", path, body=body)
    stored = kopf.Body(await kube_client.get(f"{path}/p"))
    await policy.Policy(client=kube_client, body=stored, logger=LOGGER).reconcile()
    status: dict[str, Any] = (await kube_client.get(f"{path}/p"))["status"]
    return status


def _spec(address: str, **fields: Any) -> dict[str, Any]:
    return {"scheduler": {"address": address}, "workload": {"kind": "Deployment", "name": "w"}} | fields


@pytest.mark.usefixtures("no_events")
async def test_a_pressed_worker_without_peers_is_grown_through_pods_resize(
    namespace: tuple[kube.Kube, str],
) -> None:
    """The only worker is at about 80% of its limit: relief has no peer to move to, so the pass asks
    the pod's resize subresource for a limit (and, Guaranteed, the same request) that puts its memory
    at 60%: the pod's spec holds it (the API server takes resources through pods/resize only), the pod
    is stamped with the time, and status.resize says Grow, PeersFull. Dask is told only once the
    kubelet reports the new limit applied: written here into the pod's status as a kubelet would,
    the next pass sets the worker's and the scheduler's copies (no nanny runs in this process)."""
    kube_client, ns = namespace
    limit = -(-int(psutil.Process().memory_info().rss / 0.8) // Mi) * Mi
    async with (
        Scheduler(host="127.0.0.1", dashboard_address=":0") as scheduler,
        Worker(scheduler.address, name=POD, nthreads=1, memory_limit=limit, heartbeat_interval="100ms") as worker,
        Client(scheduler.address, asynchronous=True),
    ):
        pod_path = await start_pod(kube_client, ns, limit)
        status = await one_pass(kube_client, ns, _spec(scheduler.address, resize={"maxLimit": "64Gi"}))
        pod = await kube_client.get(pod_path)
        [entry] = status["resize"]["workers"]
        resources = pod["spec"]["containers"][0]["resources"]
        grown = specs.parse_quantity(resources["limits"]["memory"])
        assert (entry["pod"], entry["action"], entry["reason"]) == (POD, "Grow", "PeersFull"), status["resize"]
        assert grown > limit and grown % STEP == 0, (resources, status["resize"]["message"])
        assert specs.parse_quantity(entry["limit"]) == grown
        assert resources["requests"]["memory"] == resources["limits"]["memory"], "a Guaranteed pod stays Guaranteed"
        assert objects.RESIZED_ANNOTATION in pod["metadata"]["annotations"]
        assert status["resize"]["resized"] == 1
        assert scheduler.workers[worker.address].memory_limit == limit, "Dask waits for the kubelet's report"

        # The kubelet applied it (as it reports it in the pod's status): the next pass tells Dask.
        applied = {"limits": resources["limits"], "requests": resources["requests"]}
        report = {"name": "worker", "image": "w.invalid/w:1", "imageID": "", "ready": True, "restartCount": 0}
        report |= {"resources": applied, "allocatedResources": resources["requests"], "state": {"running": {}}}
        await kube_client.request(
            "PATCH",
            f"{pod_path}/status",
            body={"status": {"containerStatuses": [report]}},
            content_type="application/strategic-merge-patch+json",
        )
        status = await one_pass(kube_client, ns, _spec(scheduler.address, resize={"maxLimit": "64Gi"}))
        [entry] = status["resize"]["workers"]
        assert (entry["action"], entry["reason"]) == ("TellDask", "ContainerResized"), status["resize"]
        assert scheduler.workers[worker.address].memory_limit == grown, "the scheduler's copy"
        assert worker.memory_manager.memory_limit == grown, "the worker's copy"


@pytest.mark.usefixtures("no_events")
async def test_a_deferred_growth_falls_back_and_the_status_says_why(namespace: tuple[kube.Kube, str]) -> None:
    """The kubelet deferred the growth (the pod's PodResizePending condition, reason Deferred): with
    no peer to relieve it, the policy asks for one more worker, and status.resize says so and why."""
    kube_client, ns = namespace
    limit = -(-int(psutil.Process().memory_info().rss / 0.8) // Mi) * Mi
    async with (
        Scheduler(host="127.0.0.1", dashboard_address=":0") as scheduler,
        Worker(scheduler.address, name=POD, nthreads=1, memory_limit=limit, heartbeat_interval="100ms"),
        Client(scheduler.address, asynchronous=True),
    ):
        pod_path = await start_pod(kube_client, ns, limit)
        spec = _spec(scheduler.address, resize={"maxLimit": "64Gi"}, replicas=1)
        await one_pass(kube_client, ns, spec)  # asks the growth
        pending = {
            "type": "PodResizePending",
            "status": "True",
            "reason": "Deferred",
            "message": "Node didn't have enough capacity: memory",
            "lastTransitionTime": "2026-01-01T00:00:00Z",
        }
        await kube_client.request(
            "PATCH",
            f"{pod_path}/status",
            body={"status": {"conditions": [pending]}},
            content_type="application/strategic-merge-patch+json",
        )
        status = await one_pass(kube_client, ns, spec)
        deployment = await kube_client.get(kube.resource_path("apps", "v1", "deployments", ns, "w"))
        [entry] = status["resize"]["workers"]
        assert (entry["action"], entry["reason"]) == ("ScaleUp", "ResizeDeferred"), status["resize"]
        assert "deferred" in status["resize"]["message"] and "one more worker" in status["resize"]["message"]
        assert deployment["spec"]["replicas"] == 2


@pytest.mark.usefixtures("no_events")
async def test_a_worker_with_data_found_nowhere_else_is_marked_do_not_disrupt(
    namespace: tuple[kube.Kube, str],
) -> None:
    """Keys scattered to the only worker exist nowhere else: its pod gets Karpenter's and
    cluster-autoscaler's annotations; once they are gone (and the protection is older than its
    minimum), the pass takes both off. Switched off in the spec, nothing is set."""
    kube_client, ns = namespace
    async with (
        Scheduler(host="127.0.0.1", dashboard_address=":0") as scheduler,
        Worker(scheduler.address, name=POD, nthreads=1, heartbeat_interval="100ms") as worker,
        Client(scheduler.address, asynchronous=True) as dask_client,
    ):
        pod_path = await start_pod(kube_client, ns, 8 * 1024 * Mi)
        spec = _spec(scheduler.address)
        data = await dask_client.scatter({f"k{i}": b"k" * 4096 for i in range(3)}, workers=[worker.address])
        await one_pass(kube_client, ns, spec)
        annotations = (await kube_client.get(pod_path))["metadata"]["annotations"]
        assert annotations[objects.DO_NOT_DISRUPT] == "true"
        assert annotations[objects.SAFE_TO_EVICT] == "false"
        # The keys go; the protection was set long enough ago (as the clock would say in 30 s).
        await dask_client.cancel(list(data.values()))
        del data
        old = {"metadata": {"annotations": {objects.PROTECTED_ANNOTATION: "0"}}}
        await kube_client.merge_patch(pod_path, old)
        await one_pass(kube_client, ns, spec)
        annotations = (await kube_client.get(pod_path))["metadata"].get("annotations") or {}
        assert not {objects.DO_NOT_DISRUPT, objects.SAFE_TO_EVICT, objects.PROTECTED_ANNOTATION} & set(annotations)
