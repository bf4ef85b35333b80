"""What memops does to the workload whose pods run the workers: a Deployment or a DaskWorkerGroup.

Called by the controllers; every function here is a few API calls through :mod:`memops.clients.kube`.

Deployment: the order of removal follows the ReplicaSet controller's own rules: memops marks
exactly the drained pods with the lowest ``controller.kubernetes.io/pod-deletion-cost`` and
then lowers ``replicas``, so the ReplicaSet removes those pods and no others
(``ActivePodsWithRanks`` in kubernetes ``pkg/controller/controller_utils.go``: deletion cost is
compared only after unassigned, pending and not-ready pods, hence :func:`outranking_pods`).

DaskWorkerGroup (dask-kubernetes 2026.3.0, ``operator/controller/controller.py``,
``daskworkergroup_replica_update``): each worker is its own one-replica Deployment named
``<group>-worker-<uuid>``, which is also its Dask worker name (env ``DASK_WORKER_NAME``). The
handler runs when ``spec.worker.replicas`` changes, counts the Deployments labelled
``dask.org/workergroup-name=<group>`` and creates or retires the difference; to retire it asks
the scheduler, or closes the last workers, "which can result in lost data". So memops deletes
exactly the drained workers' Deployments, waits until they are gone, and only then lowers
``spec.worker.replicas`` from the value it recorded: the handler then finds as many
Deployments as replicas and has nothing to choose.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection, Mapping
from typing import Any

from memops import specs
from memops.clients import kube
from memops.decisions import objects, selectors, snapshots

DASK_GROUP, DASK_VERSION = "kubernetes.dask.org", "v1"
WORKER_NAME_ENV = "DASK_WORKER_NAME"


def _deployment_path(namespace: str, name: str | None, subresource: str | None = None) -> str:
    return kube.resource_path("apps", "v1", "deployments", namespace, name, subresource)


def _path(namespace: str, ref: specs.WorkloadRef) -> str:
    if ref.kind == specs.WorkloadKind.DASK_WORKER_GROUP:
        return kube.resource_path(DASK_GROUP, DASK_VERSION, "daskworkergroups", namespace, ref.name)
    return _deployment_path(namespace, ref.name)


def _is_group(workload: objects.Obj) -> bool:
    return str(workload.get("kind")) == specs.WorkloadKind.DASK_WORKER_GROUP.value


async def get(client: kube.Kube, namespace: str, ref: specs.WorkloadRef) -> objects.Obj | None:
    return await client.get_or_none(_path(namespace, ref))


def replicas_of(workload: objects.Obj) -> int:
    """The workload's desired replicas as its spec says."""
    spec = workload.get("spec", {})
    if _is_group(workload):
        return int(spec.get("worker", {}).get("replicas", 0))
    return int(spec.get("replicas", 1))


def selector_of(workload: objects.Obj) -> Any:
    """The LabelSelector of the workload's worker pods, as the workload writes it."""
    if _is_group(workload):
        # The labels dask-kubernetes puts on every worker Deployment and its pods.
        return {
            "matchLabels": {
                "dask.org/component": "worker",
                "dask.org/workergroup-name": str(workload["metadata"]["name"]),
            }
        }
    return workload.get("spec", {}).get("selector")


def selector(workload: objects.Obj) -> str:
    """The selector as a ``labelSelector``; raises :class:`memops.decisions.selectors.InvalidSelector`
    for an empty or missing one, which memops never reads as "every pod"."""
    return selectors.render(selector_of(workload))


def worker_names(pods: list[objects.Obj]) -> dict[str, str]:
    """Dask worker name -> pod name, where they differ.

    memops names a worker by its pod. dask-kubernetes names it by its Deployment, through a
    literal ``DASK_WORKER_NAME`` in the pod's environment; that value maps back to the pod.
    """
    names: dict[str, str] = {}
    for pod in pods:
        for container in pod.get("spec", {}).get("containers", []):
            for variable in container.get("env", []) or []:
                if variable.get("name") == WORKER_NAME_ENV and variable.get("value"):
                    names[str(variable["value"])] = str(pod["metadata"]["name"])
    return names


def pod_info(pod: objects.Obj) -> snapshots.PodInfo:
    """What :func:`memops.decisions.snapshots.workers_by_pod` and :func:`memops.decisions.tenancy.check`
    read of a pod."""
    status = pod.get("status") or {}
    spec = pod.get("spec") or {}
    ips = [str(status["podIP"])] if status.get("podIP") else []
    ips += [str(entry["ip"]) for entry in status.get("podIPs") or [] if entry.get("ip")]
    host_ips = [str(status["hostIP"])] if status.get("hostIP") else []
    host_ips += [str(entry["ip"]) for entry in status.get("hostIPs") or [] if entry.get("ip")]
    return snapshots.PodInfo(
        name=str(pod["metadata"]["name"]),
        ips=tuple(dict.fromkeys(ips)),
        worker_names=tuple(worker_names([pod])),
        phase=str(status.get("phase", "Pending")),
        node=str(spec.get("nodeName") or ""),
        host_network=bool(spec.get("hostNetwork")),
        host_ips=tuple(dict.fromkeys(host_ips)),
    )


async def namespace_pods(
    client: kube.Kube, namespace: str, not_older_than: str | None = None
) -> tuple[list[snapshots.PodInfo], str | None]:
    """Every pod of the namespace, for the tenancy check (:mod:`memops.decisions.tenancy`), no
    older than the listing whose resourceVersion is ``not_older_than`` (else a consistent list);
    and this listing's resourceVersion."""
    path = kube.resource_path("", "v1", "pods", namespace)
    items, version = await client.list_not_older_than(path, not_older_than)
    return [pod_info(p) for p in items], version


async def owning_deployment(client: kube.Kube, pod: objects.Obj) -> str | None:
    """The Deployment that runs this pod: its owner, or its ReplicaSet's owner."""
    meta = pod["metadata"]
    for owner in meta.get("ownerReferences", []) or []:
        if owner.get("kind") == "Deployment":
            return str(owner["name"])
        if owner.get("kind") == "ReplicaSet":
            replica_set = await client.get_or_none(
                kube.resource_path("apps", "v1", "replicasets", meta["namespace"], owner["name"])
            )
            for parent in (replica_set or {}).get("metadata", {}).get("ownerReferences", []) or []:
                if parent.get("kind") == "Deployment":
                    return str(parent["name"])
    return None


async def pods(
    client: kube.Kube,
    namespace: str,
    ref: specs.WorkloadRef,
    workload: objects.Obj | None = None,
    *,
    not_older_than: str | None = None,
) -> list[objects.Obj]:
    """The workload's pods that are not being deleted (no older than the listing whose
    resourceVersion is ``not_older_than``: see :meth:`memops.clients.kube.Kube.list_not_older_than`)."""
    workload = workload or await get(client, namespace, ref)
    if workload is None:
        return []
    path = kube.resource_path("", "v1", "pods", namespace)
    items, _ = await client.list_not_older_than(path, not_older_than, label_selector=selector(workload))
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


async def patch_annotations(
    client: kube.Kube,
    namespace: str,
    patches: Mapping[str, Mapping[str, str | None]],
    logger: logging.Logger | logging.LoggerAdapter[Any],
) -> int:
    """One merge-patch of annotations per pod (None removes one); a pod that is gone or refuses is
    logged and left to the next pass. Returns how many pods were written."""
    written = 0
    for pod, values in patches.items():
        try:
            await client.merge_patch(_pod_path(namespace, pod), {"metadata": {"annotations": dict(values)}})
        except kube.ApiError as exc:
            logger.info("annotations of pod %s not written: %s", pod, exc)
        else:
            written += 1
    return written


async def patch_metadata(
    client: kube.Kube,
    namespace: str,
    patches: Mapping[str, Mapping[str, Mapping[str, str | None]]],
    logger: logging.Logger | logging.LoggerAdapter[Any],
) -> int:
    """One merge-patch of metadata (``annotations``, ``labels``) per pod, as :func:`patch_annotations`."""
    written = 0
    for pod, metadata in patches.items():
        try:
            await client.merge_patch(_pod_path(namespace, pod), {"metadata": {k: dict(v) for k, v in metadata.items()}})
        except kube.ApiError as exc:
            logger.info("metadata of pod %s not written: %s", pod, exc)
        else:
            written += 1
    return written


async def protected_pods(client: kube.Kube, namespace: str, policy: str) -> list[objects.Obj]:
    """The pods that carry ``policy``'s disruption label (:data:`memops.decisions.objects.PROTECTED_LABEL`),
    whatever workload they belong to now, but for those being deleted."""
    path = kube.resource_path("", "v1", "pods", namespace)
    items = await client.list(path, label_selector=f"{objects.PROTECTED_LABEL}={policy}")
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def _pod_path(namespace: str, name: str) -> str:
    return kube.resource_path("", "v1", "pods", namespace, name)


async def claim_pod(client: kube.Kube, pod: objects.Obj, request: str) -> None:
    """Annotate the pod as this request's, atomically: a concurrent claim fails the ``test``."""
    meta = pod["metadata"]
    operations: list[objects.Obj] = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": meta["resourceVersion"]}
    ]
    if meta.get("annotations"):
        key = objects.CLAIM_ANNOTATION.replace("~", "~0").replace("/", "~1")
        operations.append({"op": "add", "path": f"/metadata/annotations/{key}", "value": request})
    else:
        operations.append({"op": "add", "path": "/metadata/annotations", "value": {objects.CLAIM_ANNOTATION: request}})
    await client.json_patch(_pod_path(meta["namespace"], meta["name"]), operations)


async def release_claims(
    client: kube.Kube, namespace: str, names: list[str] | None, request: str, *, keep_cost: Collection[str] = ()
) -> list[str]:
    """Take this request's claim off these pods (``None``: every pod it claimed), and the lowest
    deletion cost it set with it, except on ``keep_cost`` (pods whose scale-down is ordered).
    Idempotent; returns the pods released."""
    if names is None:
        listed = await client.list(kube.resource_path("", "v1", "pods", namespace))
        claimed = [p for p in listed if (p["metadata"].get("annotations") or {}).get(objects.CLAIM_ANNOTATION)]
    else:
        claimed = [p for p in [await client.get_or_none(_pod_path(namespace, n)) for n in names] if p is not None]
    released = []
    for pod in claimed:
        name = str(pod["metadata"]["name"])
        annotations = pod["metadata"].get("annotations") or {}
        if annotations.get(objects.CLAIM_ANNOTATION) != request:
            continue
        change: dict[str, str | None] = {objects.CLAIM_ANNOTATION: None}
        cost = annotations.get(objects.POD_DELETION_COST)
        if name not in keep_cost and cost == objects.LOWEST_DELETION_COST:
            change[objects.POD_DELETION_COST] = None
        try:
            await client.merge_patch(_pod_path(namespace, name), {"metadata": {"annotations": change}})
        except kube.ApiError as exc:
            if exc.code != 404:  # gone meanwhile: nothing left to release
                raise
        released.append(name)
    return released


def _ready(pod: objects.Obj) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in pod.get("status", {}).get("conditions", [])
    )


async def outranking_pods(client: kube.Kube, namespace: str, ref: specs.WorkloadRef, chosen: list[str]) -> list[str]:
    """Other pods that the ReplicaSet would delete before the chosen ones, whatever their cost."""
    if ref.kind == specs.WorkloadKind.DASK_WORKER_GROUP:
        return []  # each worker has its own Deployment, and memops deletes exactly the chosen ones
    others = [p for p in await pods(client, namespace, ref) if p["metadata"]["name"] not in chosen]
    return [
        p["metadata"]["name"]
        for p in others
        if not p.get("spec", {}).get("nodeName") or p.get("status", {}).get("phase") != "Running" or not _ready(p)
    ]


async def mark_for_deletion(client: kube.Kube, namespace: str, ref: specs.WorkloadRef, names: list[str]) -> None:
    if ref.kind == specs.WorkloadKind.DASK_WORKER_GROUP:
        return  # no ReplicaSet chooses among a group's pods
    patch = {"metadata": {"annotations": {objects.POD_DELETION_COST: objects.LOWEST_DELETION_COST}}}
    for name in names:
        try:
            await client.merge_patch(_pod_path(namespace, name), patch)
        except kube.ApiError as exc:
            if exc.code != 404:  # already gone: nothing to mark
                raise


async def replicas(client: kube.Kube, namespace: str, ref: specs.WorkloadRef) -> int:
    if ref.kind == specs.WorkloadKind.DASK_WORKER_GROUP:
        return replicas_of(await client.get(_path(namespace, ref)))
    scale = await client.get(_deployment_path(namespace, ref.name, "scale"))
    return int(scale.get("spec", {}).get("replicas", 0))


class ForeignDeployment(Exception):
    """A pod's owning Deployment is not a worker Deployment of the group memops was asked about."""


def foreign_deployment(deployment: objects.Obj | None, group: objects.Obj) -> str | None:
    """Why this Deployment is not one of the group's worker Deployments, or None if it is.

    dask-kubernetes labels each worker Deployment with its group and cluster; a pod's
    ownerReferences name a Deployment, but only these labels say that it is the group's.
    """
    if deployment is None:
        return None  # gone already: nothing will be deleted
    name = deployment["metadata"]["name"]
    labels = deployment["metadata"].get("labels") or {}
    wanted = {
        "dask.org/workergroup-name": str(group["metadata"]["name"]),
        "dask.org/cluster-name": str(group.get("spec", {}).get("cluster", "")),
    }
    wrong = [f"{k}={labels.get(k)!r} (want {v!r})" for k, v in wanted.items() if labels.get(k) != v]
    if wrong:
        group_name = wanted["dask.org/workergroup-name"]
        return f"Deployment {name!r} is not a worker Deployment of DaskWorkerGroup {group_name!r}: {', '.join(wrong)}"
    return None


async def worker_deployments(client: kube.Kube, namespace: str, ref: specs.WorkloadRef, pods: list[str]) -> list[str]:
    """DaskWorkerGroup: the worker Deployments of these pods (none for a Deployment workload).

    Raises :class:`ForeignDeployment` if an owning Deployment does not carry the group's labels:
    memops deletes only Deployments that belong to the group it was asked about.
    """
    if ref.kind != specs.WorkloadKind.DASK_WORKER_GROUP:
        return []
    group = await client.get(_path(namespace, ref))
    found = []
    for name in pods:
        pod = await client.get_or_none(_pod_path(namespace, name))
        deployment = await owning_deployment(client, pod) if pod is not None else None
        if deployment is not None:
            why = foreign_deployment(await client.get_or_none(_deployment_path(namespace, deployment)), group)
            if why is not None:
                raise ForeignDeployment(f"pod {name}: {why}")
            found.append(deployment)
    return found


async def remove(client: kube.Kube, namespace: str, ref: specs.WorkloadRef, scale_down: specs.ScaleDown) -> None:
    """Carry out the recorded scale-down; idempotent, so a restarted operator can repeat it."""
    if ref.kind != specs.WorkloadKind.DASK_WORKER_GROUP:
        await scale_to(client, namespace, ref, scale_down.replicasTo, up=False)
        return
    for name in scale_down.deployments:
        try:
            # Background propagation: the Deployment object goes at once, its pods after their
            # preStop and grace period, as with any Deployment deletion.
            await client.delete(_deployment_path(namespace, name), propagation_policy="Background")
        except kube.ApiError as exc:
            if exc.code != 404:
                raise
    await _wait_deployments_gone(client, namespace, scale_down.deployments)
    await _lower_group_replicas(client, namespace, ref, scale_down.replicasFrom, scale_down.replicasTo)


async def _wait_deployments_gone(client: kube.Kube, namespace: str, names: list[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        present = {d["metadata"]["name"] for d in await client.list(_deployment_path(namespace, None))}
        if not present & set(names):
            return
        await asyncio.sleep(0.2)


async def _lower_group_replicas(
    client: kube.Kube, namespace: str, ref: specs.WorkloadRef, replicas_from: int, replicas_to: int
) -> None:
    """Set spec.worker.replicas from ``replicas_from`` to ``replicas_to``, only if nobody changed it.

    The ``test`` makes it atomic: if someone else scaled the group meanwhile, their value stands
    (dask-kubernetes counts the Deployments that are left, so nothing is retired twice).
    """
    try:
        await client.json_patch(
            _path(namespace, ref),
            [
                {"op": "test", "path": "/spec/worker/replicas", "value": replicas_from},
                {"op": "replace", "path": "/spec/worker/replicas", "value": replicas_to},
            ],
        )
    except kube.ApiError as exc:
        if exc.code not in (409, 422):  # 422: the test failed, the replicas are no longer ours to set
            raise


async def scale_to(client: kube.Kube, namespace: str, ref: specs.WorkloadRef, target: int, *, up: bool) -> None:
    """Raise (``up``) or lower the workload's replicas to ``target``, unless they already are there
    or beyond (idempotent). The resourceVersion makes it a compare-and-swap: a change by someone
    else meanwhile fails with 409, and the next pass looks again."""
    change: dict[str, Any]
    if ref.kind == specs.WorkloadKind.DASK_WORKER_GROUP:
        # dask-kubernetes' handler creates the new workers' Deployments.
        path = _path(namespace, ref)
        found = await client.get(path)
        current, change = replicas_of(found), {"worker": {"replicas": target}}
    else:
        path = _deployment_path(namespace, ref.name, "scale")
        found = await client.get(path)
        current, change = int(found.get("spec", {}).get("replicas", 0)), {"replicas": target}
    if (current >= target) if up else (current <= target):
        return
    version = found["metadata"]["resourceVersion"]
    await client.merge_patch(path, {"metadata": {"resourceVersion": version}, "spec": change})


async def wait_pods_gone(client: kube.Kube, namespace: str, names: list[str], *, timeout: float) -> list[str]:
    """Wait until these pods no longer exist; return those that are gone (all, unless timed out)."""
    deadline = time.monotonic() + timeout
    while True:
        # One list per poll, not one GET per pod.
        present = {p["metadata"]["name"] for p in await client.list(kube.resource_path("", "v1", "pods", namespace))}
        gone = [n for n in names if n not in present]
        if len(gone) == len(names) or time.monotonic() >= deadline:
            return gone
        await asyncio.sleep(0.2)
