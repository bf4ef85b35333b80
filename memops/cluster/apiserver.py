"""The emulated Kubernetes API server: kmock's ``KubernetesEmulator`` with the semantics memops needs.

Used by the sandbox (``memops sandbox``) and the test suite. kmock gives the HTTP server,
API discovery and the Status error shape; this module adds what real clients (kubectl,
Kopf, memops' own client) rely on and what kmock leaves to its users:

- a store with resourceVersion, uid, generation, optimistic concurrency and subresources
  (:mod:`memops.cluster.memstore`);
- label and field selectors, list ``kind``s, watches that start from a resourceVersion;
- the ``/scale`` subresource for Deployments and for CRDs that declare one;
- CustomResourceDefinitions: creating one serves its kind, validated against its schema
  (:mod:`memops.cluster.schemas`), with its printer columns in ``kubectl get``;
- ``meta.k8s.io/v1`` Tables, because that is what ``kubectl get`` asks for;
- the OpenAPI v3 documents, which ``kubectl apply`` reads to learn that the server
  validates fields, and ``kubectl explain`` reads to describe them.

Everything else is out of scope and answers 404 or 405, never a made-up success.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import json
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp.web
import attrs
import kmock
import yaml

from memops import selectors
from memops.cluster import admission, audit, memstore, schemas
from memops.cluster.memstore import ApiError, Kind, MemoryStore, Obj

logger = logging.getLogger(__name__)

SERVER_VERSION = {"major": "1", "minor": "35", "gitVersion": "v1.35.0-memops-emulator", "platform": "linux/amd64"}

BUILTIN_KINDS = (
    Kind("", "v1", "Namespace", "namespaces", namespaced=False, subresources=("status",), short_names=("ns",)),
    Kind("", "v1", "Pod", "pods", subresources=("status",), short_names=("po",)),
    Kind("", "v1", "Event", "events", short_names=("ev",)),
    Kind("", "v1", "Secret", "secrets"),
    Kind("", "v1", "ConfigMap", "configmaps", short_names=("cm",)),
    Kind("", "v1", "Service", "services", subresources=("status",), short_names=("svc",)),
    Kind("", "v1", "ServiceAccount", "serviceaccounts", short_names=("sa",)),
    Kind(
        "apps",
        "v1",
        "Deployment",
        "deployments",
        subresources=("status", "scale"),
        short_names=("deploy",),
        scale={
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        },
    ),
    Kind("coordination.k8s.io", "v1", "Lease", "leases"),
    Kind(
        "admissionregistration.k8s.io",
        "v1",
        "MutatingWebhookConfiguration",
        "mutatingwebhookconfigurations",
        namespaced=False,
    ),
    Kind(
        "admissionregistration.k8s.io",
        "v1",
        "ValidatingWebhookConfiguration",
        "validatingwebhookconfigurations",
        namespaced=False,
    ),
    Kind(
        "autoscaling",
        "v2",
        "HorizontalPodAutoscaler",
        "horizontalpodautoscalers",
        subresources=("status",),
        short_names=("hpa",),
    ),
    Kind(
        "apiextensions.k8s.io",
        "v1",
        "CustomResourceDefinition",
        "customresourcedefinitions",
        namespaced=False,
        subresources=("status",),
        short_names=("crd",),
    ),
)

_BUILTIN_COLUMNS: dict[str, tuple[tuple[str, Callable[[Obj], Any]], ...]] = {
    "pods": (
        ("Ready", lambda o: f"{int(_pod_ready(o))}/1"),
        (
            "Status",
            lambda o: (
                "Terminating" if o["metadata"].get("deletionTimestamp") else o.get("status", {}).get("phase", "Pending")
            ),
        ),
        ("Restarts", lambda o: sum(c.get("restartCount", 0) for c in o.get("status", {}).get("containerStatuses", []))),
    ),
    "deployments": (
        (
            "Ready",
            lambda o: "{}/{}".format(o.get("status", {}).get("readyReplicas", 0), o.get("spec", {}).get("replicas", 1)),
        ),
        ("Up-to-date", lambda o: o.get("status", {}).get("updatedReplicas", 0)),
        ("Available", lambda o: o.get("status", {}).get("availableReplicas", 0)),
    ),
    "events": (
        ("Type", lambda o: o.get("type", "")),
        ("Reason", lambda o: o.get("reason", "")),
        (
            "Object",
            lambda o: "{}/{}".format(
                o.get("involvedObject", {}).get("kind", "").lower(), o.get("involvedObject", {}).get("name", "")
            ),
        ),
        ("Message", lambda o: o.get("message", "")),
    ),
}


def _pod_ready(pod: Obj) -> bool:
    conditions = pod.get("status", {}).get("conditions", [])
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def json_path(obj: Any, path: str) -> Any:
    """The value at a printer column's simple JSONPath (``.status.phase``), or None."""
    for part in path.strip(".").split("."):
        if not isinstance(obj, dict):
            return None
        obj = obj.get(part)
    return obj


def _age(timestamp: str | None) -> str:
    """Render a timestamp as kubectl's short human duration (``5m``, ``3h``), as upstream tables do."""
    if not timestamp:
        return "<unknown>"
    then = datetime.datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)
    seconds = int((datetime.datetime.now(tz=datetime.UTC) - then).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size * 2 or (unit == "m" and seconds >= 120):
            return f"{seconds // size}{unit}"
    return f"{max(seconds, 0)}s"


def _column_getter(path: str, *, is_date: bool) -> Callable[[Obj], Any]:
    def getter(obj: Obj) -> Any:
        value = json_path(obj, path)
        return _age(value) if is_date else value

    return getter


# -- selectors -------------------------------------------------------------------------------

_SELECTOR_TERM = re.compile(r"^\s*(!)?([\w./-]+)\s*(?:(==|=|!=)\s*([\w./-]*))?\s*$")
_SET_TERM = re.compile(r"^\s*([\w./-]+)\s+(in|notin)\s+\(([^()]*)\)\s*$")
_TERMS = re.compile(r"(?:[^,(]|\([^)]*\))+")


def parse_selector(text: str | None) -> list[tuple[str, str, str]]:
    """Equality-based (``a=b,c!=d,e,!f``) and set-based (``a in (x,y),b notin (z)``) selectors,
    as labelSelector and fieldSelector take them; a set's values are kept joined by commas."""
    terms: list[tuple[str, str, str]] = []
    for raw in _TERMS.findall(text or ""):
        if not raw.strip():
            continue
        in_set = _SET_TERM.match(raw)
        if in_set:
            key, op, values = in_set.groups()
            terms.append((key, op, ",".join(v.strip() for v in values.split(","))))
            continue
        match = _SELECTOR_TERM.match(raw)
        if not match:
            raise ApiError(400, "BadRequest", f"unable to parse requirement: {raw!r}")
        negate, key, op, value = match.groups()
        if op is None:
            terms.append((key, "!exists" if negate else "exists", ""))
        else:
            terms.append((key, "!=" if op == "!=" else "=", value or ""))
    return terms


def _matches(terms: list[tuple[str, str, str]], lookup: Callable[[str], Any]) -> bool:
    for key, op, value in terms:
        actual = lookup(key)
        if op == "=" and (actual is None or str(actual) != value):
            return False
        if op == "!=" and actual is not None and str(actual) == value:
            return False
        if op == "exists" and actual is None:
            return False
        if op == "!exists" and actual is not None:
            return False
        if op == "in" and (actual is None or str(actual) not in value.split(",")):
            return False
        if op == "notin" and actual is not None and str(actual) in value.split(","):
            return False
    return True


def selected(obj: Obj, label_terms: list[tuple[str, str, str]], field_terms: list[tuple[str, str, str]]) -> bool:
    labels = obj.get("metadata", {}).get("labels") or {}
    return _matches(label_terms, labels.get) and _matches(field_terms, lambda path: json_path(obj, path))


# -- the server ------------------------------------------------------------------------------


@attrs.define(kw_only=True)
class ApiServer(kmock.KubernetesEmulator):
    """A KubernetesEmulator whose resource requests are served from a :class:`MemoryStore`."""

    store: MemoryStore = attrs.field(factory=MemoryStore)
    audit_log: Path | None = None  # append each resource request here (see memops.cluster.audit)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for kind in BUILTIN_KINDS:
            self.serve_kind(kind)
        # The API server answers these with a trailing slash too; kr8s (dask-kubernetes' client) adds one.
        self.fallback["get /version/"] << self._serve_server_version
        self.fallback["get /api/"] << self._serve_api
        self.fallback["get /apis/"] << self._serve_apis
        self.store.admit = self.admit
        for namespace in ("default", "kube-system"):
            self.store.objects[("namespaces", None, namespace)] = {
                "apiVersion": "v1",
                "kind": "Namespace",
                "metadata": {
                    "name": namespace,
                    "uid": namespace,
                    "resourceVersion": "1",
                    "creationTimestamp": memstore.now_rfc3339(),
                    "generation": 1,
                },
                "status": {"phase": "Active"},
            }

    def serve_kind(self, kind: Kind) -> None:
        self.store.register(kind)
        verbs = {"get", "list", "watch", "create", "update", "patch", "delete"}
        self.resources[kmock.resource(kind.group, kind.version, kind.plural)] = kmock.ResourceInfo(
            kind=kind.kind,
            singular=kind.kind.lower(),
            namespaced=kind.namespaced,
            verbs=verbs,
            shortnames=set(kind.short_names),
            categories={"all"} if kind.plural in ("pods", "deployments", "services") else set(),
            subresources=set(kind.subresources),
        )

    async def _serve_server_version(self, request: kmock.Request) -> dict[str, str]:
        return SERVER_VERSION

    async def _serve_version(self, request: kmock.Request) -> Obj:
        """APIResourceList of one group version (kmock's lists subresources with short names,
        which makes kubectl warn that every short name is ambiguous)."""
        assert request.resource is not None
        group, version = request.resource.group, request.resource.version
        kinds = [k for k in self.store.kinds.values() if (k.group, k.version) == (group, version)]
        if not kinds:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({request.url.path})")
        verbs = ["create", "delete", "get", "list", "patch", "update", "watch"]
        resources: list[Obj] = []
        for kind in kinds:
            resources.append(
                {
                    "name": kind.plural,
                    "singularName": kind.kind.lower(),
                    "namespaced": kind.namespaced,
                    "kind": kind.kind,
                    "verbs": verbs,
                    "shortNames": list(kind.short_names),
                    **({"categories": ["all"]} if kind.plural in ("pods", "deployments", "services") else {}),
                }
            )
            for sub in kind.subresources:
                sub_kind = "Scale" if sub == "scale" else kind.kind
                resources.append(
                    {
                        "name": f"{kind.plural}/{sub}",
                        "singularName": "",
                        "namespaced": kind.namespaced,
                        "kind": sub_kind,
                        "verbs": ["get", "patch", "update"],
                        **({"group": "autoscaling", "version": "v1"} if sub == "scale" else {}),
                    }
                )
        return {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": f"{group}/{version}".lstrip("/"),
            "resources": resources,
        }

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        path = request.url.path
        if self.audit_log is not None:
            self._audit(request, self.audit_log)
        try:
            if path == "/openapi/v3" or path.startswith("/openapi/v3/"):
                return aiohttp.web.json_response(self._openapi(path))
            res = request.resource
            if res is not None and res.version is not None and res.plural is None:
                return aiohttp.web.json_response(await self._serve_version(request))
            if res is None or res.plural is None or res.plural not in self.store.kinds:
                return await super()._handle(request)  # discovery, or kmock's own 404
            kind = self.store.kinds[res.plural]
            if (res.group, res.version) != (kind.group, kind.version):
                raise ApiError(404, "NotFound", f"the server could not find the requested resource ({path})")
            return await self._serve(request, kind)
        except ApiError as exc:
            return aiohttp.web.json_response(exc.status(), status=exc.code)

    def _audit(self, request: kmock.Request, log: Path) -> None:
        """Record a resource request as RBAC sees it, before it is served: authorization comes
        first in a real API server, so requests that end in 404 are recorded too."""
        res = request.resource
        if res is None or res.plural is None:
            return  # discovery and OpenAPI: non-resource URLs, open to every authenticated user
        entry = {
            "user": audit.user_of(request.headers.get("Authorization", "")),
            "userAgent": request.headers.get("User-Agent", ""),
            "verb": audit.rbac_verb(
                request.method.value,
                named=request.name is not None,
                watch=request.params.get("watch") in ("true", "1"),
            ),
            "group": res.group or "",
            "version": res.version,
            "resource": res.plural,
            "subresource": request.subresource or "",
            "namespace": request.namespace or "",
            "name": request.name or "",
        }
        audit.write(log, entry)

    async def _serve(self, request: kmock.Request, kind: Kind) -> aiohttp.web.StreamResponse:
        method, name, sub = request.method.value.upper(), request.name, request.subresource
        namespace = request.namespace
        if kind.namespaced and namespace is not None and self.store.get("namespaces", None, namespace) is None:
            if method != "GET":
                raise ApiError(404, "NotFound", f'namespaces "{namespace}" not found')
        if method == "GET" and request.params.get("watch") in ("true", "1"):
            return await self._watch(request, kind)
        if name is None:
            if method == "GET":
                return self._respond(request, kind, self._list(request, kind), listing=True)
            if method == "POST":
                self._check_strict(request, kind, request.data)
                created = await self.store.create(kind.plural, namespace, dict(request.data or {}))
                await self._after_write(kind, created)
                return aiohttp.web.json_response(created, status=201)
            raise ApiError(405, "MethodNotAllowed", f"{method} is not supported on a collection here")
        if sub == "scale" and kind.scale is not None:
            return await self._serve_scale(request, kind)
        if sub not in (None, "status") or (sub == "status" and "status" not in kind.subresources):
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({kind.plural}/{sub})")
        if method == "GET":
            obj = self.store.require(kind.plural, namespace, name)
            return self._respond(request, kind, [obj], listing=False)
        if method == "PUT":
            self._check_strict(request, kind, request.data)
            obj = await self.store.replace(kind.plural, namespace, name, dict(request.data or {}), subresource=sub)
        elif method == "PATCH":
            patch_type = _patch_type(request.headers.get("Content-Type", ""))
            if patch_type != "json":
                self._check_strict(request, kind, request.data)
            obj = await self.store.patch(
                kind.plural, namespace, name, request.data, subresource=sub, patch_type=patch_type
            )
        elif method == "DELETE":
            grace = request.params.get("gracePeriodSeconds")
            if grace is None and isinstance(request.data, dict):
                grace = request.data.get("gracePeriodSeconds")
            obj = await self.store.delete(
                kind.plural, namespace, name, grace_period_seconds=None if grace is None else int(grace)
            )
        else:
            raise ApiError(405, "MethodNotAllowed", f"{method} is not supported here")
        await self._after_write(kind, obj)
        return aiohttp.web.json_response(obj)

    # -- admission and CRDs ---------------------------------------------------------------------

    async def admit(self, kind: Kind, obj: Obj) -> Obj:
        """Call the mutating webhooks whose rules match the creation of ``obj``, as the API server
        does: an AdmissionReview v1 POSTed to ``clientConfig.url``, its JSONPatch applied."""
        for config in self.store.list("mutatingwebhookconfigurations"):
            for hook in config.get("webhooks", []):
                labels = obj.get("metadata", {}).get("labels") or {}
                wanted = (hook.get("objectSelector") or {}).get("matchLabels") or {}
                if not admission.rules_match(hook.get("rules", []), kind, "CREATE") or any(
                    labels.get(k) != v for k, v in wanted.items()
                ):
                    continue
                try:
                    obj = await admission.call_webhook(hook, kind, obj, operation="CREATE")
                except admission.Denied as exc:
                    raise ApiError(
                        400, "BadRequest", f'admission webhook "{hook.get("name")}" denied the request: {exc}'
                    ) from exc
                except Exception as exc:
                    if hook.get("failurePolicy", "Fail") == "Ignore":
                        logger.warning("webhook %s failed and is ignored: %s", hook.get("name"), exc)
                        continue
                    raise ApiError(500, "InternalError", f'failed calling webhook "{hook.get("name")}": {exc}') from exc
        return obj

    async def _after_write(self, kind: Kind, obj: Obj) -> None:
        if kind.plural == "customresourcedefinitions" and not obj["metadata"].get("deletionTimestamp"):
            self.serve_crd(obj)
            if not obj.get("status", {}).get("conditions"):
                established = {
                    "type": "Established",
                    "status": "True",
                    "reason": "InitialNamesAccepted",
                    "lastTransitionTime": memstore.now_rfc3339(),
                    "message": "the initial names have been accepted",
                }
                status = {"conditions": [established], "acceptedNames": obj["spec"]["names"]}
                await self.store.patch(
                    kind.plural, None, obj["metadata"]["name"], {"status": status}, subresource="status"
                )

    async def create_crd(self, crd: Obj) -> Obj:
        """Install a CRD as ``kubectl apply`` would: store it, then serve its kind."""
        kind = self.store.kinds["customresourcedefinitions"]
        created = await self.store.create(kind.plural, None, crd)
        await self._after_write(kind, created)
        return created

    def serve_crd(self, crd: Obj) -> Kind:
        """Serve the kind that a CustomResourceDefinition declares (its first served version)."""
        spec = crd["spec"]
        version = next(v for v in spec["versions"] if v.get("served", True))
        schema = version.get("schema", {}).get(
            "openAPIV3Schema", {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
        )
        names = spec["names"]

        def validate(new: Obj, old: Obj | None) -> Obj:
            return schemas.validate(new, schema, kind=names["kind"], group=spec["group"])

        kind = Kind(
            spec["group"],
            version["name"],
            names["kind"],
            names["plural"],
            namespaced=spec.get("scope", "Namespaced") == "Namespaced",
            subresources=tuple(version.get("subresources", {})),
            short_names=tuple(names.get("shortNames", ())),
            validate=validate,
            printer_columns=tuple(version.get("additionalPrinterColumns", ())),
            scale=version.get("subresources", {}).get("scale"),
            schema=schema,
        )
        self.serve_kind(kind)
        return kind

    def _check_strict(self, request: kmock.Request, kind: Kind, body: Any) -> None:
        schema = kind.schema
        if schema is None or request.params.get("fieldValidation") != "Strict" or not isinstance(body, dict):
            return
        content = {k: v for k, v in body.items() if k not in schemas.IMPLICIT_ROOT_FIELDS}
        unknown = sorted(schemas.unknown_fields(content, schema))
        if unknown:
            raise ApiError(
                400, "BadRequest", "strict decoding error: " + ", ".join(f'unknown field "{f}"' for f in unknown)
            )

    # -- reading ----------------------------------------------------------------------------------

    def _list(self, request: kmock.Request, kind: Kind) -> list[Obj]:
        label_terms = parse_selector(request.params.get("labelSelector"))
        field_terms = parse_selector(request.params.get("fieldSelector"))
        return [
            obj for obj in self.store.list(kind.plural, request.namespace) if selected(obj, label_terms, field_terms)
        ]

    def _respond(
        self, request: kmock.Request, kind: Kind, objs: list[Obj], *, listing: bool
    ) -> aiohttp.web.StreamResponse:
        if "as=Table" in request.headers.get("Accept", ""):
            return aiohttp.web.json_response(self._table(kind, objs))
        if not listing:
            return aiohttp.web.json_response(objs[0])
        return aiohttp.web.json_response(
            {
                "apiVersion": kind.api_version,
                "kind": f"{kind.kind}List",
                "metadata": {"resourceVersion": str(self.store.resource_version)},
                "items": objs,
            }
        )

    def _table(self, kind: Kind, objs: list[Obj]) -> Obj:
        columns: list[tuple[str, str, Callable[[Obj], Any], int]] = [
            ("Name", "string", lambda o: o["metadata"]["name"], 0)
        ]
        for column in kind.printer_columns:
            getter = _column_getter(column["jsonPath"], is_date=column.get("type") == "date")
            columns.append((column["name"], column.get("type", "string"), getter, int(column.get("priority", 0))))
        for name, getter in _BUILTIN_COLUMNS.get(kind.plural, ()):
            columns.append((name, "string", getter, 0))
        if not kind.printer_columns:
            columns.append(("Age", "string", lambda o: _age(o["metadata"].get("creationTimestamp")), 0))
        return {
            "kind": "Table",
            "apiVersion": "meta.k8s.io/v1",
            "metadata": {"resourceVersion": str(self.store.resource_version)},
            "columnDefinitions": [
                {
                    "name": name,
                    "type": type_,
                    "format": "name" if name == "Name" else "",
                    "description": name,
                    "priority": prio,
                }
                for name, type_, _, prio in columns
            ],
            "rows": [
                {
                    "cells": [getter(obj) for _, _, getter, _ in columns],
                    "object": {
                        "kind": "PartialObjectMetadata",
                        "apiVersion": "meta.k8s.io/v1",
                        "metadata": obj["metadata"],
                    },
                }
                for obj in objs
            ],
        }

    async def _watch(self, request: kmock.Request, kind: Kind) -> aiohttp.web.StreamResponse:
        label_terms = parse_selector(request.params.get("labelSelector"))
        field_terms = parse_selector(request.params.get("fieldSelector"))
        if request.name is not None:
            field_terms.append(("metadata.name", "=", request.name))
        timeout = float(request.params.get("timeoutSeconds", 1800))
        start = request.params.get("resourceVersion") or ""
        # WatchList (client-go's WatchListClient, on in kubectl): the current objects as ADDED
        # events, then a BOOKMARK annotated k8s.io/initial-events-end, then the changes.
        watch_list = request.params.get("sendInitialEvents") == "true"
        initial: list[Obj] = []
        if start in ("", "0") or watch_list:
            initial = [
                o for o in self.store.list(kind.plural, request.namespace) if selected(o, label_terms, field_terms)
            ]
            from_rv = self.store.resource_version
        else:
            from_rv = int(start)

        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        raw = request._raw_request
        assert raw is not None
        await response.prepare(raw)

        async def send(event_type: str, obj: Obj) -> None:
            await response.write(json.dumps({"type": event_type, "object": obj}).encode() + b"\n")

        with contextlib.suppress(ConnectionError, asyncio.TimeoutError, asyncio.CancelledError):
            async with asyncio.timeout(timeout):
                for obj in initial:
                    await send("ADDED", obj)
                if watch_list:
                    await send(
                        "BOOKMARK",
                        {
                            "kind": kind.kind,
                            "apiVersion": kind.api_version,
                            "metadata": {
                                "resourceVersion": str(from_rv),
                                "annotations": {"k8s.io/initial-events-end": "true"},
                            },
                        },
                    )
                try:
                    async for _, event in self.store.watch_from(from_rv):
                        if event.plural != kind.plural:
                            continue
                        ns = event.object.get("metadata", {}).get("namespace")
                        if request.namespace is not None and ns != request.namespace:
                            continue
                        if selected(event.object, label_terms, field_terms):
                            await send(event.type, event.object)
                except ApiError as exc:
                    await send("ERROR", exc.status())
        with contextlib.suppress(ConnectionError):
            await response.write_eof()
        return response

    # -- /scale -----------------------------------------------------------------------------------

    async def _serve_scale(self, request: kmock.Request, kind: Kind) -> aiohttp.web.StreamResponse:
        assert kind.scale is not None and request.name is not None
        method = request.method.value.upper()
        if method in ("PATCH", "PUT"):
            body = request.data if isinstance(request.data, dict) else {}
            if _patch_type(request.headers.get("Content-Type", "")) == "json":
                import jsonpatch

                body = jsonpatch.apply_patch(
                    self._scale(kind, self.store.require(kind.plural, request.namespace, request.name)), request.data
                )
            replicas = (body.get("spec") or {}).get("replicas")
            if not isinstance(replicas, int) or replicas < 0:
                raise ApiError(
                    422,
                    "Invalid",
                    f'Scale.autoscaling "{request.name}" is invalid: spec.replicas: Invalid value: {replicas!r}:'
                    " must be greater than or equal to 0",
                )
            current = self.store.require(kind.plural, request.namespace, request.name)
            claimed = (body.get("metadata") or {}).get("resourceVersion")
            if claimed and claimed != current["metadata"]["resourceVersion"]:
                raise self.store._conflict(kind.plural, request.name)
            patch = _nest(kind.scale["specReplicasPath"], replicas)
            obj = await self.store.patch(kind.plural, request.namespace, request.name, patch)
        elif method == "GET":
            obj = self.store.require(kind.plural, request.namespace, request.name)
        else:
            raise ApiError(405, "MethodNotAllowed", f"{method} is not supported on /scale")
        return aiohttp.web.json_response(self._scale(kind, obj))

    def _scale(self, kind: Kind, obj: Obj) -> Obj:
        assert kind.scale is not None
        meta = obj["metadata"]
        selector = json_path(obj, kind.scale.get("labelSelectorPath", ".status.selector")) or ""
        if kind.plural == "deployments":
            try:
                selector = selectors.render(obj.get("spec", {}).get("selector"))
            except selectors.InvalidSelector:
                selector = ""  # memops refuses such a selector; the scale still reports its replicas
        return {
            "kind": "Scale",
            "apiVersion": "autoscaling/v1",
            "metadata": {
                k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp") if k in meta
            },
            "spec": {"replicas": json_path(obj, kind.scale["specReplicasPath"]) or 0},
            "status": {"replicas": json_path(obj, kind.scale["statusReplicasPath"]) or 0, "selector": selector},
        }

    # -- OpenAPI v3 -------------------------------------------------------------------------------

    def _group_versions(self) -> dict[str, list[Kind]]:
        result: dict[str, list[Kind]] = {}
        for kind in self.store.kinds.values():
            key = f"apis/{kind.group}/{kind.version}" if kind.group else f"api/{kind.version}"
            result.setdefault(key, []).append(kind)
        return result

    def _openapi(self, path: str) -> Obj:
        groups = self._group_versions()
        if path.rstrip("/") == "/openapi/v3":
            return {
                "paths": {
                    key: {"serverRelativeURL": f"/openapi/v3/{key}?hash={self._hash(kinds)}"}
                    for key, kinds in groups.items()
                }
            }
        key = path[len("/openapi/v3/") :].strip("/")
        if key not in groups:
            raise ApiError(404, "NotFound", f"no OpenAPI document for {key}")
        components: dict[str, Any] = {}
        paths: dict[str, Any] = {}
        for kind in groups[key]:
            gvk = [{"group": kind.group, "version": kind.version, "kind": kind.kind}]
            schema_name = (
                ".".join(reversed(kind.group.split("."))) + f".{kind.version}.{kind.kind}"
                if kind.group
                else f"io.k8s.api.core.{kind.version}.{kind.kind}"
            )
            schema = kind.schema or {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
            components[schema_name] = {**schema, "x-kubernetes-group-version-kind": gvk}
            params = [{"name": "fieldValidation", "in": "query", "schema": {"type": "string", "uniqueItems": True}}]
            base = f"/{key}/namespaces/{{namespace}}/{kind.plural}" if kind.namespaced else f"/{key}/{kind.plural}"
            op = {"x-kubernetes-group-version-kind": gvk[0], "parameters": params}
            paths[base] = {"post": {**op, "x-kubernetes-action": "post"}}
            paths[f"{base}/{{name}}"] = {
                "patch": {**op, "x-kubernetes-action": "patch"},
                "put": {**op, "x-kubernetes-action": "put"},
            }
        return {
            "openapi": "3.0.0",
            "info": {"title": "Kubernetes", "version": SERVER_VERSION["gitVersion"]},
            "paths": paths,
            "components": {"schemas": components},
        }

    @staticmethod
    def _hash(kinds: list[Kind]) -> str:
        text = json.dumps([(k.kind, k.schema) for k in kinds], sort_keys=True, default=str)
        return hashlib.sha512(text.encode()).hexdigest()[:32].upper()


def _patch_type(content_type: str) -> str:
    if "json-patch" in content_type:
        return "json"
    if "apply-patch" in content_type:
        raise ApiError(
            415,
            "UnsupportedMediaType",
            "server-side apply is not served by this emulator; use client-side kubectl apply",
        )
    return "merge"


def _nest(path: str, value: Any) -> Obj:
    result: Any = value
    for part in reversed(path.strip(".").split(".")):
        result = {part: result}
    assert isinstance(result, dict)
    return result


def kubeconfig(url: str, namespace: str = "default", token: str = "sandbox") -> str:
    """A kubeconfig that points kubectl and the Python clients at the emulated server.

    The token names the user in the audit log (:mod:`memops.cluster.audit`); it grants nothing.
    """
    return yaml.safe_dump(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "memops-sandbox", "cluster": {"server": url}}],
            "users": [{"name": "memops-sandbox", "user": {"token": token}}],
            "contexts": [
                {
                    "name": "memops-sandbox",
                    "context": {"cluster": "memops-sandbox", "user": "memops-sandbox", "namespace": namespace},
                }
            ],
            "current-context": "memops-sandbox",
            "preferences": {},
        },
        sort_keys=False,
    )
