"""What ``kubectl get ... -o json`` prints, read from the API server over kept-alive connections.

The tests act through kubectl (apply, scale, drain, delete), as users do, and read objects back
to poll for a status, a phase or a pod. Each kubectl process costs about 70 ms of CPU (starting
the binary, its kubeconfig and discovery cache), and a test polls every 0.2 s: on two shared
cores the polls of two lanes took a fifth of the CPU that the Dask workers and the control plane
needed. :class:`Reader` makes the same GET in this process: kubectl's argument forms that the
tests use (a resource by plural, singular, kind or short name, with a group; comma-separated
resources; a name; ``-n``, ``-A``, ``-l``, ``--field-selector``), the same JSON (a list's items
carry their ``kind`` and ``apiVersion``, as kubectl adds them), and the same failure (an
AssertionError with the server's message). :func:`parse` returns None for any other form, and the
caller runs kubectl instead.
"""

from __future__ import annotations

import base64
import dataclasses
import http.client
import json
import ssl
import tempfile
import threading
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

TIMEOUT = 60.0


@dataclasses.dataclass(frozen=True)
class Query:
    """A ``kubectl get``'s arguments: resources (as typed), an optional name, where and what."""

    resources: tuple[str, ...]
    name: str | None = None
    namespace: str | None = None
    all_namespaces: bool = False
    labels: str | None = None
    fields: str | None = None


_VALUED = {"-n": "namespace", "--namespace": "namespace", "-l": "labels", "--selector": "labels"}
_VALUED["--field-selector"] = "fields"


def parse(args: tuple[str, ...]) -> Query | None:
    """A ``kubectl get`` command line (without ``get`` and ``-o json``) as a :class:`Query`, or
    None where it uses anything else."""
    positional: list[str] = []
    options: dict[str, Any] = {}
    rest = list(args)
    while rest:
        arg = rest.pop(0)
        flag, equals, value = arg.partition("=")
        if flag in _VALUED:
            if not equals:
                if not rest:
                    return None
                value = rest.pop(0)
            options[_VALUED[flag]] = value
        elif arg in ("-A", "--all-namespaces"):
            options["all_namespaces"] = True
        elif arg.startswith("-"):
            return None
        else:
            positional.append(arg)
    if not positional or len(positional) > 2 or "/" in positional[0]:
        return None
    resources = tuple(positional[0].split(","))
    name = positional[1] if len(positional) == 2 else None
    if name is not None and (len(resources) > 1 or options.get("labels") or options.get("fields")):
        return None
    if not all(resources):
        return None
    return Query(resources, name, **options)


@dataclasses.dataclass(frozen=True)
class Resource:
    path: str  # /api/v1 or /apis/GROUP/VERSION
    plural: str
    kind: str
    namespaced: bool

    @property
    def api_version(self) -> str:
        return self.path.removeprefix("/api/").removeprefix("/apis/")


class Reader:
    """GETs with one kubeconfig's static credentials (a client certificate or a token): one
    connection per thread, kept alive; the API's resources discovered on first use, and again
    when a name is not among them (a CRD installed since)."""

    def __init__(self, cluster: dict[str, Any], user: dict[str, str], namespace: str):
        self.namespace = namespace
        server = urllib.parse.urlsplit(cluster["server"])
        self.host, self.port = str(server.hostname), int(server.port or 443)
        ca = base64.b64decode(cluster["certificate-authority-data"]).decode()
        self.context = ssl.create_default_context(cadata=ca)
        self.headers = {"Accept": "application/json"}
        if "token" in user:
            self.headers["Authorization"] = f"Bearer {user['token']}"
        else:
            # ssl loads a client certificate from files only.
            with tempfile.TemporaryDirectory() as directory:
                cert, key = Path(directory) / "cert", Path(directory) / "key"
                cert.write_bytes(base64.b64decode(user["client-certificate-data"]))
                key.write_bytes(base64.b64decode(user["client-key-data"]))
                self.context.load_cert_chain(cert, key)
        self.local = threading.local()
        self.lock = threading.Lock()
        self.resources: dict[str, Resource] = {}

    @classmethod
    def of(cls, kubeconfig: Path) -> Reader | None:
        """A reader with the kubeconfig's current context; None where its user's credentials are
        not static (an exec plugin, a token file: kubectl reads those)."""
        config = yaml.safe_load(kubeconfig.read_text())
        context = next((c["context"] for c in config["contexts"] if c["name"] == config["current-context"]), {})
        users = [u["user"] for u in config.get("users", []) if u["name"] == context.get("user")]
        if not users or not ("token" in users[0] or "client-certificate-data" in users[0]):
            return None
        cluster = next(c["cluster"] for c in config["clusters"] if c["name"] == context["cluster"])
        return cls(cluster, users[0], str(context.get("namespace") or "default"))

    # -- HTTP -----------------------------------------------------------------------------------

    def _request(self, path: str) -> tuple[int, bytes]:
        for attempt in (0, 1):
            connection: http.client.HTTPSConnection | None = getattr(self.local, "connection", None)
            if connection is None:
                connection = http.client.HTTPSConnection(self.host, self.port, context=self.context, timeout=TIMEOUT)
                self.local.connection = connection
            try:
                connection.request("GET", path, headers=self.headers)
                response = connection.getresponse()
                return response.status, response.read()
            except (OSError, http.client.HTTPException) as error:
                connection.close()
                self.local.connection = None
                if attempt:  # kubectl fails too: the API server is away
                    raise AssertionError(f"kubectl get failed: {self.host}:{self.port}: {error!r}") from error
        raise AssertionError("unreachable")

    def _json(self, path: str, what: str) -> dict[str, Any]:
        status, body = self._request(path)
        if status != 200:
            try:
                problem = json.loads(body)
                reason, message = problem.get("reason") or status, problem.get("message", "")
            except ValueError:
                reason, message = status, body.decode(errors="replace")
            raise AssertionError(f"kubectl get {what} failed: Error from server ({reason}): {message}")
        found: dict[str, Any] = json.loads(body)
        return found

    # -- discovery -------------------------------------------------------------------------------

    def _discover(self) -> dict[str, Resource]:
        """Every name kubectl resolves, to its resource in the group's preferred version: the core
        group first, then the groups in the API server's order (kubectl's priority)."""
        paths = ["/api/v1"]
        groups = self._json("/apis", "the API's groups")["groups"]
        paths += [f"/apis/{group['preferredVersion']['groupVersion']}" for group in groups]
        names: dict[str, Resource] = {}
        for path in paths:
            group = path.split("/")[2] if path.startswith("/apis/") else ""
            for item in self._json(path, path)["resources"]:
                if "/" in item["name"] or "get" not in item.get("verbs", []):
                    continue  # a subresource, or what cannot be read
                resource = Resource(path, item["name"], item["kind"], bool(item["namespaced"]))
                aliases = {item["name"], item.get("singularName") or "", item["kind"].lower()}
                aliases |= set(item.get("shortNames") or [])
                for alias in aliases - {""}:
                    names.setdefault(alias, resource)
                    if group:
                        names.setdefault(f"{alias}.{group}", resource)
        return names

    def resource(self, name: str) -> Resource | None:
        with self.lock:
            if name.lower() not in self.resources:
                self.resources = self._discover()
            return self.resources.get(name.lower())

    # -- get -------------------------------------------------------------------------------------

    def get(self, query: Query) -> Any:
        """What ``kubectl get -o json`` prints for ``query``; None where a resource is unknown."""
        resources = [self.resource(name) for name in query.resources]
        if any(found is None for found in resources):
            return None
        params = {"labelSelector": query.labels, "fieldSelector": query.fields}
        encoded = urllib.parse.urlencode({k: v for k, v in params.items() if v})
        items: list[dict[str, Any]] = []
        for found, typed in zip(resources, query.resources, strict=True):
            assert found is not None
            base = found.path
            if found.namespaced and not query.all_namespaces:
                base += f"/namespaces/{query.namespace or self.namespace}"
            if query.name is not None:
                return _shown(self._json(f"{base}/{found.plural}/{query.name}", f"{typed} {query.name}"))
            listed = self._json(f"{base}/{found.plural}" + (f"?{encoded}" if encoded else ""), typed)
            kind = listed.get("kind", "").removesuffix("List") or found.kind
            version = listed.get("apiVersion", found.api_version)
            items += [_shown({"apiVersion": version, "kind": kind, **item}) for item in listed.get("items") or []]
        return {"apiVersion": "v1", "items": items, "kind": "List", "metadata": {"resourceVersion": ""}}


def _shown(found: dict[str, Any]) -> dict[str, Any]:
    """As kubectl shows an object: without ``metadata.managedFields`` (``--show-managed-fields``)."""
    found.get("metadata", {}).pop("managedFields", None)
    return found


def get(kubeconfig: Path, what: tuple[str, ...], kubectl: Callable[[], str]) -> Any:
    """``kubectl get WHAT -o json``'s object with ``kubeconfig``: read here where this module can,
    else parsed from what ``kubectl`` (that command, run) printed."""
    query = parse(what)
    api = reader(kubeconfig) if query is not None else None
    found = api.get(query) if api is not None and query is not None else None
    return found if found is not None else json.loads(kubectl())


_READERS: dict[tuple[Path, int, int], Reader | None] = {}
_READERS_LOCK = threading.Lock()


def reader(kubeconfig: Path) -> Reader | None:
    """One :class:`Reader` per kubeconfig file as it is now (a test that rewrites one, to rotate
    its credentials, gets a new one); None where its user's credentials are not static."""
    found = kubeconfig.stat()
    key = (kubeconfig, found.st_mtime_ns, found.st_size)
    with _READERS_LOCK:
        if key not in _READERS:
            _READERS[key] = Reader.of(kubeconfig)
        return _READERS[key]
