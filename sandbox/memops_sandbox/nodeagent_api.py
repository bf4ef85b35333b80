"""The node agent's one seam to the Kubernetes API: a kubeconfig read into an aiohttp session.

Used only by ``nodeagent``. It speaks the few verbs a kubelet uses (get, list, watch, create,
patch, delete) and nothing else; every call raises ``ApiError`` on a status other than 2xx so
that callers decide what a 404 or a 409 means.
"""

from __future__ import annotations

import base64
import json
import ssl
import tempfile
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

Obj = dict[str, Any]

STRATEGIC_MERGE = "application/strategic-merge-patch+json"
MERGE = "application/merge-patch+json"


class ApiError(Exception):
    def __init__(self, status: int, body: str):
        super().__init__(f"HTTP {status}: {body[:500]}")
        self.status = status
        self.body = body


class Gone(ApiError):
    """410: the resourceVersion a watch started from is compacted away; list again."""


TRANSIENT: tuple[type[BaseException], ...] = (ApiError, aiohttp.ClientError, OSError, TimeoutError, ValueError)
"""What a call may raise when the API server refuses, is unreachable or answers nonsense."""


@dataclass(frozen=True)
class Credentials:
    """Where the API server is and who we are to it, from one context of a kubeconfig."""

    server: str
    ssl_context: ssl.SSLContext | bool
    token: str | None
    user: str


def _data_or_file(entry: Mapping[str, Any], key: str, base: Path, scratch: Path) -> Path | None:
    """A kubeconfig names a PEM either inline (``<key>-data``, base64) or as a path."""
    if entry.get(f"{key}-data"):
        scratch.mkdir(parents=True, exist_ok=True, mode=0o700)
        with tempfile.NamedTemporaryFile(dir=scratch, suffix=".pem", delete=False) as file:
            file.write(base64.b64decode(entry[f"{key}-data"]))
        return Path(file.name)
    if entry.get(key):
        return base / str(entry[key])
    return None


def load_credentials(kubeconfig: Path, *, node: str, scratch: Path) -> Credentials:
    """The credentials the agent uses for ``node``.

    A kubeconfig may hold one context per node (named ``system:node:<node>`` or ``<node>``,
    with a client certificate for user ``system:node:<node>`` in group ``system:nodes``), so
    that the Node authorizer and the NodeRestriction admission plugin treat the agent as they
    treat a kubelet; otherwise the current context is used (an admin, typically).
    """
    config = yaml.safe_load(kubeconfig.read_text())
    contexts = {item["name"]: item["context"] for item in config.get("contexts") or []}
    name = next(
        (n for n in (f"system:node:{node}", node) if n in contexts),
        config.get("current-context"),
    )
    if name not in contexts:
        raise ValueError(f"{kubeconfig}: no context for node {node!r} and no current-context")
    context = contexts[name]
    cluster = next(c["cluster"] for c in config["clusters"] if c["name"] == context["cluster"])
    user: dict[str, Any] = next((u["user"] for u in config.get("users") or [] if u["name"] == context.get("user")), {})
    base = kubeconfig.parent
    ssl_context: ssl.SSLContext | bool = True
    if str(cluster["server"]).startswith("https"):
        if cluster.get("insecure-skip-tls-verify"):
            ssl_context = False
        else:
            ca = _data_or_file(cluster, "certificate-authority", base, scratch)
            ssl_context = ssl.create_default_context(cafile=str(ca) if ca else None)
        cert = _data_or_file(user, "client-certificate", base, scratch)
        key = _data_or_file(user, "client-key", base, scratch)
        if cert is not None and isinstance(ssl_context, ssl.SSLContext):
            ssl_context.load_cert_chain(str(cert), str(key) if key else None)
    return Credentials(
        server=str(cluster["server"]).rstrip("/"),
        ssl_context=ssl_context,
        token=user.get("token"),
        user=str(context.get("user", "")),
    )


class Api:
    """A session against one API server as one identity."""

    def __init__(self, credentials: Credentials):
        self.credentials = credentials
        headers = {"Authorization": f"Bearer {credentials.token}"} if credentials.token else {}
        self.session = aiohttp.ClientSession(
            base_url=credentials.server,
            headers={"Accept": "application/json", "User-Agent": "memops-nodeagent", **headers},
            connector=aiohttp.TCPConnector(ssl=credentials.ssl_context),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
        )

    async def close(self) -> None:
        await self.session.close()

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: Obj | None = None,
        params: Mapping[str, str] | None = None,
        content_type: str = "application/json",
        timeout: float = 30,
    ) -> Obj:
        data = json.dumps(body) if body is not None else None
        headers = {"Content-Type": content_type} if data is not None else {}
        async with self.session.request(
            method,
            path,
            data=data,
            params=dict(params or {}),
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as response:
            text = await response.text()
            if response.status == 410:
                raise Gone(response.status, text)
            if not 200 <= response.status < 300:
                raise ApiError(response.status, text)
            result: Obj = json.loads(text) if text else {}
            return result

    async def get(self, path: str, **params: str) -> Obj:
        return await self.request("GET", path, params=params)

    async def create(self, path: str, body: Obj) -> Obj:
        return await self.request("POST", path, body=body)

    async def patch(self, path: str, body: Obj, *, content_type: str = STRATEGIC_MERGE) -> Obj:
        return await self.request("PATCH", path, body=body, content_type=content_type)

    async def put(self, path: str, body: Obj) -> Obj:
        return await self.request("PUT", path, body=body)

    async def delete(self, path: str, body: Obj | None = None) -> Obj:
        return await self.request("DELETE", path, body=body)

    async def watch(self, path: str, **params: str) -> AsyncIterator[Obj]:
        """Yields watch events (``{"type", "object"}``) until the server ends the stream.

        An ``ERROR`` event whose status code is 410 raises ``Gone``, as an HTTP 410 does.
        """
        query = {**params, "watch": "true", "allowWatchBookmarks": "true"}
        # The server closes a watch after timeoutSeconds; a read that hangs longer is a dead link.
        timeout = aiohttp.ClientTimeout(total=None, sock_read=float(params.get("timeoutSeconds", "300")) + 30)
        async with self.session.get(path, params=query, timeout=timeout) as response:
            if response.status == 410:
                raise Gone(response.status, await response.text())
            if response.status != 200:
                raise ApiError(response.status, await response.text())
            async for line in response.content:
                if not line.strip():
                    continue
                event: Obj = json.loads(line)
                if event.get("type") == "ERROR":
                    status = event.get("object") or {}
                    if status.get("code") == 410:
                        raise Gone(410, json.dumps(status))
                    raise ApiError(int(status.get("code") or 500), json.dumps(status))
                yield event
