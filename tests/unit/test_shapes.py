"""What the webhooks read is checked first: a malformed object is a typed refusal naming the
field, or is left out of a cache's list; never a TypeError inside a decision (which Kopf answers
with a 500 refusal: a pod not created, an eviction refused for a crash). Each case here is one
that the fuzz tests (tests/fuzz/test_webhooks.py) found crashing the code before."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from memops.controllers import eviction_webhook, safetynet_webhook
from memops.decisions import eviction_gate, shapes
from tests.fuzz.test_webhooks import DEPLOYMENT, POD, POLICIES, REQUEST

DEPLOYMENTS = {("default", "dask-worker"): [DEPLOYMENT]}


def changed(path: tuple[Any, ...], value: Any, body: Any = POD) -> Any:
    body = copy.deepcopy(body)
    parent = body
    for step in path[:-1]:
        parent = parent[step]
    parent[path[-1]] = value
    return body


@pytest.mark.parametrize(
    ("pod", "field"),
    [
        pytest.param(changed(("metadata",), None), "metadata", id="metadata-null"),
        pytest.param(changed(("spec", "containers", 0), "worker"), "spec.containers.0", id="container-a-string"),
        pytest.param(changed(("spec", "containers", 0, "env", 0), ["A"]), "spec.containers.0.env.0", id="env-a-list"),
        pytest.param(
            changed(("spec", "terminationGracePeriodSeconds"), [30]),
            "spec.terminationGracePeriodSeconds",
            id="grace-a-list",
        ),
        pytest.param(changed(("spec", "volumes"), [["data"]]), "spec.volumes.0", id="volume-a-list"),
        pytest.param(changed(("spec",), [1, 2]), "spec", id="spec-a-list"),
    ],
)
def test_a_malformed_pod_is_a_typed_refusal_naming_the_field(pod: Any, field: str) -> None:
    """Before: AttributeError or TypeError out of plan_injection, so Kopf refused the pod's
    creation with a 500; now the handler logs it and the pod is created as it is."""
    with pytest.raises(shapes.MalformedObject, match=f"pod: {field}: "):
        safetynet_webhook.plan_for_pod(pod, policies=POLICIES, deployments=DEPLOYMENTS)


def test_a_pod_under_admission_needs_no_name_but_a_listed_pod_does() -> None:
    """A ReplicaSet's pod has only ``generateName`` when the webhook sees it."""
    unnamed = copy.deepcopy(POD)
    del unnamed["metadata"]["name"]
    found = safetynet_webhook.plan_for_pod(unnamed, policies=POLICIES, deployments=DEPLOYMENTS)
    assert found is not None and found[0] == "p0"
    with pytest.raises(shapes.MalformedObject, match=r"metadata\.name"):
        shapes.check(shapes.LISTED_POD, unnamed, "pod")
    assert shapes.well_formed(shapes.LISTED_POD, [unnamed, POD]) == [POD]
    assert eviction_gate.pods_to_drain(shapes.well_formed(shapes.LISTED_POD, [unnamed, POD]), "node-1", set()) == [
        POD["metadata"]["name"]
    ]


@pytest.mark.parametrize(
    ("bad", "chosen"),
    [
        pytest.param({"spec": POLICIES[0]["spec"]}, "p2", id="no-metadata"),
        pytest.param(None, "p2", id="null"),
        pytest.param(changed(("metadata", "name"), ["p"], POLICIES[1]), "p2", id="name-a-list"),
        pytest.param(changed(("metadata", "creationTimestamp"), None, POLICIES[1]), "p1", id="null-timestamp-oldest"),
    ],
)
def test_policy_for_leaves_out_malformed_cached_policies(bad: Any, chosen: str) -> None:
    """Before: KeyError or TypeError (sorting a None timestamp) for every pod of the namespace."""
    found = safetynet_webhook.policy_for(
        "default", {"app": "dask-worker"}, policies=[bad, POLICIES[2]], deployments=DEPLOYMENTS
    )
    assert found is not None and found[0] == chosen


LATER = changed(("metadata", "creationTimestamp"), "2026-01-02T00:00:00Z", REQUEST)


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param({"spec": REQUEST["spec"]}, id="no-metadata"),
        pytest.param(changed(("status", "workers", 0), "dask-worker-5d8f-x1", LATER), id="entry-a-string"),
        pytest.param(changed(("status", "workers", 0, "bytesLost"), "many", LATER), id="bytes-lost-a-string"),
        pytest.param(changed(("status",), ["Draining"], LATER), id="status-a-list"),
    ],
)
def test_malformed_cached_requests_are_left_out_of_the_gates_decision(bad: Any) -> None:
    """Before: KeyError, AttributeError or ValueError out of eviction_requests or latest_request
    (here the malformed request is the newer one, which latest_request reads)."""
    requests = eviction_webhook.eviction_requests(shapes.well_formed(shapes.REQUEST, [REQUEST, bad]), "node-1")
    latest = eviction_gate.latest_request("dask-worker-5d8f-x1", requests)
    assert latest is not None and latest.name == REQUEST["metadata"]["name"]
    decision = eviction_gate.decide(pod="dask-worker-5d8f-x1", unique_bytes=10, request=latest)
    assert not decision.allowed


@pytest.mark.parametrize(
    ("body", "field"),
    [
        pytest.param(None, r"\(the object\)", id="null"),
        pytest.param({"deleteOptions": ["All"]}, "deleteOptions", id="options-a-list"),
    ],
)
def test_a_malformed_eviction_is_refused_naming_the_field(body: Any, field: str) -> None:
    with pytest.raises(shapes.MalformedObject, match=f"eviction: {field}"):
        eviction_gate.dry_run(shapes.check(shapes.EVICTION, body, "eviction"), False)
