"""The shipped RBAC grants exactly what the operator uses, in the namespace where it uses it,
and the feature-gated permissions only with their feature.

Every sandbox runs on the upstream control plane, where RBAC is enforced: the operator holds
its ServiceAccount's token and the chart's rules, so a permission the chart lacks already fails
the end-to-end test that needs it (a 403, and the behaviour does not happen). What this module
adds is the other direction and the other installers: it catches over-granting (a permission
the chart or kustomize grants that nothing uses), a grant made in the wrong place (a namespaced
request allowed only cluster-wide, or the reverse), the namespaced mode (``watchNamespaces``),
kustomize's rules, and each feature-gated permission granted by its feature alone.

What the operator uses comes from the API server's own audit log (upstream JSON lines:
``user.username``, ``verb``, ``objectRef.apiGroup/resource/subresource/namespace``). Every
sandbox of the test session appends its ``DIR/audit.log`` to one file when it stops
(``tests/conftest.py``), so after ``tests/e2e`` that file holds the operator's requests in every
end-to-end scenario. This module always adds its own scenario, run the way the chart runs the
operator: its ``memops run`` arguments taken from the rendered Deployment (Kopf peering, not
``--standalone``; the webhook over TLS with a certificate from files and ``--webhook-unmanaged``;
the liveness probe), the chart's MutatingWebhookConfiguration registered with a ``caBundle``,
then a RetirementRequest, a MemoryPolicy scale-up through the safety net and a scale-down. A
request in namespace X needs the grant in X; a cluster-wide request (a list or watch across
namespaces, a cluster-scoped object) needs a ClusterRole. A request the API server refused
(403) counts as used: it is a permission missing.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import ipaddress
import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from memops_sandbox import common as sandbox_cli
from memops_sandbox import install

from memops.clients import kube
from memops.controllers import workloads
from memops.decisions import permissions
from tests.e2e import audit
from tests.e2e.conftest import EVERY_FEATURE, Sandbox
from tests.packaging import argocd, manifests

# Used only where Kopf manages the webhook configuration (``memops run`` without
# --webhook-unmanaged, as a developer may run it). The chart and kustomize ship their own
# configuration and run `memops run --webhook-unmanaged`; this module's scenario checks that it
# then never asks.
SANDBOX_ONLY = {
    (group, resource, verb): "Kopf registers the webhook in the sandbox; the installers run --webhook-unmanaged"
    for group in ("admissionregistration.k8s.io",)
    for resource in ("mutatingwebhookconfigurations", "validatingwebhookconfigurations")
    for verb in ("create", "patch")
}

# Exercised only by a module of tests/e2e (this module's scenario does not reach them). When
# that module ran in this session they must be in the log; otherwise they are reported, unchecked.
E2E_ONLY = {
    ("kubernetes.dask.org", "daskworkergroups", "get"): "tests/e2e/test_daskworkergroup.py",
    ("kubernetes.dask.org", "daskworkergroups", "patch"): "tests/e2e/test_daskworkergroup.py",
    ("apps", "deployments", "delete"): "tests/e2e/test_daskworkergroup.py",
    ("", "pods", "get"): "tests/e2e/test_daskworkergroup.py",
    ("", "nodes", "get"): "tests/e2e/test_replication.py",
    ("", "secrets", "get"): "tests/e2e/test_safety_net.py",
    ("", "pods/resize", "patch"): "tests/e2e/test_resize.py",
    ("", "services", "get"): "tests/e2e/test_walkthrough.py",
    # A policy's deletion deletes the gate's Lease in the operator's namespace (404: never made).
    ("coordination.k8s.io", "leases", "delete"): "tests/e2e/test_pressure.py",
}

# Served by the upstream plane only, whose own audit log tests/e2e/test_eviction.py reads to
# check that the operator uses them (the node signals list and watch Nodes), and is allowed to.
UPSTREAM_ONLY = {("", "nodes", "list"), ("", "nodes", "watch")} | {
    # The eviction gate's Lease, held while the gate decides an eviction: only the eviction tests
    # make evictions of a policy's workers, on sandboxes of their own, after this module has run;
    # tests/e2e/test_eviction.py checks in its own audit log that the operator used these, allowed
    # in its own namespace.
    ("coordination.k8s.io", "leases", verb)
    for verb in ("get", "create", "update")
}

RELEASE_NAMESPACE = "memops"
"""Where the chart and the kustomize base, rendered here, put the operator's namespaced objects: the
sandboxes install it in ``memops_sandbox.install.NAMESPACE``, whose requests are checked as this."""

# Asked of the kubelets, not of the API server: each kubelet names them in a SubjectAccessReview of
# its own, whose body the audit log's Metadata level does not hold. tests/e2e/test_node_pressure.py
# shows that they suffice (the chart grants these and not nodes/proxy, and the policy reads its
# kubelets and drains ahead of them).
KUBELET_ASKED = {("", "nodes/stats", "get"), ("", "nodes/configz", "get")}

# Every feature on: what the operator may use at most.
FEATURES = {key.split("=")[0].removeprefix("rbac."): True for key in permissions.FEATURE_GATED.values()}
# A namespaced install whose webhook is open to any source, which the chart refuses unless told.
OPEN = {"webhook": {"allowUnauthenticatedSources": True}}
COMPONENTS = {
    "schedulerTLS": "scheduler-tls",
    "daskWorkerGroups": "daskworkergroups",
    "podResize": "pod-resize",
    "kubeletStats": "kubelet-stats",
}
CLUSTER_SCOPED = {"customresourcedefinitions", "clusterkopfpeerings", "namespaces", "nodes"} | {
    resource for _, resource, _ in KUBELET_ASKED
}
# Namespaced mode peers through a KopfPeering in each watched namespace instead.
PEERING_SWAP = {"clusterkopfpeerings": "kopfpeerings"}

Request = audit.Request


def owner_lookup(kubeconfig: Path) -> None:
    """The DaskWorkerGroup path from a worker's pod to its Deployment goes through the pod's
    ReplicaSet; only tests/e2e/test_daskworkergroup.py takes it. Run the operator's code for a
    ReplicaSet-owned pod whose ReplicaSet does not exist, so that the request is in this
    scenario's log (the API server answers 404 once RBAC has allowed it) whichever modules ran."""
    pod = {
        "metadata": {
            "name": "dk-default-worker-0a1b2c3d4e-6c8d9f-x2k4q",
            "namespace": "default",
            "ownerReferences": [{"kind": "ReplicaSet", "name": "dk-default-worker-0a1b2c3d4e-6c8d9f"}],
        }
    }

    async def look_up() -> str | None:
        client = kube.Kube(kube.load_connection(str(kubeconfig)))
        try:
            return await workloads.owning_deployment(client, pod)
        finally:
            await client.close()

    assert asyncio.run(look_up()) is None, "no such ReplicaSet"


def _webhook_certificate(directory: Path) -> tuple[Path, Path, bytes]:
    """A CA and a serving certificate for localhost, as the chart makes for its Service."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "memops-webhook-ca")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.IPv4Address("127.0.0.1"))]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    cert_file, key_file = directory / "tls.crt", directory / "tls.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_file, key_file, ca.public_bytes(serialization.Encoding.PEM)


def _chart_arguments(deployment: dict[str, Any], replacements: dict[str, str]) -> list[str]:
    """The container's arguments with the in-cluster paths and ports replaced by local ones."""
    args: list[str] = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    out = []
    for arg in args:
        flag = arg.partition("=")[0]
        out.append(f"{flag}={replacements[flag]}" if flag in replacements else arg)
    return out


def _policy(name: str, address: str, replicas: int) -> dict[str, Any]:
    return {
        "apiVersion": "memops.dev/v1alpha1",
        "kind": "MemoryPolicy",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "scheduler": {"address": address},
            "workload": {"kind": "Deployment", "name": "dask-worker"},
            "replicas": replicas,
        },
    }


@pytest.fixture(scope="module")
def chart_scenario(tmp_path_factory: pytest.TempPathFactory, audit_log: Path) -> Iterator[dict[str, Any]]:
    """Run the operator as the chart runs it through a short scenario; yields what it observed."""
    directory = tmp_path_factory.mktemp("chart-mode")
    state_dir = directory / "sandbox"
    process = sandbox_cli.launch(state_dir, 3, *EVERY_FEATURE, "--no-operator", "--audit-log", str(audit_log))
    sandbox = Sandbox(state_dir, process)
    operator: subprocess.Popen[bytes] | None = None
    try:
        # The sandbox applied the chart's CRDs, ServiceAccount, RBAC and peering, and wrote the
        # ServiceAccount's token to operator-kubeconfig; the webhook is this module's to register.
        objects = manifests.render_chart(namespace="default")
        cert_file, key_file, ca = _webhook_certificate(directory)
        webhook_port = sandbox_cli.free_port()
        health_port = sandbox_cli.free_port(webhook_port)
        metrics_port = sandbox_cli.free_port(webhook_port, health_port)
        # The chart's webhook configuration with the Service reference replaced by a URL (the
        # operator runs on this machine, not behind a Service); the API server calls it over TLS.
        config = manifests.one(objects, "MutatingWebhookConfiguration")
        for hook in config["webhooks"]:
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {
                "url": f"https://127.0.0.1:{webhook_port}{path}",
                "caBundle": base64.b64encode(ca).decode(),
            }
        sandbox.apply(config)

        kubeconfig = state_dir / "operator-kubeconfig"
        user = audit.kubeconfig_user(kubeconfig)
        health_url = f"http://127.0.0.1:{health_port}/healthz"
        args = _chart_arguments(
            manifests.one(objects, "Deployment"),
            {
                "--liveness": health_url,
                "--webhook-port": str(webhook_port),
                "--webhook-host": "127.0.0.1",
                "--webhook-cert-file": str(cert_file),
                "--webhook-key-file": str(key_file),
                "--metrics-port": str(metrics_port),
                "--metrics-host": "127.0.0.1",
            },
        )
        log = (directory / "operator.log").open("wb")
        operator = subprocess.Popen(
            [str(Path(sys.executable).parent / "memops"), "run", *args],
            stdout=log,
            stderr=log,
            env={**os.environ, "KUBECONFIG": str(kubeconfig), "POD_ID": "memops-0", "POD_NAMESPACE": install.NAMESPACE},
            start_new_session=True,
        )

        def healthy() -> bool:
            try:
                with urllib.request.urlopen(health_url, timeout=2) as response:
                    return bool(response.status == 200)
            except OSError:
                return False

        sandbox.wait_for(healthy, timeout=60, what="the operator's liveness probe")
        owner_lookup(kubeconfig)
        peers = sandbox.wait_for(
            lambda: sandbox.get("clusterkopfpeering", "memops").get("status"), timeout=30, what="a peering keep-alive"
        )

        # A RetirementRequest.
        sandbox.apply(
            {
                "apiVersion": "memops.dev/v1alpha1",
                "kind": "RetirementRequest",
                "metadata": {"name": "shrink", "namespace": "default"},
                "spec": {
                    "scheduler": {"address": sandbox.scheduler_address},
                    "workload": {"kind": "Deployment", "name": "dask-worker"},
                    "count": 1,
                    "timeout": "2m",
                },
            }
        )
        request = sandbox.wait_phase("shrink", "Succeeded", "Failed", timeout=90)

        # A MemoryPolicy: a scale-up whose new pod gets the safety net through the webhook, then a
        # drained scale-down.
        sandbox.apply(_policy("analytics", sandbox.scheduler_address, 2))
        sandbox.kubectl("scale", "mempol/analytics", "--replicas=3")
        sandbox.wait_for(lambda: len(sandbox.pods()) == 3, what="the scale-up's pod")
        netted = [
            pod
            for pod in sandbox.get("pods", "-l", "app=dask-worker")["items"]
            if (pod["metadata"].get("annotations") or {}).get("memops.dev/safety-net") == "analytics"
        ]
        sandbox.kubectl("scale", "mempol/analytics", "--replicas=2")
        sandbox.wait_for(lambda: sandbox.replicas() == 2 and len(sandbox.pods()) == 2, what="a drained scale-down")
        policy = sandbox.wait_for(
            lambda: (p := sandbox.get("mempol", "analytics")) and argocd.health(p)["status"] == "Healthy" and p,
            timeout=60,
            what="the policy to settle",
        )
        yield {
            "peers": peers,
            "request": request,
            "policy": policy,
            "netted": netted,
            "user": user,
            "audit_log": state_dir / "audit.log",
        }
    finally:
        if operator is not None and operator.poll() is None:
            os.killpg(operator.pid, signal.SIGTERM)
            operator.wait(30)
        sandbox.stop()


def test_chart_mode_operator_peers_serves_the_webhook_and_drains(chart_scenario: dict[str, Any]) -> None:
    assert "memops-0" in chart_scenario["peers"], "the operator announced itself in the ClusterKopfPeering"
    assert chart_scenario["request"]["status"]["phase"] == "Succeeded"
    assert len(chart_scenario["netted"]) == 1, "the scale-up's pod went through the chart's webhook, over TLS"
    assert argocd.health(chart_scenario["request"])["status"] == "Healthy"
    assert argocd.health(chart_scenario["policy"])["status"] == "Healthy"


def _as_rendered(requests: list[Request]) -> set[Request]:
    """The requests in the operator's own namespace as made in :data:`RELEASE_NAMESPACE`."""
    return {(*r[:3], RELEASE_NAMESPACE if r[3] == install.NAMESPACE else r[3]) for r in requests}


def _used(
    scenario: dict[str, Any], audit_log: Path, request: pytest.FixtureRequest
) -> tuple[set[Request], set[manifests.Triple]]:
    """The operator's requests in this session, and the E2E_ONLY permissions left unchecked."""
    chart_mode = _as_rendered(audit.requests(scenario["audit_log"], scenario["user"]))
    e2e = _as_rendered(audit.requests(audit_log, scenario["user"]))
    assert chart_mode, "the chart-mode scenario made no requests"
    assert not {r[:3] for r in chart_mode} & SANDBOX_ONLY.keys(), (
        "with --webhook-unmanaged Kopf must not touch webhook configurations"
    )
    used = {r for r in chart_mode | e2e if r[:3] not in SANDBOX_ONLY}
    ran = {item.path.relative_to(manifests.ROOT).as_posix() for item in request.session.items}
    expected = {t for t, module in E2E_ONLY.items() if module in ran}
    unseen = sorted(expected - {r[:3] for r in used})
    assert not unseen, f"expected from tests/e2e modules that ran in this session, not in the log: {unseen}"
    unchecked = (set(E2E_ONLY) - expected) | UPSTREAM_ONLY | KUBELET_ASKED
    if unchecked:
        print(
            "their tests/e2e modules did not run, or the kubelets ask for them: not checked for use:", sorted(unchecked)
        )
    return used, unchecked


def _not_granted(objects: list[manifests.Obj], used: set[Request]) -> list[Request]:
    """The requests that the objects do not allow where they were made."""
    return sorted(r for r in used if r[:3] not in manifests.granted(objects, namespace=r[3]))


def test_rbac_grants_what_the_operator_uses(
    chart_scenario: dict[str, Any], audit_log: Path, request: pytest.FixtureRequest
) -> None:
    """Cluster-wide (the operator's mode in every scenario): each request allowed in its own
    namespace, cluster-wide ones by a ClusterRole; and nothing granted that is never used."""
    used, unchecked = _used(chart_scenario, audit_log, request)
    every_component = list(COMPONENTS.values())
    for name, objects in (
        ("helm/memops", manifests.render_chart({"rbac": FEATURES})),
        ("deploy/kustomize/base", manifests.kustomize_with(manifests.KUSTOMIZE / "base", every_component)),
    ):
        missing = _not_granted(objects, used)
        assert not missing, (
            f"{name} does not grant what the operator uses, where it uses it: {missing}; add it to the rules in"
            " helm/memops/templates/_helpers.tpl, deploy/kustomize/base/rbac.yaml and"
            " deploy/kustomize/overlays/namespaced/role.yaml (or a feature's block and component)"
        )
        extra = manifests.granted(objects) - {r[:3] for r in used} - unchecked
        assert not extra, f"{name} grants what the operator never uses: {sorted(extra)}"
        print(f"{name}: grants {len(manifests.granted(objects))} (group, resource, verb); requests seen {len(used)}")
    print("operator requests, as RBAC sees them:", json.dumps(sorted(used)))


def _watched(resource: str, namespace: str, cluster_scoped: set[str]) -> str:
    """Where a request would be made watching only "default": there, unless cluster-scoped or in
    the operator's own namespace (the gate's Leases)."""
    if resource in cluster_scoped:
        return ""
    return namespace if namespace == RELEASE_NAMESPACE else "default"


def test_namespaced_mode_grants_it_in_the_watched_namespace_only(
    chart_scenario: dict[str, Any], audit_log: Path, request: pytest.FixtureRequest
) -> None:
    """Watching only "default", the operator makes the same requests there: each namespaced one
    (and each cluster-wide list or watch of a namespaced kind, which becomes one in "default")
    must be allowed in "default", and no namespace it does not watch grants it anything."""
    used, _ = _used(chart_scenario, audit_log, request)
    objects = manifests.render_chart({"rbac": FEATURES, "watchNamespaces": ["default"], **OPEN})
    cluster_scoped = CLUSTER_SCOPED - set(PEERING_SWAP)
    as_namespaced = {
        (group, PEERING_SWAP.get(resource, resource), verb, _watched(resource, namespace, cluster_scoped))
        for group, resource, verb, namespace in used
    }
    missing = _not_granted(objects, as_namespaced)
    assert not missing, f"watchNamespaces=[default] does not grant, where it is needed: {missing}"
    cluster_wide = manifests.granted(objects, namespace="")
    assert manifests.granted(objects, namespace="other") == cluster_wide, "nothing in a namespace not watched"
    # Nodes are cluster-scoped: replication targets and the node signals read them in either mode,
    # and node pressure their kubelets (nodes/stats and nodes/configz, with rbac.kubeletStats, on here).
    assert {resource for _, resource, _ in cluster_wide} == {
        "customresourcedefinitions",
        "nodes",
        "nodes/stats",
        "nodes/configz",
    }


@pytest.mark.parametrize("namespaces", [[], ["dask"]], ids=["cluster-wide", "namespaced"])
@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_feature_gated_permissions_only_with_their_value(feature: str, namespaces: list[str]) -> None:
    gated = {p for p, value in permissions.FEATURE_GATED.items() if value == f"rbac.{feature}=true"}
    others = {name: True for name in FEATURES if name != feature}
    on = manifests.render_chart({"rbac": {**others, feature: True}, "watchNamespaces": namespaces, **OPEN})
    off = manifests.render_chart({"rbac": {**others, feature: False}, "watchNamespaces": namespaces, **OPEN})
    assert manifests.granted(on) - manifests.granted(off) == set(gated), f"exactly what rbac.{feature} grants"
    default = manifests.render_chart({"watchNamespaces": namespaces, **OPEN})
    assert not manifests.granted(default) & set(gated), f"rbac.{feature} is off by default"
    tree = manifests.KUSTOMIZE / ("overlays/namespaced" if namespaces else "base")
    with_component = manifests.granted(manifests.kustomize_with(tree, [COMPONENTS[feature]]))
    assert with_component - manifests.granted(manifests.kustomize(tree)) == set(gated)
