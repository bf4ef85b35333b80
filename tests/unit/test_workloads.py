"""Which pods a workload has and what its workers are called: Deployment and DaskWorkerGroup."""

from typing import Any

import pytest

from memops.controllers import workloads
from memops.decisions import snapshots


def group(replicas: int) -> dict[str, Any]:
    return {
        "apiVersion": "kubernetes.dask.org/v1",
        "kind": "DaskWorkerGroup",
        "metadata": {"name": "dk-default"},
        "spec": {"cluster": "dk", "worker": {"replicas": replicas, "spec": {}}},
    }


def deployment(replicas: int) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "dask-worker"},
        "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": "dask-worker"}}},
    }


def test_replicas_and_selector_of_either_kind() -> None:
    assert workloads.replicas_of(deployment(4)) == 4
    assert workloads.replicas_of(group(3)) == 3
    assert workloads.selector(deployment(4)) == "app=dask-worker"
    # The labels dask-kubernetes puts on each worker Deployment's pods.
    assert workloads.selector(group(3)) == "dask.org/component=worker,dask.org/workergroup-name=dk-default"


def pod(name: str, env: list[dict[str, Any]]) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"containers": [{"name": "worker", "env": env}]}}


def test_dask_kubernetes_workers_are_named_after_their_deployment_and_map_back_to_their_pod() -> None:
    pods = [
        pod("dk-default-worker-aa-5f9c-x1", [{"name": "DASK_WORKER_NAME", "value": "dk-default-worker-aa"}]),
        pod("dask-worker-7d-abcde", [{"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]),
    ]
    assert workloads.worker_names(pods) == {"dk-default-worker-aa": "dk-default-worker-aa-5f9c-x1"}
    snapshot = snapshots.SchedulerSnapshot(
        (
            snapshots.WorkerInfo("dk-default-worker-aa", "tcp://a:1", unique_bytes=5),
            snapshots.WorkerInfo("dask-worker-7d-abcde", "tcp://b:1"),
        )
    )
    named = snapshot.named_by_pod(workloads.worker_names(pods))
    worker = named.by_name("dk-default-worker-aa-5f9c-x1")
    assert worker is not None and worker.address == "tcp://a:1" and worker.unique_bytes == 5
    assert named.by_name("dask-worker-7d-abcde") is not None
    assert named.by_name("dk-default-worker-aa") is None


def worker_deployment(labels: dict[str, str]) -> dict[str, Any]:
    return {"metadata": {"name": "dk-default-worker-aa", "labels": labels}}


@pytest.mark.parametrize(
    ("labels", "refused"),
    [
        pytest.param(
            {"dask.org/workergroup-name": "dk-default", "dask.org/cluster-name": "dk"}, None, id="the-group's"
        ),
        pytest.param(
            {"dask.org/workergroup-name": "other", "dask.org/cluster-name": "dk"},
            "dask.org/workergroup-name='other' (want 'dk-default')",
            id="another-group",
        ),
        pytest.param(
            {"dask.org/workergroup-name": "dk-default"},
            "dask.org/cluster-name=None (want 'dk')",
            id="no-cluster-label",
        ),
        pytest.param({}, "is not a worker Deployment of DaskWorkerGroup 'dk-default'", id="unlabelled"),
    ],
)
def test_only_deployments_labelled_as_the_groups_are_deleted(labels: dict[str, str], refused: str | None) -> None:
    why = workloads.foreign_deployment(worker_deployment(labels), group(1))
    assert why is None if refused is None else refused in (why or "")


def test_pod_info_reads_the_pod_ips_and_the_dask_worker_name() -> None:
    body = pod("dk-default-worker-aa-x1", [{"name": "DASK_WORKER_NAME", "value": "dk-default-worker-aa"}])
    body["status"] = {"phase": "Running", "podIP": "10.0.0.1", "podIPs": [{"ip": "10.0.0.1"}, {"ip": "fd00::1"}]}
    body["spec"]["nodeName"] = "node-a"
    assert workloads.pod_info(body) == snapshots.PodInfo(
        "dk-default-worker-aa-x1", ("10.0.0.1", "fd00::1"), ("dk-default-worker-aa",), "Running", node="node-a"
    )


def test_a_selector_with_match_expressions_selects_only_its_pods() -> None:
    mexp = deployment(1)
    mexp["spec"]["selector"] = {"matchExpressions": [{"key": "app", "operator": "In", "values": ["mexp", "m2"]}]}
    assert workloads.selector(mexp) == "app in (m2,mexp)", "never empty: that would list every pod"
