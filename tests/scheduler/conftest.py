"""Fixtures of the scheduler tests: one real local Dask cluster, shaped by ``dask_cluster`` marks.

``cluster`` (:class:`processes.Cluster`, which unpacks as ``local, client``): a
:func:`processes.local_cluster` and its client, with the options of the test's ``dask_cluster``
marks; where a test, its class and its module mark, the closest wins, option by option (a module
gives its cluster, a test changes what it needs):

- ``workers`` (required): the LocalCluster's own worker processes;
- ``config``, ``memory_limit``, ``wait`` and any other option of :func:`processes.local_cluster`;
- ``shared_spill``: the workers' local directory (so their spill stores) is the test's ``shm``;
- ``spawn``: names of more workers, started as their own processes (:func:`processes.spawn`),
  waited for, SIGKILLed at the end if still there;
- ``setup``: awaited with the running cluster before the test (plugins to install, ...).

``client``: the cluster's client. ``shm``: a directory of its own on the machine's tmpfs.
Nothing of Dask is mocked.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from distributed import Client

from tests.scheduler import processes

MARK = "dask_cluster"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{MARK}(**options): the options of the ``cluster`` fixture (tests/scheduler)")


def marked(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The options of the test's ``dask_cluster`` marks, the closest one's over the others'."""
    options: dict[str, Any] = {}
    for mark in reversed(list(request.node.iter_markers(MARK))):  # the closest comes first
        options.update(mark.kwargs)
    return options


@pytest.fixture
def shm() -> Iterator[Path]:
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this machine: spilling into one filesystem's memory needs a tmpfs")
    path = Path(tempfile.mkdtemp(prefix="memops-spill-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def cluster(request: pytest.FixtureRequest) -> AsyncIterator[processes.Cluster]:
    options = marked(request)
    if "workers" not in options:
        pytest.fail(f"{request.node.nodeid}: no {MARK} mark gives the cluster's workers", pytrace=False)
    n_workers, names = int(options.pop("workers")), tuple(options.pop("spawn", ()))
    setup = options.pop("setup", None)
    if options.pop("shared_spill", False):
        # Requested here, not by signature, so that only the tests that spill there need a tmpfs.
        options["local_directory"] = str(request.getfixturevalue("shm"))
    async with processes.local_cluster(n_workers, **options) as (local, client):
        spawned = {name: processes.spawn(local.scheduler_address, name) for name in names}
        try:
            if spawned:
                await client.wait_for_workers(n_workers + len(spawned), timeout=60)
            running = processes.Cluster(local, client, spawned)
            if setup is not None:
                await setup(running)
            yield running
        finally:
            for process in spawned.values():
                processes.kill(process)


@pytest.fixture
def client(cluster: processes.Cluster) -> Client:
    return cluster.client
