"""The node agent against an upstream control plane: real kube-apiserver, controllers, scheduler,
and the pods as real processes.

The plane (``memops_sandbox.controlplane``, as the sandbox starts it) and one agent (serving two
nodes, as ``python -m memops_sandbox.nodeagent``) are shared by the module; each test works in
its own namespace. The pure parts (expansion, fieldRef, phase) have table tests at the top.
Skipped, with the reason, only where the Kubernetes binaries are neither cached nor buildable.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from memops_sandbox import build, controlplane
from memops_sandbox import nodeagent_env as envs
from memops_sandbox import nodeagent_status as statuses

from tests import polling, reads

KUBECTL = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or "kubectl"
NODES = ["node-a", "node-b"]
LONE_NODE = "node-c"  # served by an agent of its own, that the shutdown test stops
# The node lifecycle controller's --node-monitor-grace-period: the plane keeps the default
# (pkg/controller/nodelifecycle/config/v1alpha1/defaults.go), after which a silent node is NotReady.
MONITOR_GRACE = 50


# -- pure parts ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "variables", "expected"),
    [
        pytest.param("--name $(POD)", {"POD": "w-1"}, "--name w-1", id="expand"),
        pytest.param("$$(POD)", {"POD": "w-1"}, "$(POD)", id="escape"),
        pytest.param("$(MISSING)", {}, "$(MISSING)", id="unknown-stays"),
        pytest.param("$(A", {"A": "x"}, "$(A", id="unclosed-stays"),
        pytest.param("a$b$", {}, "a$b$", id="bare-dollar-stays"),
        pytest.param("$(A)$(B)", {"A": "1", "B": "2"}, "12", id="adjacent"),
        pytest.param("$(a b)", {"a b": "odd"}, "odd", id="any-name-up-to-closer"),
    ],
)
def test_expand_as_upstream(text: str, variables: dict[str, str], expected: str) -> None:
    assert envs.expand(text, variables) == expected


POD = {
    "metadata": {
        "name": "w-1",
        "namespace": "ns",
        "uid": "u-1",
        "labels": {"app": "dask", "tier": "w"},
        "annotations": {"a/b": "c"},
    },
    "spec": {"nodeName": "node-a", "serviceAccountName": "sa"},
}


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        pytest.param("metadata.name", "w-1", id="name"),
        pytest.param("metadata.namespace", "ns", id="namespace"),
        pytest.param("metadata.uid", "u-1", id="uid"),
        pytest.param("metadata.labels['app']", "dask", id="label"),
        pytest.param("metadata.labels['missing']", "", id="label-missing"),
        pytest.param("metadata.annotations['a/b']", "c", id="annotation"),
        pytest.param("metadata.labels", 'app="dask"\ntier="w"', id="labels-formatted"),
        pytest.param("spec.nodeName", "node-a", id="node"),
        pytest.param("spec.serviceAccountName", "sa", id="service-account"),
        pytest.param("status.podIP", "127.100.0.2", id="pod-ip"),
        pytest.param("status.podIPs", "127.100.0.2", id="pod-ips"),
        pytest.param("status.hostIP", "127.100.0.1", id="host-ip"),
    ],
)
def test_field_ref(path: str, expected: str) -> None:
    assert envs.field_value(POD, path, pod_ip="127.100.0.2", host_ip="127.100.0.1") == expected


def test_env_order_and_sources() -> None:
    container = {
        "name": "c",
        "envFrom": [{"configMapRef": {"name": "cm"}, "prefix": "CM_"}],
        "env": [
            {"name": "ME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "GREETING", "value": "hello $(ME) $(LATER)"},
            {"name": "LATER", "value": "x"},
            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "t"}}},
            {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "mode"}}},
            {"name": "GONE", "valueFrom": {"secretKeyRef": {"name": "nope", "key": "k", "optional": True}}},
            {"name": "RAW", "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['a/b']"}}},
        ],
    }
    env = envs.container_env(
        POD,
        container,
        pod_ip="127.100.0.2",
        host_ip="127.100.0.1",
        secrets={"s": {"data": {"t": "c2VjcmV0"}}, "nope": None},
        config_maps={"cm": {"data": {"mode": "fast"}}},
    )
    assert env == {
        "CM_mode": "fast",
        "ME": "w-1",
        "GREETING": "hello w-1 $(LATER)",
        "LATER": "x",
        "TOKEN": "secret",
        "MODE": "fast",
        "RAW": "c",
    }
    with pytest.raises(envs.ConfigError, match="couldn't find key t"):
        envs.container_env(
            POD,
            {"env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "s", "key": "t"}}}]},
            pod_ip="",
            host_ip="",
            secrets={"s": {"data": {}}},
            config_maps={},
        )


def container(state: str, code: int | None = None, last: int | None = None) -> statuses.Container:
    result = statuses.Container(name="c", state=state, exit_code=code)
    if last is not None:
        result.last_terminated = {"exitCode": last}
    return result


@pytest.mark.parametrize(
    ("policy", "state", "terminal", "expected"),
    [
        pytest.param("Always", container("waiting"), False, "Pending", id="creating"),
        pytest.param("Always", container("running"), False, "Running", id="running"),
        pytest.param("Always", container("waiting", last=1), False, "Running", id="crash-loop"),
        pytest.param("Always", container("terminated", 0), False, "Running", id="always-restarts-success"),
        pytest.param("OnFailure", container("terminated", 0), False, "Succeeded", id="on-failure-done"),
        pytest.param("OnFailure", container("terminated", 2), False, "Running", id="on-failure-retries"),
        pytest.param("Never", container("terminated", 0), False, "Succeeded", id="never-succeeded"),
        pytest.param("Never", container("terminated", 2), False, "Failed", id="never-failed"),
        pytest.param("Always", container("terminated", 143), True, "Failed", id="deleted-sigterm"),
        pytest.param("Always", container("terminated", 0), True, "Succeeded", id="deleted-clean-exit"),
        pytest.param("Always", container("waiting"), True, "Failed", id="deleted-before-start"),
    ],
)
def test_phase(policy: str, state: statuses.Container, terminal: bool, expected: str) -> None:
    assert statuses.phase(policy, state, terminal=terminal) == expected


def test_conditions_keep_transition_time() -> None:
    running = statuses.Container(name="c", state="running", ready=True)
    first = statuses.conditions([], running, "Running")
    assert {c["type"]: c["status"] for c in first}["Ready"] == "True"
    old = [{**c, "lastTransitionTime": "2020-01-01T00:00:00Z"} for c in first]
    again = statuses.conditions(old, running, "Running")
    assert all(c["lastTransitionTime"] == "2020-01-01T00:00:00Z" for c in again)
    running.ready = False
    flipped = {c["type"]: c for c in statuses.conditions(old, running, "Running")}
    assert flipped["Ready"]["status"] == "False"
    assert flipped["Ready"]["reason"] == "ContainersNotReady"
    assert flipped["Ready"]["lastTransitionTime"] != "2020-01-01T00:00:00Z"


# -- a control plane -------------------------------------------------------------------------


def find_binaries() -> build.Binaries:
    """``$MEMOPS_KUBERNETES_BIN`` if set, else the sandbox's cache (built there if need be)."""
    directory = os.environ.get("MEMOPS_KUBERNETES_BIN")
    if directory:
        binaries = build.Binaries(version=build.kubernetes_version(), directory=Path(directory))
        if binaries.complete():
            return binaries
    try:
        return build.ensure()
    except build.BuildError as error:
        reason = f"the control plane's binaries are not available: {error}"
        print(reason)
        pytest.skip(reason)


class PlaneThread:
    """``controlplane.running`` in an event loop of its own, for the module's synchronous tests."""

    def __init__(self, state_dir: Path, binaries: build.Binaries):
        self.state_dir = state_dir
        self.binaries = binaries
        self.loop = asyncio.new_event_loop()
        self.started = threading.Event()
        self.stop: asyncio.Event | None = None
        self.error: BaseException | None = None
        self.nodes: Path | None = None
        self.admin: Path | None = None
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self.main(),), daemon=True)

    async def main(self) -> None:
        self.stop = asyncio.Event()
        try:
            async with controlplane.running(self.state_dir, self.binaries) as plane:
                self.admin = plane.kubeconfig
                self.nodes = plane.nodes_kubeconfig([*NODES, LONE_NODE])
                self.started.set()
                await self.stop.wait()
        except BaseException as exc:
            self.error = exc
        finally:
            self.started.set()

    def __enter__(self) -> PlaneThread:
        self.thread.start()
        self.started.wait(300)
        if self.error is not None or self.admin is None:
            self.__exit__()
            raise RuntimeError(f"the control plane did not start: {self.error!r}")
        return self

    def __exit__(self, *_: object) -> None:
        if self.stop is not None:
            self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(120)
        self.loop.close()


@dataclass
class Plane:
    admin: Path
    nodes: Path
    directory: Path

    def kubectl(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [KUBECTL, "--kubeconfig", str(self.admin), *args],
            capture_output=True,
            text=True,
            check=check,
            timeout=timeout,
        )

    def get(self, *what: str) -> Any:
        return reads.get(self.admin, what, lambda: self.kubectl("get", *what, "-o", "json").stdout)

    def apply(self, manifest: dict[str, Any]) -> None:
        done = subprocess.run(
            [KUBECTL, "--kubeconfig", str(self.admin), "apply", "-f", "-"],
            input=json.dumps(manifest),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr


def wait_for(predicate: Callable[[], Any], *, timeout: float = 60, what: str) -> Any:
    return polling.wait_for(predicate, timeout=timeout, what=what, interval=0.25)


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plane]:
    binaries = find_binaries()
    directory = tmp_path_factory.mktemp("plane")
    with PlaneThread(directory / "state", binaries) as running:
        assert running.admin is not None and running.nodes is not None
        (directory / "logs").mkdir()
        yield Plane(admin=running.admin, nodes=running.nodes, directory=directory)


@dataclass
class Agent:
    process: subprocess.Popen[bytes]
    run_dir: Path
    log: Path


def start_agent(plane: Plane, run_dir: Path, nodes: list[str]) -> subprocess.Popen[bytes]:
    run_dir.mkdir(exist_ok=True)
    log = plane.directory / "logs" / f"nodeagent-{'-'.join(nodes)}.log"
    command = [sys.executable, "-m", "memops_sandbox.nodeagent", f"--kubeconfig={plane.nodes}", f"--run-dir={run_dir}"]
    with log.open("ab") as out:
        return subprocess.Popen([*command, *nodes], stdout=out, stderr=out)


def stop_agent(process: subprocess.Popen[bytes], timeout: float = 60) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise


@pytest.fixture(scope="module")
def agent(plane: Plane) -> Iterator[Agent]:
    run_dir = plane.directory / "run"
    process = start_agent(plane, run_dir, NODES)
    try:
        yield Agent(process=process, run_dir=run_dir, log=plane.directory / "logs")
    finally:
        stop_agent(process)


@pytest.fixture
def namespace(plane: Plane, request: pytest.FixtureRequest) -> str:
    name = request.node.name.replace("_", "-").lower()[:50]
    plane.kubectl("create", "namespace", name)
    wait_for(
        lambda: plane.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode == 0,
        what="the namespace's default service account",
    )
    return name


def taints(node: dict[str, Any]) -> set[str]:
    return {taint["key"] for taint in node["spec"].get("taints") or []}


def ready(obj: dict[str, Any]) -> bool:
    conditions = {c["type"]: c["status"] for c in obj.get("status", {}).get("conditions") or []}
    return conditions.get("Ready") == "True"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie has exited: its parent (the agent) has not reaped it yet.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(")")[-1].split()[0] != "Z"


NAME_ENV = [{"name": "T_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]


def pod_program(body: str) -> str:
    """A tiny Python container: prints its environment, handles SIGTERM, then runs ``body``."""
    return textwrap.dedent(
        """
        import json, os, signal, sys, time
        def term(*_):
            print("SIGTERM", time.time(), flush=True)
            sys.exit(0)
        signal.signal(signal.SIGTERM, term)
        print("ENV", json.dumps({k: v for k, v in os.environ.items() if k.startswith("T_")}), flush=True)
        """
    ) + textwrap.dedent(body)


def env_of(agent: Agent, namespace: str, name: str) -> dict[str, str]:
    log = agent.run_dir / "pods" / f"{namespace}_{name}.log"
    for line in log.read_text().splitlines() if log.exists() else []:
        if line.startswith("ENV "):
            return dict(json.loads(line[4:]))
    return {}


def events(plane: Plane, namespace: str, reason: str) -> list[dict[str, Any]]:
    return list(plane.get("events", "-n", namespace, "--field-selector", f"reason={reason}")["items"])


# -- nodes -----------------------------------------------------------------------------------


def test_nodes_register_and_stay_ready(plane: Plane, agent: Agent) -> None:
    """Both nodes register with capacity, lose the not-ready taint the admission plugin gives
    new nodes, and keep it off for longer than the node monitor's grace period."""

    def both_ready() -> bool:
        found = {n["metadata"]["name"]: n for n in plane.get("nodes")["items"]}
        return all(name in found and ready(found[name]) and not taints(found[name]) for name in NODES)

    wait_for(both_ready, timeout=60, what="both nodes Ready without taints")
    leases = {item["metadata"]["name"]: item for item in plane.get("leases", "-n", "kube-node-lease")["items"]}
    assert {lease["spec"]["holderIdentity"] for name, lease in leases.items() if name in NODES} == set(NODES)
    node = plane.get("node", NODES[0])
    assert node["status"]["capacity"] == {"cpu": "8", "memory": "16Gi", "pods": "110"}
    assert node["metadata"]["annotations"]["memops.dev/tmpfs-dir"].startswith("/dev/shm/")
    assert Path(node["metadata"]["annotations"]["memops.dev/tmpfs-dir"]).is_dir()
    first_renewal = leases[NODES[0]]["spec"]["renewTime"]
    deadline = time.monotonic() + MONITOR_GRACE + 10
    while time.monotonic() < deadline:
        for item in plane.get("nodes")["items"]:
            if item["metadata"]["name"] in NODES:
                assert ready(item), item["status"]["conditions"]
                assert not taints(item) & {"node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"}
        time.sleep(2)
    assert plane.get("lease", "-n", "kube-node-lease", NODES[0])["spec"]["renewTime"] != first_renewal


# -- pods ------------------------------------------------------------------------------------


def deployment(name: str, replicas: int, program: str, **container: Any) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "terminationGracePeriodSeconds": 10,
                    "containers": [
                        {"name": "main", "image": "python", "command": ["python", "-c", program], **container}
                    ],
                },
            },
        },
    }


def pods_of(plane: Plane, namespace: str, app: str) -> list[dict[str, Any]]:
    return list(plane.get("pods", "-n", namespace, "-l", f"app={app}")["items"])


def pod(
    name: str, namespace: str, program: str, *, grace: int | None = None, node: str | None = None, **container: Any
) -> dict[str, Any]:
    """A Pod of one Python container, ``main``, that runs ``program``."""
    spec: dict[str, Any] = {"containers": [{"name": "main", "image": "python", "command": ["python", "-c", program]}]}
    spec["containers"][0].update(container)
    if grace is not None:
        spec["terminationGracePeriodSeconds"] = grace
    if node is not None:
        spec["nodeName"] = node
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace}, "spec": spec}


def wait_running(plane: Plane, namespace: str, name: str) -> None:
    running = lambda: plane.get("pod", "-n", namespace, name)["status"].get("phase") == "Running"  # noqa: E731
    wait_for(running, what=f"{name} Running")


def test_deployment_runs_with_distinct_ips_env_and_readiness(plane: Plane, agent: Agent, namespace: str) -> None:
    """A Deployment's pods run as processes with the container's environment (fieldRef,
    secretKeyRef, configMapKeyRef, $(VAR)), each on its own pod IP, where the worker binds;
    a readiness probe that runs in that environment gates Ready."""
    plane.kubectl("create", "secret", "generic", "s", "--from-literal=token=sesame", "-n", namespace)
    plane.kubectl("create", "configmap", "cm", "--from-literal=mode=fast", "-n", namespace)
    markers = agent.run_dir / "markers"
    markers.mkdir(exist_ok=True)
    program = pod_program(
        """
        import socket
        server = socket.create_server((os.environ["T_IP"], 8786))
        print("BOUND", server.getsockname(), flush=True)
        while True:
            time.sleep(1)
        """
    )
    env = [
        {"name": "T_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "T_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "T_NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "T_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}},
        {"name": "T_APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
        {"name": "T_TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "token"}}},
        {"name": "T_MODE", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "mode"}}},
        {"name": "T_MARKER", "value": f"{markers}/$(T_NAME)"},
    ]
    probe = "import os, sys; sys.exit(not os.path.exists(os.environ['T_MARKER']))"
    plane.apply(
        deployment(
            "workers",
            2,
            program,
            env=env,
            readinessProbe={"exec": {"command": ["python", "-c", probe]}, "periodSeconds": 1, "failureThreshold": 1},
        )
        | {"metadata": {"name": "workers", "namespace": namespace}}
    )

    def running() -> list[dict[str, Any]] | None:
        pods = pods_of(plane, namespace, "workers")
        if len(pods) == 2 and all(p["status"].get("phase") == "Running" for p in pods):
            return pods
        return None

    pods = wait_for(running, timeout=60, what="2 Running pods")
    ips = {p["status"]["podIP"] for p in pods}
    assert len(ips) == 2 and all(ip.startswith("127.") for ip in ips)
    for pod in pods:
        name = pod["metadata"]["name"]
        got = wait_for(lambda name=name: env_of(agent, namespace, name), what=f"{name}'s environment")
        assert got == {
            "T_NAME": name,
            "T_IP": pod["status"]["podIP"],
            "T_NODE": pod["spec"]["nodeName"],
            "T_HOST": pod["status"]["hostIP"],
            "T_APP": "workers",
            "T_TOKEN": "sesame",
            "T_MODE": "fast",
            "T_MARKER": f"{markers}/{name}",
        }
        assert not ready(pod), "Ready before its readiness probe passed"
        assert pod["status"]["containerStatuses"][0]["started"] is True
    first, second = (p["metadata"]["name"] for p in pods)
    (markers / first).touch()
    wait_for(lambda: ready(plane.get("pod", "-n", namespace, first)), timeout=30, what="the probed pod Ready")
    assert not ready(plane.get("pod", "-n", namespace, second))
    assert events(plane, namespace, "Unhealthy"), "a failed readiness probe is an Unhealthy event"
    assert events(plane, namespace, "Started") and events(plane, namespace, "Created")


def test_delete_runs_prestop_in_container_env_then_sigterm(plane: Plane, agent: Agent, namespace: str) -> None:
    """``kubectl delete pod``: preStop runs with the container's environment, then SIGTERM,
    then the agent's final delete removes the pod."""
    out = agent.run_dir / f"prestop-{namespace}"
    program = pod_program("while True: time.sleep(1)\n")
    hook = {"preStop": {"exec": {"command": ["sh", "-c", f'echo "$T_NAME $(date +%s.%N)" > {out}']}}}
    plane.apply(pod("p", namespace, program, grace=20, env=NAME_ENV, lifecycle=hook))
    wait_running(plane, namespace, "p")
    pid = int(wait_for(lambda: (agent.run_dir / "pods" / f"{namespace}_p.pid").read_text(), what="the pid"))
    started = time.monotonic()
    plane.kubectl("delete", "pod", "p", "-n", namespace, "--wait=true", timeout=60)
    assert time.monotonic() - started < 15, "the pod handled SIGTERM: no wait for the grace period"
    assert not alive(pid)
    name, hooked = out.read_text().split()
    assert name == "p", "the hook ran in the container's environment"
    log = (agent.run_dir / "pods" / f"{namespace}_p.log").read_text()
    term = float(next(line.split()[1] for line in log.splitlines() if line.startswith("SIGTERM")))
    assert float(hooked) <= term, "preStop ran before SIGTERM"
    assert events(plane, namespace, "Killing")


def test_grace_period_counts_from_the_deletion_hook_included(plane: Plane, agent: Agent, namespace: str) -> None:
    """A container that ignores SIGTERM is killed when the grace period ends; the time its
    preStop hook took is taken from that period, not added to it (``killContainer``)."""
    program = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nwhile True: time.sleep(1)\n"
    hook = {"preStop": {"exec": {"command": ["sleep", "3"]}}}
    plane.apply(pod("stubborn", namespace, program, grace=6, lifecycle=hook))
    wait_running(plane, namespace, "stubborn")
    pid = int((agent.run_dir / "pods" / f"{namespace}_stubborn.pid").read_text())
    started = time.monotonic()
    plane.kubectl("delete", "pod", "stubborn", "-n", namespace, "--wait=true", timeout=60)
    took = time.monotonic() - started
    assert not alive(pid)
    # 6 s from the deletion: not 3 s (the hook's own time), nor 9 s (the grace after the hook).
    assert 5.0 <= took < 8.5, took


def test_failing_prestop_is_an_event_and_the_kill_goes_on(plane: Plane, agent: Agent, namespace: str) -> None:
    program = pod_program("while True: time.sleep(1)\n")
    hook = {"preStop": {"exec": {"command": ["sh", "-c", "exit 3"]}}}
    plane.apply(pod("bad-hook", namespace, program, grace=20, lifecycle=hook))
    wait_running(plane, namespace, "bad-hook")
    plane.kubectl("delete", "pod", "bad-hook", "-n", namespace, "--wait=true", timeout=60)
    [event] = events(plane, namespace, "FailedPreStopHook")
    assert event["type"] == "Warning"
    assert event["message"] == "PreStopHook failed"
    assert event["source"] == {"component": "kubelet", "host": event["source"]["host"]}
    assert event["involvedObject"]["fieldPath"] == "spec.containers{main}"


def test_exited_container_restarts_with_backoff(plane: Plane, agent: Agent, namespace: str) -> None:
    plane.apply(pod("crash", namespace, "raise SystemExit(3)"))

    def restarted() -> dict[str, Any] | None:
        status = plane.get("pod", "-n", namespace, "crash")["status"]
        containers = status.get("containerStatuses") or [{}]
        return containers[0] if containers[0].get("restartCount", 0) >= 2 else None

    container_status = wait_for(restarted, timeout=60, what="two restarts")
    assert container_status["lastState"]["terminated"]["exitCode"] == 3
    assert container_status["lastState"]["terminated"]["reason"] == "Error"
    assert plane.get("pod", "-n", namespace, "crash")["status"]["phase"] == "Running"
    assert events(plane, namespace, "BackOff")


def test_scale_down_removes_pods_and_ends_their_processes(plane: Plane, agent: Agent, namespace: str) -> None:
    program = pod_program("while True: time.sleep(1)\n")
    plane.apply(deployment("scaled", 3, program) | {"metadata": {"name": "scaled", "namespace": namespace}})

    def running() -> list[dict[str, Any]] | None:
        pods = pods_of(plane, namespace, "scaled")
        return pods if len(pods) == 3 and all(p["status"].get("phase") == "Running" for p in pods) else None

    pods = wait_for(running, timeout=60, what="3 Running pods")
    pids = {
        p["metadata"]["name"]: int((agent.run_dir / "pods" / f"{namespace}_{p['metadata']['name']}.pid").read_text())
        for p in pods
    }
    assert len({p["spec"]["nodeName"] for p in pods} | set()) >= 1
    plane.kubectl("scale", "deployment", "scaled", "--replicas=1", "-n", namespace)
    left = wait_for(
        lambda: (
            (names := [p["metadata"]["name"] for p in pods_of(plane, namespace, "scaled")])
            and len(names) == 1
            and names
        ),
        timeout=60,
        what="one pod left",
    )
    gone = set(pids) - set(left)
    assert len(gone) == 2
    wait_for(lambda: not any(alive(pids[name]) for name in gone), timeout=15, what="the removed pods' processes")
    assert alive(pids[left[0]])


def test_failing_liveness_probe_restarts_the_container(plane: Plane, agent: Agent, namespace: str) -> None:
    program = pod_program("while True: time.sleep(1)\n")
    liveness = {"exec": {"command": ["sh", "-c", "exit 1"]}, "periodSeconds": 1, "failureThreshold": 2}
    plane.apply(pod("unwell", namespace, program, grace=5, livenessProbe=liveness))

    def restarted() -> bool:
        statuses = plane.get("pod", "-n", namespace, "unwell")["status"].get("containerStatuses") or [{}]
        return int(statuses[0].get("restartCount", 0)) >= 1

    wait_for(restarted, timeout=60, what="a restart after the liveness probe failed")
    killing = [e["message"] for e in events(plane, namespace, "Killing")]
    assert "Container main failed liveness probe, will be restarted" in killing
    assert any(e["message"].startswith("Liveness probe failed") for e in events(plane, namespace, "Unhealthy"))


def test_shutdown_gives_every_container_its_grace_with_prestop(plane: Plane, namespace: str) -> None:
    """On SIGTERM the agent stops as a node shutdown does: every container's preStop, then
    SIGTERM, within its grace period, all at once; the pods end Failed, "Terminated"."""
    run_dir = plane.directory / "run-lone"
    process = start_agent(plane, run_dir, [LONE_NODE])
    try:
        wait_for(
            lambda: any(n["metadata"]["name"] == LONE_NODE and ready(n) for n in plane.get("nodes")["items"]),
            what="the lone node Ready",
        )
        program = pod_program("while True: time.sleep(1)\n")
        for name in ("s1", "s2"):
            hook = f'echo "$T_NAME $(date +%s.%N)" > {run_dir}/hook-{name}; sleep 1'
            prestop = {"preStop": {"exec": {"command": ["sh", "-c", hook]}}}
            plane.apply(pod(name, namespace, program, grace=5, node=LONE_NODE, env=NAME_ENV, lifecycle=prestop))
        for name in ("s1", "s2"):
            wait_running(plane, namespace, name)
        pids = [int((run_dir / "pods" / f"{namespace}_{name}.pid").read_text()) for name in ("s1", "s2")]
        stop_agent(process)
        assert not any(alive(pid) for pid in pids)
        # A restarted agent takes its existing Node over and renews the same Lease.
        renewed = plane.get("lease", "-n", "kube-node-lease", LONE_NODE)["spec"]["renewTime"]
        process = start_agent(plane, run_dir, [LONE_NODE])
        wait_for(
            lambda: plane.get("lease", "-n", "kube-node-lease", LONE_NODE)["spec"]["renewTime"] != renewed,
            what="the restarted agent's first renewal",
        )
        assert ready(plane.get("node", LONE_NODE))
    finally:
        stop_agent(process)
        # The node is gone for good: no later pod may be scheduled to it before it turns NotReady.
        plane.kubectl("delete", "node", LONE_NODE, "--wait=false", check=False)
    hooked = {}
    for name in ("s1", "s2"):
        who, when = (run_dir / f"hook-{name}").read_text().split()
        assert who == name, "the hook ran in the container's environment"
        hooked[name] = float(when)
    # Each hook takes 1 s: one after the other, the second would start 1 s after the first.
    assert abs(hooked["s1"] - hooked["s2"]) < 0.8
    for name in ("s1", "s2"):
        status = plane.get("pod", "-n", namespace, name)["status"]
        assert (status["phase"], status.get("reason")) == ("Failed", "Terminated")
