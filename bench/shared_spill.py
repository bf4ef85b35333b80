"""Shared spill: disk spill, tmpfs spill, tmpfs spill with memops' hand-over by hardlink.

Real Dask, no Kubernetes: a LocalCluster of worker processes on this machine, which is one node,
so all its workers can share a tmpfs root (``/dev/shm``), as the ``Node`` medium of
``sharedSpill`` gives the workers of one node. Two measurements, each against anchors of the
same run:

a. A workload that spills (data about twice the workers' Dask memory limits summed): make the
   chunks, retire one worker (memops' drain), then read every chunk where it is. The hand-over
   serves drains, not a task's inputs: the only worker-to-worker transfers here are the drain's. Three set-ups: the
   default disk spill (the worker's local directory on disk, drain without hand-over: the
   anchor), tmpfs spill (drain without hand-over), tmpfs spill with hand-over. Figures: peak
   memory summed over the workers, counting the tmpfs pages (RSS of the worker processes, by
   psutil, plus the bytes of the tmpfs directory, each inode once; a disk spill's page cache is
   not counted), wall time, bytes received over the network by the workers.
b. Draining one worker whose data is mostly spilled, on tmpfs: stock ``retire_workers`` (the
   anchor), memops' drain without hand-over, memops' drain with hand-over: bytes over the
   network, seconds, and the peak as above.
c. All to all (the shared-memory spill design's O(n^2) shape, small): numpy blocks made and spilled at once (target 0),
   then every worker reads every block: tmpfs spill with stock fetches (the anchor), and with
   memops' same-node links and maps (:mod:`memops.worker.links`). Network is what the senders
   wrote on their comms (a link is a few hundred bytes). Peak here: RSS less its resident tmpfs
   pages (``RssShmem``: mapped spill files), plus the tmpfs' bytes, each inode once.

    python bench/shared_spill.py            # 4 workers of 256 MiB, 2 GiB of data
    python bench/shared_spill.py --small    # the pass CI runs: 3 workers of 96 MiB, 384 MiB
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Self

import dask
import distributed
import psutil
from distributed import Client, LocalCluster

from memops.scheduler import drain
from memops.worker import links

MIB = 2**20
CONFIG = {
    "distributed.worker.memory.target": 0.5,
    "distributed.worker.memory.spill": 0.6,
    "distributed.worker.memory.pause": False,  # the bench measures spilling, not pausing
    "distributed.worker.memory.terminate": False,
    "distributed.scheduler.active-memory-manager.start": False,
    "distributed.admin.low-level-log-length": 1_000_000,  # every transfer stays in the log
    "distributed.worker.memory.monitor-interval": "20ms",
}


@dataclass(frozen=True)
class Size:
    workers: int
    limit: int  # bytes: each worker's Dask memory limit
    data: int  # bytes made in all
    chunk: int


@dataclass
class Result:
    seconds: float
    peak: int  # bytes: RSS of the workers plus the tmpfs directory, at its highest
    network: int  # bytes received by the workers from other workers
    linked: int = 0  # keys handed over by a link
    drain_seconds: float = 0.0  # of ``seconds``: the retirement alone
    drain_peak: int = 0  # the peak while retiring


def tmpfs_bytes(root: str) -> int:
    """Bytes the files under ``root`` hold, each inode once (a hardlinked file is one set of pages)."""
    seen: set[int] = set()
    total = 0
    for directory, _, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(directory, name))
                if st.st_ino not in seen:
                    seen.add(st.st_ino)
                    total += st.st_blocks * 512
    return total


def shmem(pid: int) -> int:
    """A process' resident tmpfs pages (``RssShmem``): mapped spill files, which the tmpfs' own
    bytes count already (each inode once), so a sampler of mapped workers leaves them out of RSS."""
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) * 1024
    return 0


class Periodic:
    """Calls :meth:`take` every ``period`` seconds on a thread of its own while entered."""

    def __init__(self, period: float):
        self.period = period
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def take(self) -> None:
        raise NotImplementedError

    def run(self) -> None:
        while not self.stop.is_set():
            self.take()
            self.stop.wait(self.period)

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


class Sampler(Periodic):
    """Samples the worker processes' RSS plus the tmpfs directory's bytes, keeps the highest."""

    def __init__(self, tmpfs: str | None, period: float = 0.05, shmem_once: bool = False):
        super().__init__(period)
        self.tmpfs, self.shmem_once = tmpfs, shmem_once
        self.peak = 0

    def sample(self) -> int:
        rss = 0
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                rss += child.memory_info().rss - (shmem(child.pid) if self.shmem_once else 0)
        return rss + (tmpfs_bytes(self.tmpfs) if self.tmpfs else 0)

    def take(self) -> None:
        self.peak = max(self.peak, self.sample())


@contextlib.asynccontextmanager
async def cluster(
    size: Size, directory: str, config: dict[str, Any] | None = None
) -> AsyncIterator[tuple[LocalCluster, Client]]:
    with dask.config.set({**CONFIG, **(config or {})}):
        async with LocalCluster(
            n_workers=size.workers,
            processes=True,
            threads_per_worker=1,
            memory_limit=size.limit,
            local_directory=directory,
            dashboard_address=":0",
            asynchronous=True,
        ) as local:
            async with Client(local, asynchronous=True) as client:
                yield local, client


def make(i: int, nbytes: int) -> bytes:
    return os.urandom(nbytes)


def edges(chunk: bytes) -> int:
    return chunk[0] + chunk[-1]


async def received(client: Client) -> int:
    def incoming(dask_worker: Any) -> int:
        return sum(int(entry["total"]) for entry in dask_worker.transfer_incoming_log)

    return sum((await client.run(incoming)).values())


async def retire(local: LocalCluster, address: str, how: str) -> int:
    """Retire ``address``: ``stock``, ``memops`` (no hand-over) or ``handover``; keys linked."""
    scheduler = local.scheduler
    if how == "stock":
        await scheduler.retire_workers(workers=[address], close_workers=True)
        return 0
    drain.start(scheduler, workers=[address], deadline=600, handover=how == "handover")
    async with asyncio.timeout(600):
        while True:  # polled, as the operator polls drain_status
            report = drain.status(scheduler, workers=[address])[address]
            if report["state"] != drain.State.DRAINING and address not in scheduler.workers:
                break
            await asyncio.sleep(0.05)
    if report["state"] != drain.State.DONE:
        raise RuntimeError(f"the drain of {address} ended {report['state']}: {report}")
    return int(report["keysLinked"])


async def workload(size: Size, directory: str, tmpfs: str | None, how: str) -> Result:
    """(a): make the chunks (they spill), retire one worker, read every chunk."""
    async with cluster(size, directory) as (local, client):
        n = size.data // size.chunk
        with Sampler(tmpfs) as sampler:
            start = time.perf_counter()
            chunks = client.map(make, range(n), nbytes=size.chunk, pure=False)
            await distributed.wait(chunks)
            address = sorted(local.scheduler.workers)[0]
            with Sampler(tmpfs) as during:
                begun = time.perf_counter()
                linked = await retire(local, address, how)
                drain_seconds = time.perf_counter() - begun
            # Each chunk read where it is (unspilled): the data itself crosses no network here.
            total = sum(await client.gather(client.map(edges, chunks)))
            seconds = time.perf_counter() - start
        assert total > 0
        return Result(seconds, sampler.peak, await received(client), linked, drain_seconds, during.peak)


async def drain_spilled(size: Size, directory: str, tmpfs: str, how: str) -> Result:
    """(b): one worker holds about twice its limit (most of it spilled); retire it."""
    async with cluster(size, directory) as (local, client):
        address = sorted(local.scheduler.workers)[0]
        n = 2 * size.limit // size.chunk
        chunks = client.map(make, range(n), nbytes=size.chunk, workers=[address], pure=False)
        await distributed.wait(chunks)
        with Sampler(tmpfs) as sampler:
            start = time.perf_counter()
            linked = await retire(local, address, how)
            seconds = time.perf_counter() - start
        network = await received(client)
        assert len(await client.gather(chunks[:2])) == 2
        return Result(seconds, sampler.peak, network, linked)


def block(i: int, nbytes: int) -> Any:
    import numpy

    return numpy.random.default_rng(i).random(nbytes // 8)


def total_of(*blocks: Any) -> float:
    return float(sum(float(b.sum()) for b in blocks))  # every page of every block read


async def written(client: Client) -> tuple[int, int]:
    """Bytes the workers wrote to peers for fetches (their comms' own count), and keys sent by link."""

    def outgoing(dask_worker: Any) -> tuple[int, int]:
        log = dask_worker.transfer_outgoing_log
        return sum(int(e["compressed"]) for e in log), sum(len(e.get("linked", ())) for e in log)

    found = (await client.run(outgoing)).values()
    return sum(w for w, _ in found), sum(n for _, n in found)


async def all_to_all(size: Size, directory: str, tmpfs: str, with_links: bool) -> Result:
    """(c): the design's O(n^2) shape, small: numpy blocks made spilled at once (target 0: the design's
    set-up against duplication), then on every worker a task that reads every block."""
    async with cluster(size, directory, {"distributed.worker.memory.target": 0.001}) as (local, client):
        if with_links:
            await links.install(local.scheduler)  # on every worker before it returns
            found = {s.get("status") for s in (await links.statuses(local.scheduler)).values()}
            if found != {links.ACTIVE}:
                raise RuntimeError(f"the links plugin is not active everywhere: {found}")
        n = size.data // 2 // size.chunk
        with Sampler(tmpfs, shmem_once=True) as sampler:
            start = time.perf_counter()
            blocks = client.map(block, range(n), nbytes=size.chunk, pure=False)
            await distributed.wait(blocks)
            sums = [
                client.submit(total_of, *blocks, workers=[w], allow_other_workers=False, pure=False)
                for w in sorted(local.scheduler.workers)
            ]
            results = await client.gather(sums)
            seconds = time.perf_counter() - start
        assert len(set(results)) == 1
        network, linked = await written(client)
        return Result(seconds, sampler.peak, network, linked)


def table(title: str, rows: Sequence[tuple[str, Result]], anchor: Result, phases: bool = False) -> None:
    print(f"\n{title}\n")
    extra = " retire s | peak MiB while retiring |" if phases else ""
    print(f"| set-up | seconds | time / anchor | peak MiB | peak / anchor | network MiB | keys linked |{extra}")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |" + (" ---: | ---: |" if phases else ""))
    for label, r in rows:
        more = f" {r.drain_seconds:.2f} | {r.drain_peak / MIB:.0f} |" if phases else ""
        print(
            f"| {label} | {r.seconds:.2f} | {r.seconds / anchor.seconds:.2f} | {r.peak / MIB:.0f} | "
            f"{r.peak / anchor.peak:.2f} | {r.network / MIB:.1f} | {r.linked} |{more}",
            flush=True,
        )


async def run(size: Size, passes: str = "abc") -> None:
    disk = tempfile.mkdtemp(prefix="memops-bench-spill-")
    shm = tempfile.mkdtemp(prefix="memops-bench-spill-", dir="/dev/shm")
    try:

        async def fresh(where: str, step: Callable[..., Any], *args: Any) -> Result:
            shutil.rmtree(where, ignore_errors=True)
            os.makedirs(where)
            return await step(size, where, *args)  # type: ignore[no-any-return]

        if "a" in passes:
            await pass_a(size, fresh, disk, shm)
        if "b" in passes:
            await pass_b(size, fresh, shm)
        if "c" in passes:
            await pass_c(size, fresh, shm)
    finally:
        shutil.rmtree(disk, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


async def pass_a(size: Size, fresh: Callable[..., Any], disk: str, shm: str) -> None:
    a = [
        ("disk spill, drain without hand-over (anchor)", await fresh(disk, workload, None, "memops")),
        ("tmpfs spill, drain without hand-over", await fresh(shm, workload, shm, "memops")),
        ("tmpfs spill, drain with hand-over", await fresh(shm, workload, shm, "handover")),
    ]
    table(
        f"a. make {size.data // MIB} MiB on {size.workers} workers of {size.limit // MIB} MiB, "
        "retire one, read every chunk",
        a,
        a[0][1],
        phases=True,
    )


async def pass_b(size: Size, fresh: Callable[..., Any], shm: str) -> None:
    b = [
        ("stock `retire_workers` (anchor)", await fresh(shm, drain_spilled, shm, "stock")),
        ("memops' drain, without hand-over", await fresh(shm, drain_spilled, shm, "memops")),
        ("memops' drain, with hand-over", await fresh(shm, drain_spilled, shm, "handover")),
    ]
    table(
        f"b. drain one worker holding {2 * size.limit // MIB} MiB (limit {size.limit // MIB} MiB), tmpfs spill",
        b,
        b[0][1],
    )


async def pass_c(size: Size, fresh: Callable[..., Any], shm: str) -> None:
    c = [
        ("tmpfs spill, stock fetches (anchor)", await fresh(shm, all_to_all, shm, False)),
        ("tmpfs spill, links and maps", await fresh(shm, all_to_all, shm, True)),
    ]
    table(
        f"c. all to all: {size.data // 2 // MIB} MiB of numpy blocks, each of {size.workers} workers reads "
        "every block (target 0); network is what the senders wrote",
        c,
        c[0][1],
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="3 workers of 96 MiB, 384 MiB of data (CI)")
    parser.add_argument("--passes", default="abc", help="which measurements: any of a, b, c (default all)")
    args = parser.parse_args(argv)
    if not os.path.isdir("/dev/shm"):
        print("no /dev/shm: this benchmark needs a tmpfs", file=sys.stderr)
        return 1
    if args.small:
        size = Size(workers=3, limit=96 * MIB, data=384 * MIB, chunk=4 * MIB)
    else:
        size = Size(workers=4, limit=256 * MIB, data=2048 * MIB, chunk=8 * MIB)
    asyncio.run(run(size, args.passes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
