"""A hostile "scheduler" at ``spec.scheduler.address``: nothing it sends runs, memory stays flat.

The operator's channel (:mod:`memops.clients.daskrpc`) and the preStop hook (run as the kubelet runs
it) against each route of :mod:`tests.scheduler.hostile`: the marker file that unpickling
would create never exists, the process' memory grows by less than a few MiB, and the call
fails with the typed error.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from pathlib import Path

import pytest
from memops_sandbox import dask_direct

from memops.clients import daskrpc, prestop_hook
from tests.scheduler import hostile

MiB = 2**20
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    """This process' resident memory, in bytes (``/proc/self/statm``: pages)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * PAGE


@pytest.mark.parametrize("route", hostile.ROUTES)
async def test_the_operator_runs_nothing_and_allocates_nothing(route: str, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    async with hostile.serving(route, marker) as address:
        for call in (
            lambda: dask_direct.fetch_snapshot(address, timeout=5),
            lambda: dask_direct.ping(address, timeout=5),
            lambda: dask_direct.retire_workers(address, ["tcp://127.0.0.1:1"], timeout=5),
            lambda: dask_direct.configure_replication(address, rules={}, places={}, owner="default/p", timeout=5),
        ):
            before = rss()
            with pytest.raises(daskrpc.SchedulerMisbehaved, match="memops refuses") as raised:
                await call()
            grown = rss() - before
            assert not marker.exists(), "the scheduler's pickle ran in the operator"
            assert grown < 4 * MiB, f"{grown / MiB:.1f} MiB allocated for one reply"
            assert "pwned" not in str(raised.value), "the message holds only plain text"


async def test_an_error_reply_says_only_that_it_was_one(tmp_path: Path) -> None:
    """A scheduler's error (a handler that raised) is reported as one, and nothing of it is decoded."""
    async with hostile.serving("error", tmp_path / "pwned") as address:
        with pytest.raises(
            daskrpc.SchedulerMisbehaved, match="an error from a handler that every Dask scheduler serves"
        ):
            await dask_direct.ping(address, timeout=5)


HOOK_WRAPPER = """
import os, resource, sys
if os.environ.get("BLOCK_IMPORTS"):  # as in a container where neither is installed
    sys.modules["memops"] = sys.modules["distributed"] = None
try:
    exec(compile(os.environ["HOOK"], "prestop", "exec"), {"__name__": "__main__"})
finally:
    print("maxrss-kib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)
"""


async def run_hook(address: str, **env: str) -> tuple[int, str, int]:
    """The hook as the kubelet runs it: (exit code, stderr, its peak memory in bytes)."""
    hook_env = {
        **os.environ,
        "HOOK": prestop_hook.PRE_STOP_SCRIPT,
        "MEMOPS_SCHEDULER_ADDRESS": address,
        "MEMOPS_POD_NAME": "worker-0",
        "MEMOPS_DRAIN_TIMEOUT": "10",
        **env,
    }
    hook = await asyncio.create_subprocess_exec(
        sys.executable, "-c", HOOK_WRAPPER, env=hook_env, stderr=asyncio.subprocess.PIPE
    )
    _, stderr = await asyncio.wait_for(hook.communicate(), 30)
    text = stderr.decode()
    assert hook.returncode is not None
    return hook.returncode, text, int(text.rsplit("maxrss-kib", 1)[1].split()[0]) * 1024


@pytest.mark.parametrize("route", hostile.ROUTES)
async def test_the_prestop_hook_runs_nothing_and_allocates_nothing(route: str, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    with socket.socket() as sock:  # a port that nobody listens on: the hook fails before any reply
        sock.bind(("127.0.0.1", 0))
        nobody = f"tcp://127.0.0.1:{sock.getsockname()[1]}"
    _, _, baseline = await run_hook(nobody)
    async with hostile.serving(route, marker) as address:
        code, text, maxrss = await run_hook(address)
    assert code != 0, text
    assert not marker.exists(), "the scheduler's pickle ran in the worker's container"
    assert "Misbehaved: " in text or "RemoteError: identity: an error, without text" in text, text
    assert maxrss - baseline < 4 * MiB, f"{(maxrss - baseline) / MiB:.1f} MiB allocated for one reply"


async def test_the_prestop_hook_needs_neither_memops_nor_distributed_pickle(tmp_path: Path) -> None:
    """The hook carries its client as source: it runs where memops is not installed."""
    async with hostile.serving("huge-gib", tmp_path / "pwned") as address:
        code, text, _ = await run_hook(address, BLOCK_IMPORTS="1")
    assert code != 0 and "over this call's limit" in text, text
