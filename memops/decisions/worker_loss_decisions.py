"""Workers that left on their own with keys held nowhere else: which are new, whose pod, and why.

memops' agent records in the scheduler every worker that left with keys no other worker held
(:mod:`memops.scheduler.departures`); the policy's pass reads the records with the drains, on
the same connection, and the workload's pods when a record is new. Here, purely:

- :func:`parse` checks every field of the agent's reply (hostile input: a wrong shape is skipped);
- :func:`pending` keeps the records that may be the policy's to record: not memops' own drains
  (their losses are in their RetirementRequest, or in ``safetyNet.lostAtDeadline``), after the
  policy was created, and not yet decided on an earlier pass;
- :func:`pod_of` finds a record's pod as memops maps workers to pods: by the pod IP its address
  carries, else by name (the pod's, or ``DASK_WORKER_NAME``), else by what the last tenancy
  check found for that address (the pod may be gone), else by a name that only the workload's
  pods carry;
- :func:`reason_of` reads why from the pod: its container's termination near that moment
  (``OOMKilled``, ``Error``, ...), ``Evicted``, ``Deleted``, else ``Unknown``;
- :func:`decide` puts them together into the status' list (the last :data:`KEPT`, newest last,
  one entry per (pod, time)), the entries it adds (an Event and the metrics each, once: the
  status is what a restarted operator compares against), and how far the records are decided.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from memops import specs
from memops.decisions import counts, safetynet, snapshots, timestamps

KEPT = 10
"""The policy's status lists this many of the latest losses."""
SETTLE_SECONDS = 30.0
"""A record whose pod does not say why yet (the kubelet reports a container's end a moment after
the scheduler sees its worker go) waits this long for it, then is recorded as ``Unknown``."""
TERMINATION_WINDOW_SECONDS = 120.0
"""A container's termination counts as the reason of a departure at most this far from it: an older
one (a restart long ago) says nothing of a worker process killed inside a container that kept running."""
TEXT = 256
DRAINS = ("draining", "deadline")
"""What the agent says of a departure that memops' own drain reports (:mod:`memops.scheduler.departures`)."""
EVENT_REASON = "WorkerLost"


@dataclasses.dataclass(frozen=True)
class Departure:
    """One record of the agent, checked."""

    address: str
    name: str
    time: float  # the scheduler's clock, seconds since the epoch
    keys: int
    bytes: int
    irreplaceable: int
    drain: str = ""

    @property
    def when(self) -> str:
        return timestamps.render(datetime.datetime.fromtimestamp(self.time, datetime.UTC))


@dataclasses.dataclass(frozen=True)
class Decision:
    losses: list[specs.WorkerLoss]
    """The status' list: the last :data:`KEPT`, oldest first."""
    new: list[specs.WorkerLoss]
    """The entries that this pass adds."""
    messages: list[str]
    """A Warning event's message for each of :attr:`new` (:func:`message`)."""
    settled: float
    """Every record up to this time (the scheduler's clock) is decided: the next pass need not read them again."""


def _count(value: Any) -> int:
    found = counts.plain(value)
    return -1 if found is None else found


def _text(value: Any) -> str | None:
    return value[:TEXT] if isinstance(value, str) else None


def parse(raw: Any) -> list[Departure]:
    """The agent's ``departures`` reply as :class:`Departure` records; an entry of the wrong shape
    (a field missing, of the wrong type, out of range) is skipped whole."""
    found: list[Departure] = []
    if not isinstance(raw, (list, tuple)):
        return found
    for entry in raw:
        if not isinstance(entry, Mapping):
            continue
        address, name, drain = _text(entry.get("address")), _text(entry.get("name")), _text(entry.get("drain", ""))
        when = entry.get("time")
        keys, nbytes, irreplaceable = (_count(entry.get(k)) for k in ("keys", "bytes", "irreplaceableKeys"))
        if address is None or name is None or drain is None or min(keys, nbytes, irreplaceable) < 0:
            continue
        if not isinstance(when, (int, float)) or isinstance(when, bool) or not 0 < when < 2**33:
            continue
        found.append(Departure(address, name, float(when), keys, nbytes, min(irreplaceable, keys), drain))
    return found


def pending(departures: Iterable[Departure], *, since: float) -> list[Departure]:
    """The records that may be new losses of a policy: keys lost, after ``since`` (the policy's
    creation, or how far an earlier pass decided), and not memops' own drains' (their reports
    count those losses: a RetirementRequest's, or the safety net's ``lostAtDeadline``)."""
    return [d for d in departures if d.keys > 0 and d.time > since and d.drain not in DRAINS]


def _ips(pod: Mapping[str, Any]) -> set[str]:
    status = pod.get("status") or {}
    ips = {str(status["podIP"])} if status.get("podIP") else set()
    ips |= {str(e["ip"]) for e in status.get("podIPs") or [] if isinstance(e, Mapping) and e.get("ip")}
    return {snapshots.canonical_ip(ip) for ip in ips}


def _name(pod: Mapping[str, Any]) -> str:
    return str((pod.get("metadata") or {}).get("name", ""))


def _worker_names(pod: Mapping[str, Any]) -> set[str]:
    names = {_name(pod)}
    for container in (pod.get("spec") or {}).get("containers") or []:
        for variable in container.get("env") or []:
            if variable.get("name") == "DASK_WORKER_NAME" and variable.get("value"):
                names.add(str(variable["value"]))
    return names


def _terminated(pod: Mapping[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def pod_of(
    departure: Departure,
    pods: Sequence[Mapping[str, Any]],
    workload: specs.WorkloadRef,
    known: Mapping[str, str],
) -> tuple[str, Mapping[str, Any] | None] | None:
    """The departed worker's pod (its name, and the pod when it still exists), or None when it is
    not one of the workload's.

    ``pods`` are the workload's pods (those being deleted included); ``known`` maps worker addresses
    to the pods the tenancy checks found them in. A pod keeps its IP after its worker died in it
    (a container restarted); a pod that terminated keeps it too until another pod of the workload
    takes it, so a live pod goes first."""
    host = snapshots.address_host(departure.address)
    by_ip = sorted((p for p in pods if host in _ips(p)), key=_terminated)
    if by_ip:
        return _name(by_ip[0]), by_ip[0]
    for pod in pods:
        if departure.name and departure.name in _worker_names(pod):
            return _name(pod), pod
    for name in (known.get(departure.address, ""), departure.name):
        if name and safetynet.is_workload_pod(name, workload):
            return name, None  # a pod of the workload's, gone
    return None


def _parse_time(text: Any) -> float | None:
    moment = timestamps.parse_or_none(text)
    return None if moment is None else moment.timestamp()


def _termination(pod: Mapping[str, Any], departed: float) -> Mapping[str, Any] | None:
    """The container termination nearest the departure, within :data:`TERMINATION_WINDOW_SECONDS`."""
    nearest: tuple[float, Mapping[str, Any]] | None = None
    for container in (pod.get("status") or {}).get("containerStatuses") or []:
        for state in ("state", "lastState"):
            terminated = ((container.get(state) or {}) if isinstance(container, Mapping) else {}).get("terminated")
            if not isinstance(terminated, Mapping):
                continue
            finished = _parse_time(terminated.get("finishedAt"))
            if finished is None or abs(finished - departed) > TERMINATION_WINDOW_SECONDS:
                continue
            if nearest is None or abs(finished - departed) < nearest[0]:
                nearest = (abs(finished - departed), terminated)
    return nearest[1] if nearest is not None else None


def restarts(pod: Mapping[str, Any] | None) -> int:
    """The pod's container restarts, summed."""
    statuses = (pod or {}).get("status", {}).get("containerStatuses") or []
    return sum(max(_count(c.get("restartCount")), 0) for c in statuses if isinstance(c, Mapping))


def reason_of(pod: Mapping[str, Any] | None, departed: float) -> tuple[str, int | None]:
    """Why the worker left, from its pod, and the container's exit code when one ended then.

    A container that the kernel killed (``OOMKilled``) says so first, whatever else happens to the
    pod; then the pod's eviction (``Evicted``), its deletion (``Deleted``: being deleted, or gone:
    ``pod`` None), the container's own reason (``Error``, ``Completed``, ...), else ``Unknown``
    (a worker process killed inside a container that kept running: the nanny's kill)."""
    if pod is None:
        return "Deleted", None
    terminated = _termination(pod, departed)
    reason = str(terminated.get("reason") or "Error")[:64] if terminated is not None else ""
    code = _count(terminated.get("exitCode")) if terminated is not None else -1
    exit_code = code if code >= 0 else None
    if reason == "OOMKilled":
        return reason, exit_code
    if (pod.get("status") or {}).get("reason") == "Evicted":
        return "Evicted", exit_code
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return "Deleted", exit_code
    if reason:
        return reason, exit_code
    return "Unknown", None


def decide(
    departures: Sequence[Departure],
    pods: Sequence[Mapping[str, Any]],
    workload: specs.WorkloadRef,
    previous: Sequence[specs.WorkerLoss],
    *,
    now: float,
    since: float,
    known: Mapping[str, str] | None = None,
    limit: int = KEPT,
) -> Decision:
    """The status' ``workerLosses`` with the :func:`pending` ``departures`` of the workload's pods.

    One entry per (pod, time): a record already listed adds nothing, whatever the passes and
    restarts of the operator; two workers of one pod that left in the same second are summed.
    Once the list is full, a record no later than its oldest entry was listed and dropped. A
    record whose pod does not say why yet waits up to :data:`SETTLE_SECONDS` (and holds
    ``settled`` back); records of other workloads are decided (not the policy's)."""
    found = {(loss.pod, loss.time): loss for loss in previous}
    oldest = min(t for _, t in found) if len(found) >= limit > 0 else ""
    added: dict[tuple[str, str], specs.WorkerLoss] = {}
    restarted: dict[tuple[str, str], int | None] = {}
    settled = since
    waiting = False
    for departure in sorted(pending(departures, since=since), key=lambda d: d.time):
        located = pod_of(departure, pods, workload, known or {})
        if located is not None:
            name, pod = located
            reason, exit_code = reason_of(pod, departure.time)
            if reason == "Unknown" and now - departure.time < SETTLE_SECONDS:
                waiting = True  # the kubelet may not have reported the container's end yet
                continue
            key = (name, departure.when)
            if key not in found and not (oldest and departure.when <= oldest):
                before = added.get(key)
                added[key] = specs.WorkerLoss(
                    pod=name,
                    time=departure.when,
                    reason=reason,
                    exitCode=exit_code,
                    keys=departure.keys + (before.keys if before else 0),
                    bytes=departure.bytes + (before.bytes if before else 0),
                    irreplaceableKeys=departure.irreplaceable + (before.irreplaceableKeys if before else 0),
                )
                restarted[key] = restarts(pod) if pod is not None else None
        if not waiting:
            settled = max(settled, departure.time)
    found.update(added)
    losses = sorted(found.values(), key=lambda loss: (loss.time, loss.pod))[-limit:] if limit > 0 else []
    kept = {(loss.pod, loss.time) for loss in losses}
    new = [(key, loss) for key, loss in added.items() if key in kept]
    return Decision(
        losses, [loss for _, loss in new], [message(loss, restarted.get(key)) for key, loss in new], settled
    )


def new_losses(old: Sequence[specs.WorkerLoss], new: Sequence[specs.WorkerLoss]) -> list[specs.WorkerLoss]:
    """Entries of ``new`` that ``old`` did not list: what a status write records for the first time."""
    before = {(loss.pod, loss.time) for loss in old}
    return [loss for loss in new if (loss.pod, loss.time) not in before]


def message(loss: specs.WorkerLoss, restart_count: int | None = None) -> str:
    """The Warning event's message: the pod, why, and what it took with it."""
    why = loss.reason
    details = [f"exit code {loss.exitCode}"] if loss.exitCode is not None else []
    if restart_count is not None:
        details.append(f"{restart_count} restarts")
    if details:
        why += f" ({', '.join(details)})"
    return (
        f"the worker in pod {loss.pod} left at {loss.time}: {why}; it took {loss.keys} keys"
        f" ({loss.bytes} bytes) held nowhere else, {loss.irreplaceableKeys} of which cannot be recomputed"
    )
