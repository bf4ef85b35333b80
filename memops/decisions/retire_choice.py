"""Which workers a RetirementRequest with ``count`` retires: the pods whose retirement costs least.

Pure, over the scheduler's snapshot (:mod:`memops.decisions.snapshots`). A request's start
(:func:`memops.decisions.retirement_decisions.start`) leaves out the pods that another request
claimed and the Running pods with no worker memops can identify (:func:`unidentified`), then
ranks the rest (:func:`choose_workers`); ``bench/decision_cost.py`` measures the ranking.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from memops.decisions import snapshots


def unidentified(pods: Sequence[snapshots.PodInfo], located: Mapping[str, Sequence[snapshots.WorkerInfo]]) -> list[str]:
    """Running pods with no worker memops can identify: they may hold data, so none is "empty"."""
    return [pod.name for pod in pods if pod.phase == "Running" and not located.get(pod.name)]


def choose_workers(
    pod_names: Sequence[str],
    snapshot: snapshots.SchedulerSnapshot,
    count: int,
    exclude: Collection[str] = (),
    *,
    located: Mapping[str, Sequence[snapshots.WorkerInfo]] | None = None,
) -> list[str]:
    """The ``count`` pods whose retirement costs least.

    Pods with no connected worker come first (they hold nothing); then connected workers not
    in the middle of a shuffle before those that are; then fewest unique bytes, then fewest
    managed bytes, then name, so the choice is deterministic. Pods in ``exclude`` (claimed by
    another request, or Running with no identifiable worker: see :func:`unidentified`) are never
    chosen. ``located`` maps each pod to its workers
    (:func:`memops.decisions.snapshots.workers_by_pod`); without it a worker is its pod's by
    name. A pod with several workers costs their sum. When fewer candidates than ``count`` exist,
    all of them are returned and the caller reports it.
    """
    if count <= 0:
        return []
    excluded = set(exclude)

    def workers_of(pod: str) -> Sequence[snapshots.WorkerInfo]:
        if located is not None:
            return located.get(pod, ())
        worker = snapshot.by_name(pod)
        return () if worker is None else (worker,)

    def cost(pod: str) -> tuple[int, bool, int, int, str]:
        workers = workers_of(pod)
        if not workers:
            return (0, False, 0, 0, pod)
        return (
            1,
            any(w.in_shuffle for w in workers),
            sum(w.unique_bytes for w in workers),
            sum(w.managed_bytes for w in workers),
            pod,
        )

    candidates = sorted((p for p in pod_names if p not in excluded), key=cost)
    return candidates[:count]
