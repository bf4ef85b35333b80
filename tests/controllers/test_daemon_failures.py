"""Every failure in a daemon ends in a status, never in a crash loop.

Inputs: the emulated API server in this process (with memops' CRDs) and the real daemons'
code (:class:`memops.controllers.retirement.Retirement`, :func:`memops.controllers.policy._loop`),
run as asyncio tasks against it. No scheduler is needed: each case fails before one is
reached. Only Kopf's event posting is switched off (it needs a running operator), and one
case makes a memops function raise to stand for a bug.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, cast

import kmock
import kopf
import pytest
from kopf._core.engines import posting

from memops import crds, kube, specs
from memops.cluster import apiserver
from memops.controllers import policy, retirement, workloads

LOGGER = logging.getLogger("test")
RR = kube.resource_path(specs.GROUP, specs.VERSION, "retirementrequests", "default")
POLICIES = kube.resource_path(specs.GROUP, specs.VERSION, "memorypolicies", "default")


class Stopped:
    """What a daemon's ``stopped`` flag offers: truthiness and a bounded wait."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def __bool__(self) -> bool:
        return self.event.is_set()

    async def wait(self, timeout: float | None = None) -> bool:
        try:
            await asyncio.wait_for(self.event.wait(), timeout)
        except TimeoutError:
            pass
        return bool(self)


@pytest.fixture
async def client() -> AsyncIterator[kube.Kube]:
    handler = apiserver.ApiServer()
    async with handler, kmock.Server(handler) as server:
        for crd in crds.all_crds():
            await handler.create_crd(crd)
        client = kube.Kube(kopf.ConnectionInfo(server=str(server.url)))
        deployment = {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "w", "namespace": "default"},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "w"}}, "template": {}},
        }
        await client.request("POST", kube.resource_path("apps", "v1", "deployments", "default"), body=deployment)
        try:
            yield client
        finally:
            await client.close()


def _quiet_events() -> None:
    settings = kopf.OperatorSettings()
    settings.posting.enabled = False
    posting.settings_var.set(settings)


async def _poll(what: str, check: Callable[[], Awaitable[Any]], timeout: float = 15) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = await check()
        if value:
            return value
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _condition(obj: dict[str, Any], type_: str) -> dict[str, Any] | None:
    return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == type_), None)


async def _run_request(client: kube.Kube, name: str, spec: dict[str, Any], status: dict[str, Any] | None = None) -> Any:
    """Create the request and run its daemon to the end; return the request as it ends."""
    _quiet_events()
    body = {"apiVersion": specs.API_VERSION, "kind": "RetirementRequest", "metadata": {"name": name}, "spec": spec}
    created = await client.request("POST", RR, body=body)
    if status is not None:
        created = await client.merge_patch(f"{RR}/{name}/status", {"status": status})
    stopped = Stopped()
    daemon = retirement.Retirement(client=client, body=kopf.Body(created), logger=LOGGER)
    task = asyncio.create_task(daemon.run(cast(kopf.DaemonStopped, stopped)))
    try:
        await asyncio.wait_for(asyncio.shield(task), 20)
    finally:
        stopped.event.set()
        await task  # re-raises what the daemon raised
    return await client.get(f"{RR}/{name}")


def _secret(name: str, **data: str) -> dict[str, Any]:
    encoded = {key: base64.b64encode(value.encode()).decode() for key, value in data.items()}
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": "default"}, "data": encoded}


TLS = {"address": "tls://127.0.0.1:9", "tls": {"secretName": "dask-tls"}}
NOT_PEM = "-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydGlmaWNhdGU=\n-----END CERTIFICATE-----\n"


@pytest.mark.parametrize(
    ("secret", "detail"),
    [
        pytest.param(None, 'secrets "dask-tls" not found', id="missing"),
        pytest.param(_secret("dask-tls", **{"ca.crt": NOT_PEM}), "has no 'tls.crt'", id="incomplete"),
        pytest.param(
            _secret("dask-tls", **{"ca.crt": NOT_PEM, "tls.crt": NOT_PEM, "tls.key": NOT_PEM}), "", id="not-pem"
        ),
    ],
)
async def test_an_unusable_secret_is_a_condition_then_a_failure_at_the_deadline(
    client: kube.Kube, secret: dict[str, Any] | None, detail: str
) -> None:
    if secret is not None:
        await client.request("POST", kube.resource_path("", "v1", "secrets", "default"), body=secret)
    spec = {"scheduler": TLS, "workload": {"kind": "Deployment", "name": "w"}, "count": 1, "timeout": "3s"}
    _quiet_events()
    task = asyncio.create_task(_run_request(client, "tls", spec))
    try:
        retrying = await _poll(
            "the Retrying condition",
            lambda: _retrying(client, "tls"),
        )
        assert retrying["reason"] == "SecretUnusable"
        assert retrying["message"].startswith("spec.scheduler.tls.secretName: Secret 'dask-tls'")
        assert detail in retrying["message"]
        assert "retrying until" in retrying["message"]
        ended = await asyncio.wait_for(task, 20)
    finally:
        task.cancel()
    assert ended["status"]["phase"] == "Failed"
    failed = _condition(ended, "Failed")
    assert failed is not None and failed["reason"] == "SecretUnusable"
    assert "spec.scheduler.tls.secretName" in ended["status"]["message"]


async def _retrying(client: kube.Kube, name: str) -> dict[str, Any] | None:
    request = await client.get_or_none(f"{RR}/{name}")  # None until the task has created it
    condition = _condition(request, "Retrying") if request is not None else None
    return condition if condition is not None and condition["status"] == "True" else None


async def test_a_timeout_past_the_maximum_fails_the_request_naming_the_field(client: kube.Kube) -> None:
    # The emulated API server does not run the CRD's CEL rule, as an API server before 1.25 would
    # not: the operator checks the bound itself instead of overflowing a datetime.
    spec = {"scheduler": {"address": "tcp://127.0.0.1:9"}, "workload": {"kind": "Deployment", "name": "w"}}
    ended = await _run_request(client, "forever", {**spec, "count": 1, "timeout": "100000000h"})
    assert ended["status"]["phase"] == "Failed"
    assert ended["status"]["message"].startswith("spec.timeout:")
    assert _condition(ended, "Failed")["reason"] == "InvalidSpec"  # type: ignore[index]


async def test_an_unexpected_error_is_a_condition_then_a_failure_at_the_deadline(
    client: kube.Kube, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(workloads, "get", broken)
    spec = {"scheduler": {"address": "tcp://127.0.0.1:9"}, "workload": {"kind": "Deployment", "name": "w"}}
    task = asyncio.create_task(_run_request(client, "bug", {**spec, "count": 1, "timeout": "3s"}))
    try:
        retrying = await _poll("the Retrying condition", lambda: _retrying(client, "bug"))
        assert (retrying["reason"], retrying["message"].split(";")[0]) == ("InternalError", "RuntimeError: a bug")
        ended = await asyncio.wait_for(task, 20)
    finally:
        task.cancel()
    assert ended["status"]["phase"] == "Failed"
    assert ended["status"]["message"] == "RuntimeError: a bug; gave up at spec.timeout"


async def test_a_status_that_cannot_be_read_fails_the_request_and_touches_nothing(client: kube.Kube) -> None:
    spec = {"scheduler": {"address": "tcp://127.0.0.1:9"}, "workload": {"kind": "Deployment", "name": "w"}}
    # Written by an operator that accepted what this one refuses (no CEL rule held it back).
    status = {
        "phase": "Draining",
        "acceptedSpec": {**spec, "count": 1, "timeout": "100000000h"},
        "workers": [{"pod": "w-1", "state": "Draining"}],
    }
    ended = await _run_request(client, "odd", {**spec, "count": 1}, status=status)
    assert ended["status"]["phase"] == "Failed"
    assert _condition(ended, "Failed")["reason"] == "InvalidStatus"  # type: ignore[index]
    assert "status.acceptedSpec.timeout" in ended["status"]["message"]
    assert [(w["pod"], w["state"]) for w in ended["status"]["workers"]] == [("w-1", "Draining")], "left as it was"


async def test_an_unexpected_error_in_a_policy_pass_is_a_condition(
    client: kube.Kube, monkeypatch: pytest.MonkeyPatch
) -> None:
    _quiet_events()

    async def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(workloads, "get", broken)
    body = {
        "apiVersion": specs.API_VERSION,
        "kind": "MemoryPolicy",
        "metadata": {"name": "p"},
        "spec": {"scheduler": {"address": "tcp://127.0.0.1:9"}, "workload": {"kind": "Deployment", "name": "w"}},
    }
    created = kopf.Body(await client.request("POST", POLICIES, body=body))
    stopped = Stopped()
    reconciler = policy.Policy(client=client, body=created, logger=LOGGER)
    task = asyncio.create_task(
        policy._loop(reconciler, created, cast(kopf.DaemonStopped, stopped), asyncio.Event(), LOGGER)
    )

    async def not_ready() -> dict[str, Any] | None:
        if task.done():
            task.result()  # the loop ended: re-raise why
        ready = _condition(await client.get(f"{POLICIES}/p"), "Ready")
        return ready if ready is not None and ready["reason"] == "InternalError" else None

    try:
        ready = await _poll("the policy's Ready=False condition", not_ready)
        assert (ready["status"], ready["message"]) == ("False", "RuntimeError: a bug")
        assert not task.done(), "the loop carries on"
    finally:
        stopped.event.set()
        await asyncio.wait_for(task, 10)


async def _policy(client: kube.Kube, name: str, **spec: Any) -> policy.Policy:
    _quiet_events()
    body = {
        "apiVersion": specs.API_VERSION,
        "kind": "MemoryPolicy",
        "metadata": {"name": name},
        "spec": {"scheduler": {"address": "tcp://127.0.0.1:9"}, "workload": {"kind": "Deployment", "name": "w"}}
        | spec,
    }
    created = kopf.Body(await client.request("POST", POLICIES, body=body))
    return policy.Policy(client=client, body=created, logger=LOGGER)


async def test_a_policy_whose_name_cannot_label_its_requests_is_not_ready(client: kube.Kube) -> None:
    name = "p" * 64
    await (await _policy(client, name)).reconcile()
    ready = _condition(await client.get(f"{POLICIES}/{name}"), "Ready")
    assert ready is not None and (ready["status"], ready["reason"]) == ("False", "InvalidName")
    assert ready["message"].startswith("metadata.name: at most 63 characters")


async def test_a_policy_with_a_missing_secret_names_the_secret(client: kube.Kube) -> None:
    reconciler = await _policy(client, "p", scheduler={"address": "tls://127.0.0.1:9", "tls": {"secretName": "gone"}})
    await reconciler.reconcile()
    reachable = _condition(await client.get(f"{POLICIES}/p"), "SchedulerReachable")
    assert reachable is not None and (reachable["status"], reachable["reason"]) == ("False", "SecretUnusable")
    assert reachable["message"].startswith("spec.scheduler.tls.secretName: ")
