"""Workers that left on their own with keys held nowhere else, read from memops' agent into the policy's status.

A worker killed by the kernel's OOM killer, by its nanny, or with its pod (evicted, deleted
without the safety net's drain) takes the keys it alone held. memops' agent in the scheduler
records each such departure (:mod:`memops.scheduler.departures`); the policy's pass reads the
records with the drains, on the same connection (:meth:`memops.clients.daskrpc.Scheduler.snapshot`
with ``drains``), and, when one may be new, the workload's pods, for whose pod it was and why
(:mod:`memops.decisions.worker_loss_decisions`). The status holds the last ones, keyed by pod and time, so
a departure is recorded, posted as a ``WorkerLost`` Warning and counted in the metrics (once the
status holds it: :func:`memops.controllers.metrics.worker_losses`) once, whatever the passes and
restarts of the operator.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from memops import specs
from memops.clients import kube
from memops.decisions import worker_loss_decisions


async def read(
    client: kube.Kube,
    *,
    namespace: str,
    spec: specs.MemoryPolicySpec,
    selector: str,
    current: Sequence[specs.WorkerLoss],
    departures: Any,
    since: float,
    now: float,
    known: Mapping[str, str],
) -> worker_loss_decisions.Decision:
    """``current`` with the workload's new losses from ``departures`` (the agent's reply, hostile
    input) after ``since``; the workload's pods (``selector``, those being deleted too) are listed
    only when a record may be new."""
    pending = worker_loss_decisions.pending(worker_loss_decisions.parse(departures), since=since)
    if not pending:
        return worker_loss_decisions.Decision(list(current), [], [], since)
    path = kube.resource_path("", "v1", "pods", namespace)
    pods = await client.list(path, label_selector=selector) if selector else []
    return worker_loss_decisions.decide(pending, pods, spec.workload, current, now=now, since=since, known=known)
