"""The emulated API server's audit log: RBAC verbs derived as the API server derives them."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import kmock
import pytest

from memops.cluster import apiserver, audit


@pytest.mark.parametrize(
    ("method", "named", "watch", "verb"),
    [
        pytest.param("GET", True, False, "get", id="get"),
        pytest.param("GET", False, False, "list", id="list"),
        pytest.param("GET", False, True, "watch", id="watch"),
        pytest.param("POST", False, False, "create", id="create"),
        pytest.param("PUT", True, False, "update", id="update"),
        pytest.param("PATCH", True, False, "patch", id="patch"),
        pytest.param("DELETE", True, False, "delete", id="delete"),
        pytest.param("DELETE", False, False, "deletecollection", id="deletecollection"),
    ],
)
def test_rbac_verbs(method: str, named: bool, watch: bool, verb: str) -> None:
    assert audit.rbac_verb(method, named=named, watch=watch) == verb


async def test_the_server_records_each_resource_request(tmp_path: Path) -> None:
    log = tmp_path / "audit.jsonl"
    api = apiserver.ApiServer(audit_log=log)
    async with api, kmock.Server(api) as server:
        headers = {"Authorization": "Bearer memops-operator", "User-Agent": "memops"}
        async with aiohttp.ClientSession(str(server.url), headers=headers) as session:
            async with session.get("/apis/apps/v1/namespaces/default/deployments/nothing/scale") as response:
                assert response.status == 404  # recorded all the same: authorization comes first
            async with session.get("/api/v1/namespaces/default/pods", params={"watch": "true", "timeoutSeconds": "0"}):
                pass
            async with session.get("/api/v1"):
                pass  # discovery: not a resource request
    entries = audit.read(log)
    assert [(e["verb"], e["group"], e["resource"], e["subresource"], e["namespace"]) for e in entries] == [
        ("get", "apps", "deployments", "scale", "default"),
        ("watch", "", "pods", "", "default"),
    ]
    assert {(e["user"], e["userAgent"]) for e in entries} == {("memops-operator", "memops")}
