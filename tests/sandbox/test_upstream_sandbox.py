"""``memops sandbox``: the whole sandbox on the upstream control plane.

Real kube-apiserver, etcd, controller-manager and scheduler; the node agent serving two Nodes
with their own client certificates; a real ``dask scheduler`` and ``dask worker`` pods made by
the real ReplicaSet controller; the operator under its ServiceAccount's token, its webhook
called by the API server over TLS. Skipped only where the binaries cannot be built (no Go).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from memops_sandbox import build
from memops_sandbox import common as sandbox_cli

KUBECTL = Path(sys.executable).parent / "kubectl"
OPERATOR = "system:serviceaccount:memops-system:memops"
PROBE_REF = {"resource": "pods", "namespace": "default", "name": "probe", "apiVersion": "v1"}


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, subprocess.Popen[bytes]]]:
    try:
        build.ensure()
    except build.BuildError as error:
        pytest.skip(f"the control plane's binaries cannot be built here: {error}")
    state_dir = tmp_path_factory.mktemp("upstream") / "state"
    process = sandbox_cli.launch(state_dir, 2, "--nodes", "2")
    try:
        yield state_dir, process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(60)


def kubectl_json(state_dir: Path, *args: str) -> Any:
    result = subprocess.run(
        [str(KUBECTL), "--kubeconfig", str(state_dir / "kubeconfig"), *args, "-o", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "KUBECACHEDIR": str(state_dir / "kubecache")},
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def audit(state_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (state_dir / "audit.log").read_text().splitlines() if line.strip()]


def test_workers_run_on_ready_nodes_under_a_real_replicaset(sandbox: tuple[Path, subprocess.Popen[bytes]]) -> None:
    state_dir, _ = sandbox
    nodes = kubectl_json(state_dir, "get", "nodes")["items"]
    assert sorted(n["metadata"]["name"] for n in nodes) == ["node-0", "node-1"]
    for node in nodes:
        ready = [c for c in node["status"]["conditions"] if c["type"] == "Ready"]
        assert ready[0]["status"] == "True"
    pods = kubectl_json(state_dir, "get", "pods", "-l", "app=dask-worker")["items"]
    assert len(pods) == 2
    for pod in pods:
        assert pod["status"]["phase"] == "Running"
        assert pod["spec"]["nodeName"] in ("node-0", "node-1")
        (owner,) = pod["metadata"]["ownerReferences"]
        assert owner["kind"] == "ReplicaSet"
    # The node agent acted as each node, not as an admin: the Node authorizer let it through.
    users = {e["user"]["username"] for e in audit(state_dir) if e.get("objectRef", {}).get("resource") == "nodes"}
    assert {"system:node:node-0", "system:node:node-1"} <= users


def test_the_operator_acts_as_its_service_account(sandbox: tuple[Path, subprocess.Popen[bytes]]) -> None:
    state_dir, _ = sandbox
    mine = [e for e in audit(state_dir) if e["user"]["username"] == OPERATOR]
    assert any(e.get("objectRef", {}).get("resource") == "retirementrequests" for e in mine)
    denied = [e.get("objectRef") for e in mine if e["responseStatus"]["code"] == 403]
    assert not denied, f"the chart's RBAC does not grant what the operator asked for: {denied}"


def test_the_api_server_calls_the_webhook_over_tls(sandbox: tuple[Path, subprocess.Popen[bytes]]) -> None:
    """A pod's creation passes through the chart's webhook configuration, pointed at the
    operator's TLS port with the sandbox CA: the audit log records the call, not a failure."""
    state_dir, _ = sandbox
    config = kubectl_json(state_dir, "get", "mutatingwebhookconfiguration", "memops")
    (webhook,) = config["webhooks"]
    assert webhook["clientConfig"]["url"].startswith("https://127.0.0.1:")
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "probe", "namespace": "default"},
        "spec": {"containers": [{"name": "c", "image": "example.invalid/c", "command": ["sleep", "1"]}]},
    }
    subprocess.run(
        [str(KUBECTL), "--kubeconfig", str(state_dir / "kubeconfig"), "create", "-f", "-"],
        input=json.dumps(pod),
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    deadline = time.monotonic() + 10
    created: list[dict[str, Any]] = []
    while not created and time.monotonic() < deadline:
        created = [
            e
            for e in audit(state_dir)
            if e["verb"] == "create" and e.get("objectRef", {}) | {"apiVersion": "v1"} == PROBE_REF
        ]
        time.sleep(0.1)
    (event,) = created
    annotations = event["annotations"]
    assert '"webhook":"safety-net.memops.dev"' in annotations["mutation.webhook.admission.k8s.io/round_0_index_0"]
    assert not any(key.startswith("failed-open") for key in annotations), annotations


def terminal(state_dir: Path) -> list[str]:
    """What ``memops sandbox`` wrote to its terminal (stdout and stderr: ``launch`` sends both to one file)."""
    return (state_dir.parent / f"{state_dir.name}-sandbox.log").read_text().splitlines()


# A log or access line of any component: a timestamp, a level, klog's "I1123 19:59:01.123456", or an
# aiohttp access line.
LOG_LINE = re.compile(
    r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d|\b(DEBUG|INFO|WARNING|ERROR|CRITICAL)\b"
    r"|^[IWEF]\d{4} |\"(GET|POST|PUT|PATCH|DELETE) /"
)


def test_the_terminal_says_only_what_to_do_next(sandbox: tuple[Path, subprocess.Popen[bytes]]) -> None:
    """A start line, a ready line and the commands to type; every process' log is in a file."""
    state_dir, _ = sandbox
    lines = terminal(state_dir)
    print("\n".join(lines))
    assert not [line for line in lines if LOG_LINE.search(line)], lines
    assert lines[0].startswith("memops sandbox: starting Kubernetes ") and str(state_dir) in lines[0]
    assert lines[1] == "memops sandbox: ready. In another terminal:"
    assert lines[2] == f"  export KUBECONFIG={state_dir / 'kubeconfig'}"
    assert all(line.startswith("  kubectl ") or " | kubectl " in line for line in lines[3:-1]), lines
    assert lines[-1].startswith("Logs: ") and lines[-1].endswith("Stop with Ctrl-C.")
    assert len(lines) <= 8
    # The logs went to files instead.
    for log in ("sandbox.log", "scheduler.log", "logs/kube-apiserver.log", "logs/operator.log", "logs/etcd.log"):
        assert (state_dir / log).stat().st_size > 0, log
    assert list((state_dir / "pods").glob("*.log"))


def test_sigterm_stops_every_process(sandbox: tuple[Path, subprocess.Popen[bytes]]) -> None:
    state_dir, process = sandbox
    pids = {path.name: int(path.read_text()) for path in state_dir.rglob("*.pid")}
    assert {"etcd.pid", "kube-apiserver.pid", "operator.pid", "scheduler.pid"} <= set(pids)
    process.send_signal(signal.SIGTERM)
    assert process.wait(60) == 0
    assert not (state_dir / "ready").exists()
    left = [name for name, pid in pids.items() if Path(f"/proc/{pid}").exists() and not _zombie(pid)]
    assert not left, f"outlived the sandbox: {left}"


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True
