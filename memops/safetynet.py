"""The safety net for scale-downs that memops does not make: what a worker pod gets at creation.

Someone lowers a Deployment's replicas directly, a rollout replaces pods, a node drains: the
kubelet then runs the container's ``preStop`` hook before SIGTERM. For the workers of a
MemoryPolicy's workload, memops' mutating admission webhook (:mod:`memops.controllers.safetynet_webhook`)
adds a ``preStop`` hook that asks the scheduler to drain this worker (memops' drain with a
deadline where the operator's agent runs, stock ``retire_workers`` elsewhere), and a grace
period long enough for the drain. The pods are mutated, never the user's Deployment, so GitOps tools see
no drift. The hook uses only what ``distributed`` ships (msgpack), so a stock Dask image works,
and speaks to the scheduler through :mod:`memops.daskcomm`'s client, carried as source.

Pure: :func:`plan_injection` builds the JSON-patch-free description of the change, which the
webhook applies to the pod; :func:`failed_hooks` reads the kubelet's ``FailedPreStopHook``
events into the policy's status, so that a pod that left undrained is seen.
"""

from __future__ import annotations

import copy
import datetime
import inspect
import re
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from memops import daskcomm, objects, shared_spill, specs, timestamps

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

_PRE_STOP_MAIN = """

# -- the preStop hook: drain this worker through the scheduler -------------------------------

LEAVING = {"closing_gracefully", "closing", "closed"}
# The worker image's msgpack may allocate all of an array's items as its header arrives: short
# arrays keep what a reply's nested empty arrays cost to 8 MiB.
IDENTITY = Limit(bytes=WORKERS.bytes, objects=WORKERS.objects, items=SMALL.items)


async def _statuses(comm, name):
    identity = await comm.call("identity", limit=IDENTITY)
    workers = identity.get("workers") if isinstance(identity, dict) else None
    if not isinstance(workers, dict):
        raise Misbehaved("identity is not a map of workers")
    return {
        str(info.get("status"))
        for info in workers.values()
        if isinstance(info, dict) and str(info.get("name")) == name
    }


async def _drained_by_memops(comm, name):
    # Whether memops' drain is draining this worker now (the operator's RetirementRequest).
    reply = await comm.call("memops_agent", operation="drain_status", names=[name])
    states = reply.get("result") if isinstance(reply, dict) else None
    return isinstance(states, dict) and any(
        isinstance(state, dict) and state.get("state") == "draining" for state in states.values()
    )


async def _drain_by_memops(comm, name, deadline):
    # memops' drain (the operator's agent in the scheduler): the keys worth most first, off
    # this node, each asked once, stopped at the deadline. Not installed (or an agent without
    # it): None, and stock retire_workers does it.
    node = os.environ.get("MEMOPS_NODE_NAME", "")
    reply = await comm.call(
        "memops_agent",
        operation="drain",
        names=[name],
        deadline=deadline,
        nodes={name: node} if node else {},
        origin="preStop",
    )
    if not isinstance(reply, dict) or not isinstance(reply.get("result"), dict) or not reply["result"]:
        return None
    while True:
        reply = await comm.call("memops_agent", operation="drain_status", names=[name])
        states = reply.get("result") if isinstance(reply, dict) else None
        if not isinstance(states, dict) or not states:
            return None
        state = next(iter(states.values()))
        if not isinstance(state, dict) or state.get("state") != "draining":
            print("memops drain:", state, flush=True)
            return state
        await asyncio.sleep(0.2)


async def _main(deadline):
    # dask-kubernetes names a worker by DASK_WORKER_NAME (its Deployment); otherwise the pod's name.
    name = os.environ.get("DASK_WORKER_NAME") or os.environ["MEMOPS_POD_NAME"]
    context = None
    if os.environ.get("MEMOPS_TLS_CA"):  # PEM texts from the policy's Secret
        context = ssl_context_from_pem(
            os.environ["MEMOPS_TLS_CA"], os.environ["MEMOPS_TLS_CERT"], os.environ["MEMOPS_TLS_KEY"]
        )
    comm = await connect(os.environ["MEMOPS_SCHEDULER_ADDRESS"], ssl_context=context, timeout=10)
    async with comm:
        statuses = await _statuses(comm, name)
        if statuses & LEAVING and await _drained_by_memops(comm, name):
            # memops' drain asked again keeps its drain, and takes this hook's deadline if earlier
            # and this node as dying: a drain that ran on past the hook's end would be killed.
            if await _drain_by_memops(comm, name, deadline) is not None:
                return
            statuses = await _statuses(comm, name)
        if statuses & LEAVING:
            # Already being retired (by stock retire_workers): a second retirement could leave the
            # worker stuck closing_gracefully, so wait for that one to end instead.
            while statuses & LEAVING:
                await asyncio.sleep(0.5)
                statuses = await _statuses(comm, name)
            return
        if await _drain_by_memops(comm, name, deadline) is None:
            # No memops agent: stock retire_workers. The scheduler retires nobody when no other
            # worker can take the unique data (say, in a rollout, before the new pods' workers have
            # connected): the kubelet would then kill the worker with its data. Ask again until it
            # is retired, or gone, or the timeout ends.
            while not await comm.call("retire_workers", names=[name], close_workers=True, remove=True, limit=IDENTITY):
                if not await _statuses(comm, name):
                    return
                await asyncio.sleep(1)


# The pod's grace period, and a shorter one given at deletion (kubectl delete --grace-period,
# a preemption), are not visible in the container: the hook's deadline is what the webhook
# set (MEMOPS_DRAIN_DEADLINE) and no later than the drain's timeout. A shorter window ends the
# hook with SIGKILL; memops' drain has moved the keys worth most by then.
_DEADLINE = min(float(os.environ["MEMOPS_DRAIN_TIMEOUT"]), float(os.environ.get("MEMOPS_DRAIN_DEADLINE") or "inf"))
asyncio.run(asyncio.wait_for(_main(_DEADLINE), _DEADLINE + 5))
"""

PRE_STOP_SCRIPT = inspect.getsource(daskcomm) + _PRE_STOP_MAIN
"""Runs in the worker's container, with the image's own Python and only what ``distributed``
brings (msgpack). It is :mod:`memops.daskcomm`'s source and a short main, so the hook and the
operator share one client, and the hook never unpickles what the address sends it either.
Retiring by name finds the worker whatever its address; a worker that memops already retired is
simply not found, and one that something else is retiring right now is waited for, not retired
twice; one that memops' drain is draining gets this hook's deadline and node in that drain."""


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


def plan_injection(
    pod: Mapping[str, Any],
    policy_name: str,
    spec: specs.MemoryPolicySpec,
    *,
    host_roots: Collection[str] = frozenset(),
) -> dict[str, Any]:
    """The pod's new ``spec`` and annotations: a preStop drain on its first container, and a
    grace period that covers ``drain.timeout``. An existing preStop hook is left alone. With
    ``sharedSpill``, also the spill volume, its mount and Dask's configuration
    (:mod:`memops.shared_spill`), unless the pod's memory cannot hold it or its ``hostPath`` is
    not among ``host_roots``, the host directories the operator was allowed."""
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
            {"name": "MEMOPS_DRAIN_TIMEOUT", "value": str(timeout)},
            {"name": "MEMOPS_DRAIN_DEADLINE", "value": str(max(grace - GRACE_MARGIN_SECONDS, 1))},
            *_tls_env(spec),
        ]
        container.setdefault("lifecycle", {})["preStop"] = {"exec": {"command": ["python", "-c", PRE_STOP_SCRIPT]}}
    annotations[ANNOTATION] = policy_name
    if spec.sharedSpill is not None:
        # Refused (it cannot fit, or its host path is not allowed): the pod keeps its own spill
        # directory, and only the safety net.
        verdict, mutation = shared_spill.plan(pod_spec, spec.sharedSpill, host_roots=host_roots)
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


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


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
        keys = _count(lost.get("keys"))
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
            bytes=_count(lost.get("bytes")),
            irreplaceableKeys=min(_count(lost.get("irreplaceableKeys")), keys),
            cause=cause if cause in ("deadline", "worker left") else "deadline",
        )
    return sorted(found.values(), key=lambda loss: (loss.time, loss.pod))[-limit:] if limit > 0 else []


def new_losses(old: specs.SafetyNetStatus | None, new: specs.SafetyNetStatus | None) -> list[specs.HookLoss]:
    """Losses in ``new`` that ``old`` did not list: what a status write records for the first time."""
    before = {(loss.pod, loss.time) for loss in (old.lostAtDeadline if old is not None else [])}
    return [loss for loss in (new.lostAtDeadline if new is not None else []) if (loss.pod, loss.time) not in before]
