"""In-place growth and the disruption annotations through one real MemoryPolicy pass.

Inputs: the upstream control plane (``plane``: etcd and kube-apiserver with memops' CRDs; no
node runs, so no kubelet answers a resize: what is checked is what memops asks of the API server),
a real Dask scheduler and worker in this process, and the real pass
(:class:`memops.controllers.policy.Policy`), as the admin. The worker's pod is written with its IP
(127.0.0.1, the worker's) as a kubelet would, so that the scheduler is shown to be the namespace's;
its container's memory limit is the worker's Dask limit, set so that the test process' memory is
about 80% of it: over ``growAbove`` (75%), with no peer to take its keys. Kopf's event posting is
switched off (it needs a running operator). The administrator allows growth in every namespace
(``memops run --resize-in '*'``) unless a test says otherwise.
"""

from __future__ import annotations

import contextlib
import datetime
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
from memops.decisions import objects, resize_decisions

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


def everywhere() -> dict[str, Any]:
    """``memops run --resize-in '*'`` (and the default ceiling, 64Gi)."""
    return {"growth": resize_decisions.administrator("64Gi", [], ["*"])}


async def one_pass(kube_client: kube.Kube, namespace: str, spec: dict[str, Any], **admin: Any) -> dict[str, Any]:
    """Create or update the policy, run one pass over it as Kopf hands the daemon its body; its status.
    ``admin``: the operator's flags (``growth``), as ``memops run`` hands them to the daemon."""
    path = kube.resource_path(specs.GROUP, specs.VERSION, "memorypolicies", namespace)
    current = await kube_client.get_or_none(f"{path}/p")
    if current is None:
        body = {"apiVersion": specs.API_VERSION, "kind": "MemoryPolicy", "metadata": {"name": "p"}, "spec": spec}
        await kube_client.request("POST", path, body=body)
    stored = kopf.Body(await kube_client.get(f"{path}/p"))
    await policy.Policy(client=kube_client, body=stored, logger=LOGGER, **admin).reconcile()
    status: dict[str, Any] = (await kube_client.get(f"{path}/p"))["status"]
    return status


def pressed_limit() -> int:
    """A memory limit that puts this process (the worker's) at about 80% of it."""
    return -(-int(psutil.Process().memory_info().rss / 0.8) // Mi) * Mi


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
    limit = pressed_limit()
    async with (
        Scheduler(host="127.0.0.1", dashboard_address=":0") as scheduler,
        Worker(scheduler.address, name=POD, nthreads=1, memory_limit=limit, heartbeat_interval="100ms") as worker,
        Client(scheduler.address, asynchronous=True),
    ):
        pod_path = await start_pod(kube_client, ns, limit)
        status = await one_pass(kube_client, ns, _spec(scheduler.address, resize={"maxLimit": "64Gi"}), **everywhere())
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
        status = await one_pass(kube_client, ns, _spec(scheduler.address, resize={"maxLimit": "64Gi"}), **everywhere())
        [entry] = status["resize"]["workers"]
        assert (entry["action"], entry["reason"]) == ("TellDask", "ContainerResized"), status["resize"]
        assert scheduler.workers[worker.address].memory_limit == grown, "the scheduler's copy"
        assert worker.memory_manager.memory_limit == grown, "the worker's copy"


async def report_applied(kube_client: kube.Kube, pod_path: str, limit: int) -> None:
    """The worker container's status as the kubelet reports it: ``limit`` applied and allocated."""
    memory = {"memory": str(limit)}
    report = {"name": "worker", "image": "w.invalid/w:1", "imageID": "", "ready": True, "restartCount": 0}
    report |= {"resources": {"limits": memory, "requests": memory}, "allocatedResources": memory}
    report |= {"state": {"running": {}}}
    await kube_client.request(
        "PATCH",
        f"{pod_path}/status",
        body={"status": {"containerStatuses": [report]}},
        content_type="application/strategic-merge-patch+json",
    )


async def defer(kube_client: kube.Kube, pod_path: str, seconds_ago: float) -> None:
    """The kubelet's PodResizePending condition, reason Deferred, set ``seconds_ago``."""
    when = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=seconds_ago)
    pending = {
        "type": "PodResizePending",
        "status": "True",
        "reason": "Deferred",
        "message": "Node didn't have enough capacity: memory",
        "lastTransitionTime": when.strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    await kube_client.request(
        "PATCH",
        f"{pod_path}/status",
        body={"status": {"conditions": [pending]}},
        content_type="application/strategic-merge-patch+json",
    )


@pytest.mark.usefixtures("no_events")
async def test_a_deferred_growth_falls_back_and_is_taken_back_past_the_bound(namespace: tuple[kube.Kube, str]) -> None:
    """The kubelet deferred the growth (the pod's PodResizePending condition, reason Deferred): with
    no peer to relieve it, the policy asks for one more worker, and status.resize says so and why.
    Deferred for more than 2 minutes, the ask is taken back through pods/resize: the pod's spec is
    again what the kubelet allocated, so the scheduler no longer counts the larger request on the
    node; the status says so, and one more worker still takes the excess."""
    kube_client, ns = namespace
    limit = pressed_limit()
    async with (
        Scheduler(host="127.0.0.1", dashboard_address=":0") as scheduler,
        Worker(scheduler.address, name=POD, nthreads=1, memory_limit=limit, heartbeat_interval="100ms"),
        Client(scheduler.address, asynchronous=True),
    ):
        pod_path = await start_pod(kube_client, ns, limit)
        await report_applied(kube_client, pod_path, limit)
        spec = _spec(scheduler.address, resize={"maxLimit": "64Gi"}, replicas=1)
        await one_pass(kube_client, ns, spec, **everywhere())  # asks the growth
        asked = (await kube_client.get(pod_path))["spec"]["containers"][0]["resources"]
        assert specs.parse_quantity(asked["limits"]["memory"]) > limit
        await defer(kube_client, pod_path, 5)
        status = await one_pass(kube_client, ns, spec, **everywhere())
        deployment = await kube_client.get(kube.resource_path("apps", "v1", "deployments", ns, "w"))
        [entry] = status["resize"]["workers"]
        assert (entry["action"], entry["reason"]) == ("ScaleUp", "ResizeDeferred"), status["resize"]
        assert "deferred" in status["resize"]["message"] and "one more worker" in status["resize"]["message"]
        assert deployment["spec"]["replicas"] == 2
        assert (await kube_client.get(pod_path))["spec"]["containers"][0]["resources"] == asked, "left to the kubelet"

        await defer(kube_client, pod_path, 180)
        status = await one_pass(kube_client, ns, spec, **everywhere())
        [entry] = status["resize"]["workers"]
        assert (entry["action"], entry["reason"]) == ("ScaleUp", "ResizeDeferredTooLong"), status["resize"]
        assert "took it back" in status["resize"]["message"]
        resources = (await kube_client.get(pod_path))["spec"]["containers"][0]["resources"]
        taken_back = {kind: specs.parse_quantity(resources[kind]["memory"]) for kind in ("limits", "requests")}
        assert taken_back == {"limits": limit, "requests": limit}, "taken back to what the kubelet allocated"
        deployment = await kube_client.get(kube.resource_path("apps", "v1", "deployments", ns, "w"))
        assert deployment["spec"]["replicas"] == 2


@pytest.mark.usefixtures("no_events")
async def test_a_namespace_the_administrator_did_not_list_is_never_resized(namespace: tuple[kube.Kube, str]) -> None:
    """The operator's defaults (no ``--resize-in``): a pressed worker's pod is left as it is, whatever
    the policy asks, and status.resize says why. Listing another namespace changes nothing here."""
    kube_client, ns = namespace
    limit = pressed_limit()
    async with (
        Scheduler(host="127.0.0.1", dashboard_address=":0") as scheduler,
        Worker(scheduler.address, name=POD, nthreads=1, memory_limit=limit, heartbeat_interval="100ms"),
        Client(scheduler.address, asynchronous=True),
    ):
        pod_path = await start_pod(kube_client, ns, limit)
        spec = _spec(scheduler.address, resize={"maxLimit": "64Gi"})
        for elsewhere in ([], ["elsewhere"]):
            admin = {"growth": resize_decisions.administrator("64Gi", [], elsewhere)} if elsewhere else {}
            status = await one_pass(kube_client, ns, spec, **admin)
            pod = await kube_client.get(pod_path)
            assert pod["spec"]["containers"][0]["resources"]["limits"] == {"memory": str(limit)}, status
            assert objects.RESIZED_ANNOTATION not in (pod["metadata"].get("annotations") or {})
            assert f"not allowed in namespace {ns}" in status["resize"]["message"], status["resize"]
            assert status["resize"]["workers"] == [] and status["resize"]["resized"] == 0


@pytest.mark.usefixtures("no_events")
async def test_the_administrators_ceiling_bounds_a_policy_that_allows_more(namespace: tuple[kube.Kube, str]) -> None:
    """The policy allows 64Gi; the administrator's ceiling in this namespace
    (``--max-resize-limit-in NS=...``) is one step above the worker's limit: the growth stops there."""
    kube_client, ns = namespace
    limit = pressed_limit()
    step = 16 * Mi
    ceiling = (limit // step + 1) * step
    admin = {"growth": resize_decisions.administrator("64Gi", [f"{ns}={ceiling}"], [ns])}
    async with (
        Scheduler(host="127.0.0.1", dashboard_address=":0") as scheduler,
        Worker(scheduler.address, name=POD, nthreads=1, memory_limit=limit, heartbeat_interval="100ms"),
        Client(scheduler.address, asynchronous=True),
    ):
        pod_path = await start_pod(kube_client, ns, limit)
        status = await one_pass(
            kube_client, ns, _spec(scheduler.address, resize={"maxLimit": "64Gi", "step": "16Mi"}), **admin
        )
        resources = (await kube_client.get(pod_path))["spec"]["containers"][0]["resources"]
        assert specs.parse_quantity(resources["limits"]["memory"]) == ceiling, status["resize"]


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
