"""What every benchmark needs: a running ``memops sandbox``, ``kubectl`` against it, its workers, and
the median time of a call."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cloudpickle
import distributed
import psutil
import yaml
from distributed.diagnostics.plugin import SchedulerPlugin
from memops_sandbox import common as sandbox
from memops_sandbox import install
from memops_sandbox import nodes as real_nodes

from memops import specs

CONTROL_PLANE = {"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler"}
NODES = {"kubelet", "containerd", "kube-proxy"}
OPERATOR = "app.kubernetes.io/component=operator"


@dataclass(frozen=True)
class Sandbox:
    state: Path
    env: dict[str, str]  # KUBECONFIG and a private kubectl cache
    address: str  # the Dask scheduler's
    pid: int = 0  # the sandbox process (and, on the node agent's Nodes, the agent)
    real_nodes: bool = True

    def pod_pid(self, selector: str, namespace: str = "default") -> int:
        """The host pid of the first container of the first pod that ``selector`` matches, on
        real Nodes (a process of the node agent's pod writes its pid file instead)."""
        pods = json.loads(kubectl(self.env, "get", "pods", "-n", namespace, "-l", selector, "-o", "json"))["items"]
        running = [
            p for p in pods if p["status"].get("containerStatuses") and not p["metadata"].get("deletionTimestamp")
        ]
        return real_nodes.container_pid(running[0]["status"]["containerStatuses"][0]["containerID"])

    def operator_pid(self) -> int:
        if self.real_nodes:
            return self.pod_pid(OPERATOR, install.NAMESPACE)
        return int((self.state / "operator.pid").read_text())

    def control_plane_cpu(self) -> float:
        """CPU seconds used so far by the control plane (etcd, kube-apiserver, controller-manager,
        scheduler), the Nodes (kubelets, containerds, kube-proxy; or the node agent) and the
        operator (its container's processes on real Nodes): what runs besides Dask on the same cores."""
        processes: list[psutil.Process] = []
        with contextlib.suppress(psutil.NoSuchProcess):
            root = psutil.Process(self.pid)
            for process in [root, *root.children(recursive=True)]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    command = process.cmdline()
                    name = Path(command[0]).name if command else ""
                    # The node agent runs in the sandbox process, and runs `memops run` as a child.
                    agent = not self.real_nodes and (process is root or "run" in command[1:3])
                    if agent or name in CONTROL_PLANE or name in NODES:
                        processes.append(process)
        if self.real_nodes:
            with contextlib.suppress(psutil.NoSuchProcess, LookupError, IndexError):
                operator = psutil.Process(self.operator_pid())
                processes += [operator, *operator.children(recursive=True)]
        total = 0.0
        for process in processes:
            with contextlib.suppress(psutil.NoSuchProcess):
                times = process.cpu_times()
                total += times.user + times.system
        return total


@contextlib.contextmanager
def running_sandbox(workers: int, *args: str, real_nodes: bool = True) -> Iterator[Sandbox]:
    """A sandbox on real Nodes (kubelets, containers with memory limits), or with
    ``real_nodes=False`` on the process node agent's, for the one benchmark that reads its
    processes' own pids (py-spy)."""
    state = Path(tempfile.mkdtemp(prefix="memops-bench-")) / "sandbox"
    process = sandbox.launch(state, workers, *args, real_nodes=real_nodes)
    try:
        env = {**os.environ, "KUBECONFIG": str(state / "kubeconfig"), "KUBECACHEDIR": str(state / "kubecache")}
        address = (state / "scheduler-address").read_text().strip()
        yield Sandbox(state, env, address, process.pid, real_nodes)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(120)


def created_at(box: Sandbox, resource: str, name: str, namespace: str = "default") -> float:
    """When the API server completed the create of ``resource`` ``name`` (epoch seconds, from its
    audit log's ``stageTimestamp``): the moment its watchers are sent the ADDED event."""
    for line in (box.state / "audit.log").read_text().splitlines():
        event = json.loads(line)
        ref = event.get("objectRef") or {}
        if (
            event.get("verb") == "create"
            and event.get("stage") == "ResponseComplete"
            and (ref.get("resource"), ref.get("name"), ref.get("namespace")) == (resource, name, namespace)
            and (event.get("responseStatus") or {}).get("code") == 201
        ):
            return datetime.datetime.fromisoformat(event["stageTimestamp"]).timestamp()
    raise LookupError(f"no create of {resource} {namespace}/{name} in the audit log")


def kubectl(env: dict[str, str], *args: str, stdin: str | None = None) -> str:
    kubectl_bin = str(Path(sys.executable).parent / "kubectl")
    return subprocess.run([kubectl_bin, *args], input=stdin, env=env, check=True, capture_output=True, text=True).stdout


def memory_policy(
    name: str, address: str, *, workload: str = "dask-worker", namespace: str = "default", **spec: Any
) -> dict[str, Any]:
    """A MemoryPolicy of the Deployment ``workload``, whose workers are the Dask scheduler's at
    ``address``; ``spec``: the rest of its spec (``replicas``, ``drain``, ``pressure``, ...)."""
    return {
        "apiVersion": specs.API_VERSION,
        "kind": "MemoryPolicy",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"scheduler": {"address": address}, "workload": {"kind": "Deployment", "name": workload}, **spec},
    }


def apply_policy(box: Sandbox, name: str, **spec: Any) -> dict[str, Any]:
    """``kubectl apply`` a MemoryPolicy of the sandbox's worker Deployment (:func:`memory_policy`);
    returns what was applied."""
    policy = memory_policy(name, box.address, **spec)
    kubectl(box.env, "apply", "-f", "-", stdin=yaml.safe_dump(policy))
    return policy


SPREAD_OVER_NODES: dict[str, Any] = {
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
"""Pod spec fields that spread the worker Deployment's pods evenly over the Nodes, as a rule:
kube-scheduler's own spreading is only a preference, and on a busy machine it may put every pod on one."""


def spread_over_nodes(box: Sandbox, **pod_spec: Any) -> None:
    """Patch the sandbox's worker Deployment (a rollout) so that its pods spread evenly over the
    Nodes; ``pod_spec``: more of the template's pod spec in the same patch (strategic merge, so a
    container is merged by its name)."""
    patch = {"spec": {"template": {"spec": {**SPREAD_OVER_NODES, **pod_spec}}}}
    kubectl(box.env, "patch", "deployment/dask-worker", "--type=strategic", "-p", json.dumps(patch))


def median_ms(call: Callable[[], object], runs: int = 3) -> float:
    """The median of ``runs`` timed calls of ``call``, in milliseconds."""
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        call()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def workers(client: distributed.Client) -> dict[str, str]:
    """Worker name (the pod's name) -> Dask address."""
    return {str(i["name"]): a for a, i in client.scheduler_info(n_workers=-1)["workers"].items()}


class ComputeCounter(SchedulerPlugin):
    """Counts, in the scheduler, how often each key with a prefix reaches memory.

    A plugin and not the scheduler's ``transition_log``: that log keeps only the last
    ``distributed.admin.low-level-log-length`` transitions, which a busy run overflows.
    """

    name = "memops-bench-compute-counter"

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.counts: Counter[str] = Counter()

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        if finish == "memory" and str(key).startswith(self.prefix):
            self.counts[str(key)] += 1


def _counts(dask_scheduler: Any = None) -> dict[str, int]:
    return dict(dask_scheduler.plugins[ComputeCounter.name].counts)


def count_computations(client: distributed.Client, prefix: str) -> None:
    """From now on, count how often each key starting with ``prefix`` is computed."""
    # This module is not importable on the scheduler: send the plugin by value.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    client.register_plugin(ComputeCounter(prefix))


def recomputed(client: distributed.Client) -> int:
    """Tasks counted by :func:`count_computations` that reached memory more than once."""
    counts = client.run_on_scheduler(_counts)
    return sum(count - 1 for count in counts.values() if count > 1)
