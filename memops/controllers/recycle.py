"""Recycling under a MemoryPolicy, the I/O half: sample memory, mark workers, record finished drains.

:mod:`memops.controllers.policy` calls :func:`observe` while it reads a pass (it reads only),
and :func:`apply_seen`, :func:`mark` and :func:`mark_recorded` while it applies one; which workers
to mark and drain, and how many to surge, is decided in :mod:`memops.decisions.policy_decisions`. What
matters lives in Kubernetes objects: a worker being recycled carries the
``memops.dev/recycle`` annotation (why, and since when); its drain is a RetirementRequest that
the policy owns, labelled ``memops.dev/purpose: recycle``; a finished one is recorded in the
policy's ``status.recycle`` and then annotated as recorded. A restarted operator finds all of
it and carries on. Only the memory samples live in the daemon (:class:`memops.decisions.recycle_decisions.Window`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

import kopf

from memops import specs
from memops.clients import kube
from memops.controllers import metrics
from memops.decisions import objects, policy_decisions, recycle_decisions, snapshots, timestamps

_RECENT = 10


def _mark(pod: objects.Obj) -> objects.Obj | None:
    raw = (pod["metadata"].get("annotations") or {}).get(objects.RECYCLE_ANNOTATION)
    if not raw:
        return None
    try:
        mark = json.loads(raw)
    except json.JSONDecodeError:
        return {"reason": "Unknown", "message": raw, "startTime": ""}
    return mark if isinstance(mark, dict) else None


def _pod_path(namespace: str, name: str) -> str:
    return kube.resource_path("", "v1", "pods", namespace, name)


def observe(
    *,
    pods: list[objects.Obj],
    snapshot: snapshots.SchedulerSnapshot,
    window: recycle_decisions.Window,
    requests: list[objects.Obj],
    record: specs.RecycleStatus,
    now: float,
) -> policy_decisions.RecycleSeen:
    """The recycling pass' reading: sample the workers' memory, and find what to show on their
    pods and the drains that finished (applied by :func:`apply_seen`); what to mark and drain
    next is :func:`memops.decisions.policy_decisions.decide`'s."""
    window.add(snapshot.workers, now)
    mine = [r for r in requests if (r["metadata"].get("labels") or {}).get(objects.PURPOSE_LABEL) == "recycle"]
    record = record.model_copy(deep=True)
    recorded, ended, unmark = _record_finished(mine, record)
    return policy_decisions.RecycleSeen(
        pods=tuple(
            policy_decisions.PodSeen(
                name=str(p["metadata"]["name"]),
                age=timestamps.age_seconds(p["metadata"].get("creationTimestamp")),
                mark=_mark(p),
            )
            for p in pods
        ),
        samples=dict(window.samples),
        shuffling=frozenset(w.name for w in snapshot.workers if w.in_shuffle),
        connected=frozenset(w.name for w in snapshot.workers if w.status == "running"),
        record=record,
        recorded=recorded,
        unmanaged=_unmanaged_to_show(pods, window, now),
        ended=ended,
        unmark=unmark,
    )


async def apply_seen(
    client: kube.Kube,
    *,
    body: kopf.Body,
    seen: policy_decisions.RecycleSeen,
    logger: logging.Logger | logging.LoggerAdapter[Any],
) -> None:
    """What :func:`observe` found to show: the unmanaged memory on the pods, an event and a metric
    for each finished drain, and no mark any more on a pod whose drain failed."""
    namespace = str(body.metadata.namespace)
    for name, shown in seen.unmanaged.items():
        await _patch_pod(client, namespace, name, {objects.UNMANAGED_ANNOTATION: shown})
    for entry in seen.ended:
        metrics.recycled(namespace, str(body.metadata.name), entry.reason, entry.outcome)
        took = f" in {entry.seconds:.0f}s" if entry.seconds is not None else ""
        if entry.outcome == "Recycled":
            kopf.event(body, type="Normal", reason="Recycled", message=f"recycled {entry.pod} ({entry.reason}){took}")
        else:
            kopf.event(body, type="Warning", reason="RecycleFailed", message=f"kept {entry.pod}: {entry.message}")
        logger.info("recycling of %s ended: %s%s", entry.pod, entry.outcome, took)
    for pod in seen.unmark:
        # The pod stays, unmarked: its data had nowhere to go. The rule may mark it again
        # later, after a full window of fresh evidence.
        await _patch_pod(client, namespace, pod, {objects.RECYCLE_ANNOTATION: None})


async def mark(client: kube.Kube, namespace: str, pod: str, mark: Mapping[str, str]) -> None:
    """Mark a worker for recycling: its pod carries why, and since when."""
    await client.merge_patch(
        _pod_path(namespace, pod), {"metadata": {"annotations": {objects.RECYCLE_ANNOTATION: json.dumps(mark)}}}
    )


def _seconds_between(start: str, end: str) -> float | None:
    try:
        return (timestamps.parse(end) - timestamps.parse(start)).total_seconds()
    except ValueError:
        return None


async def mark_recorded(client: kube.Kube, namespace: str, names: tuple[str, ...]) -> None:
    """After the policy's status holds them: a finished request is recorded once."""
    for name in names:
        try:
            await client.merge_patch(
                kube.resource_path(specs.GROUP, specs.VERSION, "retirementrequests", namespace, name),
                {"metadata": {"annotations": {objects.RECORDED_ANNOTATION: "true"}}},
            )
        except kube.ApiError as exc:
            if exc.code != 404:
                raise


def _unmanaged_to_show(pods: list[objects.Obj], window: recycle_decisions.Window, now: float) -> dict[str, str]:
    """Each worker's unmanaged memory to show on its pod, only where the whole percent changed."""
    shown: dict[str, str] = {}
    for pod in pods:
        name = str(pod["metadata"]["name"])
        percent = recycle_decisions.annotation_percent(window.samples, name, now)
        if (
            percent is not None
            and (pod["metadata"].get("annotations") or {}).get(objects.UNMANAGED_ANNOTATION) != percent
        ):
            shown[name] = percent
    return shown


async def _patch_pod(client: kube.Kube, namespace: str, pod: str, annotations: Mapping[str, str | None]) -> None:
    try:
        await client.merge_patch(_pod_path(namespace, pod), {"metadata": {"annotations": dict(annotations)}})
    except kube.ApiError as exc:
        if exc.code != 404:  # the pod went away meanwhile: nothing to show
            raise


def _record_finished(
    requests: list[objects.Obj], record: specs.RecycleStatus
) -> tuple[tuple[str, ...], tuple[specs.Recycling, ...], tuple[str, ...]]:
    """Move finished recycling drains into ``status.recycle.recent`` (in ``record``), once each:
    the requests to annotate as recorded, the entries new to the record, the pods to unmark."""
    recorded, ended, unmark = [], [], []
    for request in requests:
        meta, state = request["metadata"], request.get("status") or {}
        if not objects.is_finished(request) or (meta.get("annotations") or {}).get(objects.RECORDED_ANNOTATION):
            continue
        annotations = meta.get("annotations") or {}
        mark = json.loads(annotations.get(objects.RECYCLE_ANNOTATION, "{}"))
        pod = str(annotations.get(objects.POD_ANNOTATION, ""))
        succeeded = state["phase"] == specs.Phase.SUCCEEDED.value
        start, end = str(mark.get("startTime", "")), str(state.get("completionTime", ""))
        entry = specs.Recycling(
            pod=pod,
            reason=str(mark.get("reason", "")),
            message=str(mark.get("message", "")) if succeeded else str(state.get("message", "")),
            startTime=start,
            completionTime=end,
            seconds=_seconds_between(start, end) if start and end else None,
            outcome="Recycled" if succeeded else "Kept",
            request=str(meta["name"]),
        )
        if all(r.request != entry.request for r in record.recent):
            record.recent = [*record.recent, entry][-_RECENT:]
            record.total += 1 if succeeded else 0
            ended.append(entry)
        if not succeeded:
            unmark.append(pod)
        recorded.append(str(meta["name"]))
    return tuple(recorded), tuple(ended), tuple(unmark)
