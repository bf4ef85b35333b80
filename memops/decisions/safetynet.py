"""The safety net for scale-downs that memops does not make: what a worker pod gets at creation.

Someone lowers a Deployment's replicas directly, a rollout replaces pods, a node drains: the
kubelet then runs the container's ``preStop`` hook before SIGTERM. For the workers of a
MemoryPolicy's workload, memops' mutating admission webhook (:mod:`memops.controllers.safetynet_webhook`)
adds a ``preStop`` hook that asks the scheduler to drain this pod's workers (memops' drain with a
deadline where the operator's agent runs, stock ``retire_workers`` elsewhere), and a grace
period long enough for the drain. The pods are mutated, never the user's Deployment, so GitOps tools see
no drift. The hook uses only what ``distributed`` ships (msgpack), so a stock Dask image works,
and speaks to the scheduler through :mod:`memops.clients.daskcomm`'s client, carried as source
(:data:`memops.clients.prestop_hook.PRE_STOP_SCRIPT`, which the webhook passes in).

Pure: :func:`plan_injection` builds the JSON-patch-free description of the change, which the
webhook applies to the pod; :func:`failed_hooks` reads the kubelet's ``FailedPreStopHook``
events into the policy's status, so that a pod that left undrained is seen.
"""

from __future__ import annotations

import copy
import datetime
import re
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from memops import specs
from memops.decisions import counts, objects, shared_spill, timestamps

ANNOTATION = objects.SAFETY_NET_ANNOTATION
FAILED_PRE_STOP_HOOK = "FailedPreStopHook"
"""The kubelet's event reason (kubernetes ``pkg/kubelet/events/event.go``) for a preStop hook that failed."""
FAILED_HOOKS_KEPT = 10
"""The policy's status lists this many of the latest pods that left with a failed hook."""
GRACE_MARGIN_SECONDS = 30
"""Beyond the drain's timeout: the worker still has to close after the hook returns."""
MAX_GRACE_SECONDS = int(specs.parse_duration(specs.MAX_DURATION).total_seconds()) + GRACE_MARGIN_SECONDS
"""The longest grace period the webhook sets: the longest drain timeout a policy may have
(168h) plus the margin, 604,830 s. A pod that already asks for more keeps its own."""


def _tls_env(spec: specs.MemoryPolicySpec) -> list[dict[str, Any]]:
    """For a tls:// scheduler: the policy's client certificate, from its Secret, as the hook's env.

    Environment variables from ``secretKeyRef``, not a volume: the pod's volumes stay the user's,
    and the Secret is the one the operator itself uses (``spec.scheduler.tls.secretName``).
    """
    if spec.scheduler.tls is None:
        return []
    secret = spec.scheduler.tls.secretName
    return [
        {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}
        for name, key in (("MEMOPS_TLS_CA", "ca.crt"), ("MEMOPS_TLS_CERT", "tls.crt"), ("MEMOPS_TLS_KEY", "tls.key"))
    ]


def _pod_ips_env(pod_spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The pod's IPs (comma-separated, both families on a dual-stack cluster), by which the hook
    finds every worker of the pod, named or not. None for a ``hostNetwork`` pod: its IPs are its
    node's, shared with every such pod there, so they prove nothing and the hook goes by name."""
    if pod_spec.get("hostNetwork"):
        return []
    return [{"name": "MEMOPS_POD_IPS", "valueFrom": {"fieldRef": {"fieldPath": "status.podIPs"}}}]


def plan_injection(
    pod: Mapping[str, Any],
    policy_name: str,
    spec: specs.MemoryPolicySpec,
    *,
    hook: str,
    host_roots: Collection[str] = frozenset(),
    namespace: str = "",
    owner_script: str = "",
) -> dict[str, Any]:
    """The pod's new ``spec`` and annotations: a preStop drain on its first container, and a
    grace period that covers ``drain.timeout``; ``hook`` is the script that the preStop drain
    runs (:data:`memops.clients.prestop_hook.PRE_STOP_SCRIPT`). An existing preStop hook is left alone. With
    ``sharedSpill``, also the spill volume, its mount and Dask's configuration
    (:mod:`memops.decisions.shared_spill`), unless the pod's memory cannot hold it or its ``hostPath`` is
    not among ``host_roots``, the host directories the operator was allowed. ``namespace``: the
    pod's (the admission request's; else the pod's own ``metadata.namespace``), whose directory
    of the host root a medium Node spill mounts."""
    annotations = dict(pod.get("metadata", {}).get("annotations") or {})
    pod_spec = copy.deepcopy(dict(pod.get("spec", {})))
    # At most MAX_DURATION (the spec's bound, checked again), so the grace is at most MAX_GRACE_SECONDS.
    timeout = int(specs.parse_duration(spec.drain.timeout, specs.MAX_DURATION).total_seconds())
    grace = max(int(pod_spec.get("terminationGracePeriodSeconds", 30)), timeout + GRACE_MARGIN_SECONDS)
    pod_spec["terminationGracePeriodSeconds"] = grace
    containers = pod_spec.get("containers", [])
    if containers and "preStop" not in containers[0].get("lifecycle", {}):
        container = containers[0]
        env = [e for e in container.get("env", []) if not e.get("name", "").startswith("MEMOPS_")]
        container["env"] = [
            *env,
            {"name": "MEMOPS_SCHEDULER_ADDRESS", "value": spec.scheduler.address},
            {"name": "MEMOPS_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "MEMOPS_NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            *_pod_ips_env(pod_spec),
            {"name": "MEMOPS_DRAIN_TIMEOUT", "value": str(timeout)},
            {"name": "MEMOPS_DRAIN_DEADLINE", "value": str(max(grace - GRACE_MARGIN_SECONDS, 1))},
            *_tls_env(spec),
        ]
        container.setdefault("lifecycle", {})["preStop"] = {"exec": {"command": ["python", "-c", hook]}}
    annotations[ANNOTATION] = policy_name
    if spec.sharedSpill is not None:
        # Refused (it cannot fit, or its host path is not allowed): the pod keeps its own spill
        # directory, and only the safety net.
        namespace = namespace or str((pod.get("metadata") or {}).get("namespace") or "")
        verdict, mutation = shared_spill.plan(
            pod_spec,
            spec.sharedSpill,
            host_roots=host_roots,
            namespace=namespace,
            policy=policy_name,
            owner_script=owner_script,
        )
        if mutation is not None:
            shared_spill.apply(pod_spec, mutation)
        annotations[shared_spill.ANNOTATION] = (
            spec.sharedSpill.medium.value if mutation is not None else f"Refused: {verdict.refusal}"
        )
    return {"spec": pod_spec, "annotations": annotations}


def is_workload_pod(pod: str, workload: specs.WorkloadRef) -> bool:
    """Whether a pod's name is one that the workload's controllers give its pods.

    A pod that is gone can only be recognised by its name. A Deployment's pods are named
    ``<deployment>-<pod-template-hash>-<suffix>`` (its ReplicaSet is ``<deployment>-<hash>``);
    dask-kubernetes names a group's worker Deployments ``<group>-worker-<id>``, whose pods add the
    same two parts. Exactly two (or three) parts after the name: the pods of a Deployment named
    ``dask-worker-big`` are not ``dask-worker``'s.
    """
    name = re.escape(workload.name)
    if workload.kind == specs.WorkloadKind.DASK_WORKER_GROUP:
        return re.fullmatch(rf"{name}-worker-[a-z0-9]+-[a-z0-9]+-[a-z0-9]+", pod) is not None
    return re.fullmatch(rf"{name}-[a-z0-9]+-[a-z0-9]+", pod) is not None


def failed_hooks(
    events: Iterable[Mapping[str, Any]],
    workload: specs.WorkloadRef,
    previous: Iterable[specs.FailedHook] = (),
    limit: int = FAILED_HOOKS_KEPT,
) -> list[specs.FailedHook]:
    """The latest ``limit`` failed preStop hooks of the workload's pods, oldest first.

    ``events`` are the namespace's ``FailedPreStopHook`` events (the API server keeps them an
    hour by default); ``previous`` is what the status listed already, kept after its events expire.
    """
    found = {(hook.pod, hook.time): hook for hook in previous}
    for event in events:
        involved = event.get("involvedObject") or {}
        pod = str(involved.get("name", ""))
        if event.get("reason") != FAILED_PRE_STOP_HOOK or involved.get("kind") != "Pod":
            continue
        if not is_workload_pod(pod, workload):
            continue
        meta = event.get("metadata") or {}
        when = str(event.get("lastTimestamp") or event.get("eventTime") or meta.get("creationTimestamp") or "")
        found.setdefault((pod, when), specs.FailedHook(pod=pod, time=when, message=str(event.get("message", ""))))
    return sorted(found.values(), key=lambda hook: (hook.time, hook.pod))[-limit:] if limit > 0 else []


HOOK_LOSSES_KEPT = 10
"""The policy's status lists this many of the latest preStop drains that ran out of time."""
HOOK_ORIGIN = "preStop"
"""What the hook tells memops' drain it is, so that its drains are told from the operator's."""


def hook_losses(
    drains: Mapping[Any, Any],
    workload: specs.WorkloadRef,
    previous: Iterable[specs.HookLoss] = (),
    limit: int = HOOK_LOSSES_KEPT,
) -> list[specs.HookLoss]:
    """The latest ``limit`` preStop drains of the workload's pods that lost keys, oldest first.

    ``drains`` is the agent's ``drain_status`` (worker address -> figures; hostile input: any
    entry of the wrong shape is skipped). Only drains the hook started count: the operator's own
    are in their RetirementRequests. ``previous`` is what the status listed: a pod's record is
    keyed by its name and the time its drain stopped, so reading the same drain on every pass,
    or after the operator restarts, adds it once. Once the list is full, a drain no later than
    its oldest entry is one that was listed and dropped, not a new one.
    """
    found = {(loss.pod, loss.time): loss for loss in previous}
    oldest = min(found, key=lambda k: k[1])[1] if len(found) >= limit > 0 else ""
    for state in drains.values():
        if not isinstance(state, Mapping) or state.get("origin") != HOOK_ORIGIN:
            continue
        lost = state.get("lostAtDeadline")
        pod = state.get("name")
        ended = state.get("endedAt")
        if not isinstance(lost, Mapping) or not isinstance(pod, str) or not is_workload_pod(pod, workload):
            continue
        if not isinstance(ended, (int, float)) or isinstance(ended, bool) or not 0 < ended < 2**33:
            continue
        keys = counts.or_zero(lost.get("keys"))
        if keys == 0:
            continue
        when = timestamps.render(datetime.datetime.fromtimestamp(ended, datetime.UTC))
        if (pod, when) in found or (oldest and when <= oldest):
            continue
        cause = lost.get("cause")
        found[(pod, when)] = specs.HookLoss(
            pod=pod,
            time=when,
            keys=keys,
            bytes=counts.or_zero(lost.get("bytes")),
            irreplaceableKeys=min(counts.or_zero(lost.get("irreplaceableKeys")), keys),
            cause=cause if cause in ("deadline", "worker left") else "deadline",
        )
    return sorted(found.values(), key=lambda loss: (loss.time, loss.pod))[-limit:] if limit > 0 else []


def new_losses(old: specs.SafetyNetStatus | None, new: specs.SafetyNetStatus | None) -> list[specs.HookLoss]:
    """Losses in ``new`` that ``old`` did not list: what a status write records for the first time."""
    before = {(loss.pod, loss.time) for loss in (old.lostAtDeadline if old is not None else [])}
    return [loss for loss in (new.lostAtDeadline if new is not None else []) if (loss.pod, loss.time) not in before]
