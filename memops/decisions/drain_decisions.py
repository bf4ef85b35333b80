"""Pure decisions of a RetirementRequest: what each chosen worker's drain came to, and what
the request as a whole came to. No I/O; :mod:`memops.controllers.retirement` calls these
between reading the scheduler and writing the status.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import pydantic

from memops import specs
from memops.decisions import objects, snapshots


def explain_invalid(error: pydantic.ValidationError, prefix: str = "spec") -> str:
    """One line per problem, each naming the field as a Kubernetes user writes it."""
    lines = []
    for problem in error.errors():
        path = ".".join([prefix, *(str(p) for p in problem["loc"])]) if problem["loc"] else prefix
        message = problem["msg"].removeprefix("Value error, ")
        lines.append(f"{path}: {message}")
    return "; ".join(lines)


def claimed_by_others(pods: Iterable[Mapping[str, object]], me: str) -> set[str]:
    """Names of pods that another RetirementRequest has claimed."""
    result = set()
    for pod in pods:
        meta = pod.get("metadata", {})
        assert isinstance(meta, dict)
        owner = (meta.get("annotations") or {}).get(objects.CLAIM_ANNOTATION)
        if owner and owner != me:
            result.add(str(meta["name"]))
    return result


def entry(pod: str, workers: Sequence[snapshots.WorkerInfo], *, unknown: bool = False) -> specs.WorkerStatus:
    """The status of a chosen pod when the drain starts, from the workers that run in it."""
    if unknown:
        return _with(specs.WorkerStatus(pod=pod, state=specs.WorkerState.KEPT), _cause(specs.WorkerReason.UNIDENTIFIED))
    if not workers:
        return _with(
            specs.WorkerStatus(pod=pod, state=specs.WorkerState.DRAINING), _cause(specs.WorkerReason.NO_WORKER)
        )
    started = specs.WorkerStatus(
        pod=pod,
        address=workers[0].address,
        addresses=[w.address for w in workers],
        state=specs.WorkerState.DRAINING,
        uniqueBytes=sum(w.unique_bytes for w in workers),
    )
    return _with(started, _cause(specs.WorkerReason.DRAINING))


def unidentified_message(pods: Sequence[str]) -> str:
    return (
        f"pods {', '.join(pods)} are Running, but no connected worker has their IP as its address' host or"
        " their name: memops cannot tell what they hold, so it keeps them (is the worker still starting,"
        " or does it listen on another address than the pod's IP?)"
    )


def render(worker: specs.WorkerStatus) -> str:
    """The worker's message, from its cause, its state and whether its pod is removed.

    The one place where a worker's outcome becomes words. A status written before causes were
    recorded has none: its message stands as it was written.
    """
    cause = worker.cause
    if cause is None:
        return worker.message
    reason = specs.WorkerReason
    alone = f"{cause.bytes} bytes ({cause.keys} keys) that exist nowhere else"
    removal = "removed" if worker.podRemoved else "removing"
    head = {
        reason.UNIDENTIFIED: unidentified_message([worker.pod]),
        reason.NO_WORKER: "no connected worker, nothing to drain",
        reason.DRAINING: "draining",
        reason.DRAINED: "drained: the scheduler retired the worker",
        reason.DIED: f"the worker left the scheduler during the drain (it died): {cause.bytes} bytes"
        f" ({cause.keys} keys) that had not moved yet were lost with it",
        reason.NOWHERE_TO_GO: "the scheduler could not retire the worker: its unique data had nowhere to go",
        reason.TIMED_OUT: "the drain did not finish within spec.timeout (the scheduler may still finish it)",
        reason.UNREACHABLE: f"the scheduler was unreachable until spec.timeout ({cause.detail})",
    }[cause.reason]
    if cause.kept == specs.KeptReason.REQUEST_FAILED:
        return f"{head}; pod kept: {cause.keptDetail}"
    if cause.kept == specs.KeptReason.REMOVAL_BLOCKED:
        return f"{head}; pod kept at spec.timeout, {cause.keptDetail}"
    if worker.state == specs.WorkerState.FORCED:
        lost = f"; up to {cause.bytes} bytes may be lost" if cause.reason == reason.UNREACHABLE else f" with {alone}"
        return f"{head}; onTimeout is Force: {removal} the pod{lost}"
    if worker.state == specs.WorkerState.KEPT and cause.reason == reason.UNREACHABLE:
        return f"{head}; kept the pod, since nothing confirms that its data moved"
    if worker.state == specs.WorkerState.KEPT and cause.reason != reason.UNIDENTIFIED:
        return f"{head}; kept its pod, which holds {alone}"
    if not worker.removable:
        return head
    if cause.reason == reason.DIED:
        head += "; its pod holds no unique data now"
    return f"{head}; {'its pod was removed' if worker.podRemoved else 'removing its pod'}"


def _cause(reason: specs.WorkerReason, *, nbytes: int = 0, keys: int = 0, detail: str = "") -> specs.WorkerCause:
    return specs.WorkerCause(reason=reason, bytes=nbytes, keys=keys, detail=detail)


def _with(worker: specs.WorkerStatus, cause: specs.WorkerCause | None = None, **update: object) -> specs.WorkerStatus:
    """The worker with these fields changed (and this cause, if given), its message rendered anew."""
    if cause is not None:
        update["cause"] = cause
    changed = worker.model_copy(update=update)
    return changed.model_copy(update={"message": render(changed)})


def judge_drain(
    workers: Sequence[specs.WorkerStatus],
    *,
    before: snapshots.SchedulerSnapshot | None,
    after: snapshots.SchedulerSnapshot,
    retired: Iterable[str],
    timed_out: bool,
    on_timeout: specs.OnTimeout,
    located: Mapping[str, Sequence[snapshots.WorkerInfo]] | None = None,
    lost_at_deadline: Mapping[str, tuple[int, int]] | None = None,
    linked: Mapping[str, tuple[int, int]] | None = None,
) -> list[specs.WorkerStatus]:
    """Decide each draining worker's fate once the scheduler has answered.

    A pod may be removed once the workers it ran have left the scheduler and whatever runs in
    the pod now holds no unique data: the scheduler retired the workers (their data moved), or
    they died during the drain (what had not moved died with them, and the status says how
    much). The pod then stays ``Draining`` until it is gone. A pod whose workers still hold
    unique data is ``Kept``, or with ``onTimeout: Force`` marked ``Forced`` with the bytes its
    removal loses. A pod that ran several workers (``--nworkers``) is removable only when all of
    them are. ``located`` maps each pod to the workers that run in it now
    (:func:`memops.decisions.snapshots.workers_by_pod` over ``after``); without it a worker is its pod's by
    name. ``before`` is the snapshot taken when this process began the drain; after an operator
    restart it may not know the workers any more, and the status' own figures stand.
    ``lost_at_deadline``: by worker address, (keys, bytes) that memops' drain left on it at its
    deadline; a kept or forced pod's workers' figures are recorded as its ``lostAtDeadline``.
    ``linked``: by worker address, (keys, bytes) that memops' drain handed over by link, recorded
    as its pod's ``keysLinked`` and ``bytesLinked`` (summed over the pod's workers).
    """
    retired_set = set(retired)
    stopped = lost_at_deadline or {}
    result = []
    for worker in workers:
        if worker.state != specs.WorkerState.DRAINING or worker.removable:
            result.append(worker)
            continue
        recorded = tuple(worker.addresses) or ((worker.address,) if worker.address else ())
        if located is not None:
            current: Sequence[snapshots.WorkerInfo] = located.get(worker.pod, ())
        else:
            found = after.by_name(worker.pod)
            current = () if found is None else (found,)
        holding = sum(c.unique_bytes for c in current)  # what runs in this pod now, if anything
        holding_keys = sum(c.unique_keys for c in current)
        gone = not any(c.address in recorded for c in current)
        moved, lost, lost_keys = worker.uniqueBytes, 0, 0
        known = [a for a in recorded if before is not None and before.by_address(a) is not None]
        if known and before is not None:
            moved = lost = lost_keys = 0
            for address in known:
                moved += snapshots.bytes_moved(before.who_has, after.who_has, before.nbytes, address)[0]
                some_bytes, some_keys = snapshots.bytes_lost(before.who_has, after.who_has, before.nbytes, address)
                lost += some_bytes
                lost_keys += some_keys
        stuck = specs.WorkerReason.TIMED_OUT if timed_out else specs.WorkerReason.NOWHERE_TO_GO
        if not recorded:
            cause = _cause(specs.WorkerReason.NO_WORKER)
            update: dict[str, object] = {"removable": True}
        elif gone and holding == 0 and (retired_set.issuperset(recorded) and lost == 0):
            cause = _cause(specs.WorkerReason.DRAINED)
            update = {"removable": True, "bytesMoved": moved}
        elif gone and holding == 0:
            cause = _cause(specs.WorkerReason.DIED, nbytes=lost, keys=lost_keys)
            update = {"removable": True, "bytesMoved": moved, "bytesLost": lost, "keysLost": lost_keys}
        elif on_timeout == specs.OnTimeout.FORCE:
            cause = _cause(stuck, nbytes=holding, keys=holding_keys)
            update = {
                "state": specs.WorkerState.FORCED,
                "removable": True,
                "bytesMoved": max(moved, 0),
                "bytesLost": holding,
                "keysLost": holding_keys,
            }
        else:
            cause = _cause(stuck, nbytes=holding, keys=holding_keys)
            update = {"state": specs.WorkerState.KEPT, "bytesMoved": max(moved, 0)}
        left = [stopped[a] for a in recorded if a in stopped]
        if left and update.get("state") in (specs.WorkerState.KEPT, specs.WorkerState.FORCED):
            update["lostAtDeadline"] = specs.LostAtDeadline(
                keys=sum(k for k, _ in left), bytes=sum(b for _, b in left), cause="deadline"
            )
        handed = [(linked or {})[a] for a in recorded if a in (linked or {})]
        if handed:
            update["keysLinked"] = sum(k for k, _ in handed)
            update["bytesLinked"] = sum(b for _, b in handed)
        result.append(_with(worker, cause, **update))
    return result


def judge_unreachable(
    workers: Sequence[specs.WorkerStatus], *, on_timeout: specs.OnTimeout, reason: str
) -> list[specs.WorkerStatus]:
    """The deadline passed with the scheduler unreachable: nothing can be confirmed moved.

    Abort keeps every draining pod. Force removes them and records their unique bytes at the
    drain's start as lost: without a scheduler nobody can tell how much had moved.
    """
    result = []
    for worker in workers:
        if worker.state != specs.WorkerState.DRAINING or worker.removable:
            result.append(worker)
            continue
        cause = _cause(specs.WorkerReason.UNREACHABLE, nbytes=worker.uniqueBytes, detail=reason)
        if on_timeout == specs.OnTimeout.FORCE:
            result.append(
                _with(worker, cause, state=specs.WorkerState.FORCED, removable=True, bytesLost=worker.uniqueBytes)
            )
        else:
            result.append(_with(worker, cause, state=specs.WorkerState.KEPT))
    return result


def to_remove(workers: Sequence[specs.WorkerStatus]) -> list[str]:
    """Pods whose removal is decided but not yet done, each once."""
    return list(dict.fromkeys(w.pod for w in workers if w.removable and not w.podRemoved))


def _kept(worker: specs.WorkerStatus, why: specs.KeptReason, detail: str) -> specs.WorkerStatus:
    """The worker's pod is kept after all; its cause records why, beside what its drain came to."""
    update: dict[str, object] = {"state": specs.WorkerState.KEPT, "removable": False}
    if worker.cause is None:  # written before causes were recorded: its message stands
        return worker.model_copy(update=update)
    return _with(worker, worker.cause.model_copy(update={"kept": why, "keptDetail": detail}), **update)


def keep_unfinished(
    workers: Sequence[specs.WorkerStatus], why: str, *, ordered: Iterable[str] = ()
) -> list[specs.WorkerStatus]:
    """The request failed mid-way: every worker still Draining keeps its pod, and says why.

    Pods whose removal was already ordered (``ordered``: the recorded scale-down) are left as
    they are: they were drained, and the workload's controller removes them anyway.
    """
    ordered_set = set(ordered)
    return [
        _kept(w, specs.KeptReason.REQUEST_FAILED, why)
        if w.state == specs.WorkerState.DRAINING and not w.podRemoved and w.pod not in ordered_set
        else w
        for w in workers
    ]


def keep_blocked(workers: Sequence[specs.WorkerStatus], why: str) -> list[specs.WorkerStatus]:
    """The deadline passed before the pods could be removed safely: keep them, and say why."""
    return [
        _kept(w, specs.KeptReason.REMOVAL_BLOCKED, why.removeprefix("waiting: "))
        if w.removable and not w.podRemoved
        else w
        for w in workers
    ]


def mark_removed(workers: Sequence[specs.WorkerStatus], gone: Iterable[str]) -> list[specs.WorkerStatus]:
    """Record that these pods are gone: a drained worker is now Retired."""
    gone_set = set(gone)
    return [
        _with(
            w,
            podRemoved=True,
            state=specs.WorkerState.RETIRED if w.state == specs.WorkerState.DRAINING else w.state,
        )
        if w.removable and not w.podRemoved and w.pod in gone_set
        else w
        for w in workers
    ]


def conclude(status: specs.RetirementRequestStatus, *, requested: int, at: str) -> specs.RetirementRequestStatus:
    """Final phase, counters and message, once no worker is Pending or Draining."""
    states = [w.state for w in status.workers]
    retired = states.count(specs.WorkerState.RETIRED)
    kept = states.count(specs.WorkerState.KEPT)
    forced = states.count(specs.WorkerState.FORCED)
    moved = sum(w.bytesMoved for w in status.workers)
    lost = sum(w.bytesLost for w in status.workers)
    removed = retired + forced
    succeeded = kept == 0 and removed >= requested
    if succeeded:
        message = f"retired {removed} of {requested} workers; {moved} bytes moved"
        if forced:
            message += f"; {forced} removed by force, losing {lost} bytes"
    elif removed < requested and kept == 0:
        message = f"only {removed} of {requested} workers could be chosen and retired"
    else:
        message = f"retired {removed} of {requested} workers; kept {kept} that still hold unique data"
    return status.model_copy(
        update={
            "phase": specs.Phase.SUCCEEDED if succeeded else specs.Phase.FAILED,
            "retired": retired,
            "kept": kept,
            "forced": forced,
            "bytesMoved": moved,
            "moved": quantity(moved),
            "bytesLost": lost,
            "message": message,
            "completionTime": at,
        }
    )


def quantity(nbytes: int) -> str:
    """Bytes as a person reads them, in Kubernetes' binary units: 134217728 is ``128Mi``.

    Three significant figures at most (``1.5Gi``, ``143Mi``); below 1Ki the plain number.
    """
    value, unit = float(nbytes), ""
    for suffix in ("Ki", "Mi", "Gi", "Ti", "Pi"):
        if abs(value) < 1024:
            break
        value, unit = value / 1024, suffix
    if not unit:
        return str(nbytes)
    text = f"{value:.1f}" if abs(value) < 10 else f"{value:.0f}"
    return text.removesuffix(".0") + unit
