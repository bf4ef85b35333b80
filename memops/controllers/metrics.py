"""The operator's Prometheus metrics, and the endpoint that serves them.

The controllers call the small functions here at the moments that matter (a drain starts or
ends, a policy decides, a worker is recycled); ``memops run --metrics-port`` serves them on
``/metrics``. Names follow Prometheus' naming guide (``memops_`` prefix, ``_total`` counters,
base units in ``_seconds`` and ``_bytes``). Labels are bounded: namespace and policy, and small
enumerations (outcome, reason, state, action); never a worker, pod or key name.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator

import prometheus_client

from memops import specs

REGISTRY = prometheus_client.CollectorRegistry(auto_describe=True)

_POLICY = ("namespace", "policy")


def _counter(name: str, documentation: str, *labels: str) -> prometheus_client.Counter:
    return prometheus_client.Counter(name, documentation, labels, registry=REGISTRY)


def _gauge(name: str, documentation: str, *labels: str) -> prometheus_client.Gauge:
    return prometheus_client.Gauge(name, documentation, labels, registry=REGISTRY)


def _histogram(name: str, documentation: str, *labels: str, buckets: tuple[float, ...]) -> prometheus_client.Histogram:
    return prometheus_client.Histogram(name, documentation, labels, buckets=buckets, registry=REGISTRY)


DRAINS_STARTED = _counter("memops_drains_started_total", "RetirementRequests whose drain started.", "namespace")
DRAINS_FINISHED = _counter(
    "memops_drains_finished_total",
    "RetirementRequests that finished, by outcome (Succeeded, Failed) and reason.",
    *("namespace", "outcome", "reason"),
)
DRAIN_SECONDS = _histogram(
    "memops_drain_duration_seconds",
    "From the start of a drain to its end, pods removed.",
    *("namespace", "outcome"),
    buckets=(0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800),
)
BYTES_MOVED = _counter(
    "memops_drain_moved_bytes_total", "Unique bytes that drains moved to other workers.", "namespace"
)
BYTES_LOST = _counter(
    "memops_drain_lost_bytes_total",
    "Unique bytes lost by forced removals (onTimeout: Force) or workers that died mid-drain.",
    "namespace",
)
LOST_AT_DEADLINE = _counter(
    "memops_drain_deadline_left_bytes_total",
    "Unique bytes that memops' drain had not moved when a RetirementRequest's timeout came"
    " (kept with the pod, or lost with onTimeout: Force).",
    "namespace",
)
HOOK_LOST_KEYS = _counter(
    "memops_safety_net_lost_keys_total",
    "Keys that the safety net's preStop drain had not moved when the pod's time ran out,"
    " by cause (deadline, or worker left: killed at the end of a shorter deletion grace period).",
    *_POLICY,
    "cause",
)
HOOK_LOST_BYTES = _counter("memops_safety_net_lost_bytes_total", "Bytes of those keys.", *_POLICY, "cause")
WORKER_LOSSES = _counter(
    "memops_worker_losses_total",
    "Workers of a policy's workload that left on their own (not drained by memops) with keys held"
    " nowhere else, by reason (OOMKilled, Error, Completed, Evicted, Deleted, Unknown, Other).",
    *_POLICY,
    "reason",
)
WORKER_LOST_BYTES = _counter(
    "memops_worker_lost_bytes_total", "Bytes of the keys those workers took.", *_POLICY, "reason"
)
WORKER_LOST_KEYS = _counter("memops_worker_lost_keys_total", "Keys those workers took.", *_POLICY, "reason")
_LOSS_REASONS = frozenset(("OOMKilled", "Error", "Completed", "Evicted", "Deleted", "Unknown"))
"""The reasons a label may carry: the pod's words otherwise become ``Other`` (labels stay bounded)."""
WORKERS = _counter(
    "memops_drained_workers_total",
    "Workers at the end of a drain, by state (Retired, Kept, Forced).",
    *("namespace", "state"),
)
DECISIONS = _counter(
    "memops_policy_decisions_total",
    "A MemoryPolicy's scaling decisions, by action (ScaleUp, ScaleDown, Wait).",
    *_POLICY,
    "action",
)
DESIRED = _gauge("memops_policy_desired_replicas", "Workers the policy steers towards.", *_POLICY)
REPLICAS = _gauge("memops_policy_replicas", "Workers that exist now.", *_POLICY)
UTILIZATION = _gauge(
    "memops_policy_memory_utilization_ratio",
    "Memory held by the workers (process plus spilled) over their limits.",
    *_POLICY,
)
RECYCLED = _counter(
    "memops_recycled_workers_total",
    "Workers recycled, by reason (UnmanagedMemory, Growth, MaxAge) and outcome (Recycled, Kept).",
    *_POLICY,
    *("reason", "outcome"),
)
TASK_PEAK = _gauge(
    "memops_task_peak_bytes",
    "Task admission's profile of a task prefix: what one task adds to its worker at its peak (the policy's"
    " top prefixes only, so that a tenant's prefixes cannot grow the label set).",
    *_POLICY,
    "prefix",
)
_TASK_STATES = ("probed", "admitted", "waiting", "preempted", "demand")
TASKS = _gauge(
    "memops_tasks",
    "Task admission's counts (state: probed, admitted, waiting for room, preempted, demand: fitting no worker).",
    *_POLICY,
    "state",
)
_PEAK_PREFIXES: dict[tuple[str, str], set[str]] = {}
"""The prefixes each policy's peak gauge reports now: the others' series are removed."""
RELIEF_KEYS = _counter(
    "memops_relief_moved_keys_total", "Keys that pressure relief moved off workers above relieveAbove.", *_POLICY
)
RELIEF_BYTES = _counter(
    "memops_relief_moved_bytes_total", "Bytes that pressure relief moved off workers above relieveAbove.", *_POLICY
)
DECISION_SECONDS = _histogram(
    "memops_decision_duration_seconds",
    "Time spent in the pure deciding functions, by decision.",
    "decision",
    buckets=(0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5),
)
ERRORS = _counter(
    "memops_reconcile_errors_total", "Reconcile passes that failed and will be retried, by kind.", "kind", "namespace"
)

_REPLICATION_STATES = ("under", "over")
_REPLICATION_KINDS = ("under", "over", "spent", "budget")
REPLICATION_KEYS = _gauge(
    "memops_replication_keys",
    "Ruled keys under or over their replication target (state: under, over).",
    *_POLICY,
    "state",
)
REPLICATION_BYTES = _gauge(
    "memops_replication_bytes",
    "Replication's bytes (kind: under, over, spent on extra copies, budget).",
    *_POLICY,
    "kind",
)
REPLICATION_COPIES = _counter(
    "memops_replication_copied_bytes_total", "Bytes that replication targets copied between workers.", *_POLICY
)

NAMES = frozenset(family.name for family in REGISTRY.collect())
"""Every metric family memops exports (as the exposition format names them, without suffixes)."""


def serve(port: int, host: str = "0.0.0.0") -> None:
    """Serve ``/metrics`` from a thread, as prometheus_client does."""
    # The *_created series (one more per counter and histogram) add nothing a dashboard uses.
    prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]
    prometheus_client.start_http_server(port, addr=host, registry=REGISTRY)


@contextlib.contextmanager
def deciding(decision: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        DECISION_SECONDS.labels(decision).observe(time.perf_counter() - start)


def drain_started(namespace: str) -> None:
    DRAINS_STARTED.labels(namespace).inc()


def drain_finished(namespace: str, status: specs.RetirementRequestStatus, reason: str, seconds: float | None) -> None:
    outcome = status.phase.value
    DRAINS_FINISHED.labels(namespace, outcome, reason).inc()
    if seconds is not None:
        DRAIN_SECONDS.labels(namespace, outcome).observe(seconds)
    BYTES_MOVED.labels(namespace).inc(status.bytesMoved)
    BYTES_LOST.labels(namespace).inc(status.bytesLost)
    for worker in status.workers:
        WORKERS.labels(namespace, worker.state.value).inc()
        if worker.lostAtDeadline is not None:
            LOST_AT_DEADLINE.labels(namespace).inc(worker.lostAtDeadline.bytes)


def hook_losses(namespace: str, policy: str, losses: Iterable[specs.HookLoss]) -> None:
    """Count losses of preStop drains that the policy's status records for the first time."""
    for loss in losses:
        HOOK_LOST_KEYS.labels(namespace, policy, loss.cause).inc(loss.keys)
        HOOK_LOST_BYTES.labels(namespace, policy, loss.cause).inc(loss.bytes)


def worker_losses(namespace: str, policy: str, losses: Iterable[specs.WorkerLoss]) -> None:
    """Count the workers' losses that the policy's status records for the first time."""
    for loss in losses:
        reason = loss.reason if loss.reason in _LOSS_REASONS else "Other"
        WORKER_LOSSES.labels(namespace, policy, reason).inc()
        WORKER_LOST_BYTES.labels(namespace, policy, reason).inc(loss.bytes)
        WORKER_LOST_KEYS.labels(namespace, policy, reason).inc(loss.keys)


def policy_observed(
    namespace: str, policy: str, *, action: str, desired: int, replicas: int, utilization: float | None
) -> None:
    if action != "None":
        DECISIONS.labels(namespace, policy, action).inc()
    DESIRED.labels(namespace, policy).set(desired)
    REPLICAS.labels(namespace, policy).set(replicas)
    if utilization is not None:
        UTILIZATION.labels(namespace, policy).set(utilization)


def policy_gone(namespace: str, policy: str) -> None:
    """Drop a deleted policy's gauges, so that they do not report a policy that no longer exists."""
    for gauge in (DESIRED, REPLICAS, UTILIZATION):
        with contextlib.suppress(KeyError):
            gauge.remove(namespace, policy)
    prefixes = tuple(_PEAK_PREFIXES.pop((namespace, policy), set()))
    for labelled, values in (
        (REPLICATION_KEYS, _REPLICATION_STATES),
        (REPLICATION_BYTES, _REPLICATION_KINDS),
        (TASKS, _TASK_STATES),
        (TASK_PEAK, prefixes),
    ):
        for value in values:
            with contextlib.suppress(KeyError):
                labelled.remove(namespace, policy, value)


def recycled(namespace: str, policy: str, reason: str, outcome: str) -> None:
    RECYCLED.labels(namespace, policy, reason, outcome).inc()


def relieved(namespace: str, policy: str, keys: int, nbytes: int) -> None:
    RELIEF_KEYS.labels(namespace, policy).inc(max(keys, 0))
    RELIEF_BYTES.labels(namespace, policy).inc(max(nbytes, 0))


def replication_observed(namespace: str, policy: str, status: specs.ReplicationStatus, copied: int) -> None:
    for state, keys in zip(_REPLICATION_STATES, (status.keysUnder, status.keysOver), strict=True):
        REPLICATION_KEYS.labels(namespace, policy, state).set(keys)
    figures = (status.bytesUnder, status.bytesOver, status.bytesSpent, status.budgetBytes)
    for kind, value in zip(_REPLICATION_KINDS, figures, strict=True):
        REPLICATION_BYTES.labels(namespace, policy, kind).set(value)
    REPLICATION_COPIES.labels(namespace, policy).inc(max(copied, 0))


def tasks_observed(namespace: str, policy: str, status: specs.TaskAdmissionStatus) -> None:
    figures = (status.tasksProbed, status.tasksAdmitted, status.waiting, status.preempted, status.demandTasks)
    for state, value in zip(_TASK_STATES, figures, strict=True):
        TASKS.labels(namespace, policy, state).set(value)
    shown = {peak.prefix for peak in status.top}
    for gone in _PEAK_PREFIXES.get((namespace, policy), set()) - shown:
        with contextlib.suppress(KeyError):
            TASK_PEAK.remove(namespace, policy, gone)
    for peak in status.top:
        TASK_PEAK.labels(namespace, policy, peak.prefix).set(peak.peakBytes)
    _PEAK_PREFIXES[(namespace, policy)] = shown


def reconcile_error(kind: str, namespace: str) -> None:
    ERRORS.labels(kind, namespace).inc()
