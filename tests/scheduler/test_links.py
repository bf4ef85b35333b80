"""Same-node fetches of spilled keys by link, and spilled keys read back as maps, on real workers.

The workers spill to a directory under ``/dev/shm`` (a tmpfs, as the ``Node`` medium of
``sharedSpill`` gives them); every key of 1 MiB goes straight to the spill store (the target is
a few hundred KB). A fetch is an ordinary task on one worker whose input another holds. What went
over the network is what the sender wrote on the comm for it (its ``transfer_outgoing_log``'s
``compressed``); what was linked, the spill files' inodes.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import stat
import tempfile
from collections.abc import AsyncIterator
from typing import Any

import dask
import numpy as np
import pytest
from distributed import Client, LocalCluster, Nanny
from memops_sandbox import dask_direct

from memops.worker import accounting, links, maps
from tests import polling
from tests.scheduler import peers, processes, spilling
from tests.scheduler.processes import Cluster
from tests.scheduler.spilling import MiB, value


async def wait_active(local: LocalCluster, count: int) -> dict[str, Any]:
    async def active() -> dict[str, Any] | None:
        found = await links.statuses(local.scheduler)
        ok = [a for a, s in found.items() if s.get("status") == links.ACTIVE]
        return found if len(ok) >= count else None

    return await polling.poll(active, timeout=30, what="the plugin active", interval=0.1)  # type: ignore[no-any-return]


async def with_links(cluster: Cluster) -> None:
    await links.install(cluster.scheduler)
    await wait_active(cluster.local, len(cluster.local.workers))


pytestmark = spilling.WORKERS.with_args(setup=with_links)
ROOMY = pytest.mark.dask_cluster(workers=2, config={**spilling.CONFIG, "distributed.worker.memory.target": 0.6})
"""Dask's own target (0.6): keys stay in memory until a peer asks."""


def digest(b: Any) -> str:
    return hashlib.sha256(memoryview(b).cast("B")).hexdigest()


async def spill_files(client: Client, worker: str) -> dict[str, tuple[int, int]]:
    """Key -> (inode, link count) of the worker's spill files."""

    def files(dask_worker: Any) -> dict[str, tuple[int, int]]:
        store = dask_worker.data.slow.data.d
        stats = {str(k): os.stat(os.path.join(store.directory, n)) for k, n in store.filenames.items()}
        return {k: (st.st_ino, st.st_nlink) for k, st in stats.items()}

    return dict((await client.run(files, workers=[worker]))[worker])


async def sent(client: Client, worker: str) -> list[dict[str, Any]]:
    """The worker's transfers out: keys sent as bytes, keys sent by link, bytes written."""

    def log(dask_worker: Any) -> list[dict[str, Any]]:
        return [
            {"keys": list(e["keys"]), "linked": list(e.get("linked", ())), "written": e["compressed"]}
            for e in dask_worker.transfer_outgoing_log
        ]

    return list((await client.run(log, workers=[worker]))[worker])


async def fetch(client: Client, future: Any, worker: str) -> str:
    """A task on ``worker`` that reads ``future``: the worker fetches it from its holder."""
    return await client.submit(digest, future, workers=[worker], allow_other_workers=False, pure=False)  # type: ignore[no-any-return]


async def test_a_same_node_fetch_of_a_spilled_key_goes_by_link(cluster: tuple[LocalCluster, Client]) -> None:
    """The receiver's spill file is the sender's (one inode, two links), the task read the right
    bytes, and the sender wrote a few hundred bytes on the comm for a key of 1 MiB."""
    local, client = cluster
    sender, receiver, _ = sorted(local.scheduler.workers)
    [future] = await client.scatter([value(1)], workers=[sender])
    assert await fetch(client, future, receiver) == hashlib.sha256(value(1)).hexdigest()
    key = str(future.key)

    async def linked() -> tuple[int, int] | None:
        there = (await spill_files(client, receiver)).get(key)
        return there if there is not None and there[1] == 2 else None  # the outbox's link gone

    there = await polling.poll(linked, timeout=20, what="the receiver's link")
    assert (await spill_files(client, sender))[key] == there, "one inode, two links"
    [transfer] = await sent(client, sender)
    assert transfer["linked"] == [key] and transfer["keys"] == []
    assert transfer["written"] < 4096, transfer
    statuses = await links.statuses(local.scheduler)
    assert statuses[sender]["keysSent"] == 1 and statuses[receiver]["keysReceived"] == 1
    # Both copies are one file: the shares count it once.
    found = {w: await _spill_report(client, w) for w in (sender, receiver)}
    shares, total = accounting.shares({w: report["inodes"] for w, report in found.items()})
    assert total == sum(shares.values()) and shares[sender] == shares[receiver] == total / 2
    # The kernel charges the file to the sender, which wrote it: the receiver's link is not its own.
    assert found[sender]["ownBytes"] == total and found[receiver]["ownBytes"] == 0, found
    assert await client.gather(future) == value(1)


async def _spill_report(client: Client, worker: str) -> dict[str, Any]:
    return dict((await client.run(lambda dask_worker: accounting.report(dask_worker), workers=[worker]))[worker])


async def test_a_numpy_array_read_back_is_a_map_of_the_shared_file(cluster: tuple[LocalCluster, Client]) -> None:
    """Both workers' arrays are views of maps of one inode (their spill files); a write into
    one worker's array changes neither the file nor the other worker's array."""
    local, client = cluster
    sender, receiver, _ = sorted(local.scheduler.workers)
    array = np.arange(MiB // 8, dtype="float64")
    [future] = await client.scatter([array], workers=[sender])
    assert await client.submit(lambda a: float(a.sum()), future, workers=[receiver], pure=False) == array.sum()
    key = future.key

    def mapped(dask_worker: Any) -> tuple[bool, float]:
        held = dask_worker.data[key]
        return maps.mapped_base(held) is not None, float(held[-1])

    await polling.poll(lambda: _linked_twice(client, str(key), receiver), timeout=20, what="the receiver's link")
    assert (await spill_files(client, sender))[str(key)] == (await spill_files(client, receiver))[str(key)]
    found = await client.run(mapped, workers=[sender, receiver])
    assert found == {sender: (True, array[-1]), receiver: (True, array[-1])}

    def write(dask_worker: Any) -> float:
        held = dask_worker.data[key]
        held[-1] = -1.0
        return float(held[-1])

    assert (await client.run(write, workers=[receiver]))[receiver] == -1.0
    assert (await client.run(mapped, workers=[sender]))[sender] == (True, array[-1])
    assert (await client.gather(future))[-1] == array[-1]


async def _linked_twice(client: Client, key: str, worker: str) -> bool:
    there = (await spill_files(client, worker)).get(key)
    return there is not None and there[1] == 2


async def test_a_peer_on_another_filesystem_gets_the_bytes(cluster: tuple[LocalCluster, Client]) -> None:
    """A worker that spills elsewhere (a disk directory, not the tmpfs) gets the key as bytes."""
    local, client = cluster
    scheduler = local.scheduler
    sender = sorted(scheduler.workers)[0]
    async with spilling.worker_elsewhere(scheduler.address) as far:
        await wait_active(local, 4)
        [future] = await client.scatter([value(2)], workers=[sender])
        assert await fetch(client, future, far) == hashlib.sha256(value(2)).hexdigest()
        [transfer] = await sent(client, sender)
        assert transfer["keys"] == [str(future.key)] and transfer["linked"] == []
        assert transfer["written"] > MiB
        assert (await spill_files(client, far))[str(future.key)] != (await spill_files(client, sender))[str(future.key)]


async def test_a_peer_without_the_plugin_gets_the_bytes(cluster: tuple[LocalCluster, Client]) -> None:
    local, client = cluster
    sender, _, plain = sorted(local.scheduler.workers)
    await client.run(lambda dask_worker: dask_worker.handlers.pop(links.NAME) and None, workers=[plain])
    [future] = await client.scatter([value(3)], workers=[sender])
    assert await fetch(client, future, plain) == hashlib.sha256(value(3)).hexdigest()
    [transfer] = await sent(client, sender)
    assert transfer["keys"] == [str(future.key)] and transfer["linked"] == [] and transfer["written"] > MiB


async def test_a_key_in_memory_goes_as_bytes(cluster: tuple[LocalCluster, Client]) -> None:
    local, client = cluster
    sender, receiver, _ = sorted(local.scheduler.workers)
    [small] = await client.scatter([b"in memory"], workers=[sender])  # below the target: not spilled
    assert await fetch(client, small, receiver) == hashlib.sha256(b"in memory").hexdigest()
    [transfer] = await sent(client, sender)
    assert transfer["linked"] == []


@ROOMY
async def test_an_array_in_memory_is_spilled_for_a_same_node_peer(cluster: tuple[LocalCluster, Client]) -> None:
    """A key that the sender holds in memory and would read back as a map goes by link too: the
    sender spills it first (its private copy goes), the receiver maps the file, and the sender
    wrote a few hundred bytes on the comm for 4 MiB."""
    local, client = cluster
    sender, receiver = sorted(local.scheduler.workers)
    array = np.arange(4 * MiB // 8, dtype="float64")
    [future] = await client.scatter([array], workers=[sender])
    key = future.key

    def where(dask_worker: Any) -> tuple[bool, bool, bool]:
        data = dask_worker.data
        return key in data.fast, key in data.slow, maps.mapped_base(data[key]) is not None

    assert (await client.run(where, workers=[sender]))[sender] == (True, False, False), "held in memory"
    assert await client.submit(lambda a: float(a.sum()), future, workers=[receiver], pure=False) == array.sum()
    [transfer] = await sent(client, sender)
    assert transfer["linked"] == [str(key)] and transfer["keys"] == [] and transfer["written"] < 4096, transfer
    found = await client.run(where, workers=[sender, receiver])
    # The sender's copy is its spill file now, read back as a map; the receiver keeps a map of it.
    assert found[sender][1] and found[sender][2], found
    assert found[receiver][2], found
    assert (await client.gather(future))[-1] == array[-1]


@ROOMY
async def test_a_map_spilled_again_goes_back_by_its_own_file(cluster: tuple[LocalCluster, Client]) -> None:
    """A key read back as a map, then spilled again, is its file again: the sender's (read back
    by a task, its file out of the store) and the receiver's (kept in memory as a map of the
    linked file) both put back the one inode, and no second copy of the pages is written. The
    receiver's counts as linked from a peer, not as its own."""
    local, client = cluster
    sender, receiver = sorted(local.scheduler.workers)
    array = np.arange(4 * MiB // 8, dtype="float64")
    [future] = await client.scatter([array], workers=[sender])
    key = future.key
    assert await client.submit(lambda a: float(a.sum()), future, workers=[receiver], pure=False) == array.sum()
    [inode, _] = (await spill_files(client, sender))[str(key)]

    def read_back_then_spill(dask_worker: Any) -> tuple[bool, bool]:
        data = dask_worker.data
        value = data[key]  # the sender: unspilled into memory; the receiver: held there already
        in_memory = key in data.fast and key not in data.slow
        data.fast.evict(key)
        return in_memory, maps.mapped_base(value) is not None and float(value[-1]) == array[-1]

    found = await client.run(read_back_then_spill, workers=[sender, receiver])
    assert found == {sender: (True, True), receiver: (True, True)}, found
    assert (await spill_files(client, sender))[str(key)][0] == inode
    assert (await spill_files(client, receiver))[str(key)][0] == inode

    def linked_in(dask_worker: Any) -> list[int]:
        return [ino for _, ino in dask_worker.__dict__.get(accounting.LINKED_IN, ())]

    assert inode in (await client.run(linked_in, workers=[receiver]))[receiver]
    assert inode not in (await client.run(linked_in, workers=[sender]))[sender]
    assert (await client.gather(future))[-1] == array[-1]


@ROOMY
async def test_pure_python_data_in_memory_goes_as_bytes(cluster: tuple[LocalCluster, Client]) -> None:
    """A value that would be unpickled into private memory on every read (strings) is not spilled
    for a peer: it stays in the sender's memory and travels as distributed sends it."""
    local, client = cluster
    sender, receiver = sorted(local.scheduler.workers)
    strings = [f"{i:032x}" for i in range(64 * 1024)]  # about 6 MiB of Python objects
    [future] = await client.scatter([strings], workers=[sender])
    key = future.key
    assert await client.submit(len, future, workers=[receiver], pure=False) == len(strings)
    [transfer] = await sent(client, sender)
    assert transfer["keys"] == [str(key)] and transfer["linked"] == [], transfer
    assert (await client.run(lambda dask_worker: key in dask_worker.data.fast, workers=[sender]))[sender]


def test_what_is_spilled_for_a_peer() -> None:
    """:func:`maps.mappable`: what a read back from the spill file gives as a view of the map."""
    assert maps.mappable(np.zeros(4)) and maps.mappable(memoryview(b"x"))
    assert maps.mappable({"a": np.zeros(4), "b": [np.ones(2)]})
    assert not maps.mappable(np.array(["a", None], dtype=object))
    assert not maps.mappable(b"bytes") and not maps.mappable("text") and not maps.mappable([1, 2])
    assert not maps.mappable({}) and not maps.mappable([[[np.zeros(1)]]]), "empty, or nested past the depth"


async def test_a_hostile_link_is_refused(cluster: tuple[LocalCluster, Client], shm: pathlib.Path) -> None:
    """A link header that names a file outside the workers' shared root, through '..', through a
    symbolic link, or with another inode than the file's, is refused and nothing is linked; the
    sender's genuine outbox link is taken."""
    local, client = cluster
    sender, receiver, _ = sorted(local.scheduler.workers)
    [future] = await client.scatter([value(4)], workers=[sender])
    plugin = links.NAME  # the worker's own copy of the plugin, which the scheduler sent by value

    def pin(dask_worker: Any) -> list[Any]:
        state = dask_worker.plugins[plugin].links
        name, ino, size = state.pin(future.key)
        return [os.path.realpath(state.outbox), name, ino, size]

    outbox, name, ino, size = (await client.run(pin, workers=[sender]))[sender]
    root = os.path.dirname(os.path.dirname(outbox))
    outside = tempfile.mkdtemp(dir=shm)  # in the tmpfs, but not under the workers' root
    pathlib.Path(outside, "f").write_bytes(b"x")
    os.symlink(outbox, os.path.join(root, "sneaky"))
    os.symlink("/etc/passwd", os.path.join(outbox, "to-passwd"))
    passwd = os.stat("/etc/passwd")
    hostile = [
        ["/etc", "passwd", passwd.st_ino, passwd.st_size],
        ["/etc", "shadow", 0, 0],
        [outside, "f", os.stat(os.path.join(outside, "f")).st_ino, 1],
        [os.path.join(outbox, "..", "memops-links"), name, ino, size],
        [os.path.join(root, "sneaky"), name, ino, size],
        [outbox, "../memops-links/" + name, ino, size],
        [outbox, "to-passwd", passwd.st_ino, passwd.st_size],
        [outbox, name, ino + 1, size],
        [outbox, name, ino, size + 1],
    ]

    def receive(where: str, fname: str, inode: int, nbytes: int, dask_worker: Any = None) -> str:
        header = {"to": dask_worker.address, "directory": where, "name": fname, "inode": inode, "size": nbytes}
        state = dask_worker.plugins[plugin].links
        before = set(os.listdir(state.outbox))
        try:
            state.receive(header)
        except (ValueError, OSError) as exc:
            assert set(os.listdir(state.outbox)) == before
            return f"refused: {exc}"
        return "taken"

    for where, fname, inode, nbytes in hostile:
        result = await client.run(receive, where, fname, inode, nbytes, workers=[receiver])
        assert result[receiver].startswith("refused"), (where, fname, result)
    assert (await client.run(receive, outbox, name, ino, size, workers=[receiver]))[receiver] == "taken"


@pytest.fixture
async def on_a_new_tmpfs() -> AsyncIterator[tuple[LocalCluster, Client]]:
    """As :func:`cluster`, two workers, spilling into a tmpfs of their own: its inode numbers are small."""
    with peers.tmpfs() as root:
        async with processes.local_cluster(
            2, config=spilling.CONFIG, memory_limit="256MiB", local_directory=root
        ) as both:
            await links.install(both[0].scheduler)
            await wait_active(both[0], 2)
            yield both


async def test_a_link_swapped_for_another_filesystems_twin_as_it_is_linked_is_never_read(
    on_a_new_tmpfs: tuple[LocalCluster, Client],
) -> None:
    """A peer sends a link to a file of its own, then, the moment the receiver links it, puts in its
    place a symbolic link to a file of another tmpfs with the same inode number and size (a new
    tmpfs numbers its inodes from 2: a small number is easy to match). The receiver reads the file
    it checked, never its twin."""
    local, client = on_a_new_tmpfs
    sender, receiver = sorted(local.scheduler.workers)
    [future] = await client.scatter([value(11)], workers=[sender])
    plugin = links.NAME

    def pin(dask_worker: Any) -> list[Any]:
        state = dask_worker.plugins[plugin].links
        name, ino, size = state.pin(future.key)
        return [os.path.realpath(state.outbox), name, ino, size]

    def outbox(dask_worker: Any) -> str:
        return os.path.realpath(dask_worker.plugins[plugin].links.outbox)

    def receive(where: str, fname: str, inode: int, nbytes: int, dask_worker: Any = None) -> str:
        state = dask_worker.plugins[plugin].links
        try:
            got = state.receive({"directory": where, "name": fname, "inode": inode, "size": nbytes})
        except (ValueError, OSError) as exc:
            return f"refused: {exc}"
        finally:
            state.staged.clear()
        return digest(got)

    where, name, ino, size = (await client.run(pin, workers=[sender]))[sender]
    genuine = pathlib.Path(where, name).read_bytes()
    with peers.tmpfs() as other:
        twin = peers.inode_twin(other, ino, genuine[:-1] + bytes([genuine[-1] ^ 0xFF]))
        assert (os.stat(twin).st_ino, os.stat(twin).st_size) == (ino, size)
        assert os.stat(twin).st_dev != os.stat(os.path.join(where, name)).st_dev
        os.symlink(twin, os.path.join(where, "swap"))
        marker = os.path.join(other, "swapped")
        into = (await client.run(outbox, workers=[receiver]))[receiver]
        moves = [(os.path.join(where, "swap"), os.path.join(where, name))]
        await client.run(peers.swap_as_it_links, into, moves, marker, workers=[receiver])

        result = (await client.run(receive, where, name, ino, size, workers=[receiver]))[receiver]

        assert os.path.exists(marker), "the swap came as the receiver linked"
        checked = hashlib.sha256(value(11)).hexdigest()
        assert result == checked, f"the receiver read another file than it checked: {result}"


async def test_a_spill_file_is_read_only_once_written(cluster: tuple[LocalCluster, Client], shm: pathlib.Path) -> None:
    """A spill file that a peer links and reads as a map cannot be opened for writing or truncated
    (a truncation would end the peer's process with SIGBUS) by its writer or by any process of its
    uid: the spill store takes its write bits off once the bytes are in."""
    local, client = cluster
    sender, receiver, _ = sorted(local.scheduler.workers)
    [future] = await client.scatter([value(12)], workers=[sender])
    assert await fetch(client, future, receiver) == hashlib.sha256(value(12)).hexdigest()
    await polling.poll(lambda: _linked_twice(client, str(future.key), receiver), timeout=20, what="the link")

    def path(dask_worker: Any) -> str:
        store = dask_worker.data.slow.data.d
        return os.path.join(store.directory, store.filenames[future.key])

    written = (await client.run(path, workers=[sender]))[sender]
    mode = stat.S_IMODE(os.stat(written).st_mode)

    said = peers.writes_as_owner(written, os.path.dirname(shm))  # /dev/shm: anyone may pass through it

    assert all("Permission denied" in why for why in said.values()), f"its owner wrote to it (mode {mode:o}): {said}"
    assert mode & 0o222 == 0, f"mode {mode:o}"
    assert await fetch(client, future, receiver) == hashlib.sha256(value(12)).hexdigest()


async def test_a_worker_whose_data_is_not_a_spill_buffer_refuses_the_plugin(
    cluster: tuple[LocalCluster, Client],
) -> None:
    """A worker that does not spill (its data a plain dict) says why it refused, and serves as stock."""
    local, client = cluster
    scheduler = local.scheduler
    config = {**spilling.CONFIG, "distributed.worker.memory.target": False}
    with dask.config.set(config):
        async with Nanny(scheduler.address, memory_limit="256MiB", nthreads=1) as nanny:
            address = nanny.worker_address

            async def answered() -> dict[str, Any] | None:
                status = (await links.statuses(scheduler)).get(address)
                return status if status and status.get("reason") else None

            status = await polling.poll(answered, timeout=30, what="its refusal")
            assert status["status"] == links.REFUSED and "SpillBuffer" in status["reason"], status
            [future] = await client.scatter([value(5)], workers=[address])
            sender = sorted(scheduler.workers)[0]
            assert await fetch(client, future, sender) == hashlib.sha256(value(5)).hexdigest()


@pytest.mark.parametrize(
    "reports, shares, total",
    [
        pytest.param({"a": [[1, 10, 100]], "b": [[1, 10, 100]]}, {"a": 50, "b": 50}, 100, id="one-inode-two-workers"),
        pytest.param({"a": [[1, 10, 100]], "b": [[1, 11, 100]]}, {"a": 100, "b": 100}, 200, id="two-inodes"),
        pytest.param({"a": [[1, 10, 90]], "b": [[2, 10, 90]]}, {"a": 90, "b": 90}, 180, id="same-inode-other-device"),
        pytest.param(
            {"a": [[1, 1, 30]] * 2, "b": [], "c": [[1, 1, 30]]}, {"a": 15, "b": 0, "c": 15}, 30, id="a-name-twice"
        ),
    ],
)
def test_shares_count_each_inode_once(reports: dict[str, Any], shares: dict[str, float], total: int) -> None:
    assert accounting.shares(reports) == (shares, total)


def test_summarize_counts_a_linked_file_once() -> None:
    assert accounting.summarize([(1, 5, 100, 2), (1, 5, 100, 2), (1, 6, 10, 1)], linked={(1, 5)}) == {
        "files": 2,
        "bytes": 110,
        "sharedBytes": 100,
        "ownBytes": 10,  # (1, 5) is a peer's file, linked: its pages are charged to the peer
        "ownerBytes": 0,
        "inodes": [[1, 5, 100], [1, 6, 10]],
    }
    # A file the spill owner allocated is the owner's: neither the worker's own nor a peer's.
    owned = accounting.summarize([(1, 5, 100, 2), (1, 6, 10, 1), (1, 7, 30, 1)], linked={(1, 5)}, owned={(1, 7)})
    assert (owned["ownBytes"], owned["ownerBytes"], owned["bytes"]) == (10, 30, 140)


@pytest.mark.dask_cluster(workers=2, setup=None)  # the operator installs the plugin
async def test_the_operator_installs_the_plugin_and_reads_the_shares(cluster: tuple[LocalCluster, Client]) -> None:
    """Through memops' agent, as the policy pass calls it (the plugin sent by value): every
    worker active, and after a fetch by link the shares of the two holders add up to the one file."""
    local, client = cluster
    await client.wait_for_workers(2)
    async with dask_direct.connect(local.scheduler_address) as scheduler:
        found = await scheduler.install_links()
        assert {s["status"] for s in found.values()} == {links.ACTIVE}, found
        sender, receiver = sorted(local.scheduler.workers)
        [future] = await client.scatter([value(6)], workers=[sender])
        assert await fetch(client, future, receiver) == hashlib.sha256(value(6)).hexdigest()
        await polling.poll(lambda: _linked_twice(client, str(future.key), receiver), timeout=20, what="the link")
        shares = await scheduler.spill_shares()
        assert shares[sender]["bytes"] == shares[receiver]["bytes"] > MiB
        assert shares[sender]["sharedBytes"] == shares[sender]["bytes"]
        assert abs(shares[sender]["share"] + shares[receiver]["share"] - shares[sender]["bytes"]) <= 1


@pytest.mark.parametrize(
    "make, is_mapped",
    [
        pytest.param(lambda: np.arange(MiB // 8, dtype="float64"), True, id="ndarray"),
        pytest.param(lambda: np.zeros(80 * MiB // 8), True, id="ndarray-larger-than-a-shard"),
        pytest.param(lambda: memoryview(bytearray(MiB)), True, id="memoryview"),
        pytest.param(lambda: {"a": np.arange(MiB // 8)}, True, id="dict-of-arrays"),
        pytest.param(lambda: b"x" * MiB, False, id="bytes"),
        pytest.param(lambda: bytearray(MiB), False, id="bytearray"),
        pytest.param(lambda: np.array(["abc"] * 1000, dtype=object), False, id="object-array"),
        pytest.param(lambda: list(range(1000)), False, id="list"),
    ],
)
def test_which_types_are_read_back_as_maps(shm: pathlib.Path, make: Any, is_mapped: bool) -> None:
    """What docs/resources.md lists: the values that the spill store's mapped file gives back as
    views of the map, through Dask's own spill serialization (uncompressed)."""
    from distributed.protocol.serialize import deserialize_bytes, serialize_bytelist

    store = maps.mapped_file_class()(os.path.join(shm, "storage"))
    original = make()
    store["k"] = serialize_bytelist(original, compression=False, on_error="raise")
    read = deserialize_bytes(store["k"])
    inner = read["a"] if isinstance(read, dict) else read
    assert (maps.mapped_base(inner) is not None) is is_mapped
    assert same(read, original)


def same(a: Any, b: Any) -> bool:
    if isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in b)
    if isinstance(b, np.ndarray):
        return bool(np.array_equal(a, b))
    if isinstance(b, memoryview):
        return bytes(a) == bytes(b)
    return bool(a == b)


async def test_a_key_released_while_its_link_is_on_the_way_still_arrives_whole(
    cluster: tuple[LocalCluster, Client],
) -> None:
    """The sender pins the file before it answers: once the key is released there (its spill file
    removed), the receiver still links and reads the right bytes from the pinned name."""
    local, client = cluster
    sender, receiver, _ = sorted(local.scheduler.workers)
    [future] = await client.scatter([value(7)], workers=[sender])
    key, plugin = future.key, links.NAME

    def pin(dask_worker: Any) -> list[Any]:
        state = dask_worker.plugins[plugin].links
        name, ino, size = state.pin(key)
        return [os.path.realpath(state.outbox), name, ino, size]

    outbox, name, ino, size = (await client.run(pin, workers=[sender]))[sender]
    del future
    await polling.poll(lambda: key not in local.scheduler.tasks, timeout=20, what="the key released")
    await polling.poll(lambda: _gone(client, str(key), sender), timeout=20, what="the sender's spill file removed")

    def receive(dask_worker: Any = None) -> str:
        state = dask_worker.plugins[plugin].links
        got = state.receive({"directory": outbox, "name": name, "inode": ino, "size": size})
        state.staged.clear()
        return hashlib.sha256(got).hexdigest()

    assert (await client.run(receive, workers=[receiver]))[receiver] == hashlib.sha256(value(7)).hexdigest()


async def _gone(client: Client, key: str, worker: str) -> bool:
    return key not in await spill_files(client, worker)
