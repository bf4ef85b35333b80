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
