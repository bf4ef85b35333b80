"""Graph-aware placement, operator side: configure it in the scheduler from the policy, report what
it did.

The placing happens in the scheduler (:mod:`memops.scheduler.placement`); here, once per policy
pass, one idempotent call installs it, retunes it, or removes it when ``spec.placement`` is unset,
and returns its figures for ``status.placement``. When the policy is deleted, :func:`remove` takes
it out of the scheduler, which lifts the restrictions it set. One scheduler has one placement: it
belongs to the policy that installed it, and another policy on the same scheduler says so in its
status instead of retuning it.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from memops import specs
from memops.clients import daskrpc
from memops.controllers import relief_install


async def reconcile(
    *,
    scheduler: daskrpc.Scheduler,
    spec: specs.MemoryPolicySpec,
    old: specs.PlacementStatus | None,
    namespace: str,
    policy: str,
    logger: logging.Logger | logging.LoggerAdapter[Any],
) -> specs.PlacementStatus | None:
    """The new ``status.placement``: None when placement is off (and, if it was on, now removed),
    on the ``scheduler`` connection that the pass vouched for."""
    if spec.placement is None and old is None:
        return None  # never turned on by this policy: nothing to remove, and nothing is installed
    owner = relief_install.owner_of(namespace, policy)
    wanted = spec.placement
    try:
        figures = await scheduler.configure_placement(
            enabled=wanted is not None,
            max_tasks=wanted.maxTasks if wanted is not None else specs.PlacementSpec().maxTasks,
            owner=owner,
        )
    except daskrpc.SchedulerRefused as exc:
        logger.warning("%s", exc)
        return (old or specs.PlacementStatus()).model_copy(update={"message": str(exc)})
    if figures is None or (wanted is None and figures.get("owner") != owner):
        return None
    if figures.get("owner") != owner:
        return specs.PlacementStatus(
            message=f"spec.placement: the scheduler's placement belongs to MemoryPolicy {figures.get('owner')};"
            " this policy's is not applied"
        )
    return specs.PlacementStatus(
        graphsPlaced=figures["graphsPlaced"],
        graphsLeft=figures["graphsLeft"],
        groups=figures["groups"],
        tasksPlaced=figures["tasksPlaced"],
        groupsMoved=figures["rehomed"],
        longestMilliseconds=round(figures["longest"] * 1000, 3),
    )


async def remove(
    body: kopf.Body, *, scheduler: daskrpc.Scheduler, logger: logging.Logger | logging.LoggerAdapter[Any]
) -> None:
    """The policy is gone: so is its placement in the (vouched for) scheduler (best effort)."""
    try:
        owner = relief_install.owner_of(str(body.metadata.namespace), str(body.metadata.name))
        await scheduler.configure_placement(enabled=False, max_tasks=1, owner=owner)
    except (daskrpc.SchedulerUnreachable, daskrpc.SchedulerRefused, KeyError) as exc:
        logger.warning("placement left in the scheduler: %s", exc)
