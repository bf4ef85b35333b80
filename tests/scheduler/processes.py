"""Dask clusters of real processes for the scheduler tests.

:func:`local_cluster`: the suite's one ``LocalCluster`` setup (worker processes, one thread each,
no dashboard) and a client of it. :func:`spawn`: workers as their own processes (``dask worker``:
a nanny and its worker), in their own session, so that SIGKILL of the session takes both at once,
as a node lost without notice does: no drain, no preStop, no nanny left to restart the worker.
:class:`Cluster`: what the ``cluster`` fixture (``conftest.py``) yields, both kinds together."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import dask.config
from distributed import Client, LocalCluster

from tests import polling

OPTIONS = ("--no-dashboard", "--death-timeout", "30")
DASK = str(Path(sys.executable).with_name("dask"))
ROOT = Path(__file__).resolve().parents[2]
"""The repository, where ``tests`` is imported from."""


def spawn(scheduler: str, name: str, memory_limit: str = "256MiB", host: str | None = None) -> subprocess.Popen[bytes]:
    """A worker (and its nanny); ``host``: the IP it listens on and advertises (a pod's, in a cluster)."""
    where = ("--host", host) if host is not None else ()
    command = [DASK, "worker", scheduler, "--name", name, "--nthreads", "1", "--memory-limit", memory_limit]
    return subprocess.Popen(
        [*command, *where, *OPTIONS],
        start_new_session=True,
        # The tests' own functions reach a worker by reference, as LocalCluster's workers import them.
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def spawn_scheduler(port: int, host: str = "127.0.0.1") -> subprocess.Popen[bytes]:
    """A scheduler at ``tcp://{host}:{port}``, in its own session."""
    return subprocess.Popen(
        [DASK, "scheduler", "--host", host, "--port", str(port), "--no-dashboard"],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def kill(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL the nanny and its worker together."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(10)


async def wait_for_workers(count_of: object, count: int, timeout: float = 60) -> None:
    """Poll ``count_of()`` (an awaitable factory) until it reaches ``count``."""

    async def enough() -> bool:
        return bool(await count_of() >= count)  # type: ignore[operator]

    await polling.poll(enough, timeout=timeout, what=f"{count} workers", interval=0.2)


@contextlib.asynccontextmanager
async def local_cluster(
    n_workers: int, *, config: Mapping[str, Any] | None = None, wait: bool = False, **options: Any
) -> AsyncIterator[tuple[LocalCluster, Client]]:
    """A LocalCluster of ``n_workers`` worker processes under the Dask ``config``, and a client of
    it; ``wait``: until every worker has connected; ``options``: LocalCluster's (memory_limit, ...)."""
    with dask.config.set(dict(config or {})):
        async with (
            LocalCluster(
                n_workers=n_workers,
                processes=True,
                threads_per_worker=options.pop("threads_per_worker", 1),
                dashboard_address=None,
                asynchronous=True,
                **options,
            ) as local,
            Client(local, asynchronous=True) as client,
        ):
            if wait:
                await client.wait_for_workers(n_workers, timeout=60)
            yield local, client


class Cluster(tuple[LocalCluster, Client]):
    """A running :func:`local_cluster` and its client (it unpacks as ``local, client``, what
    :func:`local_cluster` yields), with the workers :func:`spawn` started into it, by name."""

    spawned: Mapping[str, subprocess.Popen[bytes]]

    def __new__(
        cls, local: LocalCluster, client: Client, spawned: Mapping[str, subprocess.Popen[bytes]] | None = None
    ) -> Cluster:
        running = super().__new__(cls, (local, client))
        running.spawned = dict(spawned or {})
        return running

    @property
    def local(self) -> LocalCluster:
        return self[0]

    @property
    def client(self) -> Client:
        return self[1]

    @property
    def address(self) -> str:
        return str(self.local.scheduler_address)

    @property
    def scheduler(self) -> Any:
        """The scheduler itself: it runs in this process."""
        return self.local.scheduler

    async def addresses(self) -> dict[str, str]:
        """Worker name -> address, as the scheduler knows them now."""
        info = await self.client.scheduler.identity()
        return {str(w["name"]): a for a, w in info["workers"].items()}
