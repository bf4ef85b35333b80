"""Fuzzing what the admission webhooks decide from: the safety net's pod mutation and the
eviction gate's reading of the Eviction, the pod, the workload's pods and the RetirementRequests.

Each input is a real object (a worker pod, an Eviction, an Eviction RetirementRequest, a policy)
with fields replaced, removed, wrapped in lists or blown up. The pure parts that the handlers
call must return a decision, or raise :class:`memops.decisions.shapes.MalformedObject`, which the handler
turns into a response (the safety net: the pod is created as it is; the gate: refused, 400);
malformed cached objects are left out. Never a TypeError, KeyError or AttributeError, which Kopf
would answer with a 500 refusal: a pod that cannot be created, an eviction refused for a crash.

The gate's handler mixes these with its I/O (the pod's GET, the scheduler's answer, the request's
creation); the pure parts are tested here, in the order it calls them.
"""

from __future__ import annotations

import copy
import time
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memops import specs
from memops.controllers import eviction_webhook, safetynet_webhook
from memops.decisions import eviction_gate, shapes
from tests.fuzz import strategies

BUDGET = settings(
    max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), database=None
)
"""About a second of CPU per test: derandomized, the same examples in every run."""
SLOW_SECONDS = 2.0
HOST_ROOTS = frozenset({"/var/lib/memops"})

POD: dict[str, Any] = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {
        "name": "dask-worker-5d8f-x1",
        "namespace": "default",
        "labels": {"app": "dask-worker"},
        "annotations": {"note": "kept"},
        "creationTimestamp": "2026-01-01T00:00:00Z",
    },
    "spec": {
        "terminationGracePeriodSeconds": 30,
        "nodeName": "node-1",
        "containers": [
            {
                "name": "worker",
                "command": ["dask", "worker"],
                "args": ["tcp://dask-scheduler:8786", "--memory-limit", "3GiB", "--nworkers", "1"],
                "env": [{"name": "A", "value": "1"}, {"name": "MEMOPS_OLD", "value": "x"}],
                "resources": {"limits": {"memory": "4Gi", "cpu": "1"}, "requests": {"memory": "4Gi", "cpu": "1"}},
                "volumeMounts": [{"name": "data", "mountPath": "/data"}],
            },
            {"name": "sidecar", "image": "busybox", "lifecycle": {"preStop": {"exec": {"command": ["true"]}}}},
        ],
        "initContainers": [{"name": "init", "resources": {"limits": {"memory": "1Gi"}}}],
        "volumes": [{"name": "data", "emptyDir": {}}],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{"matchExpressions": [{"key": "k", "operator": "In", "values": ["v"]}]}]
                }
            }
        },
    },
    "status": {"phase": "Running"},
}
DEPLOYMENT = {
    "metadata": {"name": "dask-worker", "namespace": "default"},
    "spec": {"selector": {"matchLabels": {"app": "dask-worker"}}},
}
POLICIES = [
    {
        "metadata": {"name": f"p{i}", "namespace": "default", "creationTimestamp": f"2026-01-0{i % 9 + 1}T00:00:00Z"},
        "spec": {**spec, "workload": {"kind": "Deployment", "name": "dask-worker"}},
    }
    for i, spec in enumerate(strategies.example_specs("MemoryPolicy"))
]
EVICTION = {
    "apiVersion": "policy/v1",
    "kind": "Eviction",
    "metadata": {"name": "dask-worker-5d8f-x1", "namespace": "default"},
    "deleteOptions": {"dryRun": ["All"], "gracePeriodSeconds": 30},
}
REQUEST = {
    "metadata": {
        "name": "evict-node-1-0123456789",
        "namespace": "default",
        "creationTimestamp": "2026-01-01T00:00:00Z",
        "labels": {
            eviction_gate.REASON_LABEL: eviction_gate.EVICTION,
            eviction_gate.NODE_LABEL: eviction_gate.node_label("node-1"),
        },
    },
    "spec": {"workers": ["dask-worker-5d8f-x1", "dask-worker-5d8f-x2"], "onTimeout": "Abort", "removePods": False},
    "status": {
        "phase": "Draining",
        "deadline": "2026-01-01T00:10:00Z",
        "message": "draining",
        "workers": [{"pod": "dask-worker-5d8f-x1", "state": "Kept", "bytesLost": 0, "message": "no room"}],
    },
}


def bounded(call: Any) -> Any:
    started = time.perf_counter()
    try:
        return call()
    finally:
        elapsed = time.perf_counter() - started
        assert elapsed < SLOW_SECONDS, f"{elapsed:.2f} s"


def safety_net(pod: Any, policies: list[Any], deployments: list[Any]) -> None:
    try:
        planned = bounded(
            lambda: safetynet_webhook.plan_for_pod(
                pod, policies=policies, deployments={("default", "dask-worker"): deployments}, host_roots=HOST_ROOTS
            )
        )
    except shapes.MalformedObject:
        return
    if planned is not None:
        name, change = planned
        assert isinstance(name, str) and isinstance(change["spec"], dict) and isinstance(change["annotations"], dict)


@BUDGET
@given(data=st.data())
def test_safety_net_mutated_pods(data: st.DataObject) -> None:
    safety_net(data.draw(strategies.mutated([POD], mutations=4)), POLICIES, [DEPLOYMENT])


@BUDGET
@given(data=st.data())
def test_safety_net_arbitrary_pods(data: st.DataObject) -> None:
    safety_net(data.draw(strategies.json_values), POLICIES, [DEPLOYMENT])


@BUDGET
@given(data=st.data())
def test_safety_net_mutated_caches(data: st.DataObject) -> None:
    policies = data.draw(st.lists(strategies.mutated(POLICIES, mutations=2), max_size=3))
    deployments = data.draw(st.lists(strategies.mutated([DEPLOYMENT], mutations=2), max_size=2))
    safety_net(copy.deepcopy(POD), policies, deployments)


def gate(eviction_body: Any, pod: Any, requests: list[Any], pods: list[Any], held: int | None) -> None:
    """The gate's pure steps, in its order; MalformedObject for the Eviction or the pod is its 400."""
    try:
        dry_run = eviction_gate.dry_run(shapes.check(shapes.EVICTION, eviction_body, "eviction"), False)
        shapes.check(shapes.LISTED_POD, pod, "pod")
    except shapes.MalformedObject:
        return
    assert isinstance(dry_run, bool)
    name = str((pod.get("metadata") or {}).get("name") or "")
    found = safetynet_webhook.policy_for(
        "default",
        dict((pod.get("metadata") or {}).get("labels") or {}),
        policies=POLICIES,
        deployments={("default", "dask-worker"): [DEPLOYMENT]},
    )
    node = str((pod.get("spec") or {}).get("nodeName") or "")
    mine = eviction_webhook.eviction_requests(shapes.well_formed(shapes.REQUEST, requests), node)
    latest = eviction_gate.latest_request(name, mine)
    decision = bounded(lambda: eviction_gate.decide(pod=name, unique_bytes=held, request=latest, dry_run=dry_run))
    assert isinstance(decision, eviction_gate.Decision) and decision.message
    assert found is None or isinstance(found[1], specs.MemoryPolicySpec)
    drained = eviction_gate.pods_to_drain(shapes.well_formed(shapes.LISTED_POD, pods), node, set())
    assert all(isinstance(p, str) for p in drained)


held_bytes = st.one_of(st.none(), st.integers(min_value=0, max_value=2**63))


@BUDGET
@given(data=st.data())
def test_eviction_gate_mutated_inputs(data: st.DataObject) -> None:
    gate(
        data.draw(strategies.mutated([EVICTION])),
        data.draw(st.one_of(st.just(copy.deepcopy(POD)), strategies.mutated([POD]))),
        data.draw(st.lists(strategies.mutated([REQUEST], mutations=3), max_size=3)),
        data.draw(st.lists(strategies.mutated([POD], mutations=2), max_size=3)),
        data.draw(held_bytes),
    )


@BUDGET
@given(data=st.data())
def test_eviction_gate_arbitrary_inputs(data: st.DataObject) -> None:
    gate(
        data.draw(strategies.json_values),
        data.draw(strategies.json_values),
        data.draw(st.lists(strategies.json_values, max_size=3)),
        data.draw(st.lists(strategies.json_values, max_size=3)),
        data.draw(held_bytes),
    )
