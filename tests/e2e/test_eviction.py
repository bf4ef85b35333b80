"""Node drains on the sandbox's real Nodes: the real Eviction API, the real ``kubectl drain``.

Two Nodes (kubelets, containers), worker pods spread over them by the real scheduler, unique
scattered data on every worker. ``kubectl drain`` evicts through ``pods/<name>/eviction``; the
API server calls memops' validating webhook over TLS, whose 429 ``kubectl drain`` retries on
its own. Without memops the same drain loses the node's keys.

The drain takes the node's Dask workers of the test's namespace (``--pod-selector``): the Dask
scheduler and memops' operator are pods of these two Nodes too, where a cluster runs them on nodes
of their own (or keeps them with a PodDisruptionBudget of their own); evicting the scheduler would
lose every key whatever any operator did. The drains run in the session's sandbox as ``quiet``
tests (no other test runs meanwhile: a cordoned Node takes no new pod), and uncordon its Nodes when
they end.
"""

from __future__ import annotations

import base64
import contextlib
import json
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import distributed
import pytest
from memops_sandbox import certs, install
from memops_sandbox import common as sandbox_cli

from tests.e2e import audit
from tests.e2e.conftest import BIN, NAMESPACE_LABEL, SPREAD_OVER_NODES, Sandbox, spread_rolled_out, uncordon
from tests.e2e.data import Holdings, scatter_unique

WORKERS = 4
OPERATOR = "system:serviceaccount:memops-system:memops"


DRAINS = pytest.mark.quiet("it cordons and drains a Node of the session's sandbox: no other test runs meanwhile")


def workers_only(sandbox: Sandbox) -> tuple[str, ...]:
    """What of a node ``kubectl drain`` evicts here: this test's Dask workers (see above), not
    those of another namespace (a spare one, waiting for the next test)."""
    return ("--ignore-daemonsets", f"--pod-selector=app=dask-worker,{NAMESPACE_LABEL}={sandbox.namespace}")


@pytest.fixture
def drains(sandbox_factory: Callable[..., Sandbox]) -> Iterator[Callable[..., Sandbox]]:
    """A namespace of the session's sandbox (``sandbox_factory``); its Nodes uncordoned at the
    end, as an administrator does once a drained Node is back, before the next test."""
    made: list[Sandbox] = []

    def make(workers: int = WORKERS) -> Sandbox:
        made.append(sandbox_factory(workers))
        return made[-1]

    yield make
    if made:
        uncordon(made[0])  # this test's own cordon: not the leak that sandbox_factory reports after it


@pytest.fixture
def upstream(tmp_path: Path) -> Iterator[Any]:
    from memops_sandbox import build

    try:
        build.ensure()
    except build.BuildError as error:
        pytest.skip(f"the control plane's binaries cannot be built here: {error}")
    started: list[Sandbox] = []

    def start(operator: bool = True, workers: int = WORKERS) -> Sandbox:
        state_dir = tmp_path / f"upstream{len(started)}"
        args = ["--nodes", "2", *([] if operator else ["--no-operator"])]
        sandbox = Sandbox(state_dir, sandbox_cli.launch(state_dir, workers, *args, real_nodes=True))
        started.append(sandbox)
        return sandbox

    yield start
    for sandbox in started:
        sandbox.stop()


def policy(sandbox: Sandbox, **spec: Any) -> None:
    sandbox.apply(
        {
            "apiVersion": "memops.dev/v1alpha1",
            "kind": "MemoryPolicy",
            "metadata": {"name": "drain"},
            "spec": {
                "scheduler": {"address": sandbox.scheduler_address},
                "workload": {"kind": "Deployment", "name": "dask-worker"},
                "drain": {"timeout": "2m"},
                **spec,
            },
        }
    )


def nodes_of(sandbox: Sandbox) -> dict[str, str]:
    """Running worker pod -> its node."""
    items = sandbox.get("pods", "-l", "app=dask-worker")["items"]
    return {
        p["metadata"]["name"]: p["spec"]["nodeName"]
        for p in items
        if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
    }


def setup(sandbox: Sandbox, client: distributed.Client) -> tuple[str, list[str], Holdings]:
    """A node with workers while the other has some too (room for the data), the node's pods,
    and unique data on every worker."""

    def settled() -> dict[str, str] | None:
        placed = nodes_of(sandbox)
        names = {str(w["name"]) for w in client.scheduler_info(n_workers=-1)["workers"].values()}
        return placed if len(placed) == WORKERS and names == set(placed) else None

    placed = sandbox.wait_for(settled, 120, "the workers")
    if len(set(placed.values())) < 2:  # the scheduler's spreading is a preference: make it a rule
        sandbox.kubectl("patch", "deployment/dask-worker", "--type=merge", "-p", json.dumps(SPREAD_OVER_NODES))
        placed = sandbox.wait_for(
            lambda: (
                (found := settled())
                and len(set(found.values())) == 2
                and spread_rolled_out(sandbox, sandbox.get("pods", "-l", "app=dask-worker")["items"])
                and found
            ),
            180,
            "spread workers",
        )
    node = sorted(set(placed.values()))[0]
    pods = sorted(p for p, n in placed.items() if n == node)
    return node, pods, scatter_unique(client, dict.fromkeys(placed, 3))


def drain(sandbox: Sandbox, node: str, timeout: int = 170) -> tuple[subprocess.CompletedProcess[str], float]:
    """``kubectl drain`` as an operator of the cluster runs it, with its own retry loop."""
    began = time.monotonic()
    result = subprocess.run(
        [str(BIN / "kubectl"), "drain", node, *workers_only(sandbox), f"--timeout={timeout}s"],
        capture_output=True,
        text=True,
        env=sandbox.env,
        timeout=200,
    )
    return result, time.monotonic() - began


def eviction_requests(sandbox: Sandbox) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = sandbox.get("retirementrequests", "-l", "memops.dev/reason=eviction")["items"]
    return items


@DRAINS
def test_kubectl_drain_waits_for_the_drain_and_loses_nothing(drains: Callable[..., Sandbox]) -> None:
    sandbox = drains()
    since = len(audit.lines(sandbox.audit_log))
    policy(sandbox)
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        node, pods, holdings = setup(sandbox, client)
        # A server-side dry run: the API server calls the gate with dryRun (its sideEffects are
        # NoneOnDryRun), which answers as it would (429, as a PDB would) and starts nothing.
        dry = subprocess.run(
            [str(BIN / "kubectl"), "drain", node, *workers_only(sandbox), "--dry-run=server", "--timeout=8s"],
            capture_output=True,
            text=True,
            env=sandbox.env,
            timeout=60,
        )
        assert dry.returncode != 0 and "will retry after" in dry.stderr, dry.stdout + dry.stderr
        assert eviction_requests(sandbox) == [], "a dry-run eviction started a drain"
        assert not sandbox.get("node", node)["spec"].get("unschedulable"), "the dry run cordoned the node"
        result, seconds = drain(sandbox, node)
        print(f"kubectl drain {node} ({len(pods)} workers): {seconds:.1f} s")
        assert result.returncode == 0, result.stdout + result.stderr + sandbox.operator_log()[-4000:]
        # The refusal came back as 429 and kubectl's own loop retried it; unless the drain that the
        # cordon (kubectl drain's first step) starts was done before kubectl's first eviction, with
        # nothing left to refuse (seen once on a loaded machine). The dry run above shows the 429.
        if "will retry after" in result.stderr:
            assert "memops" in result.stderr, result.stderr
        else:
            print("no eviction refused: the drain that the cordon started was done before the first eviction")
        assert holdings.lost() == []
        holdings.assert_all_correct()
    (request,) = eviction_requests(sandbox)
    assert sorted(request["spec"]["workers"]) == pods, "the node's workers drain together, in one request"

    # The node signals list and watch Nodes, allowed by the chart's RBAC (tests/packaging/test_rbac.py
    # leaves these two to this check: only the upstream plane serves Nodes). The operator started
    # with the session's sandbox: its reads of Nodes are in the audit log from then, the Lease of
    # this test's policy since the test began.
    def operator_requests(resource: str, since: int = 0) -> set[tuple[str, int, str]]:
        return {
            (e["verb"], e["responseStatus"]["code"], e["objectRef"].get("namespace", ""))
            for e in map(json.loads, (line for line in audit.lines(sandbox.audit_log)[since:] if OPERATOR in line))
            if e.get("user", {}).get("username") == OPERATOR
            and e.get("objectRef", {}).get("resource") == resource
            and "responseStatus" in e
        }

    node_reads = operator_requests("nodes")
    assert {("list", 200, ""), ("watch", 200, "")} <= node_reads, node_reads
    # The gate decided under the policy's Lease (the lock between the operator's replicas): read,
    # created, given back, in the operator's own namespace (out of tenants' reach); allowed by the
    # chart's RBAC (tests/packaging/test_rbac.py leaves it here).
    lease_requests = operator_requests("leases", since)
    own = install.NAMESPACE
    assert {("get", 404, own), ("create", 201, own), ("update", 200, own)} <= lease_requests, lease_requests
    assert {namespace for _, _, namespace in lease_requests} == {own}, lease_requests
    assert request["spec"]["removePods"] is False
    assert request["status"]["phase"] == "Succeeded"
    assert request["metadata"]["ownerReferences"][0]["kind"] == "MemoryPolicy"


@DRAINS
def test_stock_kubectl_drain_loses_the_nodes_keys(drains: Callable[..., Sandbox]) -> None:
    """No MemoryPolicy for this namespace's workers (memops runs, for other tenants): the drain is
    stock, and the node's keys are lost."""
    sandbox = drains()
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        node, pods, holdings = setup(sandbox, client)
        result, _ = drain(sandbox, node)
        assert result.returncode == 0, result.stderr
        lost = sandbox.wait_for(holdings.lost, 60, "the evicted workers' keys to be lost")
        assert sorted(lost) == sorted(k for pod in pods for k in holdings.keys_of(pod))


@DRAINS
def test_cordon_starts_the_drain_before_the_eviction(drains: Callable[..., Sandbox]) -> None:
    sandbox = drains()
    policy(sandbox)
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        node, pods, holdings = setup(sandbox, client)
        sandbox.kubectl("cordon", node)
        (request,) = sandbox.wait_for(lambda: eviction_requests(sandbox), 30, "the cordon's Eviction request")
        assert sorted(request["spec"]["workers"]) == pods
        assert "taint node.kubernetes.io/unschedulable" in request["metadata"]["annotations"]["memops.dev/why"]
        time.sleep(10)  # the issue's scenario: the eviction comes 10 s after the cordon
        result, _ = drain(sandbox, node)
        assert result.returncode == 0, result.stderr
        assert holdings.lost() == []
    names = [r["metadata"]["name"] for r in eviction_requests(sandbox)]
    assert names == [request["metadata"]["name"]], "the eviction found the cordon's drain under way"


@DRAINS
@pytest.mark.parametrize("on_timeout", ["Abort", "Force"])
def test_a_drain_with_nowhere_to_go_ends_in_on_timeout(drains: Callable[..., Sandbox], on_timeout: str) -> None:
    """One worker: its data has nowhere to go. Abort keeps refusing (an event on the pod says so),
    and once there is room (a second worker, on the other Node) the same drain goes through, a
    new drain having moved the data; Force lets the eviction through and the request records the
    bytes lost."""
    sandbox = drains(1)
    policy(sandbox, drain={"timeout": "12s", "onTimeout": on_timeout})
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        sandbox.wait_for(lambda: len(client.scheduler_info(n_workers=-1)["workers"]) == 1, 120, "the worker")
        ((pod, node),) = nodes_of(sandbox).items()
        holdings = scatter_unique(client, {pod: 3})
        # Abort: kubectl gives up before the gate would drain again (KEPT_RETRY_SECONDS after).
        result, _ = drain(sandbox, node, timeout=20 if on_timeout == "Abort" else 30)
        (request,) = eviction_requests(sandbox)
        (worker,) = request["status"]["workers"]
        if on_timeout == "Abort":
            assert result.returncode != 0, "kubectl drain must give up at its own --timeout"
            assert "onTimeout is Abort" in result.stderr, result.stderr
            assert request["status"]["phase"] == "Failed" and worker["state"] == "Kept"
            events = sandbox.get("events", "--field-selector", f"involvedObject.name={pod}")["items"]
            refused = [e for e in events if e["reason"] == "EvictionRefused"]
            # kubectl drain retried every 5 s after the drain ended: one event for the episode.
            assert len(refused) == 1, refused
            assert "will retry after" in result.stderr
            assert holdings.lost() == []
            # Room is made (the node is still cordoned: the new worker starts on the other one);
            # the drain run again goes through, the data moved by a second drain.
            sandbox.kubectl("scale", "deployment/dask-worker", "--replicas=2")
            sandbox.wait_for(lambda: len(client.scheduler_info(n_workers=-1)["workers"]) == 2, 120, "a second worker")
            again, seconds = drain(sandbox, node, timeout=120)
            print(f"kubectl drain again, with room: {seconds:.1f} s")
            assert again.returncode == 0, again.stdout + again.stderr
            assert holdings.lost() == []
            holdings.assert_all_correct()
            phases = sorted(r["status"]["phase"] for r in eviction_requests(sandbox))
            assert phases == ["Failed", "Succeeded"], phases
        else:
            assert result.returncode == 0, result.stderr
            assert worker["state"] == "Forced" and worker["bytesLost"] == 3 * 256 * 1024
            lost = sandbox.wait_for(holdings.lost, 60, "the forced worker's keys to be lost")
            assert sorted(lost) == sorted(holdings.keys_of(pod))


def forged_review(pod: str, namespace: str = "default") -> dict[str, Any]:
    """The AdmissionReview that the API server would send for an eviction of ``pod``, as anyone
    who reaches the webhook's port can write it: another tenant's user, say."""
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "00000000-0000-0000-0000-000000000001",
            "kind": {"group": "policy", "version": "v1", "kind": "Eviction"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "subResource": "eviction",
            "name": pod,
            "namespace": namespace,
            "operation": "CREATE",
            "userInfo": {"username": "system:serviceaccount:tenant-a:default"},
            "object": {
                "apiVersion": "policy/v1",
                "kind": "Eviction",
                "metadata": {"name": pod, "namespace": namespace},
            },
            "dryRun": False,
        },
    }


def post_review(url: str, review: dict[str, Any], context: ssl.SSLContext) -> Any:
    request = urllib.request.Request(
        url, data=json.dumps(review).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, context=context, timeout=15) as response:
        return json.loads(response.read())


def evict(sandbox: Sandbox, pod: str) -> subprocess.CompletedProcess[str]:
    """One eviction through the API (``pods/<pod>/eviction``), as the sandbox's admin."""
    body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": pod}}
    path = f"/api/v1/namespaces/{sandbox.namespace}/pods/{pod}/eviction"
    return sandbox.kubectl("create", "--raw", path, "-f", "-", input=json.dumps(body), check=False)


def gate(sandbox: Sandbox) -> tuple[str, Callable[[], ssl.SSLContext]]:
    """The eviction gate's URL as the API server calls it (the operator pod's Service, reached
    through kube-proxy), and a maker of TLS contexts that trust the webhook configuration's CA
    bundle. The certificate names the Service's DNS name, which this host does not resolve: its
    chain is checked, not its name."""
    (hook,) = sandbox.get("validatingwebhookconfiguration", "memops-eviction")["webhooks"]
    config = hook["clientConfig"]
    authority = base64.b64decode(config["caBundle"]).decode()
    by_url = "url" in config

    def context() -> ssl.SSLContext:
        made = ssl.create_default_context(cadata=authority)
        made.check_hostname = by_url
        return made

    if by_url:
        return config["url"], context
    service = config["service"]
    address = sandbox.get("service", service["name"], "-n", service["namespace"])["spec"]["clusterIP"]
    return f"https://{address}:{service.get('port', 443)}{service.get('path', '')}", context


def test_only_the_api_servers_review_starts_a_drain(sandbox: Sandbox) -> None:
    """The webhook requires the API server's client certificate: a review posted without it (no
    certificate, or one of the cluster CA that every admin and kubelet holds) fails the TLS
    handshake and starts nothing, while a real eviction through the API still drains first, the
    workers of this tenant's policy on the pod's Node (other tenants' workers there are theirs),
    and its request records who evicted. One eviction, no cordon: a namespace of the session's."""
    policy(sandbox)
    pki = sandbox.state_dir / "pki"
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        _, pods, holdings = setup(sandbox, client)
        url, context = gate(sandbox)
        anonymous, admin, api_server = context(), context(), context()
        admin.load_cert_chain(pki / "admin.crt", pki / "admin.key")
        for context in (anonymous, admin):
            with pytest.raises(OSError):  # ssl.SSLError, or the connection reset by the server's alert
                answer = post_review(url, forged_review(pods[0]), context)
                print(f"the webhook answered a forged review: {answer}")
        assert eviction_requests(sandbox) == [], "a forged review started a drain"
        # The same address with the API server's own client certificate is answered: what
        # refused the two above is their certificate, nothing on the way. (A pod that does not
        # exist: allowed, and nothing starts.)
        api_server.load_cert_chain(pki / "apiserver-webhook-client.crt", pki / "apiserver-webhook-client.key")
        answer = post_review(url, forged_review("dask-worker-no-such-pod"), api_server)
        assert answer["response"]["allowed"] is True, answer
        assert eviction_requests(sandbox) == []
        refused = evict(sandbox, pods[0])
        assert refused.returncode != 0 and "memops started draining" in refused.stderr, refused.stderr
        (request,) = eviction_requests(sandbox)
        assert request["metadata"]["annotations"]["memops.dev/requested-by"] == "kubernetes-admin"
        assert sorted(request["spec"]["workers"]) == pods
        sandbox.wait_phase(request["metadata"]["name"], "Succeeded")
        admitted = evict(sandbox, pods[0])
        assert admitted.returncode == 0, admitted.stderr + sandbox.operator_log()[-4000:]
        assert holdings.lost() == []
    events = sandbox.get("events", "--field-selector", f"involvedObject.name={pods[0]}")["items"]
    started = [e for e in events if e["reason"] == "EvictionDrainStarted"]
    assert len(started) == 1 and "by kubernetes-admin" in started[0]["message"], started


@contextlib.contextmanager
def unverifying_operator(sandbox: Sandbox) -> Iterator[str]:
    """The operator with its webhook as on a cluster whose API server presents no client
    certificate (most managed ones): TLS, and no client verified. Yields the gate's URL."""
    authority = certs.authority("memops-test-webhook")
    cert, key = certs.issue(authority, "127.0.0.1", ip_addresses=(certs.LOOPBACK,), server=True).write(
        sandbox.state_dir, "unverifying-webhook"
    )
    port = sandbox_cli.free_port()
    log = (sandbox.state_dir / "operator.log").open("ab")
    command = [str(BIN / "memops"), "run", "--all-namespaces", "--standalone", "--webhook-unmanaged"]
    command += [f"--webhook-port={port}", "--webhook-host=127.0.0.1"]
    command += [f"--webhook-cert-file={cert}", f"--webhook-key-file={key}"]
    env = {**sandbox.env, "KUBECONFIG": str(sandbox.state_dir / "operator-kubeconfig")}
    sandbox.operator = subprocess.Popen(command, stdout=log, stderr=log, env=env, start_new_session=True)
    try:
        yield f"https://127.0.0.1:{port}/eviction-gate"
    finally:
        sandbox.kill_operator()


@pytest.mark.owns_cluster("it runs an operator of its own, whose webhook verifies no client")
def test_a_forged_review_acts_only_as_the_api_bears_it_out_once_per_node(upstream: Any) -> None:
    """Where the webhook cannot tell the API server from anyone else, a forged review starts
    nothing for a pod that does not exist, for one whose uid is not the review's, nor in a
    namespace it does not name, and a flood of them starts one drain per node, which records
    the user the review claims."""
    sandbox = upstream(operator=False)
    policy(sandbox)
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        node, pods, _ = setup(sandbox, client)
        uid = sandbox.get("pod", pods[0])["metadata"]["uid"]
        with unverifying_operator(sandbox) as url:
            # The policy's status is the operator's own: once written, its caches hold the policy.
            sandbox.wait_for(lambda: sandbox.get("mempol", "drain").get("status"), 60, "the operator")
            attacker = ssl.create_default_context()
            attacker.check_hostname, attacker.verify_mode = False, ssl.CERT_NONE
            answers = []
            for review in (
                forged_review("dask-worker-no-such-pod"),
                forged_review(pods[0], namespace="kube-system"),
                without_namespace(forged_review(pods[0])),
                with_uid(forged_review(pods[0]), "00000000-0000-0000-0000-0000000000ff"),
            ):
                answers.append(post_review(url, review, attacker)["response"])
            assert eviction_requests(sandbox) == [], (answers, sandbox.operator_log()[-4000:])
            assert all(a["allowed"] for a in answers), "the API server decides these evictions itself"
            floods = [with_uid(forged_review(pod), uid if pod == pods[0] else None) for pod in pods * 5]
            answers = [post_review(url, review, attacker)["response"] for review in floods]
            assert "memops started draining" in answers[0]["status"]["message"], answers[0]
        (request,) = eviction_requests(sandbox)
        assert sorted(request["spec"]["workers"]) == pods, "one drain: the node's workers together"
        assert request["metadata"]["labels"]["memops.dev/node"] == node
        annotations = request["metadata"]["annotations"]
        assert annotations["memops.dev/requested-by"] == "system:serviceaccount:tenant-a:default"
        everywhere = sandbox.get("retirementrequests", "--all-namespaces")["items"]
        assert {r["metadata"]["namespace"] for r in everywhere} == {"default"}


def without_namespace(review: dict[str, Any]) -> dict[str, Any]:
    del review["request"]["namespace"], review["request"]["object"]["metadata"]["namespace"]
    return review


def with_uid(review: dict[str, Any], uid: str | None) -> dict[str, Any]:
    if uid is not None:
        review["request"]["object"]["deleteOptions"] = {"preconditions": {"uid": uid}}
    return review
