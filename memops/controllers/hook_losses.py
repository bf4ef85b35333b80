"""What the safety net's preStop drains lost, read from memops' agent into the policy's status.

The hook asks memops' agent in the scheduler for the drain (:mod:`memops.safetynet`); when the
pod's time runs out first, only the agent knows what stayed on the worker (its ``drain_status``,
``lostAtDeadline``). The policy's pass reads it here, level-based: the agent keeps every drain's
figures until the scheduler restarts, and :func:`memops.safetynet.hook_losses` keys each record
by pod and time, so a drain is recorded (and counted in the metrics, once the status holds it:
:func:`memops.metrics.hook_losses`) once, whatever the passes and restarts of the operator.
"""

from __future__ import annotations

import logging
from typing import Any

from memops import daskcomm, daskrpc, safetynet, specs

_RPC_SECONDS = 5.0


async def read(
    spec: specs.MemoryPolicySpec,
    current: specs.SafetyNetStatus | None,
    *,
    security: Any,
    logger: logging.Logger | logging.LoggerAdapter[Any],
) -> specs.SafetyNetStatus | None:
    """``current`` with the latest losses of the workload's preStop drains; ``current`` unchanged
    when the scheduler cannot tell (the next pass asks again). Call only for a scheduler shown
    to be the namespace's: it may install the agent."""
    try:
        drains = await daskrpc.drain_status(spec.scheduler.address, security=security, timeout=_RPC_SECONDS)
    except (daskrpc.SchedulerUnreachable, daskrpc.SchedulerRefused, daskcomm.Misbehaved) as exc:
        logger.warning("cannot read the preStop drains' losses from the scheduler: %s", exc)
        return current
    previous = current.lostAtDeadline if current is not None else []
    losses = safetynet.hook_losses(drains, spec.workload, previous)
    if losses == previous:
        return current
    return (current or specs.SafetyNetStatus()).model_copy(update={"lostAtDeadline": losses})
