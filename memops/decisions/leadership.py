"""Which replica of the operator acts: Kopf's peering as memops reads it, and Leases as locks.

memops runs as several replicas (the chart's default is two). Exactly one reconciles: Kopf's
peering pauses every replica that sees a live peer of a higher or the same priority, and memops
gives each replica the priority of its start, older first (:func:`start_priority`), so that a new
replica of a rollout, or one that crash-loops, never takes over from one that works; it takes
over when that one leaves (Kopf removes a leaving replica's record at once) or stops renewing it
(:data:`PEERING_LIFETIME`). Every replica serves the webhooks: :func:`leads` tells a webhook whether
the Kopf indexes it would read are kept current here (a paused replica's are not), from the same
peering record that Kopf reads.

The eviction gate's bounds hold across replicas through a Lease per policy (:func:`lease_free`),
the API server's optimistic concurrency being the lock; the Leases live in the operator's own
namespace, where tenants write nothing. Everything here is pure: the records are
hostile input (anyone with write access to them may forge them), and a malformed one never
makes a replica believe it acts alone.
"""

from __future__ import annotations

import datetime
import hashlib
from collections.abc import Mapping
from typing import Any

PEERING_LIFETIME = 15
"""Seconds a replica's peering record lives unless renewed (Kopf renews it 5 to 10 s before
that): a replica that dies without leaving is replaced within this time."""

LEASE_SECONDS = 10
"""How long the eviction gate's Lease holds without its holder: the webhook's longest answer."""

LEASE_PREFIX = "memops-gate-"

_EPOCH = datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC)


def start_priority(started: datetime.datetime) -> int:
    """A replica's peering priority: the earlier it started, the higher (milliseconds before
    2100), so that the oldest live replica acts. Ties (two replicas started in the same
    millisecond) pause both, Kopf's rule, until one of them leaves."""
    horizon = datetime.datetime(2100, 1, 1, tzinfo=datetime.UTC)
    return max(0, int((horizon - started).total_seconds() * 1000))


def _moment(text: Any) -> datetime.datetime | None:
    if not isinstance(text, str) or len(text) > 64:
        return None
    try:
        moment = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=datetime.UTC)


def leads(status: Any, identity: str, priority: int, now: datetime.datetime) -> bool:
    """Whether the replica ``identity`` of ``priority`` acts, by its peering object's ``status``
    (Kopf's: peer id -> ``priority``, ``lastseen``, ``lifetime``): no other live peer has a
    priority as high. A peer whose record cannot be read counts as live and higher: a forged
    record may pause a replica's indexes (its webhooks then read the API), never unpause them."""
    if status is None:
        return True  # no peer has written yet
    if not isinstance(status, Mapping):
        return False
    for peer, record in status.items():
        if peer == identity:
            continue
        if not isinstance(record, Mapping):
            return False
        seen, lifetime, theirs = _moment(record.get("lastseen")), record.get("lifetime"), record.get("priority")
        if seen is None or not isinstance(lifetime, int) or not isinstance(theirs, int):
            return False
        if seen + datetime.timedelta(seconds=lifetime) < now:
            continue  # dead: Kopf cleans it away
        if theirs >= priority:
            return False
    return True


def lease_name(namespace: str, policy: str) -> str:
    """The eviction gate's Lease for the policy ``policy`` of ``namespace``, in the operator's own
    namespace (a DNS subdomain of at most 253; a namespace name has no dot, so the two never run
    together)."""
    name = f"{LEASE_PREFIX}{namespace}.{policy}"
    if len(name) <= 253:
        return name
    return LEASE_PREFIX + hashlib.sha256(f"{namespace}/{policy}".encode()).hexdigest()[:32]


def micro_time(moment: datetime.datetime) -> str:
    """A Kubernetes MicroTime (a Lease's times)."""
    return moment.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def lease_spec(holder: str, now: datetime.datetime, seconds: int = LEASE_SECONDS) -> dict[str, Any]:
    return {
        "holderIdentity": holder,
        "leaseDurationSeconds": seconds,
        "acquireTime": micro_time(now),
        "renewTime": micro_time(now),
    }


def lease_free(spec: Any, holder: str, now: datetime.datetime) -> bool:
    """Whether a Lease of this ``spec`` may be taken by ``holder``: nobody holds it, ``holder``
    does, or its holder stopped renewing it.

    The spec is hostile: whoever may write Leases in the namespace (a tenant) may forge the one
    named for a policy, and a hold read from it would refuse every eviction of the policy's
    workers, a node's drain included, for as long as it says. memops' replicas write only
    :data:`LEASE_SECONDS` from the moment of writing, so no hold lasts longer than that from its
    renewal, a renewal later than that from now is forged, and a spec that cannot be read holds
    nothing. Taking it over still needs the ``resourceVersion`` read, so a live replica's hold is
    never taken by two at once."""
    if not isinstance(spec, Mapping):
        return True
    current = spec.get("holderIdentity")
    if current in (None, "", holder):
        return True
    renewed, seconds = _moment(spec.get("renewTime")), spec.get("leaseDurationSeconds")
    if renewed is None or not isinstance(seconds, int) or isinstance(seconds, bool):
        return True
    bound = datetime.timedelta(seconds=LEASE_SECONDS)
    if renewed > now + bound:
        return True
    return renewed + min(datetime.timedelta(seconds=max(seconds, 0)), bound) < now
