"""What memops writes on Kubernetes objects: its labels and annotations, the phases that end a
RetirementRequest, and the one builder of a RetirementRequest that a MemoryPolicy owns.

Pure: no I/O. The controllers read and write objects as plain dicts (:data:`Obj`); every name
memops puts on them is defined here once, so a reader finds them all in one place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from memops import specs

Obj = dict[str, Any]
"""A Kubernetes object as the API sends it: parsed JSON."""

# -- on RetirementRequests that a MemoryPolicy creates ---------------------------------------------
POLICY_LABEL = "memops.dev/policy"
"""The owning policy's name (a label value: at most 63 characters)."""
PURPOSE_LABEL = "memops.dev/purpose"
"""``recycle`` on a recycling drain; absent on a scale-down."""
GENERATION_ANNOTATION = "memops.dev/policy-generation"
"""The policy's generation when the request was made (a failed drain holds back that generation)."""
SCALE_EVENT_ANNOTATION = "memops.dev/scale-event"
"""On a policy's scale-down request: the time (Unix seconds) of the scale event it is, so that a
pass whose status write failed after the request was made has the next pass record the event."""
POD_ANNOTATION = "memops.dev/recycled-pod"
"""The pod a recycling drain replaces."""
RECORDED_ANNOTATION = "memops.dev/recorded"
"""A finished recycling drain that the policy's ``status.recycle`` already counts."""

# -- on pods -----------------------------------------------------------------------------------
CLAIM_ANNOTATION = "memops.dev/retirement-request"
"""The RetirementRequest that chose this pod: no other request chooses it meanwhile."""
RECYCLE_ANNOTATION = "memops.dev/recycle"
"""Why and since when a worker is being recycled (JSON); also on its drain request."""
UNMANAGED_ANNOTATION = "memops.dev/unmanaged-memory"
"""The worker's unmanaged memory, as a percent of its limit (shown for people)."""
SAFETY_NET_ANNOTATION = "memops.dev/safety-net"
"""Set by the webhook on a worker pod that got the preStop drain: the policy's name."""
POD_DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
LOWEST_DELETION_COST = str(-(2**31))  # the annotation is an int32; lower is deleted first
RESIZED_ANNOTATION = "memops.dev/resized"
"""When memops last asked the pod's resize subresource for a new memory (Unix seconds)."""
DO_NOT_DISRUPT = "karpenter.sh/do-not-disrupt"
"""Karpenter leaves the node of a pod with this ``"true"`` (no consolidation, no drift replacement)."""
SAFE_TO_EVICT = "cluster-autoscaler.kubernetes.io/safe-to-evict"
"""cluster-autoscaler does not remove the node of a pod with this ``"false"``."""
PROTECTED_ANNOTATION = "memops.dev/unique-data-protected"
"""memops set the two above, since this time (Unix seconds): only then does it remove them."""
PROTECTION_BEGAN_ANNOTATION = "memops.dev/disruption-protection-began"
"""When memops first protected the pod (Unix seconds). It stays for the pod's life, through every
later protection, so that the bound on protection counts from here."""
PROTECTED_LABEL = "memops.dev/protected-by"
"""The policy that protected the pod (a label: found by a label selector once the pod has left the
policy's workload, or the policy is gone)."""

TERMINAL_PHASES = frozenset({specs.Phase.SUCCEEDED, specs.Phase.FAILED})
"""A RetirementRequest in one of these has finished; its daemon has exited."""


def is_finished(request: Mapping[str, Any]) -> bool:
    """Whether a RetirementRequest (a dict as listed) has reached a terminal phase."""
    return (request.get("status") or {}).get("phase") in TERMINAL_PHASES


@dataclasses.dataclass(frozen=True)
class Owner:
    """The MemoryPolicy that owns the requests it makes."""

    name: str
    namespace: str
    uid: str


def policy_request(
    owner: Owner,
    spec: specs.MemoryPolicySpec,
    *,
    name: str,
    count: int | None = None,
    workers: tuple[str, ...] = (),
    labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
) -> Obj:
    """A RetirementRequest that ``owner`` makes: ``count`` workers (a scale-down) or these ``workers``.

    Its scheduler, workload and drain settings are the policy's; it is labelled with the policy's
    name and owned by it, so that deleting the policy deletes its requests.
    """
    request_spec: dict[str, Any] = {
        "scheduler": spec.scheduler.model_dump(mode="json", exclude_none=True),
        "workload": spec.workload.model_dump(mode="json"),
    }
    if workers:
        request_spec["workers"] = list(workers)
    else:
        request_spec["count"] = count
    request_spec.update({"timeout": spec.drain.timeout, "onTimeout": spec.drain.onTimeout.value})
    return {
        "apiVersion": specs.API_VERSION,
        "kind": "RetirementRequest",
        "metadata": {
            "name": name,
            "namespace": owner.namespace,
            "labels": {POLICY_LABEL: owner.name, **(labels or {})},
            "annotations": dict(annotations or {}),
            "ownerReferences": [
                {
                    "apiVersion": specs.API_VERSION,
                    "kind": "MemoryPolicy",
                    "name": owner.name,
                    "uid": owner.uid,
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": request_spec,
    }


@dataclasses.dataclass(frozen=True)
class Event:
    """A Kubernetes event that a decision asks the controller to post about its object."""

    type: str  # Normal or Warning
    reason: str
    message: str
