"""What the safety net's preStop drains lost, read from memops' agent into the policy's status.

The hook asks memops' agent in the scheduler for the drain (:mod:`memops.decisions.safetynet`); when the
pod's time runs out first, only the agent knows what stayed on the worker (its ``drain_status``,
``lostAtDeadline``). The policy's pass reads it with the workers, on the same connection
(:meth:`memops.clients.daskrpc.Scheduler.snapshot` with ``drains``), and records it here, level-based: the
agent keeps every drain's figures until the scheduler restarts, and
:func:`memops.decisions.safetynet.hook_losses` keys each record by pod and time, so a drain is recorded
(and counted in the metrics, once the status holds it: :func:`memops.controllers.metrics.hook_losses`) once,
whatever the passes and restarts of the operator.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from memops import specs
from memops.decisions import safetynet


def read(
    spec: specs.MemoryPolicySpec,
    current: specs.SafetyNetStatus | None,
    drains: Mapping[str, Any] | None,
    *,
    logger: logging.Logger | logging.LoggerAdapter[Any],
) -> specs.SafetyNetStatus | None:
    """``current`` with the latest losses of the workload's preStop drains, from ``drains`` (the
    agent's ``drain_status`` of the namespace's scheduler, hostile input); ``current`` unchanged
    when the scheduler could not tell (None: the next pass asks again)."""
    if drains is None:
        logger.warning("cannot read the preStop drains' losses: the scheduler does not run memops' agent")
        return current
    previous = current.lostAtDeadline if current is not None else []
    losses = safetynet.hook_losses(drains, spec.workload, previous)
    if losses == previous:
        return current
    return (current or specs.SafetyNetStatus()).model_copy(update={"lostAtDeadline": losses})
