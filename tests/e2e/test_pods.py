"""Which pods memops may act on: workers found by address, set-based selectors, claims given back
on deletion, and schedulers of another namespace left alone."""

from __future__ import annotations

import copy
import signal
from typing import Any

import distributed
from memops_sandbox import common as sandbox_cli

from tests import polling
from tests.e2e import windows
from tests.e2e.conftest import Sandbox, retirement_request
from tests.e2e.data import Holdings, scatter_unique, workers_by_name


def worker_deployment(
    sandbox: Sandbox, name: str, replicas: int, *extra: str, named: bool = False, **selector: Any
) -> dict[str, Any]:
    """The sandbox's worker Deployment under another name, with other ``dask worker`` arguments,
    and unless ``named`` without ``--name``."""
    body = copy.deepcopy(sandbox_cli.worker_deployment(sandbox.scheduler_address, replicas, "512MiB", namespace=None))
    body["metadata"]["name"] = name
    body["metadata"]["labels"] = {"app": name}
    body["spec"]["template"]["metadata"]["labels"] = {"app": name}
    body["spec"]["selector"] = selector or {"matchLabels": {"app": name}}
    container = body["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    if not named:
        del args[args.index("--name") : args.index("--name") + 2]  # the worker is not named after its pod
    container["args"] = [*args, *extra]
    return body


def pods_of(sandbox: Sandbox, app: str) -> dict[str, str]:
    """Pod name -> pod IP of the running pods labelled app=<app>."""
    items = sandbox.get("pods", "-l", f"app={app}")["items"]
    return {
        p["metadata"]["name"]: p["status"]["podIP"]
        for p in items
        if not p["metadata"].get("deletionTimestamp") and p.get("status", {}).get("phase") == "Running"
    }


def addresses_by_ip(client: distributed.Client) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for address in client.scheduler_info(n_workers=-1)["workers"]:
        found.setdefault(address.split("://")[1].rsplit(":", 1)[0], []).append(address)
    return found


def scatter_to(client: distributed.Client, holdings: Holdings, address: str, tag: str, count: int) -> None:
    """``count`` unique values on the worker at ``address``, recorded in ``holdings`` under ``tag``."""
    extra = scatter_unique(client, {})
    values = {f"{tag}-{i}": bytes([i]) * (256 * 1024) for i in range(count)}
    futures = client.scatter(values, workers=[address], hash=False, broadcast=False)
    for holder in (holdings, extra):
        holder.futures.update(futures)
        holder.values.update(values)
        holder.owner.update(dict.fromkeys(values, tag))


def test_workers_without_their_pod_name_are_drained_by_address(sandbox_factory: Any) -> None:
    """`dask worker` without --name, and with --nworkers 2: each worker is found by its pod's IP,
    drained, and its pod removed only then; no key is lost. On real Nodes: each pod's workers
    find their address in its network namespace, as on a cluster."""
    sandbox = sandbox_factory(1, real_nodes=True)
    sandbox.apply(worker_deployment(sandbox, "unnamed", 2))
    sandbox.apply(worker_deployment(sandbox, "pair", 1, "--nworkers", "2"))
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        client.wait_for_workers(5, timeout=120)
        unnamed, pair = pods_of(sandbox, "unnamed"), pods_of(sandbox, "pair")
        by_ip = addresses_by_ip(client)
        holdings = scatter_unique(client, {})
        for pod, ip in unnamed.items():
            scatter_to(client, holdings, by_ip[ip][0], pod, 3)
        [(pair_pod, pair_ip)] = pair.items()
        assert len(by_ip[pair_ip]) == 2, "two workers listen on the pair's pod IP"
        for index, address in enumerate(by_ip[pair_ip]):
            scatter_to(client, holdings, address, f"{pair_pod}-{index}", 2)
        sandbox.apply(
            retirement_request(
                "by-count",
                scheduler={"address": sandbox.scheduler_address},
                workload={"kind": "Deployment", "name": "unnamed"},
                count=1,
            )
        )
        sandbox.apply(
            retirement_request(
                "pair",
                scheduler={"address": sandbox.scheduler_address},
                workload={"kind": "Deployment", "name": "pair"},
                workers=[pair_pod],
            )
        )
        for name in ("by-count", "pair"):
            done = sandbox.wait_phase(name, "Succeeded", "Failed")
            assert done["status"]["phase"] == "Succeeded", done["status"]
            [worker] = done["status"]["workers"]
            assert worker["state"] == "Retired" and worker["message"].startswith("drained"), worker
            assert worker["uniqueBytes"] >= (3 if name == "by-count" else 4) * 256 * 1024, worker
        [pair_worker] = sandbox.get("retire", "pair")["status"]["workers"]
        assert sorted(pair_worker["addresses"]) == sorted(by_ip[pair_ip])
        assert pair_pod not in pods_of(sandbox, "pair")
        holdings.assert_all_correct()


def test_a_selector_with_match_expressions_never_claims_an_unrelated_pod(sandbox_factory: Any) -> None:
    sandbox = sandbox_factory(1)
    in_mexp = {"matchExpressions": [{"key": "app", "operator": "In", "values": ["mexp"]}]}
    sandbox.apply(worker_deployment(sandbox, "mexp", 2, named=True, **in_mexp))
    # Another tenant of the namespace: Running, with no worker, so "empty" to a reader of every pod.
    sandbox.apply(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "unrelated", "labels": {"app": "other"}},
            "spec": {
                "containers": [
                    {
                        "name": "c",
                        "image": sandbox_cli.DASK_IMAGE,
                        "command": ["python", "-c", "import time; time.sleep(600)"],
                    }
                ]
            },
        }
    )
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        client.wait_for_workers(3, timeout=120)
    sandbox.wait_for(lambda: pods_of(sandbox, "other"), what="the unrelated pod to run")
    sandbox.apply(
        retirement_request(
            "mexp",
            scheduler={"address": sandbox.scheduler_address},
            workload={"kind": "Deployment", "name": "mexp"},
            count=1,
        )
    )
    done = sandbox.wait_phase("mexp", "Succeeded", "Failed")
    assert done["status"]["phase"] == "Succeeded", done["status"]
    # The proof that the selector matched only the workload's pods: a selector that let the unrelated
    # pod in would have found it Running with no worker, kept it out of the choice (so it would still
    # be unclaimed) and said so in this condition.
    unidentified = [c for c in done["status"].get("conditions", []) if c["type"] == "WorkersUnidentified"]
    assert unidentified == [], unidentified
    [worker] = done["status"]["workers"]
    assert worker["pod"].startswith("mexp-"), worker
    unrelated = sandbox.get("pod", "unrelated")
    assert "memops.dev/retirement-request" not in (unrelated["metadata"].get("annotations") or {})
    assert sandbox.get("deployment", "mexp")["spec"]["replicas"] == 1


def test_deleting_a_request_mid_drain_gives_its_pod_back(sandbox: Sandbox) -> None:
    pods = sandbox.pods()
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        holdings = scatter_unique(client, {pods[0]: 4})
        old = workers_by_name(client)[pods[0]]
        frozen = [p for p in pods if p != pods[0]]
        for pod in frozen:  # transfers to them hang: the drain stays in progress
            sandbox.signal_pod(pod, signal.SIGSTOP)
        try:
            sandbox.apply(
                retirement_request(
                    "first", scheduler={"address": sandbox.scheduler_address}, workers=[pods[0]], timeout="120s"
                )
            )
            sandbox.wait_phase("first", "Draining")
            claimed = sandbox.get("pod", pods[0])["metadata"]["annotations"]
            assert claimed["memops.dev/retirement-request"] == "first"
            sandbox.kubectl("delete", "retire", "first", "--wait=false")
            sandbox.wait_for(
                lambda: sandbox.kubectl("get", "retire", "first", check=False).returncode != 0,
                what="the request to be gone (its finalizer step done)",
            )
            annotations = sandbox.get("pod", pods[0])["metadata"].get("annotations") or {}
            assert "memops.dev/retirement-request" not in annotations
            assert "controller.kubernetes.io/pod-deletion-cost" not in annotations
        finally:
            for pod in frozen:
                sandbox.signal_pod(pod, signal.SIGCONT)

        # The scheduler goes on with the drain it was asked for, which nothing can cancel: the
        # worker leaves and the kubelet restarts the container, or (its recipients having been
        # away) the scheduler sets it back to running. Until the pod has a running worker, it
        # has none that memops can identify, which it would keep: wait for one, new or old.
        def running_worker() -> str | None:
            workers = client.scheduler_info(n_workers=-1)["workers"]
            found = [a for a, info in workers.items() if str(info["name"]) == pods[0] and info["status"] == "running"]
            return found[0] if found else None

        worker = sandbox.wait_for(running_worker, timeout=180, what="a running worker in the pod, new or old")
        print("the pod's worker after the deleted request:", "the old one, back" if worker == old else "a new one")
        sandbox.apply(retirement_request("second", scheduler={"address": sandbox.scheduler_address}, workers=[pods[0]]))
        done = sandbox.wait_phase("second", "Succeeded", "Failed")
        assert done["status"]["phase"] == "Succeeded", done["status"]
        assert pods[0] not in sandbox.pods()
        holdings.assert_all_correct()


def test_deleting_the_policy_mid_drain_gives_its_pod_back(sandbox: Sandbox) -> None:
    pods = sandbox.pods()
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        # pods[0] holds least: the policy's scale-down chooses it.
        holdings = scatter_unique(client, {pods[0]: 1, pods[1]: 3, pods[2]: 3, pods[3]: 3})
        frozen = pods[1:]
        for pod in frozen:
            sandbox.signal_pod(pod, signal.SIGSTOP)
        try:
            sandbox.apply(
                {
                    "apiVersion": "memops.dev/v1alpha1",
                    "kind": "MemoryPolicy",
                    "metadata": {"name": "shrink"},
                    "spec": {
                        "scheduler": {"address": sandbox.scheduler_address},
                        "workload": {"kind": "Deployment", "name": "dask-worker"},
                        "replicas": 3,
                        "drain": {"timeout": "120s"},
                    },
                }
            )
            sandbox.wait_for(
                lambda: (
                    (sandbox.get("pod", pods[0])["metadata"].get("annotations") or {})
                    .get("memops.dev/retirement-request", "")
                    .startswith("shrink-")
                ),
                what="the policy's request to claim the pod",
            )
            sandbox.kubectl("delete", "mempol", "shrink", "--wait=false")
            sandbox.wait_for(
                lambda: not sandbox.get("retire", "-l", "memops.dev/policy=shrink")["items"],
                what="the policy's request to be gone with it",
            )
            annotations = sandbox.get("pod", pods[0])["metadata"].get("annotations") or {}
            assert "memops.dev/retirement-request" not in annotations
            assert "controller.kubernetes.io/pod-deletion-cost" not in annotations
        finally:
            for pod in frozen:
                sandbox.signal_pod(pod, signal.SIGCONT)
        assert sandbox.replicas() == 4
        holdings.assert_all_correct()


def test_a_scheduler_whose_workers_are_another_namespaces_is_left_alone(sandbox: Sandbox) -> None:
    """Another tenant's namespace points at the scheduler of default's workers: it reads nothing of
    them, installs nothing, retires nothing, and says why."""
    tenant = sandbox.make_namespace("tenant-b")
    sandbox.kubectl("create", "serviceaccount", "dask-worker", "-n", tenant)
    workers = sandbox_cli.worker_deployment(sandbox.scheduler_address, 0)
    workers["metadata"]["namespace"] = tenant
    workers["spec"]["template"]["spec"]["serviceAccountName"] = "dask-worker"
    sandbox.apply(workers)
    scheduler = {"address": sandbox.scheduler_address}
    sandbox.apply(
        {
            "apiVersion": "memops.dev/v1alpha1",
            "kind": "MemoryPolicy",
            "metadata": {"name": "b", "namespace": tenant},
            "spec": {
                "scheduler": scheduler,
                "workload": {"kind": "Deployment", "name": "dask-worker"},
                "pressure": {"relieveAbove": "80%", "relieveTo": "60%"},
            },
        }
    )
    # Retried until the deadline: the last try's answer names the failure (each try has a full
    # call's time, even at the deadline, so that a slow answer under load is not called unreachable).
    request = retirement_request("b", scheduler=scheduler, count=1, timeout="30s")
    request["metadata"]["namespace"] = tenant
    sandbox.apply(request)

    def refused(kind: str) -> dict[str, Any] | None:
        status: dict[str, Any] = sandbox.get(kind, "b", "-n", tenant).get("status", {})
        reachable = [c for c in status.get("conditions", []) if c["type"] == "SchedulerReachable"]
        return status if reachable and reachable[0]["reason"] == "ForeignScheduler" else None

    policy = sandbox.wait_for(lambda: refused("mempol"), what="the policy to refuse the scheduler")
    # Each pass meets the scheduler again: none of them reads its workers' memory or installs relief.
    polling.stays(
        lambda: (found := refused("mempol")) is not None and "memory" not in found and "pressure" not in found,
        seconds=windows.POLICY_PASS,
        what="the scheduler refused, nothing read of it and nothing installed",
    )
    [condition] = [c for c in policy["conditions"] if c["type"] == "SchedulerReachable"]
    assert condition["status"] == "False"
    assert condition["message"].startswith(
        f"spec.scheduler.address: 4 of the scheduler's 4 workers are not pods of namespace {tenant}"
    )
    failed = sandbox.wait_for(
        lambda: (r := sandbox.get("retire", "b", "-n", tenant)).get("status", {}).get("phase") == "Failed" and r,
        what="the request to fail",
    )
    [reason] = [c["reason"] for c in failed["status"]["conditions"] if c["type"] == "Failed"]
    assert reason == "ForeignScheduler", failed["status"]
    assert not failed["status"].get("workers"), "nothing about the scheduler's workers is written"
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        assert len(client.scheduler_info(n_workers=-1)["workers"]) == 4, "no worker was retired"
    assert len(sandbox.pods()) == 4
