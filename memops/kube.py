"""The operator's Kubernetes API client: the one seam between memops and the API server.

Kopf watches and patches memops' own resources; everything else the controllers do to the
cluster (read a Deployment, claim and annotate pods, lower replicas through ``/scale``,
write a request's status mid-drain) goes through the thin functions here. Credentials come
from the kubeconfig or the in-cluster service account and are expressed as Kopf's own
``ConnectionInfo``, so that Kopf's login and ours agree.
"""

from __future__ import annotations

import base64
import builtins
import json
import os
import ssl
import tempfile
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp
import kopf
import yaml

from memops import objects, permissions

_SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class ApiError(Exception):
    """The API server refused a request; ``code`` and ``reason`` come from its Status."""

    def __init__(self, code: int, reason: str, message: str):
        super().__init__(f"{code} {reason}: {message}")
        self.code = code
        self.reason = reason
        self.message = message


def load_connection(kubeconfig: str | None = None, context: str | None = None) -> kopf.ConnectionInfo:
    """Credentials from ``kubeconfig`` (or $KUBECONFIG, ~/.kube/config), else the service account."""
    path = kubeconfig or os.environ.get("KUBECONFIG", "").split(os.pathsep)[0] or str(Path.home() / ".kube/config")
    if Path(path).is_file():
        return _from_kubeconfig(Path(path), context)
    if (_SERVICE_ACCOUNT / "token").is_file() and os.environ.get("KUBERNETES_SERVICE_HOST"):
        host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        return kopf.ConnectionInfo(
            server=f"https://{host}:{port}",
            ca_path=str(_SERVICE_ACCOUNT / "ca.crt"),
            scheme="Bearer",
            token=(_SERVICE_ACCOUNT / "token").read_text().strip(),
            default_namespace=(_SERVICE_ACCOUNT / "namespace").read_text().strip(),
        )
    raise kopf.LoginError(f"no kubeconfig at {path} and no in-cluster service account")


def _from_kubeconfig(path: Path, context_name: str | None) -> kopf.ConnectionInfo:
    config = yaml.safe_load(path.read_text()) or {}
    context_name = context_name or config.get("current-context")
    context = _named(config.get("contexts", []), context_name)
    cluster = _named(config.get("clusters", []), context.get("cluster"))
    user = _named(config.get("users", []), context.get("user"))
    base = path.parent

    def file_or_data(prefix: str, section: Mapping[str, Any]) -> tuple[str | None, bytes | None]:
        if section.get(f"{prefix}-data"):
            return None, base64.b64decode(section[f"{prefix}-data"])
        if section.get(prefix):
            return str(base / section[prefix]), None
        return None, None

    ca_path, ca_data = file_or_data("certificate-authority", cluster)
    cert_path, cert_data = file_or_data("client-certificate", user)
    key_path, key_data = file_or_data("client-key", user)
    return kopf.ConnectionInfo(
        server=cluster["server"],
        ca_path=ca_path,
        ca_data=ca_data,
        insecure=cluster.get("insecure-skip-tls-verify"),
        scheme="Bearer" if user.get("token") else None,
        token=user.get("token"),
        username=user.get("username"),
        password=user.get("password"),
        certificate_path=cert_path,
        certificate_data=cert_data,
        private_key_path=key_path,
        private_key_data=key_data,
        default_namespace=context.get("namespace", "default"),
    )


def _named(items: list[Mapping[str, Any]], name: str | None) -> Mapping[str, Any]:
    for item in items:
        if item.get("name") == name:
            section = item.get("context") or item.get("cluster") or item.get("user") or {}
            return dict(section)
    raise kopf.LoginError(f"kubeconfig has no entry named {name!r}")


def _ssl_context(info: kopf.ConnectionInfo) -> ssl.SSLContext | bool:
    if not info.server.startswith("https://"):
        return False
    if info.insecure:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    else:
        cadata = info.ca_data.decode() if isinstance(info.ca_data, bytes) else info.ca_data
        context = ssl.create_default_context(cafile=info.ca_path, cadata=cadata)
    cert, key = info.certificate_path, info.private_key_path
    if info.certificate_data and info.private_key_data:
        # ssl only loads client certificates from files.
        directory = Path(tempfile.mkdtemp(prefix="memops-kube-"))
        cert, key = directory / "tls.crt", directory / "tls.key"
        cert.write_bytes(_as_bytes(info.certificate_data))
        key.write_bytes(_as_bytes(info.private_key_data))
        key.chmod(0o600)
    if cert:
        context.load_cert_chain(cert, key)
    return context


def _as_bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else value


def resource_path(
    group: str,
    version: str,
    plural: str,
    namespace: str | None = None,
    name: str | None = None,
    subresource: str | None = None,
) -> str:
    """The API path of a collection or an object; every segment is one path segment, always.

    The names come from users' specs, which the CRD schema already restricts to DNS-1123 names;
    quoting each segment and refusing the empty, ``.`` and ``..`` ones keeps a name from
    leaving its namespace even if one slips past the schema (an older CRD, a bug).
    """
    segments = ["apis", group, version] if group else ["api", version]
    if namespace is not None:
        segments += ["namespaces", namespace]
    segments.append(plural)
    if name is not None:
        segments.append(name)
    if subresource is not None:
        segments.append(subresource)
    for segment in segments:
        if segment in ("", ".", ".."):
            raise ValueError(f"{segment!r} cannot be a segment of an API path (in {segments!r})")
    return "/" + "/".join(urllib.parse.quote(segment, safe="") for segment in segments)


_ERROR_TEXT_LIMIT = 500
"""How much of an error body that is not a Kubernetes Status is kept in the ApiError."""


def _api_error(status: int, reason: str, text: str) -> ApiError:
    """The ApiError for an error response: from its Status when the body is one, else from its text."""
    try:
        payload = json.loads(text) if text else {}
    except ValueError:
        payload = None
    if isinstance(payload, dict):
        return ApiError(status, str(payload.get("reason") or reason), str(payload.get("message", "")))
    return ApiError(status, reason, _truncated(text))


def _truncated(text: str) -> str:
    return text[:_ERROR_TEXT_LIMIT] + ("…" if len(text) > _ERROR_TEXT_LIMIT else "")


class Kube:
    """A small async client. One instance per operator; cheap to create per test."""

    def __init__(self, info: kopf.ConnectionInfo):
        self.info = info
        headers = {"Accept": "application/json", "User-Agent": "memops"}
        if info.token:
            headers["Authorization"] = f"{info.scheme or 'Bearer'} {info.token}"
        auth = aiohttp.BasicAuth(info.username, info.password or "") if info.username else None
        self._session = aiohttp.ClientSession(
            base_url=info.server.rstrip("/") + "/",
            headers=headers,
            auth=auth,
            connector=aiohttp.TCPConnector(ssl=_ssl_context(info)),
            timeout=aiohttp.ClientTimeout(total=30),
        )

    async def close(self) -> None:
        await self._session.close()

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: Mapping[str, str] | None = None,
        content_type: str = "application/json",
    ) -> objects.Obj:
        kwargs: dict[str, Any] = {"params": dict(params or {})}
        if body is not None:
            kwargs["data"] = json.dumps(body)
            kwargs["headers"] = {"Content-Type": content_type}
        async with self._session.request(method, path.lstrip("/"), **kwargs) as response:
            # Read as text first: a proxy or a webhook may answer with HTML or plain text.
            text = await response.text(errors="replace") if response.content_length != 0 else ""
            if response.status >= 400:
                error = _api_error(response.status, response.reason or "", text)
                if response.status == 403:
                    # Name the missing permission and what grants it: this text reaches conditions.
                    explained = permissions.explain_forbidden(method, path, error.message)
                    error = ApiError(error.code, error.reason, explained)
                raise error
            try:
                payload = json.loads(text) if text else {}
            except ValueError:
                raise ApiError(response.status, "InvalidResponse", f"not JSON: {_truncated(text)}") from None
            return payload if isinstance(payload, dict) else {}

    async def get(self, path: str, **params: str) -> objects.Obj:
        return await self.request("GET", path, params=params)

    async def get_or_none(self, path: str) -> objects.Obj | None:
        try:
            return await self.get(path)
        except ApiError as exc:
            if exc.code == 404:
                return None
            raise

    async def list(
        self, path: str, *, label_selector: str | None = None, field_selector: str | None = None
    ) -> builtins.list[objects.Obj]:
        params = {"labelSelector": label_selector} if label_selector else {}
        if field_selector:
            params["fieldSelector"] = field_selector
        items: builtins.list[objects.Obj] = (await self.request("GET", path, params=params)).get("items", [])
        return items

    async def merge_patch(self, path: str, patch: objects.Obj) -> objects.Obj:
        return await self.request("PATCH", path, body=patch, content_type="application/merge-patch+json")

    async def json_patch(self, path: str, operations: builtins.list[objects.Obj]) -> objects.Obj:
        return await self.request("PATCH", path, body=operations, content_type="application/json-patch+json")

    async def delete(self, path: str, *, propagation_policy: str = "Background") -> objects.Obj:
        return await self.request(
            "DELETE", path, body={"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": propagation_policy}
        )
