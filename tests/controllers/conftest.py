"""Fixtures of the controller tests: the real controllers' code against an upstream control plane.

``client`` (on the suite's ``plane``): the admin's :class:`memops.clients.kube.Kube` and this test's own
namespace, holding Deployment ``w`` and one pod of it, named by the test module's ``POD``, bound to
its ``NODE`` (no node runs: its name is all a pass reads) and Running at its ``POD_IP``
(127.0.0.1 when the module sets none). Nothing of Kubernetes is mocked; the pod's status is
written as a kubelet would.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from memops.clients import kube


@pytest.fixture
async def client(plane: Path, request: pytest.FixtureRequest) -> AsyncIterator[tuple[kube.Kube, str]]:
    pod_name = str(request.module.POD)
    node = str(getattr(request.module, "NODE", "node-a"))
    ip = str(getattr(request.module, "POD_IP", "127.0.0.1"))
    kube_client = kube.Kube(kube.load_connection(str(plane / "kubeconfig")))
    namespace = "t-" + hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:12]
    template = {"metadata": {"labels": {"app": "w"}}, "spec": {"containers": [{"name": "w", "image": "w.invalid/w:1"}]}}
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "w", "namespace": namespace},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "w"}}, "template": template},
    }
    pods = kube.resource_path("", "v1", "pods", namespace)
    running = {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}
    try:
        await kube_client.request("POST", "/api/v1/namespaces", body={"metadata": {"name": namespace}})
        await kube_client.request("POST", kube.resource_path("apps", "v1", "deployments", namespace), body=deployment)
        pod = {"metadata": {"name": pod_name, **template["metadata"]}, "spec": {**template["spec"], "nodeName": node}}
        await kube_client.request("POST", pods, body=pod)
        await kube_client.merge_patch(f"{pods}/{pod_name}/status", {"status": running})
        yield kube_client, namespace
    finally:
        await kube_client.close()
