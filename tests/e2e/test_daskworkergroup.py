"""MemoryPolicy on a dask-kubernetes DaskWorkerGroup, with dask-kubernetes' real controller.

dask-kubernetes' operator (its own Kopf controller, with kr8s as its client) runs as a process
against the sandbox's API server (with the admin's credentials), as it would against a cluster,
watching the test's namespace of the session's sandbox (its CRDs are the cluster's, applied once).
It creates the DaskCluster's scheduler, its Service and one one-replica Deployment per worker; the
real ReplicaSet controller makes their pods and the sandbox's real Nodes run them in containers of
Dask's image. memops scales the group through the policy, whose address is the Service's name
(``tcp://dk-scheduler:8786``) as the namespace's pods dial it:
the drained workers' Deployments are deleted and ``spec.worker.replicas`` lowered after, so
dask-kubernetes' replica handler has nothing left to choose and retires nobody.
"""

from __future__ import annotations

import importlib.resources
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import distributed
import pytest
from memops_sandbox import common as sandbox_cli

from tests.e2e.conftest import BIN, Sandbox
from tests.e2e.data import scatter_unique

GROUP = "dk-default"
SERVICE_IP = "10.96.0.86"
"""The scheduler Service's cluster IP, set in the DaskCluster: the sandbox has no cluster DNS, so the
workers are given the Service by its IP rather than by dask-kubernetes' DNS name for it. It is in
the lowest 256 addresses of the service range, which the API server keeps for addresses set by
hand and gives out last (KEP-3070): no other namespace's Service of the session takes it."""
ADDRESS = f"tcp://{SERVICE_IP}:8786"


def dask_cluster(workers: int) -> dict[str, Any]:
    return {
        "apiVersion": "kubernetes.dask.org/v1",
        "kind": "DaskCluster",
        "metadata": {"name": "dk"},
        "spec": {
            "scheduler": {
                "spec": {
                    "containers": [
                        {
                            "name": "scheduler",
                            "image": sandbox_cli.DASK_IMAGE,
                            "command": ["dask", "scheduler"],
                            "args": ["--no-dashboard"],
                            "ports": [{"name": "tcp-comm", "containerPort": 8786, "protocol": "TCP"}],
                        }
                    ]
                },
                "service": {
                    "type": "ClusterIP",
                    "clusterIP": SERVICE_IP,
                    "selector": {"dask.org/cluster-name": "dk", "dask.org/component": "scheduler"},
                    "ports": [{"name": "tcp-comm", "protocol": "TCP", "port": 8786, "targetPort": "tcp-comm"}],
                },
            },
            "worker": {
                "replicas": workers,
                "spec": {
                    "containers": [
                        {
                            "name": "worker",
                            "image": sandbox_cli.DASK_IMAGE,
                            # dask-kubernetes' own arguments: the worker is named by its Deployment.
                            "command": ["dask", "worker"],
                            "args": [
                                "$(DASK_SCHEDULER_ADDRESS)",
                                "--name",
                                "$(DASK_WORKER_NAME)",
                                "--nthreads",
                                "1",
                                "--memory-limit",
                                "512MiB",
                                "--no-dashboard",
                            ],
                            "env": [{"name": "DASK_SCHEDULER_ADDRESS", "value": ADDRESS}],
                            "resources": {"limits": {"memory": "768Mi"}},
                        }
                    ]
                },
            },
        },
    }


def answers_as_dask(address: str) -> bool:
    """Whether a Dask scheduler answers at ``address``: CI once met an HTTP server behind the Service's
    cluster IP, a moment after dask-kubernetes made it (the reply's first bytes read as a frame
    length of 3 EiB); the client then fails at once, and the test should wait instead."""
    try:
        with distributed.Client(address, timeout=10):
            return True
    except Exception as error:  # any failure of the handshake: not yet a Dask scheduler
        print(f"not yet a Dask scheduler at {address}: {error!r}"[:300])
        return False


DASK_KUBERNETES = "dask_kubernetes.operator.controller"


def all_established(sandbox: Sandbox) -> bool:
    crds = sandbox.get("crd")["items"]
    return all(
        any(
            c["type"] == "Established" and c["status"] == "True"
            for c in (crd.get("status") or {}).get("conditions") or []
        )
        for crd in crds
    )


@pytest.fixture
def dask_kubernetes(sandbox_factory: Any) -> Iterator[tuple[Sandbox, str]]:
    """A sandbox with dask-kubernetes' CRDs and controller, and a DaskCluster of 3 workers."""
    sandbox: Sandbox = sandbox_factory(1)
    charts = importlib.resources.files("dask_kubernetes") / "operator/deployment/helm/dask-kubernetes-operator/crds"
    sandbox.kubectl("apply", "-f", str(charts))
    # A Kopf operator started before a CRD is Established may never serve it ("Unresolved resources
    # cannot be served"): on the real API server establishing takes a moment after the create.
    # Polled, not ``kubectl wait``: on the session's shared cluster another test may have just
    # created a CRD with no conditions yet, on which ``kubectl wait crd --all`` fails at once.
    sandbox.wait_for(lambda: all_established(sandbox), 60, "every CRD Established")
    log = (sandbox.state_dir / "dask-kubernetes.log").open("ab")
    controller = subprocess.Popen(
        [str(BIN / "kopf"), "run", "--standalone", f"--namespace={sandbox.namespace}", "-m", DASK_KUBERNETES],
        stdout=log,
        stderr=log,
        env=sandbox.env,
        start_new_session=True,
    )
    try:
        sandbox.apply(dask_cluster(3))
        address = ADDRESS
        sandbox.wait_for(lambda: len(worker_deployments(sandbox)) == 3, timeout=60, what="3 worker Deployments")
        try:
            sandbox.wait_for(lambda: answers_as_dask(address), timeout=120, what=f"a Dask scheduler at {address}")
        except AssertionError as error:
            found = sandbox.kubectl("get", "services,endpointslices,pods", "-o", "wide", check=False).stdout
            raise AssertionError(f"{error}\n{found}") from None
        with distributed.Client(address, timeout=120) as client:
            client.wait_for_workers(3, timeout=120)
        yield sandbox, address
    finally:
        # While its controller runs: it holds a finalizer on the DaskCluster, which would keep the
        # namespace from going once the controller is gone.
        sandbox.kubectl("delete", "daskclusters", "--all", "--wait=true", "--timeout=60s", check=False)
        os.killpg(controller.pid, signal.SIGTERM)
        controller.wait(20)


def worker_deployments(sandbox: Sandbox) -> list[str]:
    items = sandbox.get("deployments", "-l", f"dask.org/workergroup-name={GROUP}")["items"]
    return sorted(d["metadata"]["name"] for d in items if not d["metadata"].get("deletionTimestamp"))


def group_replicas(sandbox: Sandbox) -> int:
    return int(sandbox.get("daskworkergroup", GROUP)["spec"]["worker"]["replicas"])


def controller_log(sandbox: Sandbox) -> str:
    return Path(sandbox.state_dir / "dask-kubernetes.log").read_text(errors="replace")


def test_policy_scales_a_daskworkergroup_without_dask_kubernetes_choosing(
    dask_kubernetes: tuple[Sandbox, str],
) -> None:
    sandbox, address = dask_kubernetes
    with distributed.Client(address, timeout=30) as client:
        names = sorted(str(w["name"]) for w in client.scheduler_info(n_workers=-1)["workers"].values())
        assert names == worker_deployments(sandbox), "dask-kubernetes names each worker after its Deployment"
        # The least loaded worker is the one to keep data on the others: give it the most.
        holdings = scatter_unique(client, {names[0]: 12, names[1]: 4, names[2]: 2})
        sandbox.apply(
            {
                "apiVersion": "memops.dev/v1alpha1",
                "kind": "MemoryPolicy",
                "metadata": {"name": "dk"},
                "spec": {
                    "scheduler": {"address": "tcp://dk-scheduler:8786"},
                    "workload": {"kind": "DaskWorkerGroup", "name": GROUP},
                    "replicas": 3,
                },
            }
        )
        ready = sandbox.wait_for(
            lambda: (s := sandbox.get("mempol", "dk").get("status", {})).get("replicas") == 3 and s,
            what="the policy to read the group",
        )
        assert ready["selector"] == f"dask.org/component=worker,dask.org/workergroup-name={GROUP}"

        sandbox.kubectl("scale", "mempol/dk", "--replicas=1")
        sandbox.wait_for(lambda: group_replicas(sandbox) == 1, timeout=90, what="the group's replicas lowered")
        [request] = sandbox.get("retire", "-l", "memops.dev/policy=dk")["items"]
        done = sandbox.wait_phase(request["metadata"]["name"], "Succeeded", "Failed")
        assert done["status"]["phase"] == "Succeeded", done["status"]
        scale_down = done["status"]["scaleDown"]
        # The two workers with the least unique data were chosen, and exactly their Deployments went.
        assert sorted(scale_down["deployments"]) == names[1:]
        assert (scale_down["replicasFrom"], scale_down["replicasTo"]) == (3, 1)
        assert worker_deployments(sandbox) == names[:1]
        holdings.assert_all_correct()

        # dask-kubernetes' handler ran for the new replicas, found one Deployment for one replica,
        # and neither retired nor created any worker.
        sandbox.wait_for(
            lambda: "Scaled worker group dk-default up to 1 workers" in controller_log(sandbox),
            what="dask-kubernetes' replica handler to run",
        )
        # That log line is written once the handler is done: nothing it did is still on its way.
        assert "Workers to close" not in controller_log(sandbox)
        assert worker_deployments(sandbox) == names[:1]

        # Scale-up goes through the group: dask-kubernetes creates the new worker's Deployment,
        # and the new pod gets the safety net at creation.
        sandbox.kubectl("scale", "mempol/dk", "--replicas=2")
        sandbox.wait_for(lambda: len(worker_deployments(sandbox)) == 2, timeout=60, what="a new worker Deployment")
        client.wait_for_workers(2, timeout=60)
        assert group_replicas(sandbox) == 2
        [new] = [d for d in worker_deployments(sandbox) if d not in names]
        [pod] = [
            p
            for p in sandbox.get("pods", "-l", f"dask.org/workergroup-name={GROUP}")["items"]
            if p["metadata"]["name"].startswith(new)
        ]
        assert pod["metadata"]["annotations"]["memops.dev/safety-net"] == "dk"
        assert "preStop" in pod["spec"]["containers"][0]["lifecycle"]
        holdings.assert_all_correct()
