"""What memops does to the workload whose pods run the workers (a Deployment, so far).

Called by the controllers; every function here is a few API calls through :mod:`memops.kube`.
The order of removal follows the ReplicaSet controller's own rules: memops marks exactly the
drained pods with the lowest ``controller.kubernetes.io/pod-deletion-cost`` and then lowers
``replicas``, so the ReplicaSet removes those pods and no others (``ActivePodsWithRanks`` in
kubernetes ``pkg/controller/controller_utils.go``: deletion cost is compared only after
unassigned, pending and not-ready pods, hence :func:`outranking_pods`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from memops import kube, retirement, specs

Obj = dict[str, Any]


def _deployment_path(namespace: str, name: str, subresource: str | None = None) -> str:
    return kube.resource_path("apps", "v1", "deployments", namespace, name, subresource)


async def get(client: kube.Kube, namespace: str, ref: specs.WorkloadRef) -> Obj | None:
    return await client.get_or_none(_deployment_path(namespace, ref.name))


def selector(workload: Obj) -> str:
    labels = workload.get("spec", {}).get("selector", {}).get("matchLabels", {})
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


async def pods(client: kube.Kube, namespace: str, ref: specs.WorkloadRef, workload: Obj | None = None) -> list[Obj]:
    """The workload's pods that are not being deleted."""
    workload = workload or await get(client, namespace, ref)
    if workload is None:
        return []
    path = kube.resource_path("", "v1", "pods", namespace)
    items = await client.list(path, label_selector=selector(workload))
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def _pod_path(namespace: str, name: str) -> str:
    return kube.resource_path("", "v1", "pods", namespace, name)


async def claim_pod(client: kube.Kube, pod: Obj, request: str) -> None:
    """Annotate the pod as this request's, atomically: a concurrent claim fails the ``test``."""
    meta = pod["metadata"]
    operations: list[Obj] = [{"op": "test", "path": "/metadata/resourceVersion", "value": meta["resourceVersion"]}]
    if meta.get("annotations"):
        key = retirement.CLAIM_ANNOTATION.replace("~", "~0").replace("/", "~1")
        operations.append({"op": "add", "path": f"/metadata/annotations/{key}", "value": request})
    else:
        operations.append(
            {"op": "add", "path": "/metadata/annotations", "value": {retirement.CLAIM_ANNOTATION: request}}
        )
    await client.json_patch(_pod_path(meta["namespace"], meta["name"]), operations)


async def release_claims(client: kube.Kube, namespace: str, names: list[str], request: str) -> None:
    for name in names:
        pod = await client.get_or_none(_pod_path(namespace, name))
        annotations = (pod or {}).get("metadata", {}).get("annotations") or {}
        if annotations.get(retirement.CLAIM_ANNOTATION) == request:
            await client.merge_patch(
                _pod_path(namespace, name), {"metadata": {"annotations": {retirement.CLAIM_ANNOTATION: None}}}
            )


def _ready(pod: Obj) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in pod.get("status", {}).get("conditions", [])
    )


async def outranking_pods(client: kube.Kube, namespace: str, ref: specs.WorkloadRef, chosen: list[str]) -> list[str]:
    """Other pods that the ReplicaSet would delete before the chosen ones, whatever their cost."""
    others = [p for p in await pods(client, namespace, ref) if p["metadata"]["name"] not in chosen]
    return [
        p["metadata"]["name"]
        for p in others
        if not p.get("spec", {}).get("nodeName") or p.get("status", {}).get("phase") != "Running" or not _ready(p)
    ]


async def mark_for_deletion(client: kube.Kube, namespace: str, names: list[str]) -> None:
    patch = {"metadata": {"annotations": {retirement.POD_DELETION_COST: retirement.LOWEST_DELETION_COST}}}
    for name in names:
        try:
            await client.merge_patch(_pod_path(namespace, name), patch)
        except kube.ApiError as exc:
            if exc.code != 404:  # already gone: nothing to mark
                raise


async def replicas(client: kube.Kube, namespace: str, ref: specs.WorkloadRef) -> int:
    scale = await client.get(_deployment_path(namespace, ref.name, "scale"))
    return int(scale.get("spec", {}).get("replicas", 0))


async def scale_down_to(client: kube.Kube, namespace: str, ref: specs.WorkloadRef, target: int) -> None:
    """Lower replicas to ``target`` unless they already are at or below it (idempotent)."""
    path = _deployment_path(namespace, ref.name, "scale")
    scale = await client.get(path)
    if int(scale.get("spec", {}).get("replicas", 0)) <= target:
        return
    await client.merge_patch(
        path,
        {
            "metadata": {"resourceVersion": scale["metadata"]["resourceVersion"]},
            "spec": {"replicas": target},
        },
    )


async def scale_up_to(client: kube.Kube, namespace: str, ref: specs.WorkloadRef, target: int) -> None:
    """Raise replicas to ``target`` unless they already are at or above it (idempotent)."""
    path = _deployment_path(namespace, ref.name, "scale")
    scale = await client.get(path)
    if int(scale.get("spec", {}).get("replicas", 0)) >= target:
        return
    await client.merge_patch(
        path,
        {
            "metadata": {"resourceVersion": scale["metadata"]["resourceVersion"]},
            "spec": {"replicas": target},
        },
    )


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
