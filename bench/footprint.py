"""The operator's footprint at scale: 1,000 worker pods, 100 MemoryPolicies, 100 RetirementRequests.

In the emulated API (no worker processes: a "hollow" kubelet, as Kubernetes' own kubemark has,
binds pods to hollow nodes, marks them Running and Ready and completes their deletion), with
one real Dask scheduler that every policy points at. The operator runs as its own process,
exactly as ``memops run``. Reported: its resident memory, CPU seconds per minute and API
requests per minute at rest, then during a scale-down wave (every policy lowered by one
worker: 100 RetirementRequests), then at rest again with the 100 finished requests present.

Anchor, in the same run and the same emulated API: dask-kubernetes' operator (its own
``kopf run -m dask_kubernetes.operator.controller``) with as many DaskClusters, each with a
DaskWorkerGroup of the same number of workers, at rest. Its scale-down is not measured: it
reaches a scheduler only through the scheduler Service's DNS name or a port-forward, neither
of which the emulated cluster has, so its replica handler fails and retries every 60 s.

    python bench/footprint.py                             # 1,000 pods, 100 policies
    python bench/footprint.py --policies 10 --rest 10     # the small pass CI runs
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import hashlib
import importlib.resources
import os
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kmock
import yaml
from memops.cluster import apiserver, replicaset
from memops.cluster.store import Store

from memops import crds, sandbox, specs

PODS_PER_POLICY = 10
ANCHOR_BATCH = 10
Obj = dict[str, Any]


class HollowKubelet:
    """Pods without processes: bound to one of 100 hollow nodes, Running and Ready at once;
    deleted at once when asked."""

    def __init__(self, store: Store):
        self.store = store

    async def run(self) -> None:
        pending: set[asyncio.Task[None]] = set()

        def sync_later(pod: Obj) -> None:
            # Off the watch loop: writing to the store from inside its own watch stalls it.
            task = asyncio.create_task(self.sync(pod))
            pending.add(task)
            task.add_done_callback(pending.discard)

        watch = self.store.watch()
        for pod in self.store.list("pods"):  # list, then watch, as an informer does
            sync_later(pod)
        async for event in watch:
            if event.plural == "pods" and event.type != "DELETED":
                sync_later(event.object)

    async def sync(self, pod: Obj) -> None:
        meta = pod["metadata"]
        namespace, name = meta.get("namespace"), meta["name"]
        with contextlib.suppress(Exception):  # the pod may be gone already
            if meta.get("deletionTimestamp"):
                await self.store.delete("pods", namespace, name, grace_period_seconds=0)
            elif pod.get("status", {}).get("phase") != "Running":
                # Bound to a node first, as the scheduler would: the ReplicaSet's ranking (and
                # memops, which follows it) treats unbound pods as not running.
                node = f"hollow-{int(hashlib.sha256(name.encode()).hexdigest(), 16) % 100}"
                await self.store.patch("pods", namespace, name, {"spec": {"nodeName": node}})
                ready = [{"type": t, "status": "True"} for t in ("PodScheduled", "Initialized", "Ready")]
                await self.store.patch(
                    "pods", namespace, name, {"status": {"phase": "Running", "conditions": ready}}, subresource="status"
                )


class Process:
    """Resident memory and CPU time of a process, from /proc."""

    def __init__(self, pid: int):
        self.pid = pid

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def policy(namespace: str, name: str, address: str, replicas: int) -> Obj:
    return {
        "apiVersion": specs.API_VERSION,
        "kind": "MemoryPolicy",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "scheduler": {"address": address},
            "workload": {"kind": "Deployment", "name": name},
            "replicas": replicas,
        },
    }


def deployment(namespace: str, name: str, address: str) -> Obj:
    body = sandbox.worker_deployment(address, PODS_PER_POLICY)
    body["metadata"].update({"name": name, "namespace": namespace, "labels": {"app": name}})
    body["spec"]["selector"] = {"matchLabels": {"app": name}}
    body["spec"]["template"]["metadata"]["labels"] = {"app": name}
    return body


@contextlib.asynccontextmanager
async def operator_process(kubeconfig: Path, log: Path, *argv: str) -> AsyncIterator[Process]:
    """An operator as its own process (memops' or dask-kubernetes'), stopped on the way out."""
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    with log.open("wb") as output:
        child = await asyncio.create_subprocess_exec(
            sandbox._executable(argv[0]),
            *argv[1:],
            stdout=output,
            stderr=output,
            env=env,
            start_new_session=True,
        )
        try:
            yield Process(child.pid)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGTERM)
            await child.wait()


async def measure(api: apiserver.ApiServer, proc: Process, seconds: float) -> tuple[float, float, float]:
    """(RSS MiB at the end, CPU seconds per minute, API requests per minute) over ``seconds``."""
    requests, cpu, start = len(api._requests), proc.cpu_seconds(), time.monotonic()
    await asyncio.sleep(seconds)
    minutes = (time.monotonic() - start) / 60
    return proc.rss_mib(), (proc.cpu_seconds() - cpu) / minutes, (len(api._requests) - requests) / minutes


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


async def until(predicate: Any, timeout: float, what: str, store: Store | None = None) -> None:
    """Poll the in-process store: it is this process' own state, so polling is cheap and plain."""
    progress(f"waiting for {what}")
    try:
        async with asyncio.timeout(timeout):
            while not predicate():  # noqa: ASYNC110
                await asyncio.sleep(0.5)
    except TimeoutError:
        for kind in ("memorypolicies", "retirementrequests") if store is not None else ():
            for body in store.list(kind)[:3]:
                status = body.get("status", {})
                progress(f"{kind} {body['metadata']['name']}: {status.get('phase')} {status.get('conditions')}")
        for pod in store.list("pods")[:2] if store is not None else ():
            progress(f"pod {pod['metadata']['name']}: {pod['spec'].get('nodeName')} {pod.get('status')}")
        raise


def is_ready(body: Obj) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in body.get("status", {}).get("conditions", []))


async def main_async(policies: int, rest: float) -> list[tuple[str, float, float, float, str]]:
    state = Path(tempfile.mkdtemp(prefix="memops-footprint-"))
    api = apiserver.ApiServer()
    store = api.store
    rows: list[tuple[str, float, float, float, str]] = []
    async with api, kmock.Server(api) as server, sandbox.dask_scheduler(state) as (address, _):
        for crd in crds.all_crds():
            await api.create_crd(crd)
        kubeconfig = state / "kubeconfig"
        kubeconfig.write_text(apiserver.kubeconfig(str(server.url).rstrip("/")))
        tasks = [
            asyncio.create_task(replicaset.DeploymentController(store).run()),
            asyncio.create_task(HollowKubelet(store).run()),
        ]
        names = [(f"team-{i % 10}", f"dask-{i}") for i in range(policies)]
        for namespace in sorted({namespace for namespace, _ in names}):
            if store.get("namespaces", None, namespace) is None:
                await store.create("namespaces", None, {"metadata": {"name": namespace}})
        for namespace, name in names:
            await store.create("deployments", namespace, deployment(namespace, name, address))
        total = policies * PODS_PER_POLICY
        await until(lambda: len(store.list("pods")) == total, 300, f"{total} pods")
        async with operator_process(
            kubeconfig, state / "operator.log", "memops", "run", "--all-namespaces", "--standalone"
        ) as proc:
            for namespace, name in names:
                await store.create("memorypolicies", namespace, policy(namespace, name, address, PODS_PER_POLICY))

            def ready() -> bool:
                found = store.list("memorypolicies")
                return len(found) == policies and all(is_ready(p) for p in found)

            await until(ready, 600, "every policy Ready")
            await asyncio.sleep(5)
            rss, cpu, api_rate = await measure(api, proc, rest)
            rows.append((f"at rest: {total} pods, {policies} policies", rss, cpu, api_rate, ""))

            started = time.monotonic()
            requests_before, cpu_before = len(api._requests), proc.cpu_seconds()
            for namespace, name in names:
                await store.patch("memorypolicies", namespace, name, {"spec": {"replicas": PODS_PER_POLICY - 1}})

            def done() -> bool:
                found = store.list("retirementrequests")
                finished = [r for r in found if r.get("status", {}).get("phase") in ("Succeeded", "Failed")]
                return len(finished) >= policies and len(store.list("pods")) == total - policies

            await until(done, 900 if policies > 10 else 60, "the scale-down wave", store)
            minutes = (time.monotonic() - started) / 60
            rows.append(
                (
                    f"scale-down wave: {policies} RetirementRequests",
                    proc.rss_mib(),
                    (proc.cpu_seconds() - cpu_before) / minutes,
                    (len(api._requests) - requests_before) / minutes,
                    f"all done in {minutes * 60:.0f}s",
                )
            )
            await asyncio.sleep(5)
            rss, cpu, api_rate = await measure(api, proc, rest)
            rows.append((f"at rest after: + {policies} finished requests", rss, cpu, api_rate, ""))
        for task in tasks:
            task.cancel()
    return rows


def dask_cluster(namespace: str, name: str) -> Obj:
    container = {"name": "c", "command": ["dask"], "args": ["worker"]}
    return {
        "apiVersion": "kubernetes.dask.org/v1",
        "kind": "DaskCluster",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "scheduler": {
                "spec": {"containers": [{**container, "args": ["scheduler"]}]},
                "service": {
                    "type": "ClusterIP",
                    "selector": {"dask.org/cluster-name": name, "dask.org/component": "scheduler"},
                    "ports": [
                        {"name": "tcp-comm", "protocol": "TCP", "port": 8786, "targetPort": "tcp-comm"},
                        {"name": "http-dashboard", "protocol": "TCP", "port": 8787, "targetPort": "http-dashboard"},
                    ],
                },
            },
            "worker": {"replicas": PODS_PER_POLICY, "spec": {"containers": [container]}},
        },
    }


async def anchor_async(clusters: int, rest: float) -> list[tuple[str, float, float, float, str]]:
    """dask-kubernetes' operator with ``clusters`` DaskClusters of PODS_PER_POLICY workers, at rest."""
    charts = importlib.resources.files("dask_kubernetes") / "operator/deployment/helm/dask-kubernetes-operator/crds"
    state = Path(tempfile.mkdtemp(prefix="memops-footprint-anchor-"))
    api = apiserver.ApiServer()
    store = api.store
    async with api, kmock.Server(api) as server:
        for crd in sorted(charts.iterdir(), key=lambda f: f.name):
            await api.create_crd(yaml.safe_load(crd.read_text()))
        kubeconfig = state / "kubeconfig"
        kubeconfig.write_text(apiserver.kubeconfig(str(server.url).rstrip("/")))
        tasks = [
            asyncio.create_task(replicaset.DeploymentController(store).run()),
            asyncio.create_task(HollowKubelet(store).run()),
        ]
        names = [(f"team-{i % 10}", f"dk-{i}") for i in range(clusters)]
        for namespace in sorted({namespace for namespace, _ in names}):
            if store.get("namespaces", None, namespace) is None:
                await store.create("namespaces", None, {"metadata": {"name": namespace}})
        total = clusters * PODS_PER_POLICY
        async with operator_process(
            kubeconfig,
            state / "operator.log",
            *("kopf", "run", "--standalone", "--all-namespaces", "-m", "dask_kubernetes.operator.controller"),
        ) as proc:

            def workers_running(count: int) -> bool:
                pods = store.list("pods", None, {"dask.org/component": "worker"})
                return sum(1 for p in pods if p.get("status", {}).get("phase") == "Running") >= count

            # Ten clusters at a time: created all at once, its controller stalled here after about
            # a hundred worker Deployments, every handler waiting and no CPU used.
            note = f"+ {clusters} scheduler pods"
            for start in range(0, clusters, ANCHOR_BATCH):
                for namespace, name in names[start : start + ANCHOR_BATCH]:
                    await store.create("daskclusters", namespace, dask_cluster(namespace, name))
                wanted = min(start + ANCHOR_BATCH, clusters) * PODS_PER_POLICY
                try:
                    await until(functools.partial(workers_running, wanted), 300, f"{wanted} worker pods")
                except TimeoutError:
                    note += f"; stalled at {len(store.list('deployments')) - clusters} worker Deployments"
                    break
            await asyncio.sleep(5)
            rss, cpu, api_rate = await measure(api, proc, rest)
            return_rows = [(f"at rest: {total} pods, {clusters} DaskWorkerGroups", rss, cpu, api_rate, note)]
        for task in tasks:
            task.cancel()
    return return_rows


def ratio(ours: float, theirs: float) -> str:
    """ours / theirs, or why not: a short rest can round an idle anchor's figure down to 0."""
    if theirs <= 0:
        return "n/a (dask-kubernetes measured 0)" if ours > 0 else "1.00x (both 0)"
    return f"{ours / theirs:.2f}x"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", type=int, default=100, help=f"policies, each with {PODS_PER_POLICY} pods")
    parser.add_argument("--rest", type=float, default=60, help="seconds measured at rest")
    args = parser.parse_args()
    # On SIGTERM (a timeout), unwind through the context managers: they stop the operators.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    rows = asyncio.run(main_async(args.policies, args.rest))
    progress(
        "memops: "
        + "; ".join(
            f"{label}: {rss:.0f} MiB, {cpu:.1f} CPU s/min, {rate:.0f} req/min" for label, rss, cpu, rate, _ in rows
        )
    )
    anchor = asyncio.run(anchor_async(args.policies, args.rest))
    print(f"\n{'operator':17} {'phase':48} {'RSS MiB':>8} {'CPU s/min':>10} {'API req/min':>12}  note")
    for who, table in (("memops", rows), ("dask-kubernetes", anchor)):
        for label, rss, cpu, rate, note in table:
            print(f"{who:17} {label:48} {rss:>8.0f} {cpu:>10.1f} {rate:>12.0f}  {note}")
    (_, rss, cpu, rate, _), (_, a_rss, a_cpu, a_rate, _) = rows[0], anchor[0]
    print(
        f"\nat rest, memops / dask-kubernetes: memory {ratio(rss, a_rss)}, CPU {ratio(cpu, a_cpu)},"
        f" API requests {ratio(rate, a_rate)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
