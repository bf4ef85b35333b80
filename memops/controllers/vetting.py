"""How the controllers reach a Dask scheduler: vouched for by the tenancy check, on one connection.

The scheduler's address is written by users, and what answers there may change from one
connection to the next (an ExternalName Service or DNS that its owner switches, a TCP proxy that
routes each connection its own way). So every controller that speaks to a scheduler (the
MemoryPolicy's pass and goodbye, each RetirementRequest step, the eviction gate) does it through
:func:`memops.daskrpc.vetted`: one connection, ``identity`` judged by :func:`memops.tenancy.check`
against the namespace's pods first, then everything else on that same connection. The client
certificates come from :mod:`memops.controllers.scheduler_tls`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence

from memops import daskrpc, kube, snapshots, specs, tenancy
from memops.controllers import scheduler_tls, workloads


class Tenancy:
    """The tenancy check as a vouch: each call lists the namespace's pods afresh; the pods of the
    last call stay here, for what the caller decides from the same listing (nodes, pods)."""

    def __init__(self, client: kube.Kube, namespace: str):
        self.client = client
        self.namespace = namespace
        self.pods: list[snapshots.PodInfo] = []

    async def __call__(self, workers: Sequence[snapshots.WorkerInfo]) -> tenancy.Verdict:
        self.pods = await workloads.namespace_pods(self.client, self.namespace)
        return tenancy.check(workers, self.pods, self.namespace)


@contextlib.asynccontextmanager
async def vetted(
    client: kube.Kube,
    namespace: str,
    scheduler: specs.SchedulerRef,
    *,
    timeout: float,
    vouch: daskrpc.Vouch | None = None,
) -> AsyncIterator[daskrpc.Scheduler]:
    """The namespace's scheduler (:func:`memops.daskrpc.vetted`), with the client certificates of
    ``spec.scheduler.tls`` and, unless another ``vouch`` is given, a fresh :class:`Tenancy` check.

    Raises :class:`memops.controllers.scheduler_tls.SecretUnusable`, and what
    :func:`memops.daskrpc.vetted` raises (:class:`memops.daskrpc.Unvouched` among them).
    """
    security = await scheduler_tls.security_for(client, namespace, scheduler)
    judge = vouch if vouch is not None else Tenancy(client, namespace)
    async with daskrpc.vetted(scheduler.address, vouch=judge, security=security, timeout=timeout) as vouched:
        yield vouched
