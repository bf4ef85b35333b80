"""Install the operator into the sandbox's control plane as the Helm chart installs it on a cluster.

The chart ``helm/memops`` is rendered by Helm's own library (helm-python-sdk) into the release
namespace ``memops-system``. Its CRDs, ServiceAccount, RBAC and Kopf peering are applied as
rendered, so the operator is held to exactly the permissions that users grant it. Its
Deployment, Services and Secret are not: the operator runs as a local process instead, under
its ServiceAccount's token (TokenRequest API, as ``kubectl create token``), serving its webhook
over TLS on 127.0.0.1 with a certificate of the sandbox's CA. The token reaches it as a pod's
reaches it: a file (``DIR/operator-token``, named by ``DIR/operator-kubeconfig`` as its
``tokenFile``) holding a token bound to an object, a Secret here (:data:`TOKEN_SECRET`), where
the kubelet binds it to the pod. Deleting the Secret revokes the token; writing a new one to the
file first rotates it, as the kubelet does. The chart's
Mutating and ValidatingWebhookConfigurations are applied with ``clientConfig.url`` pointing there and
``caBundle`` the sandbox's CA, so the API server calls it over TLS as it would call the Service.
Of the Deployment's arguments, those that configure what the operator allows (:data:`OPERATOR_FLAGS`)
are the local process' too: ``--set sharedSpill.hostRoots=[/var/lib/memops/spill]`` allows that
host directory to shared spill of medium Node, as it would on a cluster.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from memops_sandbox import controlplane

NAMESPACE = "memops-system"
RELEASE = "memops"
# The rendered kinds applied as they are, in this order (CRDs first, as Helm does).
APPLIED_KINDS = (
    "CustomResourceDefinition",
    "ServiceAccount",
    "ClusterRole",
    "ClusterRoleBinding",
    "Role",
    "RoleBinding",
    "ClusterKopfPeering",
    "KopfPeering",
    # The pod patch guard: the operator's ServiceAccount may change only pods' metadata and resize.
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
)
# kind -> (API path prefix, plural, namespaced): the kinds the sandbox creates.
RESOURCES = {
    "Namespace": ("/api/v1", "namespaces", False),
    "ServiceAccount": ("/api/v1", "serviceaccounts", True),
    "CustomResourceDefinition": ("/apis/apiextensions.k8s.io/v1", "customresourcedefinitions", False),
    "ClusterRole": ("/apis/rbac.authorization.k8s.io/v1", "clusterroles", False),
    "ClusterRoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "clusterrolebindings", False),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles", True),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings", True),
    "ClusterKopfPeering": ("/apis/kopf.dev/v1", "clusterkopfpeerings", False),
    "KopfPeering": ("/apis/kopf.dev/v1", "kopfpeerings", True),
    "MutatingWebhookConfiguration": (
        "/apis/admissionregistration.k8s.io/v1",
        "mutatingwebhookconfigurations",
        False,
    ),
    "ValidatingWebhookConfiguration": (
        "/apis/admissionregistration.k8s.io/v1",
        "validatingwebhookconfigurations",
        False,
    ),
    "ValidatingAdmissionPolicy": ("/apis/admissionregistration.k8s.io/v1", "validatingadmissionpolicies", False),
    "ValidatingAdmissionPolicyBinding": (
        "/apis/admissionregistration.k8s.io/v1",
        "validatingadmissionpolicybindings",
        False,
    ),
    "Deployment": ("/apis/apps/v1", "deployments", True),
    "Service": ("/api/v1", "services", True),
    "Secret": ("/api/v1", "secrets", True),
    "ConfigMap": ("/api/v1", "configmaps", True),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies", True),
}
OPERATOR_KINDS = (
    "Secret",
    "Service",
    "NetworkPolicy",
    "Deployment",
    "MutatingWebhookConfiguration",
    "ValidatingWebhookConfiguration",
)
"""On real Nodes, the rest of the chart, applied as rendered, in this order: the operator is the
chart's Deployment, its webhook reached through its Service (:func:`install_operator`)."""
CLIENT_CA_CONFIGMAP = "memops-webhook-client-ca"
"""The ConfigMap of :data:`NAMESPACE` holding the CA of the API server's webhook client
certificate, which the chart's ``webhook.clientCA.configMap`` names on real Nodes."""


def pod_values(operator_image: str, pause_image: str, client_name: str, *, replicas: int = 1) -> dict[str, Any]:
    """The chart's values for an operator pod on the sandbox's real Nodes: the images built here
    (never pulled), and the webhook answering only the API server's client certificate."""
    repository, _, tag = operator_image.rpartition(":")
    pause_repository, _, pause_tag = pause_image.rpartition(":")
    return {
        "replicas": replicas,
        "image": {"repository": repository, "tag": tag, "pullPolicy": "IfNotPresent"},
        "webhook": {"clientCA": {"configMap": CLIENT_CA_CONFIGMAP}, "clientNames": [client_name]},
        "sharedSpill": {"nodeDaemonSet": {"pauseImage": {"repository": pause_repository, "tag": pause_tag}}},
    }


def merge_values(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """``override`` over ``base``, maps merged key by key (as Helm merges ``-f`` files)."""
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_values(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def webhook_service_hosts(values: dict[str, Any] | None) -> list[str]:
    """How the API server names the chart's webhook Service when it looks up its client
    credentials: ``<service>.<namespace>.svc``, with and without the port."""
    fullname = (values or {}).get("fullnameOverride") or RELEASE
    host = f"{fullname}-webhook.{NAMESPACE}.svc"
    return [host, f"{host}:443"]


async def install_operator(api: controlplane.Api, objects: list[dict[str, Any]], client_ca: bytes) -> None:
    """Apply the chart's operator (:data:`OPERATOR_KINDS`) as rendered, with the ConfigMap of the
    API server's client CA that its webhook verifies clients with."""
    configmap = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": CLIENT_CA_CONFIGMAP, "namespace": NAMESPACE},
        "data": {"ca.crt": client_ca.decode()},
    }
    await api.create(path_of(configmap), configmap)
    for kind in OPERATOR_KINDS:
        for obj in objects:
            if obj["kind"] == kind:
                await api.create(path_of(obj), obj)


OPERATOR_FLAGS = ("--shared-spill-host-root=",)
"""The rendered Deployment's arguments that the sandbox's operator takes as they are; the others
(ports, certificate files, the liveness endpoint) it sets for loopback itself."""
TOKEN_SECONDS = 7 * 24 * 3600  # the API server caps it at --service-account-max-token-expiration
TOKEN_SECRET = "memops-operator-token"
"""The Secret in :data:`NAMESPACE` that the operator's token is bound to: deleting it revokes the token."""
TOKEN_FILE = "operator-token"
"""``DIR/operator-token``: the operator's token, read by its kubeconfig (``tokenFile``)."""


def chart_directory() -> Path:
    """helm/memops of the checkout that this memops comes from."""
    import memops

    chart = Path(memops.__file__).resolve().parents[1] / "helm" / "memops"
    if not (chart / "Chart.yaml").is_file():
        raise FileNotFoundError(f"the Helm chart is not at {chart}: the sandbox runs from a checkout of memops")
    return chart


def render_chart(values: dict[str, Any] | None = None, *, chart: Path | None = None) -> list[dict[str, Any]]:
    """What ``helm install memops helm/memops -n memops-system`` would apply: CRDs, then templates."""
    import helm_python as helm

    def documents(text: str) -> list[dict[str, Any]]:
        return [doc for doc in yaml.safe_load_all(text) if doc]

    with helm.Chart.load(chart or chart_directory()) as loaded:
        crds = [doc for crd in loaded.crds for doc in documents(crd["data"])]
        rendered = loaded.render(values or {}, name=RELEASE, namespace=NAMESPACE, is_install=True)
    objects = [doc for path, text in sorted(rendered.items()) if path.endswith(".yaml") for doc in documents(text)]
    return crds + objects


def chart_values(settings: list[str]) -> dict[str, Any]:
    """Helm's ``--set a.b=value`` as a values dict; each value is read as YAML (``true``, ``3``)."""
    values: dict[str, Any] = {}
    for setting in settings:
        key, sep, text = setting.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ValueError(f"--set {setting!r}: not KEY=VALUE (KEY a dotted path, as Helm's --set)")
        *parents, leaf = key.split(".")
        node = values
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"--set {setting!r}: {part} is set to a value already")
        node[leaf] = yaml.safe_load(text)
    return values


def path_of(obj: dict[str, Any], *, named: bool = False) -> str:
    """The REST path that creates ``obj`` (or, ``named``, reads it)."""
    prefix, plural, namespaced = RESOURCES[obj["kind"]]
    namespace = obj["metadata"].get("namespace") or NAMESPACE
    path = f"{prefix}/namespaces/{namespace}/{plural}" if namespaced else f"{prefix}/{plural}"
    return f"{path}/{obj['metadata']['name']}" if named else path


def applied(objects: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """The rendered objects that the sandbox applies as they are, in Helm's order."""
    for kind in APPLIED_KINDS:
        yield from (obj for obj in objects if obj["kind"] == kind)


def local_webhook(configuration: dict[str, Any], url: str, ca_bundle: bytes) -> dict[str, Any]:
    """The chart's MutatingWebhookConfiguration, each webhook's Service reference replaced by
    ``url`` + the Service's path, and its ``caBundle`` by the sandbox CA."""

    configuration = copy.deepcopy(configuration)
    for webhook in configuration["webhooks"]:
        service = webhook["clientConfig"].pop("service")
        webhook["clientConfig"] = {
            "url": url.rstrip("/") + service.get("path", "/"),
            "caBundle": base64.b64encode(ca_bundle).decode(),
        }
    return configuration


def operator_flags(objects: list[dict[str, Any]]) -> list[str]:
    """The chart's ``memops run`` arguments that the sandbox's operator gets too (:data:`OPERATOR_FLAGS`)."""
    deployments = [obj for obj in objects if obj["kind"] == "Deployment"]
    args = [str(a) for d in deployments for a in d["spec"]["template"]["spec"]["containers"][0].get("args") or []]
    return [a for a in args if a.startswith(OPERATOR_FLAGS)]


def service_account(objects: list[dict[str, Any]]) -> str:
    (account,) = (str(obj["metadata"]["name"]) for obj in objects if obj["kind"] == "ServiceAccount")
    return account


async def install(plane: controlplane.Plane, api: controlplane.Api, objects: list[dict[str, Any]]) -> Path:
    """Apply the chart's objects and write the operator's kubeconfig (its ServiceAccount's token)
    to ``DIR/operator-kubeconfig``; return its path."""
    await api.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    crds = [obj for obj in applied(objects) if obj["kind"] == "CustomResourceDefinition"]
    for crd in crds:
        await api.create(path_of(crd), crd)
    # Objects of these kinds (the Kopf peering) can be created once their CRDs serve.
    await asyncio.gather(*(_wait_established(api, crd) for crd in crds))
    for obj in applied(objects):
        if obj["kind"] != "CustomResourceDefinition":
            await api.create(path_of(obj), obj)
    account = service_account(objects)
    token_file = plane.state_dir / TOKEN_FILE
    write_token(token_file, await bound_token(api, account, TOKEN_SECRET))
    path = plane.state_dir / "operator-kubeconfig"
    user = f"system:serviceaccount:{NAMESPACE}:{account}"
    path.write_text(
        controlplane.kubeconfig(plane.server, plane.ca, user=user, token_file=token_file, namespace=NAMESPACE)
    )
    return path


async def bound_token(api: controlplane.Api, account: str, secret: str) -> str:
    """A token of ServiceAccount ``account`` bound to the Secret ``secret`` of :data:`NAMESPACE`
    (made here if it does not exist): the API server refuses it once the Secret is deleted."""
    secrets = f"/api/v1/namespaces/{NAMESPACE}/secrets"
    await api.create(secrets, {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": secret}})
    bound = await api.get(f"{secrets}/{secret}")
    request = {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenRequest",
        "spec": {
            "expirationSeconds": TOKEN_SECONDS,
            "boundObjectRef": {"apiVersion": "v1", "kind": "Secret", "name": secret, "uid": bound["metadata"]["uid"]},
        },
    }
    response = await api.request("POST", f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/{account}/token", request)
    return str(response["status"]["token"])


def write_token(path: Path, token: str) -> None:
    """Replace the token in ``path`` at once (a reader sees the old one or the new one, whole), readable
    by its owner only."""
    staged = path.with_name(path.name + ".new")
    with os.fdopen(os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as file:
        file.write(token)
    staged.replace(path)


async def register_webhook(api: controlplane.Api, objects: list[dict[str, Any]], url: str, ca_bundle: bytes) -> None:
    """Apply the chart's webhook configurations (the safety net, the eviction gate), pointed at the
    local operator."""
    for obj in objects:
        if obj["kind"] in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
            await api.create(path_of(obj), local_webhook(obj, url, ca_bundle))


async def _wait_established(api: controlplane.Api, crd: dict[str, Any], timeout: float = 30) -> None:

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        current = await api.get(path_of(crd, named=True))
        conditions = (current.get("status") or {}).get("conditions") or []
        if any(c["type"] == "Established" and c["status"] == "True" for c in conditions):
            return
        await asyncio.sleep(0.1)
    raise TimeoutError(f"CRD {crd['metadata']['name']} not established after {timeout} s")
