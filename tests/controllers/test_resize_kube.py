"""The pod's resize subresource as the operator asks it, against a small server that records the
request (as tests/controllers/test_kube.py does); the kubelet's answer is the end-to-end tests'."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp.test_utils
import kopf
import pytest
from aiohttp import web

from memops.clients import kube
from memops.controllers import resize
from memops.decisions import resize_decisions

POD = {
    "metadata": {"name": "w-1", "namespace": "dask"},
    "spec": {
        "containers": [{"name": "worker", "resources": {"requests": {"memory": "1Gi"}, "limits": {"memory": "2Gi"}}}]
    },
    "status": {
        "conditions": [{"type": "PodResizeInProgress", "status": "True"}],
        "containerStatuses": [
            {
                "name": "worker",
                "allocatedResources": {"memory": "1Gi"},
                "resources": {"requests": {"memory": "1Gi"}, "limits": {"memory": "1Gi"}},
            }
        ],
    },
}


@pytest.fixture
async def server() -> AsyncIterator[tuple[kube.Kube, list[dict[str, Any]]]]:
    seen: list[dict[str, Any]] = []

    async def record(request: web.Request) -> web.Response:
        body = await request.text()
        seen.append(
            {
                "method": request.method,
                "path": request.raw_path,
                "content_type": request.headers.get("Content-Type"),
                "body": json.loads(body) if body else None,
            }
        )
        if request.raw_path.endswith("/missing"):
            return web.json_response({"kind": "Status", "reason": "NotFound", "message": "gone"}, status=404)
        return web.json_response(POD)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", record)
    async with aiohttp.test_utils.TestServer(app) as test_server:
        client = kube.Kube(kopf.ConnectionInfo(server=str(test_server.make_url("/"))))
        try:
            yield client, seen
        finally:
            await client.close()


async def test_a_resize_patches_the_subresource_for_one_container_s_memory(
    server: tuple[kube.Kube, list[dict[str, Any]]],
) -> None:
    client, seen = server
    await resize.resize_container_memory(client, "dask", "w-1", "worker", limit=1536 * 2**20, request=2**30)
    assert seen == [
        {
            "method": "PATCH",
            "path": "/api/v1/namespaces/dask/pods/w-1/resize",
            "content_type": "application/strategic-merge-patch+json",
            "body": {
                "spec": {
                    "containers": [
                        {"name": "worker", "resources": {"limits": {"memory": "1536Mi"}, "requests": {"memory": "1Gi"}}}
                    ]
                }
            },
        }
    ]


async def test_a_limit_alone_leaves_the_request(server: tuple[kube.Kube, list[dict[str, Any]]]) -> None:
    client, seen = server
    await resize.resize_container_memory(client, "dask", "w-1", "worker", limit=3 * 2**30)
    assert seen[0]["body"] == {"spec": {"containers": [{"name": "worker", "resources": {"limits": {"memory": "3Gi"}}}]}}


async def test_reading_the_pod_gives_the_ask_what_was_applied_and_the_state(
    server: tuple[kube.Kube, list[dict[str, Any]]],
) -> None:
    client, seen = server
    read = await resize.read_container_memory(client, "dask", "w-1", "worker")
    assert read is not None
    memory, state = read
    assert memory is not None and (memory.limit, memory.actual_limit) == (2 * 2**30, 2**30)
    assert state == resize_decisions.ResizeStatus(resize_decisions.PodResize.IN_PROGRESS)
    assert seen[0]["method"] == "GET" and seen[0]["path"] == "/api/v1/namespaces/dask/pods/w-1"
    assert await resize.read_container_memory(client, "dask", "missing", "worker") is None


def _pod_on(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "dask"}, "spec": {"nodeName": "n-1", **spec}}


def _memory(quantity: str) -> dict[str, Any]:
    return {"requests": {"memory": quantity}}


ON_THE_NODE = [
    # A worker of shared spill with swap SpillOnly: the spill owner is a restartable init container.
    _pod_on(
        "w-1",
        {
            "containers": [{"name": "worker", "resources": _memory("2Gi")}],
            "initContainers": [{"name": "memops-spill-owner", "restartPolicy": "Always", "resources": _memory("1Gi")}],
        },
    ),
    # A pod of a RuntimeClass with overhead (a sandboxed runtime: gVisor, Kata), which the API server
    # copied into the pod's spec.
    _pod_on("vm-1", {"containers": [{"name": "app", "resources": _memory("1Gi")}], "overhead": {"memory": "512Mi"}}),
]


@pytest.fixture
async def node_server() -> AsyncIterator[tuple[kube.Kube, list[str]]]:
    """A Node of 8Gi allocatable and the pods on it, as the API server lists them."""
    seen: list[str] = []

    async def answer(request: web.Request) -> web.Response:
        seen.append(request.path_qs)
        if request.path == "/api/v1/nodes/n-1":
            return web.json_response({"metadata": {"name": "n-1"}, "status": {"allocatable": {"memory": "8Gi"}}})
        return web.json_response({"kind": "PodList", "items": ON_THE_NODE})

    app = web.Application()
    app.router.add_route("GET", "/{tail:.*}", answer)
    async with aiohttp.test_utils.TestServer(app) as test_server:
        client = kube.Kube(kopf.ConnectionInfo(server=str(test_server.make_url("/"))))
        try:
            yield client, seen
        finally:
            await client.close()


async def test_the_nodes_room_counts_sidecars_and_overhead(node_server: tuple[kube.Kube, list[str]]) -> None:
    """8Gi allocatable; the worker asks 2Gi and its spill owner (a restartable init container) 1Gi;
    the other pod 1Gi and its runtime's overhead 512Mi: 3.5Gi are left, as the kubelet counts them
    when it admits a resize (and the scheduler when it places a pod). Counting only the containers,
    the room was 5Gi, and a growth into the missing 1.5Gi came back Deferred."""
    client, seen = node_server
    assert await resize.node_room(client, "n-1", default=0) == 3 * 2**30 + 512 * 2**20
    assert seen[0] == "/api/v1/nodes/n-1" and seen[1].startswith("/api/v1/pods?fieldSelector=spec.nodeName")
