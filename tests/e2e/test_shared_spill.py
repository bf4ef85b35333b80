"""Shared spill on the sandbox's real Nodes: the webhook gives a worker pod the tmpfs volume and
Dask's configuration, the real worker in its container spills into it, the kernel charges the
tmpfs pages to the pod's cgroup, and what cannot work is refused where the user sees it.

A medium-Memory emptyDir is the kubelet's own tmpfs, under the Node's kubelet root directory. The
``Node`` medium's host path is a tmpfs that the chart's node DaemonSet mounts on each selected node;
here :func:`host_tmpfs` mounts it, as that DaemonSet's init container does. The sandbox's Nodes
are kubelets of one machine, and so share its mounts: that one tmpfs is every Node's.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import distributed
from memops_sandbox import common as sandbox_cli
from memops_sandbox import dask_direct
from memops_sandbox import nodes as real_nodes

from memops.decisions import shared_spill
from tests.e2e.conftest import SPILL_ROOT, SPILL_ROOTS, Sandbox
from tests.e2e.test_policy import condition, memory_policy
from tests.e2e.test_real_nodes import cgroup_limit, memory_stat, mount_type

HOST_PATH = SPILL_ROOT  # the one host directory that the sandbox's operator allows
SWAP_LABEL = "feature.node.kubernetes.io/memory-swap.enabled"
MIB = 2**20


def workers(
    scheduler_address: str,
    name: str,
    *,
    limit: str = "1Gi",
    request: str = "512Mi",
    dask_limit: str = "512MiB",
    cpu_request: str = "100m",
) -> dict[str, Any]:
    """The sandbox's worker Deployment under another name, with a memory limit (and request) and
    Dask's own --memory-limit, as users write them (a Node of this machine has its two cores)."""
    deployment = copy.deepcopy(
        sandbox_cli.worker_deployment(scheduler_address, replicas=0, memory_limit=dask_limit, namespace=None)
    )
    deployment["metadata"] = {"name": name, "labels": {"app": name}}
    deployment["spec"]["selector"] = {"matchLabels": {"app": name}}
    template = deployment["spec"]["template"]
    template["metadata"] = {"labels": {"app": name}}
    template["spec"]["containers"][0]["resources"] = {
        "requests": {"memory": request, "cpu": cpu_request},
        "limits": {"memory": limit, "cpu": "1"},
    }
    return deployment


def running_pods(sandbox: Sandbox, app: str, count: int) -> list[dict[str, Any]]:
    def found() -> list[dict[str, Any]] | None:
        items = sandbox.get("pods", "-l", f"app={app}")["items"]
        running = [p for p in items if (p.get("status") or {}).get("phase") == "Running"]
        return running if len(running) == count else None

    pods: list[dict[str, Any]] = sandbox.wait_for(found, timeout=120, what=f"{count} running pods of {app}")
    return pods


def node_tmpfs(sandbox: Sandbox, node: str) -> Path:
    """The node agent's tmpfs of ``node`` (its Nodes only)."""
    return Path(sandbox.get("node", node)["metadata"]["annotations"]["memops.dev/tmpfs-dir"])


@contextlib.contextmanager
def host_tmpfs(path: str = HOST_PATH, mode: int = 0o2770) -> Iterator[Path]:
    """What the chart's node DaemonSet does on a selected node: a tmpfs at ``path`` (nosuid, nodev,
    noexec, without noswap), its root's mode set after the mount; unmounted and removed on exit."""
    root = Path(path)
    made = not root.exists()
    root.mkdir(parents=True, exist_ok=True)
    options = f"size=2g,mode={mode:o},nosuid,nodev,noexec"
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "memops-spill", str(root)], check=True)
    try:
        root.chmod(mode)
        yield root
    finally:
        subprocess.run(["umount", "-l", str(root)], check=False)
        if made:
            with contextlib.suppress(OSError):
                root.rmdir()
                root.parent.rmdir()  # /var/lib/memops, when this made it


def empty_dir(pod: dict[str, Any], volume: str) -> Path:
    """Where the kubelet of the pod's Node made its emptyDir ``volume``."""
    node, uid = pod["spec"]["nodeName"], pod["metadata"]["uid"]
    return real_nodes.DISK_ROOT / node / "pods" / uid / "volumes" / "kubernetes.io~empty-dir" / volume


def container_pid(pod: dict[str, Any]) -> int:
    [status] = pod["status"]["containerStatuses"]
    return real_nodes.container_pid(status["containerID"])


def spilled_files(root: Path) -> list[Path]:
    """What distributed spilled under a temporary-directory: ``dask-scratch-space/worker-*/storage/*``."""
    return [p for p in root.glob("dask-scratch-space/worker-*/storage/*") if p.is_file()]


def ready(sandbox: Sandbox, policy: str, kind: str, status: str) -> dict[str, Any]:
    found: dict[str, Any] = sandbox.wait_for(
        lambda: (c := condition(sandbox, policy, kind)) and c["status"] == status and c, what=f"{kind} {status}"
    )
    return found


def fill(
    client: distributed.Client, address: str, pieces: int = 16, nbytes: int = 20 * MIB, first: int = 0
) -> list[Any]:
    """Scatter ``pieces`` arrays of ``nbytes`` to one worker, one at a time as a computation would
    make them (all at once, the message alone could pass the nanny's terminate threshold): 320Mi
    is over the worker's target (0.523 of 512Mi, 268Mi), so the worker spills. Pieces are named by
    their content: ``first`` keeps two workers' pieces apart."""
    futures = []
    for i in range(pieces):
        futures.append(client.scatter(bytes([first + i]) * nbytes, workers=[address]))
    return futures


def spill_figures(sandbox: Sandbox, policy: str, field: str) -> dict[str, Any]:
    """The policy's ``status.sharedSpill`` once its ``field`` is above 0 (the workers are read every 30 s)."""
    found: dict[str, Any] = sandbox.wait_for(
        lambda: (
            (seen := sandbox.get("mempol", policy).get("status", {}).get("sharedSpill")) and seen[field] > 0 and seen
        ),
        timeout=90,
        what=f"status.sharedSpill.{field}",
    )
    return found


def worker_of(client: distributed.Client, pod: str) -> tuple[str, dict[str, Any]]:
    for address, info in client.scheduler_info(n_workers=-1)["workers"].items():
        if info.get("name") == pod:
            return address, info
    raise AssertionError(f"no worker named {pod}")


def test_memory_medium_worker_spills_into_its_pods_tmpfs(sandbox_factory: Any) -> None:
    sandbox: Sandbox = sandbox_factory(1)
    sandbox.apply(workers(sandbox.scheduler_address, "spill"))
    sandbox.apply(
        memory_policy(
            "spill", sandbox.scheduler_address, workload="spill", sharedSpill={"medium": "Memory", "sizeLimit": "600Mi"}
        )
    )
    # L = 1Gi, S = 600Mi, M = 512MiB: RSS must stay under 424Mi, so terminate 0.95 -> 0.828.
    message = ready(sandbox, "spill", shared_spill.READY, "True")["message"]
    assert "scaled by 0.872" in message, message
    sandbox.kubectl("scale", "deployment/spill", "--replicas=1")
    (pod,) = running_pods(sandbox, "spill", 1)
    name = pod["metadata"]["name"]

    # What the webhook gave the pod; the Deployment is unchanged.
    assert pod["metadata"]["annotations"][shared_spill.ANNOTATION] == "Memory"
    assert {"name": "memops-spill", "emptyDir": {"medium": "Memory", "sizeLimit": "600Mi"}} in pod["spec"]["volumes"]
    container = pod["spec"]["containers"][0]
    assert {"name": "memops-spill", "mountPath": shared_spill.MOUNT_PATH} in container["volumeMounts"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["DASK_TEMPORARY_DIRECTORY"] == shared_spill.MOUNT_PATH
    assert env["DASK_DISTRIBUTED__WORKER__MEMORY__TARGET"] == "0.523"
    assert env["DASK_DISTRIBUTED__WORKER__MEMORY__TERMINATE"] == "0.828"
    template = sandbox.get("deployment", "spill")["spec"]["template"]["spec"]
    assert "volumes" not in template, "GitOps sees no drift: the Deployment is not changed"

    # The kubelet's emptyDir of medium Memory: a tmpfs of its own, under the Node's kubelet root.
    volume = empty_dir(pod, "memops-spill")
    assert mount_type(volume) == "tmpfs", volume
    pid = container_pid(pod)
    before = memory_stat(pid)
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        address, info = sandbox.wait_for(lambda: _connected(client, name), what="the worker")
        assert info["memory_limit"] == 512 * MIB
        # The container's path of the volume: the worker spills where the pod mounts it.
        assert Path(info["local_directory"]).is_relative_to(shared_spill.MOUNT_PATH), info["local_directory"]
        futures = fill(client, address)
        files = sandbox.wait_for(lambda: spilled_files(volume), what="spilled files in the tmpfs volume")
        spilled = sandbox.wait_for(
            lambda: (n := sum(f.stat().st_size for f in spilled_files(volume))) >= 40 * MIB and n,
            what="40 MiB spilled",
        )
        # The kernel charges the tmpfs pages to the pod's container: its cgroup's shmem holds
        # what was spilled (a page or so more per file), and it was nothing before.
        after = memory_stat(pid)
        assert before["shmem"] < MIB, before
        assert after["shmem"] >= spilled - len(files) * 4096, (after["shmem"], spilled)
        # memops' arithmetic against the kernel's accounting: the spill within sizeLimit, the
        # processes' memory and the spill together within the limit, and the cgroup's peak under it.
        assert cgroup_limit(pid) == 2**30
        assert after["shmem"] <= 600 * MIB, after
        assert after["anon"] + after["shmem"] < 2**30 and after["peak"] < 2**30, after
        # Still there: spilled, not lost, and read back from the tmpfs.
        assert client.gather(futures[0]) == bytes(20 * MIB)
        assert client.gather(futures[-1])[:3] == bytes([15, 15, 15])
        del futures
    [status] = sandbox.get("pod", name)["status"]["containerStatuses"]
    assert status["restartCount"] == 0, status
    sandbox.kubectl("scale", "deployment/spill", "--replicas=0")
    sandbox.wait_for(lambda: not volume.exists(), what="the emptyDir removed with its pod")


def _connected(client: distributed.Client, pod: str) -> tuple[str, dict[str, Any]] | None:
    try:
        return worker_of(client, pod)
    except AssertionError:
        return None


def test_node_medium_workers_share_the_nodes_tmpfs_and_refusals(sandbox_factory: Any) -> None:
    sandbox: Sandbox = sandbox_factory(1)
    nodes = sorted(n["metadata"]["name"] for n in sandbox.get("nodes")["items"])
    swap_node = nodes[-1]
    sandbox.kubectl("label", "node", swap_node, f"{SWAP_LABEL}=true")
    try:
        with host_tmpfs() as host_dir:
            _node_medium(sandbox, swap_node, host_dir)
    finally:  # the Node is the session's
        sandbox.kubectl("label", "node", swap_node, f"{SWAP_LABEL}-")


def same_node_fetch_by_link(
    sandbox: Sandbox, client: distributed.Client, addresses: list[str], held: list[Any]
) -> None:
    """A task on the second worker reads a key that the first spilled (of ``held``, the first's):
    the task read the right bytes, the first sent a header of a few hundred bytes for it, by link,
    and the two workers' plugins, as the operator reads them, count the key sent and received; the
    policy's ``SharedSpillLinks`` says every worker took the plugin. (The receiver reads the key
    back into memory for the task, which removes its link: the shared inode is shown in
    ``tests/scheduler/test_links.py``, with a worker that keeps it spilled.)"""
    sender, receiver = addresses
    condition_ = ready(sandbox, "shared", shared_spill.LINKS, "True")
    assert condition_["reason"] == "Active", condition_

    # Nested, so that they go by value: the workers cannot import the tests.
    def spilled(dask_worker: Any) -> list[str]:
        return [str(k) for k in dask_worker.data.slow.data.d.filenames]

    def outgoing(dask_worker: Any) -> list[dict[str, Any]]:
        return [
            {
                "keys": [str(k) for k in e["keys"]],
                "linked": [str(k) for k in e.get("linked", ())],
                "written": e["compressed"],
            }
            for e in dask_worker.transfer_outgoing_log
        ]

    def first_byte(value: bytes) -> int:
        return value[0]

    async def verdicts() -> dict[str, Any]:
        async with dask_direct.connect(sandbox.scheduler_address) as scheduler:
            return await scheduler.install_links(report=True)

    on_disk = set(client.run(spilled, workers=[sender])[sender])
    future = next(f for f in held if str(f.key) in on_disk)
    key = str(future.key)
    task = client.submit(first_byte, future, workers=[receiver], allow_other_workers=False, pure=False)
    assert task.result() == client.gather(future)[0]
    [transfer] = [t for t in client.run(outgoing, workers=[sender])[sender] if key in t["linked"]]
    assert key not in transfer["keys"] and transfer["written"] < 4096, transfer
    found = asyncio.run(verdicts())
    assert found[sender]["keysSent"] >= 1 and found[receiver]["keysReceived"] >= 1, found


def _node_medium(sandbox: Sandbox, swap_node: str, host_dir: Path) -> None:

    # Refused at apply, by the CRD's schema, naming the field.
    refused = sandbox.apply(
        memory_policy("nohost", sandbox.scheduler_address, sharedSpill={"medium": "Node", "sizeLimit": "1Gi"}),
        check=False,
    )
    assert refused.returncode != 0 and "sharedSpill.hostPath is required for medium Node" in refused.stderr
    hostile = sandbox.apply(
        memory_policy(
            "etc",
            sandbox.scheduler_address,
            sharedSpill={"medium": "Node", "sizeLimit": "1Gi", "hostPath": "/etc/kubernetes"},
        ),
        check=False,
    )
    assert hostile.returncode != 0 and "spec.sharedSpill.hostPath" in hostile.stderr, hostile.stderr
    bad_label = sandbox.apply(
        memory_policy(
            "label",
            sandbox.scheduler_address,
            sharedSpill={"medium": "Node", "sizeLimit": "1Gi", "hostPath": HOST_PATH, "nodeSelector": {"-x-": "true"}},
        ),
        check=False,
    )
    assert bad_label.returncode != 0 and "spec.sharedSpill.nodeSelector" in bad_label.stderr, bad_label.stderr

    spill = {"medium": "Node", "sizeLimit": "600Mi", "hostPath": HOST_PATH, "nodeSelector": {SWAP_LABEL: "true"}}
    sandbox.apply(workers(sandbox.scheduler_address, "shared"))
    sandbox.apply(memory_policy("shared", sandbox.scheduler_address, workload="shared", sharedSpill=spill))
    ready(sandbox, "shared", shared_spill.READY, "True")
    assert ready(sandbox, "shared", shared_spill.SWAPPABLE, "True")["reason"] == "Burstable"
    sandbox.kubectl("scale", "deployment/shared", "--replicas=2")
    pods = running_pods(sandbox, "shared", 2)
    assert {p["spec"]["nodeName"] for p in pods} == {swap_node}, "required node affinity to the swap node"
    # Each pod mounts its policy's own directory of the host root, made by the kubelet.
    policy_dir = host_dir / sandbox.namespace / "shared"
    for pod in pods:
        volume = {
            "name": "memops-spill",
            "hostPath": {"path": f"{HOST_PATH}/{sandbox.namespace}/shared", "type": "DirectoryOrCreate"},
        }
        assert volume in pod["spec"]["volumes"]
        mounts = pod["spec"]["containers"][0]["volumeMounts"]
        assert {"name": "memops-spill", "mountPath": shared_spill.MOUNT_PATH} in mounts
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        found = [sandbox.wait_for(lambda p=p: _connected(client, p["metadata"]["name"]), what="a worker") for p in pods]
        futures = [f for n, (address, _) in enumerate(found) for f in fill(client, address, first=100 * n)]
        # Both workers spill into the one directory tree of their policy on the node's tmpfs.
        sandbox.wait_for(
            lambda: len({f.parent.parent for f in spilled_files(policy_dir)}) == 2, what="two workers' spill dirs"
        )
        assert mount_type(host_dir) == "tmpfs"
        assert all(Path(info["local_directory"]).is_relative_to(shared_spill.MOUNT_PATH) for _, info in found)
        same_node_fetch_by_link(sandbox, client, [address for address, _ in found], futures[:16])
        # What the policy's status says the spill holds, each file once (read every 30 s): the
        # three workers of the scheduler (the sandbox's own spills nothing), and the bytes on the tmpfs.
        spill_held = spill_figures(sandbox, "shared", "bytes")
        assert spill_held["workers"] == 3 and 0 < spill_held["bytes"] <= spill_held["bytesCountedPerWorker"], spill_held
        assert spill_held["lastRead"], spill_held
        del futures

    # links: false keeps the tmpfs and says, in the condition, that nothing is linked; with no plugin
    # to ask, the spill's figures go from the status rather than read as an empty tmpfs.
    sandbox.kubectl("patch", "mempol", "shared", "--type=merge", "-p", '{"spec": {"sharedSpill": {"links": false}}}')
    disabled = ready(sandbox, "shared", shared_spill.LINKS, "False")
    assert disabled["reason"] == "Disabled" and "spec.sharedSpill.links" in disabled["message"], disabled
    sandbox.wait_for(lambda: "sharedSpill" not in sandbox.get("mempol", "shared").get("status", {}), what="no figures")

    # Guaranteed pods under the Node medium: injected, and the status warns.
    sandbox.apply(workers(sandbox.scheduler_address, "fixed", request="1Gi", cpu_request="1"))
    sandbox.apply(memory_policy("fixed", sandbox.scheduler_address, workload="fixed", sharedSpill=spill))
    warning = ready(sandbox, "fixed", shared_spill.SWAPPABLE, "False")
    assert warning["reason"] == "NotBurstable" and "Guaranteed" in warning["message"]

    # A host path that the operator was not allowed (its name only starts like the allowed one's):
    # refused in the condition, naming the field and the allowed directory; new pods get no volume.
    elsewhere = {**spill, "hostPath": HOST_PATH + "-other"}
    sandbox.apply(workers(sandbox.scheduler_address, "elsewhere"))
    sandbox.apply(memory_policy("elsewhere", sandbox.scheduler_address, workload="elsewhere", sharedSpill=elsewhere))
    refusal = ready(sandbox, "elsewhere", shared_spill.READY, "False")
    assert refusal["reason"] == "HostPathNotAllowed", refusal
    assert refusal["message"].startswith("spec.sharedSpill.hostPath: "), refusal["message"]
    assert f"must be one of {', '.join(SPILL_ROOTS)};" in refusal["message"], refusal["message"]
    sandbox.kubectl("scale", "deployment/elsewhere", "--replicas=1")
    (pod,) = running_pods(sandbox, "elsewhere", 1)
    assert pod["metadata"]["annotations"][shared_spill.ANNOTATION] == "Refused: HostPathNotAllowed"
    assert all(v["name"] != "memops-spill" for v in pod["spec"].get("volumes") or [])
    assert "affinity" not in pod["spec"], "a refused spill adds no node affinity either"

    # A size that cannot fit: the condition names the field, and new pods get the safety net only.
    sandbox.apply(workers(sandbox.scheduler_address, "tight"))
    sandbox.apply(
        memory_policy(
            "tight", sandbox.scheduler_address, workload="tight", sharedSpill={"medium": "Memory", "sizeLimit": "1Gi"}
        )
    )
    refusal = ready(sandbox, "tight", shared_spill.READY, "False")
    assert refusal["reason"] == "DoesNotFit" and refusal["message"].startswith("spec.sharedSpill.sizeLimit")
    assert refusal["observedGeneration"] == sandbox.get("mempol", "tight")["metadata"]["generation"]
    sandbox.kubectl("scale", "deployment/tight", "--replicas=1")
    (pod,) = running_pods(sandbox, "tight", 1)
    assert pod["metadata"]["annotations"][shared_spill.ANNOTATION] == "Refused: DoesNotFit"
    assert pod["metadata"]["annotations"]["memops.dev/safety-net"] == "tight"
    assert "volumes" not in pod["spec"] or all(v["name"] != "memops-spill" for v in pod["spec"]["volumes"])
