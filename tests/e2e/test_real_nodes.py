"""The sandbox's real Nodes: pods are containers under a kubelet, whose memory limits the kernel
enforces and Dask reads from the container's cgroup, as on a cluster."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import distributed
import pytest
from memops_sandbox import common as sandbox_cli
from memops_sandbox import mountinfo, node_mounts
from memops_sandbox import nodes as real_nodes
from memops_sandbox.nodes import memory_cgroup

from tests.e2e.conftest import Sandbox
from tests.e2e.data import scatter_unique

MiB = 2**20


def cgroup_limit(pid: int) -> int:
    """The memory limit of the cgroup that ``pid`` is in."""
    cgroup = memory_cgroup(pid)
    if (cgroup / "memory.limit_in_bytes").exists():
        return int((cgroup / "memory.limit_in_bytes").read_text())
    return int((cgroup / "memory.max").read_text())


def memory_stat(pid: int) -> dict[str, int]:
    """What the kernel charges to the cgroup that ``pid`` is in (:func:`real_nodes.memory_stat`)."""
    return real_nodes.memory_stat(memory_cgroup(pid))


def mount_type(point: Path) -> str | None:
    """The filesystem type mounted at ``point`` on this machine, or None."""
    found = mountinfo.at(point)
    return found.fstype if found is not None else None


def hog_pod(name: str, limit: str, size: int) -> dict[str, Any]:
    """A pod whose one process allocates ``size`` bytes and then sleeps, under ``limit``."""
    program = f"import time; hog = bytearray({size}); hog[::4096] = b'x' * len(hog[::4096]); time.sleep(3600)"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "hog",
                    "image": sandbox_cli.DASK_IMAGE,
                    "command": ["python", "-c", program],
                    "resources": {"limits": {"memory": limit}},
                }
            ],
        },
    }


def test_the_kernel_kills_a_container_over_its_limit(real_sandbox: Sandbox) -> None:
    """A process that touches more than its container's limit is killed by the kernel's OOM killer,
    and the kubelet says so: ``OOMKilled``, exit code 137. One under its limit keeps running."""
    sandbox = real_sandbox
    sandbox.apply(hog_pod("over", "64Mi", 128 * MiB))
    sandbox.apply(hog_pod("under", "256Mi", 64 * MiB))

    def terminated(pod: str) -> dict[str, Any] | None:
        statuses = sandbox.get("pod", pod).get("status", {}).get("containerStatuses") or [{}]
        found: dict[str, Any] | None = statuses[0].get("state", {}).get("terminated")
        return found

    state = sandbox.wait_for(lambda: terminated("over"), what="the hog over its limit killed")
    assert state["reason"] == "OOMKilled" and state["exitCode"] == 137, state
    running = sandbox.wait_for(
        lambda: (pod := sandbox.get("pod", "under"))["status"].get("phase") == "Running" and pod,
        what="the hog under its limit running",
    )
    # Running is its start, before it allocated: what proves it survived its allocation is the
    # kernel charging it to the container, with the container still the same one.
    [status] = running["status"]["containerStatuses"]
    pid = real_nodes.container_pid(status["containerID"])
    sandbox.wait_for(lambda: memory_stat(pid)["anon"] >= 64 * MiB, what="the hog under its limit allocated")
    [after] = sandbox.get("pod", "under")["status"]["containerStatuses"]
    assert terminated("under") is None and (after["containerID"], after["restartCount"]) == (status["containerID"], 0)


def test_a_worker_killed_by_the_kernel_loses_its_keys(real_sandbox: Sandbox) -> None:
    """What an enforced limit costs without memops: a worker whose data grows past its container's
    limit (Dask's own memory management off, as ``--memory-limit 0`` does) is OOM-killed by the
    kernel, and the keys only it held are gone."""
    sandbox = real_sandbox
    body = copy.deepcopy(sandbox_cli.worker_deployment(sandbox.scheduler_address, 1, namespace=None))
    body["metadata"]["name"] = body["spec"]["template"]["metadata"]["labels"]["app"] = "tight"
    body["metadata"]["labels"] = body["spec"]["selector"]["matchLabels"] = {"app": "tight"}
    [container] = body["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    args[args.index("--memory-limit") + 1] = "0"
    container["args"] = [*args, "--no-nanny"]
    container["resources"] = {"limits": {"memory": str(192 * MiB)}}
    sandbox.apply(body)
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        client.wait_for_workers(5, timeout=120)
        [pod] = [p["metadata"]["name"] for p in sandbox.get("pods", "-l", "app=tight")["items"]]
        holdings = scatter_unique(client, {pod: 4}, size=MiB)
        address = {str(w["name"]): a for a, w in client.scheduler_info(n_workers=-1)["workers"].items()}[pod]

        def grow(size: int) -> int:
            import numpy as np  # a buffer of touched pages: counted by the kernel at once

            return int(np.ones(size, dtype=np.uint8).sum())

        client.submit(grow, 256 * MiB, workers=[address], pure=False)

        def last_state() -> dict[str, Any] | None:
            [status] = sandbox.get("pod", pod)["status"]["containerStatuses"]
            found: dict[str, Any] | None = status.get("lastState", {}).get("terminated")
            return found

        killed = sandbox.wait_for(last_state, what=f"{pod}'s container OOM-killed")
        assert killed["reason"] == "OOMKilled", killed
        mine = sorted(holdings.keys_of(pod))
        sandbox.wait_for(lambda: sorted(holdings.lost()) == mine, what="its keys gone with it")


def pod_networks() -> set[str]:
    """The machine's veth interfaces (a pod's is one end of a pair, the other in its network
    namespace) and the network namespaces mounted where CNI runtimes mount them by default."""
    listed = subprocess.run(["ip", "-o", "link", "show", "type", "veth"], capture_output=True, text=True, check=True)
    found = {"veth " + line.split(":")[1].strip().split("@")[0] for line in listed.stdout.splitlines()}
    return found | {f"netns {path.name}" for path in Path("/run/netns").glob("*")}


def leftovers(before: frozenset[str] = frozenset()) -> dict[str, Any]:
    """What a sandbox with real Nodes makes on this machine and must take away again (``before``:
    :func:`pod_networks` before it started, someone else's)."""
    processes = [
        pid for pid in real_nodes._processes_mentioning(str(real_nodes.RUN_ROOT)) if Path(f"/proc/{pid}").exists()
    ]
    bridges = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True, check=True).stdout
    nat = subprocess.run(["iptables", "-t", "nat", "-S"], capture_output=True, text=True, check=True).stdout
    found = {
        "processes": processes,
        "bridges": [line.split()[0] for line in bridges.splitlines() if line.startswith(real_nodes.PREFIX)],
        "cgroups": [str(h) for h in real_nodes.made_hierarchies() if (h / real_nodes.CGROUP_PARENT).exists()],
        "directories": [str(d) for d in (real_nodes.RUN_ROOT, real_nodes.DISK_ROOT) if d.exists()],
        "mounts": [
            m.line for m in mountinfo.mounts() if "memops-sandbox" in m.line or m.point == str(node_mounts.HOST_MOUNTS)
        ],
        "services": [line for line in nat.splitlines() if line.startswith("-N KUBE-SERVICES")],
        "pod networks": sorted(pod_networks() - before),
    }
    return {what: items for what, items in found.items() if items}


@pytest.mark.owns_cluster("it crashes a sandbox and counts what is left on the machine")
def test_a_crash_is_cleaned_up_by_the_next_start_and_a_stop_leaves_nothing(tmp_path: Path) -> None:
    """SIGKILL to the sandbox leaves containers, shims, mounts, cgroups and bridges behind (the
    shims outlive it, as they outlive containerd): the next start removes them and comes up. Its
    stop by SIGTERM is bounded, and leaves nothing of either."""
    first = tmp_path / "first"
    before = frozenset(pod_networks())
    crashed = sandbox_cli.launch(first, 1, real_nodes=True)
    os.killpg(crashed.pid, signal.SIGKILL)
    crashed.wait(10)
    assert leftovers(), "a SIGKILL leaves something behind"
    second = tmp_path / "second"
    process = sandbox_cli.launch(second, 1, real_nodes=True)
    began = time.monotonic()
    process.send_signal(signal.SIGTERM)
    process.wait(60)
    assert time.monotonic() - began < 30, "the stop is bounded"
    assert leftovers(before) == {}
