"""RetirementRequest: choose workers, drain them through the scheduler, then remove their pods.

One Kopf daemon per request. Kopf starts it when the request appears and again for every
request after an operator restart; the daemon reads the request's status and the scheduler
and carries on from there, so nothing lives only in this process. It exits once the phase
is Succeeded or Failed. The decisions are pure functions in :mod:`memops.snapshots` and
:mod:`memops.drain_decisions`; this module reads, calls them, and writes.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

import kopf
import pydantic

from memops import (
    conditions,
    daskrpc,
    drain_decisions,
    eviction,
    kube,
    metrics,
    objects,
    selectors,
    snapshots,
    specs,
    tenancy,
    timestamps,
)
from memops.controllers import loop, scheduler_tls, vetting, workloads

_RETRY_SECONDS = 2.0
_MAX_RETRY_SECONDS = 30.0  # the wait grows with each failure in a row, up to this
_RPC_SECONDS = 10.0  # one call to the scheduler; a drain's own wait is bounded by spec.timeout


def _explain(exc: Exception) -> tuple[str, str, bool]:
    """(reason, message, transient) for an exception raised by a step."""
    if isinstance(exc, kube.ApiError):
        return "ApiError", f"Kubernetes API: {exc}", True
    if isinstance(exc, daskrpc.SchedulerUnreachable):
        return "SchedulerUnreachable", f"spec.scheduler.address: {exc}", True
    if isinstance(exc, scheduler_tls.SecretUnusable):
        return "SecretUnusable", str(exc), False
    return "InternalError", f"{type(exc).__name__}: {exc}", False


class Retirement:
    """The work on one RetirementRequest; its only state is the request's status."""

    def __init__(self, *, client: kube.Kube, body: kopf.Body, logger: logging.Logger | logging.LoggerAdapter[Any]):
        self.client = client
        self.body = body
        self.logger = logger
        self.namespace = str(body.metadata.namespace)
        self.name = str(body.metadata.name)
        self.path = kube.resource_path(specs.GROUP, specs.VERSION, "retirementrequests", self.namespace, self.name)
        self.before: snapshots.SchedulerSnapshot | None = None
        self._rejected_generation = 0

    # -- the loop -----------------------------------------------------------------------------

    async def run(self, stopped: kopf.DaemonStopped) -> None:
        # Read once: from here on this daemon is the status' only writer, so the copy it
        # wrote last is the truth (Kopf's live body may lag behind by a watch event).
        raw = _own_status(self.body.get("status"))
        try:
            status = specs.RetirementRequestStatus.model_validate(raw)
        except pydantic.ValidationError as exc:
            await self.fail_unreadable(raw, exc, stopped)
            return

        async def one_pass() -> loop.Next | None:
            nonlocal status
            if status.phase in objects.TERMINAL_PHASES:
                return None
            before = status.model_copy(deep=True)
            status = await self.step(status)
            if conditions.is_true(status.conditions, "Retrying"):
                status = await self.recovered(status)
            if status.phase in objects.TERMINAL_PHASES:
                return None
            # Progress goes on at once; no progress waits before trying again.
            return loop.Next(seconds=0.0 if status != before else _RETRY_SECONDS)

        async def on_error(exc: Exception) -> loop.Next | None:
            nonlocal status
            status = await self.trouble(status, exc)
            if status.phase in objects.TERMINAL_PHASES:
                return None
            return loop.Next(seconds=_RETRY_SECONDS, failures=loop.Failures.COUNT)

        await loop.run(one_pass, on_error, stopped=stopped, max_seconds=_MAX_RETRY_SECONDS)

    async def trouble(self, status: specs.RetirementRequestStatus, exc: Exception) -> specs.RetirementRequestStatus:
        """A step raised: say so in a condition and retry; past the deadline, fail (and keep the pods).

        The API server and the scheduler may come back, so their errors are retried for as long
        as it takes (a drain that already started must still finish its removals); anything
        else (a missing Secret, a bug) is retried until the request's deadline only.
        """
        metrics.reconcile_error("RetirementRequest", self.namespace)
        reason, message, transient = _explain(exc)
        if transient:
            self.logger.warning("will retry: %s", message)
        else:  # a traceback only for what memops did not foresee
            self.logger.error(
                "will retry until the deadline: %s", message, exc_info=exc if reason == "InternalError" else None
            )
        generation = status.observedGeneration or int(self.body.metadata.get("generation", 1))
        try:
            deadline = self.deadline(status)
            if not transient and (deadline is None or timestamps.now() >= deadline):
                return await self.fail(status, reason, f"{message}; gave up at spec.timeout", generation)
            until = f"; retrying until {timestamps.render(deadline)}" if deadline and not transient else "; retrying"
            status.conditions = conditions.set_condition(
                status.conditions, "Retrying", True, reason=reason, message=message + until, generation=generation
            )
            await self.write(status)
        except Exception as again:  # the status cannot be written either: the next attempt tries again
            self.logger.warning("could not record the failure: %s", again)
        return status

    async def recovered(self, status: specs.RetirementRequestStatus) -> specs.RetirementRequestStatus:
        status.conditions = conditions.set_condition(
            status.conditions, "Retrying", False, reason="Recovered", generation=status.observedGeneration
        )
        try:
            await self.write(status)
        except Exception as exc:
            self.logger.warning("could not record the recovery: %s", exc)
        return status

    def deadline(self, status: specs.RetirementRequestStatus) -> datetime.datetime | None:
        """The accepted deadline; before the start, creation plus spec.timeout (None if unreadable)."""
        try:
            if status.deadline:
                return timestamps.parse(status.deadline)
            created = timestamps.parse(str(self.body.metadata["creationTimestamp"]))
            return created + specs.parse_duration(str(self.body.spec.get("timeout", "10m")), specs.MAX_DURATION)
        except (KeyError, ValueError):
            return None

    async def fail_unreadable(
        self, raw: dict[str, Any], error: pydantic.ValidationError, stopped: kopf.DaemonStopped
    ) -> None:
        """A status this operator cannot read (written by another version, or by hand): fail the
        request, touching no pod. Only phase, message and conditions are written; the rest stays."""
        if raw.get("phase") in objects.TERMINAL_PHASES:
            return
        problems = drain_decisions.explain_invalid(error, "status")
        message = f"the request's status cannot be read, so memops does nothing more: {problems}"
        generation = int(self.body.metadata.get("generation", 1))
        failed = conditions.set_condition(
            [], "Failed", True, reason="InvalidStatus", message=message, generation=generation
        )
        patch = {
            "phase": specs.Phase.FAILED.value,
            "message": message,
            "completionTime": timestamps.render(timestamps.now()),
            "conditions": [c.model_dump(mode="json") for c in failed],
        }
        while not stopped:
            try:
                await self.client.merge_patch(self.path + "/status", {"status": patch})
            except Exception as exc:
                self.logger.warning("could not record the failure: %s", exc)
                await stopped.wait(_MAX_RETRY_SECONDS)
            else:
                kopf.event(self.body, type="Warning", reason="InvalidStatus", message=message)
                return

    async def step(self, status: specs.RetirementRequestStatus) -> specs.RetirementRequestStatus:
        generation = int(self.body.metadata.get("generation", 1))
        if status.phase == specs.Phase.PENDING:
            try:
                spec = specs.RetirementRequestSpec.model_validate(dict(self.body.spec))
            except pydantic.ValidationError as exc:
                return await self.fail(status, "InvalidSpec", drain_decisions.explain_invalid(exc), generation)
            return await self.start(spec, status, generation)
        await self.refuse_spec_changes(status, generation)
        # Once started, only the spec accepted at the start counts: a request is one-shot.
        assert status.acceptedSpec is not None
        return await self.drain(status.acceptedSpec, status)

    # -- starting -----------------------------------------------------------------------------

    async def start(
        self, spec: specs.RetirementRequestSpec, status: specs.RetirementRequestStatus, generation: int
    ) -> specs.RetirementRequestStatus:
        created = timestamps.parse(str(self.body.metadata["creationTimestamp"]))
        deadline = created + specs.parse_duration(spec.timeout)
        workload = await workloads.get(self.client, self.namespace, spec.workload)
        if workload is None:
            return await self.fail(
                status,
                "WorkloadNotFound",
                f"spec.workload.name: {spec.workload.kind} "
                f"{spec.workload.name!r} not found in namespace {self.namespace}",
                generation,
            )
        try:
            workloads.selector(workload)
        except selectors.InvalidSelector as exc:
            message = f"{spec.workload.kind} {spec.workload.name!r}: {exc}"
            return await self.fail(status, "InvalidSelector", message, generation)
        judge = vetting.Tenancy(self.client, self.namespace)
        try:
            wait = min(_RPC_SECONDS, max((deadline - timestamps.now()).total_seconds(), 1.0))
            # Identity only (no code sent) until the scheduler is shown to be this namespace's,
            # then the snapshot on that same connection, of the workers that were vouched for.
            async with vetting.vetted(self.client, self.namespace, spec.scheduler, timeout=wait, vouch=judge) as vetted:
                snapshot = await vetted.snapshot()
        except daskrpc.Unvouched as exc:
            return await self.refuse_scheduler(status, exc.verdict, deadline, generation)
        except daskrpc.SchedulerMisbehaved as exc:  # not a Dask scheduler, or a hostile one: never retried
            return await self.fail(status, "SchedulerMisbehaved", f"spec.scheduler.address: {exc}", generation)
        except daskrpc.SchedulerUnreachable as exc:
            status.conditions = conditions.set_condition(
                status.conditions,
                "SchedulerReachable",
                False,
                reason="SchedulerUnreachable",
                message=f"spec.scheduler.address: {exc}; retrying until {timestamps.render(deadline)}",
                generation=generation,
            )
            if timestamps.now() >= deadline:
                return await self.fail(status, "SchedulerUnreachable", f"spec.scheduler.address: {exc}", generation)
            await self.write(status)
            return status
        pods = await workloads.pods(self.client, self.namespace, spec.workload, workload)
        pod_names = [p["metadata"]["name"] for p in pods]
        infos = [workloads.pod_info(p) for p in pods]
        located = snapshots.workers_by_pod(infos, snapshot.workers)
        unknown = snapshots.unidentified(infos, located)
        taken = drain_decisions.claimed_by_others(pods, self.name)
        if spec.workers is not None:
            for index, pod in enumerate(spec.workers):
                if pod not in pod_names:
                    return await self.fail(
                        status,
                        "WorkerNotFound",
                        f"spec.workers[{index}]: pod {pod!r} is not a running"
                        f" pod of {spec.workload.kind} {spec.workload.name!r}",
                        generation,
                    )
                if pod in taken:
                    return await self.fail(
                        status,
                        "WorkerClaimed",
                        f"spec.workers[{index}]: pod {pod!r} is already being retired by another RetirementRequest",
                        generation,
                    )
            chosen = list(dict.fromkeys(spec.workers))  # a set, whatever let a repeat through
        else:
            assert spec.count is not None
            with metrics.deciding("choose_workers"):
                chosen = snapshots.choose_workers(
                    pod_names, snapshot, spec.count, exclude=taken | set(unknown), located=located
                )
        if unknown:
            status.conditions = conditions.set_condition(
                status.conditions,
                "WorkersUnidentified",
                True,
                reason="NoWorkerAtPodAddress",
                message=drain_decisions.unidentified_message(unknown),
                generation=generation,
            )
        if not chosen:
            message = "no worker could be chosen: every pod is taken or none exists"
            if unknown:
                message += f"; {drain_decisions.unidentified_message(unknown)}"
            return await self.fail(status, "NoWorkers", message, generation)
        for pod_object in pods:
            if pod_object["metadata"]["name"] in chosen:
                await workloads.claim_pod(self.client, pod_object, self.name)  # 409/422: another request won; retry
        started = timestamps.now()
        status = status.model_copy(
            update={
                "phase": specs.Phase.DRAINING,
                "observedGeneration": generation,
                "startTime": timestamps.render(started),
                "deadline": timestamps.render(started + specs.parse_duration(spec.timeout)),
                "onTimeout": spec.onTimeout,
                "acceptedSpec": spec,
                "requested": spec.count if spec.count is not None else len(chosen),
                "workers": [drain_decisions.entry(pod, located.get(pod, ()), unknown=pod in unknown) for pod in chosen],
            }
        )
        status.conditions = conditions.set_condition(
            status.conditions, "SchedulerReachable", True, reason="Connected", generation=generation
        )
        status.conditions = conditions.set_condition(
            status.conditions,
            "Draining",
            True,
            reason="DrainStarted",
            message=f"draining {len(chosen)} workers: {', '.join(chosen)}",
            generation=generation,
        )
        await self.write(status)
        metrics.drain_started(self.namespace)
        kopf.event(
            self.body,
            type="Normal",
            reason="DrainStarted",
            message=f"draining {len(chosen)} workers through the scheduler: {', '.join(chosen)}",
        )
        return status

    async def refuse_scheduler(
        self,
        status: specs.RetirementRequestStatus,
        verdict: tenancy.Verdict,
        deadline: datetime.datetime,
        generation: int,
    ) -> specs.RetirementRequestStatus:
        """The scheduler is not shown to be this namespace's: nothing is asked of it or written
        about it. Retried until the deadline, as an unreachable scheduler is (a worker may be
        joining, or its pod just gone), then Failed."""
        status.conditions = conditions.set_condition(
            status.conditions,
            "SchedulerReachable",
            False,
            reason=verdict.reason.value,
            message=f"spec.scheduler.address: {verdict.message}; retrying until {timestamps.render(deadline)}",
            generation=generation,
        )
        if timestamps.now() >= deadline:
            message = f"spec.scheduler.address: {verdict.message}"
            return await self.fail(status, verdict.reason.value, message, generation)
        await self.write(status)
        return status

    # -- draining -------------------------------------------------------------------------------

    async def drain(
        self, spec: specs.RetirementRequestSpec, status: specs.RetirementRequestStatus
    ) -> specs.RetirementRequestStatus:
        on_timeout = status.onTimeout or specs.OnTimeout.ABORT
        deadline = timestamps.parse(status.deadline)
        draining = [w for w in status.workers if w.state == specs.WorkerState.DRAINING and not w.removable]
        if draining:
            status = await self.retire(spec.scheduler, status, draining, deadline, on_timeout)
        if drain_decisions.to_remove(status.workers):
            if spec.removePods:
                status = await self.remove(spec, status, deadline)
            else:  # an eviction's drain: the evicting client removes the pods, which the gate now admits
                status.workers = eviction.mark_drained(status.workers)
                await self.write(status)
        if any(w.state == specs.WorkerState.DRAINING for w in status.workers):
            return status
        return await self.finish(status)

    async def retire(
        self,
        scheduler: specs.SchedulerRef,
        status: specs.RetirementRequestStatus,
        draining: list[specs.WorkerStatus],
        deadline: datetime.datetime,
        on_timeout: specs.OnTimeout,
    ) -> specs.RetirementRequestStatus:
        judge = vetting.Tenancy(self.client, self.namespace)
        try:
            # Everything on the one connection whose workers the tenancy check vouched for: the
            # holdings before, the retirement, and the holdings after.
            vetted_scheduler = vetting.vetted(self.client, self.namespace, scheduler, timeout=_RPC_SECONDS, vouch=judge)
            async with vetted_scheduler as vetted:
                addresses = [a for w in draining for a in (w.addresses or ([w.address] if w.address else []))]
                if self.before is None:
                    # Who holds each key of these workers now, to tell afterwards what moved.
                    self.before = await vetted.snapshot(placement_of=addresses, processing=False)
                remaining = max((deadline - timestamps.now()).total_seconds(), 0.0)
                # Every worker's node: off the drained workers' nodes first where those nodes are
                # going (a node drain); else spilled keys go to neighbours there, by link.
                nodes = snapshots.nodes_of_workers(judge.pods, vetted.workers)
                outcome = await vetted.retire_workers(
                    addresses,
                    timeout=remaining,
                    nodes=nodes,
                    nodes_dying=eviction.drains_node(self.body.metadata.get("labels")),
                )
                after = await vetted.snapshot(placement=list(self.before.who_has), processing=False)
        except daskrpc.Unvouched as exc:
            return await self.refuse_drain(status, exc.verdict, deadline, on_timeout)
        except daskrpc.SchedulerUnreachable as exc:
            if timestamps.now() < deadline:
                status.conditions = conditions.set_condition(
                    status.conditions,
                    "SchedulerReachable",
                    False,
                    reason="SchedulerUnreachable",
                    message=f"{exc}; retrying until {status.deadline}",
                    generation=status.observedGeneration,
                )
                await self.write(status)
                return status
            status.workers = drain_decisions.judge_unreachable(status.workers, on_timeout=on_timeout, reason=str(exc))
            await self.write(status)
            return status
        status.workers = drain_decisions.judge_drain(
            status.workers,
            before=self.before,
            after=after,
            retired=outcome.retired,
            timed_out=outcome.timed_out,
            on_timeout=on_timeout,
            located=snapshots.workers_by_pod(judge.pods, after.workers),
            lost_at_deadline=outcome.lost_at_deadline,
            linked=outcome.linked,
        )
        status.conditions = conditions.set_condition(
            status.conditions, "SchedulerReachable", True, reason="Connected", generation=status.observedGeneration
        )
        await self.write(status)
        for worker in status.workers:
            if worker.state == specs.WorkerState.KEPT:
                kopf.event(self.body, type="Warning", reason="WorkerKept", message=f"{worker.pod}: {worker.message}")
            elif worker.state == specs.WorkerState.FORCED:
                kopf.event(self.body, type="Warning", reason="WorkerForced", message=f"{worker.pod}: {worker.message}")
        return status

    async def refuse_drain(
        self,
        status: specs.RetirementRequestStatus,
        verdict: tenancy.Verdict,
        deadline: datetime.datetime,
        on_timeout: specs.OnTimeout,
    ) -> specs.RetirementRequestStatus:
        """The scheduler stopped being shown as this namespace's mid-drain: retire nothing there;
        at the deadline judge the pods as with an unreachable scheduler."""
        if timestamps.now() < deadline:
            status.conditions = conditions.set_condition(
                status.conditions,
                "SchedulerReachable",
                False,
                reason=verdict.reason.value,
                message=f"{verdict.message}; retrying until {status.deadline}",
                generation=status.observedGeneration,
            )
        else:
            status.workers = drain_decisions.judge_unreachable(
                status.workers, on_timeout=on_timeout, reason=verdict.message
            )
        await self.write(status)
        return status

    async def remove(
        self,
        spec: specs.RetirementRequestSpec,
        status: specs.RetirementRequestStatus,
        deadline: datetime.datetime,
    ) -> specs.RetirementRequestStatus:
        workload_ref = spec.workload
        pods = drain_decisions.to_remove(status.workers)
        if status.scaleDown is None or not set(pods) <= set(status.scaleDown.pods):
            blockers = await workloads.outranking_pods(self.client, self.namespace, workload_ref, pods)
            if blockers:
                message = (
                    f"waiting: pods {', '.join(blockers)} are not ready, and the ReplicaSet would remove"
                    " them before the drained ones"
                )
                if timestamps.now() >= deadline:
                    status.workers = drain_decisions.keep_blocked(status.workers, message)
                    await self.write(status)
                    return status
                status.conditions = conditions.set_condition(
                    status.conditions,
                    "Draining",
                    True,
                    reason="WaitingForPods",
                    message=message,
                    generation=status.observedGeneration,
                )
                await self.write(status)
                return status
            try:
                deployments = await workloads.worker_deployments(self.client, self.namespace, workload_ref, pods)
            except workloads.ForeignDeployment as exc:
                status.workers = drain_decisions.keep_blocked(status.workers, f"waiting: {exc}")
                status.conditions = conditions.set_condition(
                    status.conditions,
                    "Draining",
                    True,
                    reason="ForeignDeployment",
                    message=f"refused to delete: {exc}",
                    generation=status.observedGeneration,
                )
                await self.write(status)
                return status
            await workloads.mark_for_deletion(self.client, self.namespace, workload_ref, pods)
            replicas = await workloads.replicas(self.client, self.namespace, workload_ref)
            # Recorded before the scale-down is ordered: a restarted operator must not lower it twice.
            status.scaleDown = specs.ScaleDown(
                pods=pods,
                replicasFrom=replicas,
                replicasTo=max(replicas - len(pods), 0),
                deployments=deployments,
            )
            await self.write(status)
        assert status.scaleDown is not None
        await workloads.remove(self.client, self.namespace, workload_ref, status.scaleDown)
        gone = await workloads.wait_pods_gone(self.client, self.namespace, pods, timeout=60)
        status.workers = drain_decisions.mark_removed(status.workers, gone)
        await self.write(status)
        for pod in gone:
            kopf.event(self.body, type="Normal", reason="PodRemoved", message=f"{pod}: drained and removed")
        return status

    async def finish(self, status: specs.RetirementRequestStatus) -> specs.RetirementRequestStatus:
        requested = status.requested or len(status.workers)
        status = drain_decisions.conclude(status, requested=requested, at=timestamps.render(timestamps.now()))
        succeeded = status.phase == specs.Phase.SUCCEEDED
        status.conditions = conditions.set_condition(
            status.conditions,
            "Draining",
            False,
            reason="Finished",
            message=status.message,
            generation=status.observedGeneration,
        )
        status.conditions = conditions.set_condition(
            status.conditions,
            "Complete" if succeeded else "Failed",
            True,
            reason="Retired" if succeeded else "WorkersKept",
            message=status.message,
            generation=status.observedGeneration,
        )
        if status.bytesLost:
            status.conditions = conditions.set_condition(
                status.conditions,
                "DataLost",
                True,
                reason="Forced",
                message=f"{status.bytesLost} bytes lost by forced removal (onTimeout: Force)",
                generation=status.observedGeneration,
            )
        await workloads.release_claims(
            self.client,
            self.namespace,
            [w.pod for w in status.workers if not w.podRemoved],
            self.name,
            keep_cost=status.scaleDown.pods if status.scaleDown is not None else (),
        )
        await self.write(status)
        metrics.drain_finished(
            self.namespace,
            status,
            "Retired" if succeeded else "WorkersKept",
            _seconds(status.startTime, status.completionTime),
        )
        kopf.event(
            self.body,
            type="Normal" if succeeded else "Warning",
            reason="Succeeded" if succeeded else "Failed",
            message=status.message,
        )
        return status

    async def fail(
        self, status: specs.RetirementRequestStatus, reason: str, message: str, generation: int
    ) -> specs.RetirementRequestStatus:
        ordered = set(status.scaleDown.pods) if status.scaleDown is not None else set()
        status = status.model_copy(
            update={
                "phase": specs.Phase.FAILED,
                "message": message,
                "observedGeneration": generation,
                "completionTime": timestamps.render(timestamps.now()),
                # A drain that had started: every pod whose removal was not ordered is kept.
                "workers": drain_decisions.keep_unfinished(status.workers, f"{reason}: {message}", ordered=ordered),
            }
        )
        status.conditions = conditions.set_condition(
            status.conditions, "Failed", True, reason=reason, message=message, generation=generation
        )
        await self.write(status)
        kept = [w.pod for w in status.workers if w.state == specs.WorkerState.KEPT]
        if kept:
            try:
                await workloads.release_claims(self.client, self.namespace, kept, self.name)
            except kube.ApiError as exc:  # the request is Failed already; a stale claim only blocks others
                self.logger.warning("could not release the claims on %s: %s", ", ".join(kept), exc)
        metrics.drain_finished(self.namespace, status, reason, _seconds(status.startTime, status.completionTime))
        kopf.event(self.body, type="Warning", reason=reason, message=message)
        return status

    async def refuse_spec_changes(self, status: specs.RetirementRequestStatus, generation: int) -> None:
        if generation <= status.observedGeneration or generation == self._rejected_generation:
            return
        self._rejected_generation = generation
        message = (
            f"spec changed at generation {generation} after the drain started at generation"
            f" {status.observedGeneration}; a RetirementRequest is one-shot, so the change is ignored:"
            " create a new request instead"
        )
        status.conditions = conditions.set_condition(
            status.conditions, "SpecChangeRejected", True, reason="OneShot", message=message, generation=generation
        )
        await self.write(status)
        kopf.event(self.body, type="Warning", reason="SpecChangeRejected", message=message)

    # -- I/O helpers ----------------------------------------------------------------------------

    async def write(self, status: specs.RetirementRequestStatus) -> None:
        status.conditions = conditions.request_summary(status)
        body = status.model_dump(mode="json", exclude_none=True)
        await self.client.merge_patch(self.path + "/status", {"status": body})


def _seconds(start: str | None, end: str | None) -> float | None:
    if not start or not end:
        return None
    return (timestamps.parse(end) - timestamps.parse(start)).total_seconds()


def _own_status(raw: Any) -> dict[str, Any]:
    """The status fields memops owns (Kopf may keep its own bookkeeping there too)."""
    fields = specs.RetirementRequestStatus.model_fields
    return {k: v for k, v in dict(raw or {}).items() if k in fields}


def refused_change(raw_status: Any, generation: int) -> list[dict[str, Any]] | None:
    """Conditions to write when a finished request's spec changes (its daemon has exited)."""
    status = specs.RetirementRequestStatus.model_validate(_own_status(raw_status))
    if status.phase not in objects.TERMINAL_PHASES or generation <= status.observedGeneration:
        return None  # Pending: the daemon acts on the new spec; Draining: the daemon refuses it
    message = (
        f"spec changed at generation {generation} after the request finished ({status.phase});"
        " a RetirementRequest is one-shot, so the change is ignored: create a new request instead"
    )
    updated = conditions.set_condition(
        status.conditions, "SpecChangeRejected", True, reason="OneShot", message=message, generation=generation
    )
    return [c.model_dump(mode="json") for c in updated]


def register(registry: kopf.OperatorRegistry) -> None:
    @kopf.on.update(
        specs.GROUP, specs.VERSION, "retirementrequests", field="spec", registry=registry, id="refuse-spec-change"
    )
    async def refuse_spec_change(body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
        updated = refused_change(body.get("status"), int(body.metadata.get("generation", 1)))
        if updated is not None:
            patch.status["conditions"] = updated
            kopf.event(body, type="Warning", reason="SpecChangeRejected", message=updated[-1]["message"])

    @kopf.daemon(
        specs.GROUP, specs.VERSION, "retirementrequests", registry=registry, id="retire", cancellation_timeout=5.0
    )
    async def retire(
        body: kopf.Body,
        memo: kopf.Memo,
        logger: logging.Logger | logging.LoggerAdapter[Any],
        stopped: kopf.DaemonStopped,
        **_: Any,
    ) -> None:
        uid = str(body.metadata.uid)
        memo.retirement_daemons.add(uid)
        try:
            await Retirement(client=memo.kube, body=body, logger=logger).run(stopped)
        finally:
            memo.retirement_daemons.discard(uid)

    # The finalizer step: a request deleted mid-drain (or with its policy) gives its pods back,
    # so that another request can choose them and the ReplicaSet no longer ranks them first.
    @kopf.on.delete(specs.GROUP, specs.VERSION, "retirementrequests", registry=registry, id="release-claims")
    async def release_claims(
        body: kopf.Body, memo: kopf.Memo, logger: logging.Logger | logging.LoggerAdapter[Any], **_: Any
    ) -> None:
        if str(body.metadata.uid) in memo.retirement_daemons:
            # Released after the daemon has stopped: it could otherwise claim a pod after this.
            raise kopf.TemporaryError("waiting for the request's drain to stop", delay=1)
        status = specs.RetirementRequestStatus.model_validate(_own_status(body.get("status")))
        released = await workloads.release_claims(
            memo.kube,
            str(body.metadata.namespace),
            None,
            str(body.metadata.name),
            keep_cost=status.scaleDown.pods if status.scaleDown is not None else (),
        )
        if released:
            logger.info("released the claim on pods %s", ", ".join(released))
