"""Memory-aware task admission, operator side: configure it in the scheduler (and, through it, in
every worker) from the policy, and report what it did.

The profiling, admitting and preempting happen in Dask (:mod:`memops.scheduler.admission`,
:mod:`memops.worker.admission`); here, once per policy pass, one idempotent call installs, retunes
or (``spec.tasks`` unset) removes it, and returns its figures for ``status.tasks``. One scheduler
has one admission: it belongs to the policy that installed it, and another policy on the same
scheduler says so in its status instead of retuning it.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from memops import specs
from memops.clients import daskrpc
from memops.controllers import metrics, relief_install
from memops.decisions import autoscaling
from memops.specs.common import parse_quantity


def settings(spec: specs.TaskAdmissionSpec) -> dict[str, Any]:
    """``spec.tasks`` as the scheduler's agent takes it: plain numbers, strings and lists."""
    return {
        "small": parse_quantity(spec.small),
        "preemptAbove": spec.preemptAbove,
        "preemptible": sorted(set(spec.preemptible)),
        "maxRetries": spec.maxRetries,
        "probe": spec.unprofiled == specs.UnprofiledTasks.PROBE,
    }


def demand_action(
    spec: specs.MemoryPolicySpec, resizing: bool = False, peak: int = 0, usage: autoscaling.Usage | None = None
) -> str:
    """What serves tasks whose peak (the largest waiting, ``peak``) fits no worker: a worker grown in
    place (``spec.resize``: :func:`memops.decisions.resize_decisions.for_demand`, under way:
    ``resizing``), else one more worker (``spec.autoscale``, where a new worker could start it:
    :func:`memops.decisions.autoscaling.with_task_demand`), or nothing."""
    if resizing:
        return "Resize"
    return "Scale" if spec.autoscale is not None and autoscaling.new_worker_fits(peak, usage) else "None"


async def reconcile(
    *,
    scheduler: daskrpc.Scheduler,
    spec: specs.MemoryPolicySpec,
    old: specs.TaskAdmissionStatus | None,
    resizing: bool = False,
    usage: autoscaling.Usage | None = None,
    namespace: str,
    policy: str,
    logger: logging.Logger | logging.LoggerAdapter[Any],
) -> specs.TaskAdmissionStatus | None:
    """The new ``status.tasks``: None when admission is off (and, if it was on, now removed)."""
    if spec.tasks is None and old is None:
        return None
    owner = relief_install.owner_of(namespace, policy)
    try:
        figures = await scheduler.configure_admission(
            settings=settings(spec.tasks) if spec.tasks is not None else None, owner=owner
        )
    except daskrpc.SchedulerRefused as exc:
        logger.warning("%s", exc)
        return (old or specs.TaskAdmissionStatus()).model_copy(update={"message": str(exc)})
    if figures is None or (spec.tasks is None and figures.get("owner") != owner):
        return None
    if figures.get("owner") != owner:
        return specs.TaskAdmissionStatus(
            message=f"spec.tasks: the scheduler's task admission belongs to MemoryPolicy {figures.get('owner')};"
            " this policy's is not applied"
        )
    figures.pop("owner")
    top = [specs.TaskPeak(**entry) for entry in figures.pop("top")]
    action = demand_action(spec, resizing, int(figures["demandBytes"]), usage) if figures["demandTasks"] else ""
    status = specs.TaskAdmissionStatus(top=top, demandAction=action, **figures)
    metrics.tasks_observed(namespace, policy, status)
    return status


async def remove(
    body: kopf.Body, *, scheduler: daskrpc.Scheduler, logger: logging.Logger | logging.LoggerAdapter[Any]
) -> None:
    """The policy is gone: so is its admission in the (vouched for) scheduler (best effort)."""
    try:
        await scheduler.configure_admission(
            settings=None, owner=relief_install.owner_of(str(body.metadata.namespace), str(body.metadata.name))
        )
    except (daskrpc.SchedulerUnreachable, daskrpc.SchedulerRefused, KeyError) as exc:
        logger.warning("task admission left in the scheduler: %s", exc)
