"""The Kubernetes half of in-place growth: a worker pod's memory, read and resized in place.

:func:`read_container_memory` reads what :func:`memops.decisions.resize_decisions.decide` needs of the pod
(its container's memory as asked and as applied, its resize conditions);
:func:`resize_container_memory` patches the pod's ``resize`` subresource (KEP-1287, GA in
Kubernetes 1.35) for one container's memory. The API server refuses changes to a pod's resources
through the pod itself: only ``pods/resize`` takes them, and RBAC grants it apart
(``pods/resize`` ``patch``: the chart's ``rbac.podResize``).

Dask's side (the worker's, the nanny's and the scheduler's copies of the limit) is the agent's
``resize`` operation, :meth:`memops.clients.daskrpc.Scheduler.resize_worker`.

For the policy pass (:mod:`memops.controllers.policy`): :func:`observe` reads, per worker of the
workload, what :func:`memops.decisions.resize_decisions.decide` needs; :func:`apply` performs the
orders that :func:`memops.decisions.policy_decisions.decide` made of the decisions.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from memops import specs
from memops.clients import daskrpc, kube
from memops.decisions import objects, policy_decisions, resize_decisions, snapshots

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


async def observe(
    client: kube.Kube,
    *,
    spec: specs.MemoryPolicySpec,
    pods: Sequence[objects.Obj],
    snapshot: snapshots.SchedulerSnapshot,
    template: Mapping[str, Any] | None,
    now: float,
    linked: Mapping[str, int] | None = None,
    ceiling: int | None = None,
    demand: int = 0,
) -> tuple[resize_decisions.WorkerSeen, ...]:
    """Each connected worker's inputs to the decision (``snapshot``'s workers are named by their
    pods). Its node's room is read only for a worker over ``growAbove``, or for every worker while
    tasks wait for a capacity that no worker has (``demand``, bytes: one may grow for them): the
    others do not grow.

    ``linked``: worker address -> bytes of its spill that it links from other writers, as the
    workers last reported them (:func:`memops.decisions.shared_spill.linked_bytes`); read only with
    ``sharedSpill`` medium Node, the one medium whose workers link each other's files. A worker it
    does not name links nothing. ``ceiling``: the administrator's in the policy's namespace
    (:meth:`memops.decisions.resize_decisions.Administrator.ceiling_in`); None: growth may not act
    there, and no node's room is read."""
    assert spec.resize is not None
    settings = spec.resize.settings()
    if ceiling is not None:
        settings = resize_decisions.within(settings, ceiling)
    relief = specs.parse_percent(spec.pressure.relieveAbove) / 100 if spec.pressure is not None else None
    baseline = resize_decisions.template_memory(template)
    shared = spec.sharedSpill
    if shared is None or shared.medium != specs.SpillMedium.NODE:
        linked = None  # medium Memory: an emptyDir per pod, which no other pod links into
    rooms: dict[str, int] = {}
    found = []
    for pod in pods:
        seen = _worker_seen(
            pod, snapshot, baseline, relief, spill_charged=shared is not None, linked=linked or {}, now=now
        )
        if seen is None:
            continue
        node = str((pod.get("spec") or {}).get("nodeName") or "")
        if node and ceiling is not None and (demand > 0 or resize_decisions.is_pressed(seen, settings)):
            if node not in rooms:
                rooms[node] = await node_room(client, node, default=settings.max_limit)
            seen = dataclasses.replace(seen, inputs=dataclasses.replace(seen.inputs, node_room=rooms[node]))
        found.append(seen)
    return tuple(found)


def _worker_seen(
    pod: objects.Obj,
    snapshot: snapshots.SchedulerSnapshot,
    baseline: tuple[int | None, int | None],
    ceiling: float | None,
    *,
    spill_charged: bool,
    linked: Mapping[str, int],
    now: float,
) -> resize_decisions.WorkerSeen | None:
    """One pod's worker as the decision sees it (its node's room left at 0); None without a
    connected worker or a memory limit."""
    name = str(pod["metadata"]["name"])
    worker = snapshot.by_name(name)
    containers = (pod.get("spec") or {}).get("containers") or ()
    if worker is None or not containers:
        return None
    container = str(containers[0].get("name", ""))
    memory = resize_decisions.container_memory(pod, container)
    if memory is None or memory.limit is None:
        return None
    annotations = pod["metadata"].get("annotations") or {}
    baseline_limit, baseline_request = baseline
    state = resize_decisions.resize_status(pod)
    inputs = resize_decisions.Inputs(
        worker=resize_decisions.worker_memory(worker),
        container=memory,
        resize=state,
        baseline_limit=baseline_limit if baseline_limit is not None else memory.limit,
        baseline_request=baseline_request,
        node_room=0,
        peers_room=resize_decisions.peers_room(snapshot.workers, worker.address, ceiling),
        seconds_since_resize=resize_decisions.seconds_since(annotations.get(objects.RESIZED_ANNOTATION), now),
        spill_charged=spill_charged,
        spill_linked=linked.get(worker.address, 0),
        seconds_pending=max(0.0, now - state.since) if state.since is not None else None,
    )
    return resize_decisions.WorkerSeen(name, worker.address, container, inputs)


async def node_room(client: kube.Kube, node: str, *, default: int) -> int:
    """Bytes of memory request the node can still grant (:func:`memops.decisions.resize_decisions.node_room`):
    its allocatable memory minus the requests of its pods that have not ended, each counted as the
    kubelet counts it (:func:`memops.decisions.resize_decisions.pod_request`: sidecars, init
    containers, the pod-level request and the runtime's overhead too). Where the operator may
    not read them (a namespaced install lists no other namespace's pods), ``default``: the kubelet
    then decides, and a growth it cannot grant comes back Deferred or Infeasible."""
    try:
        body = await client.get(kube.resource_path("", "v1", "nodes", None, node))
        pods = await client.list(
            kube.resource_path("", "v1", "pods"),
            field_selector=f"spec.nodeName={node},status.phase!=Succeeded,status.phase!=Failed",
        )
    except kube.ApiError:
        return default
    allocatable = resize_decisions.from_quantity(((body.get("status") or {}).get("allocatable") or {}).get("memory"))
    if allocatable is None:
        return default
    return resize_decisions.node_room(allocatable, (resize_decisions.pod_request(pod) for pod in pods))


async def apply(
    client: kube.Kube,
    scheduler: daskrpc.Scheduler | None,
    *,
    namespace: str,
    orders: Sequence[policy_decisions.ResizeOrder],
    maximum: int,
    logger: logging.Logger | logging.LoggerAdapter[Any],
) -> list[str]:
    """Perform the orders: growth on the container (Dask follows once the kubelet applied it, on a
    later pass), a decrease on Dask then the container, an ask taken back. Returns what failed, one
    line per worker (the status shows it); the next pass reads where things stand and decides again."""
    Action = resize_decisions.Action
    failed = []
    for order in orders:
        try:
            if order.action in (Action.TELL_DASK, Action.SHRINK):
                if scheduler is None:
                    continue
                reply = await scheduler.resize_worker(order.address, memory_limit=order.limit, maximum=maximum)
                if reply.get("refused"):
                    failed.append(
                        f"{order.pod}: Dask refused {resize_decisions.to_quantity(order.limit)}: {reply['refused']}"
                    )
                    continue
            if order.action is not Action.TELL_DASK:
                await resize_container_memory(
                    client, namespace, order.pod, order.container, limit=order.limit, request=order.request
                )
                await client.merge_patch(
                    kube.resource_path("", "v1", "pods", namespace, order.pod),
                    {"metadata": {"annotations": {objects.RESIZED_ANNOTATION: f"{time.time():.0f}"}}},
                )
            logger.info("%s: %s to %s", order.pod, order.action.value, resize_decisions.to_quantity(order.limit))
        except (kube.ApiError, daskrpc.SchedulerUnreachable, daskrpc.SchedulerRefused) as exc:
            failed.append(f"{order.pod}: {order.action.value} {resize_decisions.to_quantity(order.limit)}: {exc}")
    return failed
