"""Credentials against the upstream API server: a pod's rotated and revoked token, and the
sandbox's node agent logging in through an exec plugin.

Inputs: ``memops-sandbox plane`` (etcd and kube-apiserver, one for the module), its admin
kubeconfig, tokens from the TokenRequest API bound to Secrets, and exec plugins written here.
The in-cluster case runs memops' loader on a service account directory made here (the kubelet's
files: ``token``, ``ca.crt``, ``namespace``) with ``KUBERNETES_SERVICE_HOST`` and ``_PORT``
pointing at the plane, as a pod's environment points at its cluster.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import json
import stat
import sys
import urllib.parse
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kopf
import pytest
import yaml
from memops_sandbox import install, nodeagent_api

from memops.clients import kube

CREDENTIAL_ID = "authentication.kubernetes.io/credential-id"


@pytest.fixture
async def admin(plane: Path) -> AsyncIterator[kube.Kube]:
    client = kube.Kube(kube.load_connection(str(plane / "kubeconfig")))
    try:
        yield client
    finally:
        await client.close()


async def bound_token(admin: kube.Kube, secret: str) -> str:
    """A token of ServiceAccount default/default, bound to Secret default/``secret`` (made here)."""
    secrets = kube.resource_path("", "v1", "secrets", "default")
    created = await admin.request("POST", secrets, body={"metadata": {"name": secret}})
    ref = {"apiVersion": "v1", "kind": "Secret", "name": secret, "uid": created["metadata"]["uid"]}
    path = kube.resource_path("", "v1", "serviceaccounts", "default", "default", "token")
    issued = await admin.request("POST", path, body={"spec": {"expirationSeconds": 3600, "boundObjectRef": ref}})
    return str(issued["status"]["token"])


def jti(token: str) -> str:
    claims = token.split(".")[1]
    return str(json.loads(base64.urlsafe_b64decode(claims + "=" * (-len(claims) % 4)))["jti"])


async def credential_id(client: kube.Kube) -> str:
    """The token the API server saw, as it says in a SelfSubjectReview (allowed to everyone)."""
    path = kube.resource_path("authentication.k8s.io", "v1", "selfsubjectreviews")
    review = await client.request("POST", path, body={"apiVersion": "authentication.k8s.io/v1"})
    (found,) = review["status"]["userInfo"]["extra"][CREDENTIAL_ID]
    return str(found)


async def in_a_pod(plane: Path, admin: kube.Kube, directory: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A service account directory as the kubelet mounts it (``token`` to be written), and the
    environment of a pod of the plane's cluster."""
    server = urllib.parse.urlsplit((await admin.credentials.get()).server)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", str(server.hostname))
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(server.port))
    account = directory / "serviceaccount"
    account.mkdir()
    (account / "ca.crt").write_bytes((plane / "pki" / "ca.crt").read_bytes())
    (account / "namespace").write_text("default")
    return account


async def test_in_a_pod_a_rotated_token_is_read_again_before_any_request_is_refused(
    plane: Path, admin: kube.Kube, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kubelet writes a new token while the old one is still good: memops reads the file again
    (every minute; at once here) and sends the new one, with no 401 needed to notice."""
    monkeypatch.setattr(kube, "TOKEN_FILE_PERIOD", datetime.timedelta(0))
    account = await in_a_pod(plane, admin, tmp_path, monkeypatch)
    old = await bound_token(admin, "rotating-1")
    install.write_token(account / "token", old)
    client = kube.Kube(kube.Credentials(lambda: kube.load(kube.Source(None, service_account=account))))
    renewals = 0
    renew = client.credentials.renew

    async def counted(failed: kopf.ConnectionInfo | None) -> kopf.ConnectionInfo:
        nonlocal renewals
        renewals += 1
        return await renew(failed)

    monkeypatch.setattr(client.credentials, "renew", counted)
    try:
        assert await credential_id(client) == f"JTI={jti(old)}"
        new = await bound_token(admin, "rotating-2")
        install.write_token(account / "token", new)
        assert await credential_id(client) == f"JTI={jti(new)}"
        assert renewals == 0, "read again when due, not after a 401"
    finally:
        await client.close()


async def test_in_a_pod_a_rotated_and_revoked_token_is_read_again_without_a_failed_request(
    plane: Path, admin: kube.Kube, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    account = await in_a_pod(plane, admin, tmp_path, monkeypatch)
    url = (await admin.credentials.get()).server
    old = await bound_token(admin, "pod-token-1")
    install.write_token(account / "token", old)
    client = kube.Kube(kube.Credentials(lambda: kube.load(kube.Source(None, service_account=account))))
    try:
        assert await credential_id(client) == f"JTI={jti(old)}"
        # The kubelet's rotation: the new token where the old one was; then the old one revoked.
        new = await bound_token(admin, "pod-token-2")
        install.write_token(account / "token", new)
        await admin.delete(kube.resource_path("", "v1", "secrets", "default", "pod-token-1"))
        revoked = kube.Kube(kopf.ConnectionInfo(server=url, ca_path=str(account / "ca.crt"), token=old))
        try:
            await poll_refused(revoked)
        finally:
            await revoked.close()
        # Within the minute in which the file is not read again of itself: the 401 makes it.
        assert await credential_id(client) == f"JTI={jti(new)}"
        assert (await client.credentials.get()).token == new
    finally:
        await client.close()


async def poll_refused(client: kube.Kube, timeout: float = 60) -> None:
    """Until the API server refuses ``client``'s token (its authenticator caches a token's
    success for a few seconds)."""
    async with asyncio.timeout(timeout):
        while True:
            try:
                await credential_id(client)
            except kube.ApiError as error:
                if error.code == 401:
                    return
                raise
            await asyncio.sleep(0.5)


def certificate_plugin(directory: Path, cert: Path, key: Path) -> Path:
    """An exec plugin that hands out a client certificate (as some do, instead of a token)."""
    script = directory / "certificate-plugin"
    status = {"clientCertificateData": cert.read_text(), "clientKeyData": key.read_text()}
    credential = {"apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential", "status": status}
    script.write_text(
        f"#!{sys.executable}\nimport pathlib\n"
        f"with pathlib.Path({str(directory / 'runs')!r}).open('a') as runs:\n    runs.write('run\\n')\n"
        f"print({json.dumps(json.dumps(credential))})\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


async def test_the_node_agent_logs_in_through_an_exec_plugin(plane: Path, tmp_path: Path) -> None:
    plugin = certificate_plugin(tmp_path, plane / "pki" / "admin.crt", plane / "pki" / "admin.key")
    config: dict[str, Any] = yaml.safe_load((plane / "kubeconfig").read_text())
    (user,) = config["users"]
    user["user"] = {"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": str(plugin)}}
    kubeconfig = tmp_path / "exec.kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(config))
    scratch = tmp_path / "scratch"
    api = nodeagent_api.Api(nodeagent_api.load_credentials(kubeconfig, node="node-0", scratch=scratch))
    try:
        nodes = await api.get("/api/v1/nodes")
        assert nodes["kind"] == "NodeList"
        namespaces = await api.get("/api/v1/namespaces")
        assert "default" in {item["metadata"]["name"] for item in namespaces["items"]}
    finally:
        await api.close()
    assert (tmp_path / "runs").read_text().splitlines() == ["run"]
    assert list(scratch.iterdir()), "the plugin's certificate and key went to the agent's scratch directory"
