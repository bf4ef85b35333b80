"""A 403 from the API server names the missing permission and the value that grants it."""

from __future__ import annotations

import logging

import aiohttp.web
import kopf
import pytest
from aiohttp.test_utils import TestServer

from memops import specs
from memops.clients import kube
from memops.controllers import policy
from memops.decisions import permissions, policy_findings


@pytest.mark.parametrize(
    ("method", "path", "expected"),
    [
        pytest.param(
            "GET",
            "/api/v1/namespaces/dask/secrets/scheduler-tls",
            (permissions.Permission("", "secrets", "get"), "dask"),
            id="secret",
        ),
        pytest.param(
            "DELETE",
            "/apis/apps/v1/namespaces/dask/deployments/dk-default-worker-0a1b",
            (permissions.Permission("apps", "deployments", "delete"), "dask"),
            id="deployment-delete",
        ),
        pytest.param(
            "PATCH",
            "/apis/apps/v1/namespaces/dask/deployments/w/scale",
            (permissions.Permission("apps", "deployments/scale", "patch"), "dask"),
            id="subresource",
        ),
        pytest.param(
            "GET",
            "/api/v1/namespaces/dask/events?fieldSelector=reason%3DFailedPreStopHook",
            (permissions.Permission("", "events", "list"), "dask"),
            id="list",
        ),
        pytest.param(
            "GET",
            "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
            (permissions.Permission("apiextensions.k8s.io", "customresourcedefinitions", "list"), ""),
            id="cluster-scoped",
        ),
        pytest.param("GET", "/healthz", None, id="not-a-resource"),
    ],
)
def test_requested_permission(method: str, path: str, expected: tuple[permissions.Permission, str] | None) -> None:
    assert permissions.requested(method, path) == expected


@pytest.mark.parametrize(
    ("method", "path", "needs"),
    [
        pytest.param("GET", "/api/v1/namespaces/dask/secrets/tls", "needs rbac.schedulerTLS=true", id="tls"),
        pytest.param(
            "DELETE", "/apis/apps/v1/namespaces/dask/deployments/w", "needs rbac.daskWorkerGroups=true", id="groups"
        ),
        pytest.param("PATCH", "/api/v1/namespaces/dask/pods/w-1/resize", "needs rbac.podResize=true", id="pod-resize"),
        pytest.param("GET", "/api/v1/nodes/n-1/proxy/stats/summary", "Role or ClusterRole lacks it", id="node-proxy"),
        pytest.param("GET", "/api/v1/namespaces/dask/pods", "Role or ClusterRole lacks it", id="not-gated"),
    ],
)
def test_explain_forbidden_names_the_permission_and_the_value(method: str, path: str, needs: str) -> None:
    message = permissions.explain_forbidden(method, path, "denied")
    assert message.startswith("Forbidden: the operator may not ") and needs in message
    where = "cluster-wide" if "/nodes/" in path else "in namespace 'dask'"
    assert where in message and message.endswith("The API server said: denied")


async def test_the_client_turns_a_403_into_that_message() -> None:
    async def refuse(request: aiohttp.web.Request) -> aiohttp.web.Response:
        status = {"kind": "Status", "reason": "Forbidden", "message": 'secrets "tls" is forbidden', "code": 403}
        return aiohttp.web.json_response(status, status=403)

    app = aiohttp.web.Application()
    app.router.add_get("/api/v1/namespaces/dask/secrets/tls", refuse)
    async with TestServer(app) as server:
        client = kube.Kube(kopf.ConnectionInfo(server=str(server.make_url("/"))))
        try:
            with pytest.raises(kube.ApiError) as raised:
                await client.get(kube.resource_path("", "v1", "secrets", "dask", "tls"))
        finally:
            await client.close()
    assert raised.value.code == 403
    assert "secrets get in namespace 'dask': needs rbac.schedulerTLS=true" in raised.value.message


async def test_a_policy_without_the_secret_permission_says_which_value_it_needs() -> None:
    """A tls:// policy on a chart installed without rbac.schedulerTLS: a condition, not a crash."""

    async def refuse(request: aiohttp.web.Request) -> aiohttp.web.Response:
        status = {"kind": "Status", "reason": "Forbidden", "message": 'secrets "tls" is forbidden', "code": 403}
        return aiohttp.web.json_response(status, status=403)

    app = aiohttp.web.Application()
    app.router.add_get("/api/v1/namespaces/dask/secrets/tls", refuse)
    body = kopf.Body({"metadata": {"name": "p", "namespace": "dask", "uid": "u", "generation": 1}, "spec": {}})
    spec = specs.MemoryPolicySpec.model_validate(
        {
            "scheduler": {"address": "tls://dask-scheduler:8786", "tls": {"secretName": "tls"}},
            "workload": {"kind": "Deployment", "name": "w"},
        }
    )
    status = specs.MemoryPolicyStatus()
    async with TestServer(app) as server:
        client = kube.Kube(kopf.ConnectionInfo(server=str(server.make_url("/"))))
        try:
            reconciler = policy.Policy(client=client, body=body, logger=logging.getLogger(__name__))
            async with reconciler.reach_scheduler(spec) as (seen, vetted):
                assert vetted is None
        finally:
            await client.close()
    observed = policy_findings.observe(
        status, policy_findings.Findings(scheduler=seen), spec.workload, generation=1, now=0
    )
    [reachable] = observed.status.conditions
    assert (reachable.type, reachable.status, reachable.reason) == ("SchedulerReachable", "False", "Forbidden")
    assert reachable.message.startswith("spec.scheduler.tls.secretName: Forbidden: the operator may not secrets get")
    assert "needs rbac.schedulerTLS=true" in reachable.message
