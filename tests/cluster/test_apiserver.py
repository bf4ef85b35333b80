"""The emulated API server answers as the Kubernetes API server does, for what memops uses."""

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import kmock
import pytest

from memops import crds
from memops.cluster import apiserver

RR = "/apis/memops.dev/v1alpha1/namespaces/default/retirementrequests"
PODS = "/api/v1/namespaces/default/pods"
DEPLOYMENTS = "/apis/apps/v1/namespaces/default/deployments"
MERGE = {"Content-Type": "application/merge-patch+json"}
JSONPATCH = {"Content-Type": "application/json-patch+json"}


@pytest.fixture
async def api() -> AsyncIterator[tuple[apiserver.ApiServer, aiohttp.ClientSession]]:
    server_handler = apiserver.ApiServer()
    async with server_handler, kmock.Server(server_handler) as server:
        for crd in crds.all_crds():
            await server_handler.create_crd(crd)
        async with aiohttp.ClientSession(base_url=str(server.url)) as session:
            yield server_handler, session


def request_body(name: str = "shrink", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "memops.dev/v1alpha1",
        "kind": "RetirementRequest",
        "metadata": {"name": name},
        "spec": {
            "scheduler": {"address": "tcp://s:8786"},
            "workload": {"kind": "Deployment", "name": "w"},
            **spec,
        },
    }


def pod(name: str, **labels: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels}, "spec": {"containers": []}}


async def test_metadata_is_server_owned_and_resource_version_grows(api: Any) -> None:
    _, http = api
    async with http.post(PODS, json=pod("a")) as response:
        assert response.status == 201
        a = await response.json()
    async with http.post(PODS, json=pod("b")) as response:
        b = await response.json()
    assert a["metadata"]["uid"] != b["metadata"]["uid"]
    assert a["metadata"]["namespace"] == "default"
    assert int(b["metadata"]["resourceVersion"]) > int(a["metadata"]["resourceVersion"])
    assert a["metadata"]["creationTimestamp"].endswith("Z")
    async with http.post(PODS, json=pod("a")) as response:
        assert response.status == 409


async def test_stale_resource_version_is_a_conflict(api: Any) -> None:
    _, http = api
    async with http.post(PODS, json=pod("a")) as response:
        stale = (await response.json())["metadata"]["resourceVersion"]
    async with http.patch(f"{PODS}/a", json={"metadata": {"labels": {"x": "1"}}}, headers=MERGE) as response:
        assert response.status == 200
    patch = {"metadata": {"resourceVersion": stale, "labels": {"x": "2"}}}
    async with http.patch(f"{PODS}/a", json=patch, headers=MERGE) as response:
        assert response.status == 409
        assert (await response.json())["reason"] == "Conflict"


async def test_failed_json_patch_test_is_422(api: Any) -> None:
    _, http = api
    async with http.post(PODS, json=pod("a")) as response:
        created = await response.json()
    ops = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": "0"},
        {"op": "add", "path": "/metadata/annotations", "value": {"k": "v"}},
    ]
    async with http.patch(f"{PODS}/a", json=ops, headers=JSONPATCH) as response:
        assert response.status == 422
    ops[0]["value"] = created["metadata"]["resourceVersion"]
    async with http.patch(f"{PODS}/a", json=ops, headers=JSONPATCH) as response:
        assert response.status == 200
        assert (await response.json())["metadata"]["annotations"] == {"k": "v"}


async def test_label_and_field_selectors(api: Any) -> None:
    _, http = api
    for name, app in [("a", "x"), ("b", "x"), ("c", "y")]:
        async with http.post(PODS, json=pod(name, app=app)):
            pass
    async with http.get(PODS, params={"labelSelector": "app=x"}) as response:
        listing = await response.json()
    assert listing["kind"] == "PodList"
    assert [p["metadata"]["name"] for p in listing["items"]] == ["a", "b"]
    async with http.get(PODS, params={"labelSelector": "app!=x"}) as response:
        assert [p["metadata"]["name"] for p in (await response.json())["items"]] == ["c"]
    async with http.get(PODS, params={"fieldSelector": "metadata.name=b"}) as response:
        assert [p["metadata"]["name"] for p in (await response.json())["items"]] == ["b"]


async def test_custom_resources_are_validated_with_messages_naming_the_field(api: Any) -> None:
    _, http = api
    async with http.post(RR, json=request_body(count=-1, timeout="soon")) as response:
        assert response.status == 422
        status = await response.json()
    assert "spec.count: Invalid value: -1" in status["message"]
    assert "spec.timeout" in status["message"]
    assert {c["field"] for c in status["details"]["causes"]} == {"spec.count", "spec.timeout"}
    async with http.post(RR, json=request_body(count=1, workers=["a"])) as response:
        assert response.status == 422
        assert "oneOf" in (await response.json())["message"]
    async with http.post(RR, json=request_body(count=1, extra=1), params={"fieldValidation": "Strict"}) as response:
        assert response.status == 400
        assert 'unknown field "spec.extra"' in (await response.json())["message"]


async def test_defaults_generation_and_status_subresource(api: Any) -> None:
    _, http = api
    async with http.post(RR, json={**request_body(count=2), "status": {"phase": "Succeeded"}}) as response:
        created = await response.json()
    assert created["spec"]["onTimeout"] == "Abort" and created["spec"]["timeout"] == "10m"
    assert "status" not in created, "status is written through its subresource only"
    assert created["metadata"]["generation"] == 1
    async with http.patch(f"{RR}/shrink/status", json={"status": {"phase": "Draining"}}, headers=MERGE) as response:
        assert (await response.json())["metadata"]["generation"] == 1
    async with http.patch(
        f"{RR}/shrink", json={"spec": {"count": 3}, "status": {"phase": "Failed"}}, headers=MERGE
    ) as response:
        updated = await response.json()
    assert updated["metadata"]["generation"] == 2
    assert updated["status"]["phase"] == "Draining"
    async with http.patch(f"{RR}/shrink/status", json={"status": {"phase": "Sideways"}}, headers=MERGE) as response:
        assert response.status == 422


async def test_scale_subresource(api: Any) -> None:
    _, http = api
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "w"},
        "spec": {"replicas": 4, "selector": {"matchLabels": {"app": "w"}}, "template": {}},
    }
    async with http.post(DEPLOYMENTS, json=deployment):
        pass
    async with http.get(f"{DEPLOYMENTS}/w/scale") as response:
        scale = await response.json()
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 4 and scale["status"]["selector"] == "app=w"
    async with http.patch(f"{DEPLOYMENTS}/w/scale", json={"spec": {"replicas": 2}}, headers=MERGE) as response:
        assert (await response.json())["spec"]["replicas"] == 2
    async with http.get(f"{DEPLOYMENTS}/w") as response:
        assert (await response.json())["spec"]["replicas"] == 2
    stale = {"metadata": {"resourceVersion": scale["metadata"]["resourceVersion"]}, "spec": {"replicas": 1}}
    async with http.patch(f"{DEPLOYMENTS}/w/scale", json=stale, headers=MERGE) as response:
        assert response.status == 409


async def test_watch_from_a_resource_version(api: Any) -> None:
    _, http = api
    async with http.post(PODS, json=pod("a")) as response:
        rv = (await response.json())["metadata"]["resourceVersion"]
    async with http.post(PODS, json=pod("b")):
        pass
    async with http.delete(f"{PODS}/a"):
        pass
    params = {"watch": "true", "resourceVersion": rv, "timeoutSeconds": "1"}
    async with http.get(PODS, params=params) as response:
        lines = [line async for line in response.content if line.strip()]
    import json

    events = [(e["type"], e["object"]["metadata"]["name"]) for e in map(json.loads, lines)]
    assert events == [("ADDED", "b"), ("DELETED", "a")]


async def test_graceful_pod_deletion_waits_for_the_kubelet(api: Any) -> None:
    server, http = api
    scheduled = {**pod("a"), "spec": {"nodeName": "local", "terminationGracePeriodSeconds": 7, "containers": []}}
    async with http.post(PODS, json=scheduled):
        pass
    async with http.delete(f"{PODS}/a") as response:
        terminating = await response.json()
    assert terminating["metadata"]["deletionGracePeriodSeconds"] == 7
    assert server.store.get("pods", "default", "a") is not None
    await server.store.delete("pods", "default", "a", grace_period_seconds=0)
    assert server.store.get("pods", "default", "a") is None


async def test_kubectl_tables_use_printer_columns(api: Any) -> None:
    _, http = api
    async with http.post(RR, json=request_body(count=2)):
        pass
    headers = {"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io,application/json"}
    async with http.get(RR, headers=headers) as response:
        table = await response.json()
    names = [c["name"] for c in table["columnDefinitions"]]
    assert names[:4] == ["Name", "Phase", "Workload", "Count"]
    assert table["rows"][0]["cells"][:4] == ["shrink", None, "w", 2]


async def test_openapi_v3_describes_custom_resources(api: Any) -> None:
    _, http = api
    async with http.get("/openapi/v3") as response:
        index = await response.json()
    url = index["paths"]["apis/memops.dev/v1alpha1"]["serverRelativeURL"]
    async with http.get(url) as response:
        document = await response.json()
    schema = document["components"]["schemas"]["dev.memops.v1alpha1.RetirementRequest"]
    assert schema["x-kubernetes-group-version-kind"] == [
        {"group": "memops.dev", "version": "v1alpha1", "kind": "RetirementRequest"}
    ]
    assert "description" in schema["properties"]["spec"]["properties"]["count"]


async def test_watch_list_ends_initial_events_with_a_bookmark(api: Any) -> None:
    """kubectl (client-go's WatchListClient) waits for this bookmark before it evaluates anything."""
    import json

    _, http = api
    async with http.post(PODS, json=pod("a")):
        pass
    params = {
        "watch": "true",
        "sendInitialEvents": "true",
        "resourceVersionMatch": "NotOlderThan",
        "allowWatchBookmarks": "true",
        "timeoutSeconds": "1",
    }
    async with http.get(PODS, params=params) as response:
        events = [json.loads(line) async for line in response.content if line.strip()]
    assert [e["type"] for e in events] == ["ADDED", "BOOKMARK"]
    assert events[1]["object"]["metadata"]["annotations"] == {"k8s.io/initial-events-end": "true"}


async def test_mutating_webhooks_are_called_on_creation(api: Any) -> None:
    import base64
    import json

    from aiohttp import web

    server, http = api
    reviews: list[dict[str, Any]] = []

    async def hook(request: web.Request) -> web.Response:
        review = await request.json()
        reviews.append(review)
        patch = [{"op": "add", "path": "/metadata/annotations", "value": {"mutated": "yes"}}]
        response = {
            "uid": review["request"]["uid"],
            "allowed": True,
            "patchType": "JSONPatch",
            "patch": base64.b64encode(json.dumps(patch).encode()).decode(),
        }
        return web.json_response({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response})

    app = web.Application()
    app.router.add_post("/hook", hook)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    rules = [{"apiGroups": [""], "apiVersions": ["v1"], "resources": ["pods"], "operations": ["CREATE"]}]
    config = {
        "metadata": {"name": "test"},
        "webhooks": [
            {
                "name": "works.test",
                "clientConfig": {"url": f"http://127.0.0.1:{port}/hook"},
                "rules": rules,
                "failurePolicy": "Fail",
            },
            {
                "name": "down.test",
                "clientConfig": {"url": "http://127.0.0.1:9/hook"},
                "rules": rules,
                "failurePolicy": "Ignore",
            },
        ],
    }
    try:
        await server.store.create("mutatingwebhookconfigurations", None, config)
        async with http.post(PODS, json=pod("a")) as response:
            created = await response.json()
        assert created["metadata"]["annotations"] == {"mutated": "yes"}
        assert reviews[0]["request"]["operation"] == "CREATE" and reviews[0]["request"]["kind"]["kind"] == "Pod"
        async with http.post(DEPLOYMENTS, json={"metadata": {"name": "d"}, "spec": {}}) as response:
            assert "annotations" not in (await response.json())["metadata"], "rules select pods only"
        config["webhooks"][1]["failurePolicy"] = "Fail"
        await server.store.replace("mutatingwebhookconfigurations", None, "test", config)
        async with http.post(PODS, json=pod("b")) as response:
            assert response.status == 500
            assert "down.test" in (await response.json())["message"]
    finally:
        await runner.cleanup()


async def test_a_crd_need_not_declare_apiversion_and_kind(api: Any) -> None:
    """As the API server does: they are implicit at the root of a structural schema."""
    server, http = api
    await server.create_crd(
        {
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {"name": "widgets.example.com"},
            "spec": {
                "group": "example.com",
                "scope": "Namespaced",
                "names": {"kind": "Widget", "plural": "widgets", "singular": "widget"},
                "versions": [
                    {
                        "name": "v1",
                        "served": True,
                        "storage": True,
                        "schema": {
                            "openAPIV3Schema": {
                                "type": "object",
                                "properties": {"spec": {"type": "object", "properties": {"size": {"type": "integer"}}}},
                            }
                        },
                    }
                ],
            },
        }
    )
    widget = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}, "spec": {"size": 1}}
    path = "/apis/example.com/v1/namespaces/default/widgets"
    async with http.post(path, json=widget, params={"fieldValidation": "Strict"}) as response:
        assert response.status == 201, await response.text()
        created = await response.json()
    assert (created["apiVersion"], created["kind"], created["spec"]) == ("example.com/v1", "Widget", {"size": 1})
    async with http.post(path, json={**widget, "extra": 1}, params={"fieldValidation": "Strict"}) as response:
        assert response.status == 400
        assert 'unknown field "extra"' in (await response.json())["message"]


@pytest.mark.parametrize("path", ["/version/", "/api/", "/apis/"])
async def test_discovery_answers_with_a_trailing_slash(api: Any, path: str) -> None:
    _, http = api
    async with http.get(path) as response:
        assert response.status == 200
        assert await response.json()


@pytest.mark.parametrize(
    ("spec", "field", "detail"),
    [
        pytest.param({"workers": ["p", "q", "p"]}, "spec.workers[2]", 'Duplicate value: "p"', id="set"),
        pytest.param(
            {"count": 1, "workload": {"kind": "Deployment", "name": "../../kube-system/deployments/coredns"}},
            "spec.workload.name",
            "should match",
            id="name",
        ),
    ],
)
async def test_names_and_sets_are_refused_naming_the_field(
    api: Any, spec: dict[str, Any], field: str, detail: str
) -> None:
    _, http = api
    body = request_body(**spec)
    async with http.post(RR, json=body) as response:
        assert response.status == 422
        causes = (await response.json())["details"]["causes"]
    assert any(c["field"] == field and detail in c["message"] for c in causes), causes
