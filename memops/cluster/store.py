"""The store protocol that the in-process parts of the emulated cluster program against.

The local kubelet and the Deployment controller (:mod:`memops.cluster.kubelet`,
:mod:`memops.cluster.replicaset`) read and write objects through this protocol, exactly as
their real counterparts do through the API server. :class:`memops.cluster.memstore.MemoryStore`
implements it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any, NamedTuple, Protocol


class WatchEvent(NamedTuple):
    type: str  # "ADDED" | "MODIFIED" | "DELETED"
    plural: str  # "pods", "deployments", ...
    object: dict[str, Any]


class Store(Protocol):
    def get(self, plural: str, namespace: str | None, name: str) -> dict[str, Any] | None: ...

    def list(
        self, plural: str, namespace: str | None = None, selector: Mapping[str, str] | None = None
    ) -> list[dict[str, Any]]: ...

    async def create(self, plural: str, namespace: str | None, body: dict[str, Any]) -> dict[str, Any]: ...

    async def patch(
        self, plural: str, namespace: str | None, name: str, patch: dict[str, Any], *, subresource: str | None = None
    ) -> dict[str, Any]: ...

    async def delete(
        self, plural: str, namespace: str | None, name: str, *, grace_period_seconds: int | None = None
    ) -> Any: ...

    def watch(self) -> AsyncIterator[WatchEvent]: ...
