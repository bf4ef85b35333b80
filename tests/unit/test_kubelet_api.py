"""memops' reads of a kubelet's own API (:mod:`memops.clients.kubelet_api`), against a real HTTPS
server in this process that answers as a kubelet does, with a serving certificate of a CA made
here (:mod:`memops_sandbox.certs`); the operator's credentials are a bearer token."""

from __future__ import annotations

import contextlib
import ipaddress
import ssl
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp.web
import kopf
import pytest
from memops_sandbox import certs

from memops.clients import kube, kubelet_api

TOKEN = "operator-token"
Handler = Callable[[aiohttp.web.Request], Any]


def node(port: int, *addresses: tuple[str, str]) -> dict[str, Any]:
    return {
        "metadata": {"name": "n1"},
        "status": {
            "addresses": [{"type": kind, "address": address} for kind, address in addresses],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": port}},
        },
    }


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, Path]:
    """The cluster's CA, a kubelet serving certificate it signs for 127.0.0.1, and one that
    another CA signs (a self-signed kubelet, as far as the cluster's CA can tell)."""
    cluster, other = certs.authority("cluster"), certs.authority("kubelet-self-signed")
    cluster.key_pair().write(tmp_path, "ca")
    loopback = (ipaddress.IPv4Address("127.0.0.1"),)
    certs.issue(cluster, "system:node:n1", ip_addresses=loopback, server=True).write(tmp_path, "kubelet")
    certs.issue(other, "n1", ip_addresses=loopback, server=True).write(tmp_path, "stranger")
    return {name: tmp_path / f"{name}.crt" for name in ("ca", "kubelet", "stranger")}


@pytest.fixture
def serve(pki: dict[str, Path]) -> Callable[..., Any]:
    """A kubelet on 127.0.0.1 that answers ``routes``; yields its Node and what it was asked."""

    def start(routes: dict[str, Handler], certificate: str = "kubelet") -> Any:
        @contextlib.asynccontextmanager
        async def running() -> AsyncIterator[tuple[dict[str, Any], list[tuple[str, str]]]]:
            asked: list[tuple[str, str]] = []

            @aiohttp.web.middleware
            async def record(request: aiohttp.web.Request, handler: Handler) -> Any:
                asked.append((request.path, request.headers.get("Authorization", "")))
                return await handler(request)

            app = aiohttp.web.Application(middlewares=[record])
            for path, handler in routes.items():
                app.router.add_get(path, handler)
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            cert = pki[certificate]
            context.load_cert_chain(cert, cert.with_suffix(".key"))
            runner = aiohttp.web.AppRunner(app)
            await runner.setup()
            site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context)
            await site.start()
            port = runner.addresses[0][1]
            try:
                yield node(port, ("Hostname", "n1"), ("InternalIP", "127.0.0.1")), asked
            finally:
                await runner.cleanup()

        return running()

    return start


def credentials(pki: dict[str, Path]) -> kube.Credentials:
    return kube.Credentials.fixed(
        kopf.ConnectionInfo(server="https://api.invalid", ca_path=str(pki["ca"]), token=TOKEN)
    )


async def summary(_: aiohttp.web.Request) -> aiohttp.web.Response:
    return aiohttp.web.json_response({"node": {"nodeName": "n1"}})


async def test_reads_the_kubelet_itself_with_the_operators_token_and_verifies_it(
    pki: dict[str, Path], serve: Callable[..., Any]
) -> None:
    async with serve({"/stats/summary": summary}) as (found, asked):
        async with kubelet_api.reading(credentials(pki)) as reader:
            answer = await reader.get(found, "/stats/summary")
    assert answer == {"node": {"nodeName": "n1"}}
    assert asked == [("/stats/summary", f"Bearer {TOKEN}")]


async def test_a_kubelet_whose_certificate_the_ca_did_not_sign_is_never_read(
    pki: dict[str, Path], serve: Callable[..., Any]
) -> None:
    async with serve({"/stats/summary": summary}, certificate="stranger") as (found, asked):
        async with kubelet_api.reading(credentials(pki)) as reader:
            with pytest.raises(kube.ApiError) as raised:
                await reader.get(found, "/stats/summary")
    assert raised.value.code == 503 and raised.value.reason == "KubeletUnreachable", raised.value
    assert "CERTIFICATE_VERIFY_FAILED" in raised.value.message or "certificate" in raised.value.message
    assert asked == [], "no request, and no token, went to a kubelet that was not verified"


async def test_the_kubelets_own_ca_file_verifies_it(
    pki: dict[str, Path], serve: Callable[..., Any], tmp_path: Path
) -> None:
    other = certs.authority("kubelets")
    other.key_pair().write(tmp_path, "kubelets-ca")
    loopback = (ipaddress.IPv4Address("127.0.0.1"),)
    certs.issue(other, "n1", ip_addresses=loopback, server=True).write(tmp_path, "own")
    pki["own"] = tmp_path / "own.crt"
    async with serve({"/configz": summary}, certificate="own") as (found, asked):
        async with kubelet_api.reading(credentials(pki), str(tmp_path / "kubelets-ca.crt")) as reader:
            assert await reader.get(found, "/configz") == {"node": {"nodeName": "n1"}}
    assert asked == [("/configz", f"Bearer {TOKEN}")]


async def test_a_kubelets_refusal_names_the_permission_and_the_chart_value(
    pki: dict[str, Path], serve: Callable[..., Any]
) -> None:
    async def refuse(_: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.Response(status=403, text="Forbidden (user=x, verb=get, resource=nodes, subresource=stats)")

    async with serve({"/stats/summary": refuse}) as (found, _):
        async with kubelet_api.reading(credentials(pki)) as reader:
            with pytest.raises(kube.ApiError) as raised:
                await reader.get(found, "/stats/summary")
    assert raised.value.code == 403
    assert "may not get nodes/stats" in raised.value.message and "rbac.kubeletStats=true" in raised.value.message


async def test_an_answer_past_the_bound_is_refused(
    pki: dict[str, Path], serve: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kubelet_api, "MAX_BYTES", 1024)

    async def large(_: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.json_response({"pods": ["x" * 100] * 100})

    async with serve({"/stats/summary": large}) as (found, _):
        async with kubelet_api.reading(credentials(pki)) as reader:
            with pytest.raises(kube.ApiError) as raised:
                await reader.get(found, "/stats/summary")
    assert raised.value.reason == "KubeletAnswerTooLarge"


@pytest.mark.parametrize(
    ("addresses", "port", "expected"),
    [
        pytest.param([("InternalIP", "10.0.0.5")], 10250, "https://10.0.0.5:10250", id="internal"),
        pytest.param(
            [("ExternalIP", "1.2.3.4"), ("InternalIP", "10.0.0.5")],
            10250,
            "https://10.0.0.5:10250",
            id="prefers-internal",
        ),
        pytest.param([("InternalIP", "fd00::5")], 10250, "https://[fd00::5]:10250", id="ipv6"),
        pytest.param(
            [("InternalIP", "10.0.0.5/evil?"), ("ExternalIP", "1.2.3.4")],
            1,
            "https://1.2.3.4:1",
            id="not-an-ip-skipped",
        ),
    ],
)
def test_the_endpoint_is_an_ip_and_a_port_from_the_nodes_status(
    addresses: list[tuple[str, str]], port: int, expected: str
) -> None:
    assert kubelet_api.endpoint(node(port, *addresses)) == expected


@pytest.mark.parametrize(
    ("addresses", "port"),
    [
        pytest.param([("Hostname", "evil.example")], 10250, id="a-name-only"),
        pytest.param([("InternalIP", "10.0.0.5")], 0, id="port-0"),
        pytest.param([("InternalIP", "10.0.0.5")], 70000, id="port-too-large"),
        pytest.param([("InternalIP", "10.0.0.5")], "10250/x", id="port-a-string"),
        pytest.param([("InternalIP", "10.0.0.5")], True, id="port-a-bool"),
    ],
)
def test_a_node_without_an_ip_or_a_port_is_refused(addresses: list[tuple[str, str]], port: Any) -> None:
    with pytest.raises(ValueError, match="node n1"):
        kubelet_api.endpoint(node(port, *addresses))
