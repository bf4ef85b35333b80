"""The spill owner (``sharedSpill.swap: SpillOnly``): a real owner process, as the sidecar runs it
(``python -c`` of :mod:`memops.worker.owner`'s source), allocating the spill files of real worker
processes on a tmpfs (``/dev/shm``). That the kernel then charges the pages to the owner's cgroup is
measured on real Nodes (``tests/e2e/test_swap.py``); here: the protocol, what it refuses, and that a
worker keeps every key whether the owner answers or not.
"""

from __future__ import annotations

import inspect
import os
import re
import signal
import socket
import stat
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from distributed import Client, LocalCluster

from memops.worker import accounting, links, owner
from tests import polling
from tests.scheduler import peers, processes
from tests.scheduler.spilling import CONFIG as SPILL_CONFIG
from tests.scheduler.test_links import wait_active

MiB = 2**20


@pytest.fixture
def running_owner(shm: Path, tmp_path: Path) -> Iterator[str]:
    """The owner as the sidecar runs it: the module's source, by ``python -c``, nothing imported."""
    path = str(tmp_path / "owner.sock")
    process = subprocess.Popen([sys.executable, "-c", inspect.getsource(owner), path, str(shm)])
    try:
        polling.wait_for(lambda: os.path.exists(path), timeout=20, what="the owner's socket")
        yield path
    finally:
        process.kill()
        process.wait(10)


def test_the_owner_allocates_an_empty_file_it_is_handed(running_owner: str, shm: Path) -> None:
    with open(shm / "key", "wb") as f:
        assert owner.allocate(running_owner, f.fileno(), 8 * MiB) == ""
        assert os.fstat(f.fileno()).st_size == 8 * MiB
        assert os.fstat(f.fileno()).st_blocks * 512 >= 8 * MiB  # allocated, not a hole


@pytest.mark.parametrize(
    ("make", "refusal"),
    [
        ("a file elsewhere", "not a regular file on the spill volume"),
        ("a file with bytes", "the file is not empty"),
        ("read only", "not open for writing"),
        ("a directory", "not a regular file"),
        # Refused by the owner's own limit where its cgroup has one, else by the tmpfs.
        ("too big", "memory limit has|fallocate: No space left"),
    ],
)
def test_the_owner_refuses_what_is_not_an_empty_spill_file_open_for_writing(
    running_owner: str, shm: Path, tmp_path: Path, make: str, refusal: str
) -> None:
    size = MiB
    if make == "a file elsewhere":
        fd = os.open(tmp_path / "elsewhere", os.O_RDWR | os.O_CREAT)
    elif make == "a file with bytes":
        (shm / "full").write_bytes(b"x")
        fd = os.open(shm / "full", os.O_RDWR)
    elif make == "read only":
        (shm / "ro").write_bytes(b"")
        fd = os.open(shm / "ro", os.O_RDONLY)
    elif make == "a directory":
        fd = os.open(shm, os.O_RDONLY)
    else:
        fd = os.open(shm / "big", os.O_RDWR | os.O_CREAT)
        size = 2**62
    try:
        assert re.search(refusal, owner.allocate(running_owner, fd, size))
        if make == "too big":
            assert os.fstat(fd).st_size == 0, "nothing was allocated"
    finally:
        os.close(fd)


def test_a_request_that_is_not_one_size_and_one_descriptor_is_answered_and_the_owner_goes_on(
    running_owner: str, shm: Path
) -> None:
    for payload, fds in ((b"\x00" * 8, []), (b"garbage", []), (b"", [])):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(5)
            conn.connect(running_owner)
            if fds or payload:
                socket.send_fds(conn, [payload], fds)
            else:
                conn.shutdown(socket.SHUT_WR)
            assert conn.recv(200) in (b"a request is one 8-byte size and one descriptor", b"")
    with open(shm / "after", "wb") as f:
        assert owner.allocate(running_owner, f.fileno(), MiB) == ""


def test_an_owner_that_is_not_there_is_a_reason_not_an_error(tmp_path: Path, shm: Path) -> None:
    with open(shm / "key", "wb") as f:
        assert "did not answer" in owner.allocate(str(tmp_path / "nobody.sock"), f.fileno(), MiB)


@pytest.fixture
async def owned_cluster(shm: Path, running_owner: str) -> AsyncIterator[tuple[LocalCluster, Client]]:
    """Two worker processes whose spill stores ask the running owner, with the links plugin (which
    puts memops' spill store in), spilling every key of 1 MiB at once."""
    env = {owner.SOCKET_ENV: running_owner}
    async with processes.local_cluster(
        2, config=SPILL_CONFIG, memory_limit="256MiB", local_directory=str(shm), env=env
    ) as both:
        await links.install(both[0].scheduler)
        await wait_active(both[0], 2)
        yield both


def _report(dask_worker: Any) -> dict[str, Any]:
    return accounting.report(dask_worker)


async def spill_reports(client: Client) -> dict[str, Any]:
    found: dict[str, Any] = await client.run(_report)
    return found


async def test_a_worker_spills_into_files_the_owner_allocated_and_reads_them_back(
    owned_cluster: tuple[LocalCluster, Client],
) -> None:
    _, client = owned_cluster
    arrays = [np.full(MiB // 8, float(i)) for i in range(6)]
    futures = await client.scatter(arrays)
    reports = await spill_reports(client)
    assert sum(r["files"] for r in reports.values()) == 6
    assert sum(r["ownerBytes"] for r in reports.values()) >= 6 * MiB
    assert sum(r["ownBytes"] for r in reports.values()) == 0, reports
    assert all(r["ownerRefusedFiles"] == 0 for r in reports.values())
    back = await client.gather(futures)
    assert all(np.array_equal(a, b) for a, b in zip(arrays, back, strict=True))


async def test_a_file_the_owner_allocated_is_read_only_once_written(
    owned_cluster: tuple[LocalCluster, Client], shm: Path
) -> None:
    """The owner allocates the file's pages, the worker writes them and then takes the write bits
    off: neither it nor any process of its uid opens the file for writing or truncates it."""
    _, client = owned_cluster
    futures = await client.scatter([np.full(MiB // 8, float(i)) for i in range(2)])

    def paths(dask_worker: Any) -> list[str]:
        store = dask_worker.data.slow.data.d
        return [os.path.join(store.directory, name) for name in store.filenames.values()]

    written = [p for found in (await client.run(paths)).values() for p in found]
    assert len(written) == 2 and sum(r["ownerBytes"] for r in (await spill_reports(client)).values()) >= 2 * MiB
    modes = {os.path.basename(p): f"{stat.S_IMODE(os.stat(p).st_mode):o}" for p in written}

    said = peers.writes_as_owner(written[0], str(shm.parent))  # /dev/shm: anyone may pass through it

    assert all("Permission denied" in why for why in said.values()), f"its owner wrote to it ({modes}): {said}"
    assert all(int(mode, 8) & 0o222 == 0 for mode in modes.values()), modes
    back = await client.gather(futures)
    assert [float(a[0]) for a in back] == [0.0, 1.0]


async def test_without_its_owner_a_worker_writes_its_spill_itself_and_loses_nothing(shm: Path, tmp_path: Path) -> None:
    env = {owner.SOCKET_ENV: str(tmp_path / "gone.sock")}
    async with processes.local_cluster(
        1, config=SPILL_CONFIG, memory_limit="256MiB", local_directory=str(shm), env=env
    ) as (local, client):
        await links.install(local.scheduler)
        await wait_active(local, 1)
        arrays = [np.full(MiB // 8, float(i)) for i in range(3)]
        futures = await client.scatter(arrays)
        [report] = (await spill_reports(client)).values()
        assert report["ownerBytes"] == 0
        assert report["ownBytes"] >= 3 * MiB
        assert report["ownerRefusedFiles"] == 3
        assert "did not answer" in report["ownerRefusal"]
        back = await client.gather(futures)
        assert all(np.array_equal(a, b) for a, b in zip(arrays, back, strict=True))


def test_the_owner_ends_at_sigterm_as_a_containers_first_process_must(shm: Path, tmp_path: Path) -> None:
    """A container's first process ignores a signal it has no handler for: without one, the pod would
    wait out its grace period for the sidecar."""
    path = tmp_path / "owner.sock"
    process = subprocess.Popen([sys.executable, "-c", inspect.getsource(owner), str(path), str(shm)])
    try:
        polling.wait_for(path.exists, timeout=20, what="the owner's socket")
        process.send_signal(signal.SIGTERM)
        assert process.wait(10) == 0
    finally:
        process.kill()
