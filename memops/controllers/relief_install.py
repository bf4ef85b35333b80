"""Pressure relief, operator side: configure it in the scheduler from the policy, report what it did.

The moving happens in the scheduler (:mod:`memops.scheduler.relief`); here, once per policy
pass (:class:`memops.controllers.policy.Policy`), one idempotent call installs it, retunes it,
or removes it when ``spec.pressure`` is unset, and returns its counters for ``status.pressure``
and the metrics. When the policy is deleted, :func:`remove` takes it out of the scheduler.
One scheduler has one relief: it belongs to the policy that installed it (``namespace/name``),
and another policy on the same scheduler says so in its status instead of retuning it.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from memops import specs
from memops.clients import daskrpc
from memops.controllers import metrics


def owner_of(namespace: str, policy: str) -> str:
    return f"{namespace}/{policy}"


async def reconcile(
    *,
    scheduler: daskrpc.Scheduler,
    spec: specs.MemoryPolicySpec,
    old: specs.PressureStatus | None,
    namespace: str,
    policy: str,
    logger: logging.Logger | logging.LoggerAdapter[Any],
) -> specs.PressureStatus | None:
    """The new ``status.pressure``: None when relief is off (and, if it was on, now removed), on
    the ``scheduler`` connection that the pass vouched for."""
    if spec.pressure is None and old is None:
        return None  # never turned on by this policy: nothing to remove
    above = specs.parse_percent(spec.pressure.relieveAbove) / 100 if spec.pressure else None
    to = specs.parse_percent(spec.pressure.relieveTo) / 100 if spec.pressure else None
    owner = owner_of(namespace, policy)
    try:
        state = await scheduler.configure_relief(above=above, to=to, owner=owner)
    except daskrpc.SchedulerRefused as exc:
        logger.warning("%s", exc)
        return (old or specs.PressureStatus()).model_copy(update={"message": str(exc)})
    if state is None or (spec.pressure is None and state.get("owner") != owner):
        return None
    if state.get("owner") != owner:
        return specs.PressureStatus(
            message=f"spec.pressure: the scheduler's pressure relief belongs to MemoryPolicy {state.get('owner')}"
            f" (relieveAbove {state['above']:.0%}, relieveTo {state['to']:.0%}); this policy's is not applied"
        )
    new = specs.PressureStatus(
        keysMoved=int(state["keysMoved"]),
        bytesMoved=int(state["bytesMoved"]),
        hot=list(state["hot"]),
        starved=list(state["starved"]),
        message=_starved_message(list(state["starved"]), spec),
    )
    # The scheduler's counters start over when it restarts: count only what grew.
    before = old or specs.PressureStatus()
    metrics.relieved(
        namespace,
        policy,
        new.keysMoved - before.keysMoved if new.keysMoved >= before.keysMoved else new.keysMoved,
        new.bytesMoved - before.bytesMoved if new.bytesMoved >= before.bytesMoved else new.bytesMoved,
    )
    return new


def _starved_message(starved: list[str], spec: specs.MemoryPolicySpec) -> str:
    if not starved:
        return ""
    workers = ", ".join(starved)
    if spec.autoscale is None:
        return f"{workers} above relieveAbove with no peer that has room: more workers are needed (no spec.autoscale)"
    return f"{workers} above relieveAbove with no peer that has room: asking for {len(starved)} more worker(s)"


async def remove(
    body: kopf.Body, *, scheduler: daskrpc.Scheduler, logger: logging.Logger | logging.LoggerAdapter[Any]
) -> None:
    """The policy is gone: so is its pressure relief in the (vouched for) scheduler (best effort)."""
    try:
        owner = owner_of(str(body.metadata.namespace), str(body.metadata.name))
        await scheduler.configure_relief(above=None, to=None, owner=owner)
    except (daskrpc.SchedulerUnreachable, daskrpc.SchedulerRefused, KeyError) as exc:
        logger.warning("pressure relief left in the scheduler: %s", exc)
