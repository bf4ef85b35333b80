"""How the controllers reach a Dask scheduler: vouched for by the tenancy check, on one connection.

The scheduler's address is written by users, and what answers there may change from one
connection to the next (an ExternalName Service or DNS that its owner switches, a TCP proxy that
routes each connection its own way). So every controller that speaks to a scheduler (the
MemoryPolicy's pass and goodbye, each RetirementRequest step, the eviction gate) does it through
:func:`reach`, the one sequence: one connection, ``identity`` judged by :func:`memops.decisions.tenancy.check`
against the namespace's pods first, then the snapshot and everything else on that same connection.
:func:`vetted` adds the client certificates, from :mod:`memops.controllers.scheduler_tls`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from memops import specs
from memops.clients import daskcomm, daskrpc, kube
from memops.controllers import scheduler_tls, workloads
from memops.decisions import service_names, snapshots, tenancy


class Tenancy:
    """The tenancy check as a vouch: each call lists the namespace's pods afresh; the pods of the
    last call stay here, for what the caller decides from the same listing (nodes, pods).

    ``seen``: the resourceVersion of the caller's own last listing of these pods (moments before,
    in the step before), kept up to date by each call: a listing is then no older than that one, and
    the API server serves it from its watch cache at once. Without it, a consistent list, which
    after any write waits up to the watch cache's 100 ms progress period: most of a
    RetirementRequest's time to its first byte."""

    def __init__(self, client: kube.Kube, namespace: str, seen: str | None = None):
        self.client = client
        self.namespace = namespace
        self.seen = seen
        self.pods: list[snapshots.PodInfo] = []

    async def __call__(self, workers: Sequence[snapshots.WorkerInfo]) -> tenancy.Verdict:
        self.pods, self.seen = await workloads.namespace_pods(self.client, self.namespace, self.seen)
        return tenancy.check(workers, self.pods, self.namespace)


@dataclasses.dataclass(frozen=True)
class Vetted:
    """A scheduler shown to be the namespace's, on the connection that everything else goes over,
    and its snapshot taken right after the vouch (None when none was asked for)."""

    scheduler: daskrpc.Scheduler
    snapshot: snapshots.SchedulerSnapshot | None


@contextlib.asynccontextmanager
async def reach(
    address: str,
    *,
    vouch: daskrpc.Vouch,
    security: Any,
    timeout: float,
    snapshot: Mapping[str, Any] | None = None,
) -> AsyncIterator[Vetted]:
    """Identity, then the tenancy check (``vouch``), then the snapshot (the keyword arguments of
    :meth:`memops.clients.daskrpc.Scheduler.snapshot` in ``snapshot``; None: no snapshot), on one
    connection, which stays open for as long as the caller acts on it.

    Raises :class:`memops.clients.daskrpc.Unvouched` (nothing but ``identity`` was sent), and what
    :func:`memops.clients.daskrpc.vetted` raises.
    """
    async with daskrpc.vetted(address, vouch=vouch, security=security, timeout=timeout) as scheduler:
        taken = await scheduler.snapshot(**snapshot) if snapshot is not None else None
        yield Vetted(scheduler, taken)


async def dialled(client: kube.Kube, namespace: str, address: str) -> str:
    """``address`` as the operator dials it: a host that names a Service of ``namespace``
    (:func:`memops.decisions.service_names.service_of`) replaced by that Service's cluster IP, as a
    pod of the namespace would reach it (the operator's own pod is in another namespace, where the
    name means something else). A headless Service, an ExternalName or none: dialled as written.

    Raises :class:`ValueError` for an address that is not ``tcp://`` or ``tls://`` host:port.
    """
    scheme, host, port = daskcomm.parse_address(address)
    name = service_names.service_of(host, namespace)
    if name is None:
        return address
    try:
        service = await client.get_or_none(f"/api/v1/namespaces/{namespace}/services/{name}")
    except kube.ApiError:
        # Without the right to read Services (an RBAC of an older chart), or while the API server
        # cannot answer: the name as written, to the cluster's DNS.
        return address
    cluster_ip = ((service or {}).get("spec") or {}).get("clusterIP")
    if not isinstance(cluster_ip, str) or cluster_ip in ("", "None"):
        return address
    try:
        found = ipaddress.ip_address(cluster_ip)
    except ValueError:
        return address
    return f"{scheme}://[{found}]:{port}" if found.version == 6 else f"{scheme}://{found}:{port}"


@contextlib.asynccontextmanager
async def vetted(
    client: kube.Kube,
    namespace: str,
    scheduler: specs.SchedulerRef,
    *,
    timeout: float,
    vouch: daskrpc.Vouch | None = None,
    snapshot: Mapping[str, Any] | None = None,
) -> AsyncIterator[Vetted]:
    """:func:`reach` with the client certificates of ``spec.scheduler.tls`` and, unless another
    ``vouch`` is given, a fresh :class:`Tenancy` check.

    Raises :class:`memops.controllers.scheduler_tls.SecretUnusable`, and what :func:`reach` raises.
    """
    security = await scheduler_tls.security_for(client, namespace, scheduler)
    judge = vouch if vouch is not None else Tenancy(client, namespace)
    address = await dialled(client, namespace, scheduler.address)
    async with reach(address, vouch=judge, security=security, timeout=timeout, snapshot=snapshot) as found:
        yield found
