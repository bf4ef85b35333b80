"""A minimal Deployment/ReplicaSet controller for the emulated cluster.

Keeps ``spec.replicas`` active pods for every Deployment, creating them from its template
and, on scale-down, deleting the pods that the upstream ReplicaSet controller would delete,
in its order (:func:`rank_pods_for_deletion`). No ReplicaSet objects are created: the
Deployment owns its pods directly, which is all memops and its tests observe. It also
stands in for the garbage collector: pods whose Deployment is gone are deleted, and so are
RetirementRequests whose MemoryPolicy is gone (background propagation, as upstream).
Used by the sandbox and the tests, through the :class:`memops.cluster.store.Store` protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
import json
import secrets
from typing import Any

from memops.cluster.store import Store

Obj = dict[str, Any]

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
# k8s.io/apimachinery/pkg/util/rand: the alphabet of generated name suffixes.
_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
# pkg/controller/controller_utils.go podPhaseToOrdinal: Pending < Unknown < Running.
_PHASE_ORDER = {"Pending": 0, "Unknown": 1, "Running": 2}


def _ready_time(pod: Obj) -> str | None:
    for condition in pod.get("status", {}).get("conditions", []):
        if condition.get("type") == "Ready" and condition.get("status") == "True":
            return str(condition.get("lastTransitionTime") or "")
    return None


def _deletion_cost(pod: Obj) -> int:
    raw = (pod.get("metadata", {}).get("annotations") or {}).get(DELETION_COST, "0")
    try:
        return int(raw)
    except ValueError:
        return 0  # upstream ignores an invalid value (validation rejects it at admission)


def _restarts(pod: Obj) -> int:
    return max((c.get("restartCount", 0) for c in pod.get("status", {}).get("containerStatuses", [])), default=0)


def _deletion_key(pod: Obj, rank: int) -> tuple[Any, ...]:
    """Sort key for ``ActivePodsWithRanks.Less`` in kubernetes pkg/controller/controller_utils.go.

    Pods that sort first are deleted first:
    1. unassigned before assigned; 2. Pending before Unknown before Running;
    3. not ready before ready; 4. lower ``controller.kubernetes.io/pod-deletion-cost`` first;
    5. more pods of the set on the same node (rank) first; 6. both ready: ready more recently
       first (upstream buckets ready times on a log scale under LogarithmicScaleDown; these
       pods live seconds to minutes, and the plain comparison gives the same order);
    7. more restarts first; 8. newer first.
    """
    spec, status, meta = pod.get("spec", {}), pod.get("status", {}), pod.get("metadata", {})
    ready_time = _ready_time(pod)
    created = meta.get("creationTimestamp") or ""
    return (
        bool(spec.get("nodeName")),
        _PHASE_ORDER.get(status.get("phase", "Pending"), 0),
        ready_time is not None,
        _deletion_cost(pod),
        -rank,
        _negate_timestamp(ready_time),
        -_restarts(pod),
        _negate_timestamp(created),
    )


def _negate_timestamp(timestamp: str | None) -> tuple[int, ...]:
    """Later timestamps sort first; RFC 3339 UTC strings compare like the times they name."""
    if not timestamp:
        return (-(2**31),)  # empty sorts before any time, as upstream
    return tuple(-ord(c) for c in timestamp)


def rank_pods_for_deletion(pods: list[Obj], related_pods: list[Obj]) -> list[Obj]:
    """``pods`` in the order the ReplicaSet controller deletes them (``getPodsToDelete``).

    ``related_pods`` are all active pods of the owner; a pod's rank is how many of them run on
    its node (``getPodsRankedByRelatedPodsOnSameNode`` in pkg/controller/replicaset/replica_set.go).
    """
    per_node: dict[str, int] = {}
    for pod in related_pods:
        node = pod.get("spec", {}).get("nodeName")
        if node:
            per_node[node] = per_node.get(node, 0) + 1
    ranked = [(pod, per_node.get(pod.get("spec", {}).get("nodeName") or "", 0)) for pod in pods]
    return [pod for pod, rank in sorted(ranked, key=lambda item: _deletion_key(item[0], item[1]))]


def _matches(pod: Obj, selector: dict[str, str]) -> bool:
    labels = pod["metadata"].get("labels") or {}
    return all(labels.get(k) == v for k, v in selector.items())


def _is_active(pod: Obj) -> bool:
    """``FilterActivePods``: not being deleted, not Succeeded, not Failed."""
    return not pod["metadata"].get("deletionTimestamp") and pod.get("status", {}).get("phase") not in (
        "Succeeded",
        "Failed",
    )


def _template_hash(template: Obj) -> str:
    digest = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()
    return "".join(_ALPHABET[int(digest[i : i + 2], 16) % len(_ALPHABET)] for i in range(0, 20, 2))


class DeploymentController:
    """Reconciles every Deployment in the store; level-based, so a missed event costs a second."""

    def __init__(self, store: Store, *, resync_seconds: float = 1.0):
        self.store = store
        self.resync_seconds = resync_seconds
        self._wake = asyncio.Event()

    async def run(self) -> None:
        events = self.store.watch()

        async def listen() -> None:
            async for event in events:
                if event.plural in ("deployments", "pods"):
                    self._wake.set()

        listener = asyncio.create_task(listen())
        try:
            while True:
                # Clear before reconciling, not after: an event during the pass must wake the next.
                self._wake.clear()
                await self.reconcile_all()
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a
                # cancellation that arrives as the wait ends, and the task would never stop.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.resync_seconds):
                        await self._wake.wait()
        finally:
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listener

    async def reconcile_all(self) -> None:
        deployments = self.store.list("deployments")
        # One pass over the pods, grouped by owner: listing per Deployment would cost
        # Deployments x objects on every event, which at a thousand pods stalls the emulator.
        owned: dict[str, list[Obj]] = {}
        orphans = []
        uids = {d["metadata"]["uid"] for d in deployments}
        for pod in self.store.list("pods"):
            owners = [o for o in pod["metadata"].get("ownerReferences", []) if o.get("kind") == "Deployment"]
            if not owners:
                continue
            owned.setdefault(owners[0]["uid"], []).append(pod)
            if owners[0]["uid"] not in uids and not pod["metadata"].get("deletionTimestamp"):
                orphans.append(pod)
        for deployment in deployments:
            await self.reconcile(deployment, owned.get(deployment["metadata"]["uid"], []))
        await self._collect_requests()
        for pod in orphans:
            await self._delete(pod)

    async def _collect_requests(self) -> None:
        """Delete RetirementRequests whose owning MemoryPolicy no longer exists."""
        policies = {p["metadata"]["uid"] for p in self.store.list("memorypolicies")}
        for request in self.store.list("retirementrequests"):
            meta = request["metadata"]
            owners = [o["uid"] for o in meta.get("ownerReferences", []) if o.get("kind") == "MemoryPolicy"]
            if owners and owners[0] not in policies and not meta.get("deletionTimestamp"):
                with contextlib.suppress(Exception):  # gone meanwhile
                    await self.store.delete("retirementrequests", meta.get("namespace"), meta["name"])

    async def reconcile(self, deployment: Obj, owned: list[Obj]) -> None:
        """Create or delete pods until ``replicas`` are active; ``owned``: the pods it owns."""
        meta, spec = deployment["metadata"], deployment.get("spec", {})
        if meta.get("deletionTimestamp"):
            return
        selector = spec.get("selector", {}).get("matchLabels", {})
        active = [p for p in owned if _is_active(p) and _matches(p, selector)]
        wanted = int(spec.get("replicas", 1))
        if len(active) < wanted:
            for _ in range(wanted - len(active)):
                created = await self.store.create("pods", meta.get("namespace"), self._new_pod(deployment))
                active.append(created)
        elif len(active) > wanted:
            for pod in rank_pods_for_deletion(active, active)[: len(active) - wanted]:
                await self._delete(pod)
                active.remove(pod)
        await self._write_status(deployment, active)

    def _new_pod(self, deployment: Obj) -> Obj:
        meta, template = deployment["metadata"], copy.deepcopy(deployment["spec"].get("template", {}))
        template_hash = _template_hash(template)
        pod_meta = template.get("metadata", {})
        suffix = "".join(secrets.choice(_ALPHABET) for _ in range(5))
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": f"{meta['name']}-{template_hash}-{suffix}",
                "namespace": meta.get("namespace"),
                "labels": {**pod_meta.get("labels", {}), "pod-template-hash": template_hash},
                "annotations": dict(pod_meta.get("annotations", {})),
                "ownerReferences": [
                    {
                        "apiVersion": "apps/v1",
                        "kind": "Deployment",
                        "name": meta["name"],
                        "uid": meta["uid"],
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "spec": template.get("spec", {}),
            "status": {"phase": "Pending"},
        }

    async def _delete(self, pod: Obj) -> None:
        with contextlib.suppress(Exception):  # already gone: nothing to do
            await self.store.delete("pods", pod["metadata"].get("namespace"), pod["metadata"]["name"])

    async def _write_status(self, deployment: Obj, active: list[Obj]) -> None:
        meta = deployment["metadata"]
        current = self.store.get("deployments", meta.get("namespace"), meta["name"])
        if current is None:
            return
        ready = sum(1 for p in active if _ready_time(p) is not None)
        status = {
            "replicas": len(active),
            "readyReplicas": ready,
            "availableReplicas": ready,
            "updatedReplicas": len(active),
            "observedGeneration": current["metadata"].get("generation", 1),
        }
        if {k: current.get("status", {}).get(k) for k in status} != status:
            await self.store.patch(
                "deployments", meta.get("namespace"), meta["name"], {"status": status}, subresource="status"
            )
