"""A kubelet's own API, read directly: its summary statistics and its configuration.

Not through the API server's node proxy: ``get nodes/proxy`` reaches every kubelet endpoint that
a GET reaches, exec and attach in every pod included (the kubelet authorizes a WebSocket upgrade
as ``get``). memops asks each kubelet itself, at the address and port that its Node reports, with
the operator's own credentials. The kubelet authenticates them (a TokenReview, or its client CA)
and asks the API server about each path (a SubjectAccessReview): ``nodes/stats`` for ``/stats/``,
``nodes/configz`` for ``/configz`` (fine-grained kubelet authorization, GA in Kubernetes 1.36),
neither of which reaches a pod. The kubelet's serving certificate is verified, against
``memops run --kubelet-ca-file`` or else the API server's CA (which signs kubelets' serving
certificates where they bootstrap them: ``serverTLSBootstrap``).

What one answer may hold is bounded (:data:`MAX_BYTES`): a kubelet is the cluster's, but its
summary grows with the pods on its Node.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import json
import ssl
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import kopf

from memops.clients import kube
from memops.decisions import objects, permissions

MAX_BYTES = 32 * 2**20
"""The largest answer read from a kubelet (a summary of a Node with hundreds of pods is a few MiB)."""
REQUEST_SECONDS = 10.0
ADDRESS_TYPES = ("InternalIP", "ExternalIP")
"""The Node's addresses tried, in this order (as the API server's ``--kubelet-preferred-address-types``
puts InternalIP first); a name is not used: it would be resolved by the operator's DNS."""
PERMISSIONS = {"/stats/": "nodes/stats", "/configz": "nodes/configz"}
"""What the kubelet asks of the API server for each path (fine-grained kubelet authorization)."""


def endpoint(node: objects.Obj) -> str:
    """``https://<address>:<port>`` of ``node``'s kubelet, from its status (an IP address only, so
    that nothing a Node says can change the URL's form). ValueError when it says none."""
    metadata, status = node.get("metadata") or {}, node.get("status") or {}
    name = metadata.get("name", "?")
    port = ((status.get("daemonEndpoints") or {}).get("kubeletEndpoint") or {}).get("Port")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise ValueError(f"node {name}: status.daemonEndpoints.kubeletEndpoint.Port is not a port: {port!r}")
    addresses = {
        entry.get("type"): entry.get("address") for entry in status.get("addresses") or [] if isinstance(entry, dict)
    }
    for kind in ADDRESS_TYPES:
        address = addresses.get(kind)
        if not isinstance(address, str):
            continue
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            continue
        return f"https://[{ip}]:{port}" if ip.version == 6 else f"https://{ip}:{port}"
    raise ValueError(f"node {name}: no IP address of type {' or '.join(ADDRESS_TYPES)} in status.addresses")


def _permission(path: str) -> str:
    return next((permission for prefix, permission in PERMISSIONS.items() if path.startswith(prefix)), "nodes/proxy")


class Reader:
    """One pass' reads of kubelets: one HTTP session, closed when the pass is done."""

    def __init__(self, credentials: kube.Credentials, ca_file: str | None, session: aiohttp.ClientSession):
        self.credentials = credentials
        self.ca_file = ca_file
        self.session = session
        self._contexts: dict[tuple[Any, ...], ssl.SSLContext] = {}

    def _ssl(self, info: kopf.ConnectionInfo) -> ssl.SSLContext:
        """The API server's TLS settings (client certificate, insecure or not), with the kubelets'
        CA where one is given."""
        if self.ca_file:
            info = dataclasses.replace(info, ca_path=self.ca_file, ca_data=None)
        key = (info.ca_path, info.ca_data, info.insecure, info.certificate_path, info.certificate_data)
        context = self._contexts.get(key)
        if context is None:
            context = self._contexts[key] = info.as_ssl_context()
        return context

    async def get(self, node: objects.Obj, path: str) -> objects.Obj:
        """``path`` of ``node``'s kubelet, as JSON. Raises :class:`memops.clients.kube.ApiError`:
        the kubelet's own refusal (403 names the permission it asked for), or 503 when it cannot be
        reached, its certificate is not trusted, or its answer is not JSON or too large."""
        try:
            url = endpoint(node) + path
        except ValueError as exc:
            raise kube.ApiError(503, "KubeletUnreachable", str(exc)) from None
        return await kube.renewing(self.credentials, lambda info: self._send(info, url, path))

    async def _send(self, info: kopf.ConnectionInfo, url: str, path: str) -> objects.Obj:
        try:
            async with self.session.get(url, headers=info.as_http_headers(), ssl=self._ssl(info)) as response:
                body = await response.content.read(MAX_BYTES + 1)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise kube.ApiError(503, "KubeletUnreachable", f"kubelet at {url}: {type(exc).__name__}: {exc}") from None
        if len(body) > MAX_BYTES:
            raise kube.ApiError(503, "KubeletAnswerTooLarge", f"kubelet at {url}: more than {MAX_BYTES} bytes")
        if response.status == 403:
            said = body[:200].decode("utf-8", "replace")
            raise kube.ApiError(403, "Forbidden", permissions.explain_kubelet_forbidden(_permission(path), url, said))
        if response.status >= 400:
            text = body[:200].decode("utf-8", "replace")
            raise kube.ApiError(response.status, response.reason or "", f"kubelet at {url}: {text}")
        try:
            payload = json.loads(body)
        except ValueError:
            raise kube.ApiError(503, "InvalidResponse", f"kubelet at {url}: not JSON") from None
        return payload if isinstance(payload, dict) else {}


@contextlib.asynccontextmanager
async def reading(credentials: kube.Credentials, ca_file: str | None = None) -> AsyncIterator[Reader]:
    """A :class:`Reader` for one pass."""
    timeout = aiohttp.ClientTimeout(total=REQUEST_SECONDS)
    headers = {"Accept": "application/json", "User-Agent": "memops"}
    async with aiohttp.ClientSession(headers=headers, timeout=timeout) as session:
        yield Reader(credentials, ca_file, session)
