"""A Lease (``coordination.k8s.io/v1``) as a lock between the operator's replicas.

Taken by creating it, or by replacing a free one (:func:`memops.decisions.leadership.lease_free`)
with the ``resourceVersion`` read: of two replicas that try at once, the API server lets one
write and answers the other 409. Given back by clearing its holder with the version it was taken
at, so that a lock taken over after it expired is never freed by its former holder. The Lease
stays, in the operator's own namespace (a tenant who could write it could hold the lock), until
what it locks goes (:func:`delete`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp

from memops.clients import kube
from memops.decisions import leadership, timestamps


@dataclasses.dataclass(frozen=True)
class Holder:
    """A replica as it holds Leases: its identity, and the namespace of its Leases (the operator's)."""

    identity: str
    namespace: str


def _path(namespace: str, name: str | None = None) -> str:
    return kube.resource_path("coordination.k8s.io", "v1", "leases", namespace, name)


def _body(namespace: str, name: str, spec: dict[str, Any], annotations: Mapping[str, str]) -> dict[str, Any]:
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "labels": {"app.kubernetes.io/managed-by": "memops"},
        "annotations": dict(annotations),
    }
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": metadata, "spec": spec}


async def acquire(
    client: kube.Kube,
    namespace: str,
    name: str,
    holder: str,
    *,
    annotations: Mapping[str, str] | None = None,
    seconds: int = leadership.LEASE_SECONDS,
) -> str | None:
    """Take the Lease for ``holder``: its resourceVersion, or None while another holds it (or
    took it at the same moment). ``annotations``: what it locks, for whoever reads it."""
    now = timestamps.now()
    body = _body(namespace, name, leadership.lease_spec(holder, now, seconds), annotations or {})
    found = await client.get_or_none(_path(namespace, name))
    try:
        if found is None:
            made = await client.request("POST", _path(namespace), body=body)
        elif leadership.lease_free(found.get("spec"), holder, now):
            meta = found.get("metadata") or {}
            body["metadata"]["resourceVersion"] = meta.get("resourceVersion")
            made = await client.request("PUT", _path(namespace, name), body=body)
        else:
            return None
    except kube.ApiError as exc:
        if exc.code in (404, 409):
            return None  # another replica was faster
        raise
    return str(made["metadata"]["resourceVersion"])


async def release(client: kube.Kube, namespace: str, name: str, version: str) -> None:
    """Give the Lease back, unless someone took it over since ``version``."""
    found = await client.get_or_none(_path(namespace, name))
    if found is None or str((found.get("metadata") or {}).get("resourceVersion")) != version:
        return
    found["spec"] = {k: v for k, v in (found.get("spec") or {}).items() if k not in ("holderIdentity", "acquireTime")}
    try:
        await client.request("PUT", _path(namespace, name), body=found)
    except kube.ApiError as exc:
        if exc.code not in (404, 409):
            raise


@contextlib.asynccontextmanager
async def held(
    client: kube.Kube,
    namespace: str,
    name: str,
    holder: str,
    *,
    annotations: Mapping[str, str] | None = None,
    seconds: int = leadership.LEASE_SECONDS,
) -> AsyncIterator[bool]:
    """Whether the Lease was taken, for the block; given back after it. A release that fails
    (the API unreachable) leaves the Lease to expire after ``seconds``."""
    version = await acquire(client, namespace, name, holder, annotations=annotations, seconds=seconds)
    try:
        yield version is not None
    finally:
        if version is not None:
            with contextlib.suppress(kube.ApiError, aiohttp.ClientError, TimeoutError):
                await release(client, namespace, name, version)


async def delete(client: kube.Kube, namespace: str, name: str) -> None:
    """Remove the Lease once what it locks is gone (it may never have been made)."""
    try:
        await client.request("DELETE", _path(namespace, name))
    except kube.ApiError as exc:
        if exc.code != 404:
            raise
