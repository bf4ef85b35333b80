"""Dask workers as their own processes (``dask worker``: a nanny and its worker), in their own
session, so that SIGKILL of the session takes both at once, as a node lost without notice does:
no drain, no preStop, no nanny left to restart the worker."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

OPTIONS = ("--no-dashboard", "--death-timeout", "30")
DASK = str(Path(sys.executable).with_name("dask"))


def spawn(scheduler: str, name: str, memory_limit: str = "256MiB", host: str | None = None) -> subprocess.Popen[bytes]:
    """A worker (and its nanny); ``host``: the IP it listens on and advertises (a pod's, in a cluster)."""
    where = ("--host", host) if host is not None else ()
    command = [DASK, "worker", scheduler, "--name", name, "--nthreads", "1", "--memory-limit", memory_limit]
    return subprocess.Popen(
        [*command, *where, *OPTIONS],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def spawn_scheduler(port: int) -> subprocess.Popen[bytes]:
    """A scheduler at ``tcp://127.0.0.1:{port}``, in its own session."""
    return subprocess.Popen(
        [DASK, "scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard"],
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
    async with asyncio.timeout(timeout):
        while await count_of() < count:  # type: ignore[operator]
            await asyncio.sleep(0.2)
