"""The operator's channel to the scheduler, against real Dask processes (scheduler, nannies, workers).

Nothing of Dask is mocked. Where a test needs a drain that cannot finish yet, it freezes
worker processes with SIGSTOP: the scheduler still counts them as running, so transfers to
or from them hang, exactly as with a node that stops answering. Where it needs workers that
cannot receive data, it lowers their pause threshold and their own memory monitor pauses
them, as it would at 80% memory.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import signal
import socket
import time
from collections.abc import Iterator
from typing import Any

import dask
import pytest
from distributed import Client, Future, LocalCluster
from distributed.security import Security
from memops_sandbox import dask_direct

from memops.clients import daskrpc
from memops.decisions import retire_choice, snapshots, tenancy
from memops.scheduler import drain
from tests import polling
from tests.scheduler.processes import Cluster

MiB = 2**20


pytestmark = pytest.mark.dask_cluster(workers=3)


async def scatter(client: Client, address: str, count: int, size: int = MiB) -> dict[str, tuple[Future, bytes]]:
    """``count`` random values held by ``address`` only; the futures keep them referenced."""
    values = {f"{address}-{i}": os.urandom(size) for i in range(count)}
    futures = await client.scatter(values, workers=[address], hash=False)
    return {key: (futures[key], value) for key, value in values.items()}


async def all_intact(client: Client, data: dict[str, tuple[Future, bytes]]) -> bool:
    gathered = await client.gather([future for future, _ in data.values()])
    return list(gathered) == [value for _, value in data.values()]


async def statuses(address: str, **kwargs: Any) -> dict[str, str]:
    snapshot = await dask_direct.fetch_snapshot(address, keys=False, **kwargs)
    return {w.address: w.status for w in snapshot.workers}


def identity_calls(cluster: Cluster) -> int:
    """How many ``identity`` calls the scheduler has served (its own counter of comm ops)."""
    return int(cluster.scheduler.counters["op"].components[0]["identity"])


@contextlib.contextmanager
def frozen(pids: list[int]) -> Iterator[None]:
    """The processes stop answering (SIGSTOP) until the block ends (SIGCONT)."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def pause(dask_worker: Any) -> None:
    """Run on a worker: its memory monitor pauses it within 100 ms, any process being above 1e-9."""
    dask_worker.memory_manager.memory_pause_fraction = 1e-9


async def test_snapshot_counts_unique_bytes(cluster: Cluster, client: Client) -> None:
    a, b, c = sorted(cluster.scheduler.workers)
    # The Active Memory Manager's ReduceReplicas would drop one of the two replicas of "shared"
    # within its 2 s tick: it did, once, while another test lane loaded the machine.
    await client.amm.stop()
    data = await scatter(client, a, 3)
    shared = await client.scatter({"shared": os.urandom(MiB)}, workers=[a, b], hash=False, broadcast=True)
    snapshot = await dask_direct.fetch_snapshot(cluster.address, placement_of=[a])
    assert sorted(snapshot.who_has["shared"]) == [a, b]
    assert set(snapshot.who_has) == {*data, "shared"}, "who holds the keys of the workers asked for, only"
    on_a, on_b, on_c = (snapshot.by_address(x) for x in (a, b, c))
    assert on_a is not None and on_b is not None and on_c is not None
    assert (on_a.unique_keys, on_a.nkeys) == (3, 4)
    assert 3 * MiB <= on_a.unique_bytes < 3 * MiB + 4096, "the replicated key is not unique"
    assert (on_b.unique_bytes, on_b.unique_keys, on_b.nkeys) == (0, 0, 1)
    assert on_a.name == str(cluster.scheduler.workers[a].name) and snapshot.by_name(on_a.name) == on_a
    assert on_a.status == "running" and on_a.memory_limit > 0
    # What the operator would retire first: the empty worker, then the one whose data has copies.
    chosen = retire_choice.choose_workers([on_a.name, on_b.name, on_c.name], snapshot, 3)
    assert chosen == [on_c.name, on_b.name, on_a.name]
    # A deadline already past starts nothing.
    outcome = await dask_direct.retire_workers(cluster.address, [a], timeout=0)
    assert outcome.timed_out and outcome.not_retired == (a,)
    assert (await statuses(cluster.address))[a] == "running"
    assert await all_intact(client, data) and len(shared) == 1


async def test_a_scheduler_that_refuses_run_function_gives_the_same_figures_from_who_has() -> None:
    """The sums run in the scheduler; where ``run_function`` is blocked they are done from
    ``who_has`` instead, with the same result (and ``who_has`` of every key)."""
    figures = {}
    for blocked in ([], ["run_function"]):
        # Without the Active Memory Manager, whose ReduceReplicas would drop a replica of "both".
        config = {
            "distributed.scheduler.blocked-handlers": blocked,
            "distributed.scheduler.active-memory-manager.start": False,
        }
        with dask.config.set(config):
            async with (
                LocalCluster(
                    n_workers=2, processes=True, threads_per_worker=1, dashboard_address=None, asynchronous=True
                ) as local,
                Client(local, asynchronous=True) as dask_client,
            ):
                a, b = sorted(local.scheduler.workers)
                names = {a: "a", b: "b"}
                data = await scatter(dask_client, a, 3, size=64 * 1024)
                kept = await dask_client.scatter({"only-b": b"x" * 1000}, workers=[b], hash=False)
                kept |= await dask_client.scatter({"both": b"y" * 5000}, workers=[a, b], hash=False, broadcast=True)
                snapshot = await dask_direct.fetch_snapshot(local.scheduler_address, placement_of=[b])
                figures[bool(blocked)] = {
                    names[w.address]: (w.managed_bytes, w.nkeys, w.unique_bytes, w.unique_keys)
                    for w in snapshot.workers
                }
                assert sorted(snapshot.who_has["both"]) == [a, b] and snapshot.who_has["only-b"] == (b,)
                assert set(snapshot.who_has) >= {"only-b", "both"}
                assert (set(snapshot.who_has) > {"only-b", "both"}) == bool(blocked), "every key only from who_has"
                assert len(data) == 3 and len(kept) == 2  # referenced until here, so the scheduler keeps them
    assert figures[False] == figures[True], figures
    # (held bytes, held keys, unique bytes, unique keys); Dask sizes bytes by their length.
    assert figures[False]["a"] == (3 * 64 * 1024 + 5000, 4, 3 * 64 * 1024, 3)
    assert figures[False]["b"] == (1000 + 5000, 2, 1000, 1)


async def test_retire_moves_unique_data_worker_to_worker(cluster: Cluster, client: Client) -> None:
    a = sorted(cluster.scheduler.workers)[0]
    data = await scatter(client, a, 5)
    before = await dask_direct.fetch_snapshot(cluster.address, placement_of=[a])
    worker = before.by_address(a)
    assert worker is not None
    outcome = await dask_direct.retire_workers(cluster.address, [a], timeout=30)
    assert (outcome.retired, outcome.not_retired, outcome.timed_out, outcome.absent) == ((a,), (), False, ())
    after = await dask_direct.fetch_snapshot(cluster.address, placement=list(before.who_has))
    assert after.by_address(a) is None
    assert snapshots.bytes_moved(before.who_has, after.who_has, before.nbytes, a) == (worker.unique_bytes, 5)
    assert snapshots.bytes_lost(before.who_has, after.who_has, before.nbytes, a) == (0, 0)
    assert await all_intact(client, data)
    # Again, as an operator would after a restart: the worker is known to be gone, nothing is done.
    again = await dask_direct.retire_workers(cluster.address, [a], timeout=30)
    assert (again.retired, again.not_retired, again.timed_out, again.absent) == ((), (), False, (a,))


async def test_retiring_every_worker_retires_none_and_loses_nothing(cluster: Cluster, client: Client) -> None:
    workers = sorted(cluster.scheduler.workers)
    data = {}
    for address in workers:
        data.update(await scatter(client, address, 2, size=64 * 1024))
    outcome = await dask_direct.retire_workers(cluster.address, workers, timeout=30)
    assert outcome.retired == () and outcome.not_retired == tuple(workers) and not outcome.timed_out
    assert outcome.seconds < 5, "no recipients: the scheduler gives up at once"

    async def all_running() -> bool:  # the scheduler asks each worker to go back; each reports back
        return await statuses(cluster.address) == dict.fromkeys(workers, "running")

    await polling.poll(all_running, timeout=15, what="all_running")
    assert await all_intact(client, data)


async def test_timeout_returns_promptly_and_the_scheduler_finishes_alone(cluster: Cluster, client: Client) -> None:
    """Stock retire_workers (a scheduler without memops' agent): recipients that stop answering
    make the drain hang; we stop waiting, the scheduler does not."""
    a, *others = sorted(cluster.scheduler.workers)
    data = await scatter(client, a, 2)
    pids = await client.run(os.getpid, workers=others)
    with frozen(list(pids.values())):
        outcome = await dask_direct.retire_workers(cluster.address, [a], timeout=1.5, memops_drain=False)
        assert outcome.timed_out and outcome.retired == () and outcome.not_retired == (a,)
        assert 1.4 < outcome.seconds < 4
        assert (await statuses(cluster.address))[a] == "closing_gracefully"

    async def a_gone() -> bool:
        return a not in await statuses(cluster.address)

    await polling.poll(a_gone, timeout=15, what="a_gone")  # no second call: the handler went on after we hung up
    assert await all_intact(client, data)


@pytest.mark.parametrize("room", [pytest.param(True, id="data-moves"), pytest.param(False, id="no-recipients")])
async def test_retire_again_waits_for_the_retirement_in_progress(cluster: Cluster, client: Client, room: bool) -> None:
    """An operator restarted mid-drain calls again: it must wait for the first retirement, not stack one
    (the first by stock retire_workers, which goes on after the caller's timeout).

    Two stacked ``retire_workers`` calls that both find no recipients leave the worker
    ``closing_gracefully`` for good about half the time (each restores the status it saw).
    """
    a, *others = sorted(cluster.scheduler.workers)
    data = await scatter(client, a, 3)
    pid = (await client.run(os.getpid, workers=[a]))[a]
    with frozen([pid]):  # a sends nothing: its drain stays in progress
        first = await dask_direct.retire_workers(cluster.address, [a], timeout=1, memops_drain=False)
        assert first.timed_out and first.not_retired == (a,)
        if not room:
            await client.run(pause, workers=others)

            async def first_gave_up() -> bool:
                events = cluster.scheduler.get_events(a)
                return any(msg.get("action") == "could-not-retire" for _, msg in events)

            await polling.poll(first_gave_up, timeout=15, what="first_gave_up")  # at the next AMM run, within 2 s
        assert (await statuses(cluster.address))[a] == "closing_gracefully"
        asked = identity_calls(cluster)
        second = asyncio.create_task(dask_direct.retire_workers(cluster.address, [a], timeout=20))

        async def second_has_asked() -> bool:  # while a is frozen, so it was told closing_gracefully
            return identity_calls(cluster) > asked

        await polling.poll(second_has_asked, timeout=15, what="second_has_asked")
        assert not second.done()
    outcome = await second
    assert not outcome.timed_out
    if room:
        assert outcome.retired == (a,)
        assert a not in await statuses(cluster.address)
    else:
        assert outcome.not_retired == (a,)

        async def a_running() -> bool:
            return (await statuses(cluster.address))[a] == "running"

        await polling.poll(a_running, timeout=15, what="a_running")  # the worker must not stay leaving
        gave_up = [msg for _, msg in cluster.scheduler.get_events(a) if msg.get("action") == "could-not-retire"]
        assert len(gave_up) == 1, "one retirement only: a second one would restore a stale closing_gracefully"
    assert await all_intact(client, data)


async def test_unreachable_scheduler_is_reported_quickly() -> None:
    with socket.socket() as sock:  # a port that nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    address = f"tcp://127.0.0.1:{port}"
    started = time.monotonic()
    with pytest.raises(daskrpc.SchedulerUnreachable, match=rf"cannot reach the Dask scheduler at {address}"):
        await dask_direct.fetch_snapshot(address, timeout=1)
    with pytest.raises(daskrpc.SchedulerUnreachable):  # Dask retries a refused connection until the timeout
        await dask_direct.retire_workers(address, ["tcp://127.0.0.1:10"], timeout=1)
    with pytest.raises(daskrpc.SchedulerUnreachable):
        await dask_direct.ping(address, timeout=1)
    assert time.monotonic() - started < 5


async def test_tls_scheduler_with_certificates_from_pem_and_from_a_secret() -> None:
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
        from_secret = daskrpc.security_from_secret(secret)
        snapshot = await dask_direct.fetch_snapshot(local.scheduler_address, security=from_secret)
        assert len(snapshot.workers) == 2
        address = snapshot.workers[0].address
        from_pem = daskrpc.security_from_pem(security.tls_ca_file, security.tls_client_cert, security.tls_client_key)
        outcome = await dask_direct.retire_workers(local.scheduler_address, [address], security=from_pem, timeout=30)
        assert outcome.retired == (address,)
        with pytest.raises(daskrpc.SchedulerUnreachable, match="needs client certificates"):
            await dask_direct.fetch_snapshot(local.scheduler_address, timeout=2)
        stranger = Security.temporary()  # certificates from another CA: the handshake fails
        with pytest.raises(daskrpc.SchedulerUnreachable):
            await dask_direct.fetch_snapshot(
                local.scheduler_address,
                security=daskrpc.security_from_pem(
                    stranger.tls_ca_file, stranger.tls_client_cert, stranger.tls_client_key
                ),
                timeout=2,
            )
    with pytest.raises(ValueError, match="not PEM"):
        daskrpc.security_from_pem("/path/ca.pem", security.tls_client_cert, security.tls_client_key)


async def test_the_agent_comes_back_after_a_restart_and_replaces_another_version(
    cluster: Cluster, client: Client
) -> None:
    """One handler for every feature; a scheduler that lost it (restarted) or holds another
    version of it gets this one on the next call, which then succeeds."""
    from memops.scheduler import agent

    a = sorted(cluster.scheduler.workers)[0]
    data = await scatter(client, a, 2)
    handlers = cluster.scheduler.handlers
    assert (await dask_direct.fetch_snapshot(cluster.address)).by_address(a).unique_keys == 2  # type: ignore[union-attr]
    assert agent.NAME in handlers and "memops-pressure-relief" not in handlers
    for lost in (lambda: handlers.pop(agent.NAME), lambda: handlers.update({agent.NAME: lambda **_: {"agent": 0}})):
        lost()
        snapshot = await dask_direct.fetch_snapshot(cluster.address)
        assert snapshot.by_address(a).unique_keys == 2  # type: ignore[union-attr]
        assert handlers[agent.NAME](operation="hello") == {"agent": agent.VERSION, "result": {"version": agent.VERSION}}
    assert len(data) == 2  # referenced until here, so the scheduler keeps them


async def test_a_snapshot_vouched_for_reads_the_drains_on_its_connection(cluster: Cluster, client: Client) -> None:
    """As a MemoryPolicy's pass reads: ``identity``, then, only if ``vouch`` finds its workers to be
    the namespace's, memops' agent (installed then) for the drains. Refused: nothing more is asked
    and nothing is installed. A failure of ``vouch`` itself (the API server's) is raised as it is,
    not as the scheduler's."""
    from memops.scheduler import agent

    a, *_ = sorted(cluster.scheduler.workers)
    address = cluster.address
    judged: list[set[str]] = []

    async def refuse(workers: Any) -> tenancy.Verdict:
        judged.append({w.address for w in workers})
        return tenancy.Verdict(tenancy.Reason.FOREIGN, "not ours")

    with pytest.raises(daskrpc.Unvouched, match="not ours") as refused:
        async with daskrpc.vetted(address, vouch=refuse) as scheduler:
            await scheduler.snapshot(keys=False, processing=True, drains=True)
    assert judged == [set(cluster.scheduler.workers)] and {w.address for w in refused.value.workers} == judged[0]
    assert agent.NAME not in cluster.scheduler.handlers, "no code sent"

    async def vouch(workers: Any) -> tenancy.Verdict:
        return tenancy.Verdict(tenancy.Reason.TENANT, "ours")

    async with daskrpc.vetted(address, vouch=vouch) as scheduler:
        assert (await scheduler.snapshot(keys=False, drains=True)).drains == {}
        assert agent.NAME in cluster.scheduler.handlers
        await scheduler.start_drain([a], deadline=30, close_workers=False)
        drained = await scheduler.snapshot(keys=False, drains=True)
    assert drained.drains is not None and set(drained.drains) == {a}
    assert drained.drains[a]["state"] in (drain.State.DRAINING, drain.State.DONE)

    async def broken(workers: Any) -> tenancy.Verdict:
        raise TimeoutError("the API server did not answer")

    with pytest.raises(TimeoutError, match="the API server") as raised:
        async with daskrpc.vetted(address, vouch=broken):
            pass
    assert not isinstance(raised.value, daskrpc.SchedulerUnreachable)
