"""The upstream control plane as ``memops-sandbox plane`` starts it: etcd, kube-apiserver,
kube-controller-manager and kube-scheduler from the binaries that ``memops_sandbox.build``
makes, with the operator's CRDs, ServiceAccount and RBAC applied from the Helm chart.

One plane is shared by the module (it starts in about five seconds from the cached binaries);
the last test starts its own to check that SIGTERM leaves no process behind. Skipped, with the
reason, only where the binaries are not cached and cannot be built (no Go toolchain): CI builds
them first (``memops-sandbox build`` in ``.ci/run``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from memops_sandbox import build, upstream

from memops.decisions import selectors
from tests import polling, reads

KUBECTL = Path(sys.executable).parent / "kubectl"
OPERATOR = "system:serviceaccount:memops-system:memops"


def _binaries() -> build.Binaries:
    try:
        return build.ensure()
    except build.BuildError as error:
        pytest.skip(f"the control plane's binaries cannot be built here: {error}")


class RunningPlane:
    """A control plane's state directory, with kubectl at hand; ``process`` where the test started
    it itself (else the suite's ``plane`` fixture stops it)."""

    def __init__(self, state_dir: Path, process: subprocess.Popen[bytes] | None = None):
        self.state_dir = state_dir
        self.process = process

    def kubectl(
        self, *args: str, as_operator: bool = False, input: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        config = self.state_dir / ("operator-kubeconfig" if as_operator else "kubeconfig")
        result = subprocess.run(
            [str(KUBECTL), "--kubeconfig", str(config), *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "KUBECACHEDIR": str(self.state_dir / "kubecache")},
        )
        if check:
            assert result.returncode == 0, f"kubectl {' '.join(args)}: {result.stderr}"
        return result

    def get(self, *what: str) -> Any:
        return json.loads(self.kubectl("get", *what, "-o", "json").stdout)

    def pids(self) -> dict[str, int]:
        return {path.stem: int(path.read_text()) for path in (self.state_dir / "logs").glob("*.pid")}

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(60)


def poll(predicate: Any, *, timeout: float, what: str) -> Any:
    return polling.wait_for(predicate, timeout=timeout, what=what)


def start(state_dir: Path) -> RunningPlane:
    _binaries()
    return RunningPlane(state_dir, upstream.launch_plane(state_dir))


@pytest.fixture(scope="module")
def plane(plane: Path) -> RunningPlane:
    """The suite's control plane (``plane`` of tests/conftest.py), seen through kubectl."""
    return RunningPlane(plane)


def test_kubectl_reports_the_pinned_release(plane: RunningPlane) -> None:
    version = json.loads(plane.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"] == build.kubernetes_version()
    assert version["serverVersion"]["gitTreeState"] == "clean"


def test_a_deployment_gets_a_real_replicaset(plane: RunningPlane) -> None:
    """The upstream Deployment controller makes a ReplicaSet (with its pod-template-hash), and
    the ReplicaSet controller makes pods owned by it, not by the Deployment."""
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web", "namespace": "default"},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": {"containers": [{"name": "web", "image": "example.invalid/web:1"}]},
            },
        },
    }
    plane.kubectl("apply", "-f", "-", input=yaml.safe_dump(deployment))
    replicasets = poll(lambda: plane.get("replicasets", "-l", "app=web")["items"], timeout=30, what="the ReplicaSet")
    (replicaset,) = replicasets
    (owner,) = replicaset["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"]) == ("Deployment", "web")
    assert replicaset["metadata"]["labels"]["pod-template-hash"]

    def two_pods() -> list[dict[str, Any]] | None:
        items: list[dict[str, Any]] = plane.get("pods", "-l", "app=web")["items"]
        return items if len(items) == 2 else None

    pods = poll(two_pods, timeout=30, what="two pods")
    for pod in pods:
        (owner,) = pod["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"]) == ("ReplicaSet", replicaset["metadata"]["name"])


def test_rbac_denies_the_operator_what_the_chart_does_not_grant(plane: RunningPlane) -> None:
    """The operator's kubeconfig is its ServiceAccount's token; the chart grants it pods and its
    CRDs, not Secrets. The API server says so in its own words, and its audit log names the user."""
    allowed = plane.kubectl("get", "retirementrequests", "-A", as_operator=True)
    assert allowed.returncode == 0
    denied = plane.kubectl("get", "secrets", "-n", "default", as_operator=True, check=False)
    assert denied.returncode != 0
    assert f'User "{OPERATOR}" cannot list resource "secrets"' in denied.stderr

    def audited() -> list[dict[str, Any]]:
        lines = (plane.state_dir / "audit.log").read_text().splitlines()
        events = [json.loads(line) for line in lines if line.strip()]
        return [
            e
            for e in events
            if e["user"]["username"] == OPERATOR
            and e.get("objectRef", {}).get("resource") == "secrets"
            and e["responseStatus"]["code"] == 403
        ]

    poll(audited, timeout=10, what="the denied request in the audit log")


def test_the_crd_schema_refuses_a_bad_object_in_the_api_servers_words(plane: RunningPlane) -> None:
    request = {
        "apiVersion": "memops.dev/v1alpha1",
        "kind": "RetirementRequest",
        "metadata": {"name": "none", "namespace": "default"},
        "spec": {
            "scheduler": {"address": "tcp://127.0.0.1:8786"},
            "workload": {"kind": "Deployment", "name": "dask-worker"},
            "count": 0,
        },
    }
    refused = plane.kubectl("apply", "-f", "-", input=yaml.safe_dump(request), check=False)
    assert refused.returncode != 0
    assert "spec.count: Invalid value: 0: spec.count in body should be greater than or equal to 1" in refused.stderr
    request["spec"]["count"] = 1
    plane.kubectl("apply", "-f", "-", input=yaml.safe_dump(request))


EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "deploy" / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_passes_the_api_servers_validation(plane: RunningPlane, path: Path) -> None:
    """A server-side dry run: the generated CRD's schema, its CEL rules and strict field
    validation (an unknown field is an error, not a warning) in the API server's own words."""
    result = plane.kubectl(
        "apply", "--dry-run=server", "--validate=strict", "-f", str(path), "-n", "default", check=False
    )
    assert result.returncode == 0, result.stderr
    assert "(server dry run)" in result.stdout


@pytest.mark.parametrize(
    ("keys", "refusal"),
    [
        pytest.param(
            {"pattern": "(a|a)*b"},
            'spec.replication.rules[0].keys.pattern: Invalid value: "(a|a)*b": regular expressions are no longer',
            id="regular-expression",
        ),
        pytest.param({"glob": "*" * 257}, "spec.replication.rules[0].keys.glob: Too long", id="long-glob"),
        pytest.param({"glob": "*a" * 100 + "*b"}, None, id="any-short-glob"),
    ],
)
def test_the_crd_schema_refuses_what_the_scheduler_cannot_match_safely(
    plane: RunningPlane, keys: dict[str, str], refusal: str | None
) -> None:
    """A key rule's regular expression, or an over-long glob, is refused by the API server,
    naming the field, before the operator or the scheduler sees it; a short glob is accepted."""
    policy = yaml.safe_load((EXAMPLES[0].parent / "memorypolicy-replication.yaml").read_text())
    policy["spec"]["replication"]["rules"][0]["keys"] = keys
    result = plane.kubectl(
        "apply", "--dry-run=server", "--validate=strict", "-f", "-", "-n", "default",
        input=yaml.safe_dump(policy), check=False,
    )  # fmt: skip
    if refusal is None:
        assert result.returncode == 0, result.stderr
    else:
        assert result.returncode != 0
        assert refusal in result.stderr, result.stderr


SELECTORS = [
    {"matchLabels": {"b": "2", "a": "1"}},
    {"matchExpressions": [{"key": "app", "operator": "In", "values": ["mexp"]}]},
    {"matchExpressions": [{"key": "app", "operator": "In", "values": ["y", "x"]}]},
    {
        "matchLabels": {"app": "w"},
        "matchExpressions": [
            {"key": "tier", "operator": "NotIn", "values": ["a"]},
            {"key": "w", "operator": "Exists"},
            {"key": "old", "operator": "DoesNotExist"},
        ],
    },
]
LABEL_SETS = [
    {"app": "w", "tier": "b", "w": "1"},
    {"app": "w", "tier": "a", "w": "1"},
    {"app": "w", "w": "1", "old": "1"},
    {"app": "mexp"},
    {"app": "x"},
    {"a": "1", "b": "2"},
]


def test_a_rendered_selector_selects_on_the_api_server_what_memops_matches(plane: RunningPlane) -> None:
    """memops lists pods with ``selectors.render`` and decides with ``selectors.matches``: the
    API server must read the rendered string back to the same selection."""
    namespace = "selectors"
    plane.kubectl("create", "namespace", namespace)
    for index, labels in enumerate(LABEL_SETS):
        config_map = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": f"labels-{index}", "namespace": namespace, "labels": labels},
        }
        plane.kubectl("apply", "-f", "-", input=yaml.safe_dump(config_map))
    for selector in SELECTORS:
        rendered = selectors.render(selector)
        found = plane.get("configmaps", "-n", namespace, "-l", rendered)["items"]
        expected = {f"labels-{i}" for i, labels in enumerate(LABEL_SETS) if selectors.matches(selector, labels)}
        assert {c["metadata"]["name"] for c in found} == expected, rendered


def test_a_killed_api_server_is_started_again_with_what_it_stored(tmp_path: Path) -> None:
    """As a kubelet keeps a static pod: SIGKILLed, the API server is started again with its
    arguments, on the same port and etcd, and answers with what was stored before."""
    running = start(tmp_path / "state")
    try:
        running.kubectl("create", "namespace", "kept")
        before = running.pids()["kube-apiserver"]
        os.kill(before, signal.SIGKILL)

        def again() -> bool:
            after = running.pids()["kube-apiserver"]
            answer = running.kubectl("get", "--raw", "/readyz", check=False)
            return after != before and answer.returncode == 0 and answer.stdout == "ok"

        poll(again, timeout=60, what="the API server started again and ready")
        assert running.get("namespace", "kept")["metadata"]["name"] == "kept"
        assert running.process is not None and running.process.poll() is None, "the plane runs on"
    finally:
        running.stop()


def test_sigterm_stops_every_component(tmp_path: Path) -> None:
    running = start(tmp_path / "state")
    pids = running.pids()
    assert set(pids) == {"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler"}
    running.stop()
    assert running.process.returncode == 0
    assert not (tmp_path / "state" / "ready").exists()
    for name, pid in pids.items():
        assert not Path(f"/proc/{pid}").exists() or _zombie(pid), f"{name} (pid {pid}) outlived the plane"


def _zombie(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(")")[-1].split()[0] == "Z"


READS = [
    ("namespaces",),
    ("ns", "kube-system"),
    ("serviceaccounts", "-A"),
    ("configmaps,serviceaccounts", "-n", "kube-system"),
    ("clusterroles", "-l", "kubernetes.io/bootstrapping=rbac-defaults"),
    ("ns", "--field-selector=metadata.name=default"),
    ("retire", "read-back"),
    ("retirementrequests.memops.dev", "--selector", "app=reads", "--namespace", "default"),
    ("mempol",),
]


def test_the_tests_reads_print_what_kubectl_get_prints(plane: RunningPlane) -> None:
    """The end-to-end tests read objects back in their own process (``tests/reads.py``): for
    each form they use, the same JSON as ``kubectl get -o json``, the same refusal, and kubectl
    itself for any other form. Nothing of these objects changes between the two reads."""
    request = {
        "apiVersion": "memops.dev/v1alpha1",
        "kind": "RetirementRequest",
        "metadata": {"name": "read-back", "namespace": "default", "labels": {"app": "reads"}},
        "spec": {
            "scheduler": {"address": "tcp://127.0.0.1:8786"},
            "workload": {"kind": "Deployment", "name": "dask-worker"},
            "count": 1,
        },
    }
    plane.kubectl("apply", "-f", "-", input=yaml.safe_dump(request))
    reader = reads.reader(plane.state_dir / "kubeconfig")
    assert reader is not None, "the admin kubeconfig's client certificate is static"
    for args in READS:
        query = reads.parse(args)
        assert query is not None, args
        ours = reader.get(query)
        assert ours == plane.get(*args), args
    listed = reader.get(reads.Query(("namespaces",)))
    assert {item["kind"] for item in listed["items"]} == {"Namespace"}, "a list's items name their kind"
    refused = plane.kubectl("get", "pod", "nope", "-n", "default", "-o", "json", check=False)
    with pytest.raises(AssertionError) as raised:
        reader.get(reads.Query(("pod",), "nope", namespace="default"))
    assert refused.returncode != 0 and refused.stderr.strip() in str(raised.value)
    for other in [("pods", "-o", "wide"), ("pod/web",), ("--raw", "/healthz"), ("pods", "a", "b"), ("pods", "-n")]:
        assert reads.parse(other) is None, f"kubectl reads {other}"
    assert reader.get(reads.Query(("nosuchthings",))) is None, "an unknown resource is kubectl's to report"
