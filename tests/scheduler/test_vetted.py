"""The vetted scheduler (:func:`memops.clients.daskrpc.vetted`): vouched for and acted on over one connection.

Two real schedulers, each a ``dask scheduler`` process with one ``dask worker`` process (tenant
A's worker at 127.0.0.2, tenant B's at 127.0.0.3), behind one address: a forwarder that sends the
first connection to A's scheduler and every later one to B's (:mod:`tests.scheduler.forwarder`).
The vouch is the tenancy check against A's one pod, at 127.0.0.2.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import pytest

from memops.clients import daskrpc
from memops.decisions import snapshots, tenancy
from tests.scheduler import forwarder

A_POD = snapshots.PodInfo(name="a-0", ips=(forwarder.A_IP,))


async def vouch(workers: Sequence[snapshots.WorkerInfo]) -> tenancy.Verdict:
    return tenancy.check(workers, [A_POD], "tenant-a")


@pytest.fixture
async def tenants() -> AsyncIterator[forwarder.Tenants]:
    async with forwarder.two_tenants() as both:
        yield both


async def test_everything_goes_over_the_connection_that_was_vouched_for(tenants: forwarder.Tenants) -> None:
    """A snapshot, pressure relief, replication, a drain and its status, a retirement of the
    scheduler's last worker and the snapshot after it: all on the one connection that the vouch
    judged, to A's scheduler; B's gets nothing."""
    async with forwarder.Forwarder([tenants.a, tenants.b]).serving() as proxy:
        async with daskrpc.vetted(proxy.address, vouch=vouch) as scheduler:
            snapshot = await scheduler.snapshot(drains=True)
            assert [w.address for w in snapshot.workers] == [tenants.a_worker]
            assert await scheduler.configure_relief(above=0.7, to=0.55, owner="tenant-a/p") is not None
            assert await scheduler.configure_replication(rules={"default": 16}, places={}, owner="tenant-a/p")
            # (A drain of a worker that is not there: the call, not the drain, is what counts here.)
            await scheduler.start_drain(["tcp://127.0.0.2:1"], deadline=1)
            assert isinstance(await scheduler.drain_status(), dict)
            # It holds nothing: retired at once, and closed.
            outcome = await scheduler.retire_workers([tenants.a_worker], timeout=30)
            assert outcome.retired == (tenants.a_worker,) and not outcome.timed_out, outcome
            # What the retirement reads after: the scheduler has no worker left, on the same connection.
            assert (await scheduler.snapshot(placement=list(snapshot.who_has))).workers == ()
        assert len(proxy.routed) == 1, "one connection"
    await forwarder.assert_untouched(tenants)
    assert await forwarder.on_scheduler(tenants.a, forwarder.memops_in)


async def test_a_new_connection_is_trusted_only_once_vouched_for_again(tenants: forwarder.Tenants) -> None:
    """A retirement that reaches its timeout reads the workers' statuses on a new connection, which
    leads to B's scheduler, where A's worker is absent. That connection is not vouched for, so its
    answer is no news: A's worker is not claimed as retired (its pod would be removed with its data),
    and nothing is asked of B's scheduler but ``identity``; the next call on the handle is refused."""
    async with forwarder.Forwarder([tenants.a, tenants.b]).serving() as proxy:
        async with daskrpc.vetted(proxy.address, vouch=vouch) as scheduler:
            outcome = await scheduler.retire_workers([tenants.a_worker], timeout=0)
            assert outcome.timed_out and outcome.retired == (), outcome
            assert outcome.not_retired == (tenants.a_worker,)
            with pytest.raises(daskrpc.Unvouched) as refused:
                await scheduler.snapshot()
            assert refused.value.verdict.reason == tenancy.Reason.FOREIGN
        assert len(proxy.routed) == 3  # A's; B's, for the statuses; B's again, for the snapshot
    await forwarder.assert_untouched(tenants)


async def test_a_retirement_that_times_out_after_its_last_worker_left_says_retired(
    tenants: forwarder.Tenants,
) -> None:
    """A's only worker is retired, and the reply comes after the timeout: the statuses are read on
    a new connection, where the scheduler has no worker left. That connection has only lost the
    worker vouched for before, so it is the same scheduler after it left: the worker is retired,
    and the snapshot after it reads an empty scheduler (not ``NoWorkers``, which would keep the
    retired worker's pod refused for good). That connection is read, and nothing is changed on it."""
    await forwarder.on_scheduler(tenants.a, forwarder.slow_retirement_replies)
    async with daskrpc.vetted(tenants.a, vouch=vouch) as scheduler:
        outcome = await scheduler.retire_workers([tenants.a_worker], timeout=5, memops_drain=False)
        assert outcome.timed_out and outcome.retired == (tenants.a_worker,), outcome
        assert (await scheduler.snapshot()).workers == ()
        # Read, never changed: nothing on that connection is shown to be the tenant's any more.
        with pytest.raises(daskrpc.Unvouched) as refused:
            await scheduler.configure_relief(above=0.7, to=0.55, owner="tenant-a/p")
        assert refused.value.verdict.reason == tenancy.Reason.NO_WORKERS
    assert await forwarder.on_scheduler(tenants.a, forwarder.workers) == {}


async def test_a_reconnect_that_gains_a_foreign_worker_is_refused(tenants: forwarder.Tenants) -> None:
    """A reconnect may only lose workers: one to B's scheduler, which shows B's worker instead of
    A's, is judged by the vouch again and refused, though it lost A's worker too."""
    async with forwarder.Forwarder([tenants.a, tenants.b]).serving() as proxy:
        async with daskrpc.vetted(proxy.address, vouch=vouch) as scheduler:
            await scheduler.close()
            with pytest.raises(daskrpc.Unvouched) as refused:
                await scheduler.snapshot()
            assert refused.value.verdict.reason == tenancy.Reason.FOREIGN
    await forwarder.assert_untouched(tenants)
