"""MemoryPolicy: keep a workload at the policy's replicas; every scale-down drains first.

One Kopf daemon per policy. Each pass reads the workload, the policy's own RetirementRequests,
the scheduler and what else touches the workload into one :class:`memops.decisions.policy_decisions.Inputs`,
decides with :func:`memops.decisions.policy_decisions.decide`, then applies the decision once: scale-up
raises the workload's replicas directly; scale-down creates a RetirementRequest that the policy
owns (visible with ``kubectl get retire``), which drains the chosen workers and removes exactly
their pods. ``kubectl scale mempol/NAME``, an HPA or KEDA whose target is the policy, and a
GitOps change of ``spec.replicas`` all land here. The daemon keeps nothing that matters in
memory: a restarted operator sees the requests and carries on.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import kopf
import pydantic

from memops import specs
from memops.clients import daskrpc, kube
from memops.controllers import (
    admission_install,
    kubelets,
    loop,
    metrics,
    placement_install,
    recycle,
    relief_install,
    replication_install,
    resize,
    scheduler_tls,
    vetting,
    workloads,
)
from memops.decisions import (
    autoscaling,
    conditions,
    disruption,
    drain_decisions,
    node_pressure,
    objects,
    policy_decisions,
    policy_findings,
    recycle_decisions,
    resize_decisions,
    safetynet,
    scaling,
    selectors,
    shapes,
    shared_spill,
    snapshots,
    tenancy,
    timestamps,
    worker_loss_decisions,
)
from memops.worker import links

_IDLE_SECONDS = 2.0
_STEADY_SECONDS = 10.0
_MEMORY_REFRESH_SECONDS = 15.0
"""A status change of the memory figures alone is written at most this often (the HPA's sync period)."""
_HOOK_EVENTS_SECONDS = 15.0
"""The namespace's FailedPreStopHook events are read at most this often per policy.

One list with a field selector (``reason=FailedPreStopHook``), which the API server filters: far
cheaper than a watch on every event of the cluster, which Kopf would have to filter itself.
"""
_MAX_RETRY_SECONDS = 30.0
_MAX_NAME_LENGTH = 63
"""A policy's name is a label value on its RetirementRequests (``memops.dev/policy``): 63 characters at most."""
_TENANCY_RECHECK_SECONDS = 60.0
"""The workers shown to be pods of the namespace are checked again at least this often."""
_SPILL_SECONDS = 30.0
"""The workers' shared spill (medium Node) is read into the status at most this often per policy: each
read is a call to every worker, which lists its spill directory."""
_DISRUPTION_SECONDS = 15.0
"""The disruption annotations are decided at most this often per policy: each time costs the
workers' unique bytes (the agent's holdings) and a list of the workload's pods. A node
autoscaler waits minutes before it removes a node (cluster-autoscaler's scale-down-unneeded-time,
10 min by default), so 15 s of delay leaves it nothing to remove in between."""
_REMOVALS = {
    "pressure": relief_install.remove,
    "replication": replication_install.remove,
    "placement": placement_install.remove,
    "tasks": admission_install.remove,
}
"""What a policy may set up in its scheduler, by the names of its spec's and its status' fields
(pressure relief, replication targets, placement and task admission), and what removes each."""
_KNOWN_WORKERS = 4096
"""Worker addresses whose pods the tenancy checks found, kept after the workers leave (the latest
this many): a departed worker's pod may be gone by the time its loss is read."""


@dataclasses.dataclass(frozen=True)
class Read:
    """What a pass read: the status as written last, the decision's inputs, and what the apply
    acts on (the workload, and the vouched-for scheduler on its one connection, when reached)."""

    old: specs.MemoryPolicyStatus
    inputs: policy_decisions.Inputs
    workload: dict[str, Any]
    scheduler: daskrpc.Scheduler | None = None
    snapshot: snapshots.SchedulerSnapshot | None = None


@dataclasses.dataclass(frozen=True)
class Blocked:
    """A pass that cannot act: the status as written last, and why."""

    old: specs.MemoryPolicyStatus
    blocker: policy_decisions.NotReady
    generation: int


class Policy:
    """One pass over one MemoryPolicy; every pass starts from what the cluster says."""

    def __init__(
        self,
        *,
        client: kube.Kube,
        body: kopf.Body,
        logger: logging.Logger | logging.LoggerAdapter[Any],
        cache: Cache | None = None,
        host_roots: frozenset[str] = frozenset(),
        protection: disruption.Administrator = disruption.DEFAULTS,
        growth: resize_decisions.Administrator = resize_decisions.NOBODY,
        kubelet_ca: str | None = None,
    ):
        self.client = client
        self.host_roots = host_roots  # memops run --shared-spill-host-root
        self.protection = protection  # memops run --max-disruption-protection, --no-disruption-protection-in
        self.growth = growth  # memops run --resize-in, --max-resize-limit, --max-resize-limit-in
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
        # The scheduler and workers whose verdicts on the same-node links were last asked.
        self.links_reported: tuple[str, frozenset[str]] | None = None
        self.spill_read = -_SPILL_SECONDS  # when the workers' shared spill was last read (monotonic)
        # Worker address -> bytes of its spill that it links from other writers, from that read
        # (shared_spill.linked_bytes), for in-place growth. Only a cache of what the workers report:
        # a restarted operator starts without it (every worker then counts as linking nothing, the
        # safe side) and has it again from the first pass' read.
        self.spill_linked: dict[str, int] = {}
        self.tenants: dict[str, str] = {}  # worker address -> pod, as the last tenancy check found them
        self.tenants_checked = -_TENANCY_RECHECK_SECONDS  # when (monotonic)
        self.nodes: dict[str, str] = {}  # worker address -> its pod's node, from the same check
        self.hooks_read = -_HOOK_EVENTS_SECONDS  # when the FailedPreStopHook events were last read (monotonic)
        self.disruption_read = -_DISRUPTION_SECONDS  # when the disruption annotations were last decided (monotonic)
        # The kubelets' configurations (spec.eviction.nodePressure); memops run --kubelet-ca-file.
        self.kubelets = kubelets.Kubelets(kubelet_ca)
        self.known: dict[str, str] = {}  # worker address -> pod, from every tenancy check (the latest _KNOWN_WORKERS)
        # What a pass of this daemon may have set up in the scheduler (status names), kept for the
        # goodbye: a policy deleted while a pass runs refuses that pass' status patch, so that its
        # status never says what the pass installed.
        self.installed: set[str] = set()
        # The scheduler's departures up to this time (its clock) are decided: from the policy's creation
        # on, so that a new policy does not report what happened before it.
        self.losses_settled = _created(body)

    async def reconcile(self) -> None:
        """One pass: read, decide (:func:`memops.decisions.policy_decisions.decide`), apply."""
        self.steady = False
        # The scheduler's connection stays open from the read to the apply: the apply configures
        # relief and replication on the connection whose workers the tenancy check vouched for.
        async with contextlib.AsyncExitStack() as stack:
            read = await self.read(stack)
            if isinstance(read, Blocked):
                # Not Ready, and the status says why.
                await self.write(read.old, policy_decisions.not_ready(read.old, read.blocker, read.generation))
                await self.release_while_blocked()
                return
            with metrics.deciding("policy"):
                decision = policy_decisions.decide(read.inputs)
            await self.apply(read, decision)

    async def read(self, stack: contextlib.AsyncExitStack) -> Read | Blocked:
        """The status as written last, and everything the pass decides from; or what blocks the
        policy. Reads only: nothing is written, configured, patched or posted here."""
        generation = int(self.body.metadata.get("generation", 1))
        old = specs.MemoryPolicyStatus.model_validate(_own(self.body.get("status")))
        target = await self.read_target()
        if isinstance(target, policy_decisions.NotReady):
            return Blocked(old, target, generation)
        spec, workload, selector = target
        disruption_due = time.monotonic() - self.disruption_read >= _DISRUPTION_SECONDS
        hpas = await self.listed("horizontalpodautoscalers", (self.namespace,))
        pressure = await self.read_node_pressure(spec, workload)
        victims = pressure is not None and any(p.ours for p in pressure.predictions)
        # The workers' unique bytes, for the disruption annotations on the passes that decide them,
        # and for the workers the kubelet would evict on the passes that predict it.
        keys = (disruption_due and self.protects(spec)) or victims
        seen, connection = await stack.enter_async_context(self.reach_scheduler(spec, keys=keys))
        scheduler, snapshot = connection if connection is not None else (None, None)
        if pressure is not None and snapshot is not None and victims:
            # Asked with the snapshot on this pass (reach_scheduler): only those holding data alone are drained.
            pressure = dataclasses.replace(pressure, unique={w.name: w.unique_bytes for w in snapshot.workers})
        now = time.time()
        requests = await self.listed("retirementrequests", (self.namespace, self.name))
        if snapshot is not None and snapshot.drains is None:
            self.logger.warning("cannot read the preStop drains' losses: the scheduler does not run memops' agent")
        findings = policy_findings.Findings(
            selector=selector,
            scheduler=seen,
            memory=_memory_status(snapshot) if snapshot is not None else None,
            drains=snapshot.drains if snapshot is not None else None,
            hook_events=await self.failed_hook_events(),
            # The namespace's scheduler: what its workers' departures lost.
            departures=await self.departures(selector, snapshot) if snapshot is not None else None,
        )
        current = workloads.replicas_of(workload)
        resized, disrupted = await self.read_workers(spec, old, workload, snapshot, now, disruption_due=disruption_due)
        inputs = policy_decisions.Inputs(
            owner=objects.Owner(name=self.name, namespace=self.namespace, uid=str(self.body.metadata.uid)),
            generation=generation,
            spec=spec,
            status=old,
            current=current,
            replicas=int(workload.get("status", {}).get("replicas", current)),
            now=now,
            autoscalers=tuple(scaling.autoscalers_on(spec.workload, hpas)),
            usage=autoscaling.usage_of(snapshot.workers) if snapshot is not None else None,
            connected=len(snapshot.workers) if snapshot is not None else 0,
            requests=tuple(requests),
            recycling=await self.read_recycling(spec, workload, snapshot, requests, old, now),
            template=shared_spill.template_spec(workload) if spec.sharedSpill is not None else None,
            host_roots=self.host_roots,
            resize=resized,
            resize_ceiling=self.growth.ceiling_in(self.namespace),
            disruption=disrupted,
            protection=self.protection.max_in(self.namespace),
            node_pressure=pressure,
            findings=findings,
        )
        return Read(old, inputs, workload, scheduler, snapshot)

    async def read_workers(
        self,
        spec: specs.MemoryPolicySpec,
        old: specs.MemoryPolicyStatus,
        workload: dict[str, Any],
        snapshot: snapshots.SchedulerSnapshot | None,
        now: float,
        *,
        disruption_due: bool,
    ) -> tuple[tuple[resize_decisions.WorkerSeen, ...] | None, policy_decisions.DisruptionSeen | None]:
        """What in-place growth decides from (``spec.resize``), and, on the passes that decide them,
        the disruption annotations' inputs (with the scheduler out of reach too: protection must not
        outlive it); None for each that this pass does not read."""
        ceiling = self.growth.ceiling_in(self.namespace)  # None: not in memops run --resize-in
        growth = snapshot is not None and spec.resize is not None and ceiling is not None
        if not growth and not disruption_due:
            return None, None
        pods = await workloads.pods(self.client, self.namespace, spec.workload, workload)
        resized = None
        if growth and snapshot is not None:
            template = shared_spill.template_spec(workload)
            # The linked bytes of the last spill read (read_spill, in an earlier pass' apply), not
            # read again here: up to about _SPILL_SECONDS old. Close enough, as a linked-in file
            # changes rarely: it stays until its key is released or read back, and from such a
            # change to the next read the worker's spill counts for at most that file less (never
            # below nothing). Older than twice that (the scheduler was out of reach meanwhile),
            # they are not used.
            fresh = time.monotonic() - self.spill_read < 2 * _SPILL_SECONDS
            resized = await resize.observe(
                self.client,
                spec=spec,
                pods=pods,
                snapshot=snapshot,
                template=template,
                now=now,
                linked=self.spill_linked if fresh else None,
                ceiling=ceiling,
                demand=policy_decisions.task_demand(spec, old),
            )
        if not disruption_due:
            return resized, None
        return resized, await self.read_disruption(spec, pods, snapshot)

    async def read_disruption(
        self, spec: specs.MemoryPolicySpec, pods: list[dict[str, Any]], snapshot: snapshots.SchedulerSnapshot | None
    ) -> policy_decisions.DisruptionSeen:
        """The workload's pods, those that carry the policy's label but left the workload (a new
        ``spec.workload``), and each worker's unique bytes (None: the scheduler was not reached)."""
        unique = None
        if snapshot is not None:
            # Asked for with the snapshot when the annotations can be on (reach_scheduler).
            unique = {w.name: w.unique_bytes for w in snapshot.workers} if self.protects(spec) else {}
        ours = {str(p["metadata"]["name"]) for p in pods}
        marked = await workloads.protected_pods(self.client, self.namespace, self.name)
        strays = [p for p in marked if str(p["metadata"]["name"]) not in ours]
        return policy_decisions.DisruptionSeen(
            pods=_metadata(pods, "annotations"),
            unique=unique,
            labels=_metadata([*pods, *strays], "labels"),
            strays=_metadata(strays, "annotations"),
        )

    def protects(self, spec: specs.MemoryPolicySpec) -> bool:
        """Whether the policy's pods may carry the disruption annotations at all: its spec, and the
        administrator's bound in its namespace."""
        bound = disruption.bound(spec.eviction, self.protection.max_in(self.namespace))
        return spec.eviction.disruptionAnnotations and bound > 0

    async def read_node_pressure(
        self, spec: specs.MemoryPolicySpec, workload: dict[str, Any]
    ) -> node_pressure.Seen | None:
        """The kubelet's predicted evictions on the workers' Nodes (``spec.eviction.nodePressure``);
        None when the policy does not ask for them."""
        settings = spec.eviction.nodePressure
        if settings is None:
            return None
        pods = await workloads.pods(self.client, self.namespace, spec.workload, workload)
        margin = specs.parse_quantity(settings.margin)
        return await kubelets.read(self.client, self.kubelets, pods=pods, margin=margin, logger=self.logger)

    async def read_target(self) -> tuple[specs.MemoryPolicySpec, dict[str, Any], str] | policy_decisions.NotReady:
        """The spec, the workload it names and its pods' selector, or what blocks the policy."""
        NotReady = policy_decisions.NotReady
        try:
            spec = specs.MemoryPolicySpec.model_validate(dict(self.body.spec))
        except pydantic.ValidationError as exc:
            return NotReady("InvalidSpec", drain_decisions.explain_invalid(exc))
        if len(self.name) > _MAX_NAME_LENGTH:
            message = (
                f"metadata.name: at most {_MAX_NAME_LENGTH} characters, as it labels the policy's"
                f" RetirementRequests ({objects.POLICY_LABEL}); this policy does nothing"
            )
            return NotReady("InvalidName", message)
        try:
            workload = await self.workload(spec.workload)
        except kube.ApiError as exc:
            if exc.code != 403:
                raise
            # A DaskWorkerGroup without rbac.daskWorkerGroups: the message names the value.
            return NotReady("Forbidden", f"spec.workload: {exc.message}")
        if workload is None:
            message = f"spec.workload.name: {spec.workload.kind} {spec.workload.name!r} not found in {self.namespace}"
            return NotReady("WorkloadNotFound", message)
        try:
            selector = workloads.selector(workload)
        except selectors.InvalidSelector as exc:
            return NotReady("InvalidSelector", f"spec.workload: {spec.workload.kind} {spec.workload.name!r}: {exc}")
        older = scaling.competing_policies(dict(self.body), await self.listed("memorypolicies", (self.namespace,)))
        if older:
            message = (
                f"spec.workload: MemoryPolicy {older[0]!r} already manages {spec.workload.kind}"
                f" {spec.workload.name!r}; this policy does nothing while it exists"
            )
            return NotReady("Conflict", message, True)
        return spec, workload, selector

    async def apply(self, read: Read, decision: policy_decisions.Decision) -> None:
        """Do what the pass decided, each effect once: the scheduler's relief and replication, what
        the read found to show, marks, requests, the scale-up; then the status, then the events,
        the workers' departures marked as decided and the finished drains annotated as recorded,
        each only once the status holds what it says: a pass whose write fails has them found
        and said again by the next, never lost nor said twice."""
        inputs = read.inputs
        status = await self.configure_scheduler(read, decision.status)
        status = await self.apply_resizes(read, decision, status)
        written = await workloads.patch_metadata(self.client, self.namespace, decision.annotations, self.logger)
        if inputs.disruption is not None and written == len(decision.annotations):
            # Decided and written: the next decision in _DISRUPTION_SECONDS. A write that failed
            # (or a pass that failed before it) has the next pass decide again.
            self.disruption_read = time.monotonic()
        if inputs.recycling is not None:
            await recycle.apply_seen(self.client, body=self.body, seen=inputs.recycling, logger=self.logger)
        for mark in decision.marks:
            await recycle.mark(self.client, self.namespace, mark.pod, mark.mark)
            self.logger.info("recycling %s: %s", mark.pod, mark.message)
        for request in decision.create:
            await self.create(request)
        if decision.scale_up_to is not None:
            await workloads.scale_to(self.client, self.namespace, inputs.spec.workload, decision.scale_up_to, up=True)
        await self.write(read.old, status)
        for event in decision.events:
            kopf.event(self.body, type=event.type, reason=event.reason, message=event.message)
        if decision.losses_settled is not None:
            self.losses_settled = decision.losses_settled
        memory = status.memory
        metrics.policy_observed(
            self.namespace,
            self.name,
            action=decision.action.value,
            desired=decision.desired,
            replicas=status.replicas or 0,
            utilization=memory.percent / 100 if memory is not None and inputs.usage is not None else None,
        )
        await recycle.mark_recorded(self.client, self.namespace, decision.recorded)
        self.steady = decision.steady

    async def apply_resizes(
        self, read: Read, decision: policy_decisions.Decision, status: specs.MemoryPolicyStatus
    ) -> specs.MemoryPolicyStatus:
        """The workers' memory changes (:func:`memops.controllers.resize.apply`); ``status`` with
        what failed in ``resize.message``, for the next pass to decide again."""
        spec, ceiling = read.inputs.spec.resize, read.inputs.resize_ceiling
        if not decision.resizes or spec is None or ceiling is None:
            return status
        failed = await resize.apply(
            self.client,
            read.scheduler,
            namespace=self.namespace,
            orders=decision.resizes,
            maximum=resize_decisions.within(spec.settings(), ceiling).max_limit,
            logger=self.logger,
        )
        if not failed or status.resize is None:
            return status
        message = "; ".join(filter(None, [status.resize.message, *failed]))
        return status.model_copy(update={"resize": status.resize.model_copy(update={"message": message})})

    async def configure_scheduler(self, read: Read, status: specs.MemoryPolicyStatus) -> specs.MemoryPolicyStatus:
        """Relief, replication, placement and task admission in the vouched-for scheduler; ``status``
        with what they report. Untouched when the pass could not reach the scheduler."""
        if read.scheduler is None or read.snapshot is None:
            return status
        spec, found = read.inputs.spec, read.inputs.status
        self.installed |= {name for name in _REMOVALS if getattr(spec, name) is not None}
        pressure = await relief_install.reconcile(
            scheduler=read.scheduler,
            spec=spec,
            old=found.pressure,
            namespace=self.namespace,
            policy=self.name,
            logger=self.logger,
        )
        # Replication targets: its own module; the scheduler keeps the copies between passes.
        replicated = await replication_install.reconcile(
            scheduler=read.scheduler,
            client=self.client,
            spec=spec,
            old=found.replication,
            namespace=self.namespace,
            policy=self.name,
            snapshot=read.snapshot,
            workload=read.workload,
            logger=self.logger,
        )
        placed = await placement_install.reconcile(
            scheduler=read.scheduler,
            spec=spec,
            old=found.placement,
            namespace=self.namespace,
            policy=self.name,
            logger=self.logger,
        )
        admitted = await admission_install.reconcile(
            scheduler=read.scheduler,
            spec=spec,
            old=found.tasks,
            resizing=policy_decisions.serves_demand(status.resize, read.inputs.now),
            usage=read.inputs.usage,
            namespace=self.namespace,
            policy=self.name,
            logger=self.logger,
        )
        workers = frozenset(w.address for w in read.snapshot.workers)
        found_links = await self.install_links(read.scheduler, spec, workers, status.conditions, read.inputs.generation)
        shared = await self.read_spill(read.scheduler, spec, status.sharedSpill)
        update = {
            "pressure": pressure,
            "replication": replicated,
            "placement": placed,
            "tasks": admitted,
            "conditions": found_links,
            "sharedSpill": shared,
        }
        return status.model_copy(update=update)

    async def read_spill(
        self, scheduler: daskrpc.Scheduler, spec: specs.MemoryPolicySpec, old: specs.SharedSpillStatus | None
    ) -> specs.SharedSpillStatus | None:
        """Medium Node: what the workers' spill holds, each file once (:func:`shared_spill.spill_status`),
        read at most every :data:`_SPILL_SECONDS`; ``old`` in between, or when the scheduler does not
        answer; None without medium Node, or with ``links: false``.

        The same read gives each worker's bytes linked from other writers
        (:func:`shared_spill.linked_bytes`), kept in :attr:`spill_linked` for the next passes'
        in-place growth; forgotten without medium Node or when the read failed: a worker with no
        figure counts as linking nothing."""
        shared = spec.sharedSpill
        # The workers' reports come from the links plugin: without it every worker would report
        # nothing, and a status of no bytes would say the tmpfs is empty.
        if shared is None or shared.medium != specs.SpillMedium.NODE or shared.links is False:
            self.spill_linked = {}
            return None
        if time.monotonic() - self.spill_read < _SPILL_SECONDS:
            return old
        try:
            found = await scheduler.spill_shares()
        except (daskrpc.SchedulerUnreachable, daskrpc.SchedulerRefused) as exc:
            self.logger.warning("shared spill: the workers' spill was not read: %s", exc)
            self.spill_linked = {}
            return old
        self.spill_read = time.monotonic()
        self.spill_linked = shared_spill.linked_bytes(found)
        return shared_spill.spill_status(found, timestamps.render(timestamps.now()))

    async def install_links(
        self,
        scheduler: daskrpc.Scheduler,
        spec: specs.MemoryPolicySpec,
        workers: frozenset[str],
        found: list[specs.Condition],
        generation: int,
    ) -> list[specs.Condition]:
        """Medium Node: the plugin by which the node's workers fetch each other's spilled keys by
        hardlink and read them back as maps (:mod:`memops.worker.links`), in every pass (idempotent:
        a restarted scheduler gets it again). The workers' verdicts are asked (a call to each) when
        the scheduler or its ``workers`` changed since they were last asked, and kept in the
        ``SharedSpillLinks`` condition; ``found`` with it set, or without it when the spec has no
        medium Node.

        With ``links: false`` nothing is installed and the condition is False, ``Disabled``. Nothing
        is uninstalled either: a plugin installed before stays registered with the scheduler, which
        gives it to every worker that joins (a restarted one too), until the scheduler restarts."""
        shared = spec.sharedSpill
        if shared is None or shared.medium != specs.SpillMedium.NODE:
            return [c for c in found if c.type != shared_spill.LINKS]
        if shared.links is False:
            # Asked again once links is back on, whatever the workers are then.
            self.links_reported = None
            return conditions.set_condition(
                found,
                shared_spill.LINKS,
                False,
                reason="Disabled",
                message=shared_spill.LINKS_DISABLED,
                generation=generation,
            )
        report = self.links_reported != (scheduler.address, workers)
        try:
            verdicts = await scheduler.install_links(report=report)
        except daskrpc.SchedulerUnreachable as exc:  # SchedulerReachable says so
            self.logger.warning("shared spill: the same-node links are not installed: %s", exc)
            return found
        except daskrpc.SchedulerRefused as exc:
            self.logger.warning("shared spill: the same-node links are not installed: %s", exc)
            message = f"the scheduler refused the same-node links plugin: {exc}"
            return conditions.set_condition(
                found, shared_spill.LINKS, False, reason="NotInstalled", message=message, generation=generation
            )
        if not report:
            return found
        # A worker that joined as the plugin was installed may not have it yet: asked again next pass.
        if not any(links.unsettled(verdict) for verdict in verdicts.values()):
            self.links_reported = (scheduler.address, workers)
        value, reason, message = shared_spill.links_condition(verdicts)
        if value is False:
            self.logger.warning("shared spill: %s", message)
        return conditions.set_condition(
            found, shared_spill.LINKS, value, reason=reason, message=message, generation=generation
        )

    async def read_recycling(
        self,
        spec: specs.MemoryPolicySpec,
        workload: dict[str, Any],
        snapshot: snapshots.SchedulerSnapshot | None,
        requests: list[dict[str, Any]],
        status: specs.MemoryPolicyStatus,
        now: float,
    ) -> policy_decisions.RecycleSeen | None:
        if spec.recycle is None or snapshot is None:
            return None
        window = recycle_decisions.window_for(spec.recycle)
        if self.window is None or (self.window.seconds, self.window.spacing) != (window.seconds, window.spacing):
            self.window = window
        pods = await workloads.pods(self.client, self.namespace, spec.workload, workload)
        return recycle.observe(
            pods=pods,
            snapshot=snapshot.named_by_pod(workloads.worker_names(pods)),
            window=self.window,
            requests=requests,
            record=status.recycle or specs.RecycleStatus(),
            now=now,
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
        selector = f"{objects.POLICY_LABEL}={self.name}" if plural == "retirementrequests" else None
        return await self.client.list(path, label_selector=selector)

    @contextlib.asynccontextmanager
    async def reach_scheduler(
        self, spec: specs.MemoryPolicySpec, *, keys: bool = False
    ) -> AsyncIterator[
        tuple[policy_findings.SchedulerSeen, tuple[daskrpc.Scheduler, snapshots.SchedulerSnapshot] | None]
    ]:
        """How the scheduler was reached and, when it was, the scheduler, vouched for, and its
        workers and their memory (with ``keys``, each worker's unique bytes: dearer), for as long
        as the caller acts on it."""
        Seen = policy_findings.SchedulerSeen
        try:
            self.security = security = await scheduler_tls.security_for(self.client, self.namespace, spec.scheduler)
        except (scheduler_tls.SecretUnusable, kube.ApiError) as exc:
            # The chart grants Secrets only with rbac.schedulerTLS: a 403's message says so.
            cause = exc.cause if isinstance(exc, scheduler_tls.SecretUnusable) else exc
            forbidden = isinstance(cause, kube.ApiError) and cause.code == 403
            detail = cause.message if isinstance(cause, kube.ApiError) and forbidden else str(cause)
            reason = "Forbidden" if forbidden else "SecretUnusable"
            yield Seen(reason, f"spec.scheduler.tls.secretName: {detail}"), None
            return
        async with contextlib.AsyncExitStack() as stack:
            try:
                # One connection a pass. Identity only (no code sent) until the scheduler is shown
                # to be this namespace's (the vouch); then what recycling reads, and the preStop
                # drains' figures for status.safetyNet (hook_losses), from memops' agent, which is
                # told where the workers run: a preStop hook names only its own worker's node.
                query = {
                    "keys": keys,
                    "processing": spec.recycle is not None,
                    "drains": True,
                    "nodes": lambda: self.nodes,
                }
                address = await vetting.dialled(self.client, self.namespace, spec.scheduler.address)
                found = await stack.enter_async_context(
                    vetting.reach(address, vouch=self.verify_tenancy, security=security, timeout=5, snapshot=query)
                )
                scheduler, snapshot = found.scheduler, found.snapshot
                assert snapshot is not None
            except daskrpc.Unvouched as exc:
                message = f"spec.scheduler.address: {exc.verdict.message}"
                seen = Seen(exc.verdict.reason.value, message, foreign=True)
            except (daskrpc.SchedulerUnreachable, kube.ApiError, ValueError) as exc:
                forbidden = isinstance(exc, kube.ApiError) and exc.code == 403
                if isinstance(exc, kube.ApiError) and forbidden:
                    seen = Seen("Forbidden", f"spec.scheduler.tls.secretName: {exc.message}")
                else:
                    seen = Seen("SchedulerUnreachable", f"spec.scheduler.address: {exc}")
            else:
                # Each worker under its pod's name, found by address (status.memory, recycling).
                named = snapshot.named_by_pod({w.name: self.tenants[w.address] for w in snapshot.workers})
                yield Seen(), (scheduler, named)
                return
            yield seen, None

    async def verify_tenancy(self, workers: Sequence[snapshots.WorkerInfo]) -> tenancy.Verdict:
        """:func:`memops.decisions.tenancy.check` against the namespace's pods, listed only when a worker
        is not among those the last check showed to be pods here, or that check is old: a
        listing of the namespace's pods on every pass of every policy would cost more API
        requests than everything else a policy at rest does."""
        addresses = {w.address for w in workers}
        fresh = time.monotonic() - self.tenants_checked < _TENANCY_RECHECK_SECONDS
        if workers and fresh and addresses <= self.tenants.keys():
            return tenancy.Verdict(tenancy.Reason.TENANT, "the workers of the last check")
        pods, _ = await workloads.namespace_pods(self.client, self.namespace)
        verdict = tenancy.check(workers, pods, self.namespace)
        located = snapshots.workers_by_pod(pods, workers) if verdict.allowed else {}
        self.tenants = {w.address: pod for pod, found in located.items() for w in found}
        self.known.update(self.tenants)
        for address in list(self.known)[: max(len(self.known) - _KNOWN_WORKERS, 0)]:
            del self.known[address]
        self.nodes = snapshots.nodes_of_workers(pods, workers) if verdict.allowed else {}
        self.tenants_checked = time.monotonic()
        return verdict

    async def goodbye(self) -> None:
        """The policy is gone: its pressure relief, replication, placement and task admission leave the
        scheduler (best effort), on one connection vouched for by a fresh tenancy check."""
        await self.unprotect()
        status = self.body.get("status") or {}
        left = {name for name in _REMOVALS if status.get(name)} | self.installed
        if not left:
            return
        try:
            spec = specs.MemoryPolicySpec.model_validate(dict(self.body.spec))
            async with vetting.vetted(self.client, self.namespace, spec.scheduler, timeout=5) as found:
                for name, remove in _REMOVALS.items():
                    if name in left:
                        await remove(self.body, scheduler=found.scheduler, logger=self.logger)
        except (
            daskrpc.SchedulerUnreachable,
            daskrpc.Unvouched,
            scheduler_tls.SecretUnusable,
            kube.ApiError,
            ValueError,
        ) as exc:
            self.logger.warning(
                "pressure relief, replication, placement and task admission left in the scheduler: %s", exc
            )

    async def unprotect(self, *, workload: bool = True) -> None:
        """The policy is gone: the disruption annotations it set leave the pods (best effort); left
        behind, they would keep node autoscalers off those nodes for ever. The pods are found by the
        policy's own label, whatever ``spec.workload`` names now; with ``workload``, the workload's
        pods too, for marks set before memops labelled them."""
        try:
            # A name too long for a label value never labelled anything (the pass refuses it: InvalidName).
            labelled = len(self.name) <= _MAX_NAME_LENGTH
            pods = await workloads.protected_pods(self.client, self.namespace, self.name) if labelled else []
            if workload:
                pods += await self.legacy_marked()
        except kube.ApiError as exc:
            self.logger.warning("disruption annotations left on the workers: %s", exc)
            return
        seen = {
            str(p["metadata"]["name"]): disruption.PodSeen(
                dict(p["metadata"].get("annotations") or {}), dict(p["metadata"].get("labels") or {}), ours=False
            )
            for p in pods
        }
        patches = disruption.release(seen, self.name, time.time())
        await workloads.patch_metadata(self.client, self.namespace, patches, self.logger)

    async def legacy_marked(self) -> list[dict[str, Any]]:
        """The pods of ``spec.workload``; none when the spec does not say which."""
        try:
            spec = specs.MemoryPolicySpec.model_validate(dict(self.body.spec))
        except pydantic.ValidationError:
            return []
        return await workloads.pods(self.client, self.namespace, spec.workload)

    async def release_while_blocked(self) -> None:
        """A policy that cannot act (another policy first, no workload, an invalid spec) protects
        nothing: its labelled pods lose its marks, as often as a pass would decide them. Not the
        workload's pods: with another policy first, their marks are that policy's."""
        if time.monotonic() - self.disruption_read < _DISRUPTION_SECONDS:
            return
        self.disruption_read = time.monotonic()
        await self.unprotect(workload=False)

    async def failed_hook_events(self) -> tuple[dict[str, Any], ...] | None:
        """The namespace's ``FailedPreStopHook`` events (the kubelet's: a pod that left with a
        failed preStop hook), every so often; None on the passes between, or when they cannot be read."""
        if time.monotonic() - self.hooks_read < _HOOK_EVENTS_SECONDS:
            return None
        path = kube.resource_path("", "v1", "events", self.namespace)
        try:
            events = await self.client.list(path, field_selector=f"reason={safetynet.FAILED_PRE_STOP_HOOK}")
        except kube.ApiError as exc:
            self.logger.warning("cannot read the FailedPreStopHook events: %s", exc)
            return None
        self.hooks_read = time.monotonic()
        return tuple(events)

    async def departures(
        self, selector: str, snapshot: snapshots.SchedulerSnapshot
    ) -> policy_findings.Departures | None:
        """The workers that left on their own and may be new to the status, from memops' agent
        (hostile input: :func:`memops.decisions.worker_loss_decisions.parse`), and, only when one
        may be new, the workload's pods (``selector``, those being deleted too), to tell whose."""
        if snapshot.departures is None:
            return None
        since = self.losses_settled
        pending = worker_loss_decisions.pending(worker_loss_decisions.parse(snapshot.departures), since=since)
        path = kube.resource_path("", "v1", "pods", self.namespace)
        pods = await self.client.list(path, label_selector=selector) if pending and selector else []
        # self.known as it is: only the tenancy check of this pass' read changes it, before this.
        return policy_findings.Departures(tuple(pending), tuple(pods), since, self.known)

    async def create(self, request: dict[str, Any]) -> None:
        """Create one of the policy's RetirementRequests; one that exists already (a repeated pass) stays."""
        try:
            await self.client.request(
                "POST",
                kube.resource_path(specs.GROUP, specs.VERSION, "retirementrequests", self.namespace),
                body=request,
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
        blocker = policy_decisions.NotReady("InternalError", f"{type(exc).__name__}: {exc}")
        try:
            await self.write(old, policy_decisions.not_ready(status, blocker, generation))
        except Exception as again:  # the status cannot be written either: the next pass tries again
            self.logger.warning("could not record the failure: %s", again)

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
        # Once the status holds them: a restart reads them back and does not count them again.
        metrics.hook_losses(self.namespace, self.name, safetynet.new_losses(old.safetyNet, status.safetyNet))
        metrics.worker_losses(
            self.namespace, self.name, worker_loss_decisions.new_losses(old.workerLosses, status.workerLosses)
        )


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


def _metadata(pods: Sequence[Mapping[str, Any]], key: str) -> dict[str, dict[str, str]]:
    """Pod name -> its ``annotations`` or ``labels``."""
    return {str(p["metadata"]["name"]): dict(p["metadata"].get(key) or {}) for p in pods}


def _created(body: kopf.Body) -> float:
    """The policy's creation (seconds since the epoch); 0 when it does not say."""
    try:
        return timestamps.parse(str(body.metadata.get("creationTimestamp") or "")).timestamp()
    except ValueError:
        return 0.0


def _own(raw: Any) -> dict[str, Any]:
    fields = specs.MemoryPolicyStatus.model_fields
    return {k: v for k, v in dict(raw or {}).items() if k in fields}


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


def _slim(body: Mapping[str, Any]) -> dict[str, Any]:
    """What the passes read of an object; the managed fields would only cost memory."""
    meta = {k: v for k, v in dict(body.get("metadata", {})).items() if k != "managedFields"}
    return {"metadata": meta, "spec": dict(body.get("spec", {})), "status": dict(body.get("status", {}) or {})}


def _slim_pod_spec(pod_spec: Any) -> dict[str, Any]:
    """The containers' resources, and the first container's command line and literal env."""
    if not isinstance(pod_spec, Mapping):
        return {}

    def container(found: Any, first: bool) -> dict[str, Any]:
        if not isinstance(found, Mapping):
            return {}
        kept = {"resources": found.get("resources") or {}}
        if first:
            kept |= {"command": found.get("command") or [], "args": found.get("args") or []}
            kept["env"] = [
                e
                for e in found.get("env") or []
                if isinstance(e, Mapping) and "value" in e and str(e.get("name", "")).startswith("DASK_")
            ]
        return kept

    containers = pod_spec.get("containers") or []
    slim: dict[str, Any] = {
        "containers": [container(c, i == 0) for i, c in enumerate(containers)],
        "initContainers": [container(c, False) for c in pod_spec.get("initContainers") or []],
    }
    if pod_spec.get("resources"):
        slim["resources"] = pod_spec["resources"]
    return slim


def _slim_deployment(body: Mapping[str, Any]) -> dict[str, Any]:
    """Only what a pass reads: the replicas, the selector, the status, and of the pod template
    what the shared spill's verdict reads (memory, the worker's command line and env)."""
    spec = body.get("spec", {})
    slim = _slim(body)
    slim["spec"] = {
        "replicas": spec.get("replicas", 1),
        "selector": spec.get("selector", {}),
        "template": {"spec": _slim_pod_spec(spec.get("template", {}).get("spec", {}))},
    }
    return slim


INDEX_NAMES = {
    "deployments": "memops_deployments",
    "memorypolicies": "memops_policies",
    "horizontalpodautoscalers": "memops_hpas",
    "retirementrequests": "memops_policy_requests",
}

API_POLICIES = 32
"""The most policies of one namespace whose Deployments :func:`api_cache` reads (oldest first,
the order in which the webhook chooses): a tenant's thousand policies cost one list, not a
thousand reads, on each of its pod creations."""


async def api_cache(client: kube.Kube, namespace: str) -> Cache:
    """What the indexes hold of one namespace, read from the API: a webhook's view on a replica
    whose indexes are paused (:mod:`memops.decisions.leadership`). The policies, their workloads'
    Deployments and their RetirementRequests, slimmed as the indexes slim them."""
    policies = [
        _slim(p) for p in await client.list(kube.resource_path(specs.GROUP, specs.VERSION, "memorypolicies", namespace))
    ]
    names: list[str] = []
    for body in sorted(shapes.well_formed(shapes.LISTED, policies), key=_age_and_name)[:API_POLICIES]:
        workload = (body.get("spec") or {}).get("workload")
        if isinstance(workload, Mapping) and workload.get("kind", "Deployment") == "Deployment":
            name = workload.get("name")
            if isinstance(name, str) and name and name not in names:
                names.append(name)
    deployments: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for name in names:
        found = await client.get_or_none(kube.resource_path("apps", "v1", "deployments", namespace, name))
        if found is not None:
            deployments[(namespace, name)] = [_slim_deployment(found)]
    requests: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    path = kube.resource_path(specs.GROUP, specs.VERSION, "retirementrequests", namespace)
    for request in await client.list(path, label_selector=objects.POLICY_LABEL):
        owner = ((request.get("metadata") or {}).get("labels") or {}).get(objects.POLICY_LABEL)
        if isinstance(owner, str):
            requests.setdefault((namespace, owner), []).append(_slim(request))
    return Cache(
        {
            INDEX_NAMES["memorypolicies"]: {(namespace,): policies},
            INDEX_NAMES["deployments"]: deployments,
            INDEX_NAMES["horizontalpodautoscalers"]: {},
            INDEX_NAMES["retirementrequests"]: requests,
        }
    )


def _age_and_name(body: Mapping[str, Any]) -> tuple[str, str]:
    meta = body.get("metadata") or {}
    return str(meta.get("creationTimestamp") or ""), str(meta.get("name") or "")


def register(
    registry: kopf.OperatorRegistry,
    *,
    host_roots: frozenset[str] = frozenset(),
    protection: disruption.Administrator = disruption.DEFAULTS,
    growth: resize_decisions.Administrator = resize_decisions.NOBODY,
    kubelet_ca: str | None = None,
) -> None:
    """The indexes and the daemon; ``host_roots``: the host directories medium Node may mount;
    ``protection``: the administrator's bounds on the disruption annotations; ``growth``: where
    in-place growth may act, and how far; ``kubelet_ca``: what verifies the kubelets' serving
    certificates (None: the API server's CA)."""
    _register_indexes(registry)
    _register_daemon(registry, host_roots=host_roots, protection=protection, growth=growth, kubelet_ca=kubelet_ca)


def _register_indexes(registry: kopf.OperatorRegistry) -> None:
    """What every pass of every policy reads (:class:`Cache`), kept current by Kopf's watches."""

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
        return {(namespace or "", name): _slim_deployment(body)}

    @kopf.index("autoscaling", "v2", "horizontalpodautoscalers", registry=registry, id="memops_hpas")
    def memops_hpas(namespace: str | None, body: kopf.Body, **_: Any) -> dict[tuple[str, ...], dict[str, Any]]:
        return {(namespace or "",): _slim(body)}

    @kopf.index(
        specs.GROUP,
        specs.VERSION,
        "retirementrequests",
        registry=registry,
        id="memops_policy_requests",
        labels={objects.POLICY_LABEL: kopf.PRESENT},
    )
    def memops_policy_requests(
        namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any
    ) -> dict[tuple[str, ...], dict[str, Any]]:
        return {(namespace or "", labels[objects.POLICY_LABEL]): _slim(body)}


def _register_daemon(
    registry: kopf.OperatorRegistry,
    *,
    host_roots: frozenset[str],
    protection: disruption.Administrator,
    growth: resize_decisions.Administrator,
    kubelet_ca: str | None,
) -> None:
    """One daemon per policy, running its passes (:func:`_loop`)."""

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
        reconciler = Policy(
            client=memo.kube,
            body=body,
            logger=logger,
            cache=cache,
            host_roots=host_roots,
            protection=protection,
            growth=growth,
            kubelet_ca=kubelet_ca,
        )
        uid = str(body.metadata.uid)
        waker = memo.policy_wakers.setdefault(uid, asyncio.Event())
        try:
            await _loop(reconciler, body, stopped, waker, logger)
        finally:
            memo.policy_wakers.pop(uid, None)
            if stopped.reason is not None and kopf.DaemonStoppingReason.RESOURCE_DELETED in stopped.reason:
                await reconciler.goodbye()


async def _loop(
    reconciler: Policy,
    body: kopf.Body,
    stopped: kopf.DaemonStopped,
    waker: asyncio.Event,
    logger: logging.Logger | logging.LoggerAdapter[Any],
) -> None:
    """Reconcile, then wait for a spec change (woken by the policies index) or the idle time."""
    generation = body.metadata.get("generation")

    def idle() -> float:
        # Every few seconds to follow drains and drift; every 10 s for a plain policy at rest
        # (see Policy.steady). The loop lengthens it after failures in a row.
        return _STEADY_SECONDS if reconciler.steady else _IDLE_SECONDS

    async def one_pass() -> loop.Next:
        nonlocal generation
        generation = body.metadata.get("generation")
        await reconciler.reconcile()
        return loop.Next(seconds=idle())

    async def on_error(exc: Exception) -> loop.Next:
        metrics.reconcile_error("MemoryPolicy", reconciler.namespace)
        if isinstance(exc, (kube.ApiError, daskrpc.SchedulerUnreachable)):
            logger.warning("will retry: %s", exc)
            return loop.Next(seconds=idle(), failures=loop.Failures.KEEP)
        # Anything else becomes the policy's condition, never a crash loop.
        logger.error("will retry: %s: %s", type(exc).__name__, exc, exc_info=exc)
        await reconciler.report_error(exc)
        return loop.Next(seconds=idle(), failures=loop.Failures.COUNT)

    async def wait(seconds: float) -> None:
        # Wake at once when the spec changes (kubectl scale, an HPA, a GitOps commit: Kopf
        # keeps the body current, and the policies index sets the waker).
        deadline = time.monotonic() + seconds
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

    await loop.run(one_pass, on_error, stopped=stopped, max_seconds=_MAX_RETRY_SECONDS, wait=wait)
