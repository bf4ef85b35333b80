"""The API client's seam: paths that stay where they are put, and errors that are always ApiErrors."""

from collections.abc import AsyncIterator

import aiohttp.test_utils
import kopf
import pytest
from aiohttp import web

from memops.clients import kube
from memops.controllers import vetting

ECHOED: list[str] = []
"""The paths the test server's echo answered, in order."""


@pytest.mark.parametrize(
    ("args", "path"),
    [
        pytest.param(("", "v1", "pods", "default", "w-1"), "/api/v1/namespaces/default/pods/w-1", id="core"),
        pytest.param(
            ("apps", "v1", "deployments", "default", "w", "scale"),
            "/apis/apps/v1/namespaces/default/deployments/w/scale",
            id="subresource",
        ),
        pytest.param(
            ("memops.dev", "v1alpha1", "memorypolicies"), "/apis/memops.dev/v1alpha1/memorypolicies", id="all"
        ),
        pytest.param(
            ("apps", "v1", "deployments", "default", "../../kube-system/deployments/coredns"),
            "/apis/apps/v1/namespaces/default/deployments/..%2F..%2Fkube-system%2Fdeployments%2Fcoredns",
            id="slashes-quoted",
        ),
        pytest.param(
            ("", "v1", "secrets", "default", "a?b#c"), "/api/v1/namespaces/default/secrets/a%3Fb%23c", id="query"
        ),
    ],
)
def test_resource_path_quotes_every_segment(args: tuple[str, ...], path: str) -> None:
    assert kube.resource_path(*args) == path


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(("", "v1", "secrets", "default", ".."), id="dotdot-name"),
        pytest.param(("", "v1", "secrets", "default", "."), id="dot-name"),
        pytest.param(("", "v1", "secrets", "default", ""), id="empty-name"),
        pytest.param(("", "v1", "secrets", "..", "x"), id="dotdot-namespace"),
        pytest.param(("apps", "v1", "deployments", "default", "w", ".."), id="dotdot-subresource"),
    ],
)
def test_resource_path_refuses_segments_that_move(args: tuple[str, ...]) -> None:
    with pytest.raises(ValueError, match="cannot be a segment"):
        kube.resource_path(*args)


@pytest.fixture
async def client() -> AsyncIterator[kube.Kube]:
    """A Kube talking to a small server that answers as proxies and broken servers do."""

    async def html_error(request: web.Request) -> web.Response:
        return web.Response(status=502, text="<html>" + "x" * 5000 + "</html>", content_type="text/html")

    async def status_error(request: web.Request) -> web.Response:
        body = {"kind": "Status", "reason": "NotFound", "message": 'secrets "s" not found'}
        return web.json_response(body, status=404)

    async def text_ok(request: web.Request) -> web.Response:
        return web.Response(status=200, text="all good")

    async def echo(request: web.Request) -> web.Response:
        ECHOED.append(request.raw_path)
        return web.json_response({"path": request.raw_path, "metadata": {"resourceVersion": "7"}})

    app = web.Application()
    app.router.add_get("/html", html_error)
    app.router.add_get("/status", status_error)
    app.router.add_get("/text", text_ok)
    app.router.add_get("/{tail:.*}", echo)
    async with aiohttp.test_utils.TestServer(app) as server:
        client = kube.Kube(kopf.ConnectionInfo(server=str(server.make_url("/"))))
        try:
            yield client
        finally:
            await client.close()


async def test_a_non_json_error_body_is_an_api_error_with_the_text_truncated(client: kube.Kube) -> None:
    with pytest.raises(kube.ApiError) as info:
        await client.get("/html")
    assert info.value.code == 502
    assert info.value.message.startswith("<html>xxx")
    assert len(info.value.message) <= 501


async def test_a_status_error_body_gives_its_reason_and_message(client: kube.Kube) -> None:
    with pytest.raises(kube.ApiError) as info:
        await client.get("/status")
    assert (info.value.code, info.value.reason, info.value.message) == (404, "NotFound", 'secrets "s" not found')


async def test_a_non_json_success_body_is_an_api_error(client: kube.Kube) -> None:
    with pytest.raises(kube.ApiError, match="not JSON: all good"):
        await client.get("/text")


async def test_a_quoted_name_reaches_the_server_as_one_segment(client: kube.Kube) -> None:
    path = kube.resource_path("apps", "v1", "deployments", "default", "a/../../b")
    echoed = await client.get(path)
    assert echoed["path"] == "/apis/apps/v1/namespaces/default/deployments/a%2F..%2F..%2Fb"


async def test_a_tenancy_check_lists_no_older_than_its_last_listing(client: kube.Kube) -> None:
    """The first listing is a consistent list; the next names the first's resourceVersion (the
    API server then answers from its watch cache at once, where a consistent list waits for the
    cache's progress period after any write: most of a RetirementRequest's time to its first byte)."""
    judge = vetting.Tenancy(client, "ns")
    await judge([])
    await judge([])
    assert judge.seen == "7"
    assert ECHOED[-2:] == [
        "/api/v1/namespaces/ns/pods",
        "/api/v1/namespaces/ns/pods?resourceVersion=7&resourceVersionMatch=NotOlderThan",
    ]
