"""What only the upstream control plane shows: a rollout of the worker Deployment (the real
Deployment controller, two ReplicaSets) under a MemoryPolicy, and GitOps through server-side
apply (the API server's field ownership)."""

from __future__ import annotations

import json
from typing import Any

import distributed
import pytest
import yaml

from tests.e2e.conftest import Sandbox
from tests.e2e.data import scatter_unique
from tests.e2e.test_policy import condition, memory_policy


def ready(sandbox: Sandbox, name: str) -> bool:
    return bool((c := condition(sandbox, name, "Ready")) and c["status"] == "True")


def replica_sets(sandbox: Sandbox) -> dict[str, int]:
    """The worker Deployment's ReplicaSets: name -> spec.replicas."""
    items = sandbox.get("replicasets", "-l", "app=dask-worker")["items"]
    return {rs["metadata"]["name"]: int(rs["spec"]["replicas"]) for rs in items}


def restart(sandbox: Sandbox, revision: str) -> None:
    """A rollout, as ``kubectl rollout restart`` makes one: a new pod template annotation."""
    patch = {"spec": {"template": {"metadata": {"annotations": {"example.com/revision": revision}}}}}
    sandbox.kubectl("patch", "deployment", "dask-worker", "--type=strategic", "-p", json.dumps(patch))


def rolled_out(sandbox: Sandbox, revision: str) -> bool:
    """Every running worker pod is of ``revision`` and the Deployment says the rollout is done."""
    deployment = sandbox.get("deployment", "dask-worker")
    status = deployment.get("status", {})
    pods = sandbox.get("pods", "-l", "app=dask-worker")["items"]
    return (
        status.get("observedGeneration") == deployment["metadata"]["generation"]
        and status.get("updatedReplicas") == status.get("replicas") == status.get("readyReplicas") == 4
        and len(pods) == 4
        and all((p["metadata"].get("annotations") or {}).get("example.com/revision") == revision for p in pods)
    )


@pytest.mark.timeout(600)  # two rollouts' waits (240 s and 300 s), on a slow machine
def test_a_rollout_under_a_policy_loses_no_key(sandbox: Sandbox) -> None:
    """The Deployment controller replaces every pod through a second ReplicaSet; each old pod that
    leaves is drained by its preStop hook (the safety net, given to the pods made under the policy),
    so the data moves ahead of the rollout and no key is lost."""
    sandbox.apply(memory_policy("rollout", sandbox.scheduler_address))  # no replicas: it adopts the count
    sandbox.wait_for(lambda: ready(sandbox, "rollout"), what="the policy Ready")
    # The sandbox's pods predate the policy: a first rollout gives every pod the safety net.
    restart(sandbox, "1")
    sandbox.wait_for(lambda: rolled_out(sandbox, "1"), timeout=240, what="the first rollout")
    pods = sandbox.pods()
    for pod in pods:
        assert sandbox.get("pod", pod)["metadata"]["annotations"]["memops.dev/safety-net"] == "rollout"
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        sandbox.wait_for(
            lambda: {str(w["name"]) for w in client.scheduler_info(n_workers=-1)["workers"].values()} == set(pods),
            what="the rolled-out pods' workers",
        )
        holdings = scatter_unique(client, dict.fromkeys(pods, 4))
        restart(sandbox, "2")
        sandbox.wait_for(lambda: len(replica_sets(sandbox)) >= 3, what="the rollout's new ReplicaSet")
        sandbox.wait_for(lambda: rolled_out(sandbox, "2"), timeout=300, what="the second rollout")
        assert not set(pods) & set(sandbox.pods()), "every old pod was replaced"
        holdings.assert_all_correct()
    assert sorted(replica_sets(sandbox).values()) == [0, 0, 4], "the old ReplicaSets scaled to zero"
    assert sandbox.replicas() == 4


def field_owners(body: dict[str, Any], *path: str) -> list[str]:
    """The managers that own the field at ``path`` (e.g. "spec", "replicas") per managedFields."""
    owners = []
    for entry in body["metadata"].get("managedFields", []):
        node = entry.get("fieldsV1", {})
        for key in path:
            node = node.get(f"f:{key}")
            if node is None:
                break
        else:
            owners.append(str(entry["manager"]))
    return owners


def test_gitops_server_side_apply_and_kubectl_scale(sandbox: Sandbox) -> None:
    """Flux applies the policy server-side without spec.replicas (the recommended setup); a person
    scales it with ``kubectl scale``; Flux's next apply leaves the count. A manifest that sets
    spec.replicas takes it back without a conflict: the API server records no owner for a write
    through a custom resource's /scale."""
    pods = sandbox.pods()
    manifest = memory_policy("gitops", sandbox.scheduler_address)

    def flux_apply(body: dict[str, Any]) -> None:
        sandbox.kubectl("apply", "--server-side", "--field-manager=flux", "-f", "-", input=yaml.safe_dump(body))

    def managed() -> dict[str, Any]:
        return json.loads(sandbox.kubectl("get", "mempol", "gitops", "-o", "json", "--show-managed-fields").stdout)

    flux_apply(manifest)
    sandbox.wait_for(lambda: ready(sandbox, "gitops"), what="the policy Ready")
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        holdings = scatter_unique(client, dict.fromkeys(pods, 3))
        sandbox.kubectl("scale", "mempol/gitops", "--replicas=3")
        sandbox.wait_for(lambda: sandbox.replicas() == 3 and len(sandbox.pods()) == 3, what="the drained scale-down")
        holdings.assert_all_correct()
    policy = managed()
    assert field_owners(policy, "spec", "replicas") == [], policy["metadata"]["managedFields"]
    assert field_owners(policy, "spec", "scheduler") == ["flux"], "Flux keeps what it applied"

    flux_apply(manifest)  # Flux's next reconciliation: the same manifest
    assert sandbox.get("mempol", "gitops")["spec"]["replicas"] == 3, "the hand scale stands"

    flux_apply(memory_policy("gitops", sandbox.scheduler_address, replicas=4))  # no conflict to stop it
    assert field_owners(managed(), "spec", "replicas") == ["flux"]
    sandbox.wait_for(lambda: sandbox.replicas() == 4, what="Git's count back on the Deployment")
