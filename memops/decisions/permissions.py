"""The permissions that the chart grants only with a feature, and what a refusal (403) tells.

The Helm chart and the kustomize manifests leave out two permissions unless the feature that
needs them is on: reading Secrets (a ``tls://`` scheduler's client certificate) and deleting
Deployments, with reading and patching DaskWorkerGroups (dask-kubernetes' worker groups), and
patching a pod's ``resize`` subresource (in-place growth). When
the operator meets such a feature without the permission, the API server answers 403;
:func:`explain_forbidden` turns that into a message that names the missing permission and the
value that grants it, which the controllers put into their conditions. Pure: called by
:mod:`memops.clients.kube` on every 403.
"""

from __future__ import annotations

import re
from typing import NamedTuple


class Permission(NamedTuple):
    group: str
    resource: str
    verb: str


FEATURE_GATED: dict[Permission, str] = {
    Permission("", "secrets", "get"): "rbac.schedulerTLS=true",
    Permission("apps", "deployments", "delete"): "rbac.daskWorkerGroups=true",
    Permission("kubernetes.dask.org", "daskworkergroups", "get"): "rbac.daskWorkerGroups=true",
    Permission("kubernetes.dask.org", "daskworkergroups", "patch"): "rbac.daskWorkerGroups=true",
    Permission("apps", "replicasets", "get"): "rbac.daskWorkerGroups=true",
    Permission("", "pods/resize", "patch"): "rbac.podResize=true",
    Permission("", "nodes/stats", "get"): "rbac.kubeletStats=true",
    Permission("", "nodes/configz", "get"): "rbac.kubeletStats=true",
}
"""Permission -> the Helm value that grants it (kustomize: the component of the same name)."""

KUSTOMIZE_COMPONENTS = {
    "rbac.schedulerTLS=true": "deploy/kustomize/components/scheduler-tls",
    "rbac.daskWorkerGroups=true": "deploy/kustomize/components/daskworkergroups",
    "rbac.podResize=true": "deploy/kustomize/components/pod-resize",
    "rbac.kubeletStats=true": "deploy/kustomize/components/kubelet-stats",
}

_PATH = re.compile(
    r"^/(?:api/(?P<core>[^/]+)|apis/(?P<group>[^/]+)/[^/]+)"
    r"(?:/namespaces/(?P<namespace>[^/]+))?/(?P<resource>[^/]+)(?:/(?P<name>[^/]+))?(?:/(?P<sub>[^/]+))?"
)
_VERBS = {"GET": "get", "POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}


def requested(method: str, path: str) -> tuple[Permission, str] | None:
    """The permission a request needs, as RBAC names it, and its namespace ("" cluster-wide)."""
    match = _PATH.match(path.split("?", 1)[0])
    if match is None:
        return None
    verb = _VERBS.get(method.upper(), method.lower())
    if verb == "get" and match["name"] is None:
        verb = "list"
    resource = match["resource"] + (f"/{match['sub']}" if match["sub"] else "")
    return Permission(match["group"] or "", resource, verb), match["namespace"] or ""


def explain_forbidden(method: str, path: str, message: str) -> str:
    """The message of a 403: which permission is missing, where, and what grants it."""
    found = requested(method, path)
    if found is None:
        return f"Forbidden: {message}"
    permission, namespace = found
    where = f" in namespace {namespace!r}" if namespace else " cluster-wide"
    what = f"{permission.resource} {permission.verb}" + (f" ({permission.group})" if permission.group else "")
    return f"Forbidden: the operator may not {what}{where}: {_remedy(permission)}. The API server said: {message}"


def explain_kubelet_forbidden(resource: str, kubelet: str, message: str) -> str:
    """The message of a kubelet's 403 (``resource``: what it asked the API server about, such as
    ``nodes/stats``)."""
    remedy = _remedy(Permission("", resource, "get"))
    return f"Forbidden: the operator may not get {resource} of the kubelet at {kubelet}: {remedy}. It said: {message}"


def _remedy(permission: Permission) -> str:
    value = FEATURE_GATED.get(permission)
    if value is not None:
        return f"needs {value} (Helm value; kustomize: the component {KUSTOMIZE_COMPONENTS[value]})"
    return "the operator's Role or ClusterRole lacks it"
