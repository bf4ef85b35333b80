"""Workers that spill into one tmpfs root, as the ``Node`` medium of ``sharedSpill`` gives a node's
workers: :data:`WORKERS`, three of them (the mark of the ``cluster`` fixture, ``conftest.py``), and
:func:`worker_elsewhere`, one more that spills to a disk directory: another filesystem."""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import tempfile
from collections.abc import AsyncIterator

import dask
import pytest
from distributed import Nanny

MiB = 2**20
MEMORY_LIMIT = "256MiB"
CONFIG = {
    # Every key larger than the target (1e-3 of 256 MiB: 268 KB) is written straight to the spill store.
    "distributed.worker.memory.target": 0.001,
    "distributed.worker.memory.spill": False,
    "distributed.worker.memory.pause": False,
    "distributed.worker.memory.terminate": False,
    "distributed.scheduler.active-memory-manager.start": False,
}
WORKERS = pytest.mark.dask_cluster(workers=3, config=CONFIG, memory_limit=MEMORY_LIMIT, shared_spill=True)


def value(i: int) -> bytes:
    """1 MiB of its own for each ``i``: spilled as soon as a worker holds it."""
    return hashlib.sha256(str(i).encode()).digest() * (MiB // 32)


@contextlib.asynccontextmanager
async def worker_elsewhere(scheduler_address: str) -> AsyncIterator[str]:
    """The address of one more worker (a nanny and its process) that spills as :data:`WORKERS` do,
    but to a directory on disk: it shares no filesystem with them."""
    directory = tempfile.mkdtemp(prefix="memops-disk-")
    try:
        with dask.config.set(CONFIG):
            async with Nanny(
                scheduler_address, local_directory=directory, memory_limit=MEMORY_LIMIT, nthreads=1
            ) as nanny:
                yield str(nanny.worker_address)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
