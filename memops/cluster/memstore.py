"""The emulated API server's object store: what etcd and the registry do in Kubernetes.

Used by :mod:`memops.cluster.apiserver` (the HTTP front) and, in the same process, by the
local kubelet and Deployment controller through the :class:`memops.cluster.store.Store`
protocol. It keeps the parts of the API server's behaviour that memops and its users rely
on, and nothing more:

- ``uid``, ``creationTimestamp``, a cluster-wide monotonically increasing
  ``resourceVersion``, and ``generation`` bumped on spec changes only;
- optimistic concurrency: an update that carries a stale ``resourceVersion`` gets 409;
- the ``status`` subresource: writes to it touch only ``status``, writes to the main
  resource never touch ``status`` (for kinds that have the subresource);
- JSON merge patch, JSON patch (a failed ``test`` answers 422), graceful pod deletion,
  finalizers;
- an event history, so that a watch can start from a ``resourceVersion``.
"""

from __future__ import annotations

import asyncio
import builtins
import collections
import copy
import datetime
import secrets
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import jsonpatch

from memops.cluster.store import WatchEvent

Obj = dict[str, Any]
Validator = Callable[[Obj, Obj | None], Obj]
"""Checks (and defaults) an object about to be stored; gets the new and the old object."""
Admission = Callable[["Kind", Obj], Awaitable[Obj]]
"""Mutating admission of an object about to be created (the API server's webhooks)."""

_HISTORY = 20_000
_NAME_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"  # k8s.io/apimachinery/pkg/util/rand


class ApiError(Exception):
    """An error that the API server answers with a Status object."""

    def __init__(self, code: int, reason: str, message: str, details: Mapping[str, Any] | None = None):
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = dict(details or {})

    def status(self) -> Obj:
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "details": self.details,
            "code": self.code,
        }


def now_rfc3339() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


@dataclass
class Kind:
    """What the store knows about one resource type."""

    group: str
    version: str
    kind: str
    plural: str
    namespaced: bool = True
    subresources: tuple[str, ...] = ()
    short_names: tuple[str, ...] = ()
    validate: Validator | None = None
    printer_columns: tuple[Mapping[str, Any], ...] = ()
    scale: Mapping[str, str] | None = None
    schema: Mapping[str, Any] | None = None
    """The openAPIV3Schema of a custom resource; None for built-in kinds, which are not validated."""

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


@dataclass
class MemoryStore:
    """All objects of the emulated cluster, in memory. Implements the ``Store`` protocol."""

    kinds: dict[str, Kind] = field(default_factory=dict)
    objects: dict[tuple[str, str | None, str], Obj] = field(default_factory=dict)
    resource_version: int = 0
    history: collections.deque[tuple[int, WatchEvent]] = field(
        default_factory=lambda: collections.deque(maxlen=_HISTORY)
    )
    _changed: asyncio.Condition | None = None
    admit: Admission | None = None

    def register(self, kind: Kind) -> None:
        self.kinds[kind.plural] = kind

    def kind(self, plural: str) -> Kind:
        try:
            return self.kinds[plural]
        except KeyError:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({plural})") from None

    # -- reading ------------------------------------------------------------------------------

    def get(self, plural: str, namespace: str | None, name: str) -> Obj | None:
        obj = self.objects.get((plural, self._ns(plural, namespace), name))
        return copy.deepcopy(obj) if obj is not None else None

    def list(
        self,
        plural: str,
        namespace: str | None = None,
        selector: Mapping[str, str] | None = None,
    ) -> builtins.list[Obj]:
        return [copy.deepcopy(obj) for obj in self._select(plural, namespace, selector)]

    def _select(self, plural: str, namespace: str | None, selector: Mapping[str, str] | None) -> builtins.list[Obj]:
        result = []
        for (res, ns, _), obj in self.objects.items():
            if res != plural or (namespace is not None and ns != namespace):
                continue
            labels = obj.get("metadata", {}).get("labels") or {}
            if selector and any(labels.get(k) != v for k, v in selector.items()):
                continue
            result.append(obj)
        return sorted(result, key=lambda o: (o["metadata"].get("namespace", ""), o["metadata"]["name"]))

    def require(self, plural: str, namespace: str | None, name: str) -> Obj:
        obj = self.objects.get((plural, self._ns(plural, namespace), name))
        if obj is None:
            raise ApiError(404, "NotFound", f'{plural} "{name}" not found', {"name": name, "kind": plural})
        return obj

    # -- writing ------------------------------------------------------------------------------

    async def create(self, plural: str, namespace: str | None, body: Obj) -> Obj:
        kind = self.kind(plural)
        namespace = self._ns(plural, namespace or body.get("metadata", {}).get("namespace"))
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise ApiError(422, "Invalid", "metadata.name: Required value: name or generateName is required")
            meta["name"] = meta["generateName"] + "".join(secrets.choice(_NAME_ALPHABET) for _ in range(5))
        key = (plural, namespace, meta["name"])
        if key in self.objects:
            raise ApiError(409, "AlreadyExists", f'{plural} "{meta["name"]}" already exists', {"name": meta["name"]})
        obj["apiVersion"], obj["kind"] = kind.api_version, kind.kind
        if kind.namespaced:
            meta["namespace"] = namespace
        meta.pop("resourceVersion", None)
        meta.pop("deletionTimestamp", None)
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = now_rfc3339()
        meta["generation"] = 1
        if "status" in kind.subresources:
            obj.pop("status", None)  # status is written through its subresource only
        if self.admit is not None:
            # Every creation is admitted, whoever makes it (kubectl, or the in-process
            # ReplicaSet stand-in), as every creation passes the real API server.
            obj = await self.admit(kind, obj)
            obj["metadata"]["name"], obj["metadata"]["uid"] = meta["name"], meta["uid"]
        if kind.validate is not None:
            obj = kind.validate(obj, None)
        self.objects[key] = obj
        await self._emit("ADDED", plural, obj)
        return copy.deepcopy(obj)

    async def patch(
        self,
        plural: str,
        namespace: str | None,
        name: str,
        patch: Any,
        *,
        subresource: str | None = None,
        patch_type: str = "merge",
    ) -> Obj:
        current = self.require(plural, namespace, name)
        if patch_type == "json":
            try:
                new = jsonpatch.apply_patch(current, patch)
            except jsonpatch.JsonPatchTestFailed as exc:
                raise ApiError(
                    422, "Invalid", f"the server rejected our request: test operation failed: {exc}"
                ) from exc
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
                raise ApiError(422, "Invalid", f"the server rejected our request: {exc}") from exc
        else:
            # Strategic merge patch is served as a JSON merge patch: for the fields memops and its
            # tests patch (labels, annotations, replicas, status) the two give the same result.
            new = merge_patch(current, patch)
            claimed = (patch.get("metadata") or {}).get("resourceVersion") if isinstance(patch, dict) else None
            if claimed is not None and claimed != current["metadata"]["resourceVersion"]:
                raise self._conflict(plural, name)
        return await self._update(plural, current, new, subresource=subresource)

    async def replace(
        self, plural: str, namespace: str | None, name: str, body: Obj, *, subresource: str | None = None
    ) -> Obj:
        current = self.require(plural, namespace, name)
        claimed = body.get("metadata", {}).get("resourceVersion")
        if claimed and claimed != current["metadata"]["resourceVersion"]:
            raise self._conflict(plural, name)
        return await self._update(plural, current, copy.deepcopy(body), subresource=subresource)

    async def _update(self, plural: str, current: Obj, new: Obj, *, subresource: str | None) -> Obj:
        kind = self.kind(plural)
        meta, old_meta = new.setdefault("metadata", {}), current["metadata"]
        # Identity and server-owned fields cannot be changed by clients.
        for key in (
            "name",
            "namespace",
            "uid",
            "creationTimestamp",
            "generation",
            "resourceVersion",
            "deletionTimestamp",
        ):
            if key in old_meta:
                meta[key] = old_meta[key]
            else:
                meta.pop(key, None)
        new["apiVersion"], new["kind"] = kind.api_version, kind.kind
        if subresource == "status":
            new = {**copy.deepcopy(current), "status": new.get("status")}
            if new["status"] is None:
                del new["status"]
        elif subresource is None and "status" in kind.subresources:
            if "status" in current:
                new["status"] = copy.deepcopy(current["status"])
            else:
                new.pop("status", None)
        elif subresource is not None:
            raise ApiError(
                404, "NotFound", f"the server could not find the requested resource ({plural}/{subresource})"
            )
        if new == current:
            return copy.deepcopy(current)  # a no-op write does not bump resourceVersion, as upstream
        if kind.validate is not None:
            new = kind.validate(new, current)
        if _spec_of(new) != _spec_of(current):
            new["metadata"]["generation"] = old_meta.get("generation", 1) + 1
        object_key = (plural, self._ns(plural, old_meta.get("namespace")), str(old_meta["name"]))
        self.objects[object_key] = new
        if new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers"):
            del self.objects[object_key]
            await self._emit("DELETED", plural, new)
        else:
            await self._emit("MODIFIED", plural, new)
        return copy.deepcopy(new)

    async def delete(
        self, plural: str, namespace: str | None, name: str, *, grace_period_seconds: int | None = None
    ) -> Obj:
        obj = self.require(plural, namespace, name)
        meta = obj["metadata"]
        key = (plural, self._ns(plural, namespace), name)
        graceful = (
            plural == "pods"
            and grace_period_seconds != 0
            and bool(obj.get("spec", {}).get("nodeName"))  # unscheduled pods go at once, as upstream
        )
        if graceful or meta.get("finalizers"):
            if meta.get("deletionTimestamp"):
                return copy.deepcopy(obj)
            new = copy.deepcopy(obj)
            new["metadata"]["deletionTimestamp"] = now_rfc3339()
            if plural == "pods":
                grace = grace_period_seconds
                if grace is None:
                    grace = int(obj.get("spec", {}).get("terminationGracePeriodSeconds", 30))
                new["metadata"]["deletionGracePeriodSeconds"] = grace
            self.objects[key] = new
            await self._emit("MODIFIED", plural, new)
            if graceful or new["metadata"].get("finalizers"):
                return copy.deepcopy(new)
        del self.objects[key]
        await self._emit("DELETED", plural, obj)
        return copy.deepcopy(obj)

    # -- watching -----------------------------------------------------------------------------

    def watch(self) -> AsyncIterator[WatchEvent]:
        """Every change from the moment of this call (not of the first iteration) on."""
        return self._events_after(self.resource_version)

    async def _events_after(self, resource_version: int) -> AsyncIterator[WatchEvent]:
        async for _, event in self.watch_from(resource_version):
            yield event

    async def watch_from(self, resource_version: int) -> AsyncIterator[tuple[int, WatchEvent]]:
        """Every event after ``resource_version``; 410 Gone if the history no longer has it."""
        if self.history and resource_version < self.history[0][0] - 1:
            raise ApiError(410, "Expired", f"too old resource version: {resource_version}")
        seen = resource_version
        while True:
            pending = [(rv, ev) for rv, ev in self.history if rv > seen]
            for rv, event in pending:
                seen = rv
                yield rv, event
            async with self._condition():
                if self.resource_version <= seen:
                    await self._condition().wait()

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    async def _emit(self, kind: str, plural: str, obj: Obj) -> None:
        self.resource_version += 1
        rv = self.resource_version
        obj["metadata"]["resourceVersion"] = str(rv)
        self.history.append((rv, WatchEvent(kind, plural, copy.deepcopy(obj))))
        async with self._condition():
            self._condition().notify_all()

    # -- helpers ------------------------------------------------------------------------------

    def _ns(self, plural: str, namespace: str | None) -> str | None:
        return (namespace or "default") if self.kind(plural).namespaced else None

    def _conflict(self, plural: str, name: str) -> ApiError:
        return ApiError(
            409,
            "Conflict",
            f'Operation cannot be fulfilled on {plural} "{name}": the object has been modified;'
            " please apply your changes to the latest version and try again",
            {"name": name, "kind": plural},
        )


def _spec_of(obj: Obj) -> Any:
    """What ``generation`` tracks: everything but metadata and status."""
    return {k: v for k, v in obj.items() if k not in ("metadata", "status", "apiVersion", "kind")}
