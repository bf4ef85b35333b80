"""Which scheduler a memops resource may act on: the tenancy rule, as one pure function.

A MemoryPolicy or RetirementRequest in namespace N acts only on a scheduler that has at least
one worker and all of whose workers are pods of N, matched by address: the host of each
worker's comm address is the IP (``status.podIP`` or one of ``status.podIPs``) of a pod of N
that has not terminated and does not run on its node's network. Pod IPs are unique in a cluster,
and only the network gives them out; pod names are not (another tenant may name its pods like
yours), so the address is the proof. A hostNetwork pod's IP is its node's, shared by every
hostNetwork pod there whatever its namespace, so it proves nothing: such pods vouch for no worker.
Until the rule holds, the controllers ask the scheduler for nothing but ``identity`` (no code
sent, no holdings read, no retirement, no relief) and write no worker name or memory figure
into a status, nor the foreign workers' addresses (they may be another tenant's). Called, as the
vouch of :func:`memops.clients.daskrpc.vetted`, by the controllers (:mod:`memops.controllers.vetting`)
with the workers of ``identity`` and the pods of the resource's own namespace.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from memops.decisions import snapshots


class Reason(enum.StrEnum):
    TENANT = "TenantScheduler"
    FOREIGN = "ForeignScheduler"
    NO_WORKERS = "NoWorkers"


@dataclass(frozen=True)
class Verdict:
    reason: Reason
    message: str
    foreign: tuple[str, ...] = ()  # addresses of the workers that are not pods of the namespace

    @property
    def allowed(self) -> bool:
        return self.reason == Reason.TENANT


def check(workers: Sequence[snapshots.WorkerInfo], pods: Sequence[snapshots.PodInfo], namespace: str) -> Verdict:
    """Whether a resource in ``namespace``, whose pods are ``pods``, may act on this scheduler."""
    if not workers:
        return Verdict(
            Reason.NO_WORKERS,
            f"the scheduler has no worker, so none can be shown to be a pod of namespace {namespace}",
        )
    ips = {snapshots.canonical_ip(ip) for pod in pods if pod.owns_ips for ip in pod.ips}
    foreign = tuple(sorted(w.address for w in workers if snapshots.address_host(w.address) not in ips))
    if foreign:
        # Their addresses stay out of the message, which lands in a status: they may be another
        # tenant's, and this scheduler's answer is hostile input (``foreign`` keeps them for logs).
        return Verdict(
            Reason.FOREIGN,
            f"{len(foreign)} of the scheduler's {len(workers)} workers are not pods of namespace {namespace}"
            " (no pod there that runs on its own network, not its node's, has their address' IP); memops acts"
            " only on a scheduler whose workers are all pods of the resource's own namespace",
            foreign,
        )
    return Verdict(Reason.TENANT, f"all {len(workers)} workers are pods of namespace {namespace}")
