"""The shared spill and the zero-copy hand-over together, on the sandbox's real Nodes.

A MemoryPolicy gives a worker Deployment the ``Node`` medium of ``sharedSpill``; its workers run
on both Nodes, two on one. Each Node has a mount namespace of its own, and each its own tmpfs at
the host path (mounted in that Node's namespace, as the chart's node DaemonSet mounts one on each
node). One worker spills most of its data and an ordinary RetirementRequest drains it: every key
survives, its spilled keys go to the worker on its own Node by hardlink (the same inode in the
recipient's spill directory, no byte in any worker's transfer log), and the keys it held in memory
go by the normal transfer, some of them to the worker on the other Node. Then the neighbour,
spilled too, retires with the only recipient on the other Node: every key by transfer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import distributed
from memops_sandbox import dask_direct, node_mounts
from memops_sandbox import nodes as real_nodes

from memops.decisions import shared_spill
from tests.e2e.conftest import NODE_SPILL_ROOT, Sandbox, retirement_request
from tests.e2e.test_policy import memory_policy
from tests.e2e.test_shared_spill import MIB, container_pid, fill, ready, running_pods, worker_of, workers

PIECES = 28  # of 20 MiB: 560 MiB on a worker whose Dask memory limit is 512 MiB (target 268 MiB)


@contextmanager
def nodes_tmpfs(names: list[str]) -> Iterator[dict[str, Path]]:
    """A tmpfs of its own at :data:`NODE_SPILL_ROOT` on each Node (its mount namespace): where the
    machine sees each."""
    with ExitStack() as stack:
        options = "size=2g,mode=2770,nosuid,nodev,noexec"
        yield {
            node: stack.enter_context(node_mounts.node_tmpfs(real_nodes.RUN_ROOT, node, NODE_SPILL_ROOT, options))
            for node in names
        }


def spread(deployment: dict[str, Any]) -> dict[str, Any]:
    """The Deployment with its pods spread over the Nodes, at most one apart: three pods are two on
    one Node and one on the other, in the test's own namespace whatever else runs."""
    app = deployment["metadata"]["name"]
    deployment["spec"]["template"]["spec"]["topologySpreadConstraints"] = [
        {
            "maxSkew": 1,
            "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "DoNotSchedule",
            "labelSelector": {"matchLabels": {"app": app}},
        }
    ]
    return deployment


def inodes(directory: Path, pattern: str = "*") -> dict[tuple[int, int], int]:
    """(device, inode) -> size of the files in a worker's spill directory (``pattern``: in a tree).
    The device too: each Node's tmpfs numbers its inodes from the start."""
    found: dict[tuple[int, int], int] = {}
    for path in directory.glob(pattern):
        try:
            st = path.stat()
        except FileNotFoundError:  # unspilled meanwhile
            continue
        found[st.st_dev, st.st_ino] = st.st_size
    return found


def test_a_retirement_links_spilled_keys_to_the_node_neighbour_and_sends_the_rest(sandbox_factory: Any) -> None:
    sandbox: Sandbox = sandbox_factory(1)
    sandbox.kubectl("scale", "deployment/dask-worker", "--replicas=0")  # no recipient but the policy's
    names = sorted(n["metadata"]["name"] for n in sandbox.get("nodes")["items"])[:2]
    with nodes_tmpfs(names) as node_dirs:
        handover(sandbox, node_dirs)


def handover(sandbox: Sandbox, node_dirs: dict[str, Path]) -> None:
    spill = {"medium": "Node", "sizeLimit": "600Mi", "hostPath": NODE_SPILL_ROOT}
    sandbox.apply(spread(workers(sandbox.scheduler_address, "shared")))
    sandbox.apply(memory_policy("shared", sandbox.scheduler_address, workload="shared", sharedSpill=spill))
    ready(sandbox, "shared", shared_spill.READY, "True")
    sandbox.kubectl("scale", "deployment/shared", "--replicas=3")
    placed = running_pods(sandbox, "shared", 3)
    pods = {p["metadata"]["name"]: p["spec"]["nodeName"] for p in placed}
    (near,) = [n for n in node_dirs if sum(node == n for node in pods.values()) == 2]
    (far,) = [n for n in node_dirs if n != near]
    drained, neighbour = sorted(p for p, n in pods.items() if n == near)
    (remote,) = [p for p, n in pods.items() if n == far]
    # A worker's spill directory as the machine sees it: through its container's root.
    roots = {p["metadata"]["name"]: Path(f"/proc/{container_pid(p)}/root") for p in placed}
    devices = {node: directory.stat().st_dev for node, directory in node_dirs.items()}
    assert devices[near] != devices[far], "each Node its own tmpfs"

    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        found = {p: sandbox.wait_for(lambda p=p: _connected(client, p), what=f"worker {p}") for p in pods}
        address = {p: a for p, (a, _) in found.items()}
        spill_dir = roots[drained] / Path(found[drained][1]["local_directory"]).relative_to("/") / "storage"
        assert spill_dir.stat().st_dev == devices[near], "the worker spills into its Node's tmpfs"
        futures = fill(client, address[drained], pieces=PIECES)
        sandbox.wait_for(lambda: len(inodes(spill_dir)) >= PIECES // 2, what="spill")
        # The worker goes on spilling until its memory is under its target: the files it holds when
        # the drain starts are those of a spill that has stopped changing.
        before = sandbox.wait_for(lambda: steady(spill_dir), what="the spill to settle")
        print(f"before the drain: {len(before)} of {PIECES} keys spilled on {drained}, {sum(before.values())} bytes")

        sandbox.apply(
            retirement_request(
                "handover",
                scheduler={"address": sandbox.scheduler_address},
                workload={"kind": "Deployment", "name": "shared"},
                workers=[drained],
                timeout="120s",
            )
        )
        request = sandbox.wait_phase("handover", "Succeeded", "Failed", timeout=180)
        assert request["status"]["phase"] == "Succeeded", request["status"]
        (worker,) = request["status"]["workers"]
        assert worker["state"] == "Retired" and worker["keysLost"] == 0 and worker["bytesLost"] == 0, worker

        # The drain's own figures, from the scheduler's agent.
        state = asyncio.run(dask_direct.drain_status(sandbox.scheduler_address, [address[drained]]))[address[drained]]
        keys_linked, bytes_linked = int(state["keysLinked"]), int(state["bytesLinked"])
        keys_moved, bytes_moved = int(state["keysMoved"]), int(state["bytesMoved"])
        assert keys_moved == PIECES, state
        assert keys_linked >= len(before) // 2, ("most spilled keys went by link", state, len(before))
        # What the user sees in the RetirementRequest: the same figures.
        assert (worker["keysLinked"], worker["bytesLinked"]) == (keys_linked, bytes_linked), worker

        # A linked key is the same file: the drained worker's inode, now in
        # the neighbour's spill directory (read before anything reads the keys back, which would
        # unspill them), and none of them on the other node's tmpfs.
        neighbour_dir = roots[neighbour] / Path(found[neighbour][1]["local_directory"]).relative_to("/") / "storage"
        shared = set(inodes(neighbour_dir)) & set(before)
        assert len(shared) == keys_linked, (len(shared), state)
        assert inodes(node_dirs[far], "**/*"), "the other Node's worker has its directory on that Node's tmpfs"
        assert not set(inodes(node_dirs[far], "**/*")) & set(before)
        # The neighbour linked those files, it wrote none of them: the kernel charged their pages to
        # the drained worker's cgroup, and the neighbour reports none of them as its own.
        figures = asyncio.run(spill_shares(sandbox.scheduler_address))[address[neighbour]]
        linked_there = sum(size for inode, size in inodes(neighbour_dir).items() if inode in before)
        assert figures["bytes"] - figures["ownBytes"] >= linked_there > 0, (figures, linked_there)

        # The network's figures, from the recipients' transfer logs: only the keys not linked.
        def received_from(dask_worker: Any, source: str = "") -> list[str]:
            # Defined here, so that it is sent by value: the workers cannot import this module.
            log = dask_worker.transfer_incoming_log
            return [str(key) for entry in log if entry["who"] == source for key in entry["keys"]]

        sent = client.run(received_from, source=address[drained], workers=[address[neighbour], address[remote]])
        over_network = {p: len(sent[address[p]]) for p in (neighbour, remote)}
        print(
            f"drained {drained} ({len(before)} of {PIECES} keys spilled): {keys_moved} keys moved"
            f" ({bytes_moved / MIB:.0f} MiB), {keys_linked} by link ({bytes_linked / MIB:.0f} MiB) to {neighbour}"
            f" on {near}, {sum(over_network.values())} over the network"
            f" ({(bytes_moved - bytes_linked) / MIB:.0f} MiB): {over_network[neighbour]} to {neighbour} on {near},"
            f" {over_network[remote]} to {remote} on {far}; drain {state['seconds']} s"
        )
        assert sum(over_network.values()) == keys_moved - keys_linked, (over_network, state)
        assert over_network[remote] > 0, "keys held in memory went over the network, some to the other node"

        # Zero keys lost: every piece is back, intact, from the workers that stay. One at a time,
        # as a computation reads them: all at once, the holder would unspill more than its memory
        # limit and its nanny would restart it.
        holders = client.who_has(futures)
        assert all(h and set(h) <= {address[neighbour], address[remote]} for h in holders.values()), holders
        for i, future in enumerate(futures):
            value = future.result()
            assert len(value) == 20 * MIB and value[:1] == value[-1:] == bytes([i]), i
            del value
        del futures, future

        # Then the neighbour retires, spilled too, with the only recipient on the other node: every
        # key by the normal transfer, none linked, nothing lost.
        client.wait_for_workers(2)
        sandbox.wait_for(lambda: not client.has_what()[address[remote]], what="the first pieces released")
        futures = fill(client, address[neighbour], first=100)
        sandbox.wait_for(lambda: len(inodes(neighbour_dir)) >= 2, what="the neighbour spilling")
        spilled_there = len(inodes(neighbour_dir))
        sandbox.apply(
            retirement_request(
                "across",
                scheduler={"address": sandbox.scheduler_address},
                workload={"kind": "Deployment", "name": "shared"},
                workers=[neighbour],
                timeout="120s",
            )
        )
        request = sandbox.wait_phase("across", "Succeeded", "Failed", timeout=180)
        (worker,) = request["status"]["workers"]
        assert worker["state"] == "Retired" and worker["keysLost"] == 0, worker
        state = asyncio.run(dask_direct.drain_status(sandbox.scheduler_address, [address[neighbour]]))
        state = state[address[neighbour]]
        sent = client.run(received_from, source=address[neighbour], workers=[address[remote]])
        print(
            f"drained {neighbour} ({spilled_there} of 16 keys spilled) with the only recipient on {far}:"
            f" {state['keysMoved']} keys moved, {state['keysLinked']} by link,"
            f" {len(sent[address[remote]])} over the network; drain {state['seconds']} s"
        )
        # Every key went to the other node by the normal transfer (the drain's, or relief's just
        # before it: a loaded run once saw the drain move 14 of the 16), none linked.
        assert (state["keysLinked"], worker.get("keysLinked", 0)) == (0, 0), state
        assert 0 < state["keysMoved"] <= 16, state
        assert set(sent[address[remote]]) >= {str(f.key) for f in futures}, (sent, state)
        for i, future in enumerate(futures):
            value = future.result()
            assert len(value) == 20 * MIB and value[:1] == value[-1:] == bytes([100 + i]), i
            del value
        del futures


def steady(directory: Path) -> dict[tuple[int, int], int] | None:
    """:func:`inodes` of ``directory`` when a second look, a second later, finds the same files."""
    first = inodes(directory)
    time.sleep(1)
    return first if first and inodes(directory) == first else None


async def spill_shares(address: str) -> dict[str, Any]:
    """Each worker's spill figures, through memops' agent, as the policy pass reads them."""
    async with dask_direct.connect(address) as scheduler:
        return await scheduler.spill_shares()


def _connected(client: distributed.Client, pod: str) -> tuple[str, dict[str, Any]] | None:
    try:
        return worker_of(client, pod)
    except AssertionError:
        return None
