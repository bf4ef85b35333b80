"""Where memops' credentials come from and how they are renewed, against a small local server.

Inputs: ``kubernetes_asyncio``'s configuration loader (real, reading real kubeconfig files and
running a real exec plugin: a script written here), and an aiohttp server that accepts only the
bearer tokens that a test lets it accept, as an API server does after a token is revoked.
"""

from __future__ import annotations

import base64
import datetime
import json
import os
import stat
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp.test_utils
import kopf
import pytest
import yaml
from aiohttp import web

from memops.clients import kube

UTC = datetime.UTC
NOW = datetime.datetime(2026, 11, 26, 9, 0, tzinfo=UTC)


def jwt(**claims: Any) -> str:
    def part(value: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(value).encode()).decode().rstrip("=")

    return f"{part({'alg': 'RS256'})}.{part(claims)}.c2lnbmF0dXJl"


# -- the pure decisions ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "environ", "files", "expected"),
    [
        pytest.param(("/k", None), {"KUBECONFIG": "/e"}, {"sa/token", "home/.kube/config"}, "/k", id="flag-wins"),
        pytest.param((None, None), {"KUBECONFIG": "/a:/b"}, {"sa/token"}, "/a:/b", id="env-before-pod"),
        pytest.param(
            (None, None), {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, {"sa/token", "home/.kube/config"}, None, id="pod"
        ),
        pytest.param((None, None), {}, {"sa/token", "home/.kube/config"}, "home", id="no-service-host-no-pod"),
        pytest.param((None, None), {"KUBERNETES_SERVICE_HOST": "h"}, {"home/.kube/config"}, "home", id="no-token"),
    ],
)
def test_choose_source(
    tmp_path: Path, args: tuple[str | None, str | None], environ: dict[str, str], files: set[str], expected: str | None
) -> None:
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    source = kube.choose_source(*args, environ=environ, service_account=tmp_path / "sa", home=tmp_path / "home")
    if expected == "home":
        assert source.kubeconfig == str(tmp_path / "home" / ".kube" / "config")
    else:
        assert source.kubeconfig == expected
    assert source.service_account == (tmp_path / "sa" if expected is None else kube.SERVICE_ACCOUNT)


def test_choose_source_without_any_says_where_it_looked(tmp_path: Path) -> None:
    with pytest.raises(kopf.LoginError, match=r"no kubeconfig.*no in-cluster service account"):
        kube.choose_source(None, None, environ={}, service_account=tmp_path / "sa", home=tmp_path)


@pytest.mark.parametrize(
    ("token", "expected"),
    [
        pytest.param(jwt(exp=1_800_000_000), datetime.datetime.fromtimestamp(1_800_000_000, UTC), id="jwt"),
        pytest.param(jwt(sub="x"), None, id="jwt-without-exp"),
        pytest.param("abcdef", None, id="opaque"),
        pytest.param("a.b!.c", None, id="not-base64"),
        pytest.param("a.e30.c", None, id="empty-claims"),
        pytest.param(None, None, id="none"),
    ],
)
def test_token_expiry(token: str | None, expected: datetime.datetime | None) -> None:
    assert kube.token_expiry(token) == expected


@pytest.mark.parametrize(
    ("expiries", "expected"),
    [
        pytest.param((), None, id="unknown"),
        pytest.param((None, None), None, id="none-known"),
        pytest.param((NOW + datetime.timedelta(hours=1),), NOW + datetime.timedelta(minutes=59), id="margin"),
        pytest.param(
            (NOW + datetime.timedelta(hours=2), NOW + datetime.timedelta(minutes=30)),
            NOW + datetime.timedelta(minutes=29),
            id="the-first",
        ),
        pytest.param((NOW + datetime.timedelta(seconds=40),), NOW + kube.MIN_VALIDITY, id="never-sooner-than"),
        pytest.param((NOW - datetime.timedelta(hours=1),), NOW + kube.MIN_VALIDITY, id="expired-already"),
    ],
)
def test_renewal_time(expiries: tuple[datetime.datetime | None, ...], expected: datetime.datetime | None) -> None:
    assert kube.renewal_time(NOW, *expiries) == expected


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        pytest.param("Bearer abc", ("Bearer", "abc"), id="bearer"),
        pytest.param("Basic dTpw", ("Basic", "dTpw"), id="basic"),
        pytest.param("abc", (None, "abc"), id="bare"),
        pytest.param(None, (None, None), id="none"),
    ],
)
def test_split_authorization(header: str | None, expected: tuple[str | None, str | None]) -> None:
    assert kube.split_authorization(header) == expected


# -- renewal --------------------------------------------------------------------------------------


class Issuer:
    """Loads that hand out token-1, token-2, ...; counts them."""

    def __init__(self, reload_after: datetime.timedelta | None = None) -> None:
        self.loads = 0
        self.reload_after = reload_after

    async def __call__(self) -> kube.Loaded:
        self.loads += 1
        info = kopf.ConnectionInfo(server="http://127.0.0.1:1", scheme="Bearer", token=f"token-{self.loads}")
        due = None if self.reload_after is None else datetime.datetime.now(UTC) + self.reload_after
        return kube.Loaded(info, due)


async def test_credentials_are_loaded_once_until_due_or_renewed() -> None:
    issuer = Issuer()
    credentials = kube.Credentials(issuer)
    first = await credentials.get()
    assert await credentials.get() is first and issuer.loads == 1
    renewed = await credentials.renew(first)
    assert renewed.token == "token-2"
    # A second request that failed with the first token finds the new one in hand: no third load.
    assert await credentials.renew(first) is renewed and issuer.loads == 2


async def test_credentials_past_their_reload_time_are_loaded_again() -> None:
    issuer = Issuer(reload_after=datetime.timedelta(0))
    credentials = kube.Credentials(issuer)
    assert (await credentials.get()).token == "token-1"
    assert (await credentials.get()).token == "token-2"


async def test_a_failed_reload_keeps_the_credentials_in_hand() -> None:
    issuer = Issuer(reload_after=datetime.timedelta(0))

    async def flaky() -> kube.Loaded:
        if issuer.loads:
            raise kopf.LoginError("token file is being rewritten")
        return await issuer()

    credentials = kube.Credentials(flaky)
    first = await credentials.get()
    assert await credentials.get() is first
    with pytest.raises(kopf.LoginError):
        await credentials.renew(first)


async def test_kopf_gets_memops_newer_credentials_or_fresh_ones() -> None:
    issuer = Issuer()
    credentials = kube.Credentials(issuer)
    first = await credentials.login()
    assert first.token == "token-1"
    # Kopf logs in again (a 401 on token-1): fresh ones.
    assert (await credentials.login()).token == "token-2"
    # memops' client renewed meanwhile: Kopf gets those, with no load of its own.
    third = await credentials.renew(await credentials.get())
    assert await credentials.login() is third and issuer.loads == 3


# -- against a server -----------------------------------------------------------------------------


class Server:
    """Accepts the bearer tokens in ``accepted``; records the Authorization of every request."""

    def __init__(self) -> None:
        self.accepted: set[str] = set()
        self.seen: list[str] = []

    async def handle(self, request: web.Request) -> web.Response:
        header = request.headers.get("Authorization", "")
        self.seen.append(header)
        if header.removeprefix("Bearer ") not in self.accepted:
            status = {"kind": "Status", "reason": "Unauthorized", "message": "Unauthorized"}
            return web.json_response(status, status=401)
        body = await request.text()
        return web.json_response({"method": request.method, "body": json.loads(body) if body else None})


@pytest.fixture
async def server() -> AsyncIterator[tuple[Server, str]]:
    state = Server()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", state.handle)
    async with aiohttp.test_utils.TestServer(app) as test_server:
        yield state, str(test_server.make_url("")).rstrip("/")


async def test_a_request_refused_with_a_revoked_token_is_sent_again_with_the_renewed_one(
    server: tuple[Server, str], tmp_path: Path
) -> None:
    state, url = server
    token_file = tmp_path / "token"
    token_file.write_text("old")
    kubeconfig = write_kubeconfig(tmp_path / "config", url, {"tokenFile": str(token_file)})
    client = kube.Kube(kube.load_connection(str(kubeconfig)))
    try:
        state.accepted = {"old"}
        assert (await client.get("/api/v1/pods"))["method"] == "GET"
        # Rotated and revoked: a fresh token where the old one was, the old one refused.
        token_file.write_text("new")
        state.accepted = {"new"}
        patched = await client.merge_patch("/api/v1/namespaces/d/pods/p", {"metadata": {"labels": {"a": "b"}}})
        assert patched == {"method": "PATCH", "body": {"metadata": {"labels": {"a": "b"}}}}
        assert state.seen == ["Bearer old", "Bearer old", "Bearer new"]
        # Revoked with nothing new to read: the 401 stands, as an ApiError.
        state.accepted = set()
        with pytest.raises(kube.ApiError) as refused:
            await client.get("/api/v1/pods")
        assert refused.value.code == 401
    finally:
        await client.close()


def write_kubeconfig(path: Path, server: str, user: dict[str, Any], namespace: str = "team") -> Path:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": server}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "ctx", "context": {"cluster": "c", "user": "u", "namespace": namespace}}],
        "current-context": "ctx",
    }
    path.write_text(yaml.safe_dump(config))
    return path


def exec_plugin(directory: Path, *, expires_in: datetime.timedelta | None) -> Path:
    """An exec credential plugin, as ``aws eks get-token`` is one: it prints an ExecCredential with
    the token in ``DIR/issued-token`` and counts its runs in ``DIR/runs``."""
    script = directory / "credential-plugin"
    expiry = "" if expires_in is None else f"status['expirationTimestamp'] = {expires_in.total_seconds()!r}"
    script.write_text(
        f"""#!{sys.executable}
import datetime, json, os, pathlib
here = pathlib.Path({str(directory)!r})
info = json.loads(os.environ["KUBERNETES_EXEC_INFO"])
assert info["kind"] == "ExecCredential" and info["apiVersion"] == "client.authentication.k8s.io/v1", info
with (here / "runs").open("a") as runs:
    runs.write("run\\n")
status = {{"token": (here / "issued-token").read_text().strip()}}
{expiry}
if "expirationTimestamp" in status:
    at = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=status["expirationTimestamp"])
    status["expirationTimestamp"] = at.strftime("%Y-%m-%dT%H:%M:%SZ")
print(json.dumps({{"apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential", "status": status}}))
"""
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def exec_user(script: Path) -> dict[str, Any]:
    return {
        "exec": {
            "apiVersion": "client.authentication.k8s.io/v1",
            "command": str(script),
            "interactiveMode": "Never",
        }
    }


def runs(directory: Path) -> int:
    path = directory / "runs"
    return len(path.read_text().splitlines()) if path.exists() else 0


async def test_an_exec_plugin_kubeconfig_serves_memops_and_kopf(server: tuple[Server, str], tmp_path: Path) -> None:
    state, url = server
    plugin = exec_plugin(tmp_path, expires_in=datetime.timedelta(hours=1))
    (tmp_path / "issued-token").write_text("from-plugin")
    state.accepted = {"from-plugin"}
    credentials = kube.load_connection(str(write_kubeconfig(tmp_path / "config", url, exec_user(plugin))))
    client = kube.Kube(credentials)
    try:
        info = await credentials.login()  # what Kopf's login handler returns
        assert (info.scheme, info.token, info.default_namespace) == ("Bearer", "from-plugin", "team")
        assert info.expiration is not None
        remaining = info.expiration - datetime.datetime.now(UTC)
        assert datetime.timedelta(minutes=55) < remaining <= datetime.timedelta(minutes=59), remaining
        assert (await client.get("/api/v1/pods"))["method"] == "GET"
        assert runs(tmp_path) == 1, "one run serves Kopf and memops until the credential expires or fails"
        # The plugin's credential is refused (revoked): it runs again, and the request goes through.
        (tmp_path / "issued-token").write_text("reissued")
        state.accepted = {"reissued"}
        assert (await client.get("/api/v1/pods"))["method"] == "GET"
        assert runs(tmp_path) == 2
        assert (await credentials.login()).token == "reissued"
        assert runs(tmp_path) == 2, "Kopf gets what memops renewed"
    finally:
        await client.close()


async def test_a_failing_exec_plugin_is_a_login_error(tmp_path: Path) -> None:
    script = tmp_path / "failing-plugin"
    script.write_text("#!/bin/sh\necho 'not logged in: run aws sso login' >&2\nexit 1\n")
    script.chmod(0o755)
    kubeconfig = write_kubeconfig(tmp_path / "config", "https://127.0.0.1:1", exec_user(script))
    credentials = kube.load_connection(str(kubeconfig))
    with pytest.raises(kopf.LoginError, match="run aws sso login"):
        await credentials.login()


async def test_in_cluster_the_token_file_is_read_again_every_minute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "token").write_text(jwt(exp=int(datetime.datetime.now(UTC).timestamp()) + 3600))
    (account / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    (account / "namespace").write_text("memops-system")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    loaded = await kube.load(kube.Source(None, service_account=account))
    info = loaded.info
    assert info.server == "https://10.96.0.1:443"
    assert (info.ca_path, info.default_namespace) == (str(account / "ca.crt"), "memops-system")
    assert info.token == (account / "token").read_text()
    assert info.expiration is not None and loaded.reload_at is not None
    # Kopf logs in again near the token's own expiry; memops reads the file again every minute.
    assert info.expiration - loaded.reload_at > datetime.timedelta(minutes=50)
    assert loaded.reload_at - datetime.datetime.now(UTC) <= kube.TOKEN_FILE_PERIOD
    os.unlink(account / "token")
    with pytest.raises(kopf.LoginError, match="service account"):
        await kube.load(kube.Source(None, service_account=account))


async def test_an_oidc_kubeconfig_refreshes_its_expired_id_token(tmp_path: Path) -> None:
    """kubectl's ``oidc`` auth-provider: an ID token past its ``exp`` is refreshed at the issuer's
    token endpoint (found through its discovery document), then sent, and written back."""
    now = int(datetime.datetime.now(UTC).timestamp())
    expired, fresh = jwt(sub="alice", exp=now - 60), jwt(sub="alice", exp=now + 3600)
    state = Server()
    state.accepted = {fresh}
    refreshes: list[dict[str, str]] = []

    async def discovery(request: web.Request) -> web.Response:
        return web.json_response({"token_endpoint": str(request.url.with_path("/idp/token"))})

    async def token(request: web.Request) -> web.Response:
        refreshes.append(dict(await request.post()))
        return web.json_response({"id_token": fresh, "refresh_token": "refresh-2"})

    app = web.Application()
    app.router.add_get("/idp/.well-known/openid-configuration", discovery)
    app.router.add_post("/idp/token", token)
    app.router.add_route("*", "/{tail:.*}", state.handle)
    async with aiohttp.test_utils.TestServer(app) as test_server:
        url = str(test_server.make_url("")).rstrip("/")
        provider = {
            "name": "oidc",
            "config": {
                "client-id": "memops",
                "client-secret": "s3cret",
                "idp-issuer-url": f"{url}/idp",
                "id-token": expired,
                "refresh-token": "refresh-1",
            },
        }
        kubeconfig = write_kubeconfig(tmp_path / "config", url, {"auth-provider": provider})
        credentials = kube.load_connection(str(kubeconfig))
        client = kube.Kube(credentials)
        try:
            assert (await client.get("/api/v1/pods"))["method"] == "GET"
        finally:
            await client.close()
    assert refreshes == [{"grant_type": "refresh_token", "refresh_token": "refresh-1"}]
    assert state.seen == [f"Bearer {fresh}"]
    info = await credentials.get()
    assert info.expiration == datetime.datetime.fromtimestamp(now + 3600, UTC) - kube.EXPIRY_MARGIN
    written = yaml.safe_load(kubeconfig.read_text())["users"][0]["user"]["auth-provider"]["config"]
    assert (written["id-token"], written["refresh-token"]) == (fresh, "refresh-2")
