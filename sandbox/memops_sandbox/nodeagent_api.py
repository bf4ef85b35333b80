"""The node agent's one seam to the Kubernetes API: a kubeconfig's context, as an aiohttp session.

Used only by ``nodeagent``. It speaks the few verbs a kubelet uses (get, list, watch, create,
patch, delete) and nothing else; every call raises ``ApiError`` on a status other than 2xx so
that callers decide what a 404 or a 409 means. The kubeconfig is read as kubectl reads it, by
:func:`memops.clients.kube.load` (client certificates, tokens and token files, exec plugins).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes_asyncio.config import kube_config

from memops.clients import kube

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
    """Which context of which kubeconfig the agent uses for a node; ``scratch`` takes the PEM files
    of certificates that the kubeconfig (or its exec plugin) gives inline."""

    kubeconfig: Path
    context: str
    user: str
    scratch: Path


def load_credentials(kubeconfig: Path, *, node: str, scratch: Path) -> Credentials:
    """The credentials the agent uses for ``node``.

    A kubeconfig may hold one context per node (named ``system:node:<node>`` or ``<node>``,
    with a client certificate for user ``system:node:<node>`` in group ``system:nodes``), so
    that the Node authorizer and the NodeRestriction admission plugin treat the agent as they
    treat a kubelet; otherwise the current context is used (an admin, typically).
    """
    listed, current = kube_config.list_kube_config_contexts(str(kubeconfig))
    contexts = {str(item["name"]): item.get("context") or {} for item in listed}
    name = next((n for n in (f"system:node:{node}", node) if n in contexts), (current or {}).get("name"))
    if name not in contexts:
        raise ValueError(f"{kubeconfig}: no context for node {node!r} and no current-context")
    return Credentials(kubeconfig, name, str(contexts[name].get("user", "")), scratch)


class Api:
    """A session against one API server as one identity, made at the first request."""

    def __init__(self, credentials: Credentials):
        self.credentials = credentials
        self._session: aiohttp.ClientSession | None = None
        self._lock = asyncio.Lock()

    async def session(self) -> aiohttp.ClientSession:
        async with self._lock:
            if self._session is None:
                source = kube.Source(
                    str(self.credentials.kubeconfig), self.credentials.context, scratch=self.credentials.scratch
                )
                info = (await kube.load(source)).info
                self._session = aiohttp.ClientSession(
                    base_url=info.server,
                    headers={"Accept": "application/json", "User-Agent": "memops-nodeagent", **info.as_http_headers()},
                    connector=aiohttp.TCPConnector(ssl=info.as_ssl_context()),
                    timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
                )
            return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

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
        async with (await self.session()).request(
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
        session = await self.session()
        async with session.get(path, params=query, timeout=timeout) as response:
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
