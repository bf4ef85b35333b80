"""Memory-aware task admission through a MemoryPolicy (``spec.tasks``) on real Nodes: worker pods with
a 1 GiB container limit (the kernel's) and 4 threads, the issue's spiky workload (40 ordinary tasks
whose 8 MiB results stay in memory, 16 tasks that each hold 300 MiB for 1.5 s). Stock Dask first,
in the same namespace, then the same workload under the policy."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import distributed
from memops_sandbox import common as sandbox_cli
from memops_sandbox import spiky

from memops.specs.common import parse_quantity
from tests.e2e.conftest import Sandbox
from tests.e2e.data import scatter_unique
from tests.e2e.test_policy import memory_policy

THREADS = 4
SPIKES = 16
ORDINARY = 40


def four_threads(sandbox: Sandbox) -> None:
    """Give the workers 4 threads each (a rollout), and wait until every new worker has connected."""
    args = sandbox.get("deployment", "dask-worker")["spec"]["template"]["spec"]["containers"][0]["args"]
    index = args.index("--nthreads") + 1
    patch = [{"op": "replace", "path": f"/spec/template/spec/containers/0/args/{index}", "value": str(THREADS)}]
    sandbox.kubectl("patch", "deployment", "dask-worker", "--type=json", "-p", json.dumps(patch))

    def rolled_out() -> bool:
        deployment = sandbox.get("deployment", "dask-worker")
        status = deployment.get("status") or {}
        return bool(
            status.get("observedGeneration", 0) >= deployment["metadata"]["generation"]
            and status.get("updatedReplicas") == status.get("replicas") == deployment["spec"]["replicas"]
        )

    sandbox.wait_for(rolled_out, timeout=180, what="the rollout to 4 threads")
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        sandbox.wait_for(
            lambda: sorted(w["nthreads"] for w in client.scheduler_info()["workers"].values()) == [THREADS] * 4,
            timeout=180,
            what="four workers of 4 threads",
        )


def restarts(sandbox: Sandbox, app: str = "dask-worker") -> dict[str, tuple[str, int]]:
    """Each worker pod's container ID and restart count."""
    pods = sandbox.get("pods", "-l", f"app={app}")["items"]
    return {
        p["metadata"]["name"]: (s["containerID"], s["restartCount"])
        for p in pods
        for s in (p.get("status") or {}).get("containerStatuses") or ()
    }


def suppliers(client: distributed.Client) -> list[str]:
    """The workers that supply memops' resource: those whose admission plugin is set up."""

    def supplying(dask_scheduler: Any) -> list[str]:  # nested: sent by value, as tests/ is not importable there
        return sorted(dask_scheduler.resources.get("memops-memory", {}))

    return list(client.run_on_scheduler(supplying))


def why_replaced(sandbox: Sandbox, app: str = "dask-worker") -> str:
    """What the worker pods' nannies and memops' plugin said of memory and restarts: for a failure's
    message (the nanny says whether it killed a worker past 95%, or found it killed by a signal)."""
    said = sandbox.kubectl("logs", "-l", f"app={app}", "--tail=400", "--prefix", check=False).stdout
    words = ("memory", "restart", "killed", "signal", "memops")
    return "\n".join(line for line in said.splitlines() if any(w in line.lower() for w in words))[-4000:]


def run(sandbox: Sandbox) -> tuple[str, set[str], set[str]]:
    """The workload once: its outcome, and the workers before and after (a worker process that the
    nanny or the kernel killed comes back at another address)."""
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        before = set(client.scheduler_info()["workers"])
        base, tops = spiky.submit(client, ordinary_tasks=ORDINARY, spikes=SPIKES)
        try:
            total = sum(client.gather(tops))
            outcome = "right" if total == spiky.expected(SPIKES, ORDINARY) else f"wrong: {total}"
        except distributed.KilledWorker as exc:
            outcome = f"KilledWorker: {str(exc)[:100]}"
        lost = [f.key for f in base if f.status != "finished"]
        after = set(client.scheduler_info()["workers"])
        del base, tops
    return (outcome if not lost else f"{outcome}; {len(lost)} ordinary keys lost"), before, after


def test_a_spiky_workload_that_kills_stock_workers_finishes_under_admission(sandbox: Sandbox) -> None:
    # Run on the scheduler; nested, so sent by value (the scheduler cannot import the tests).
    def installed(dask_scheduler: Any) -> bool:
        return "memops-admission" in dask_scheduler.plugins or "memops_admission" in dask_scheduler.worker_plugins

    four_threads(sandbox)
    outcome, before, after = run(sandbox)
    replaced = len(before - after)
    print(f"stock Dask: {outcome}; {replaced} of 4 worker processes replaced")
    assert replaced >= 1 or outcome != "right", "stock Dask was meant to lose a worker on this workload"

    sandbox.apply(memory_policy("tasks", sandbox.scheduler_address, tasks={}))
    sandbox.wait_for(
        lambda: (s := sandbox.get("mempol", "tasks").get("status", {})).get("tasks") is not None and s,
        what="status.tasks: admission installed",
    )
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        sandbox.wait_for(lambda: len(suppliers(client)) == 4, what="every worker supplies memops' resource")
    containers = restarts(sandbox)
    outcome, before, after = run(sandbox)
    print(f"memops: {outcome}; workers before {len(before)}, after {len(after)}")
    assert outcome == "right"
    assert before == after, f"no worker process was killed by the nanny or the kernel:\n{why_replaced(sandbox)}"
    assert restarts(sandbox) == containers and all(count == 0 for _, count in containers.values())
    status: dict[str, Any] = sandbox.wait_for(
        lambda: (
            (t := sandbox.get("mempol", "tasks")["status"].get("tasks") or {}).get("top")
            and t["top"][0]["prefix"] == "spike"
            and t
        ),
        what="status.tasks to show the spike's profile first",
    )
    print(f"status.tasks: {status}")
    assert status["top"][0]["peakBytes"] >= 250 * 2**20, status
    sandbox.kubectl("delete", "mempol/tasks")
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        sandbox.wait_for(lambda: not client.run_on_scheduler(installed), what="admission to leave with the policy")


def chart_pods(sandbox: Sandbox, name: str) -> None:
    """Two worker pods as the Dask Helm chart writes them, with ``worker.extraArgs: [--nworkers, 2]``:
    no ``--name`` or ``--host``, ``--memory-limit`` the container's limit (2 GiB), so each of the
    pod's two worker processes of 4 threads is told the whole container."""
    body = sandbox_cli.worker_deployment(
        sandbox.scheduler_address, 2, "2GiB", image=sandbox_cli.DASK_IMAGE, namespace=None
    )
    body["metadata"] = {"name": name, "labels": {"app": name}}
    body["spec"]["selector"] = {"matchLabels": {"app": name}}
    body["spec"]["template"]["metadata"] = {"labels": {"app": name}}
    [container] = body["spec"]["template"]["spec"]["containers"]
    container["args"] = ["$(DASK_SCHEDULER_ADDRESS)", "--nthreads", str(THREADS), "--memory-limit", "2GiB"]
    container["args"] += ["--no-dashboard", "--nworkers", "2"]
    sandbox.apply(body)


def test_two_worker_processes_of_a_chart_pod_share_its_limit_under_admission(
    sandbox_factory: Callable[..., Sandbox],
) -> None:
    """The spiky workload on two pods of two worker processes each (the chart's arguments with
    ``--nworkers 2``). Stock Dask: each process thinks it has the pod's 2 GiB, 8 spikes land on a
    pod at once, and the kernel kills worker processes at the container's limit (no nanny acts: no
    process reaches 95% of its own 2 GiB). Under memops each process admits against its share of
    the container (1 GiB): the right result, no process replaced, no container restarted."""
    sandbox = sandbox_factory(0)
    chart_pods(sandbox, "chart")
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        client.wait_for_workers(4, timeout=180)
    outcome, before, after = run(sandbox)
    replaced = len(before - after)
    print(f"stock Dask: {outcome}; {replaced} of 4 worker processes replaced")
    assert replaced >= 1 or outcome != "right", "stock Dask was meant to lose a worker process on this workload"

    sandbox.apply(memory_policy("tasks", sandbox.scheduler_address, "chart", tasks={}))
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        client.wait_for_workers(4, timeout=180)
        sandbox.wait_for(lambda: len(suppliers(client)) == 4, what="every worker process supplies memops' resource")

        def capacities(dask_scheduler: Any) -> list[float]:  # nested: sent by value
            return sorted(dask_scheduler.resources.get("memops-memory", {}).values())

        # Counted again every few seconds: a sibling may have started after a process' plugin did.
        told = sandbox.wait_for(
            lambda: (t := client.run_on_scheduler(capacities)) and len(t) == 4 and all(c <= 0.8 * GIB for c in t) and t,
            what="each process to admit against its half of the pod's 2 GiB (a capacity of at most 819 MiB)",
        )
    print(f"capacities told: {[round(c / 2**20) for c in told]} MiB")
    containers = restarts(sandbox, "chart")
    outcome, before, after = run(sandbox)
    print(f"memops: {outcome}; workers before {len(before)}, after {len(after)}")
    assert outcome == "right"
    assert before == after, (
        f"no worker process was killed by the nanny or the kernel:\n{why_replaced(sandbox, 'chart')}"
    )
    assert restarts(sandbox, "chart") == containers


GIB = 2**30
PEAK = 900 * 2**20
"""More than the capacity task admission sees of a 1 GiB worker: its pause threshold, 819 MiB."""


def worker_pool(sandbox: Sandbox, name: str, memory: str) -> None:
    """One worker pod of one thread, ``memory`` of container limit, in a Deployment ``name``."""
    body = sandbox_cli.worker_deployment(
        sandbox.scheduler_address, 1, memory, image=sandbox_cli.DASK_IMAGE, namespace=None
    )
    body["metadata"]["name"] = name
    body["metadata"]["labels"] = body["spec"]["selector"]["matchLabels"] = {"app": name}
    body["spec"]["template"]["metadata"]["labels"] = {"app": name}
    sandbox.apply(body)


def test_a_task_that_fits_no_worker_grows_one_in_place(sandbox_factory: Callable[..., Sandbox]) -> None:
    """A prefix profiled at 900 MiB on a pool of 2 GiB workers that then scaled to zero: its next
    task fits no worker left (1 GiB: a capacity of 819 MiB), and waits. Under a policy with
    ``spec.tasks`` and ``spec.resize``, memops grows that worker's pod in place, tells Dask, and
    the task runs there: the right result, the same container (restartCount 0), no key lost, and
    the status says that growth served the demand."""
    sandbox = sandbox_factory(0)

    def worker_of(client: distributed.Client, pool: str) -> str | None:
        found = [
            a for a, w in client.scheduler_info(n_workers=-1)["workers"].items() if str(w["name"]).startswith(pool)
        ]
        return found[0] if len(found) == 1 else None

    worker_pool(sandbox, "big", "2GiB")
    worker_pool(sandbox, "small", "1GiB")
    sandbox.apply(memory_policy("demand", sandbox.scheduler_address, "small", tasks={}, resize={"maxLimit": "2Gi"}))
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        big = sandbox.wait_for(lambda: worker_of(client, "big"), timeout=180, what="the big pool's worker")
        small = sandbox.wait_for(lambda: worker_of(client, "small"), timeout=180, what="the small pool's worker")
        sandbox.wait_for(lambda: len(suppliers(client)) == 2, what="both workers supply memops' resource")
        [pod] = sandbox.get("pods", "-l", "app=small")["items"]
        name = pod["metadata"]["name"]
        holdings = scatter_unique(client, {name: 16}, size=4 * 2**20)
        assert client.submit(spiky.grow, 0, hold=PEAK, workers=[big], pure=False).result(timeout=120) == 30.0
        sandbox.wait_for(
            lambda: any(
                p["prefix"] == "grow" and p["peakBytes"] >= 850 * 2**20
                for p in (sandbox.get("mempol", "demand").get("status", {}).get("tasks") or {}).get("top", [])
            ),
            timeout=120,
            what="the prefix profiled on the big pool",
        )
        sandbox.kubectl("scale", "deployment", "big", "--replicas=0")
        sandbox.wait_for(lambda: worker_of(client, "big") is None, timeout=120, what="the big pool gone")
        [before] = sandbox.get("pod", name)["status"]["containerStatuses"]

        task = client.submit(spiky.grow, 1, hold=PEAK, pure=False)
        said = sandbox.wait_for(
            lambda: (
                (t := sandbox.get("mempol", "demand").get("status", {}).get("tasks") or {}).get("demandAction")
                == "Resize"
                and t
            ),
            timeout=120,
            what="status.tasks to say that a worker grows for the demand",
        )
        print(f"status.tasks: {said}")
        assert said["demandTasks"] == 1 and said["demandBytes"] >= 850 * 2**20, said
        assert task.result(timeout=240) == 31.0
        assert worker_of(client, "small") == small, "the same worker process ran it"
        holdings.assert_all_correct()
    pod = sandbox.get("pod", name)
    [after] = pod["status"]["containerStatuses"]
    assert (after["containerID"], after["restartCount"]) == (before["containerID"], 0), after
    limit = parse_quantity(pod["spec"]["containers"][0]["resources"]["limits"]["memory"])
    assert limit >= (PEAK + 100 * 2**20) / 0.8, limit
    lines = sandbox.get("mempol", "demand")["status"]["resize"]["workers"]
    assert [(w["pod"], w["reason"]) for w in lines] == [(name, "TaskDemand")], lines
