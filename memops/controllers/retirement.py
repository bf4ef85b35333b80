"""RetirementRequest: choose workers, drain them through the scheduler, then remove their pods.

One Kopf daemon per request. Kopf starts it when the request appears and again for every
request after an operator restart; the daemon reads the request's status and the scheduler
and carries on from there, so nothing lives only in this process. It exits once the phase
is Succeeded or Failed. The decisions are pure functions in :mod:`memops.decisions.snapshots` and
:mod:`memops.decisions.drain_decisions`; this module reads, calls them, and writes.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
from typing import Any

import kopf
import pydantic

from memops import specs
from memops.clients import daskrpc, kube
from memops.controllers import loop, metrics, scheduler_tls, vetting, workloads
from memops.decisions import (
    conditions,
    drain_decisions,
    eviction_gate,
    objects,
    retirement_decisions,
    selectors,
    snapshots,
    timestamps,
)

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
        # The resourceVersion of this request's last listing of the namespace's pods (for the
        # tenancy check): the next step's listing is no older, and answered at once.
        self.pods_seen: str | None = None
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
            status = await self.step(status)  # a step that went through clears Retrying in its write
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
                message = f"{message}; gave up at spec.timeout"
                failed = retirement_decisions.fail(status, reason, message, generation=generation, now=timestamps.now())
                return await self.apply(status, failed, recovered=False)
            until = f"; retrying until {timestamps.render(deadline)}" if deadline and not transient else "; retrying"
            status.conditions = conditions.set_condition(
                status.conditions, "Retrying", True, reason=reason, message=message + until, generation=generation
            )
            await self.write(status)
        except Exception as again:  # the status cannot be written either: the next attempt tries again
            self.logger.warning("could not record the failure: %s", again)
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
        """One step: read the facts, decide, apply; at most one status write."""
        generation = int(self.body.metadata.get("generation", 1))
        if status.phase == specs.Phase.PENDING:
            decision = await self.start(status, generation)
        else:
            # Once started, only the spec accepted at the start counts: a request is one-shot.
            assert status.acceptedSpec is not None
            decision = await self.drain(status.acceptedSpec, status)
            decision = self.refuse_spec_changes(decision, status, generation)
        return await self.apply(status, decision)

    async def apply(
        self,
        status: specs.RetirementRequestStatus,
        decision: retirement_decisions.Decision,
        *,
        recovered: bool = True,
    ) -> specs.RetirementRequestStatus:
        """The decision's effects, in order: claims, pod ranking, released claims, events; the status
        last, and only if it changed. ``recovered``: the step went through, so Retrying clears."""
        for pod_object in decision.claim:
            await workloads.claim_pod(self.client, pod_object, self.name)  # 409/422: another request won; retry
        if decision.mark_for_deletion:
            assert status.acceptedSpec is not None
            workload = status.acceptedSpec.workload
            await workloads.mark_for_deletion(self.client, self.namespace, workload, list(decision.mark_for_deletion))
        if decision.release is not None:
            await self.release(decision.release)
        for event in decision.events:
            kopf.event(self.body, type=event.type, reason=event.reason, message=event.message)
        written = retirement_decisions.summarize(
            decision.status, was_retrying=recovered and conditions.is_true(status.conditions, "Retrying")
        )
        if written != status:
            await self.write(written)
        if decision.started:
            metrics.drain_started(self.namespace)
        if decision.finished is not None:
            seconds = _seconds(written.startTime, written.completionTime)
            metrics.drain_finished(self.namespace, written, decision.finished, seconds)
        return written

    async def release(self, release: retirement_decisions.Release) -> None:
        try:
            await workloads.release_claims(
                self.client, self.namespace, list(release.pods), self.name, keep_cost=release.keep_cost
            )
        except kube.ApiError as exc:
            if not release.tolerate_errors:
                raise
            self.logger.warning("could not release the claims on %s: %s", ", ".join(release.pods), exc)

    def refuse_spec_changes(
        self, decision: retirement_decisions.Decision, read: specs.RetirementRequestStatus, generation: int
    ) -> retirement_decisions.Decision:
        """A spec changed after the start is refused once, in the step's own write."""
        if generation <= read.observedGeneration or generation == self._rejected_generation:
            return decision
        self._rejected_generation = generation
        status = decision.status.model_copy(deep=True)
        status.conditions, event = retirement_decisions.refuse_spec_change(status, generation)
        return dataclasses.replace(decision, status=status, events=(event, *decision.events))

    # -- starting -----------------------------------------------------------------------------

    async def start(self, status: specs.RetirementRequestStatus, generation: int) -> retirement_decisions.Decision:
        now = timestamps.now()
        try:
            spec = specs.RetirementRequestSpec.model_validate(dict(self.body.spec))
        except pydantic.ValidationError as exc:
            return retirement_decisions.fail(
                status, "InvalidSpec", drain_decisions.explain_invalid(exc), generation=generation, now=now
            )
        created = timestamps.parse(str(self.body.metadata["creationTimestamp"]))
        deadline = created + specs.parse_duration(spec.timeout)
        facts = await self.read_start(spec)
        now = timestamps.now()
        with metrics.deciding("choose_workers"):
            return retirement_decisions.start(
                spec, status, facts, name=self.name, generation=generation, deadline=deadline, now=now
            )

    async def read_start(self, spec: specs.RetirementRequestSpec) -> retirement_decisions.StartFacts:
        """The workload, its pods and the vetted scheduler's snapshot; or what blocks the start."""
        Blocker = retirement_decisions.Blocker
        workload = await workloads.get(self.client, self.namespace, spec.workload)
        if workload is None:
            message = (
                f"spec.workload.name: {spec.workload.kind} "
                f"{spec.workload.name!r} not found in namespace {self.namespace}"
            )
            return retirement_decisions.StartFacts(blocker=Blocker("WorkloadNotFound", message))
        try:
            workloads.selector(workload)
        except selectors.InvalidSelector as exc:
            message = f"{spec.workload.kind} {spec.workload.name!r}: {exc}"
            return retirement_decisions.StartFacts(blocker=Blocker("InvalidSelector", message))
        # A full call's time even at the deadline: the last try's answer names the failure, and a try
        # cut to what is left of the deadline (a second, under load) would call a slow scheduler, or
        # one that a tenancy check refused on every earlier try, unreachable.
        judge = vetting.Tenancy(self.client, self.namespace, self.pods_seen)
        try:
            async with vetting.vetted(
                self.client, self.namespace, spec.scheduler, timeout=_RPC_SECONDS, vouch=judge, snapshot={}
            ) as found:
                snapshot = found.snapshot
                self.pods_seen = judge.seen
        except daskrpc.Unvouched as exc:
            return retirement_decisions.StartFacts(blocker=Blocker.unvouched(exc.verdict))
        except daskrpc.SchedulerMisbehaved as exc:  # not a Dask scheduler, or a hostile one: never retried
            message = f"spec.scheduler.address: {exc}"
            return retirement_decisions.StartFacts(blocker=Blocker("SchedulerMisbehaved", message))
        except daskrpc.SchedulerUnreachable as exc:
            return retirement_decisions.StartFacts(blocker=Blocker.unreachable(exc))
        # No older than the tenancy check's listing, moments ago: answered at once.
        pods = await workloads.pods(self.client, self.namespace, spec.workload, workload, not_older_than=self.pods_seen)
        infos = [workloads.pod_info(p) for p in pods]
        assert snapshot is not None
        return retirement_decisions.StartFacts(pods=pods, infos=infos, snapshot=snapshot)

    # -- draining -------------------------------------------------------------------------------

    async def drain(
        self, spec: specs.RetirementRequestSpec, status: specs.RetirementRequestStatus
    ) -> retirement_decisions.Decision:
        """One part of the drain per step, each ending in its own write: an ordered removal first
        (its scale-down recorded, then ordered), then the scheduler's retirement, then the end."""
        deadline = timestamps.parse(status.deadline)
        if drain_decisions.to_remove(status.workers):
            if not spec.removePods:
                return retirement_decisions.left_to_eviction(status)
            if retirement_decisions.needs_scale_down(status):
                facts = await self.read_removal(spec.workload, drain_decisions.to_remove(status.workers))
                return retirement_decisions.plan_scale_down(status, facts, deadline=deadline, now=timestamps.now())
            return await self.remove(spec.workload, status)
        if retirement_decisions.draining(status):
            return await self.retire(spec.scheduler, status, deadline)
        if any(w.state == specs.WorkerState.DRAINING for w in status.workers):
            return retirement_decisions.Decision(status=status)
        return retirement_decisions.conclude(status, now=timestamps.now())

    async def retire(
        self,
        scheduler: specs.SchedulerRef,
        status: specs.RetirementRequestStatus,
        deadline: datetime.datetime,
    ) -> retirement_decisions.Decision:
        """The scheduler's retirement of the draining workers: the one effect whose outcome is the
        fact that the decision judges (:func:`memops.decisions.drain_decisions.judge_drain`)."""
        on_timeout = status.onTimeout or specs.OnTimeout.ABORT
        judge = vetting.Tenancy(self.client, self.namespace, self.pods_seen)
        addresses = retirement_decisions.addresses(retirement_decisions.draining(status))
        try:
            # Everything on the one connection whose workers the tenancy check vouched for: the
            # holdings before, the retirement, and the holdings after.
            # Who holds each key of these workers now (once), to tell afterwards what moved.
            query = {"placement_of": addresses, "processing": False} if self.before is None else None
            reached = vetting.vetted(
                self.client, self.namespace, scheduler, timeout=_RPC_SECONDS, vouch=judge, snapshot=query
            )
            async with reached as found:
                self.pods_seen = judge.seen
                vetted = found.scheduler
                if self.before is None:
                    self.before = found.snapshot
                assert self.before is not None
                remaining = max((deadline - timestamps.now()).total_seconds(), 0.0)
                # Every worker's node: off the drained workers' nodes first where those nodes are
                # going (a node drain); else spilled keys go to neighbours there, by link.
                outcome = await vetted.retire_workers(
                    addresses,
                    timeout=remaining,
                    nodes=snapshots.nodes_of_workers(judge.pods, vetted.workers),
                    nodes_dying=eviction_gate.drains_node(self.body.metadata.get("labels")),
                )
                after = await vetted.snapshot(placement=list(self.before.who_has), processing=False)
        except daskrpc.Unvouched as exc:
            blocker = retirement_decisions.Blocker.unvouched(exc.verdict)
            return retirement_decisions.drain_blocked(status, blocker, deadline=deadline, now=timestamps.now())
        except daskrpc.SchedulerUnreachable as exc:
            blocker = retirement_decisions.Blocker.unreachable(exc)
            return retirement_decisions.drain_blocked(status, blocker, deadline=deadline, now=timestamps.now())
        workers = drain_decisions.judge_drain(
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
        return retirement_decisions.drained(status, workers)

    # -- removing -------------------------------------------------------------------------------

    async def read_removal(self, workload: specs.WorkloadRef, pods: list[str]) -> retirement_decisions.RemovalFacts:
        """What stands before the scale-down: not-ready pods the ReplicaSet would remove first, a
        worker Deployment that is not the workload's; else the replicas now."""
        blockers = await workloads.outranking_pods(self.client, self.namespace, workload, pods)
        if blockers:
            return retirement_decisions.RemovalFacts(outranking=blockers)
        try:
            deployments = await workloads.worker_deployments(self.client, self.namespace, workload, pods)
        except workloads.ForeignDeployment as exc:
            return retirement_decisions.RemovalFacts(foreign=str(exc))
        replicas = await workloads.replicas(self.client, self.namespace, workload)
        return retirement_decisions.RemovalFacts(deployments=deployments, replicas=replicas)

    async def remove(
        self, workload: specs.WorkloadRef, status: specs.RetirementRequestStatus
    ) -> retirement_decisions.Decision:
        """Order the recorded scale-down (again, after a restart: it is idempotent) and wait for its pods."""
        assert status.scaleDown is not None
        pods = drain_decisions.to_remove(status.workers)
        await workloads.remove(self.client, self.namespace, workload, status.scaleDown)
        gone = await workloads.wait_pods_gone(self.client, self.namespace, pods, timeout=60)
        return retirement_decisions.removed(status, gone)

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
