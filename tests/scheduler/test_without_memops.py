"""memops' scheduler-side code runs where memops is not installed, as in Dask's own image.

The scheduler and a worker here are processes in which ``import memops`` fails (``sys.modules``
says so before distributed starts): everything the operator sends them (the agent, relief,
replication with a glob rule, the hand-over and same-node links plugins that the agent registers
for every worker,
and the reads of holdings) must arrive by value. A test in the operator's own environment cannot
see this: there, a function pickled by reference loads anyway. (Before: ``keys.glob``'s compiled
patterns were cached with ``functools.lru_cache``, whose wrapper pickles by reference, so no
agent could be installed on a stock scheduler, and every worker that joined one after a
hand-over plugin failed to start.)"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest
from memops_sandbox import dask_direct

from memops.clients import daskrpc
from tests.scheduler import processes

WITHOUT_MEMOPS = "import sys; sys.modules['memops'] = None; from {module} import main; sys.argv[0] = 'dask'; main()"


def stock(module: str, *args: str) -> subprocess.Popen[bytes]:
    """``dask scheduler`` or ``dask worker`` (``module``'s ``main``) in a process without memops."""
    return subprocess.Popen(
        [sys.executable, "-c", WITHOUT_MEMOPS.format(module=module), *args],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


@pytest.fixture
def address(unused_tcp_port: int) -> Iterator[str]:
    address = f"tcp://127.0.0.1:{unused_tcp_port}"
    scheduler = stock("distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", str(unused_tcp_port))
    workers = [
        stock("distributed.cli.dask_worker", address, "--name", f"w{i}", "--nthreads", "1", *processes.OPTIONS)
        for i in range(2)
    ]
    try:
        yield address
    finally:
        for process in [*workers, scheduler]:
            processes.kill(process)


async def test_the_agent_and_its_plugins_run_where_memops_is_not_installed(address: str) -> None:
    async def count() -> int:
        try:
            return len((await dask_direct.fetch_snapshot(address, timeout=5)).workers)
        except daskrpc.SchedulerUnreachable:
            return 0

    await processes.wait_for_workers(count, 2)
    rules = {"default": 1, "keys": [{"glob": "ruled-*", "replicas": 2}], "pods": []}
    replication = await dask_direct.configure_replication(address, rules=rules, places={}, owner="default/stock")
    assert replication is not None, "replication installed, with a glob rule"
    relief = await dask_direct.configure_relief(address, above=0.9, to=0.8, owner="default/stock")
    assert relief is not None, "relief installed"
    snapshot = await dask_direct.fetch_snapshot(address, timeout=5, drains=True)
    assert snapshot.drains is not None, "the agent answers the drains' read"
    async with dask_direct.connect(address) as scheduler:
        found = await scheduler.install_links()
        assert {s["status"] for s in found.values()} == {"Active"}, found
        assert len(await scheduler.spill_shares()) == 2, "the agent answers the spill's read"
    # A worker that joins now gets the hand-over and links plugins that the agent registered: it must start.
    late = stock("distributed.cli.dask_worker", address, "--name", "late", "--nthreads", "1", *processes.OPTIONS)
    try:
        await processes.wait_for_workers(count, 3)
    finally:
        processes.kill(late)
