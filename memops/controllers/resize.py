"""The Kubernetes half of in-place growth: a worker pod's memory, read and resized in place.

:func:`read_container_memory` reads what :func:`memops.decisions.resize_decisions.decide` needs of the pod
(its container's memory as asked and as applied, its resize conditions);
:func:`resize_container_memory` patches the pod's ``resize`` subresource (KEP-1287, GA in
Kubernetes 1.35) for one container's memory. The API server refuses changes to a pod's resources
through the pod itself: only ``pods/resize`` takes them, and RBAC grants it apart
(``pods/resize`` ``patch``: the chart's ``rbac.podResize``).

Dask's side (the worker's, the nanny's and the scheduler's copies of the limit) is the agent's
``resize`` operation, :meth:`memops.daskrpc.Scheduler.resize_worker`.
"""

from __future__ import annotations

from memops.clients import kube
from memops.decisions import objects, resize_decisions

STRATEGIC_MERGE = "application/strategic-merge-patch+json"
"""A strategic merge patch merges ``containers`` by name: the other containers, and the other
resources of this one (cpu), are left as they are. A JSON merge patch would replace the list."""


def resize_patch(container: str, *, limit: int, request: int | None = None) -> objects.Obj:
    """The body that sets ``container``'s memory limit (and request, when given) to these bytes."""
    resources: objects.Obj = {"limits": {"memory": resize_decisions.to_quantity(limit)}}
    if request is not None:
        resources["requests"] = {"memory": resize_decisions.to_quantity(request)}
    return {"spec": {"containers": [{"name": container, "resources": resources}]}}


async def resize_container_memory(
    client: kube.Kube, namespace: str, name: str, container: str, *, limit: int, request: int | None = None
) -> objects.Obj:
    """Ask the kubelet for ``container``'s new memory; the pod as the API server then has it.

    The answer comes later, in the pod's status: ``PodResizeInProgress`` while the kubelet applies
    it, ``PodResizePending`` (``Deferred``, ``Infeasible``) when it does not, and the limit it
    applied in ``status.containerStatuses[].resources`` (:func:`read_container_memory`)."""
    path = kube.resource_path("", "v1", "pods", namespace, name, "resize")
    body = resize_patch(container, limit=limit, request=request)
    return await client.request("PATCH", path, body=body, content_type=STRATEGIC_MERGE)


async def read_container_memory(
    client: kube.Kube, namespace: str, name: str, container: str
) -> tuple[resize_decisions.ContainerMemory | None, resize_decisions.ResizeStatus] | None:
    """The container's memory and the pod's resize state; None when the pod is gone."""
    pod = await client.get_or_none(kube.resource_path("", "v1", "pods", namespace, name))
    if pod is None:
        return None
    return resize_decisions.container_memory(pod, container), resize_decisions.resize_status(pod)
