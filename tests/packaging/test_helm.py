"""The Helm chart helm/memops, linted and rendered by Helm's own library (helm-python-sdk, Helm v4),
and every rendered object validated against Kubernetes' OpenAPI schemas (kubernetes-validate)."""

from __future__ import annotations

import base64
import copy
import datetime
import re
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from cryptography import x509

from tests.packaging import manifests

ROOT = manifests.ROOT

VALUE_SETS = {
    "default": {},
    "namespaced": {
        "watchNamespaces": ["dask", "ml"],
        "webhook": {"networkPolicy": {"from": [{"ipBlock": {"cidr": "10.0.0.0/24"}}]}},
    },
    "cert-manager": {"webhook": {"certManager": {"enabled": True}}},
    "cert-manager-issuer": {
        "webhook": {"certManager": {"enabled": True, "issuerRef": {"name": "corp-ca", "kind": "ClusterIssuer"}}}
    },
    "service-monitor": {"metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}}}},
    "minimal": {
        "replicas": 1,
        "webhook": {"enabled": False},
        "metrics": {"enabled": False},
        "peering": {"create": False},
    },
    "features": {
        "rbac": {"schedulerTLS": True, "daskWorkerGroups": True},
        "watchNamespaces": ["dask"],
        "webhook": {"clientCA": {"configMap": "apiserver-webhook-client-ca"}},
    },
    "network-policy-peers": {
        "webhook": {"networkPolicy": {"from": [{"ipBlock": {"cidr": "10.0.0.0/24"}}]}},
        "metrics": {"networkPolicy": {"from": []}},
    },
    "no-network-policy": {"networkPolicy": {"enabled": False}},
    "shared-spill-node": {"sharedSpill": {"nodeDaemonSet": {"enabled": True, "size": "64g", "mode": "0770"}}},
    "shared-spill-roots": {"sharedSpill": {"hostRoots": ["/mnt/spill", "/dev/shm/memops"]}},
    "disruption-protection": {"disruptionProtection": {"maxDuration": "15m", "disabledNamespaces": ["batch"]}},
    "resize": {"rbac": {"podResize": True}, "resize": {"namespaces": ["dask"], "maxLimitIn": {"dask": "16Gi"}}},
}


def test_helm_lint_finds_nothing_but_the_missing_icon() -> None:
    report = helm.lint(manifests.CHART, strict=True)
    assert report["errors"] == []
    # The one finding is informational (severity 1): memops has no icon to point to.
    assert [(m["severity"], m["error"]) for m in report["messages"]] == [(1, "icon is recommended")]
    for values in VALUE_SETS.values():
        assert helm.lint(manifests.CHART, values, strict=True)["errors"] == []


def test_helm_lint_reports_bad_values() -> None:
    """The lint above is live: the same call reports an error for a bad value."""
    report = helm.lint(manifests.CHART, {"replicas": "1"}, strict=True)
    assert any("/replicas" in error for error in report["errors"])


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_rendered_objects_are_valid_kubernetes(values: dict[str, Any]) -> None:
    objects = manifests.render_chart(values)
    report = manifests.validate(objects)
    assert len(report["validated"]) + len(report["foreign"]) == len(objects)
    for what in report["foreign"]:
        assert what.split("/")[0] in manifests.FOREIGN_KINDS
    print(f"validated {len(report['validated'])} objects; not validated (no schema): {report['foreign']}")


def test_validation_catches_an_unknown_field() -> None:
    """kubernetes-validate runs strict: a misspelt field in the Deployment fails."""
    deployment = copy.deepcopy(manifests.one(manifests.render_chart(), "Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["argz"] = ["--all-namespaces"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, manifests.KUBE_VERSIONS[-1], strict=True)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        pytest.param({"replicas": "1"}, "/replicas", id="replicas-as-string"),
        pytest.param({"replicas": 6}, "/replicas", id="six-replicas"),
        pytest.param({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy", id="unknown-pull-policy"),
        pytest.param({"image": {"digest": "latest"}}, "/image/digest", id="digest-not-sha256"),
        pytest.param({"watchNamespaces": ["Dask_NS"]}, "/watchNamespaces/0", id="bad-namespace-name"),
        pytest.param({"webhook": {"timeoutSeconds": 60}}, "/webhook/timeoutSeconds", id="timeout-over-30"),
        pytest.param({"webhook": {"failurePolicy": "Fail"}}, "failurePolicy", id="failure-policy-not-a-value"),
        pytest.param(
            {"metrics": {"serviceMonitor": {"interval": "often"}}},
            "/metrics/serviceMonitor/interval",
            id="bad-interval",
        ),
        pytest.param({"replica": 1}, "replica", id="misspelt-key"),
        pytest.param(
            {"sharedSpill": {"nodeDaemonSet": {"hostPath": "/etc/spill"}}},
            "/sharedSpill/nodeDaemonSet/hostPath",
            id="spill-under-etc",
        ),
        pytest.param(
            {"sharedSpill": {"nodeDaemonSet": {"hostPath": "/spill"}}},
            "/sharedSpill/nodeDaemonSet/hostPath",
            id="spill-parent-is-root",
        ),
        pytest.param(
            {"sharedSpill": {"nodeDaemonSet": {"size": "8g;reboot"}}},
            "/sharedSpill/nodeDaemonSet/size",
            id="spill-size-not-a-size",
        ),
        pytest.param(
            {"sharedSpill": {"nodeDaemonSet": {"mode": "a+rwx"}}}, "/sharedSpill/nodeDaemonSet/mode", id="spill-mode"
        ),
        *(
            pytest.param({"sharedSpill": {"hostRoots": [root]}}, "/sharedSpill/hostRoots/0", id=f"root-{name}")
            for name, root in (
                ("under-etc", "/etc/spill"),
                ("dev-shm", "/dev/shm"),
                ("kubelet-parent", "/var/lib"),
                ("dotdot", "/mnt/../etc"),
                ("trailing-slash", "/mnt/"),
            )
        ),
        pytest.param({"sharedSpill": {"hostRoots": ["/a", "/a"]}}, "/sharedSpill/hostRoots", id="root-twice"),
        pytest.param({"rbac": {"schedulerTLS": "yes"}}, "/rbac/schedulerTLS", id="feature-not-a-boolean"),
        pytest.param({"webhook": {"clientNames": [""]}}, "/webhook/clientNames/0", id="empty-client-name"),
        pytest.param({"webhook": {"clientCA": {"key": ""}}}, "/webhook/clientCA/key", id="empty-client-ca-key"),
        pytest.param(
            {"webhook": {"allowUnauthenticatedSources": "yes"}},
            "/webhook/allowUnauthenticatedSources",
            id="open-not-a-boolean",
        ),
        pytest.param(
            {"webhook": {"networkPolicy": {"from": [{"ipBlock": {}}]}}},
            "/webhook/networkPolicy/from/0/ipBlock",
            id="ip-block-without-cidr",
        ),
        pytest.param(
            {"metrics": {"networkPolicy": {"from": [{"namespace": "monitoring"}]}}},
            "/metrics/networkPolicy/from/0",
            id="not-a-network-policy-peer",
        ),
        pytest.param(
            {"disruptionProtection": {"maxDuration": "1 day"}},
            "/disruptionProtection/maxDuration",
            id="protection-not-a-duration",
        ),
        pytest.param(
            {"disruptionProtection": {"disabledNamespaces": ["batch,ml"]}},
            "/disruptionProtection/disabledNamespaces/0",
            id="protection-off-in-no-namespace",
        ),
        pytest.param({"resize": {"maxLimit": "lots"}}, "/resize/maxLimit", id="resize-ceiling-not-a-quantity"),
        pytest.param({"resize": {"namespaces": ["dask,ml"]}}, "/resize/namespaces/0", id="resize-in-no-namespace"),
        pytest.param(
            {"resize": {"maxLimitIn": {"ml": "8 GiB"}}}, "/resize/maxLimitIn/ml", id="resize-ceiling-in-not-a-quantity"
        ),
        pytest.param(
            {"resize": {"maxLimitIn": {"Team": "8Gi"}}},
            "invalid propertyName 'Team'",
            id="resize-ceiling-in-no-namespace",
        ),
        # Gone: the kubelets are read directly with rbac.kubeletStats, never through the node proxy.
        pytest.param({"rbac": {"nodeProxy": True}}, "nodeProxy", id="node-proxy-gone"),
        pytest.param({"kubeletCA": "Kubelet_CA"}, "/kubeletCA", id="kubelet-ca-not-a-name"),
    ],
)
def test_schema_rejects_bad_values(values: dict[str, Any], message: str) -> None:
    with helm.Chart.load(manifests.CHART) as chart:
        with pytest.raises(helm.HelmValuesError, match=message):
            chart.validate_schema(values)
        with pytest.raises(helm.HelmValuesError, match=message):
            chart.render(values, name="memops", namespace="memops")


def test_values_yaml_is_documented_line_by_line() -> None:
    """Every value in values.yaml has a comment right above it; Kubernetes structures passed through
    as they are (resources, security contexts) are documented once, above their block."""
    lines = (manifests.CHART / "values.yaml").read_text().splitlines()
    passed_through = ("resources:", "podSecurityContext:", "securityContext:")
    undocumented = []
    block_indent: int | None = None
    for number, line in enumerate(lines):
        stripped = line.strip()
        indent = len(line) - len(stripped)
        if block_indent is not None and stripped and indent <= block_indent:
            block_indent = None
        if not stripped or stripped.startswith("#") or block_indent is not None:
            continue
        if stripped in passed_through:
            block_indent = indent
        elif stripped.endswith(":"):
            continue  # a group of values, each documented
        if not lines[number - 1].strip().startswith("#"):
            undocumented.append(line)
    assert undocumented == []


def test_chart_crds_are_the_generated_ones() -> None:
    for generated in sorted((ROOT / "crds").glob("*.yaml")):
        copy_ = manifests.CHART / "crds" / generated.name
        assert copy_.exists(), f"helm/memops/crds/{generated.name} is missing: cp crds/*.yaml helm/memops/crds/"
        assert copy_.read_bytes() == generated.read_bytes(), f"helm/memops/crds/{generated.name} differs from crds/"


def test_deployment_runs_memops_with_peering_probes_and_a_locked_down_container() -> None:
    objects = manifests.render_chart()
    deployment = manifests.one(objects, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    args = container["args"]
    assert "--standalone" not in args, "the chart's operator takes part in Kopf peering"
    assert "--all-namespaces" in args
    assert "--liveness=http://0.0.0.0:8080/healthz" in args
    assert {"--webhook-unmanaged", "--webhook-cert-file=/etc/memops/webhook/tls.crt"} <= set(args)
    assert {"name": "POD_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in container["env"]
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"health": 8080, "webhook": 9443, "metrics": 9090}
    security = container["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["serviceAccountName"] == manifests.one(objects, "ServiceAccount")["metadata"]["name"]
    peering = manifests.one(objects, "ClusterKopfPeering")
    assert peering["metadata"]["name"] == "memops"  # memops.controllers sets settings.peering.name


def test_two_replicas_roll_one_at_a_time_on_different_nodes_under_a_disruption_budget() -> None:
    """The default: two operator pods, replaced one at a time with the new one Ready first (a
    webhook always answers), preferring different nodes, and a PodDisruptionBudget that lets a
    drain take only one of them; both select the operator's pods, not the spill DaemonSet's."""
    objects = manifests.render_chart({"sharedSpill": {"nodeDaemonSet": {"enabled": True}}})
    deployment = manifests.one(objects, "Deployment")
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    operator_labels = deployment["spec"]["template"]["metadata"]["labels"]
    (term,) = deployment["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"
    ]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    budget = manifests.one(objects, "PodDisruptionBudget")
    assert budget["spec"]["maxUnavailable"] == 1
    for selector in (
        budget["spec"]["selector"]["matchLabels"],
        term["podAffinityTerm"]["labelSelector"]["matchLabels"],
    ):
        assert selector.items() <= operator_labels.items()
        assert selector["app.kubernetes.io/component"] == "operator"
    spill = [o for o in objects if o["kind"] == "DaemonSet"]
    for daemon in spill:
        labels = daemon["spec"]["template"]["metadata"]["labels"]
        assert not budget["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_one_replica_is_recreated_without_a_disruption_budget() -> None:
    """One replica: the old pod stops before the new one starts (two would overlap for nothing),
    and no PodDisruptionBudget, which would block every node drain of its node."""
    objects = manifests.render_chart({"replicas": 1})
    assert manifests.one(objects, "Deployment")["spec"]["strategy"] == {"type": "Recreate"}
    assert manifests.find(objects, "PodDisruptionBudget") == []
    assert "affinity" not in manifests.one(objects, "Deployment")["spec"]["template"]["spec"]


def test_replicas_without_peering_are_refused() -> None:
    """Two replicas and no peering object would both reconcile: the chart refuses to render."""
    with pytest.raises(Exception, match=r"replicas > 1 needs peering\.create=true"):
        manifests.render_chart({"peering": {"create": False}})


def test_namespaced_mode_watches_only_its_namespaces() -> None:
    objects = manifests.render_chart(VALUE_SETS["namespaced"])
    args = manifests.one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--all-namespaces" not in args
    assert [a for a in args if a.startswith("--namespace=")] == ["--namespace=dask", "--namespace=ml"]
    # And the release's own namespace: the eviction gate's Leases.
    assert sorted(r["metadata"]["namespace"] for r in manifests.find(objects, "Role")) == ["dask", "memops", "ml"]
    assert sorted(p["metadata"]["namespace"] for p in manifests.find(objects, "KopfPeering")) == ["dask", "ml"]
    assert manifests.find(objects, "ClusterKopfPeering") == []
    cluster_wide = set(manifests.expand(manifests.one(objects, "ClusterRole")["rules"]))
    # Nodes are cluster-scoped: replication targets read their labels, the node signals
    # (spec.eviction.nodeSignals) watch them, in either mode.
    assert cluster_wide == {("apiextensions.k8s.io", "customresourcedefinitions", v) for v in ("list", "watch")} | {
        ("", "nodes", v) for v in ("get", "list", "watch")
    }
    # Each namespace gets exactly what the cluster-wide mode grants everywhere, with the
    # namespaced peering in place of the cluster one.
    everywhere = manifests.granted(manifests.render_chart(), namespace="dask")
    swap = {
        ("kopf.dev", "clusterkopfpeerings", v): ("kopf.dev", "kopfpeerings", v)
        for v in ("get", "list", "watch", "patch")
    }
    expected = {swap.get(t, t) for t in everywhere}
    for namespace in ("dask", "ml"):
        assert manifests.granted(objects, namespace=namespace) == expected
    # The release's namespace, in either mode: the gate's Leases, and nothing else there.
    leases = {("coordination.k8s.io", "leases", v) for v in ("get", "create", "update", "delete")}
    for chart in (objects, manifests.render_chart()):
        assert manifests.granted(chart, namespace="memops") - manifests.granted(chart, namespace="other") == leases
    assert not leases & manifests.granted(objects, namespace="dask"), "no tenant namespace grants Leases"
    hook = manifests.one(objects, "MutatingWebhookConfiguration")["webhooks"][0]
    assert hook["namespaceSelector"]["matchExpressions"] == [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["dask", "ml"]}
    ]


def test_network_policy_admits_only_the_webhook_and_metrics_ports() -> None:
    default = manifests.render_chart()
    policy = manifests.one(default, "NetworkPolicy")["spec"]
    pod = manifests.one(default, "Deployment")["spec"]["template"]
    assert policy["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert policy["policyTypes"] == ["Ingress"]
    webhook, metrics = policy["ingress"]
    assert webhook == {"ports": [{"port": 9443, "protocol": "TCP"}]}, "any source by default: see values.yaml"
    assert metrics["ports"] == [{"port": 9090, "protocol": "TCP"}]
    assert metrics["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    peers = manifests.one(manifests.render_chart(VALUE_SETS["network-policy-peers"]), "NetworkPolicy")["spec"]
    assert peers["ingress"][0]["from"] == [{"ipBlock": {"cidr": "10.0.0.0/24"}}]
    assert "from" not in peers["ingress"][1], "an empty list admits any source"
    closed = manifests.one(manifests.render_chart(VALUE_SETS["minimal"]), "NetworkPolicy")["spec"]
    assert closed["ingress"] == [], "no server, no port open"
    assert manifests.find(manifests.render_chart(VALUE_SETS["no-network-policy"]), "NetworkPolicy") == []


def _certificate(data: str) -> x509.Certificate:
    return x509.load_pem_x509_certificate(base64.b64decode(data))


def test_webhook_with_a_self_signed_certificate_from_helm() -> None:
    objects = manifests.render_chart(namespace="ops")
    config = manifests.one(objects, "MutatingWebhookConfiguration")
    (hook,) = config["webhooks"]
    assert hook["failurePolicy"] == "Ignore"
    assert hook["sideEffects"] == "None"
    assert hook["rules"] == [
        {
            "apiGroups": [""],
            "apiVersions": ["v1"],
            "resources": ["pods"],
            "operations": ["CREATE"],
            "scope": "Namespaced",
        }
    ]
    assert hook["clientConfig"]["service"] == {
        "name": "memops-webhook",
        "namespace": "ops",
        "path": "/safety-net",
        "port": 443,
    }
    assert {
        "key": "kubernetes.io/metadata.name",
        "operator": "NotIn",
        "values": ["kube-system", "kube-public", "kube-node-lease"],
    } in hook["namespaceSelector"]["matchExpressions"]
    assert hook["objectSelector"]["matchExpressions"] == [
        {"key": "app.kubernetes.io/name", "operator": "NotIn", "values": ["memops"]}
    ]
    secret = manifests.one(objects, "Secret", "memops-webhook-tls")
    ca, served = _certificate(secret["data"]["ca.crt"]), _certificate(secret["data"]["tls.crt"])
    assert hook["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]
    served.verify_directly_issued_by(ca)  # the caBundle really signs what the operator serves
    names = served.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName
    )
    assert "memops-webhook.ops.svc" in names
    assert served.not_valid_after_utc - datetime.datetime.now(datetime.UTC) > datetime.timedelta(days=3000)
    volume = next(
        v
        for v in manifests.one(objects, "Deployment")["spec"]["template"]["spec"]["volumes"]
        if v["name"] == "webhook-tls"
    )
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    service = manifests.one(objects, "Service", "memops-webhook")
    assert service["spec"]["ports"] == [{"name": "webhook", "port": 443, "targetPort": "webhook", "protocol": "TCP"}]


def test_webhook_with_cert_manager() -> None:
    objects = manifests.render_chart(VALUE_SETS["cert-manager"], namespace="ops")
    assert manifests.find(objects, "Secret") == [], "cert-manager writes the Secret"
    config = manifests.one(objects, "MutatingWebhookConfiguration")
    assert config["metadata"]["annotations"] == {"cert-manager.io/inject-ca-from": "ops/memops-webhook"}
    assert "caBundle" not in config["webhooks"][0]["clientConfig"]
    serving = manifests.one(objects, "Certificate", "memops-webhook")
    assert serving["spec"]["secretName"] == "memops-webhook-tls"
    assert "memops-webhook.ops.svc" in serving["spec"]["dnsNames"]
    ca_issuer = manifests.one(objects, "Issuer", serving["spec"]["issuerRef"]["name"])
    ca = manifests.one(objects, "Certificate", "memops-webhook-ca")
    assert ca["spec"]["isCA"] is True and ca_issuer["spec"]["ca"]["secretName"] == ca["spec"]["secretName"]
    assert manifests.one(objects, "Issuer", ca["spec"]["issuerRef"]["name"])["spec"] == {"selfSigned": {}}
    # With an existing issuer, the chart creates no issuers of its own.
    objects = manifests.render_chart(VALUE_SETS["cert-manager-issuer"], namespace="ops")
    assert manifests.find(objects, "Issuer") == []
    assert manifests.one(objects, "Certificate")["spec"]["issuerRef"] == {
        "name": "corp-ca",
        "kind": "ClusterIssuer",
        "group": "cert-manager.io",
    }


def test_service_monitor_scrapes_the_metrics_service() -> None:
    objects = manifests.render_chart(VALUE_SETS["service-monitor"])
    monitor = manifests.one(objects, "ServiceMonitor")
    service = manifests.one(objects, "Service", "memops-metrics")
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    selected = monitor["spec"]["selector"]["matchLabels"]
    assert selected.items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "30s"}]
    assert service["spec"]["ports"][0]["name"] == "metrics"
    assert manifests.find(manifests.render_chart(), "ServiceMonitor") == [], "off by default"


def test_readme_values_summary_names_real_values() -> None:
    """Each `key` the install guide's values table lists is a value of the chart."""
    guide = (ROOT / "docs" / "install.md").read_text()
    section = guide.split("## Helm values", 1)[1].split("\n## ", 1)[0]
    defaults = yaml.safe_load((manifests.CHART / "values.yaml").read_text())
    rows = [
        key
        for line in section.splitlines()
        if line.startswith("| `")
        for key in re.findall(r"`([^`]+)`", line.split("|")[1])
    ]
    assert rows, "no values table in the install guide's Helm values section"
    for key in rows:
        node: Any = defaults
        for part in key.split("."):
            assert isinstance(node, dict) and part in node, f"install.md lists `{key}`, not in values.yaml"
            node = node[part]


def test_shared_spill_daemonset_is_off_by_default_and_least_privileged_when_on() -> None:
    assert manifests.find(manifests.render_chart(), "DaemonSet") == []
    values = {"sharedSpill": {"nodeDaemonSet": {"enabled": True, "size": "64g", "uid": 1000, "gid": 1000}}}
    daemonset = manifests.one(manifests.render_chart(values), "DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert not {"hostNetwork", "hostPID", "hostIPC"} & set(pod)
    assert pod["nodeSelector"] == {"feature.node.kubernetes.io/memory-swap.enabled": "true"}
    # The node's parent directory only, and the tmpfs mounted on its child.
    assert pod["volumes"] == [
        {"name": "node-parent", "hostPath": {"path": "/var/lib/memops", "type": "DirectoryOrCreate"}}
    ]
    (init,) = pod["initContainers"]
    env = {e["name"]: e["value"] for e in init["env"]}
    # Not 1777 for every user of the node: root and the group list the root and write in the
    # <namespace>/<policy> directories that the kubelet makes with its mode (setgid: its group).
    assert env == {
        "SPILL_DIR": "/node/spill",
        "SPILL_OPTIONS": "size=64g,mode=2770,uid=1000,gid=1000,nosuid,nodev,noexec",
        "SPILL_OWNER": "1000:1000",
        "SPILL_MODE": "2770",
    }
    # Set again after a remount too, which ignores mode=, uid= and gid=.
    script = init["command"][2]
    assert script.index('chown "$SPILL_OWNER" "$SPILL_DIR"') > script.index("fi\n")
    assert script.index('chmod "$SPILL_MODE" "$SPILL_DIR"') > script.index("fi\n")
    # Never asked for; and the script refuses a tmpfs that ended up noswap.
    assert "noswap" not in env["SPILL_OPTIONS"] and "*noswap*) echo" in init["command"][2]
    assert init["volumeMounts"][0]["mountPropagation"] == "Bidirectional"
    assert init["securityContext"] == {
        "privileged": True,
        "runAsUser": 0,
        "runAsNonRoot": False,
        "readOnlyRootFilesystem": True,
    }
    (main,) = pod["containers"]
    assert main["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert main["securityContext"]["allowPrivilegeEscalation"] is False
    assert main["securityContext"]["runAsNonRoot"] is True
    assert main["securityContext"]["readOnlyRootFilesystem"] is True
    assert "volumeMounts" not in main
    assert all(c["resources"]["requests"] for c in (init, main))


def _host_roots(values: dict[str, Any]) -> list[str]:
    pod = manifests.one(manifests.render_chart(values), "Deployment")["spec"]["template"]["spec"]
    args: list[str] = pod["containers"][0]["args"]
    return [a.split("=", 1)[1] for a in args if a.startswith("--shared-spill-host-root")]


@pytest.mark.parametrize(
    ("values", "roots"),
    [
        # None allowed by default: a MemoryPolicy's medium Node is refused.
        pytest.param({}, [], id="default"),
        pytest.param(
            {"sharedSpill": {"hostRoots": ["/mnt/spill", "/dev/shm/memops"]}},
            ["/dev/shm/memops", "/mnt/spill"],
            id="two",
        ),
        # The DaemonSet's tmpfs is allowed with it, once.
        pytest.param({"sharedSpill": {"nodeDaemonSet": {"enabled": True}}}, ["/var/lib/memops/spill"], id="daemonset"),
        pytest.param(
            {"sharedSpill": {"nodeDaemonSet": {"enabled": True, "hostPath": "/srv/spill"}, "hostRoots": ["/mnt/a"]}},
            ["/mnt/a", "/srv/spill"],
            id="daemonset-path-and-a-root",
        ),
        pytest.param(
            {"sharedSpill": {"nodeDaemonSet": {"enabled": True}, "hostRoots": ["/var/lib/memops/spill"]}},
            ["/var/lib/memops/spill"],
            id="daemonset-path-also-listed",
        ),
        # Siblings whose names share a prefix are not nested.
        pytest.param(
            {"sharedSpill": {"hostRoots": ["/mnt/spill", "/mnt/spill-b"]}},
            ["/mnt/spill", "/mnt/spill-b"],
            id="siblings",
        ),
    ],
)
def test_shared_spill_host_roots_become_the_operators_flags(values: dict[str, Any], roots: list[str]) -> None:
    assert _host_roots(values) == roots


@pytest.mark.parametrize(
    ("values", "flags"),
    [
        pytest.param({}, ["--max-disruption-protection=1h"], id="default"),
        pytest.param(
            {"disruptionProtection": {"maxDuration": "30m", "disabledNamespaces": ["batch", "ml"]}},
            [
                "--max-disruption-protection=30m",
                "--no-disruption-protection-in=batch",
                "--no-disruption-protection-in=ml",
            ],
            id="lower-and-off-in-two-namespaces",
        ),
    ],
)
def test_disruption_protection_values_become_the_operators_flags(values: dict[str, Any], flags: list[str]) -> None:
    pod = manifests.one(manifests.render_chart(values), "Deployment")["spec"]["template"]["spec"]
    args: list[str] = pod["containers"][0]["args"]
    assert [a for a in args if "disruption-protection" in a] == flags


@pytest.mark.parametrize(
    ("values", "flags"),
    [
        pytest.param({}, ["--max-resize-limit=64Gi"], id="default-no-namespace"),
        pytest.param(
            {"resize": {"namespaces": ["dask", "ml"], "maxLimit": "32Gi", "maxLimitIn": {"ml": "8Gi", "big": "256Gi"}}},
            [
                "--max-resize-limit=32Gi",
                "--max-resize-limit-in=big=256Gi",
                "--max-resize-limit-in=ml=8Gi",
                "--resize-in=dask",
                "--resize-in=ml",
            ],
            id="two-namespaces-and-their-ceilings",
        ),
        pytest.param({"resize": {"namespaces": ["*"]}}, ["--max-resize-limit=64Gi", "--resize-in=*"], id="every"),
    ],
)
def test_resize_values_become_the_operators_flags(values: dict[str, Any], flags: list[str]) -> None:
    """Where in-place growth may act (``resize.namespaces``), and how far (``resize.maxLimit``,
    ``resize.maxLimitIn``): only the administrator sets them, and by default no namespace is listed."""
    pod = manifests.one(manifests.render_chart(values), "Deployment")["spec"]["template"]["spec"]
    args: list[str] = pod["containers"][0]["args"]
    assert [a for a in args if "resize" in a] == flags


def test_the_kubelets_ca_becomes_a_mounted_configmap_and_the_operators_flag() -> None:
    """``kubeletCA`` names a ConfigMap whose ``ca.crt`` verifies the kubelets' serving certificates;
    unset, no flag (the API server's CA) and no volume."""
    for values, flags in (({}, []), ({"kubeletCA": "kubelet-ca"}, ["--kubelet-ca-file=/etc/memops/kubelet-ca/ca.crt"])):
        pod = manifests.one(manifests.render_chart(values), "Deployment")["spec"]["template"]["spec"]
        [container] = pod["containers"]
        assert [a for a in container["args"] if a.startswith("--kubelet-ca-file")] == flags
        mounts = [m for m in container["volumeMounts"] if m["name"] == "kubelet-ca"]
        volumes = [v for v in pod["volumes"] if v["name"] == "kubelet-ca"]
        if not flags:
            assert mounts == [] and volumes == []
            continue
        assert mounts == [{"name": "kubelet-ca", "mountPath": "/etc/memops/kubelet-ca", "readOnly": True}]
        assert volumes == [
            {"name": "kubelet-ca", "configMap": {"name": "kubelet-ca", "items": [{"key": "ca.crt", "path": "ca.crt"}]}}
        ]


def test_nested_host_roots_fail_the_install() -> None:
    """The operator would refuse them when it starts: Helm says so first."""
    values = {"sharedSpill": {"nodeDaemonSet": {"enabled": True}, "hostRoots": ["/var/lib/memops"]}}
    with pytest.raises(Exception, match="/var/lib/memops/spill lies under /var/lib/memops"):
        manifests.render_chart(values)


PEERS = {"from": [{"ipBlock": {"cidr": "10.0.0.0/24"}}]}


@pytest.mark.parametrize(
    "values",
    [
        pytest.param({"watchNamespaces": ["dask"]}, id="multi-tenant-defaults"),
        pytest.param(
            {"watchNamespaces": ["dask"], "networkPolicy": {"enabled": False}, "webhook": {"networkPolicy": PEERS}},
            id="peers-but-no-network-policy",
        ),
        pytest.param(
            {"watchNamespaces": ["dask"], "webhook": {"clientNames": ["kube-apiserver-webhook"]}},
            id="names-pinned-without-a-ca",
        ),
    ],
)
def test_a_multi_tenant_webhook_open_to_every_source_fails_the_install(values: dict[str, Any]) -> None:
    """Any pod could post admission reviews that the eviction gate acts on (a drain of another
    tenant's workers): Helm refuses the install and says what to set."""
    with pytest.raises(Exception, match=r"webhook\.clientCA"):
        manifests.render_chart(values)


@pytest.mark.parametrize(
    "values",
    [
        pytest.param({}, id="one-team-cluster-wide"),
        pytest.param({"watchNamespaces": ["dask"], "webhook": {"enabled": False}}, id="no-webhook"),
        pytest.param({"watchNamespaces": ["dask"], "webhook": {"networkPolicy": PEERS}}, id="api-server-source-only"),
        pytest.param({"watchNamespaces": ["dask"], "webhook": {"clientCA": {"secret": "ca"}}}, id="client-ca"),
        pytest.param(
            {"watchNamespaces": ["dask"], "webhook": {"allowUnauthenticatedSources": True}}, id="told-otherwise"
        ),
    ],
)
def test_a_webhook_closed_to_other_sources_or_explicitly_open_installs(values: dict[str, Any]) -> None:
    manifests.validate(manifests.render_chart(values))


@pytest.mark.parametrize(
    ("client_ca", "volume"),
    [
        pytest.param(
            {"configMap": "apiserver-webhook-ca"},
            {"configMap": {"name": "apiserver-webhook-ca", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
            id="config-map",
        ),
        pytest.param(
            {"secret": "apiserver-webhook-ca", "key": "client-ca.pem"},
            {"secret": {"secretName": "apiserver-webhook-ca", "items": [{"key": "client-ca.pem", "path": "ca.crt"}]}},
            id="secret",
        ),
    ],
)
def test_the_client_ca_is_mounted_and_required(client_ca: dict[str, str], volume: dict[str, Any]) -> None:
    values = {"webhook": {"clientCA": client_ca, "clientNames": ["kube-apiserver-webhook", "apiserver.example"]}}
    pod = manifests.one(manifests.render_chart(values), "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert [a for a in container["args"] if a.startswith("--webhook-client")] == [
        "--webhook-client-ca-file=/etc/memops/webhook-client-ca/ca.crt",
        "--webhook-client-name=kube-apiserver-webhook",
        "--webhook-client-name=apiserver.example",
    ]
    mount = {"name": "webhook-client-ca", "mountPath": "/etc/memops/webhook-client-ca", "readOnly": True}
    assert mount in container["volumeMounts"]
    assert {"name": "webhook-client-ca", **volume} in pod["volumes"]


def test_no_client_ca_by_default() -> None:
    pod = manifests.one(manifests.render_chart(), "Deployment")["spec"]["template"]["spec"]
    assert not [a for a in pod["containers"][0]["args"] if a.startswith("--webhook-client")]
    assert "webhook-client-ca" not in {v["name"] for v in pod["volumes"]}


def test_a_client_ca_from_two_sources_fails_the_install() -> None:
    with pytest.raises(Exception, match="not both"):
        manifests.render_chart({"webhook": {"clientCA": {"configMap": "a", "secret": "b"}}})


GUARD_KINDS = ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")


@pytest.mark.parametrize(
    ("values", "name", "namespace", "user"),
    [
        pytest.param({}, "memops", "memops", "system:serviceaccount:memops:memops", id="default"),
        pytest.param({}, "ops", "platform", "system:serviceaccount:platform:ops-memops", id="release-and-namespace"),
        pytest.param(
            {"fullnameOverride": "mo"}, "ops", "platform", "system:serviceaccount:platform:mo", id="fullname-override"
        ),
        pytest.param(
            {"serviceAccount": {"create": False, "name": "existing"}},
            "ops",
            "platform",
            "system:serviceaccount:platform:existing",
            id="existing-service-account",
        ),
    ],
)
def test_the_pod_patch_guard_holds_the_releases_service_account(
    values: dict[str, Any], name: str, namespace: str, user: str
) -> None:
    """On by default: a ValidatingAdmissionPolicy and its binding that refuse memops' ServiceAccount,
    and no one else, an update of a pod outside its metadata, and any subresource but resize."""
    objects = manifests.render_chart(values, name=name, namespace=namespace)
    manifests.validate(objects)
    policy = manifests.one(objects, "ValidatingAdmissionPolicy")
    binding = manifests.one(objects, "ValidatingAdmissionPolicyBinding")
    assert policy["metadata"]["name"] == binding["spec"]["policyName"] == binding["metadata"]["name"]
    assert policy["metadata"]["name"].endswith("-pod-patch-guard")
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert "matchResources" not in binding["spec"], "every namespace: wherever the ServiceAccount may patch pods"
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"
    assert spec["matchConstraints"] == {
        "resourceRules": [
            {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["UPDATE"], "resources": ["pods", "pods/*"]}
        ]
    }
    assert spec["matchConditions"] == [
        {"name": "memops-service-account", "expression": f'request.userInfo.username == "{user}"'}
    ]
    assert spec["variables"] == [
        {"name": "subresource", "expression": 'has(request.subResource) ? request.subResource : ""'}
    ]
    metadata_only, resize_only = spec["validations"]
    assert metadata_only["expression"] == (
        'variables.subresource != "" || (object.spec == oldObject.spec && object.status == oldObject.status)'
    )
    assert metadata_only["message"].startswith(f"{user} may change a pod's metadata")
    assert resize_only["expression"] == 'variables.subresource in ["", "resize"]'
    assert resize_only["messageExpression"].startswith(f"\"{user} may change a pod's metadata")
    assert "reason" not in metadata_only and "reason" not in resize_only, (
        "422 Invalid: memops' client reads a 403 as a permission that RBAC lacks"
    )


def test_the_pod_patch_guard_is_off_with_its_value_and_before_kubernetes_1_30() -> None:
    """Its value turns it off; a cluster that serves no admissionregistration.k8s.io/v1 policies
    (1.28, 1.29: the chart's kubeVersion allows them) gets the rest of the chart, valid there."""
    assert manifests.find(manifests.render_chart(kube_version="1.30.0"), GUARD_KINDS[0])
    off = manifests.render_chart({"rbac": {"podPatchGuard": {"enabled": False}}})
    for kube_version in ("1.28.0", "1.29.15"):
        old = manifests.render_chart(kube_version=kube_version)
        for kind in GUARD_KINDS:
            assert manifests.find(old, kind) == [] and manifests.find(off, kind) == []
        manifests.validate(old)  # each Kubernetes kind against 1.28's schemas too
    with helm.Chart.load(manifests.CHART) as chart:
        with pytest.raises(helm.HelmValuesError, match="podPatchGuard"):
            chart.validate_schema({"rbac": {"podPatchGuard": True}})
        with pytest.raises(helm.HelmValuesError, match="podPatchGuard/enabled"):
            chart.validate_schema({"rbac": {"podPatchGuard": {"enabled": "yes"}}})


@pytest.mark.parametrize("namespaces", [[], ["dask"]], ids=["cluster-wide", "namespaced"])
def test_the_pod_patch_guard_grants_the_operator_nothing(namespaces: list[str]) -> None:
    """The installer applies the policy, as it applies the RBAC: the operator never reads it."""
    values: dict[str, Any] = {"watchNamespaces": namespaces, "webhook": {"allowUnauthenticatedSources": True}}
    on = manifests.render_chart(values)
    off = manifests.render_chart({**values, "rbac": {"podPatchGuard": {"enabled": False}}})
    for namespace in ("", "dask", "other", None):
        assert manifests.granted(on, namespace=namespace) == manifests.granted(off, namespace=namespace)
    assert not {t for t in manifests.granted(on) if t[0] == "admissionregistration.k8s.io"}
