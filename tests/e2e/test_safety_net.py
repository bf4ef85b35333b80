"""The safety net around scale-downs that memops does not make: what the webhook costs, and what
the policy says when a pod's preStop hook failed.
"""

from __future__ import annotations

import base64
import copy
import os
import shutil
from typing import Any

import distributed
import pytest
from memops_sandbox import common as sandbox_cli
from memops_sandbox import images

from tests.e2e import audit
from tests.e2e.conftest import BIN, Sandbox, retirement_request
from tests.e2e.data import Holdings
from tests.e2e.test_policy import condition, memory_policy


def operator_reads(sandbox: Sandbox, since: int) -> list[tuple[str, str, str]]:
    """The operator's reads (get, list) in the sandbox's audit log after its first ``since`` lines,
    of the test's namespace or cluster-wide (it serves the other tests' namespaces too)."""
    user = audit.kubeconfig_user(sandbox.state_dir / "operator-kubeconfig")
    return [
        (resource, verb, namespace)
        for _, resource, verb, namespace in audit.requests(sandbox.audit_log, user, since=since)
        if verb in ("get", "list") and namespace in (sandbox.namespace, "")
    ]


def audit_length(sandbox: Sandbox) -> int:
    return len(audit.lines(sandbox.audit_log))


def test_webhook_answers_pod_creations_from_the_operators_caches(sandbox: Sandbox) -> None:
    """Four pods through the webhook cost no request: the policies and the Deployment come from
    the indexes the policy controller keeps. (Before: a list of policies and a GET of the workload
    per pod.)"""
    sandbox.apply(memory_policy("cached", sandbox.scheduler_address))  # adopts the count: no scaling
    sandbox.wait_for(lambda: (c := condition(sandbox, "cached", "Ready")) and c["status"] == "True", what="Ready")
    before = sandbox.pods()
    mark = audit_length(sandbox)
    sandbox.kubectl("scale", "deployment/dask-worker", "--replicas=8")
    new = sandbox.wait_for(lambda: len(p := sandbox.pods()) == 8 and [n for n in p if n not in before], what="pods")
    for pod in new:
        annotations = sandbox.get("pod", pod)["metadata"].get("annotations") or {}
        assert annotations.get("memops.dev/safety-net") == "cached", "each new pod went through the webhook"
    reads = operator_reads(sandbox, mark)
    webhook_kinds = {"memorypolicies", "deployments", "daskworkergroups", "secrets"}
    assert [r for r in reads if r[0] in webhook_kinds] == [], "the webhook read the API on pod creation"


def unpathed_workers(scheduler_address: str, dask: str) -> dict[str, Any]:
    """Workers whose container has no ``python`` on its PATH, as in an image without one: the
    ``dask`` entry point runs by its full path (``dask``), the hook's bare ``python`` is not found."""
    deployment = copy.deepcopy(sandbox_cli.worker_deployment(scheduler_address, replicas=0, namespace=None))
    deployment["metadata"] = {"name": "bare", "labels": {"app": "bare"}}
    deployment["spec"]["selector"] = {"matchLabels": {"app": "bare"}}
    template = deployment["spec"]["template"]
    template["metadata"] = {"labels": {"app": "bare"}}
    container = template["spec"]["containers"][0]
    container["command"] = [dask, "worker"]
    container["env"].append({"name": "PATH", "value": "/nonexistent"})
    return deployment


def test_a_pod_that_left_with_a_failed_hook_is_in_the_policys_status(sandbox: Sandbox) -> None:
    # The image's environment on real Nodes; this one's for the node agent's host processes.
    dask = f"{images.DASK_PREFIX}/bin/dask" if sandbox.real_nodes else str(BIN / "dask")
    assert sandbox.real_nodes or shutil.which("dask", path=str(BIN)), "the workers' entry point"
    sandbox.apply(unpathed_workers(sandbox.scheduler_address, dask))
    sandbox.apply(memory_policy("bare", sandbox.scheduler_address, workload="bare"))
    sandbox.wait_for(lambda: (c := condition(sandbox, "bare", "Ready")) and c["status"] == "True", what="Ready")
    sandbox.kubectl("scale", "deployment/bare", "--replicas=2")

    def bare_pods() -> list[str]:
        items = sandbox.get("pods", "-l", "app=bare")["items"]
        return sorted(p["metadata"]["name"] for p in items if not p["metadata"].get("deletionTimestamp"))

    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        sandbox.wait_for(
            lambda: (
                {str(w["name"]) for w in client.scheduler_info(n_workers=-1)["workers"].values()} >= set(bare_pods())
                and len(bare_pods()) == 2
            ),
            what="the two bare workers",
        )
        pods = bare_pods()
        assert all(sandbox.get("pod", p)["metadata"]["annotations"]["memops.dev/safety-net"] == "bare" for p in pods)
        sandbox.kubectl("scale", "deployment/bare", "--replicas=1")
        gone = sandbox.wait_for(lambda: [p for p in pods if p not in bare_pods()], what="a pod removed")
        status = sandbox.wait_for(
            lambda: (s := sandbox.get("mempol", "bare").get("status", {})).get("safetyNet") and s,
            timeout=60,
            what="the failed hook in the policy's status",
        )
    [hook] = status["safetyNet"]["failedHooks"]
    assert hook["pod"] == gone[0] and hook["message"] == "PreStopHook failed" and hook["time"]
    events = sandbox.get("events", "--field-selector", "involvedObject.name=bare,reason=FailedPreStopHook")["items"]
    assert events and gone[0] in events[0]["message"], "a Warning event on the policy names the pod"


def test_a_tls_policy_reads_its_secret_and_new_pods_reference_it_by_name(sandbox: Sandbox) -> None:
    """The operator reads the client certificate from the policy's Secret (the permission that
    rbac.schedulerTLS grants); the webhook puts only a secretKeyRef to that Secret, in the pod's
    own namespace, into the pod: never the certificate, never another namespace's Secret."""
    security = distributed.Security.temporary()
    pems = {"ca.crt": security.tls_ca_file, "tls.crt": security.tls_client_cert, "tls.key": security.tls_client_key}
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "scheduler-tls"},
        "data": {key: base64.b64encode(value.encode()).decode() for key, value in pems.items()},
    }
    sandbox.apply(secret)
    with distributed.LocalCluster(
        n_workers=0,
        processes=True,
        host=sandbox.host_address,  # where the operator's pod reaches it
        dashboard_address=":0",
        security=security,
        protocol="tls://",
    ) as tls_cluster:
        address = tls_cluster.scheduler_address
        policy = memory_policy("secure", address)
        policy["spec"]["scheduler"]["tls"] = {"secretName": "scheduler-tls"}
        mark = audit_length(sandbox)
        sandbox.apply(policy)
        # The scheduler has no workers, so the tenancy rule refuses it (NoWorkers): a verdict that
        # needs its identity, read over TLS with the Secret's certificate (a bad certificate would
        # leave it SchedulerUnreachable).
        reached = sandbox.wait_for(
            lambda: (c := condition(sandbox, "secure", "SchedulerReachable")) and c["reason"] == "NoWorkers" and c,
            what="the TLS scheduler reached with the Secret's certificate",
        )
        assert reached["status"] == "False"
        assert ("secrets", "get", sandbox.namespace) in operator_reads(sandbox, mark)
        before = sandbox.pods()
        sandbox.kubectl("scale", "deployment/dask-worker", f"--replicas={len(before) + 1}")
        [new] = sandbox.wait_for(lambda: [p for p in sandbox.pods() if p not in before], what="a new pod")
        env = {e["name"]: e for e in sandbox.get("pod", new)["spec"]["containers"][0]["env"]}
        for name, key in (("MEMOPS_TLS_CA", "ca.crt"), ("MEMOPS_TLS_CERT", "tls.crt"), ("MEMOPS_TLS_KEY", "tls.key")):
            assert env[name] == {"name": name, "valueFrom": {"secretKeyRef": {"name": "scheduler-tls", "key": key}}}
        assert env["MEMOPS_SCHEDULER_ADDRESS"]["value"] == address


def chart_workers(scheduler_address: str, name: str, *extra: str) -> dict[str, Any]:
    """Workers with the Dask Helm chart's arguments (``dask/templates/dask-worker-deployment.yaml``):
    the scheduler, ``--nthreads``, ``--memory-limit``, ``--no-dashboard``; no ``--name``, no
    ``--host``: ``dask worker`` finds its pod's IP itself, and names each worker by its address."""
    deployment = copy.deepcopy(sandbox_cli.worker_deployment(scheduler_address, replicas=0, namespace=None))
    deployment["metadata"] = {"name": name, "labels": {"app": name}}
    deployment["spec"]["selector"] = {"matchLabels": {"app": name}}
    template = deployment["spec"]["template"]
    template["metadata"] = {"labels": {"app": name}}
    container = template["spec"]["containers"][0]
    container["args"] = [
        "$(DASK_SCHEDULER_ADDRESS)",
        *("--nthreads", "1", "--memory-limit", "1GiB", "--no-dashboard"),
        *extra,
    ]
    return deployment


def host_of(address: str) -> str:
    return address.split("://", 1)[1].rsplit(":", 1)[0]


@pytest.mark.parametrize(
    ("extra", "per_pod"), [pytest.param((), 1, id="chart-args"), pytest.param(("--nworkers", "2"), 2, id="nworkers-2")]
)
def test_a_direct_scale_down_drains_every_worker_of_the_pod_named_or_not(
    real_sandbox: Sandbox, extra: tuple[str, ...], per_pod: int
) -> None:
    """``kubectl scale deployment`` under a MemoryPolicy, for workers that are not named after their
    pod: the preStop hook finds every worker on the pod's IP and drains them all before SIGTERM:
    no key is lost, and no hook failed. (Before: the hook found no worker named after the pod,
    exited 0 at once, and the pod's unique data went with it.) On real Nodes: the workers run in
    containers of Dask's image, the kubelet runs the hook in the container and sends SIGTERM
    after it, and the webhook is the chart's operator pod behind its Service."""
    sandbox = real_sandbox
    sandbox.apply(chart_workers(sandbox.scheduler_address, "chart", *extra))
    sandbox.apply(memory_policy("chart", sandbox.scheduler_address, workload="chart"))
    sandbox.wait_for(lambda: (c := condition(sandbox, "chart", "Ready")) and c["status"] == "True", what="Ready")
    sandbox.kubectl("scale", "deployment/chart", "--replicas=2")

    def chart_pods() -> dict[str, str]:
        """Pod name -> IP, of the running pods not being deleted."""
        items = sandbox.get("pods", "-l", "app=chart")["items"]
        return {
            p["metadata"]["name"]: p["status"]["podIP"]
            for p in items
            if not p["metadata"].get("deletionTimestamp") and p["status"].get("podIP")
        }

    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:

        def workers_of_pods() -> dict[str, list[str]] | None:
            pods = chart_pods()
            addresses = list(client.scheduler_info(n_workers=-1)["workers"])
            found = {pod: sorted(a for a in addresses if host_of(a) == ip) for pod, ip in pods.items()}
            return found if len(found) == 2 and all(len(ws) == per_pod for ws in found.values()) else None

        placed = sandbox.wait_for(workers_of_pods, what=f"two pods of {per_pod} worker(s) each, on their pods' IPs")
        for pod in placed:
            assert sandbox.get("pod", pod)["metadata"]["annotations"]["memops.dev/safety-net"] == "chart"
            assert not any(pod in str(w["name"]) for w in client.scheduler_info(n_workers=-1)["workers"].values())
        holdings = Holdings(client)
        for pod, workers in placed.items():
            for worker in workers:
                values = {
                    f"{host_of(worker)}-{worker.rsplit(':', 1)[1]}-{i}": os.urandom(256 * 1024) for i in range(10)
                }
                holdings.futures.update(client.scatter(values, workers=[worker], hash=False, broadcast=False))
                holdings.values.update(values)
                holdings.owner.update(dict.fromkeys(values, pod))
        assert all(len(h) == 1 for h in client.who_has(list(holdings.futures.values())).values()), "unique data"

        sandbox.kubectl("scale", "deployment/chart", "--replicas=1")
        [gone] = sandbox.wait_for(lambda: [p for p in placed if p not in chart_pods()], what="a pod removed")
        # Until the pod object is gone, its hook may still run: the kubelet deletes it after SIGTERM.
        sandbox.wait_for(
            lambda: not sandbox.kubectl("get", "pod", gone, check=False).stdout, timeout=120, what=f"{gone} deleted"
        )
        left = set(client.scheduler_info(n_workers=-1)["workers"])
        assert not left & set(placed[gone]), "the removed pod's workers left the scheduler"
        holdings.assert_all_correct()
        assert len(holdings.keys_of(gone)) == 10 * per_pod

        # The operator's own retirement of the last pod: memops' drain takes its workers, then the
        # pod goes; its hook finds them drained already, which is no failure.
        [last] = chart_pods()
        request = retirement_request("last", scheduler={"address": sandbox.scheduler_address}, count=1)
        request["spec"]["workload"]["name"] = "chart"
        sandbox.apply(request)
        done = sandbox.wait_phase("last", "Succeeded", "Failed")
        assert done["status"]["phase"] == "Succeeded", done["status"]
        sandbox.wait_for(
            lambda: not sandbox.kubectl("get", "pod", last, check=False).stdout, timeout=120, what=f"{last} deleted"
        )
        holdings.assert_all_correct()
    for pod in (gone, last):
        events = sandbox.get("events", "--field-selector", f"involvedObject.name={pod},reason=FailedPreStopHook")
        assert events["items"] == [], f"{pod}'s hook did not fail"
