"""MemoryPolicy end to end: scaling through the policy drains first, and bad policies say why."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from typing import Any

import distributed
import pytest

from tests import polling
from tests.e2e import windows
from tests.e2e.conftest import Sandbox
from tests.e2e.data import scatter_unique


def memory_policy(name: str, address: str, workload: str = "dask-worker", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "memops.dev/v1alpha1",
        "kind": "MemoryPolicy",
        "metadata": {"name": name},
        "spec": {"scheduler": {"address": address}, "workload": {"kind": "Deployment", "name": workload}, **spec},
    }


def condition(sandbox: Sandbox, name: str, kind: str) -> dict[str, Any] | None:
    status = sandbox.get("mempol", name).get("status", {})
    return next((c for c in status.get("conditions", []) if c["type"] == kind), None)


def owned_requests(sandbox: Sandbox, policy: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = sandbox.get("retire", "-l", f"memops.dev/policy={policy}")["items"]
    return items


def test_kubectl_scale_on_the_policy_drains_then_scales(sandbox: Sandbox) -> None:
    pods = sandbox.pods()
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        holdings = scatter_unique(client, dict.fromkeys(pods, 5))
        sandbox.apply(memory_policy("analytics", sandbox.scheduler_address, replicas=4))
        sandbox.wait_for(
            lambda: (c := condition(sandbox, "analytics", "Ready")) and c["status"] == "True",
            what="the policy to be Ready",
        )

        sandbox.kubectl("scale", "mempol/analytics", "--replicas=2")
        sandbox.wait_for(lambda: sandbox.replicas() == 2 and len(sandbox.pods()) == 2, what="a drained scale-down")
        [request] = owned_requests(sandbox, "analytics")
        owner = request["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["name"], owner["controller"]) == ("MemoryPolicy", "analytics", True)
        done = sandbox.wait_phase(request["metadata"]["name"], "Succeeded", "Failed")
        assert done["status"]["phase"] == "Succeeded"
        assert done["status"]["bytesMoved"] >= 10 * 256 * 1024
        holdings.assert_all_correct()

        sandbox.kubectl("patch", "mempol/analytics", "--type=merge", "-p", '{"spec":{"replicas":3}}')
        sandbox.wait_for(lambda: sandbox.replicas() == 3, what="a scale-up through spec.replicas")
        status = sandbox.wait_for(
            lambda: (s := sandbox.get("mempol", "analytics")["status"]).get("replicas") == 3 and s, what="status"
        )
        assert status["desiredReplicas"] == 3 and status["lastScaleReason"] == "ScaleUp"
        assert status["selector"] == "app=dask-worker"
        polling.stays(
            lambda: len(owned_requests(sandbox, "analytics")) == 1 and sandbox.replicas() == 3,
            seconds=windows.POLICY_PASS,
            what="the scale-up made no RetirementRequest and the count stays",
        )
        holdings.assert_all_correct()


def test_bad_and_conflicting_policies_are_reported_and_the_good_one_keeps_working(sandbox: Sandbox) -> None:
    address = sandbox.scheduler_address
    sandbox.apply(memory_policy("first", address, replicas=4))
    sandbox.wait_for(lambda: (c := condition(sandbox, "first", "Ready")) and c["status"] == "True", what="first Ready")
    sandbox.apply(memory_policy("second", address, replicas=1))
    sandbox.apply(memory_policy("ghost", address, workload="no-such-workers", replicas=1))
    sandbox.apply(memory_policy("far", "tcp://127.0.0.1:9", workload="no-such-workers"))
    refused = sandbox.apply(memory_policy("negative", address, replicas=-1), check=False)
    assert refused.returncode != 0 and "spec.replicas" in refused.stderr

    conflict = sandbox.wait_for(lambda: condition(sandbox, "second", "Conflict"), what="the Conflict condition")
    assert conflict["status"] == "True" and conflict["message"].startswith("spec.workload:")
    ready = condition(sandbox, "second", "Ready")
    assert ready is not None and ready["status"] == "False"
    ghost = sandbox.wait_for(lambda: condition(sandbox, "ghost", "Ready"), what="ghost's Ready condition")
    assert ghost["status"] == "False" and ghost["message"].startswith("spec.workload.name:")

    hpa = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "direct"},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "dask-worker"},
            "minReplicas": 1,
            "maxReplicas": 4,
        },
    }
    sandbox.apply(hpa)
    flagged = sandbox.wait_for(
        lambda: (c := condition(sandbox, "first", "Conflict")) and c["status"] == "True" and c, what="HPA conflict"
    )
    assert "HorizontalPodAutoscaler direct" in flagged["message"]

    polling.stays(
        lambda: sandbox.replicas() == 4, seconds=windows.POLICY_PASS, what="the younger conflicting policy does not act"
    )
    sandbox.kubectl("scale", "mempol/first", "--replicas=3")
    sandbox.wait_for(lambda: sandbox.replicas() == 3 and len(sandbox.pods()) == 3, what="first still serves")


@pytest.mark.quiet("it kills the operator, whose Deployment starts another: no other test runs meanwhile")
def test_operator_restart_during_a_policy_scale_down(sandbox_factory: Callable[..., Sandbox]) -> None:
    sandbox = sandbox_factory(3)
    pods = sandbox.pods()
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        holdings = scatter_unique(client, {pods[0]: 1, pods[1]: 4, pods[2]: 4})
        sandbox.apply(memory_policy("restart", sandbox.scheduler_address, replicas=3))
        sandbox.wait_for(lambda: condition(sandbox, "restart", "Ready"), what="the policy")
        frozen = [pods[1], pods[2]]
        for pod in frozen:  # the recipients stop answering: the drain stays in progress
            sandbox.signal_pod(pod, signal.SIGSTOP)
        try:
            sandbox.kubectl("scale", "mempol/restart", "--replicas=2")
            request = sandbox.wait_for(lambda: owned_requests(sandbox, "restart"), what="the owned request")[0]
            sandbox.wait_phase(request["metadata"]["name"], "Draining")
            sandbox.kill_operator()
        finally:
            for pod in frozen:
                sandbox.signal_pod(pod, signal.SIGCONT)
        sandbox.start_operator()  # its Deployment's one replica
        done = sandbox.wait_phase(request["metadata"]["name"], "Succeeded", "Failed")
        assert done["status"]["phase"] == "Succeeded", done["status"]
        sandbox.wait_for(lambda: sandbox.replicas() == 2 and len(sandbox.pods()) == 2, what="the scale-down")
        polling.stays(
            lambda: len(owned_requests(sandbox, "restart")) == 1 and sandbox.replicas() == 2,
            seconds=windows.POLICY_PASS,
            what="the restarted operator does not drain twice",
        )
        assert sandbox.pods() == pods[1:]
        holdings.assert_all_correct()


def test_memory_driven_autoscaling_up_then_down_without_loss(sandbox_factory: Callable[..., Sandbox]) -> None:
    sandbox = sandbox_factory(2)
    pods = sandbox.pods()
    # No scale-down while the data arrives: a scale-up after the first worker's share, measured
    # before the second's has landed, would be followed by a scale-down of the worker being written
    # to. The window is shortened once the data is gone.
    behavior = {
        "scaleDown": {
            "stabilizationWindowSeconds": 600,
            "policies": [{"type": "Percent", "value": 100, "periodSeconds": 15}],
        }
    }
    sandbox.apply(
        memory_policy(
            "elastic",
            sandbox.scheduler_address,
            autoscale={"minReplicas": 2, "maxReplicas": 5, "targetMemoryUtilization": 30, "behavior": behavior},
        )
    )
    sandbox.wait_for(
        lambda: (sandbox.get("mempol", "elastic").get("status", {}).get("memory") or {}).get("workers"),
        what="memory in the status",
    )
    polling.stays(lambda: sandbox.replicas() == 2, seconds=windows.POLICY_PASS, what="idle workers stay at minReplicas")
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        kept = scatter_unique(client, dict.fromkeys(pods, 2), size=8 * 2**20)
        bulk = scatter_unique(client, dict.fromkeys(pods, 40), size=8 * 2**20)  # ~40% of each 1 GiB worker
        sandbox.wait_for(lambda: sandbox.replicas() >= 3, timeout=60, what="a memory-driven scale-up")
        grown = sandbox.get("mempol", "elastic")["status"]
        assert grown["lastScaleReason"] == "ScaleUp" and grown["memory"]["percent"] > 0
        # The scale-down's window is 600 s: no request may come while the data is there.
        polling.stays(
            lambda: owned_requests(sandbox, "elastic") == [],
            seconds=windows.POLICY_PASS,
            what="scaling up needs no drain",
        )

        del bulk  # the memory shrinks: the policy scales back down, through a drain
        short = {"spec": {"autoscale": {"behavior": {"scaleDown": {"stabilizationWindowSeconds": 5}}}}}
        sandbox.kubectl("patch", "mempol/elastic", "--type=merge", "-p", json.dumps(short))
        sandbox.wait_for(
            lambda: sandbox.replicas() == 2 and len(sandbox.pods()) == 2,
            timeout=90,
            what="the scale-down after the stabilization window",
        )
        requests = sandbox.wait_for(
            lambda: (
                (rs := owned_requests(sandbox, "elastic"))
                and all(r.get("status", {}).get("phase") in ("Succeeded", "Failed") for r in rs)
                and rs
            ),
            what="the policy's drains to finish",
        )
        assert all(r["status"]["phase"] == "Succeeded" for r in requests), requests
        kept.assert_all_correct()
        status = sandbox.get("mempol", "elastic")["status"]
        assert status["desiredReplicas"] >= 2
        assert {c["type"]: c["status"] for c in status["conditions"]}["Ready"] == "True"


def test_safety_net_drains_pods_that_a_direct_scale_down_removes(sandbox: Sandbox) -> None:
    """Someone scales the Deployment itself, around memops: the webhook's preStop hook drains."""
    sandbox.apply(memory_policy("net", sandbox.scheduler_address))  # no replicas: the policy adopts the count
    sandbox.wait_for(lambda: (c := condition(sandbox, "net", "Ready")) and c["status"] == "True", what="Ready")
    before = sandbox.pods()
    sandbox.kubectl("scale", "deployment/dask-worker", "--replicas=6")
    sandbox.wait_for(lambda: len(sandbox.pods()) == 6, what="two new pods")
    new = [p for p in sandbox.pods() if p not in before]
    for pod in new:
        body = sandbox.get("pod", pod)
        assert body["metadata"]["annotations"]["memops.dev/safety-net"] == "net"
        assert body["spec"]["terminationGracePeriodSeconds"] == 600 + 30
        assert "preStop" in body["spec"]["containers"][0]["lifecycle"]
    assert "memops.dev/safety-net" not in (sandbox.get("pod", before[0])["metadata"].get("annotations") or {})
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        sandbox.wait_for(lambda: len(client.scheduler_info(n_workers=-1)["workers"]) == 6, what="six workers")
        holdings = scatter_unique(client, dict.fromkeys(new, 6))
        # The ReplicaSet controller ranks pods by pod-deletion-cost, then by how many of its pods
        # share their node, and only then removes the newest: the old pods cost more, so it removes
        # exactly the two new ones, those with the net, wherever the scheduler placed them.
        for pod in before:
            sandbox.kubectl("annotate", "pod", pod, "controller.kubernetes.io/pod-deletion-cost=100")
        sandbox.kubectl("scale", "deployment/dask-worker", "--replicas=4")
        sandbox.wait_for(lambda: sorted(sandbox.pods()) == sorted(before), timeout=120, what="the new pods gone")
        holdings.assert_all_correct()
    polling.stays(
        lambda: sandbox.replicas() == 4,
        seconds=windows.POLICY_PASS,
        what="the policy adopted the new count instead of fighting it",
    )
