"""The admission webhooks' server: Kopf's, and who may call it.

An admission review is a claim about the API: "this pod is being evicted", "this pod is being
created". Only the API server should make one. Given a client CA (``memops run
--webhook-client-ca-file``), the server requires a client certificate that it signed: a caller
without one fails the TLS handshake, before any handler runs. Given client names too
(``--webhook-client-name``), the certificate must name one of them (its CN or a DNS SAN),
else the answer is 403: a CA that signs other clients as well (a cluster CA signs every
kubelet's) then still admits only the API server. Both make a call fail as a call, never as
an answer, so the webhooks' ``failurePolicy: Ignore`` holds for a misconfigured client CA: the
API server admits, as when the operator is down.

Called by :func:`memops.controllers.safetynet_webhook.configure`.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Collection, Mapping
from typing import Any

import aiohttp.web
import kopf


def peer_names(sslpeer: Mapping[str, Any] | None) -> set[str]:
    """The names of a verified client certificate (``ssl.SSLSocket.getpeercert()``): its
    subject's common names and its DNS subject alternative names."""
    if not sslpeer:
        return set()
    names = {str(value) for rdn in sslpeer.get("subject") or () for key, value in rdn if key == "commonName"}
    names.update(str(value) for kind, value in sslpeer.get("subjectAltName") or () if kind == "DNS")
    return names


def client_allowed(sslpeer: Mapping[str, Any] | None, names: Collection[str]) -> bool:
    """Whether a caller may be answered: any, when no names are pinned; else one whose verified
    certificate names one of ``names``."""
    return not names or bool(peer_names(sslpeer) & set(names))


class WebhookServer(kopf.WebhookServer):
    """Kopf's webhook server that answers only clients named in ``client_names`` (if any).

    Kopf hands each request's verified peer certificate to the function that it serves; the
    check wraps that function, so it covers every webhook (the safety net and the eviction
    gate) before a handler sees the review.
    """

    def __init__(self, *, client_names: Collection[str] = (), **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.client_names = frozenset(client_names)

    async def __call__(self, fn: kopf.WebhookFn) -> AsyncIterator[kopf.WebhookClientConfig]:
        names = self.client_names

        async def checked(
            request: Any,
            *,
            webhook: str | None = None,
            headers: kopf.Headers | None = None,
            sslpeer: kopf.SSLPeer | None = None,
        ) -> Any:
            if not client_allowed(sslpeer, names):
                # An HTTP error, not a denial: the API server applies the failurePolicy.
                raise aiohttp.web.HTTPForbidden(reason="the client certificate names no accepted client")
            # Kopf's review and response types are not exported; they pass through untouched.
            return await fn(request, webhook=webhook, headers=headers, sslpeer=sslpeer)

        async for config in super().__call__(checked):
            yield config


def server(
    *,
    port: int,
    host: str,
    insecure: bool,
    certfile: str | None,
    pkeyfile: str | None,
    client_ca: str | None,
    client_names: Collection[str],
) -> kopf.WebhookServer:
    """The server for ``memops run``'s webhook flags; with ``client_ca`` a client certificate
    signed by it is required (Kopf alone would only ask for one: ``CERT_OPTIONAL``)."""
    if client_names and not client_ca:
        raise ValueError("client names are checked on a verified client certificate: give the client CA too")
    if client_ca and insecure:
        raise ValueError("a client certificate needs TLS: not with plain HTTP")
    return WebhookServer(
        addr=host,
        port=port,
        host=host,
        insecure=insecure,
        certfile=certfile,
        pkeyfile=pkeyfile,
        verify_mode=ssl.CERT_REQUIRED if client_ca else None,
        verify_cafile=client_ca,
        client_names=client_names,
    )
