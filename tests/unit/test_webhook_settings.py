"""``memops run``'s webhook flags become Kopf's admission settings."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import aiohttp
import kopf
import pytest
from memops_sandbox import certs

from memops import cli
from memops.controllers import safetynet_webhook, webhook_server


def test_certificate_files_and_an_unmanaged_configuration() -> None:
    settings = kopf.OperatorSettings()
    safetynet_webhook.configure(
        settings, port=9443, host="0.0.0.0", insecure=False, certfile="/c/tls.crt", pkeyfile="/c/tls.key", managed=False
    )
    server = settings.admission.server
    assert isinstance(server, kopf.WebhookServer)
    assert (server.certfile, server.pkeyfile, server.port, server.addr) == ("/c/tls.crt", "/c/tls.key", 9443, "0.0.0.0")
    assert settings.admission.managed is None, "Kopf must not write a MutatingWebhookConfiguration"


def test_kopf_manages_the_configuration_by_default() -> None:
    settings = kopf.OperatorSettings()
    safetynet_webhook.configure(settings, port=9443, host="127.0.0.1", insecure=True)
    assert settings.admission.managed == safetynet_webhook.CONFIGURATION
    assert settings.admission.server.certfile is None


def test_certificate_without_key_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["run", "--webhook-port", "9443", "--webhook-cert-file", "/c/tls.crt"]) == 2
    assert "--webhook-key-file" in capsys.readouterr().err


def test_a_client_ca_makes_the_client_certificate_required() -> None:
    """Kopf alone, given a CA to verify clients with, only asks for a certificate (CERT_OPTIONAL):
    a caller without one would still be answered."""
    settings = kopf.OperatorSettings()
    safetynet_webhook.configure(
        settings,
        port=9443,
        host="0.0.0.0",
        insecure=False,
        certfile="/c/tls.crt",
        pkeyfile="/c/tls.key",
        client_ca="/ca/client-ca.crt",
        client_names=("kube-apiserver-webhook",),
    )
    server = settings.admission.server
    assert isinstance(server, webhook_server.WebhookServer)
    assert (server.verify_mode, server.verify_cafile) == (ssl.CERT_REQUIRED, "/ca/client-ca.crt")
    assert server.client_names == {"kube-apiserver-webhook"}


@pytest.mark.parametrize(
    "argv, error",
    [
        pytest.param(["--webhook-client-name", "apiserver"], "--webhook-client-ca-file", id="name-without-ca"),
        pytest.param(["--webhook-client-ca-file", "/ca.crt", "--webhook-insecure"], "needs TLS", id="ca-on-http"),
    ],
)
def test_client_verification_flags_that_cannot_work_are_refused(
    argv: list[str], error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["run", "--webhook-port", "9443", *argv]) == 2
    assert error in capsys.readouterr().err


PEER = {
    "subject": ((("organizationName", "system:masters"),), (("commonName", "kube-apiserver-webhook"),)),
    "subjectAltName": (("DNS", "apiserver.example"), ("IP Address", "10.0.0.1")),
}


@pytest.mark.parametrize(
    "sslpeer, names, allowed",
    [
        pytest.param(PEER, (), True, id="nothing-pinned"),
        pytest.param(None, (), True, id="nothing-pinned-no-certificate"),
        pytest.param(PEER, ("kube-apiserver-webhook",), True, id="by-common-name"),
        pytest.param(PEER, ("apiserver.example",), True, id="by-dns-name"),
        pytest.param(PEER, ("system:masters",), False, id="an-organization-is-not-a-name"),
        pytest.param(PEER, ("10.0.0.1",), False, id="an-ip-san-is-not-a-name"),
        pytest.param(PEER, ("system:node:n1",), False, id="another-client"),
        pytest.param({}, ("kube-apiserver-webhook",), False, id="no-certificate"),
        pytest.param(None, ("kube-apiserver-webhook",), False, id="no-peer"),
    ],
)
def test_a_pinned_client_is_told_by_its_certificates_names(
    sslpeer: dict[str, Any] | None, names: tuple[str, ...], allowed: bool
) -> None:
    assert webhook_server.client_allowed(sslpeer, names) is allowed


async def test_only_the_named_holder_of_a_client_certificate_is_answered(tmp_path: Path) -> None:
    """A real server on loopback: no certificate, or one of another CA, fails the TLS handshake;
    one of the client CA with another name gets 403; the API server's is answered."""
    serving_ca, client_ca, cluster_ca = (certs.authority(name) for name in ("serving", "webhook-clients", "cluster"))
    cert, key = certs.issue(serving_ca, "127.0.0.1", ip_addresses=(certs.LOOPBACK,), server=True).write(tmp_path, "tls")
    (tmp_path / "client-ca.crt").write_bytes(client_ca.pem)
    answered: list[Any] = []

    async def handler(request: Any, *, webhook: Any = None, headers: Any = None, sslpeer: Any = None) -> Any:
        answered.append(sslpeer)
        return {"response": {"uid": request["request"]["uid"], "allowed": True}}

    server = webhook_server.server(
        port=0,
        host="127.0.0.1",
        insecure=False,
        certfile=str(cert),
        pkeyfile=str(key),
        client_ca=str(tmp_path / "client-ca.crt"),
        client_names=("kube-apiserver-webhook",),
    )
    serving = server(handler)
    url = (await serving.__anext__())["url"] + "/eviction-gate"
    review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {"uid": "1"}}

    async def post(client: tuple[certs.Authority, str] | None) -> int:
        context = ssl.create_default_context(cadata=serving_ca.pem.decode())
        if client is not None:
            pair = certs.issue(client[0], client[1], client=True).write(tmp_path, f"client-{len(answered)}")
            context.load_cert_chain(*pair)
        async with aiohttp.ClientSession() as session, session.post(url, json=review, ssl=context) as response:
            return response.status

    try:
        for refused in (None, (cluster_ca, "kube-apiserver-webhook")):
            with pytest.raises((aiohttp.ClientError, ssl.SSLError, OSError)):
                await post(refused)
        assert await post((client_ca, "system:node:n1")) == 403
        assert answered == [], "no handler saw a review of a caller other than the API server"
        assert await post((client_ca, "kube-apiserver-webhook")) == 200
        assert webhook_server.peer_names(answered[0]) == {"kube-apiserver-webhook"}
    finally:
        await serving.aclose()
