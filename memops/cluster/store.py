"""The store protocol that the in-process parts of the emulated cluster program against.

The local kubelet and the Deployment controller (:mod:`memops.cluster.kubelet`,
:mod:`memops.cluster.replicaset`) read and write objects through this protocol, as their
real counterparts do through the API server. :class:`memops.cluster.memstore.MemoryStore`
implements it; so does the small ``FakeStore`` of ``tests/cluster/conftest.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any, NamedTuple, Protocol


class WatchEvent(NamedTuple):
    type: str  # "ADDED" | "MODIFIED" | "DELETED"
    plural: str  # "pods", "deployments", ...
    object: dict[str, Any]


class Store(Protocol):
    def get(self, plural: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        """A deep copy of the object, or None if there is none."""

    def list(
        self, plural: str, namespace: str | None = None, selector: Mapping[str, str] | None = None
    ) -> list[dict[str, Any]]:
        """Deep copies; ``selector`` is matchLabels equality; ``namespace`` None means all namespaces."""

    async def create(self, plural: str, namespace: str | None, body: dict[str, Any]) -> dict[str, Any]:
        """Fills uid, resourceVersion, creationTimestamp and generation; honours ``metadata.generateName``."""

    async def patch(
        self, plural: str, namespace: str | None, name: str, patch: dict[str, Any], *, subresource: str | None = None
    ) -> dict[str, Any]:
        """A JSON merge patch (RFC 7386); ``subresource="status"`` patches the status only."""

    async def delete(
        self, plural: str, namespace: str | None, name: str, *, grace_period_seconds: int | None = None
    ) -> object:
        """Removes the object, except a pod deleted with a grace period (None or > 0).

        Such a pod gets ``metadata.deletionTimestamp`` and ``deletionGracePeriodSeconds``
        (default ``spec.terminationGracePeriodSeconds``, itself 30 by default), and a MODIFIED
        event; its kubelet stops the containers and then deletes it with grace period 0.
        The result is for the implementation to choose (``object``): callers ignore it.
        """

    def watch(self) -> AsyncIterator[WatchEvent]:
        """Every change from the moment of this call on, of every resource; consumers filter."""
        ...
