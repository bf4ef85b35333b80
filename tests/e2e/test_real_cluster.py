"""Opt-in: the retirement scenario against a real Kubernetes cluster (``pytest -m cluster``).

Needs ``KUBECONFIG`` pointing at a cluster where memops' CRDs are installed and the operator
runs, a Deployment of Dask workers (``MEMOPS_E2E_WORKLOAD``, default ``dask-worker``) in the
current namespace with at least two replicas, and its scheduler's address as the operator
reaches it (``MEMOPS_E2E_SCHEDULER``). Anything missing skips the test with the reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.cluster
KUBECTL = str(Path(sys.executable).parent / "kubectl")


def kubectl(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([KUBECTL, *args], input=stdin, capture_output=True, text=True, timeout=60)


def test_retire_one_worker_on_a_real_cluster() -> None:
    if not os.environ.get("KUBECONFIG"):
        pytest.skip("no real cluster: KUBECONFIG is not set")
    if kubectl("version", "--request-timeout=5s").returncode != 0:
        pytest.skip("no real cluster: the API server in KUBECONFIG does not answer")
    if kubectl("get", "crd", "retirementrequests.memops.dev").returncode != 0:
        pytest.skip("memops' CRDs are not installed in this cluster (kubectl apply -f crds/)")
    scheduler = os.environ.get("MEMOPS_E2E_SCHEDULER")
    if not scheduler:
        pytest.skip("MEMOPS_E2E_SCHEDULER (the Dask scheduler's address as the operator reaches it) is not set")
    workload = os.environ.get("MEMOPS_E2E_WORKLOAD", "dask-worker")
    deployment = kubectl("get", "deployment", workload, "-o", "json")
    if deployment.returncode != 0:
        pytest.skip(f"no Deployment {workload!r} in the current namespace")
    replicas = json.loads(deployment.stdout)["spec"]["replicas"]
    if replicas < 2:
        pytest.skip(f"Deployment {workload!r} needs at least 2 replicas, has {replicas}")

    name = f"e2e-{int(time.time())}"
    request = {
        "apiVersion": "memops.dev/v1alpha1",
        "kind": "RetirementRequest",
        "metadata": {"name": name},
        "spec": {
            "scheduler": {"address": scheduler},
            "workload": {"kind": "Deployment", "name": workload},
            "count": 1,
            "timeout": "5m",
        },
    }
    assert kubectl("apply", "-f", "-", stdin=yaml.safe_dump(request)).returncode == 0
    waited = kubectl("wait", f"retire/{name}", "--for=jsonpath={.status.phase}=Succeeded", "--timeout=300s")
    assert waited.returncode == 0, waited.stderr
    after = json.loads(kubectl("get", "deployment", workload, "-o", "json").stdout)["spec"]["replicas"]
    assert after == replicas - 1
