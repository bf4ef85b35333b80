"""The operator's footprint with many MemoryPolicies over real Dask workers, on the upstream plane.

One ``memops sandbox`` (kube-apiserver, etcd, controller-manager, scheduler, the node agent, a
real Dask scheduler, the operator as ``memops run`` under its ServiceAccount). Into its
namespace go ``--policies`` worker Deployments of ``--workers`` real, small ``dask worker``
pods each (the tenancy rule holds: every worker of the scheduler is a pod of the namespace),
and a MemoryPolicy on each. Reported for the operator process: resident memory, CPU seconds
per minute and API requests per minute (the API server's audit log, by the operator's user) at
rest, during a scale-down wave (every policy lowered by one worker: as many drained
RetirementRequests), and at rest again with the finished requests present.

Anchor, in the same run and the same plane: dask-kubernetes' operator (its own ``kopf run -m
dask_kubernetes.operator.controller``, under a ServiceAccount of its own) with as many
DaskClusters, each a real scheduler with a DaskWorkerGroup of as many real workers, at rest.
Its scale-down is not measured: its replica handler retires workers through the scheduler
Service's DNS name, which the sandbox's loopback pods do not have.

    python bench/footprint.py                       # 10 policies of 2 workers, 60 s at rest
    python bench/footprint.py --small               # the small pass CI runs: 2 policies, 10 s
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import benchkit
import distributed
import yaml
from memops_sandbox import common as sandbox

IMAGE = "ghcr.io/dask/dask:2026.8.0"  # required by the API server; the node agent runs the command
NAMESPACE = "default"
WORKER_MEMORY = "256MiB"
DASK_KUBERNETES = "dask-kubernetes"  # its ServiceAccount, so that the audit log tells its requests apart
Obj = dict[str, Any]
Row = tuple[str, float, float, float, str]


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


class Audit:
    """Requests of one user, counted in the API server's audit log (one audit ID per request)."""

    def __init__(self, path: Path, user: str):
        self.path = path
        self.user = user

    def requests(self) -> int:
        ids = set()
        with self.path.open() as lines:
            for line in lines:
                if f'"{self.user}"' in line:
                    event = json.loads(line)
                    if event["user"]["username"] == self.user:
                        ids.add(event["auditID"])
        return len(ids)


def measure(proc: Process, audit: Audit, seconds: float) -> tuple[float, float, float]:
    """(RSS MiB at the end, CPU seconds per minute, API requests per minute) over ``seconds``."""
    requests, cpu, start = audit.requests(), proc.cpu_seconds(), time.monotonic()
    time.sleep(seconds)
    minutes = (time.monotonic() - start) / 60
    return proc.rss_mib(), (proc.cpu_seconds() - cpu) / minutes, (audit.requests() - requests) / minutes


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    progress(f"waiting for {what}")
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(1)


def get(env: dict[str, str], *what: str) -> Any:
    return json.loads(benchkit.kubectl(env, "get", *what, "-o", "json"))


def apply(env: dict[str, str], *objects: Obj) -> None:
    benchkit.kubectl(env, "apply", "-f", "-", stdin=yaml.safe_dump_all(objects))


def deployment(name: str, address: str, workers: int) -> Obj:
    body = sandbox.worker_deployment(address, workers, WORKER_MEMORY)
    body["metadata"].update({"name": name, "labels": {"app": name}})
    body["spec"]["selector"] = {"matchLabels": {"app": name}}
    body["spec"]["template"]["metadata"]["labels"] = {"app": name}
    return body


def is_ready(body: Obj) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in body.get("status", {}).get("conditions", []))


def worker_count(address: str) -> int:
    with distributed.Client(address, timeout=30) as client:
        return len(client.scheduler_info(n_workers=-1)["workers"])


def measure_memops(box: benchkit.Sandbox, policies: int, workers: int, rest: float) -> list[Row]:
    env, address = box.env, box.address
    names = [f"dask-{i}" for i in range(policies)]
    apply(env, *(deployment(name, address, workers) for name in names))
    total = 1 + policies * workers  # the sandbox's own worker, and the Deployments'
    until(lambda: worker_count(address) == total, 60 + sandbox.start_allowance(total), f"{total} Dask workers")
    proc = Process(box.operator_pid())
    audit = Audit(box.state / "audit.log", "system:serviceaccount:memops-system:memops")
    apply(
        env,
        *(
            benchkit.memory_policy(name, address, workload=name, namespace=NAMESPACE, replicas=workers)
            for name in names
        ),
    )

    def ready() -> bool:
        found = get(env, "mempol")["items"]
        return len(found) == policies and all(is_ready(p) for p in found)

    until(ready, 300, "every policy Ready")
    time.sleep(5)
    rows: list[Row] = []
    rss, cpu, rate = measure(proc, audit, rest)
    rows.append((f"at rest: {policies * workers} workers, {policies} policies", rss, cpu, rate, ""))

    started = time.monotonic()
    requests_before, cpu_before = audit.requests(), proc.cpu_seconds()
    for name in names:
        benchkit.kubectl(env, "scale", f"mempol/{name}", f"--replicas={workers - 1}")

    def done() -> bool:
        found = get(env, "retire")["items"]
        finished = [r for r in found if r.get("status", {}).get("phase") in ("Succeeded", "Failed")]
        # The policies' own pods (on real Nodes the scheduler is a pod of the namespace too).
        pods = get(env, "pods", "-l", f"app in ({','.join(names)})")["items"]
        return len(finished) >= policies and len(pods) == policies * (workers - 1)

    until(done, 300, "the scale-down wave")
    minutes = (time.monotonic() - started) / 60
    failed = [r["metadata"]["name"] for r in get(env, "retire")["items"] if r["status"]["phase"] != "Succeeded"]
    rows.append(
        (
            f"scale-down wave: {policies} RetirementRequests",
            proc.rss_mib(),
            (proc.cpu_seconds() - cpu_before) / minutes,
            (audit.requests() - requests_before) / minutes,
            f"all done in {minutes * 60:.0f}s" + (f"; not Succeeded: {failed}" if failed else ""),
        )
    )
    time.sleep(5)
    rss, cpu, rate = measure(proc, audit, rest)
    rows.append((f"at rest after: + {policies} finished requests", rss, cpu, rate, ""))
    return rows


def service_ip(index: int) -> str:
    """The ``index``-th DaskCluster's scheduler Service's cluster IP, set in the DaskCluster: the
    sandbox has no cluster DNS, so its workers are given the Service by IP rather than by
    dask-kubernetes' DNS name for it (as ``tests/e2e/test_daskworkergroup.py`` does)."""
    return f"10.96.201.{10 + index}"


def dask_cluster(name: str, ip: str, workers: int) -> Obj:
    """A DaskCluster whose scheduler's Service has the cluster IP ``ip``, which its workers are
    told; the containers are dask-kubernetes' own, with an image."""
    return {
        "apiVersion": "kubernetes.dask.org/v1",
        "kind": "DaskCluster",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "scheduler": {
                "spec": {
                    "containers": [
                        {
                            "name": "scheduler",
                            "image": IMAGE,
                            "command": ["dask", "scheduler"],
                            "args": ["--no-dashboard"],
                            "ports": [{"name": "tcp-comm", "containerPort": 8786, "protocol": "TCP"}],
                        }
                    ]
                },
                "service": {
                    "type": "ClusterIP",
                    "clusterIP": ip,
                    "selector": {"dask.org/cluster-name": name, "dask.org/component": "scheduler"},
                    "ports": [{"name": "tcp-comm", "protocol": "TCP", "port": 8786, "targetPort": "tcp-comm"}],
                },
            },
            "worker": {
                "replicas": workers,
                "spec": {
                    "containers": [
                        {
                            "name": "worker",
                            "image": IMAGE,
                            "command": ["dask", "worker"],
                            "args": [
                                "$(DASK_SCHEDULER_ADDRESS)",
                                "--name",
                                "$(DASK_WORKER_NAME)",
                                "--host",
                                "$(POD_IP)",
                                "--nthreads",
                                "1",
                                "--memory-limit",
                                WORKER_MEMORY,
                                "--no-dashboard",
                            ],
                            "env": [
                                {"name": "DASK_SCHEDULER_ADDRESS", "value": f"tcp://{ip}:8786"},
                                {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                            ],
                        }
                    ]
                },
            },
        },
    }


@contextmanager
def dask_kubernetes_operator(box: benchkit.Sandbox) -> Iterator[Process]:
    """dask-kubernetes' CRDs, and its operator under a ServiceAccount of its own (cluster-admin:
    what it may do is not what is measured)."""
    env = box.env
    charts = importlib.resources.files("dask_kubernetes") / "operator/deployment/helm/dask-kubernetes-operator/crds"
    benchkit.kubectl(env, "apply", "-f", str(charts))
    benchkit.kubectl(env, "wait", "--for=condition=Established", "--timeout=60s", "crd", "--all")
    benchkit.kubectl(env, "create", "serviceaccount", DASK_KUBERNETES, "-n", NAMESPACE)
    benchkit.kubectl(
        env,
        "create",
        "clusterrolebinding",
        DASK_KUBERNETES,
        "--clusterrole=cluster-admin",
        f"--serviceaccount={NAMESPACE}:{DASK_KUBERNETES}",
    )
    token = benchkit.kubectl(env, "create", "token", DASK_KUBERNETES, "-n", NAMESPACE, "--duration=2h").strip()
    config = yaml.safe_load((box.state / "kubeconfig").read_text())
    config["users"] = [{"name": DASK_KUBERNETES, "user": {"token": token}}]
    for context in config["contexts"]:
        context["context"]["user"] = DASK_KUBERNETES
    kubeconfig = box.state / f"{DASK_KUBERNETES}.kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(config))
    kopf = str(Path(sys.executable).parent / "kopf")
    with (box.state / f"{DASK_KUBERNETES}.log").open("wb") as log:
        child = subprocess.Popen(
            [kopf, "run", "--standalone", "--all-namespaces", "-m", "dask_kubernetes.operator.controller"],
            stdout=log,
            stderr=log,
            env={**env, "KUBECONFIG": str(kubeconfig)},
            start_new_session=True,
        )
    try:
        yield Process(child.pid)
    finally:
        os.killpg(child.pid, signal.SIGTERM)
        child.wait(30)


def measure_anchor(box: benchkit.Sandbox, clusters: int, workers: int, rest: float) -> list[Row]:
    env = box.env
    with dask_kubernetes_operator(box) as proc:
        ips = [service_ip(index) for index in range(clusters)]
        for index, ip in enumerate(ips):
            apply(env, dask_cluster(f"dk-{index}", ip, workers))

        def all_workers() -> bool:
            try:
                return all(worker_count(f"tcp://{ip}:8786") == workers for ip in ips)
            except Exception:
                # Until kube-proxy routes a new Service's IP, whatever the machine routes it to may
                # answer (an HTTP proxy did: a "frame" of 3 EiB).
                return False

        total = clusters * workers
        until(all_workers, 60 + sandbox.start_allowance(total), f"{total} DaskCluster workers")
        time.sleep(5)
        audit = Audit(box.state / "audit.log", f"system:serviceaccount:{NAMESPACE}:{DASK_KUBERNETES}")
        rss, cpu, rate = measure(proc, audit, rest)
        return [(f"at rest: {clusters * workers} workers, {clusters} DaskWorkerGroups", rss, cpu, rate, "")]


def ratio(ours: float, theirs: float) -> str:
    """ours / theirs, or why not: a short rest can round an idle anchor's figure down to 0."""
    if theirs <= 0:
        return "n/a (dask-kubernetes measured 0)" if ours > 0 else "1.00x (both 0)"
    return f"{ours / theirs:.2f}x"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", type=int, default=10, help="MemoryPolicies, each with its own Deployment")
    parser.add_argument("--workers", type=int, default=2, help="workers per policy (at least 2: one is retired)")
    parser.add_argument("--rest", type=float, default=60, help="seconds measured at rest")
    parser.add_argument("--small", action="store_true", help="2 policies of 2 workers, 10 s at rest (CI)")
    args = parser.parse_args()
    if args.small:
        args.policies, args.workers, args.rest = 2, 2, 10
    if args.workers < 2 or args.policies < 1:
        parser.error("--workers must be at least 2 and --policies at least 1")
    # On SIGTERM (a timeout), unwind through the context managers: they stop the sandbox.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    with benchkit.running_sandbox(1, "--worker-memory", WORKER_MEMORY) as box:
        rows = measure_memops(box, args.policies, args.workers, args.rest)
        progress(
            "memops: "
            + "; ".join(
                f"{label}: {rss:.0f} MiB, {cpu:.1f} CPU s/min, {rate:.0f} req/min" for label, rss, cpu, rate, _ in rows
            )
        )
        anchor = measure_anchor(box, args.policies, args.workers, args.rest)
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
