"""Every failure in a daemon ends in a status, never in a crash loop.

Inputs: the upstream control plane (``memops-sandbox plane``: etcd and kube-apiserver with
memops' CRDs, one plane for the module, a namespace per test) and the real daemons' code
(:class:`memops.controllers.retirement.Retirement`, :func:`memops.controllers.policy._loop`),
run in this process as asyncio tasks against it, as the admin. No scheduler and no node are
needed: each case fails before one is reached. Only Kopf's event posting is switched off (it
needs a running operator), and one case makes a memops function raise to stand for a bug.

Where the CRD's CEL rules refuse the bad value at the API server (a timeout past the maximum,
in the spec or in the accepted spec of a status), the object stored is valid and the daemon is
handed the body with the bad value, as Kopf would hand it an object stored before the rule
existed, or by an API server older than 1.25 that does not run CEL: the operator checks the
bounds itself.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, cast

import kopf
import pytest
from kopf._core.engines import posting

from memops import specs
from memops.clients import kube
from memops.controllers import policy, retirement, workloads
from tests import polling

LOGGER = logging.getLogger("test")


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


class Namespaced:
    """This test's namespace: the paths of its requests and policies."""

    def __init__(self, client: kube.Kube, namespace: str):
        self.client = client
        self.namespace = namespace
        self.requests = kube.resource_path(specs.GROUP, specs.VERSION, "retirementrequests", namespace)
        self.policies = kube.resource_path(specs.GROUP, specs.VERSION, "memorypolicies", namespace)


@pytest.fixture
async def ns(plane: Path, request: pytest.FixtureRequest) -> AsyncIterator[Namespaced]:
    client = kube.Kube(kube.load_connection(str(plane / "kubeconfig")))
    namespace = "t-" + hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:12]
    await client.request("POST", "/api/v1/namespaces", body={"metadata": {"name": namespace}})
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "w", "namespace": namespace},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "w"}},
            "template": {
                "metadata": {"labels": {"app": "w"}},
                "spec": {"containers": [{"name": "w", "image": "example.invalid/w:1"}]},
            },
        },
    }
    await client.request("POST", kube.resource_path("apps", "v1", "deployments", namespace), body=deployment)
    try:
        yield Namespaced(client, namespace)
    finally:
        await client.close()


def _quiet_events() -> None:
    settings = kopf.OperatorSettings()
    settings.posting.enabled = False
    posting.settings_var.set(settings)


def _condition(obj: dict[str, Any], type_: str) -> dict[str, Any] | None:
    return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == type_), None)


async def _run_request(
    ns: Namespaced,
    name: str,
    spec: dict[str, Any],
    status: dict[str, Any] | None = None,
    *,
    seen: Callable[[dict[str, Any]], dict[str, Any]] = lambda body: body,
) -> Any:
    """Create the request and run its daemon to the end; return the request as it ends. The
    daemon is handed ``seen(stored)``: the body as Kopf would deliver it."""
    _quiet_events()
    body = {"apiVersion": specs.API_VERSION, "kind": "RetirementRequest", "metadata": {"name": name}, "spec": spec}
    created = await ns.client.request("POST", ns.requests, body=body)
    if status is not None:
        created = await ns.client.merge_patch(f"{ns.requests}/{name}/status", {"status": status})
    stopped = Stopped()
    daemon = retirement.Retirement(client=ns.client, body=kopf.Body(seen(created)), logger=LOGGER)
    task = asyncio.create_task(daemon.run(cast(kopf.DaemonStopped, stopped)))
    try:
        await asyncio.wait_for(asyncio.shield(task), 20)
    finally:
        stopped.event.set()
        await task  # re-raises what the daemon raised
    return await ns.client.get(f"{ns.requests}/{name}")


def _secret(name: str, namespace: str, **data: str) -> dict[str, Any]:
    encoded = {key: base64.b64encode(value.encode()).decode() for key, value in data.items()}
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": namespace}, "data": encoded}


TLS = {"address": "tls://127.0.0.1:9", "tls": {"secretName": "dask-tls"}}
NOT_PEM = "-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydGlmaWNhdGU=\n-----END CERTIFICATE-----\n"
SPEC = {"scheduler": {"address": "tcp://127.0.0.1:9"}, "workload": {"kind": "Deployment", "name": "w"}}
PAST_THE_MAXIMUM = "100000000h"


@pytest.mark.parametrize(
    ("secret", "detail"),
    [
        pytest.param(None, 'secrets "dask-tls" not found', id="missing"),
        pytest.param({"ca.crt": NOT_PEM}, "has no 'tls.crt'", id="incomplete"),
        pytest.param({"ca.crt": NOT_PEM, "tls.crt": NOT_PEM, "tls.key": NOT_PEM}, "", id="not-pem"),
    ],
)
async def test_an_unusable_secret_is_a_condition_then_a_failure_at_the_deadline(
    ns: Namespaced, secret: dict[str, str] | None, detail: str
) -> None:
    if secret is not None:
        body = _secret("dask-tls", ns.namespace, **secret)
        await ns.client.request("POST", kube.resource_path("", "v1", "secrets", ns.namespace), body=body)
    spec = {"scheduler": TLS, "workload": {"kind": "Deployment", "name": "w"}, "count": 1, "timeout": "3s"}
    _quiet_events()
    task = asyncio.create_task(_run_request(ns, "tls", spec))
    try:
        retrying = await polling.poll(lambda: _retrying(ns, "tls"), timeout=15, what="the Retrying condition")
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


async def _retrying(ns: Namespaced, name: str) -> dict[str, Any] | None:
    request = await ns.client.get_or_none(f"{ns.requests}/{name}")  # None until the task has created it
    condition = _condition(request, "Retrying") if request is not None else None
    return condition if condition is not None and condition["status"] == "True" else None


async def test_the_api_server_refuses_a_timeout_past_the_maximum(ns: Namespaced) -> None:
    body = {
        "apiVersion": specs.API_VERSION,
        "kind": "RetirementRequest",
        "metadata": {"name": "forever"},
        "spec": {**SPEC, "count": 1, "timeout": PAST_THE_MAXIMUM},
    }
    with pytest.raises(kube.ApiError) as refused:
        await ns.client.request("POST", ns.requests, body=body)
    assert refused.value.code == 422 and "spec.timeout" in refused.value.message


async def test_a_timeout_past_the_maximum_fails_the_request_naming_the_field(ns: Namespaced) -> None:
    def unbounded(stored: dict[str, Any]) -> dict[str, Any]:
        return {**stored, "spec": {**stored["spec"], "timeout": PAST_THE_MAXIMUM}}

    ended = await _run_request(ns, "forever", {**SPEC, "count": 1, "timeout": "1m"}, seen=unbounded)
    assert ended["status"]["phase"] == "Failed"
    assert ended["status"]["message"].startswith("spec.timeout:")
    assert _condition(ended, "Failed")["reason"] == "InvalidSpec"  # type: ignore[index]


async def test_an_unexpected_error_is_a_condition_then_a_failure_at_the_deadline(
    ns: Namespaced, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(workloads, "get", broken)
    task = asyncio.create_task(_run_request(ns, "bug", {**SPEC, "count": 1, "timeout": "3s"}))
    try:
        retrying = await polling.poll(lambda: _retrying(ns, "bug"), timeout=15, what="the Retrying condition")
        assert (retrying["reason"], retrying["message"].split(";")[0]) == ("InternalError", "RuntimeError: a bug")
        ended = await asyncio.wait_for(task, 20)
    finally:
        task.cancel()
    assert ended["status"]["phase"] == "Failed"
    assert ended["status"]["message"] == "RuntimeError: a bug; gave up at spec.timeout"


async def test_a_status_that_cannot_be_read_fails_the_request_and_touches_nothing(ns: Namespaced) -> None:
    # Written by an operator that accepted what this one refuses (no CEL rule held it back).
    status = {
        "phase": "Draining",
        "acceptedSpec": {**SPEC, "count": 1, "timeout": "1m"},
        "workers": [{"pod": "w-1", "state": "Draining"}],
    }

    def unbounded(stored: dict[str, Any]) -> dict[str, Any]:
        accepted = {**stored["status"]["acceptedSpec"], "timeout": PAST_THE_MAXIMUM}
        return {**stored, "status": {**stored["status"], "acceptedSpec": accepted}}

    ended = await _run_request(ns, "odd", {**SPEC, "count": 1}, status=status, seen=unbounded)
    assert ended["status"]["phase"] == "Failed"
    assert _condition(ended, "Failed")["reason"] == "InvalidStatus"  # type: ignore[index]
    assert "status.acceptedSpec.timeout" in ended["status"]["message"]
    assert [(w["pod"], w["state"]) for w in ended["status"]["workers"]] == [("w-1", "Draining")], "left as it was"


async def test_an_unexpected_error_in_a_policy_pass_is_a_condition(
    ns: Namespaced, monkeypatch: pytest.MonkeyPatch
) -> None:
    _quiet_events()

    async def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(workloads, "get", broken)
    body = {"apiVersion": specs.API_VERSION, "kind": "MemoryPolicy", "metadata": {"name": "p"}, "spec": SPEC}
    created = kopf.Body(await ns.client.request("POST", ns.policies, body=body))
    stopped = Stopped()
    reconciler = policy.Policy(client=ns.client, body=created, logger=LOGGER)
    task = asyncio.create_task(
        policy._loop(reconciler, created, cast(kopf.DaemonStopped, stopped), asyncio.Event(), LOGGER)
    )

    async def not_ready() -> dict[str, Any] | None:
        if task.done():
            task.result()  # the loop ended: re-raise why
        ready = _condition(await ns.client.get(f"{ns.policies}/p"), "Ready")
        return ready if ready is not None and ready["reason"] == "InternalError" else None

    try:
        ready = await polling.poll(not_ready, timeout=15, what="the policy's Ready=False condition")
        assert (ready["status"], ready["message"]) == ("False", "RuntimeError: a bug")
        assert not task.done(), "the loop carries on"
    finally:
        stopped.event.set()
        await asyncio.wait_for(task, 10)


async def _policy(ns: Namespaced, name: str, **spec: Any) -> policy.Policy:
    _quiet_events()
    body = {
        "apiVersion": specs.API_VERSION,
        "kind": "MemoryPolicy",
        "metadata": {"name": name},
        "spec": SPEC | spec,
    }
    created = kopf.Body(await ns.client.request("POST", ns.policies, body=body))
    return policy.Policy(client=ns.client, body=created, logger=LOGGER)


async def test_the_api_server_refuses_a_policy_name_that_cannot_label_its_requests(ns: Namespaced) -> None:
    body = {"apiVersion": specs.API_VERSION, "kind": "MemoryPolicy", "metadata": {"name": "p" * 64}, "spec": SPEC}
    with pytest.raises(kube.ApiError) as refused:
        await ns.client.request("POST", ns.policies, body=body)
    assert refused.value.code == 422 and "metadata.name must be at most 63 characters" in refused.value.message


async def test_a_policy_whose_name_cannot_label_its_requests_is_not_ready(
    ns: Namespaced, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The operator's own bound, for a CRD without the rule: exercised with the bound lowered,
    since the real API server refuses a longer name (the test above)."""
    monkeypatch.setattr(policy, "_MAX_NAME_LENGTH", 3)
    await (await _policy(ns, "long")).reconcile()
    ready = _condition(await ns.client.get(f"{ns.policies}/long"), "Ready")
    assert ready is not None and (ready["status"], ready["reason"]) == ("False", "InvalidName")
    assert ready["message"].startswith("metadata.name: at most 3 characters")


async def test_a_policy_with_a_missing_secret_names_the_secret(ns: Namespaced) -> None:
    reconciler = await _policy(ns, "p", scheduler={"address": "tls://127.0.0.1:9", "tls": {"secretName": "gone"}})
    await reconciler.reconcile()
    reachable = _condition(await ns.client.get(f"{ns.policies}/p"), "SchedulerReachable")
    assert reachable is not None and (reachable["status"], reachable["reason"]) == ("False", "SecretUnusable")
    assert reachable["message"].startswith("spec.scheduler.tls.secretName: ")
