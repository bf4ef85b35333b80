"""``spec.eviction.nodePressure`` in a namespaced install: the kubelet's ranking, read as the operator.

Inputs: the upstream control plane (``memops-sandbox plane``, RBAC enforced, one for the module), a
Node object made here and pods bound to it by ``nodeName`` in two namespaces (the admin's
kubeconfig), and the operator's identity as a namespaced install has it: the chart's ServiceAccount
and RBAC rendered with ``watchNamespaces`` naming the policy's namespace only (a Role there, the
ClusterRole of Nodes), and a token of that ServiceAccount. The read of the pre-emption
(:func:`memops.controllers.kubelets.read`) runs as that identity: the Node, the pod listings and
the API server's 403 for the cluster-wide one are real. No kubelet runs, so what a kubelet answers
memops directly (its summary statistics and configuration: the pods' usage) is supplied in this
process (:func:`kubelets_answering`); every request to the API server goes there.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any, cast

import kopf
import pytest

from memops import specs
from memops.clients import kube
from memops.controllers import kubelets
from memops.decisions import node_pressure, objects
from tests.packaging import manifests

MiB = 2**20
LOGGER = logging.getLogger("test")
MARGIN = 256 * MiB
SPEC = specs.MemoryPolicySpec.model_validate(
    {
        "scheduler": {"address": "tcp://dask-scheduler:8786"},
        "workload": {"kind": "Deployment", "name": "w"},
        "eviction": {"nodePressure": {"margin": "256Mi"}},
    }
)
RBAC = {
    "ServiceAccount": ("", "serviceaccounts"),
    "ClusterRole": ("rbac.authorization.k8s.io", "clusterroles"),
    "ClusterRoleBinding": ("rbac.authorization.k8s.io", "clusterrolebindings"),
    "Role": ("rbac.authorization.k8s.io", "roles"),
    "RoleBinding": ("rbac.authorization.k8s.io", "rolebindings"),
}


def kubelets_answering(kubelet: Mapping[str, Any]) -> kubelets.Kubelets:
    """What the plane has no kubelet to answer (``<node><path>`` of a kubelet's own API) comes
    from ``kubelet``."""

    class Reader:
        async def get(self, node: dict[str, Any], path: str) -> dict[str, Any]:
            return dict(kubelet[f"{node['metadata']['name']}{path}"])

    @contextlib.asynccontextmanager
    async def reading(_: kube.Kube) -> AsyncIterator[Reader]:
        yield Reader()

    return kubelets.Kubelets(reading=cast(Any, reading))


@pytest.fixture
async def admin(plane: Path) -> AsyncIterator[kube.Kube]:
    client = kube.Kube(kube.load_connection(str(plane / "kubeconfig")))
    try:
        yield client
    finally:
        await client.close()


def tag(request: pytest.FixtureRequest) -> str:
    return hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:8]


async def namespace(admin: kube.Kube, name: str) -> None:
    await admin.request("POST", "/api/v1/namespaces", body={"metadata": {"name": name}})


async def operator(admin: kube.Kube, plane: Path, watched: str, release: str) -> kopf.ConnectionInfo:
    """The chart's ServiceAccount and RBAC for ``watchNamespaces: [watched]`` (with
    ``rbac.kubeletStats``, which node pressure needs) applied to the plane; a token of it."""
    await namespace(admin, release)
    values = {
        "rbac": {"kubeletStats": True},
        "watchNamespaces": [watched],
        "webhook": {"allowUnauthenticatedSources": True},
    }
    rendered = manifests.render_chart(values, namespace=release, name=release)
    account = ""
    for obj in rendered:
        if obj["kind"] not in RBAC:
            continue
        group, plural = RBAC[obj["kind"]]
        version = obj["apiVersion"].rsplit("/", 1)[-1]
        await admin.request(
            "POST", kube.resource_path(group, version, plural, obj["metadata"].get("namespace")), body=obj
        )
        if obj["kind"] == "ServiceAccount":
            account = obj["metadata"]["name"]
    path = kube.resource_path("", "v1", "serviceaccounts", release, account, "token")
    issued = await admin.request("POST", path, body={"spec": {"expirationSeconds": 3600}})
    server = (await admin.credentials.get()).server
    return kopf.ConnectionInfo(server=server, ca_path=str(plane / "pki" / "ca.crt"), token=issued["status"]["token"])


async def bound_pod(admin: kube.Kube, ns: str, name: str, node: str, request: str) -> None:
    """A pod bound to ``node``, Running, as its kubelet would report it."""
    pods = kube.resource_path("", "v1", "pods", ns)
    container = {"name": "c", "image": "w.invalid/w:1", "resources": {"requests": {"memory": request}}}
    body = {"metadata": {"name": name, "labels": {"app": "w"}}, "spec": {"nodeName": node, "containers": [container]}}
    await admin.request("POST", pods, body=body)
    await admin.merge_patch(f"{pods}/{name}/status", {"status": {"phase": "Running"}})


def kubelet_answers(node: str, available: int, usage: Mapping[tuple[str, str], int]) -> dict[str, Any]:
    """The kubelet's ``/stats/summary`` and ``/configz`` of ``node``: ``available`` bytes on the
    node and in the pods' cgroup, the pods' working sets (``usage``), a 100Mi hard threshold."""
    working = sum(usage.values())
    memory = {"availableBytes": available, "workingSetBytes": working}
    summary = {
        "node": {"nodeName": node, "memory": memory, "systemContainers": [{"name": "pods", "memory": memory}]},
        "pods": [
            {"podRef": {"namespace": ns, "name": name}, "memory": {"workingSetBytes": bytes_}}
            for (ns, name), bytes_ in usage.items()
        ],
    }
    config = {"kubeletconfig": {"evictionHard": {"memory.available": "100Mi"}, "enforceNodeAllocatable": ["pods"]}}
    return {f"{node}/stats/summary": summary, f"{node}/configz": config}


async def read_as_operator(
    admin: kube.Kube, plane: Path, policy_ns: str, node: str, kubelet: Mapping[str, Any], release: str
) -> node_pressure.Seen:
    """:func:`kubelets.read` as a namespaced install reads it for a policy in ``policy_ns``: its
    workers listed there by that identity, as the policy's pass lists them."""
    client = kube.Kube(await operator(admin, plane, policy_ns, release))
    try:
        workers = await client.list(kube.resource_path("", "v1", "pods", policy_ns))
        assert {w["spec"]["nodeName"] for w in workers} == {node}
        answering = kubelets_answering(kubelet)
        return await kubelets.read(client, answering, pods=workers, margin=MARGIN, logger=LOGGER)
    finally:
        await client.close()


def audited(plane: Path, user: str) -> list[tuple[str, str, int]]:
    """The pod lists that ``user`` made, from the API server's audit log: (namespace or "" for
    cluster-wide, the field selector in the URI, the response code)."""
    found = []
    for line in (plane / "audit.log").read_text().splitlines():
        event = json.loads(line)
        ref = event.get("objectRef") or {}
        if event.get("stage") != "ResponseComplete" or event["user"]["username"] != user:
            continue
        if event["verb"] == "list" and ref.get("resource") == "pods":
            found.append((ref.get("namespace", ""), event["requestURI"], event["responseStatus"]["code"]))
    return found


async def test_a_tenant_over_its_requests_gets_no_worker_of_the_policy_drained(
    plane: Path, admin: kube.Kube, request: pytest.FixtureRequest
) -> None:
    """A tenant that uses far more than it requests brings the shared Node within the margin. The
    kubelet evicts it first (over its request by the most); the policy's workers, within their
    requests, are not victims, although the policy's namespace sorts first."""
    t = tag(request)
    policy_ns, other_ns, node = f"a-pol-{t}", f"b-hog-{t}", f"n-{t}"
    await admin.request("POST", "/api/v1/nodes", body={"metadata": {"name": node}})
    for ns in (policy_ns, other_ns):
        await namespace(admin, ns)
    await bound_pod(admin, policy_ns, "w-1", node, "1Gi")
    await bound_pod(admin, policy_ns, "w-2", node, "1Gi")
    await bound_pod(admin, other_ns, "hog", node, "64Mi")
    usage = {(policy_ns, "w-1"): 600 * MiB, (policy_ns, "w-2"): 600 * MiB, (other_ns, "hog"): 3072 * MiB}
    kubelet = kubelet_answers(node, 200 * MiB, usage)  # 100 MiB above the threshold: within the margin

    seen = await read_as_operator(admin, plane, policy_ns, node, kubelet, f"mo-{t}")

    (found,) = seen.predictions
    assert [(p.namespace, p.name) for p in found.victims] == [(other_ns, "hog")]
    assert found.ours == (), "no worker of the policy is ranked ahead of a pod that may use far over its request"
    # The workers hold data alone, and other Nodes have room: still nothing is drained.
    unique = node_pressure.Seen(predictions=seen.predictions, unique={"w-1": MiB, "w-2": MiB}, room={"n": 2**40})
    planned = node_pressure.plan(objects.Owner(name="p", namespace=policy_ns, uid="u"), SPEC, unique, [], 0.0)
    assert planned.requests == (), "nothing drained"


async def test_the_policys_own_worker_over_its_request_is_ranked_with_its_real_usage(
    plane: Path, admin: kube.Kube, request: pytest.FixtureRequest
) -> None:
    """The policy's namespace sorts last. Its worker over its request is listed (namespaced, by
    the Node's name) with its real usage, and ranked ahead of another tenant's pod that the
    operator may not list; the status says that the ranking is partial."""
    t = tag(request)
    other_ns, policy_ns, node = f"a-ten-{t}", f"z-pol-{t}", f"n-{t}"
    await admin.request("POST", "/api/v1/nodes", body={"metadata": {"name": node}})
    for ns in (other_ns, policy_ns):
        await namespace(admin, ns)
    await bound_pod(admin, other_ns, "db", node, "2Gi")
    await bound_pod(admin, policy_ns, "w-1", node, "64Mi")
    await bound_pod(admin, policy_ns, "w-2", node, "1Gi")
    usage = {(other_ns, "db"): 1536 * MiB, (policy_ns, "w-1"): 1024 * MiB, (policy_ns, "w-2"): 200 * MiB}
    kubelet = kubelet_answers(node, 200 * MiB, usage)
    release = f"mo-{t}"

    seen = await read_as_operator(admin, plane, policy_ns, node, kubelet, release)

    (found,) = seen.predictions
    assert found.ours == ("w-1",), "the worker the kubelet ranks first is predicted, whatever its namespace's name"
    by_name = {p.name: p for p in found.victims}
    assert by_name["w-1"].request == 64 * MiB and by_name["w-1"].usage == 1024 * MiB, "its own figures, listed"
    # The API server refused the cluster-wide listing, and answered the policy's namespace's.
    lists = audited(plane, f"system:serviceaccount:{release}:{release}-memops")
    assert ("", f"/api/v1/pods?fieldSelector=spec.nodeName%3D{node}", 403) in lists, lists
    assert any(ns == policy_ns and code == 200 and "spec.nodeName" in uri for ns, uri, code in lists), lists
    status = node_pressure.status(None, seen, node_pressure.Plan(), "t")
    (entry,) = status.nodes
    assert entry.workers == ["w-1"] and entry.partialRanking is True
    assert f"nodes {node}: the pods of other namespaces could not be listed" in status.message, status.message
