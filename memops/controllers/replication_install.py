"""Replication targets, operator side: configure them in the scheduler, annotate the worker pods.

Once per policy pass (:class:`memops.controllers.policy.Policy`): read the workload's pods and
their nodes' labels, turn ``spec.replication`` into the agent's plain data
(:func:`memops.decisions.replication_plan.agent_rules`), make one idempotent call that installs, retunes or
removes replication in the scheduler (:meth:`memops.clients.daskrpc.Scheduler.configure_replication`, on
the connection that the pass vouched for), and write the pods' annotations that moved
(:func:`memops.decisions.replication_plan.plan_annotations`): one merge-patch per pod, at most one every 30 s.
Returns ``status.replication``. When the policy is deleted, :func:`remove` takes replication out
of the scheduler.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import kopf

from memops import specs
from memops.clients import daskrpc, kube
from memops.controllers import metrics, relief_install, workloads
from memops.decisions import replication_plan, snapshots

DEFAULT_CEILING = 0.7
"""No copy may push a worker over this share of its limit when pressure relief is off (relief's
default relieveAbove); with relief on, its relieveAbove."""


async def reconcile(
    *,
    scheduler: daskrpc.Scheduler,
    client: kube.Kube,
    spec: specs.MemoryPolicySpec,
    old: specs.ReplicationStatus | None,
    namespace: str,
    policy: str,
    snapshot: snapshots.SchedulerSnapshot,
    workload: dict[str, Any],
    logger: logging.Logger | logging.LoggerAdapter[Any],
) -> specs.ReplicationStatus | None:
    if spec.replication is None and old is None:
        return None
    owner = relief_install.owner_of(namespace, policy)
    if spec.replication is None:
        await scheduler.configure_replication(rules=None, places={}, owner=owner)
        return None
    pods = await workloads.pods(client, namespace, spec.workload, workload)
    names = workloads.worker_names(pods)
    addresses = {names.get(w.name, w.name): w.address for w in snapshot.workers}
    nodes = await _node_labels(client, pods)
    ceiling = specs.parse_percent(spec.pressure.relieveAbove) / 100 if spec.pressure else DEFAULT_CEILING
    rules, places = replication_plan.agent_rules(
        spec.replication, pods=pods, nodes=nodes, addresses=addresses, ceiling=ceiling
    )
    try:
        figures = await scheduler.configure_replication(rules=rules, places=places, owner=owner)
    except daskrpc.SchedulerRefused as exc:
        logger.warning("%s", exc)
        return (old or specs.ReplicationStatus()).model_copy(update={"message": f"spec.replication: {exc}"})
    if figures is None:
        return specs.ReplicationStatus(message="spec.replication: the scheduler does not run memops' agent")
    if figures.get("owner") != owner:
        return specs.ReplicationStatus(
            message=f"spec.replication: the scheduler's replication belongs to MemoryPolicy {figures.get('owner')};"
            " this policy's is not applied"
        )
    new = specs.ReplicationStatus.model_validate(
        {k: int(figures.get(k, 0)) for k in specs.ReplicationStatus.model_fields if k != "message"}
    )
    before = old or specs.ReplicationStatus()
    copied = new.bytesCopied - before.bytesCopied if new.bytesCopied >= before.bytesCopied else new.bytesCopied
    metrics.replication_observed(namespace, policy, new, copied)
    await annotate(client, namespace, pods, addresses, figures, spec.replication.default, logger)
    return new


async def _node_labels(client: kube.Kube, pods: Sequence[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """Node name -> its labels, for the nodes the pods run on (one GET per node)."""
    labels: dict[str, dict[str, str]] = {}
    for node in sorted({str(p.get("spec", {}).get("nodeName") or "") for p in pods} - {""}):
        try:
            body = await client.get(kube.resource_path("", "v1", "nodes", None, node))
        except kube.ApiError:
            continue  # gone, or not readable: its pods are then marked by no nodeSelector
        labels[node] = dict(body.get("metadata", {}).get("labels") or {})
    return labels


async def annotate(
    client: kube.Kube,
    namespace: str,
    pods: Sequence[dict[str, Any]],
    addresses: dict[str, str],
    figures: dict[str, Any],
    default: int,
    logger: logging.Logger | logging.LoggerAdapter[Any],
) -> int:
    """Write the annotations that moved; returns how many pods were written."""
    current = {str(p["metadata"]["name"]): dict(p["metadata"].get("annotations") or {}) for p in pods}
    per_pod = replication_plan.pod_figures(
        agent_workers=figures.get("workers") or {}, addresses=addresses, default=default
    )
    patches = replication_plan.plan_annotations(current, per_pod, time.time())
    await workloads.patch_annotations(client, namespace, patches, logger)
    return len(patches)


async def remove(
    body: kopf.Body, *, scheduler: daskrpc.Scheduler, logger: logging.Logger | logging.LoggerAdapter[Any]
) -> None:
    """The policy is gone: so is its replication in the (vouched for) scheduler (best effort)."""
    try:
        owner = relief_install.owner_of(str(body.metadata.namespace), str(body.metadata.name))
        await scheduler.configure_replication(rules=None, places={}, owner=owner)
    except (daskrpc.SchedulerUnreachable, daskrpc.SchedulerRefused, KeyError) as exc:
        logger.warning("replication left in the scheduler: %s", exc)
