"""Recycling under a MemoryPolicy: mark leaky or old workers, surge, drain, record.

Called by :mod:`memops.controllers.policy` once per pass, before it decides the count. What
matters lives in Kubernetes objects: a worker being recycled carries the
``memops.dev/recycle`` annotation (why, and since when); its drain is a RetirementRequest that
the policy owns, labelled ``memops.dev/purpose: recycle``; a finished one is recorded in the
policy's ``status.recycle`` and then annotated as recorded. A restarted operator finds all of
it and carries on. Only the memory samples live in the daemon (:class:`memops.recycle_decisions.Window`).
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import json
import logging
from typing import Any

import kopf

from memops import kube, metrics, recycle_decisions, snapshots, specs, timestamps

RECYCLE_ANNOTATION = "memops.dev/recycle"
UNMANAGED_ANNOTATION = "memops.dev/unmanaged-memory"
PURPOSE_LABEL = "memops.dev/purpose"
RECORDED_ANNOTATION = "memops.dev/recorded"
POD_ANNOTATION = "memops.dev/recycled-pod"
_RECENT = 10
_TERMINAL = (specs.Phase.SUCCEEDED.value, specs.Phase.FAILED.value)

Obj = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Step:
    extra: int  # workers to run above the desired count, for the replacements
    message: str
    recorded: tuple[str, ...] = ()  # requests to annotate as recorded once the status is written


def _mark(pod: Obj) -> Obj | None:
    raw = (pod["metadata"].get("annotations") or {}).get(RECYCLE_ANNOTATION)
    if not raw:
        return None
    try:
        mark = json.loads(raw)
    except json.JSONDecodeError:
        return {"reason": "Unknown", "message": raw, "startTime": ""}
    return mark if isinstance(mark, dict) else None


def _pod_path(namespace: str, name: str) -> str:
    return kube.resource_path("", "v1", "pods", namespace, name)


def request_name(policy: str, pod: str, attempt: int) -> str:
    # One name per worker and attempt: a pass repeated after a restart gets 409, not a second request.
    # Cut to an object name's 253 characters from the left; a name starts with a letter or digit.
    return f"{policy}-recycle-{pod}-{attempt}"[-253:].lstrip("-.")


def _pod_of(request: Obj) -> str:
    return str((request["metadata"].get("annotations") or {}).get(POD_ANNOTATION, ""))


async def reconcile(
    client: kube.Kube,
    *,
    body: kopf.Body,
    spec: specs.MemoryPolicySpec,
    pods: list[Obj],
    snapshot: snapshots.SchedulerSnapshot,
    window: recycle_decisions.Window,
    requests: list[Obj],
    desired: int,
    busy: bool,
    status: specs.MemoryPolicyStatus,
    now: float,
    logger: logging.Logger | logging.LoggerAdapter[Any],
) -> Step:
    """One pass of recycling. ``busy``: a scale-down of the policy is draining, so nothing new starts."""
    assert spec.recycle is not None
    namespace, policy = str(body.metadata.namespace), str(body.metadata.name)
    record = status.recycle or specs.RecycleStatus()
    window.add(snapshot.workers, now)
    await _annotate_unmanaged(client, namespace, pods, window, now)

    mine = [r for r in requests if (r["metadata"].get("labels") or {}).get(PURPOSE_LABEL) == "recycle"]
    recorded = await _record_finished(client, body, namespace, mine, record, logger)

    marked = {str(p["metadata"]["name"]): mark for p in pods if (mark := _mark(p)) is not None}
    if not busy:
        ages = {
            str(p["metadata"]["name"]): timestamps.age_seconds(p["metadata"].get("creationTimestamp")) for p in pods
        }
        with metrics.deciding("recycle"):
            verdicts = [
                verdict
                for name in ages
                if name not in marked
                and (
                    verdict := recycle_decisions.detect(
                        name, window.samples.get(name, []), spec.recycle, now, ages[name]
                    )
                )
            ]
        shuffling = {w.name for w in snapshot.workers if w.in_shuffle}
        for verdict in recycle_decisions.plan_recycle(
            verdicts, recycling=len(marked), max_unavailable=spec.recycle.maxUnavailable, in_shuffle=shuffling
        ):
            mark = {"reason": verdict.reason, "message": verdict.message, "startTime": _render(now)}
            await client.merge_patch(
                _pod_path(namespace, verdict.pod), {"metadata": {"annotations": {RECYCLE_ANNOTATION: json.dumps(mark)}}}
            )
            marked[verdict.pod] = mark
            kopf.event(body, type="Normal", reason="Recycling", message=f"recycling {verdict.pod}: {verdict.message}")
            logger.info("recycling %s: %s", verdict.pod, verdict.message)

    requested = {
        _pod_of(r): str(r["metadata"]["name"]) for r in mine if (r.get("status") or {}).get("phase") not in _TERMINAL
    }
    attempts = collections.Counter(_pod_of(r) for r in mine)
    connected = {w.name for w in snapshot.workers if w.status == "running"}
    plan = recycle_decisions.plan_replacement(
        marked=sorted(marked),
        requested=requested,
        connected_unmarked=len([p for p in pods if p["metadata"]["name"] in connected - set(marked)]),
        desired=desired,
        surge=spec.recycle.surge,
    )
    for pod in plan.drain:
        requested[pod] = request_name(policy, pod, attempts[pod])
        await _request_drain(client, body, spec, requested[pod], pod, marked[pod])
    record.recycling = [
        specs.Recycling(
            pod=pod,
            reason=str(mark.get("reason", "")),
            message=str(mark.get("message", "")),
            startTime=str(mark.get("startTime", "")),
            request=requested.get(pod, ""),
        )
        for pod, mark in sorted(marked.items())
    ]
    status.recycle = record
    return Step(extra=plan.extra, message=plan.message, recorded=recorded)


def _render(unix: float) -> str:
    return timestamps.render(datetime.datetime.fromtimestamp(unix, tz=datetime.UTC))


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
                {"metadata": {"annotations": {RECORDED_ANNOTATION: "true"}}},
            )
        except kube.ApiError as exc:
            if exc.code != 404:
                raise


async def _annotate_unmanaged(
    client: kube.Kube, namespace: str, pods: list[Obj], window: recycle_decisions.Window, now: float
) -> None:
    """Show each worker's unmanaged memory on its pod, written only when the whole percent changes."""
    for pod in pods:
        name = str(pod["metadata"]["name"])
        shown = recycle_decisions.annotation_percent(window.samples, name, now)
        if shown is not None and (pod["metadata"].get("annotations") or {}).get(UNMANAGED_ANNOTATION) != shown:
            try:
                await client.merge_patch(
                    _pod_path(namespace, name), {"metadata": {"annotations": {UNMANAGED_ANNOTATION: shown}}}
                )
            except kube.ApiError as exc:
                if exc.code != 404:  # the pod went away meanwhile: nothing to show
                    raise


async def _request_drain(
    client: kube.Kube, body: kopf.Body, spec: specs.MemoryPolicySpec, name: str, pod: str, mark: Obj
) -> None:
    namespace, policy = str(body.metadata.namespace), str(body.metadata.name)
    request = {
        "apiVersion": specs.API_VERSION,
        "kind": "RetirementRequest",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"memops.dev/policy": policy, PURPOSE_LABEL: "recycle"},
            "annotations": {
                RECYCLE_ANNOTATION: json.dumps(mark),
                POD_ANNOTATION: pod,
            },
            "ownerReferences": [
                {
                    "apiVersion": specs.API_VERSION,
                    "kind": "MemoryPolicy",
                    "name": policy,
                    "uid": str(body.metadata.uid),
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {
            "scheduler": spec.scheduler.model_dump(mode="json", exclude_none=True),
            "workload": spec.workload.model_dump(mode="json"),
            "workers": [pod],
            "timeout": spec.drain.timeout,
            "onTimeout": spec.drain.onTimeout.value,
        },
    }
    try:
        await client.request(
            "POST", kube.resource_path(specs.GROUP, specs.VERSION, "retirementrequests", namespace), body=request
        )
    except kube.ApiError as exc:
        if exc.code != 409:
            raise


async def _record_finished(
    client: kube.Kube,
    body: kopf.Body,
    namespace: str,
    requests: list[Obj],
    record: specs.RecycleStatus,
    logger: logging.Logger | logging.LoggerAdapter[Any],
) -> tuple[str, ...]:
    """Move finished recycling drains into ``status.recycle.recent``, once each."""
    recorded = []
    for request in requests:
        meta, state = request["metadata"], request.get("status") or {}
        if state.get("phase") not in _TERMINAL or (meta.get("annotations") or {}).get(RECORDED_ANNOTATION):
            continue
        annotations = meta.get("annotations") or {}
        mark = json.loads(annotations.get(RECYCLE_ANNOTATION, "{}"))
        pod = str(annotations.get(POD_ANNOTATION, ""))
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
                    _pod_path(namespace, pod), {"metadata": {"annotations": {RECYCLE_ANNOTATION: None}}}
                )
            except kube.ApiError as exc:
                if exc.code != 404:
                    raise
        recorded.append(str(meta["name"]))
    return tuple(recorded)
