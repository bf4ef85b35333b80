"""MemoryPolicy: keep a workload at the policy's replicas; every scale-down drains first.

One Kopf daemon per policy. Each pass reads the workload, the policy's own RetirementRequests
and what else touches the workload, asks :func:`memops.scaling.plan_scale` what to do, then
does it: scale-up raises the workload's replicas directly; scale-down creates a
RetirementRequest that the policy owns (visible with ``kubectl get retire``), which drains
the chosen workers and removes exactly their pods. ``kubectl scale mempol/NAME``, an HPA or
KEDA whose target is the policy, and a GitOps change of ``spec.replicas`` all land here.
The daemon keeps nothing that matters in memory: a restarted operator sees the requests and
carries on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

import kopf
import pydantic

from memops import (
    autoscaling,
    conditions,
    daskrpc,
    drain_decisions,
    kube,
    metrics,
    recycle_decisions,
    safetynet,
    scaling,
    selectors,
    snapshots,
    specs,
    tenancy,
    timestamps,
)
from memops.controllers import recycle, relief_install, workloads

POLICY_LABEL = "memops.dev/policy"
GENERATION_ANNOTATION = "memops.dev/policy-generation"
_IDLE_SECONDS = 2.0
_STEADY_SECONDS = 10.0
_MEMORY_REFRESH_SECONDS = 15.0
"""A status change of the memory figures alone is written at most this often (the HPA's sync period)."""
_HOOK_EVENTS_SECONDS = 15.0
"""The namespace's FailedPreStopHook events are read at most this often per policy.

One list with a field selector (``reason=FailedPreStopHook``), which the API server filters: far
cheaper than a watch on every event of the cluster, which Kopf would have to filter itself.
"""
_TERMINAL = (specs.Phase.SUCCEEDED.value, specs.Phase.FAILED.value)
_MAX_RETRY_SECONDS = 30.0
_MAX_NAME_LENGTH = 63
"""A policy's name is a label value on its RetirementRequests (``memops.dev/policy``): 63 characters at most."""
_TENANCY_RECHECK_SECONDS = 60.0
"""The workers shown to be pods of the namespace are checked again at least this often."""


class Policy:
    """One pass over one MemoryPolicy; every pass starts from what the cluster says."""

    def __init__(
        self,
        *,
        client: kube.Kube,
        body: kopf.Body,
        logger: logging.Logger | logging.LoggerAdapter[Any],
        cache: Cache | None = None,
    ):
        self.client = client
        self.body = body
        self.logger = logger
        self.cache = cache
        self.written = -_MEMORY_REFRESH_SECONDS  # when this pass' status was last written (monotonic)
        self.steady = False  # the last pass found nothing to do and nothing that samples memory
        self.security: Any = None  # the client certificates for a tls:// scheduler, read each pass
        self.namespace = str(body.metadata.namespace)
        self.name = str(body.metadata.name)
        self.path = kube.resource_path(specs.GROUP, specs.VERSION, "memorypolicies", self.namespace, self.name)
        self.window: recycle_decisions.Window | None = None  # memory samples for recycling
        self.tenants: dict[str, str] = {}  # worker address -> pod, as the last tenancy check found them
        self.tenants_checked = -_TENANCY_RECHECK_SECONDS  # when (monotonic)
        self.hooks_read = -_HOOK_EVENTS_SECONDS  # when the FailedPreStopHook events were last read (monotonic)

    async def reconcile(self) -> None:
        self.steady = False
        generation = int(self.body.metadata.get("generation", 1))
        old = specs.MemoryPolicyStatus.model_validate(_own(self.body.get("status")))
        status = old.model_copy(deep=True, update={"observedGeneration": generation})
        try:
            spec = specs.MemoryPolicySpec.model_validate(dict(self.body.spec))
        except pydantic.ValidationError as exc:
            await self.not_ready(old, status, "InvalidSpec", drain_decisions.explain_invalid(exc), generation)
            return
        if len(self.name) > _MAX_NAME_LENGTH:
            message = (
                f"metadata.name: at most {_MAX_NAME_LENGTH} characters, as it labels the policy's"
                f" RetirementRequests ({POLICY_LABEL}); this policy does nothing"
            )
            await self.not_ready(old, status, "InvalidName", message, generation)
            return
        try:
            workload = await self.workload(spec.workload)
        except kube.ApiError as exc:
            if exc.code != 403:
                raise
            # A DaskWorkerGroup without rbac.daskWorkerGroups: the message names the value.
            await self.not_ready(old, status, "Forbidden", f"spec.workload: {exc.message}", generation)
            return
        if workload is None:
            message = f"spec.workload.name: {spec.workload.kind} {spec.workload.name!r} not found in {self.namespace}"
            await self.not_ready(old, status, "WorkloadNotFound", message, generation)
            return
        try:
            status.selector = workloads.selector(workload)
        except selectors.InvalidSelector as exc:
            message = f"spec.workload: {spec.workload.kind} {spec.workload.name!r}: {exc}"
            await self.not_ready(old, status, "InvalidSelector", message, generation)
            return
        policies = await self.listed("memorypolicies", (self.namespace,))
        older = scaling.competing_policies(dict(self.body), policies)
        if older:
            message = (
                f"spec.workload: MemoryPolicy {older[0]!r} already manages {spec.workload.kind}"
                f" {spec.workload.name!r}; this policy does nothing while it exists"
            )
            status.conditions = conditions.set_condition(
                status.conditions, "Conflict", True, reason="AnotherPolicy", message=message, generation=generation
            )
            await self.not_ready(old, status, "Conflict", message, generation)
            return
        hpas = await self.listed("horizontalpodautoscalers", (self.namespace,))
        direct = scaling.autoscalers_on(spec.workload, hpas)
        status.conditions = conditions.set_condition(
            status.conditions,
            "Conflict",
            bool(direct),
            reason="AutoscalerOnWorkload" if direct else "NoConflict",
            message=(
                f"HorizontalPodAutoscaler {', '.join(direct)} scales {spec.workload.kind} {spec.workload.name!r}"
                f" directly, so its scale-downs are not drained: point its scaleTargetRef at MemoryPolicy"
                f" {self.name!r} instead"
            )
            if direct
            else "",
            generation=generation,
        )
        snapshot = await self.check_scheduler(spec, status, generation)
        if snapshot is not None:
            status.memory = _memory_status(snapshot)
            status.pressure = await relief_install.reconcile(
                spec=spec,
                old=status.pressure,
                security=self.security,
                namespace=self.namespace,
                policy=self.name,
                logger=self.logger,
            )

        current = workloads.replicas_of(workload)
        desired = spec.replicas if spec.replicas is not None else current
        now = time.time()
        limited = ""
        if spec.autoscale is not None and snapshot is not None:
            with metrics.deciding("desired_replicas"):
                recommended = autoscaling.desired_replicas(
                    current=current,
                    usage=autoscaling.usage_of(snapshot.workers),
                    spec=spec.autoscale,
                    history=status.recommendations,
                    events=status.scaleEvents,
                    now=now,
                )
            desired = recommended.replicas
            status.recommendations = _remember(status.recommendations, now, recommended.raw, spec.autoscale)
            if any(word in recommended.reason for word in ("limited", "capped", "raised", "needs")):
                limited = recommended.reason
            starved = len(status.pressure.starved) if status.pressure is not None else 0
            desired, relief_reason = autoscaling.with_relief(desired, len(snapshot.workers), starved, spec.autoscale)
            limited = relief_reason or limited
        requests = await self.listed("retirementrequests", (self.namespace, self.name))
        running = [r for r in requests if r.get("status", {}).get("phase") not in _TERMINAL]
        draining = sum(_request_size(r) for r in running)
        step = await self.recycle(spec, workload, snapshot, requests, running, desired, status, now)
        target = desired + (step.extra if step is not None else 0)
        failed = _latest_failure(requests)
        decision = scaling.plan_scale(
            current=current,
            desired=target,
            draining=draining,
            last_failure_age=timestamps.age_seconds(failed.get("status", {}).get("completionTime")) if failed else None,
            failed_generation=int(failed["metadata"].get("annotations", {}).get(GENERATION_ANNOTATION, 0))
            if failed
            else None,
            generation=generation,
        )
        if decision.action == scaling.Action.SCALE_UP:
            await workloads.scale_up_to(self.client, self.namespace, spec.workload, decision.replicas)
        elif decision.action == scaling.Action.SCALE_DOWN:
            await self.create_request(spec, decision.replicas, generation, attempt=len(requests))
        if decision.action in (scaling.Action.SCALE_UP, scaling.Action.SCALE_DOWN):
            event = specs.ScaleEvent(time=now, change=desired - current)
            status.scaleEvents = _recent_events([*status.scaleEvents, event], now, spec)
            status.lastScaleTime = timestamps.render(timestamps.now())
            status.lastScaleReason = decision.reason
            kopf.event(self.body, type="Normal", reason=decision.reason, message=decision.message)
        status.replicas = int(workload.get("status", {}).get("replicas", current))
        status.desiredReplicas = desired
        status.message = decision.message
        if step is not None and step.message and decision.action in (scaling.Action.NONE, scaling.Action.WAIT):
            status.message = step.message
        status.conditions = conditions.set_condition(
            status.conditions,
            "ScalingActive",
            decision.action != scaling.Action.NONE,
            reason=decision.reason,
            message=decision.message,
            generation=generation,
        )
        limited = decision.message if decision.reason == "DrainFailed" else limited
        status.conditions = conditions.set_condition(
            status.conditions,
            "ScalingLimited",
            bool(limited),
            reason=decision.reason if decision.reason == "DrainFailed" else ("Limited" if limited else "NotLimited"),
            message=limited,
            generation=generation,
        )
        working = decision.action != scaling.Action.NONE or (step is not None and bool(step.message))
        unreachable = conditions.get_condition(status.conditions, "SchedulerReachable")
        if unreachable is not None and unreachable.status == "False":
            # Without the scheduler no scale-down can drain and no memory is known: not Ready.
            status.conditions = conditions.with_kstatus(
                status.conditions, generation=generation, stalled=(unreachable.reason, unreachable.message)
            )
            status.conditions = conditions.set_condition(
                status.conditions,
                "Ready",
                False,
                reason=unreachable.reason,
                message=unreachable.message,
                generation=generation,
            )
        else:
            status.conditions = conditions.with_kstatus(
                status.conditions,
                generation=generation,
                reconciling=(decision.reason, status.message) if working else None,
            )
            status.conditions = conditions.set_condition(
                status.conditions,
                "Ready",
                True,
                reason="Managing",
                message=f"managing {spec.workload.kind} {spec.workload.name!r}",
                generation=generation,
            )
        status.safetyNet = await self.safety_net(spec, status.safetyNet)
        await self.write(old, status)
        metrics.policy_observed(
            self.namespace,
            self.name,
            action=decision.action.value,
            desired=desired,
            replicas=status.replicas,
            utilization=status.memory.percent / 100 if status.memory is not None and snapshot is not None else None,
        )
        if step is not None:
            await recycle.mark_recorded(self.client, self.namespace, step.recorded)
        # Memory-driven features sample the scheduler on every short pass; a plain policy that is
        # where it should be only watches for drift, and its own spec changes wake it at once.
        self.steady = (
            decision.action == scaling.Action.NONE
            and not running
            and snapshot is not None
            and spec.autoscale is None
            and spec.recycle is None
            and spec.pressure is None
        )

    async def recycle(
        self,
        spec: specs.MemoryPolicySpec,
        workload: dict[str, Any],
        snapshot: snapshots.SchedulerSnapshot | None,
        requests: list[dict[str, Any]],
        running: list[dict[str, Any]],
        desired: int,
        status: specs.MemoryPolicyStatus,
        now: float,
    ) -> recycle.Step | None:
        if spec.recycle is None or snapshot is None:
            return None
        window = recycle_decisions.window_for(spec.recycle)
        if self.window is None or (self.window.seconds, self.window.spacing) != (window.seconds, window.spacing):
            self.window = window
        pods = await workloads.pods(self.client, self.namespace, spec.workload, workload)
        return await recycle.reconcile(
            self.client,
            body=self.body,
            spec=spec,
            pods=pods,
            snapshot=snapshot.named_by_pod(workloads.worker_names(pods)),
            window=self.window,
            requests=requests,
            desired=desired,
            # A scale-down of the policy is draining: no new recycling starts meanwhile.
            busy=any((r["metadata"].get("labels") or {}).get(recycle.PURPOSE_LABEL) != "recycle" for r in running),
            status=status,
            now=now,
            logger=self.logger,
        )

    async def workload(self, ref: specs.WorkloadRef) -> dict[str, Any] | None:
        """The workload: a Deployment from the watch-fed cache; anything else from the API."""
        if self.cache is not None and ref.kind == specs.WorkloadKind.DEPLOYMENT:
            found = list(self.cache.of("deployments").get((self.namespace, ref.name), []))
            return {"kind": "Deployment", **found[0]} if found else None
        return await workloads.get(self.client, self.namespace, ref)

    async def listed(self, plural: str, key: tuple[str, ...]) -> list[dict[str, Any]]:
        """The objects of one index key, from the watch-fed cache; from the API without one."""
        if self.cache is not None:
            return [dict(body) for body in self.cache.of(plural).get(key, [])]
        group, version = _LISTED[plural]
        path = kube.resource_path(group, version, plural, self.namespace)
        selector = f"{POLICY_LABEL}={self.name}" if plural == "retirementrequests" else None
        return await self.client.list(path, label_selector=selector)

    async def check_scheduler(
        self, spec: specs.MemoryPolicySpec, status: specs.MemoryPolicyStatus, generation: int
    ) -> snapshots.SchedulerSnapshot | None:
        """The workers and their memory (no keys: cheap), or None with the reason in a condition."""
        field = "spec.scheduler.address"
        try:
            security = None
            if spec.scheduler.tls is not None:
                field = "spec.scheduler.tls.secretName"
                secret = await self.client.get(
                    kube.resource_path("", "v1", "secrets", self.namespace, spec.scheduler.tls.secretName)
                )
                security = daskrpc.security_from_secret(secret.get("data") or {})
                field = "spec.scheduler.address"
            self.security = security
            # Identity only (no code sent) until the scheduler is shown to be this namespace's.
            snapshot = await daskrpc.fetch_snapshot(
                spec.scheduler.address, security=security, keys=False, processing=False, timeout=5
            )
            verdict = await self.verify_tenancy(snapshot.workers)
            if verdict.allowed and spec.recycle is not None:
                snapshot = await daskrpc.fetch_snapshot(
                    spec.scheduler.address, security=security, keys=False, processing=True, timeout=5
                )
                verdict = await self.verify_tenancy(snapshot.workers)
        except (daskrpc.SchedulerUnreachable, kube.ApiError, ValueError) as exc:
            # The chart grants Secrets only with rbac.schedulerTLS: a 403's message says so.
            forbidden = isinstance(exc, kube.ApiError) and exc.code == 403
            status.conditions = conditions.set_condition(
                status.conditions,
                "SchedulerReachable",
                False,
                reason="Forbidden"
                if forbidden
                else ("SchedulerUnreachable" if field == "spec.scheduler.address" else "SecretUnusable"),
                message=f"spec.scheduler.tls.secretName: {exc.message}"
                if isinstance(exc, kube.ApiError) and forbidden
                else f"{field}: {exc}",
                generation=generation,
            )
            return None
        if not verdict.allowed:
            # Nothing is read from it or written about it: no memory, no relief, no recycling.
            status.memory = None
            status.conditions = conditions.set_condition(
                status.conditions,
                "SchedulerReachable",
                False,
                reason=verdict.reason.value,
                message=f"spec.scheduler.address: {verdict.message}",
                generation=generation,
            )
            return None
        status.conditions = conditions.set_condition(
            status.conditions, "SchedulerReachable", True, reason="Connected", generation=generation
        )
        # Each worker under its pod's name, found by address (status.memory, recycling).
        return snapshot.named_by_pod({w.name: self.tenants[w.address] for w in snapshot.workers})

    async def verify_tenancy(self, workers: Sequence[snapshots.WorkerInfo]) -> tenancy.Verdict:
        """:func:`memops.tenancy.check` against the namespace's pods, listed only when a worker
        is not among those the last check showed to be pods here, or that check is old: a
        listing of the namespace's pods on every pass of every policy would cost more API
        requests than everything else a policy at rest does."""
        addresses = {w.address for w in workers}
        fresh = time.monotonic() - self.tenants_checked < _TENANCY_RECHECK_SECONDS
        if workers and fresh and addresses <= self.tenants.keys():
            return tenancy.Verdict(tenancy.Reason.TENANT, "the workers of the last check")
        pods = await workloads.namespace_pods(self.client, self.namespace)
        verdict = tenancy.check(workers, pods, self.namespace)
        located = snapshots.workers_by_pod(pods, workers) if verdict.allowed else {}
        self.tenants = {w.address: pod for pod, found in located.items() for w in found}
        self.tenants_checked = time.monotonic()
        return verdict

    async def scheduler_is_tenant(self) -> bool:
        """Whether the scheduler is still this namespace's (identity only), for the goodbye calls."""
        try:
            spec = specs.MemoryPolicySpec.model_validate(dict(self.body.spec))
            identity = await daskrpc.fetch_snapshot(
                spec.scheduler.address, security=self.security, keys=False, processing=False, timeout=5
            )
            pods = await workloads.namespace_pods(self.client, self.namespace)
        except (daskrpc.SchedulerUnreachable, kube.ApiError, ValueError) as exc:
            self.logger.warning("pressure relief left in the scheduler: %s", exc)
            return False
        verdict = tenancy.check(identity.workers, pods, self.namespace)
        if not verdict.allowed:
            self.logger.warning("pressure relief left in the scheduler: %s", verdict.message)
        return verdict.allowed

    async def safety_net(
        self, spec: specs.MemoryPolicySpec, current: specs.SafetyNetStatus | None
    ) -> specs.SafetyNetStatus | None:
        """The workload's pods that left with a failed preStop hook, from the kubelet's events.

        Each one new to the status also becomes a Warning event on the policy: such a pod was
        removed without the safety net's drain.
        """
        if time.monotonic() - self.hooks_read < _HOOK_EVENTS_SECONDS:
            return current
        path = kube.resource_path("", "v1", "events", self.namespace)
        try:
            events = await self.client.list(path, field_selector=f"reason={safetynet.FAILED_PRE_STOP_HOOK}")
        except kube.ApiError as exc:
            self.logger.warning("cannot read the FailedPreStopHook events: %s", exc)
            return current
        self.hooks_read = time.monotonic()
        previous = current.failedHooks if current is not None else []
        hooks = safetynet.failed_hooks(events, spec.workload, previous)
        for hook in hooks:
            if hook not in previous:
                kopf.event(
                    self.body,
                    type="Warning",
                    reason=safetynet.FAILED_PRE_STOP_HOOK,
                    message=f"pod {hook.pod} left with a failed preStop hook at {hook.time}: the safety net did"
                    " not drain it, and data held only there may be lost",
                )
        return specs.SafetyNetStatus(failedHooks=hooks) if hooks else current

    async def create_request(self, spec: specs.MemoryPolicySpec, count: int, generation: int, *, attempt: int) -> None:
        body = {
            "apiVersion": specs.API_VERSION,
            "kind": "RetirementRequest",
            "metadata": {
                # Named by the policy's generation and attempt: a pass that is repeated after a
                # restart gets 409 for the request it already made, instead of making a second.
                "name": f"{self.name}-g{generation}-{attempt}",
                "namespace": self.namespace,
                "labels": {POLICY_LABEL: self.name},
                "annotations": {GENERATION_ANNOTATION: str(generation)},
                "ownerReferences": [
                    {
                        "apiVersion": specs.API_VERSION,
                        "kind": "MemoryPolicy",
                        "name": self.name,
                        "uid": str(self.body.metadata.uid),
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "spec": {
                "scheduler": spec.scheduler.model_dump(mode="json", exclude_none=True),
                "workload": spec.workload.model_dump(mode="json"),
                "count": count,
                "timeout": spec.drain.timeout,
                "onTimeout": spec.drain.onTimeout.value,
            },
        }
        try:
            await self.client.request(
                "POST", kube.resource_path(specs.GROUP, specs.VERSION, "retirementrequests", self.namespace), body=body
            )
        except kube.ApiError as exc:
            if exc.code != 409:
                raise

    async def report_error(self, exc: Exception) -> None:
        """A pass failed unexpectedly: the policy is not Ready, and its condition says why."""
        generation = int(self.body.metadata.get("generation", 1))
        try:
            old = specs.MemoryPolicyStatus.model_validate(_own(self.body.get("status")))
        except pydantic.ValidationError:
            old = specs.MemoryPolicyStatus()  # unreadable: written afresh
        status = old.model_copy(deep=True, update={"observedGeneration": generation})
        try:
            await self.not_ready(old, status, "InternalError", f"{type(exc).__name__}: {exc}", generation)
        except Exception as again:  # the status cannot be written either: the next pass tries again
            self.logger.warning("could not record the failure: %s", again)

    async def not_ready(
        self,
        old: specs.MemoryPolicyStatus,
        status: specs.MemoryPolicyStatus,
        reason: str,
        message: str,
        generation: int,
    ) -> None:
        status.message = message
        status.conditions = conditions.with_kstatus(status.conditions, generation=generation, stalled=(reason, message))
        status.conditions = conditions.set_condition(
            status.conditions, "Ready", False, reason=reason, message=message, generation=generation
        )
        await self.write(old, status)

    async def write(self, old: specs.MemoryPolicyStatus, status: specs.MemoryPolicyStatus) -> None:
        if status == old:
            return  # nothing changed: no write, no watch event, no resourceVersion churn
        only_memory = status.model_copy(update={"memory": old.memory}) == old
        if only_memory and time.monotonic() - self.written < _MEMORY_REFRESH_SECONDS:
            return  # memory figures move on every pass; refreshing them costs a write each time
        patch = status.model_dump(mode="json", exclude_none=True)
        # A merge patch keeps what it does not mention: a field that went away is sent as null.
        patch.update({k: None for k, v in old.model_dump(exclude_none=True).items() if k not in patch})
        await self.client.merge_patch(self.path + "/status", {"status": patch})
        self.written = time.monotonic()


def _memory_status(snapshot: snapshots.SchedulerSnapshot) -> specs.MemoryStatus:
    usage = autoscaling.usage_of(snapshot.workers)
    return specs.MemoryStatus(
        bytes=usage.held,
        limitBytes=usage.limit,
        percent=round(usage.utilization),
        workers=[
            specs.WorkerMemory(
                pod=w.name,
                bytes=w.process_bytes + w.spilled_bytes,
                spilledBytes=w.spilled_bytes,
                percent=round(100 * (w.process_bytes + w.spilled_bytes) / w.memory_limit) if w.memory_limit else 0,
            )
            for w in sorted(snapshot.workers, key=lambda w: w.name)
        ],
    )


def _remember(
    history: list[specs.Recommendation], now: float, replicas: int, spec: specs.AutoscaleSpec
) -> list[specs.Recommendation]:
    """Keep, for each recommended count, only when it was last recommended within the windows:
    that is all the stabilization (a min and a max over a window) needs."""
    window = max(spec.behavior.scaleUp.stabilizationWindowSeconds, spec.behavior.scaleDown.stabilizationWindowSeconds)
    kept = [r for r in history if r.replicas != replicas and r.time > now - window]
    return [*kept, specs.Recommendation(time=now, replicas=replicas)]


def _recent_events(events: list[specs.ScaleEvent], now: float, spec: specs.MemoryPolicySpec) -> list[specs.ScaleEvent]:
    rules = spec.autoscale.behavior if spec.autoscale is not None else specs.Behavior()
    period = max((p.periodSeconds for r in (rules.scaleUp, rules.scaleDown) for p in r.policies), default=0)
    return [e for e in events if e.time > now - period]


def _own(raw: Any) -> dict[str, Any]:
    fields = specs.MemoryPolicyStatus.model_fields
    return {k: v for k, v in dict(raw or {}).items() if k in fields}


def _request_size(request: dict[str, Any]) -> int:
    workers = request.get("status", {}).get("workers")
    return len(workers) if workers else int(request.get("spec", {}).get("count") or 1)


def _latest_failure(requests: list[dict[str, Any]]) -> dict[str, Any] | None:
    finished = sorted(
        (r for r in requests if r.get("status", {}).get("phase") in _TERMINAL),
        key=lambda r: r.get("status", {}).get("completionTime", ""),
    )
    return finished[-1] if finished and finished[-1]["status"]["phase"] == specs.Phase.FAILED.value else None


_LISTED = {
    "memorypolicies": (specs.GROUP, specs.VERSION),
    "horizontalpodautoscalers": ("autoscaling", "v2"),
    "retirementrequests": (specs.GROUP, specs.VERSION),
}


class Cache:
    """What every pass of every policy reads, kept current by Kopf's watches (Kopf indexes).

    An informer's cache, in Kopf's terms: without it each policy would list three kinds every
    few seconds, which at 100 policies is thousands of API requests a minute at rest.
    """

    def __init__(self, indexes: dict[str, Any]):
        self.indexes = indexes

    def of(self, plural: str) -> Any:
        return self.indexes[INDEX_NAMES[plural]]


def _slim(body: kopf.Body) -> dict[str, Any]:
    """What the passes read of an object; the managed fields would only cost memory."""
    meta = {k: v for k, v in dict(body.get("metadata", {})).items() if k != "managedFields"}
    return {"metadata": meta, "spec": dict(body.get("spec", {})), "status": dict(body.get("status", {}) or {})}


INDEX_NAMES = {
    "deployments": "memops_deployments",
    "memorypolicies": "memops_policies",
    "horizontalpodautoscalers": "memops_hpas",
    "retirementrequests": "memops_policy_requests",
}


def register(registry: kopf.OperatorRegistry) -> None:
    @kopf.index(specs.GROUP, specs.VERSION, "memorypolicies", registry=registry, id="memops_policies")
    def memops_policies(
        namespace: str | None, uid: str, body: kopf.Body, memo: kopf.Memo, **_: Any
    ) -> dict[tuple[str, ...], dict[str, Any]]:
        # Every change of a policy passes here first (Kopf updates the daemon's body, then its
        # indexes): wake that policy's daemon, which checks whether its generation moved.
        waker = getattr(memo, "policy_wakers", {}).get(uid)
        if waker is not None:
            waker.set()
        return {(namespace or "",): _slim(body)}

    @kopf.index("apps", "v1", "deployments", registry=registry, id="memops_deployments")
    def memops_deployments(
        namespace: str | None, name: str, body: kopf.Body, **_: Any
    ) -> dict[tuple[str, ...], dict[str, Any]]:
        # Only what a pass reads: the replicas, the selector and the status; not the pod template.
        spec = body.get("spec", {})
        slim = _slim(body)
        slim["spec"] = {"replicas": spec.get("replicas", 1), "selector": spec.get("selector", {})}
        return {(namespace or "", name): slim}

    @kopf.index("autoscaling", "v2", "horizontalpodautoscalers", registry=registry, id="memops_hpas")
    def memops_hpas(namespace: str | None, body: kopf.Body, **_: Any) -> dict[tuple[str, ...], dict[str, Any]]:
        return {(namespace or "",): _slim(body)}

    @kopf.index(
        specs.GROUP,
        specs.VERSION,
        "retirementrequests",
        registry=registry,
        id="memops_policy_requests",
        labels={POLICY_LABEL: kopf.PRESENT},
    )
    def memops_policy_requests(
        namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any
    ) -> dict[tuple[str, ...], dict[str, Any]]:
        return {(namespace or "", labels[POLICY_LABEL]): _slim(body)}

    # The backoff lets a deleted policy's daemon finish removing its relief before it is cancelled.
    @kopf.daemon(
        specs.GROUP,
        specs.VERSION,
        "memorypolicies",
        registry=registry,
        id="policy",
        cancellation_backoff=5.0,
        cancellation_timeout=5.0,
    )
    async def policy(
        body: kopf.Body,
        memo: kopf.Memo,
        logger: logging.Logger | logging.LoggerAdapter[Any],
        stopped: kopf.DaemonStopped,
        **kwargs: Any,
    ) -> None:
        cache = Cache({name: kwargs[name] for name in INDEX_NAMES.values()})
        reconciler = Policy(client=memo.kube, body=body, logger=logger, cache=cache)
        uid = str(body.metadata.uid)
        waker = memo.policy_wakers.setdefault(uid, asyncio.Event())
        try:
            await _loop(reconciler, body, stopped, waker, logger)
        finally:
            memo.policy_wakers.pop(uid, None)
            if stopped.reason is not None and kopf.DaemonStoppingReason.RESOURCE_DELETED in stopped.reason:
                if (body.get("status") or {}).get("pressure") and await reconciler.scheduler_is_tenant():
                    await relief_install.remove(body, security=reconciler.security, logger=logger)


async def _loop(
    reconciler: Policy,
    body: kopf.Body,
    stopped: kopf.DaemonStopped,
    waker: asyncio.Event,
    logger: logging.Logger | logging.LoggerAdapter[Any],
) -> None:
    """Reconcile, then wait for a spec change (woken by the policies index) or the idle time."""
    failures = 0
    while not stopped:
        generation = body.metadata.get("generation")
        try:
            await reconciler.reconcile()
            failures = 0
        except (kube.ApiError, daskrpc.SchedulerUnreachable) as exc:
            metrics.reconcile_error("MemoryPolicy", reconciler.namespace)
            logger.warning("will retry: %s", exc)
        except Exception as exc:  # anything else becomes the policy's condition, never a crash loop
            failures += 1
            metrics.reconcile_error("MemoryPolicy", reconciler.namespace)
            logger.error("will retry: %s: %s", type(exc).__name__, exc, exc_info=exc)
            await reconciler.report_error(exc)
        # Wake at once when the spec changes (kubectl scale, an HPA, a GitOps commit: Kopf
        # keeps the body current), else every few seconds to follow drains and drift
        # (every 10 s for a plain policy at rest: see Policy.steady); after failures in a
        # row, a little longer each time.
        idle = _STEADY_SECONDS if reconciler.steady else _IDLE_SECONDS
        idle = min(idle * max(failures, 1), _MAX_RETRY_SECONDS)
        deadline = time.monotonic() + idle
        while not stopped and body.metadata.get("generation") == generation:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            waker.clear()
            woken = asyncio.ensure_future(waker.wait())
            stopping = asyncio.ensure_future(stopped.wait())
            try:
                await asyncio.wait({woken, stopping}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            finally:
                woken.cancel()
                stopping.cancel()
