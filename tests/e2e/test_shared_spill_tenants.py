"""Shared spill of medium Node with two tenants on one node: each namespace's policy has its own
directory of the node's tmpfs, and neither tenant's workers reach the other's spilled files.

Two namespaces each have a worker Deployment and a MemoryPolicy, both named ``spill``, with the
``Node`` medium on the same host root; both workers run on one node. What is shown here:

- each pod's spill volume is its own ``<root>/<namespace>/<policy>`` (the hostPath's path, mounted
  without ``subPath``), made as the kubelet's DirectoryOrCreate makes it (0755), and the directory
  its spill mount resolves to is that one, in which it spills;
- a pod that mounts ``memops-spill`` in another container before memops adds the volume is
  refused the spill (it keeps the safety net);
- tenant A's mount holds none of B's files, and no path under A's mount (without ``..``, which the
  kubelet's mount would not let out of it either) reaches B's directory;
- B's workers never load a file that A wrote: A plants a file named like one of B's spill files
  in its own tree, and B's hand-over refuses to link it (it lies outside B's directory), and the
  two workers are never on "one filesystem" for the hand-over;
- each process' share of ``sizeLimit`` is its Dask ``max-spill``.

The workers run in containers under the sandbox's real kubelets: the kubelet bind-mounts only
``<root>/<namespace>/<policy>`` into the container's own mount namespace, so B's directory has no
path in A's container at all, whatever the user or the link. What A's worker can reach is walked
from inside its container, and compared by inode with what is on the node.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import cloudpickle
import distributed

from memops.decisions import shared_spill
from memops.worker import handover
from tests.e2e.conftest import Sandbox
from tests.e2e.test_policy import memory_policy
from tests.e2e.test_shared_spill import (
    HOST_PATH,
    SWAP_LABEL,
    fill,
    host_tmpfs,
    spilled_files,
    worker_of,
    workers,
)

cloudpickle.register_pickle_by_value(handover)  # a stock Dask image: sent by value, as memops sends it
TENANTS = ("tenant-a", "tenant-b")
POLICY = "spill"
SIZE = 600 * 2**20


def _in(namespace: str, manifest: dict[str, Any]) -> dict[str, Any]:
    manifest["metadata"]["namespace"] = namespace
    return manifest


def _running_pod(sandbox: Sandbox, namespace: str) -> dict[str, Any]:
    def found() -> dict[str, Any] | None:
        items = sandbox.get("pods", "-n", namespace, "-l", f"app={POLICY}")["items"]
        running = [p for p in items if (p.get("status") or {}).get("phase") == "Running"]
        return running[0] if len(running) == 1 else None

    pod: dict[str, Any] = sandbox.wait_for(found, timeout=120, what=f"the running pod of {namespace}")
    return pod


def _connected(client: distributed.Client, pod: str) -> tuple[str, dict[str, Any]] | None:
    try:
        return worker_of(client, pod)
    except AssertionError:
        return None


def test_two_namespaces_on_one_node_spill_apart_and_never_reach_each_other(sandbox_factory: Any) -> None:
    sandbox: Sandbox = sandbox_factory(1)
    node = sorted(n["metadata"]["name"] for n in sandbox.get("nodes")["items"])[-1]
    sandbox.kubectl("label", "node", node, f"{SWAP_LABEL}=true")
    try:
        with host_tmpfs(mode=0o2770) as root:
            _two_tenants(sandbox, node, root, [sandbox.make_namespace(tenant) for tenant in TENANTS])
    finally:  # the Node is the session's
        sandbox.kubectl("label", "node", node, f"{SWAP_LABEL}-")


def _two_tenants(sandbox: Sandbox, node: str, root: Path, tenants: list[str]) -> None:
    spill = {"medium": "Node", "sizeLimit": "600Mi", "hostPath": HOST_PATH, "nodeSelector": {SWAP_LABEL: "true"}}
    for tenant in tenants:
        sandbox.kubectl("create", "serviceaccount", "dask-worker", "-n", tenant)
        deployment = _in(tenant, workers(sandbox.scheduler_address, POLICY))
        deployment["spec"]["template"]["spec"]["serviceAccountName"] = "dask-worker"
        sandbox.apply(deployment)
        sandbox.apply(_in(tenant, memory_policy(POLICY, sandbox.scheduler_address, workload=POLICY, sharedSpill=spill)))
    for tenant in tenants:

        def injected(tenant: str = tenant) -> bool:
            status = sandbox.get("mempol", POLICY, "-n", tenant).get("status") or {}
            return any(
                c["type"] == shared_spill.READY and c["status"] == "True" for c in status.get("conditions") or []
            )

        sandbox.wait_for(injected, what=f"{shared_spill.READY} of {tenant}")
        sandbox.kubectl("scale", f"deployment/{POLICY}", "-n", tenant, "--replicas=1")
    pods = {tenant: _running_pod(sandbox, tenant) for tenant in tenants}
    own = {tenant: root / tenant / POLICY for tenant in tenants}
    a, b = tenants

    for tenant, pod in pods.items():
        assert pod["spec"]["nodeName"] == node
        container = pod["spec"]["containers"][0]
        volume = {
            "name": "memops-spill",
            "hostPath": {"path": f"{HOST_PATH}/{tenant}/{POLICY}", "type": "DirectoryOrCreate"},
        }
        assert volume in pod["spec"]["volumes"], pod["spec"]["volumes"]
        mount = {"name": "memops-spill", "mountPath": shared_spill.MOUNT_PATH}
        assert mount in container["volumeMounts"], container["volumeMounts"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env[shared_spill.MAX_SPILL_ENV] == str(SIZE), "one worker process: all of sizeLimit"
        assert own[tenant].is_dir(), "made by the kubelet, when the pod's mount was set up"
        # os.MkdirAll(path, 0755), with the setgid bit that the kernel carries down from the root.
        assert stat.S_IMODE(own[tenant].stat().st_mode) & 0o777 == 0o755, oct(own[tenant].stat().st_mode)

    def mount_of(dask_worker: Any) -> dict[str, Any]:
        # Defined here, so that it is sent by value: the workers cannot import this module.
        import dask

        mount = os.path.realpath(os.environ["DASK_TEMPORARY_DIRECTORY"])
        st = os.stat(mount)
        return {
            "mount": mount,
            "file": [st.st_dev, st.st_ino],
            "max_spill": dask.config.get("distributed.worker.memory.max-spill"),
        }

    def reachable(dask_worker: Any) -> list[list[Any]]:
        """Every path under the worker's spill mount, with its inode: what it can list, read,
        write or delete through its mount."""
        mount = os.environ["DASK_TEMPORARY_DIRECTORY"]
        found = []
        for directory, dirs, files in os.walk(mount, followlinks=True):
            for name in [*dirs, *files]:
                path = os.path.join(directory, name)
                found.append([os.path.realpath(path), os.stat(path).st_ino])
        return found

    def plant(dask_worker: Any, name: str = "") -> list[Any]:
        """What a hostile worker can do in its own tree: a file named like a victim's spill file."""
        directory = os.path.join(str(dask_worker.local_directory), "storage")
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, name)
        with open(path, "wb") as f:
            f.write(b"not the victim's data")
        st = os.stat(path)
        return [directory, st.st_ino, st.st_size]

    def take(dask_worker: Any, directory: str = "", entries: Any = ()) -> Any:
        return handover.take(dask_worker, directory=directory, entries=entries)

    def identity(dask_worker: Any) -> Any:
        return handover.identity(dask_worker)

    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        address = {
            t: sandbox.wait_for(lambda p=p: _connected(client, p["metadata"]["name"]), what=f"the worker of {t}")[0]
            for t, p in pods.items()
        }
        seen = {t: client.run(mount_of, workers=[address[t]])[address[t]] for t in tenants}
        for tenant in tenants:
            # The directory its spill mount is: its own namespace's and policy's, nothing wider.
            assert seen[tenant]["mount"] == shared_spill.MOUNT_PATH, (tenant, seen[tenant])
            host = own[tenant].stat()
            assert seen[tenant]["file"] == [host.st_dev, host.st_ino], (tenant, seen[tenant])
            assert seen[tenant]["max_spill"] == SIZE, seen[tenant]
        futures = [*fill(client, address[b]), *fill(client, address[a], first=100)]
        b_files = sandbox.wait_for(lambda: spilled_files(own[b]), what=f"{b}'s spilled files")
        sandbox.wait_for(lambda: spilled_files(own[a]), what=f"{a}'s spilled files")

        # A's mount: none of B's files, and no path under it is in B's directory.
        under_a = client.run(reachable, workers=[address[a]])[address[a]]
        b_inodes = {f.stat().st_ino for f in b_files} | {own[b].stat().st_ino}
        assert under_a and not b_inodes & {ino for _, ino in under_a}, "A's mount reaches B's files or directory"
        assert all(Path(p).is_relative_to(shared_spill.MOUNT_PATH) for p, _ in under_a), "A's mount leads out of it"
        assert not own[b].is_relative_to(own[a]) and not own[a].is_relative_to(own[b])

        # A plants a file named like B's spill file in its own tree; B's hand-over refuses it.
        victim = b_files[0].name
        directory, ino, size = client.run(plant, name=victim, workers=[address[a]])[address[a]]
        entries = [["planted-by-a", victim, ino, size, size]]
        taken = client.run(take, directory=directory, entries=entries, workers=[address[b]])[address[b]]
        assert taken == [], "B linked a file that A wrote"
        assert not any(p.stat().st_ino == ino for p in spilled_files(own[b])), "A's file is in B's tree"
        assert (
            "planted-by-a"
            not in client.run(lambda dask_worker: list(dask_worker.data), workers=[address[b]])[address[b]]
        )
        # And the scheduler never pairs them for a hand-over: not one spill filesystem.
        ids = {t: client.run(identity, workers=[address[t]])[address[t]] for t in tenants}
        assert ids[a]["inode"] != ids[b]["inode"] and not handover.same_filesystem(ids[a], ids[b]), ids
        assert ids[b]["inode"] == (own[b] / "dask-scratch-space").stat().st_ino, ids[b]
        del futures

    # A's pod that mounts memops' volume in a second container, at B's directory: memops refuses
    # the spill, so the volume is never added and the API server rejects the mount of nothing.
    template = pods[a]["spec"]
    worker = {
        k: template["containers"][0][k]
        for k in ("name", "image", "command", "args", "resources")
        if k in template["containers"][0]
    }
    reader = {"name": "reader", "image": worker["image"], "command": ["sleep", "3600"]}
    reader["volumeMounts"] = [{"name": "memops-spill", "mountPath": "/b", "subPath": f"{b}/{POLICY}"}]
    intruder = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "intruder", "namespace": a, "labels": {"app": POLICY}},
        # Never run: bound to no node, so only what admission does is shown.
        "spec": {"nodeName": "nowhere", "containers": [worker, reader]},
    }
    rejected = sandbox.apply(intruder, check=False)
    assert rejected.returncode != 0 and "memops-spill" in rejected.stderr, (rejected.stdout, rejected.stderr)
    # With a volume of that name of its own: admitted, without memops' volume, and annotated.
    intruder["spec"]["volumes"] = [{"name": "memops-spill", "emptyDir": {}}]
    sandbox.apply(intruder)
    admitted = sandbox.get("pod", "intruder", "-n", a)
    annotation = admitted["metadata"]["annotations"][shared_spill.ANNOTATION]
    assert annotation == f"Refused: {shared_spill.Refusal.VOLUME_NAME_TAKEN}", annotation
    assert admitted["spec"]["volumes"][0] == {"name": "memops-spill", "emptyDir": {}}, admitted["spec"]["volumes"]
    assert not any("hostPath" in v for v in admitted["spec"]["volumes"]), admitted["spec"]["volumes"]
