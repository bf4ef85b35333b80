"""This replica's standing among the operator's replicas, for its webhooks.

Kopf's peering pauses every replica but one (:mod:`memops.decisions.leadership`), and a paused
replica's watches stop, so its Kopf indexes go stale. Its webhooks still answer: the Service
sends them a share of the reviews. :func:`webhook_cache` gives a webhook the indexes where this
replica acts, and the same objects read from the API where it does not.
"""

from __future__ import annotations

import dataclasses
import datetime
import getpass
import os
import secrets
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp

from memops.clients import kube
from memops.controllers import leases, policy
from memops.decisions import leadership, timestamps

PEERING = "memops"
"""The name of Kopf's peering object (``settings.peering.name``)."""

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")

STANDING_SECONDS = 2.0
"""How long a reading of the peering object is believed: a replica that stops acting has its
webhooks read the API within this time; Kopf pauses it within about the same."""


def own_identity() -> str:
    """This replica's peering identity: its pod's name (``POD_ID``, set by the chart), else who
    runs it where, made unique."""
    pod = os.environ.get("POD_ID")
    if pod:
        return pod
    return f"{getpass.getuser()}@{socket.gethostname()}/{os.getpid()}/{secrets.token_hex(4)}"


def own_namespace() -> str:
    """The operator's own namespace, where the eviction gate's Leases are (tenants write nothing
    there): ``POD_NAMESPACE`` (the chart sets it from the pod), else the pod's ServiceAccount's,
    else ``default`` (an operator run outside a pod)."""
    named = os.environ.get("POD_NAMESPACE")
    if named:
        return named
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or "default"
    except OSError:
        return "default"


@dataclasses.dataclass
class Standing:
    """Who this replica is among its peers, and whether it acts (read at most every
    :data:`STANDING_SECONDS`). ``namespaces``: those watched; empty, the whole cluster."""

    identity: str
    priority: int
    namespaces: tuple[str, ...] = ()
    home: str = "default"
    """The operator's own namespace: the eviction gate's Leases'."""
    checked: float = -STANDING_SECONDS
    acting: bool = False

    @property
    def holder(self) -> leases.Holder:
        return leases.Holder(self.identity, self.home)

    def paths(self) -> list[str]:
        """The peering objects Kopf pauses this replica by: one per watched namespace, or the
        cluster's."""
        if not self.namespaces:
            return [kube.resource_path("kopf.dev", "v1", "clusterkopfpeerings", None, PEERING)]
        return [kube.resource_path("kopf.dev", "v1", "kopfpeerings", ns, PEERING) for ns in self.namespaces]

    async def acts(self, client: kube.Kube) -> bool:
        """Whether this replica reconciles, so that its indexes are current. A peering object
        that does not exist pauses nobody (Kopf then runs standalone); one that cannot be read
        counts as pausing this replica: its webhooks read the API, which is always right."""
        if time.monotonic() - self.checked < STANDING_SECONDS:
            return self.acting
        now = timestamps.now()
        acting = True
        for path in self.paths():
            try:
                found = await client.get_or_none(path)
            except (TimeoutError, kube.ApiError, aiohttp.ClientError):
                acting = False
                break
            if found is not None and not leadership.leads(found.get("status"), self.identity, self.priority, now):
                acting = False
                break
        self.acting, self.checked = acting, time.monotonic()
        return acting


def standing(namespaces: tuple[str, ...], started: datetime.datetime | None = None) -> Standing:
    """This replica's standing, its priority that of its start (now, unless given)."""
    return Standing(own_identity(), leadership.start_priority(started or timestamps.now()), namespaces, own_namespace())


async def webhook_cache(memo: Any, namespace: str, indexes: Mapping[str, Any]) -> policy.Cache:
    """What a webhook reads for a review in ``namespace``: the Kopf ``indexes`` where this replica
    acts (or runs without peers: no standing in ``memo``); the API's objects of that namespace
    where it is paused."""
    found: Standing | None = getattr(memo, "standing", None)
    if found is None or await found.acts(memo.kube):
        return policy.Cache(dict(indexes))
    return await policy.api_cache(memo.kube, namespace)
