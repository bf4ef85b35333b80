"""The pod patch guard against the upstream API server: memops' ServiceAccount changes a pod's
metadata and its ``resize`` subresource, and nothing else of a pod, whatever RBAC grants it.

RBAC cannot say it: ``pods`` ``patch`` (claims, deletion costs, the disruption annotations) is a
patch of the whole pod, its containers' images included. The chart's ValidatingAdmissionPolicy
and its binding (``rbac.podPatchGuard.enabled``, on by default) refuse an update of a pod by
memops' ServiceAccount that changes anything outside ``metadata``, and any subresource but
``resize``.

Inputs: the ``plane`` (etcd, kube-apiserver with RBAC, the controller manager; no Node, so the
pods stay Pending); the chart rendered for the release ``guard`` in the namespace
``memops-guard`` (ServiceAccount ``guard-memops``: not the default names, so the policy's
username is the template's), of which the ServiceAccount, the RBAC (with ``rbac.podResize``)
and the policy and its binding are applied as rendered; a token of that
ServiceAccount from the TokenRequest API; and the operator's own code (:mod:`memops.controllers`)
making its requests with it. The API server enforces a new policy once its informer has it: the
first refusal is polled for, within :data:`ENFORCED_WITHIN` seconds.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kopf
import pytest

from memops.clients import kube
from memops.controllers import resize, workloads
from memops.decisions import objects
from tests.packaging import manifests

RELEASE, NAMESPACE = "guard", "memops-guard"
VALUES = {"rbac": {"podResize": True}}
ENFORCED_WITHIN = 30.0
STRATEGIC_MERGE = resize.STRATEGIC_MERGE
# kind -> (group, version, plural, namespaced): what is applied of the rendered chart, in this order.
APPLIED = {
    "ServiceAccount": ("", "v1", "serviceaccounts", True),
    "ClusterRole": ("rbac.authorization.k8s.io", "v1", "clusterroles", False),
    "ClusterRoleBinding": ("rbac.authorization.k8s.io", "v1", "clusterrolebindings", False),
    "ValidatingAdmissionPolicy": ("admissionregistration.k8s.io", "v1", "validatingadmissionpolicies", False),
    "ValidatingAdmissionPolicyBinding": (
        "admissionregistration.k8s.io",
        "v1",
        "validatingadmissionpolicybindings",
        False,
    ),
}


@dataclass
class Guarded:
    admin: kube.Kube
    operator: kube.Kube
    """memops' ServiceAccount, with a token from the TokenRequest API."""
    account: str
    namespace: str
    """The test's own namespace, where :meth:`pod` makes pods."""
    policy: dict[str, Any] | None
    """The chart's ValidatingAdmissionPolicy, as rendered (None: the chart renders none)."""

    async def pod(self, name: str, *, node: str | None = "node-a") -> str:
        """A pod in :attr:`namespace`, with memory to resize; its API path. Bound to a Node that does
        not run (Pending for ever), so that no scheduler writes its status meanwhile (a claim's
        ``test`` of the resourceVersion would fail); or not bound (``node=None``): the API server
        resizes no pod of a Node it does not know."""
        container = {
            "name": "w",
            "image": "w.invalid/w:1",
            "resources": {"requests": {"memory": "64Mi"}, "limits": {"memory": "128Mi"}},
        }
        spec = {"containers": [container], **({"nodeName": node} if node else {})}
        body = {"metadata": {"name": name, "labels": {"app": "w"}}, "spec": spec}
        await self.admin.request("POST", kube.resource_path("", "v1", "pods", self.namespace), body=body)
        return kube.resource_path("", "v1", "pods", self.namespace, name)


async def _apply(admin: kube.Kube, obj: dict[str, Any]) -> None:
    group, version, plural, namespaced = APPLIED[obj["kind"]]
    namespace = obj["metadata"].get("namespace") if namespaced else None
    try:
        await admin.request("POST", kube.resource_path(group, version, plural, namespace), body=obj)
    except kube.ApiError as exc:
        if exc.code != 409:  # a test before this one applied it
            raise


@pytest.fixture
async def guarded(plane: Path, request: pytest.FixtureRequest) -> AsyncIterator[Guarded]:
    objects = manifests.render_chart(VALUES, name=RELEASE, namespace=NAMESPACE)
    admin = kube.Kube(kube.load_connection(str(plane / "kubeconfig")))
    operator: kube.Kube | None = None
    namespace = "t-" + hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:12]
    try:
        for name in (NAMESPACE, namespace):
            try:
                await admin.request("POST", "/api/v1/namespaces", body={"metadata": {"name": name}})
            except kube.ApiError as exc:
                if exc.code != 409:
                    raise
        for kind in APPLIED:
            for obj in manifests.find(objects, kind):
                await _apply(admin, obj)
        account = str(manifests.one(objects, "ServiceAccount")["metadata"]["name"])
        path = kube.resource_path("", "v1", "serviceaccounts", NAMESPACE, account, "token")
        issued = await admin.request("POST", path, body={"spec": {"expirationSeconds": 3600}})
        server = (await admin.credentials.get()).server
        token = issued["status"]["token"]
        operator = kube.Kube(kopf.ConnectionInfo(server=server, ca_path=str(plane / "pki" / "ca.crt"), token=token))
        policies = manifests.find(objects, "ValidatingAdmissionPolicy")
        yield Guarded(admin, operator, account, namespace, policies[0] if policies else None)
    finally:
        if operator is not None:
            await operator.close()
        await admin.close()


def _image(pod: dict[str, Any]) -> str:
    return str(pod["spec"]["containers"][0]["image"])


def _new_image(image: str) -> list[dict[str, Any]]:
    return [{"op": "replace", "path": "/spec/containers/0/image", "value": image}]


async def _first_refusal(guarded: Guarded, path: str) -> tuple[kube.ApiError, int]:
    """Patch the pod's image as memops' ServiceAccount, a new image each time, until the API server
    refuses it with a ValidatingAdmissionPolicy's answer; that answer and how many patches it let
    through before (the policy's informer)."""
    allowed = 0
    deadline = time.monotonic() + ENFORCED_WITHIN
    while True:
        image = f"w.invalid/other:{allowed + 2}"
        try:
            await guarded.operator.json_patch(path, _new_image(image))
        except kube.ApiError as exc:
            if "ValidatingAdmissionPolicy" not in exc.message:
                raise
            return exc, allowed
        allowed += 1
        assert time.monotonic() < deadline, (
            f"memops' ServiceAccount changed the pod's image {allowed} times in {ENFORCED_WITHIN:.0f} s:"
            f" nothing refuses it (the pod's image is now {image})"
        )
        await asyncio.sleep(0.2)


def _messages(policy: dict[str, Any] | None) -> list[str]:
    assert policy is not None, "the chart renders no ValidatingAdmissionPolicy"
    return [str(v["message"]) for v in policy["spec"]["validations"] if "message" in v]


async def test_memops_may_not_change_a_pods_image(guarded: Guarded) -> None:
    path = await guarded.pod("image")
    refusal, allowed = await _first_refusal(guarded, path)
    (message,) = _messages(guarded.policy)
    assert refusal.code == 422 and refusal.reason == "Invalid", refusal
    assert message in refusal.message and "ValidatingAdmissionPolicy" in refusal.message, refusal.message
    assert f"system:serviceaccount:{NAMESPACE}:{guarded.account}" in message
    before = _image(await guarded.admin.get(path))
    # Enforced from now on, whatever the kind of patch.
    with pytest.raises(kube.ApiError, match="ValidatingAdmissionPolicy"):
        await guarded.operator.request(
            "PATCH",
            path,
            body={"spec": {"containers": [{"name": "w", "image": "w.invalid/evil:1"}]}},
            content_type=STRATEGIC_MERGE,
        )
    assert _image(await guarded.admin.get(path)) == before
    print(f"refused after {allowed} patches let through while the policy's informer caught up: {refusal.message}")
    # The guard is memops' alone: anyone else whom RBAC allows still changes the image.
    await guarded.admin.json_patch(path, _new_image("w.invalid/w:9"))
    assert _image(await guarded.admin.get(path)) == "w.invalid/w:9"


async def test_memops_still_changes_a_pods_metadata_and_resizes_it(guarded: Guarded) -> None:
    """What the operator does to pods, with its own code: a claim (a JSON patch with its ``test``),
    the deletion cost and the disruption label (merge patches of metadata), an in-place resize."""
    await _first_refusal(guarded, await guarded.pod("canary"))  # the policy is enforced from here
    path = await guarded.pod("worker")
    pod = await guarded.operator.get(path)
    await workloads.claim_pod(guarded.operator, pod, "shrink")
    metadata = {"annotations": {objects.POD_DELETION_COST: "-1000"}, "labels": {objects.PROTECTED_LABEL: "p"}}
    await guarded.operator.merge_patch(path, {"metadata": metadata})
    pod = await guarded.admin.get(path)
    assert pod["metadata"]["annotations"][objects.CLAIM_ANNOTATION] == "shrink"
    assert pod["metadata"]["annotations"][objects.POD_DELETION_COST] == "-1000"
    assert pod["metadata"]["labels"][objects.PROTECTED_LABEL] == "p"
    assert _image(pod) == "w.invalid/w:1"
    resized = await guarded.pod("resized", node=None)
    await resize.resize_container_memory(guarded.operator, guarded.namespace, "resized", "w", limit=256 * 2**20)
    pod = await guarded.admin.get(resized)
    assert pod["spec"]["containers"][0]["resources"]["limits"]["memory"] == "256Mi"
    assert _image(pod) == "w.invalid/w:1"


@pytest.mark.parametrize(
    ("subresource", "body"),
    [
        pytest.param("status", {"status": {"message": "from memops"}}, id="status"),
        pytest.param(
            "ephemeralcontainers",
            {"spec": {"ephemeralContainers": [{"name": "debug", "image": "w.invalid/debug:1"}]}},
            id="ephemeral-containers",
        ),
    ],
)
async def test_memops_may_not_patch_other_subresources_even_where_rbac_lets_it(
    guarded: Guarded, subresource: str, body: dict[str, Any]
) -> None:
    """The chart grants neither; a Role that did (a mistake, another chart) is still refused."""
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": "wider", "namespace": guarded.namespace},
        "rules": [{"apiGroups": [""], "resources": [f"pods/{subresource}"], "verbs": ["patch"]}],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": "wider", "namespace": guarded.namespace},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "wider"},
        "subjects": [{"kind": "ServiceAccount", "name": guarded.account, "namespace": NAMESPACE}],
    }
    rbac = ("rbac.authorization.k8s.io", "v1")
    await guarded.admin.request("POST", kube.resource_path(*rbac, "roles", guarded.namespace), body=role)
    await guarded.admin.request("POST", kube.resource_path(*rbac, "rolebindings", guarded.namespace), body=binding)
    await _first_refusal(guarded, await guarded.pod("canary"))
    path = await guarded.pod("worker")

    async def refused() -> bool:
        try:
            await guarded.operator.request("PATCH", f"{path}/{subresource}", body=body, content_type=STRATEGIC_MERGE)
        except kube.ApiError as exc:
            if exc.code == 403:
                return False  # RBAC's: the Role is not in the authorizer's cache yet
            assert exc.code == 422 and f"not pods/{subresource}" in exc.message, exc
            return True
        raise AssertionError(f"memops' ServiceAccount patched pods/{subresource}")

    async with asyncio.timeout(ENFORCED_WITHIN):
        while not await refused():
            await asyncio.sleep(0.2)
    pod = await guarded.admin.get(path)
    assert not pod["spec"].get("ephemeralContainers") and pod["status"].get("message") != "from memops"
