"""The operator's channel to the scheduler, against real Dask processes (scheduler, nannies, workers)."""

from __future__ import annotations

import asyncio
import base64
import os
from collections.abc import AsyncIterator

import pytest
from distributed import Client, LocalCluster
from distributed.security import Security

from memops import daskrpc, planning

MiB = 2**20


@pytest.fixture
async def cluster() -> AsyncIterator[LocalCluster]:
    async with LocalCluster(
        n_workers=3, processes=True, threads_per_worker=1, dashboard_address=None, asynchronous=True
    ) as local:
        yield local


async def scatter(client: Client, address: str, count: int, size: int = MiB) -> dict[str, bytes]:
    values = {f"{address}-{i}": os.urandom(size) for i in range(count)}
    futures = await client.scatter(values, workers=[address], hash=False)
    client._test_keep = [*getattr(client, "_test_keep", []), *futures.values()]  # keep the data referenced
    return values


async def test_snapshot_counts_unique_bytes(cluster: LocalCluster) -> None:
    async with Client(cluster, asynchronous=True) as client:
        a, b, _ = sorted(cluster.scheduler.workers)
        await scatter(client, a, 3)
        replicated = await client.scatter({"shared": os.urandom(MiB)}, workers=[a, b], hash=False, broadcast=True)
        await client.replicate(list(replicated.values()), n=2)
        snapshot = await daskrpc.fetch_snapshot(cluster.scheduler_address)
        worker = snapshot.by_address(a)
        assert worker is not None
        assert worker.unique_keys == 3
        assert 3 * MiB <= worker.unique_bytes < 3 * MiB + 4096
        assert worker.name == str(cluster.scheduler.workers[a].name)
        assert len(snapshot.who_has["shared"]) >= 2


async def test_retire_moves_unique_data_worker_to_worker(cluster: LocalCluster) -> None:
    async with Client(cluster, asynchronous=True) as client:
        a = sorted(cluster.scheduler.workers)[0]
        values = await scatter(client, a, 5)
        before = await daskrpc.fetch_snapshot(cluster.scheduler_address)
        outcome = await daskrpc.retire_workers(cluster.scheduler_address, [a], timeout=30)
        assert outcome.retired == (a,) and not outcome.timed_out
        after = await daskrpc.fetch_snapshot(cluster.scheduler_address)
        assert after.by_address(a) is None
        assert planning.bytes_moved(before.who_has, after.who_has, before.nbytes, a)[1] == 5
        assert planning.bytes_lost(before.who_has, after.who_has, before.nbytes, a) == (0, 0)
        gathered = await client.gather(client._test_keep)
        assert sorted(gathered) == sorted(values.values())


async def test_retiring_every_worker_retires_none_and_loses_nothing(cluster: LocalCluster) -> None:
    async with Client(cluster, asynchronous=True) as client:
        workers = sorted(cluster.scheduler.workers)
        for address in workers:
            await scatter(client, address, 2, size=64 * 1024)
        outcome = await daskrpc.retire_workers(cluster.scheduler_address, workers, timeout=30)
        assert outcome.retired == () and set(outcome.not_retired) == set(workers) and not outcome.timed_out
        snapshot = await daskrpc.fetch_snapshot(cluster.scheduler_address)
        assert {w.address for w in snapshot.workers} == set(workers)
        assert all(w.status == "running" or w.status for w in snapshot.workers)
        assert len(await client.gather(client._test_keep)) == 6


async def test_timeout_returns_promptly_while_a_transfer_hangs(cluster: LocalCluster) -> None:
    """Recipients that stop answering (paused processes) make the drain hang; we stop waiting."""
    async with Client(cluster, asynchronous=True) as client:
        a, *others = sorted(cluster.scheduler.workers)
        await scatter(client, a, 2)
        pids = await client.run(os.getpid, workers=others)
        for pid in pids.values():
            os.kill(pid, 19)  # SIGSTOP
        try:
            outcome = await daskrpc.retire_workers(cluster.scheduler_address, [a], timeout=1.5)
        finally:
            for pid in pids.values():
                os.kill(pid, 18)  # SIGCONT
        assert outcome.timed_out and outcome.retired == () and outcome.not_retired == (a,)
        assert 1.4 < outcome.seconds < 5
        # The scheduler finishes the retirement on its own once the recipients answer again,
        # and calling again for the same worker is safe.
        again = await daskrpc.retire_workers(cluster.scheduler_address, [a], timeout=30)
        assert again.retired in ((a,), ())
        await asyncio.sleep(0)
        assert len(await client.gather(client._test_keep)) == 2


async def test_unreachable_scheduler_is_reported_quickly() -> None:
    with pytest.raises(daskrpc.SchedulerUnreachable, match=r"tcp://127\.0\.0\.1:9"):
        await daskrpc.fetch_snapshot("tcp://127.0.0.1:9", timeout=1)
    with pytest.raises(daskrpc.SchedulerUnreachable):
        await daskrpc.retire_workers("tcp://127.0.0.1:9", ["tcp://127.0.0.1:10"], timeout=1)


async def test_tls_scheduler_with_certificates_from_a_secret() -> None:
    security = Security.temporary()
    secret = {
        "ca.crt": base64.b64encode(security.tls_ca_file.encode()).decode(),
        "tls.crt": base64.b64encode(security.tls_client_cert.encode()).decode(),
        "tls.key": base64.b64encode(security.tls_client_key.encode()).decode(),
    }
    async with LocalCluster(
        n_workers=2,
        processes=True,
        threads_per_worker=1,
        dashboard_address=None,
        asynchronous=True,
        security=security,
        protocol="tls://",
    ) as local:
        assert local.scheduler_address.startswith("tls://")
        client_security = daskrpc.security_from_secret(secret)
        snapshot = await daskrpc.fetch_snapshot(local.scheduler_address, security=client_security)
        assert len(snapshot.workers) == 2
        address = snapshot.workers[0].address
        outcome = await daskrpc.retire_workers(local.scheduler_address, [address], security=client_security, timeout=30)
        assert outcome.retired == (address,)
        with pytest.raises(daskrpc.SchedulerUnreachable):
            await daskrpc.fetch_snapshot(local.scheduler_address, timeout=2)  # no certificate, no answer
