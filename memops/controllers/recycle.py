"""Recycling under a MemoryPolicy, the I/O half: sample memory, mark workers, record finished drains.

:mod:`memops.controllers.policy` calls :func:`observe` while it reads a pass, and :func:`mark`
and :func:`mark_recorded` while it applies one; which workers to mark and drain, and how many
to surge, is decided in :mod:`memops.policy_decisions`. What
matters lives in Kubernetes objects: a worker being recycled carries the
``memops.dev/recycle`` annotation (why, and since when); its drain is a RetirementRequest that
the policy owns, labelled ``memops.dev/purpose: recycle``; a finished one is recorded in the
policy's ``status.recycle`` and then annotated as recorded. A restarted operator finds all of
it and carries on. Only the memory samples live in the daemon (:class:`memops.recycle_decisions.Window`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

import kopf

from memops import kube, metrics, objects, policy_decisions, recycle_decisions, snapshots, specs, timestamps

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


async def observe(
    client: kube.Kube,
    *,
    body: kopf.Body,
    pods: list[objects.Obj],
    snapshot: snapshots.SchedulerSnapshot,
    window: recycle_decisions.Window,
    requests: list[objects.Obj],
    record: specs.RecycleStatus,
    now: float,
    logger: logging.Logger | logging.LoggerAdapter[Any],
) -> policy_decisions.RecycleSeen:
    """The recycling pass' reading: sample the workers' memory, show it on their pods, and record
    the drains that finished; what to mark and drain next is :func:`memops.policy_decisions.decide`'s."""
    namespace = str(body.metadata.namespace)
    window.add(snapshot.workers, now)
    await _annotate_unmanaged(client, namespace, pods, window, now)
    mine = [r for r in requests if (r["metadata"].get("labels") or {}).get(objects.PURPOSE_LABEL) == "recycle"]
    record = record.model_copy(deep=True)
    recorded = await _record_finished(client, body, namespace, mine, record, logger)
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
    )


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


async def _annotate_unmanaged(
    client: kube.Kube, namespace: str, pods: list[objects.Obj], window: recycle_decisions.Window, now: float
) -> None:
    """Show each worker's unmanaged memory on its pod, written only when the whole percent changes."""
    for pod in pods:
        name = str(pod["metadata"]["name"])
        shown = recycle_decisions.annotation_percent(window.samples, name, now)
        if shown is not None and (pod["metadata"].get("annotations") or {}).get(objects.UNMANAGED_ANNOTATION) != shown:
            try:
                await client.merge_patch(
                    _pod_path(namespace, name), {"metadata": {"annotations": {objects.UNMANAGED_ANNOTATION: shown}}}
                )
            except kube.ApiError as exc:
                if exc.code != 404:  # the pod went away meanwhile: nothing to show
                    raise


async def _record_finished(
    client: kube.Kube,
    body: kopf.Body,
    namespace: str,
    requests: list[objects.Obj],
    record: specs.RecycleStatus,
    logger: logging.Logger | logging.LoggerAdapter[Any],
) -> tuple[str, ...]:
    """Move finished recycling drains into ``status.recycle.recent``, once each."""
    recorded = []
    for request in requests:
        meta, state = request["metadata"], request.get("status") or {}
        if not objects.is_finished(request) or (meta.get("annotations") or {}).get(objects.RECORDED_ANNOTATION):
            continue
        annotations = meta.get("annotations") or {}
        mark = json.loads(annotations.get(objects.RECYCLE_ANNOTATION, "{}"))
        pod = str(annotations.get(objects.POD_ANNOTATION, ""))
        succeeded = state["phase"] == specs.Phase.SUCCEEDED.value
        start, end = str(mark.get("startTime", "")), str(state.get("completionTime", ""))
        seconds = _seconds_between(start, end) if start and end else None
        entry = specs.Recycling(
            pod=pod,
            reason=str(mark.get("reason", "")),
            message=str(mark.get("message", "")) if succeeded else str(state.get("message", "")),
            startTime=start,
            completionTime=end,
            seconds=seconds,
            outcome="Recycled" if succeeded else "Kept",
            request=str(meta["name"]),
        )
        if all(r.request != entry.request for r in record.recent):
            metrics.recycled(namespace, str(body.metadata.name), entry.reason, entry.outcome)
            record.recent = [*record.recent, entry][-_RECENT:]
            record.total += 1 if succeeded else 0
            took = f" in {seconds:.0f}s" if seconds is not None else ""
            if succeeded:
                kopf.event(body, type="Normal", reason="Recycled", message=f"recycled {pod} ({entry.reason}){took}")
            else:
                kopf.event(body, type="Warning", reason="RecycleFailed", message=f"kept {pod}: {entry.message}")
            logger.info("recycling of %s ended: %s%s", pod, entry.outcome, took)
        if not succeeded:
            # The pod stays, unmarked: its data had nowhere to go. The rule may mark it again
            # later, after a full window of fresh evidence.
            try:
                await client.merge_patch(
                    _pod_path(namespace, pod), {"metadata": {"annotations": {objects.RECYCLE_ANNOTATION: None}}}
                )
            except kube.ApiError as exc:
                if exc.code != 404:
                    raise
        recorded.append(str(meta["name"]))
    return tuple(recorded)
