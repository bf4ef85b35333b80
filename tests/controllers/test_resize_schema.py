"""The MemoryPolicy CRD bounds ``spec.resize.maxLimit`` and ``spec.eviction.nodePressure.margin``
at the API server (CEL rules with Kubernetes' quantity library), against the upstream plane
(``plane``: kube-apiserver with the chart's CRDs, as generated). The model refuses the same
(tests/unit/test_resize_decisions.py, tests/unit/test_node_pressure.py), for an object stored
before the rule existed."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from memops import specs
from memops.clients import kube


@pytest.fixture
async def namespace(plane: Path, request: pytest.FixtureRequest) -> AsyncIterator[tuple[kube.Kube, str]]:
    kube_client = kube.Kube(kube.load_connection(str(plane / "kubeconfig")))
    name = "t-" + hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:12]
    try:
        await kube_client.request("POST", "/api/v1/namespaces", body={"metadata": {"name": name}})
        yield kube_client, name
    finally:
        await kube_client.close()


async def _create(kube_client: kube.Kube, namespace: str, name: str, max_limit: str) -> None:
    await _create_with(kube_client, namespace, name, {"resize": {"maxLimit": max_limit}})


async def _create_with(kube_client: kube.Kube, namespace: str, name: str, spec: dict[str, object]) -> None:
    body = {
        "apiVersion": specs.API_VERSION,
        "kind": "MemoryPolicy",
        "metadata": {"name": name},
        "spec": {
            "scheduler": {"address": "tcp://dask-scheduler:8786"},
            "workload": {"kind": "Deployment", "name": "w"},
            **spec,
        },
    }
    await kube_client.request(
        "POST", kube.resource_path(specs.GROUP, specs.VERSION, "memorypolicies", namespace), body=body
    )


@pytest.mark.parametrize("max_limit", ["9e99", "65Ti", "70368744177665", "1E"])
async def test_a_maximum_past_the_bound_is_refused_by_the_api_server(
    namespace: tuple[kube.Kube, str], max_limit: str
) -> None:
    kube_client, ns = namespace
    with pytest.raises(kube.ApiError) as refused:
        await _create(kube_client, ns, "p", max_limit)
    assert refused.value.code == 422 and "spec.resize.maxLimit" in refused.value.message
    assert "at most 64Ti" in refused.value.message


@pytest.mark.parametrize("max_limit", ["64Ti", "70368744177664", "16Gi", "1.5Gi"])
async def test_a_maximum_within_the_bound_is_stored(namespace: tuple[kube.Kube, str], max_limit: str) -> None:
    kube_client, ns = namespace
    await _create(kube_client, ns, "p", max_limit)


@pytest.mark.parametrize(("margin", "stored"), [("5Gi", False), ("9e99", False), ("4Gi", True), ("256Mi", True)])
async def test_the_node_pressure_margin_is_bounded_by_the_api_server(
    namespace: tuple[kube.Kube, str], margin: str, stored: bool
) -> None:
    kube_client, ns = namespace
    spec = {"eviction": {"nodePressure": {"margin": margin}}}
    if stored:
        await _create_with(kube_client, ns, "p", spec)
        return
    with pytest.raises(kube.ApiError) as refused:
        await _create_with(kube_client, ns, "p", spec)
    assert refused.value.code == 422 and "spec.eviction.nodePressure.margin" in refused.value.message
    assert "at most 4Gi" in refused.value.message
