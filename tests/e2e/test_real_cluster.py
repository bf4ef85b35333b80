"""Opt-in: the sandbox suite's scenarios against a real Kubernetes cluster (``pytest -m cluster``),
with unique data on the workers and zero keys lost as the verdict.

Needs, and skips with the reason (printed, and in pytest's summary) when any is missing:

- ``KUBECONFIG`` pointing at a cluster that answers, where memops' CRDs are installed and the
  operator runs (Helm chart or kustomize, webhook enabled);
- a Deployment of Dask workers (``MEMOPS_E2E_WORKLOAD``, default ``dask-worker``) in
  ``MEMOPS_E2E_NAMESPACE`` (default: the kubeconfig's namespace) with at least two replicas,
  each worker named after its pod (``dask worker --name $(POD_NAME)``), as the sandbox's are;
- ``MEMOPS_E2E_SCHEDULER``: the scheduler's address as the operator reaches it (e.g.
  ``tcp://dask-scheduler:8786``), and ``MEMOPS_E2E_CLIENT_SCHEDULER``: as this machine reaches it
  (e.g. through ``kubectl port-forward svc/dask-scheduler 8786``; default: the same address).

Each scenario leaves the Deployment at the replicas it found. None of this can run in CI, which
has no cluster; there, ``pytest -m cluster`` collects these tests and skips them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import distributed
import pytest
import yaml

from tests import polling
from tests.e2e import windows
from tests.e2e.data import Holdings, scatter_unique, workers_by_name

pytestmark = pytest.mark.cluster
KUBECTL = str(Path(sys.executable).parent / "kubectl")
POLICIES = ("e2e-scale", "e2e-net")  # the MemoryPolicies these tests make, and delete after each


def kubectl(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([KUBECTL, *args], input=stdin, capture_output=True, text=True, timeout=60)


def skip(reason: str) -> NoReturn:
    print(f"\nskipped: {reason}")
    pytest.skip(reason)


@dataclass
class RealCluster:
    namespace: str
    workload: str
    scheduler: str  # as the operator reaches it
    client_scheduler: str  # as this machine reaches it

    def kubectl(self, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        result = kubectl("-n", self.namespace, *args, stdin=stdin)
        assert result.returncode == 0, f"kubectl {' '.join(args)}: {result.stderr}"
        return result

    def get(self, *what: str) -> Any:
        return json.loads(self.kubectl("get", *what, "-o", "json").stdout)

    def apply(self, manifest: dict[str, Any]) -> None:
        self.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(manifest))

    def replicas(self) -> int:
        return int(self.get("deployment", self.workload)["spec"]["replicas"])

    def pods(self) -> list[str]:
        selector = self.get("deployment", self.workload)["spec"]["selector"]["matchLabels"]
        labels = ",".join(f"{k}={v}" for k, v in selector.items())
        items = self.get("pods", "-l", labels)["items"]
        return sorted(p["metadata"]["name"] for p in items if not p["metadata"].get("deletionTimestamp"))

    def wait_for(self, predicate: Callable[[], Any], timeout: float = 300, what: str = "condition") -> Any:
        return polling.wait_for(predicate, timeout=timeout, what=what, interval=1)

    def wait_for_workers(self, client: distributed.Client, pods: list[str]) -> None:
        self.wait_for(lambda: set(pods) <= set(workers_by_name(client)), what=f"workers {pods} in the scheduler")

    def policy(self, name: str, **spec: Any) -> dict[str, Any]:
        return {
            "apiVersion": "memops.dev/v1alpha1",
            "kind": "MemoryPolicy",
            "metadata": {"name": name, "namespace": self.namespace},
            "spec": {
                "scheduler": {"address": self.scheduler},
                "workload": {"kind": "Deployment", "name": self.workload},
                **spec,
            },
        }

    def condition(self, kind: str, name: str, condition: str) -> dict[str, Any] | None:
        status = self.get(kind, name).get("status", {})
        return next((c for c in status.get("conditions", []) if c["type"] == condition), None)


def reachable_cluster() -> RealCluster:
    """The cluster, or a skip that says what is missing."""
    if not os.environ.get("KUBECONFIG"):
        skip("no real cluster: KUBECONFIG is not set")
    if kubectl("version", "--request-timeout=5s").returncode != 0:
        skip(f"no real cluster: the API server in KUBECONFIG ({os.environ['KUBECONFIG']}) does not answer")
    for crd in ("retirementrequests.memops.dev", "memorypolicies.memops.dev"):
        if kubectl("get", "crd", crd).returncode != 0:
            skip(f"memops' CRD {crd} is not installed in this cluster (kubectl apply -f crds/)")
    scheduler = os.environ.get("MEMOPS_E2E_SCHEDULER")
    if not scheduler:
        skip("MEMOPS_E2E_SCHEDULER (the Dask scheduler's address as the operator reaches it) is not set")
    context = kubectl("config", "view", "--minify", "-o", "jsonpath={..namespace}").stdout.strip()
    namespace = os.environ.get("MEMOPS_E2E_NAMESPACE") or context or "default"
    workload = os.environ.get("MEMOPS_E2E_WORKLOAD", "dask-worker")
    deployment = kubectl("-n", namespace, "get", "deployment", workload, "-o", "json")
    if deployment.returncode != 0:
        skip(f"no Deployment {workload!r} in namespace {namespace!r} (MEMOPS_E2E_WORKLOAD, MEMOPS_E2E_NAMESPACE)")
    replicas = json.loads(deployment.stdout)["spec"]["replicas"]
    if replicas < 2:
        skip(f"Deployment {workload!r} needs at least 2 replicas, has {replicas}")
    return RealCluster(namespace, workload, scheduler, os.environ.get("MEMOPS_E2E_CLIENT_SCHEDULER") or scheduler)


@pytest.fixture
def real_cluster() -> Iterator[RealCluster]:
    found = reachable_cluster()
    replicas = found.replicas()
    yield found
    found.kubectl("delete", "mempol", *POLICIES, "--ignore-not-found", "--wait=true")
    found.kubectl("scale", f"deployment/{found.workload}", f"--replicas={replicas}")


@pytest.fixture
def client(real_cluster: RealCluster) -> Iterator[distributed.Client]:
    try:
        dask_client = distributed.Client(real_cluster.client_scheduler, timeout=30)
    except OSError as exc:
        where = real_cluster.client_scheduler
        skip(f"the scheduler at {where} does not answer here (MEMOPS_E2E_CLIENT_SCHEDULER): {exc}")
    with dask_client:
        yield dask_client


def assert_nothing_lost(holdings: Holdings) -> None:
    assert holdings.lost() == [], "keys were lost"
    holdings.assert_all_correct()


def test_retirement_request_drains_data_before_removing_a_pod(
    real_cluster: RealCluster, client: distributed.Client
) -> None:
    pods = real_cluster.pods()
    real_cluster.wait_for_workers(client, pods)
    holdings = scatter_unique(client, dict.fromkeys(pods, 4))
    name = f"e2e-{int(time.time())}"
    real_cluster.apply(
        {
            "apiVersion": "memops.dev/v1alpha1",
            "kind": "RetirementRequest",
            "metadata": {"name": name, "namespace": real_cluster.namespace},
            "spec": {
                "scheduler": {"address": real_cluster.scheduler},
                "workload": {"kind": "Deployment", "name": real_cluster.workload},
                "count": 1,
                "timeout": "5m",
            },
        }
    )
    done = real_cluster.wait_for(
        lambda: (r := real_cluster.get("retire", name)).get("status", {}).get("phase") in ("Succeeded", "Failed") and r,
        what=f"RetirementRequest {name} to finish",
    )
    assert done["status"]["phase"] == "Succeeded", done["status"]
    real_cluster.wait_for(lambda: len(real_cluster.pods()) == len(pods) - 1, what="the drained pod gone")
    assert real_cluster.replicas() == len(pods) - 1
    assert_nothing_lost(holdings)


def test_scaling_the_policy_down_drains_first(real_cluster: RealCluster, client: distributed.Client) -> None:
    pods = real_cluster.pods()
    real_cluster.wait_for_workers(client, pods)
    holdings = scatter_unique(client, dict.fromkeys(pods, 4))
    real_cluster.apply(real_cluster.policy("e2e-scale", replicas=len(pods)))
    real_cluster.wait_for(
        lambda: (c := real_cluster.condition("mempol", "e2e-scale", "Ready")) and c["status"] == "True", what="Ready"
    )
    real_cluster.kubectl("scale", "mempol/e2e-scale", f"--replicas={len(pods) - 1}")
    real_cluster.wait_for(
        lambda: real_cluster.replicas() == len(pods) - 1 and len(real_cluster.pods()) == len(pods) - 1,
        what="the scale-down",
    )
    assert_nothing_lost(holdings)


def test_safety_net_drains_a_direct_deployment_scale_down(
    real_cluster: RealCluster, client: distributed.Client
) -> None:
    """Around memops: `kubectl scale deployment`. The pods created under the policy carry the
    webhook's preStop drain, which runs as the real kubelet runs it, in the worker's container."""
    before = real_cluster.pods()
    real_cluster.apply(real_cluster.policy("e2e-net"))  # no replicas: the policy adopts the Deployment's count
    real_cluster.wait_for(
        lambda: (c := real_cluster.condition("mempol", "e2e-net", "Ready")) and c["status"] == "True", what="Ready"
    )
    real_cluster.kubectl("scale", f"deployment/{real_cluster.workload}", f"--replicas={len(before) + 1}")
    [new] = real_cluster.wait_for(lambda: [p for p in real_cluster.pods() if p not in before], what="the new pod")
    annotations = real_cluster.get("pod", new)["metadata"].get("annotations") or {}
    assert annotations.get("memops.dev/safety-net") == "e2e-net", "the webhook did not mutate the new pod"
    real_cluster.wait_for_workers(client, [*before, new])
    holdings = scatter_unique(client, {new: 6, **dict.fromkeys(before, 2)})
    # The ReplicaSet removes the newest pod first, all else equal: the one with the net and the data.
    real_cluster.kubectl("scale", f"deployment/{real_cluster.workload}", f"--replicas={len(before)}")
    real_cluster.wait_for(
        lambda: new not in real_cluster.pods() and len(real_cluster.pods()) == len(before), what="the pod gone"
    )
    assert_nothing_lost(holdings)
    # The policy reads the kubelet's FailedPreStopHook events every so often: a failed hook would
    # show in a later read, not at once.
    polling.stays(
        lambda: not (real_cluster.get("mempol", "e2e-net").get("status", {}).get("safetyNet") or {}).get("failedHooks"),
        seconds=windows.HOOK_READ,
        what="no failed preStop hook in the policy's status",
    )
