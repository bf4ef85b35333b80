"""Pressure relief, operator side: configure it in the scheduler from the policy, report what it did.

The moving happens in the scheduler (:mod:`memops.scheduler.relief`); here, once per policy
pass, one idempotent call installs it, retunes it, or removes it when ``spec.pressure`` is
unset, and returns its counters for ``status.pressure`` and the metrics.
"""

from __future__ import annotations

import logging
from typing import Any

from distributed.security import Security

from memops import daskrpc, metrics, specs


async def reconcile(
    *,
    spec: specs.MemoryPolicySpec,
    old: specs.PressureStatus | None,
    security: Security | None,
    namespace: str,
    policy: str,
    logger: logging.Logger | logging.LoggerAdapter[Any],
) -> specs.PressureStatus | None:
    """The new ``status.pressure``: None when relief is off (and, if it was on, now removed)."""
    if spec.pressure is None and old is None:
        return None  # never turned on by this policy: nothing to remove
    above = specs.parse_percent(spec.pressure.relieveAbove) / 100 if spec.pressure else None
    to = specs.parse_percent(spec.pressure.relieveTo) / 100 if spec.pressure else None
    try:
        state = await daskrpc.configure_relief(spec.scheduler.address, security=security, above=above, to=to)
    except daskrpc.SchedulerRefused as exc:
        logger.warning("%s", exc)
        return old
    if state is None:
        return None
    new = specs.PressureStatus(
        keysMoved=int(state["keysMoved"]),
        bytesMoved=int(state["bytesMoved"]),
        hot=list(state["hot"]),
        starved=list(state["starved"]),
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
