"""Zero-copy hand-over of spilled keys, on a real scheduler with real worker processes.

The workers spill to a directory under ``/dev/shm`` (a tmpfs, as the ``Node`` medium of
``sharedSpill`` gives them); every key of 1 MiB goes straight to the spill store (the target is
a few KiB). What went over the network is read from the workers' own counters
(``transfer_outgoing_bytes_total``, ``transfer_incoming_log``), what was linked from the files'
inodes and link counts.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import stat
from typing import Any

import pytest
from distributed import Client, LocalCluster
from distributed.protocol.serialize import to_serialize
from memops_sandbox import dask_direct

from memops.scheduler import drain
from memops.worker import accounting, handover
from tests import polling
from tests.scheduler import peers, spilling
from tests.scheduler.spilling import MiB, value

pytestmark = spilling.WORKERS.with_args(setup=lambda cluster: handover.install(cluster.scheduler))


async def spill_files(client: Client, worker: str) -> dict[str, tuple[int, int]]:
    """Key -> (inode, link count) of the worker's spill files."""

    def files(dask_worker: Any) -> dict[str, tuple[int, int]]:
        store = dask_worker.data._slow_uncached.d
        stats = {str(k): os.stat(os.path.join(store.directory, n)) for k, n in store.filenames.items()}
        return {k: (st.st_ino, st.st_nlink) for k, st in stats.items()}

    return dict((await client.run(files, workers=[worker]))[worker])


async def network(client: Client) -> dict[str, tuple[int, int]]:
    """Worker -> (bytes it sent to peers or clients, keys it received from peers)."""

    def counters(dask_worker: Any) -> tuple[int, int]:
        received = sum(len(entry["keys"]) for entry in dask_worker.transfer_incoming_log)
        return int(dask_worker.transfer_outgoing_bytes_total), received

    return dict(await client.run(counters))


async def test_a_spilled_key_is_handed_over_by_a_hardlink(cluster: tuple[LocalCluster, Client]) -> None:
    """The receiver's spill file is the sender's (one inode, two links), the scheduler lists both
    holders, the receiver computes on it with the right bytes, and no byte went over the network;
    once the sender is gone, the receiver's link alone keeps the data."""
    local, client = cluster
    scheduler = local.scheduler
    sender, receiver, _ = sorted(scheduler.workers)
    [future] = await client.scatter([value(1)], workers=[sender])
    key = future.key
    identities = {a: await handover.identify(scheduler, a) for a in (sender, receiver)}
    assert handover.same_filesystem(identities[sender], identities[receiver])
    before = await network(client)

    linked, left = await handover.hand_over(scheduler, sender, receiver, [key], identities[sender]["directory"])

    assert (linked, left) == ([key], [])
    sent, received = (await spill_files(client, sender))[str(key)], (await spill_files(client, receiver))[str(key)]
    assert sent[0] == received[0] and sent[1] == received[1] == 2, "one inode, two links"
    await polling.poll(
        lambda: {ws.address for ws in scheduler.tasks[key].who_has} == {sender, receiver}, timeout=20, interval=0.02
    )
    digest = await client.submit(
        lambda b: hashlib.sha256(b).hexdigest(), future, workers=[receiver], allow_other_workers=False, pure=False
    )
    assert digest == hashlib.sha256(value(1)).hexdigest()
    after = await network(client)
    assert after[sender][0] == before[sender][0], "the sender sent nothing"
    assert after[receiver][1] == before[receiver][1], "the receiver received nothing from a peer"
    await scheduler.retire_workers([sender], close_workers=True)  # the only other holder is the receiver
    await polling.poll(lambda: sender not in scheduler.workers, timeout=20, interval=0.02)
    # The sender's spill directory goes with its process.

    async def one_link() -> bool:
        return (await spill_files(client, receiver))[str(key)][1] == 1

    await polling.poll(one_link, timeout=20, what="the receiver's link alone")
    assert await client.gather(future) == value(1)
    # The receiver linked the file, it did not write it: the kernel charged its pages to the sender's
    # cgroup, and none of them to the receiver's, which reports none of it as its own.
    [report] = (await client.run(lambda dask_worker: accounting.report(dask_worker), workers=[receiver])).values()
    assert report["bytes"] >= len(value(1)) and report["ownBytes"] == 0, report


async def test_a_key_in_memory_goes_by_the_normal_transfer(cluster: tuple[LocalCluster, Client]) -> None:
    local, client = cluster
    scheduler = local.scheduler
    sender, receiver, _ = sorted(scheduler.workers)
    [small] = await client.scatter([b"in memory"], workers=[sender])  # below the target: not spilled
    directory = (await handover.identify(scheduler, sender))["directory"]
    assert await handover.hand_over(scheduler, sender, receiver, [small.key], directory) == ([], [small.key])
    assert str(small.key) not in await spill_files(client, receiver)


async def test_a_receiver_on_another_filesystem_is_refused(cluster: tuple[LocalCluster, Client]) -> None:
    """A worker that spills elsewhere (here a disk directory, not the tmpfs) shares no
    filesystem with the others: its identity says so, and told to link anyway, it refuses."""
    local, client = cluster
    scheduler = local.scheduler
    sender = sorted(scheduler.workers)[0]
    async with spilling.worker_elsewhere(scheduler.address) as far:
        await polling.poll(lambda: far in scheduler.workers, timeout=20, interval=0.02)
        [future] = await client.scatter([value(2)], workers=[sender])
        ident = {a: await handover.identify(scheduler, a) for a in (sender, far)}
        assert ident[far]["directory"] and not handover.same_filesystem(ident[sender], ident[far])
        result = await handover.hand_over(scheduler, sender, far, [future.key], ident[sender]["directory"])
        assert result == ([], [future.key])
        assert str(future.key) not in await spill_files(client, far)


async def test_a_receiver_links_nothing_outside_its_shared_root(
    cluster: tuple[LocalCluster, Client], shm: pathlib.Path
) -> None:
    """The receiver checks what it is told: a file outside its shared root, a '..' detour, a
    symlink, a directory, an inode other than the one offered are all refused."""
    local, client = cluster
    scheduler = local.scheduler
    sender, receiver, _ = sorted(scheduler.workers)
    [future] = await client.scatter([value(3)], workers=[sender])
    directory = (await handover.identify(scheduler, sender))["directory"]
    [[name, ino, size]] = await handover.call(scheduler, sender, "offer", keys=[future.key])
    outside = os.path.join(shm, "outside")
    os.makedirs(outside)
    pathlib.Path(outside, "f").write_bytes(b"x")
    link_dir = os.path.join(os.path.dirname(os.path.dirname(directory)), "sneaky")
    os.symlink(directory, link_dir)
    detour = os.path.join(directory, "..", "storage")
    outside_ino = os.stat(os.path.join(outside, "f")).st_ino
    hostile = [
        ["/etc", "passwd", os.stat("/etc/passwd").st_ino, os.stat("/etc/passwd").st_size],
        [outside, "f", outside_ino, 1],  # in the tmpfs, but not under the workers' root
        [detour, name, ino, size],
        [link_dir, name, ino, size],  # a symlink to the right directory
        [directory, "../storage", ino, size],
        [directory, name, ino + 1, size],  # another inode than offered
        [os.path.dirname(directory), "storage", os.stat(directory).st_ino, os.stat(directory).st_size],
    ]
    for i, (where, fname, inode, nbytes) in enumerate(hostile):
        entries = [[f"hostile-{i}", fname, inode, nbytes, nbytes]]
        assert await handover.call(scheduler, receiver, "take", directory=where, entries=entries) == (), (where, fname)
    assert not await spill_files(client, receiver)
    # The same call with the sender's own report is taken.
    taken = await handover.call(
        scheduler, receiver, "take", directory=directory, entries=[[future.key, name, ino, size, MiB]]
    )
    assert taken == (0,)


def held(dask_worker: Any) -> dict[str, tuple[bool, int]]:
    """Key -> (whether its spill file's name is a regular file itself, the inode it reaches)."""
    store = dask_worker.data._slow_uncached.d
    found: dict[str, tuple[bool, int]] = {}
    for k, n in store.filenames.items():
        path = os.path.join(store.directory, n)
        found[str(k)] = (stat.S_ISREG(os.lstat(path).st_mode), os.stat(path).st_ino)
    return found


@pytest.mark.parametrize("swapped", ["the file", "a directory on its path"])
async def test_a_name_swapped_for_a_symlink_as_the_receiver_links_is_never_taken(
    cluster: tuple[LocalCluster, Client], shm: pathlib.Path, swapped: str
) -> None:
    """A peer offers a file of its own in the shared root, then, the moment the receiver links it
    (after every check of the name), puts a symbolic link to a file outside the root in place of
    the file or of the directory that holds it: the receiver links the file it checked, never the
    one outside, nor a symbolic link to it."""
    local, client = cluster
    scheduler = local.scheduler
    sender, receiver, _ = sorted(scheduler.workers)
    [future] = await client.scatter([value(8)], workers=[sender])
    directory = (await handover.identify(scheduler, sender))["directory"]
    into = (await handover.identify(scheduler, receiver))["directory"]
    [[name, ino, size]] = await handover.call(scheduler, sender, "offer", keys=[future.key])
    root = os.path.dirname(os.path.dirname(directory))
    mine = os.path.join(root, "peer")  # the peer's own directory in the root, and its own file
    os.makedirs(mine)
    os.link(os.path.join(directory, name), os.path.join(mine, "bait"))
    outside = os.path.join(shm, "outside")  # on the same tmpfs, outside the root
    os.makedirs(outside)
    pathlib.Path(outside, "bait").write_bytes(b"outside" * 1024)
    outside_ino = os.stat(os.path.join(outside, "bait")).st_ino
    if swapped == "the file":
        os.symlink(os.path.join(outside, "bait"), os.path.join(mine, "swap"))
        moves = [(os.path.join(mine, "swap"), os.path.join(mine, "bait"))]
    else:
        os.symlink(outside, os.path.join(root, "swap"))
        moves = [(mine, os.path.join(root, "peer-was")), (os.path.join(root, "swap"), mine)]
    marker = os.path.join(shm, "swapped")
    await client.run(peers.swap_as_it_links, into, moves, marker, workers=[receiver])

    entries = [[future.key, "bait", ino, size, MiB]]
    taken = await handover.call(scheduler, receiver, "take", directory=mine, entries=entries)

    assert os.path.exists(marker), "the swap came as the receiver linked"
    found = (await client.run(held, workers=[receiver]))[receiver].get(str(future.key))
    assert found is None or found[1] != outside_ino, (
        f"the receiver's spill file of the key is {'a link' if found[0] else 'a symbolic link'} "
        f"to inode {found[1]}, the file outside its root"
    )
    assert taken == (0,) and found == (True, ino), (taken, found)


async def test_a_handed_over_spill_file_is_read_only(cluster: tuple[LocalCluster, Client], shm: pathlib.Path) -> None:
    """Once a peer holds a spill file, and may read it as a map, its writer cannot open it for
    writing or truncate it (a truncation would end the peer's process with SIGBUS), nor can any
    process of its uid: the sender takes the write bits off as it offers the file, however it was
    written (here by distributed's own spill store, without memops' links plugin)."""
    local, client = cluster
    scheduler = local.scheduler
    sender, receiver, _ = sorted(scheduler.workers)
    [future] = await client.scatter([value(9)], workers=[sender])
    directory = (await handover.identify(scheduler, sender))["directory"]
    assert await handover.hand_over(scheduler, sender, receiver, [future.key], directory) == ([future.key], [])
    [[name, _, _]] = await handover.call(scheduler, sender, "offer", keys=[future.key])
    path = os.path.join(directory, name)
    mode = stat.S_IMODE(os.stat(path).st_mode)

    said = peers.writes_as_owner(path, os.path.dirname(shm))  # /dev/shm: anyone may pass through it

    assert all("Permission denied" in why for why in said.values()), f"its owner wrote to it (mode {mode:o}): {said}"
    assert mode & 0o222 == 0, f"mode {mode:o}"
    assert await client.gather(future) == value(9)


async def test_a_hostile_reply_is_refused(cluster: tuple[LocalCluster, Client]) -> None:
    """A worker whose handler answers with a serialized object (which would be unpickled by a
    reader that deserializes) is refused, and counts as a worker with no hand-over."""
    local, client = cluster
    scheduler = local.scheduler
    worker = sorted(scheduler.workers)[0]

    def turn_hostile(dask_worker: Any) -> None:
        dask_worker.handlers[handover.NAME] = lambda **kwargs: {"result": to_serialize(Exception("pickled"))}

    await client.run(turn_hostile, workers=[worker])
    with pytest.raises(handover.Refused, match="Serialized"):
        await handover.call(scheduler, worker, "identity")
    assert await handover.identify(scheduler, worker) == {}


@pytest.mark.parametrize(
    "value_, refused",
    [
        pytest.param({"a": [1, 2.0, "x", b"y", None, True]}, False, id="plain"),
        pytest.param({"a": {1, 2}}, True, id="a-set"),
        pytest.param({("a",): 1}, True, id="a-tuple-map-key"),
        pytest.param([[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]], True, id="too-deep"),
        pytest.param(object(), True, id="an-object"),
    ],
)
def test_plain(value_: Any, refused: bool) -> None:
    if refused:
        with pytest.raises(handover.Refused):
            handover.plain(value_)
    else:
        assert handover.plain(value_) is value_


async def test_a_drain_of_spilled_data_moves_no_byte_over_the_network(cluster: tuple[LocalCluster, Client]) -> None:
    """memops' drain (started as the operator does) of a worker whose data is spilled, with two
    recipients on its spill filesystem: every key handed over by link, none over the network,
    the worker closed, nothing lost."""
    local, client = cluster
    scheduler = local.scheduler
    dying = sorted(scheduler.workers)[0]
    data = await client.scatter({f"s{i}": value(i) for i in range(40)}, workers=[dying], hash=False)
    before = await network(client)
    await dask_direct.start_drain(local.scheduler_address, [dying], deadline=60)

    async def ended() -> dict[str, Any] | None:
        state = (await dask_direct.drain_status(local.scheduler_address, [dying]))[dying]
        return dict(state) if state["state"] != "draining" else None

    state = await polling.poll(ended, timeout=60, what="the drain to end", interval=0.05)
    assert state["state"] == drain.State.DONE
    assert state["keysMoved"] == state["keysLinked"] == 40 and state["bytesLinked"] == 40 * MiB
    await polling.poll(lambda: dying not in scheduler.workers, timeout=20, interval=0.02)
    after = await network(client)
    assert {w: after[w] for w in after} == {w: before[w] for w in after}, "no byte over the network"

    async def single_links() -> list[Any] | None:
        links = [await spill_files(client, w) for w in after]
        return links if all(n == 1 for f in links for _, n in f.values()) else None

    # The sender's spill directory goes with its process.
    links = await polling.poll(single_links, timeout=20, what="one link per spilled key")
    assert sum(len(f) for f in links) == 40
    assert min(len(f) for f in links) >= 10, "spread over both recipients"
    assert await client.gather(list(data.values())) == [value(i) for i in range(40)]


async def test_without_hand_over_the_drain_copies(cluster: tuple[LocalCluster, Client]) -> None:
    """The anchor of the test above: the same drain with ``handover`` off sends every byte."""
    local, client = cluster
    scheduler = local.scheduler
    dying = sorted(scheduler.workers)[0]
    data = await client.scatter({f"c{i}": value(i) for i in range(10)}, workers=[dying], hash=False)
    drain.start(scheduler, workers=[dying], deadline=60, handover=False)
    await polling.poll(lambda: dying not in scheduler.workers, timeout=60, interval=0.02)
    received = sum(n for _, n in (await network(client)).values())
    assert received == 10
    assert await client.gather(list(data.values())) == [value(i) for i in range(10)]


# -- the drain's choice of recipients for spilled keys (pure) ------------------------------------


def key(name: str, group: str | None = None) -> drain.Key:
    return drain.Key(name, MiB, False, group=group)


def recipient(name: str, node: str | None, group: str | None = None, headroom: int = 100 * MiB) -> drain.Recipient:
    return drain.Recipient(name, node, headroom, drain.WINDOW_BYTES, group)


@pytest.mark.parametrize(
    "keys, recipients, expected",
    [
        pytest.param(
            [key("k1", "fs1")],
            [recipient("local", "n1", "fs1", headroom=MiB), recipient("roomy", "n2", headroom=1000 * MiB)],
            [("k1", "local")],
            id="a-spilled-key-goes-to-its-filesystem-before-a-roomier-recipient",
        ),
        pytest.param(
            [key("k1", "fs1"), key("k2", "fs1"), key("k3", "fs1")],
            [recipient("a", None, "fs1"), recipient("b", None, "fs1"), recipient("c", None, "fs2")],
            [("k1", "a"), ("k2", "b"), ("k3", "a")],
            id="spread-over-the-local-recipients",
        ),
        pytest.param(
            [key("k1", "fs1")],
            [recipient("local", "dying", "fs1"), recipient("far", "n2")],
            [("k1", "far")],
            id="never-first-on-a-dying-node",
        ),
        pytest.param(
            [key("k1", "fs1")],
            [recipient("local", "n1", "fs1", headroom=0), recipient("far", "n2")],
            [("k1", "local")],
            id="a-link-needs-no-headroom",
        ),
        pytest.param(
            [key("k1"), key("k2", "fs1")],
            [recipient("local", "n1", "fs1", headroom=MiB // 2), recipient("far", "n2")],
            [("k1", "far"), ("k2", "local")],
            id="a-key-in-memory-is-placed-as-before",
        ),
    ],
)
def test_assign_prefers_the_spill_filesystem(
    keys: list[drain.Key], recipients: list[drain.Recipient], expected: list[tuple[str, str]]
) -> None:
    assert drain.assign(keys, recipients, {"dying"}) == (expected, [])


async def test_a_retirement_hands_spilled_keys_over(cluster: tuple[LocalCluster, Client]) -> None:
    """``Scheduler.retire_workers`` (here through ``dask_direct``), as the RetirementRequest controller
    (and so scale-downs and recycling) calls it: the worker retired, its spilled keys linked, none
    received over the network."""
    local, client = cluster
    retiring = sorted(local.scheduler.workers)[0]
    data = await client.scatter({f"r{i}": value(i) for i in range(12)}, workers=[retiring], hash=False)
    outcome = await dask_direct.retire_workers(local.scheduler_address, [retiring], timeout=60)
    assert outcome.by_memops and outcome.retired == (retiring,) and not outcome.lost_at_deadline
    assert sum(n for _, n in (await network(client)).values()) == 0, "no key received over the network"
    assert await client.gather(list(data.values())) == [value(i) for i in range(12)]


@pytest.mark.parametrize("nodes_dying", [False, True])
async def test_a_retirement_on_a_node_that_stays_links_to_its_neighbour(
    cluster: tuple[LocalCluster, Client], nodes_dying: bool
) -> None:
    """With every worker's node given, as the RetirementRequest controller gives them: an
    ordinary retirement (the node stays) hands spilled keys to the neighbour on the worker's own
    node too; a node drain (``nodes_dying``) keeps them off that node while another has room."""
    local, client = cluster
    retiring, neighbour, far = sorted(local.scheduler.workers)
    nodes = {retiring: "n1", neighbour: "n1", far: "n2"}
    data = await client.scatter({f"n{i}": value(i) for i in range(12)}, workers=[retiring], hash=False)
    outcome = await dask_direct.retire_workers(
        local.scheduler_address, [retiring], timeout=60, nodes=nodes, nodes_dying=nodes_dying
    )
    assert outcome.by_memops and outcome.retired == (retiring,)
    held = await client.has_what()
    assert len(held[far]) + len(held[neighbour]) == 12
    if nodes_dying:
        assert not held[neighbour], "nothing first to the dying node"
    else:
        assert len(held[neighbour]) >= 4, "spread over both recipients, the node's neighbour too"
    assert sum(n for _, n in (await network(client)).values()) == 0, "linked, whichever the recipient"
    assert await client.gather(list(data.values())) == [value(i) for i in range(12)]
