"""The swap-backed node (``memops sandbox --swap``), on real Nodes: what of a worker may reach swap.

Measured here, on cgroup v1 (this machine's; cgroup v2 is read from the kubelet's source in
``docs/resources.md``, "On a swap-backed node", under shared spill):

- every kubelet finds the swap and reports it (``status.nodeInfo.swap.capacity``);
- a medium-Memory emptyDir, the tmpfs that ``sharedSpill: {medium: Memory}`` gives a worker, is
  mounted ``noswap`` (the kubelet does so on kernels from 6.4): its pages never reach swap;
- the tmpfs of ``medium: Node``, mounted as the chart's node DaemonSet mounts it, is not: the kernel
  may swap its pages out when the node runs short;
- a worker container's memory and swap together are held to its memory limit
  (``memory.memsw.limit_in_bytes`` equal to ``memory.limit_in_bytes``, the kubelet's NoSwap on
  cgroup v1): swap never lets a worker outgrow its limit, whatever its spill is on.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from memops_sandbox import common as sandbox_cli
from memops_sandbox import nodes as real_nodes
from memops_sandbox.nodes import memory_cgroup

from memops.specs.common import parse_quantity
from tests.e2e.conftest import Sandbox
from tests.e2e.test_shared_spill import container_pid, empty_dir, host_tmpfs

SWAP = "1Gi"
LIMIT = "512Mi"
PAGE = os.sysconf("SC_PAGE_SIZE")


@pytest.fixture
def swapped(tmp_path: Path) -> Iterator[Sandbox]:
    state_dir = tmp_path / "swapped"
    args = ["--nodes", "2", "--swap", SWAP, "--no-operator"]
    sandbox = Sandbox(state_dir, sandbox_cli.launch(state_dir, 1, *args, real_nodes=True))
    try:
        yield sandbox
    finally:
        sandbox.stop()


def mount_options(point: Path) -> set[str]:
    """The mount options of the filesystem at ``point``, per-mount and per-superblock together."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4].encode().decode("unicode_escape") == str(point):
            after = fields[fields.index("-") + 1 :]
            return set(fields[5].split(",")) | set(after[2].split(","))
    raise LookupError(f"nothing mounted at {point}")


def spilling_worker(sandbox: Sandbox) -> dict[str, Any]:
    """A worker pod as ``sharedSpill: {medium: Memory}`` makes one: a medium-Memory emptyDir
    ``spill`` for its spill directory, a memory limit of ``LIMIT``."""
    body = copy.deepcopy(sandbox_cli.worker_deployment(sandbox.scheduler_address, 1, image=sandbox_cli.DASK_IMAGE))
    body["metadata"]["name"] = body["spec"]["template"]["metadata"]["labels"]["app"] = "swapped"
    body["metadata"]["labels"] = body["spec"]["selector"]["matchLabels"] = {"app": "swapped"}
    spec = body["spec"]["template"]["spec"]
    [container] = spec["containers"]
    container["resources"] = {"requests": {"memory": LIMIT}, "limits": {"memory": LIMIT}}
    container["volumeMounts"] = [*container.get("volumeMounts", []), {"name": "spill", "mountPath": "/spill"}]
    container["env"] = [*container.get("env", []), {"name": "DASK_TEMPORARY_DIRECTORY", "value": "/spill"}]
    spec["volumes"] = [*spec.get("volumes", []), {"name": "spill", "emptyDir": {"medium": "Memory"}}]
    sandbox.apply(body)

    def running() -> dict[str, Any] | None:
        for pod in sandbox.get("pods", "-l", "app=swapped")["items"]:
            statuses = pod["status"].get("containerStatuses") or []
            if statuses and statuses[0].get("state", {}).get("running"):
                return dict(pod)
        return None

    found: dict[str, Any] = sandbox.wait_for(running, timeout=120, what="the spilling worker running")
    return found


def kernel_has_noswap() -> bool:
    """tmpfs' ``noswap`` option came with Linux 6.4; the kubelet uses it where the kernel has it."""
    major, minor = (int(part) for part in os.uname().release.split(".")[:2])
    return (major, minor) >= (6, 4)


def test_on_a_swap_backed_node_spill_may_reach_swap_and_a_worker_never_outgrows_its_limit(swapped: Sandbox) -> None:
    sandbox = swapped
    for node in sandbox.get("nodes")["items"]:
        capacity = node["status"]["nodeInfo"].get("swap", {}).get("capacity", 0)
        # All of the file but its first page, which holds mkswap's header.
        assert capacity == parse_quantity(SWAP) - PAGE, (node["metadata"]["name"], node["status"]["nodeInfo"])

    pod = spilling_worker(sandbox)
    spill = mount_options(empty_dir(pod, "spill"))
    if kernel_has_noswap():
        assert "noswap" in spill, f"a medium-Memory emptyDir on a swap-backed node: {sorted(spill)}"
    else:
        assert "noswap" not in spill

    with host_tmpfs() as node_tmpfs:
        assert "noswap" not in mount_options(node_tmpfs), "the medium-Node tmpfs may reach swap"

    cgroup = memory_cgroup(container_pid(pod))
    limit = int((cgroup / "memory.limit_in_bytes").read_text())
    assert limit == parse_quantity(LIMIT)
    memsw = cgroup / "memory.memsw.limit_in_bytes"
    assert memsw.exists(), "this machine's cgroup v1 accounts swap (memsw)"
    assert int(memsw.read_text()) == limit, "memory and swap together are held to the container's limit"
    print(
        f"swap-backed node ({SWAP}, kernel {os.uname().release}, cgroup v1): the medium-Memory emptyDir is mounted"
        f" {'noswap' if 'noswap' in spill else 'swappable'}; the medium-Node tmpfs is swappable; a {LIMIT} container's"
        " memory plus swap is held to its limit"
    )

    # The swap file goes with the sandbox, as the kubelets do.
    assert str(real_nodes.SWAP_FILE) in Path("/proc/swaps").read_text()
    sandbox.stop()
    assert str(real_nodes.SWAP_FILE) not in Path("/proc/swaps").read_text()
    assert not real_nodes.SWAP_FILE.exists()
