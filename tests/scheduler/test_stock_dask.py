"""memops installed in a real scheduler changes nothing that a Dask user can observe, rules aside.

A real scheduler (in this process, so that its AMM and its log can be read) with real workers
(nanny and worker processes). memops is installed over the comm as a MemoryPolicy's pass installs
it: the agent, pressure relief with thresholds never reached, replication, and the pass' read of
the workers' holdings. Then, against the same cluster state read before memops came:

- the scheduler's AMM holds the same policy objects (the stock ReduceReplicas, the very object);
- ReduceReplicas' decisions and the AMM's log lines for one run are the same, decided without
  enacting them (``measure: managed``, so that the workers' memory holds still between the two);
- ``retire_workers`` from a Dask client returns what it returns on a stock scheduler, and the
  retired worker's data survives;
- the scheduler logged no warning and no error.

With a rule in force, the same holds except for the ruled keys: ReduceReplicas no longer decides
them, and the AMM holds a ReduceReplicas that logs as the stock one; removing the rules puts the
stock object back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

import distributed
import pytest
from distributed import Client, LocalCluster, Scheduler
from distributed.active_memory_manager import ActiveMemoryManagerPolicy, ReduceReplicas
from memops_sandbox import dask_direct

from memops.clients import daskcomm, daskrpc
from memops.scheduler import replication

OWNER = "default/stock"
NO_RULE: dict[str, Any] = {"default": 1, "keys": [], "pods": []}
A_RULE: dict[str, Any] = {"default": 1, "keys": [{"prefix": "ruled", "replicas": 2}], "maxReplicatedFraction": 0.5}
WORKERS = 4
STOCK_WARNINGS = (
    "Event loop was unresponsive",  # this machine's load
    "Received heartbeat from unregistered worker",  # a retired worker's last heartbeat, on stock Dask too
)


pytestmark = pytest.mark.dask_cluster(
    workers=WORKERS,
    config={
        # Driven by hand, and by a measure that heartbeats do not move: the same cluster
        # state gives the same decisions, before memops and after.
        "distributed.scheduler.active-memory-manager.start": False,
        "distributed.scheduler.active-memory-manager.measure": "managed",
    },
    wait=True,
)


class Warnings(logging.Handler):
    """Every record of WARNING or above that the scheduler's process logs."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if not message.startswith(STOCK_WARNINGS):
            self.records.append(f"{record.name} {record.levelname} {message}")


@contextlib.contextmanager
def scheduler_warnings() -> Iterator[list[str]]:
    handler = Warnings()
    loggers = [logging.getLogger(), logging.getLogger("distributed")]  # "distributed" does not propagate
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield handler.records
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


def decide(amm: Any) -> tuple[dict[str, tuple[list[str], list[str]]], list[str]]:
    """One run of the scheduler's AMM, decided but not enacted (``run_once`` without its last
    step): the replicas each key would gain and lose, and the AMM's log lines of that run."""
    lines: list[str] = []

    class Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = Lines(logging.DEBUG)
    logger = logging.getLogger("distributed.active_memory_manager")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    amm.pending = {}
    amm.workers_memory = {ws: getattr(ws.memory, amm.measure) for ws in amm.scheduler.workers.values()}
    try:
        amm._run_policies()
        decisions = {
            str(ts.key): (sorted(ws.address for ws in add), sorted(ws.address for ws in drop))
            for ts, (add, drop) in amm.pending.items()
        }
    finally:
        del amm.pending, amm.workers_memory
        logger.removeHandler(handler)
        logger.setLevel(level)
    return decisions, lines


async def holdings(local: LocalCluster, client: Client) -> list[distributed.Future]:
    """Each worker holds data of its own size (so that the AMM's choices have no ties), ``x`` is
    on every worker (ReduceReplicas drops 3 copies), ``ruled-1`` too, and ``alone-<i>`` only on
    worker i (what a retirement must move)."""
    workers = sorted(local.scheduler.workers)
    futures: list[distributed.Future] = []
    for i, address in enumerate(workers):
        data = {f"size-{i}": os.urandom(2**16 * (i + 1)), f"alone-{i}": os.urandom(1000)}
        futures += (await client.scatter(data, workers=[address])).values()
    futures += (await client.scatter({"x": os.urandom(1000), "ruled-1": os.urandom(1000)}, broadcast=True)).values()
    await distributed.wait(futures)
    return futures  # held by the test, so that the scheduler keeps the data


async def install(address: str, rules: dict[str, Any]) -> None:
    """As a MemoryPolicy's pass does: its read of the holdings, relief, replication."""
    await dask_direct.fetch_snapshot(address)
    assert await dask_direct.configure_relief(address, above=0.99, to=0.98, owner=OWNER) is not None
    assert await dask_direct.configure_replication(address, rules=rules, places={}, owner=OWNER) is not None


async def retire(client: Client, worker: str) -> None:
    """As a Dask user retires a worker: it is retired, and what it alone held survives."""
    alone = [k for k, holders in (await client.scheduler.who_has()).items() if list(holders) == [worker]]
    assert alone
    assert list(await client.retire_workers([worker])) == [worker]
    who_has = await client.scheduler.who_has(keys=alone)
    assert all(who_has[k] and worker not in who_has[k] for k in alone), who_has


async def test_memops_installed_with_no_rule_changes_nothing_a_dask_user_sees(
    cluster: tuple[LocalCluster, Client],
) -> None:
    local, client = cluster
    scheduler = local.scheduler
    assert scheduler is not None
    amm = scheduler.extensions["amm"]
    stock = set(amm.policies)
    workers = sorted(scheduler.workers)
    data = await holdings(local, client)
    decisions, lines = decide(amm)
    assert decisions["x"][1] and decisions["ruled-1"][1], "the state gives ReduceReplicas drops to decide"
    assert "Running policy: ReduceReplicas()" in lines
    await retire(client, workers[0])  # stock: what a Dask user gets
    decisions, lines = decide(amm)

    with scheduler_warnings() as warned:
        await install(scheduler.address, NO_RULE)
        await install(scheduler.address, NO_RULE)  # the next pass
        assert amm.policies == stock and all(type(p) is ReduceReplicas for p in amm.policies)
        assert decide(amm) == (decisions, lines)
        assert not scheduler.plugins[replication.NAME].manager.running, "no replication pass"
        await retire(client, workers[1])
    assert warned == []
    assert len(data) == 4 * 2 + 2


async def test_memops_with_a_rule_changes_nothing_but_the_ruled_keys(cluster: tuple[LocalCluster, Client]) -> None:
    local, client = cluster
    scheduler = local.scheduler
    assert scheduler is not None
    amm = scheduler.extensions["amm"]
    stock = set(amm.policies)
    workers = sorted(scheduler.workers)
    data = await holdings(local, client)
    decisions, lines = decide(amm)

    def unruled(lines: list[str]) -> list[str]:
        # The summary counts the ruled key's drops that ReduceReplicas asked for.
        return [line for line in lines if "ruled-1" not in line and "superfluous replicas" not in line]

    with scheduler_warnings() as warned:
        await install(scheduler.address, A_RULE)
        policies = set(amm.policies)
        assert len(policies) == len(stock) and all(isinstance(p, ReduceReplicas) for p in policies)
        assert [repr(p) for p in policies] == [repr(p) for p in stock] == ["ReduceReplicas()"] * len(stock)
        # Stops the replication pass: the rule stays in force in ReduceReplicas' stead, but the
        # state holds still while the two are compared.
        scheduler.plugins[replication.NAME].manager.stop()
        ruled_decisions, ruled_lines = decide(amm)
        assert "ruled-1" not in ruled_decisions
        assert ruled_decisions == {k: v for k, v in decisions.items() if k != "ruled-1"}
        assert unruled(ruled_lines) == unruled(lines)
        assert any("superfluous replicas" in line for line in ruled_lines)
        await retire(client, workers[0])
        # No rule in force again: the stock objects, where they were.
        await install(scheduler.address, NO_RULE)
        assert amm.policies == stock
        await install(scheduler.address, A_RULE)
        assert await dask_direct.configure_replication(scheduler.address, rules=None, places={}, owner=OWNER) is None
        assert amm.policies == stock
    assert warned == []
    assert len(data) == 4 * 2 + 2


@pytest.mark.parametrize("how", ["cancelled", "scheduler-closing"])
async def test_a_pass_waiting_on_the_scheduler_ends_within_a_second(how: str) -> None:
    """A pass' call that the scheduler has not answered yet (here its first question, whether the
    agent is there, held forever) ends within a second when the pass is cancelled (the operator
    stopping) or the scheduler closes; it does not wait for its own timeout."""

    asked = asyncio.Event()

    async def never(**_: Any) -> None:
        asked.set()
        await asyncio.sleep(3600)

    async with Scheduler(host="127.0.0.1", port=0, dashboard_address=":0") as scheduler:
        scheduler.handlers["events"] = never
        call = asyncio.create_task(
            dask_direct.configure_replication(scheduler.address, rules=NO_RULE, places={}, owner=OWNER, timeout=60)
        )
        await asyncio.wait_for(asked.wait(), 10)  # the call is in the scheduler's hands
        started = time.monotonic()
        if how == "cancelled":
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
        else:
            closing = asyncio.create_task(scheduler.close())
            with pytest.raises(daskrpc.SchedulerUnreachable):
                await call
            await closing
        assert time.monotonic() - started < 1.0


@pytest.mark.parametrize(
    ("events", "version"),
    [
        pytest.param([], None, id="never-installed"),
        pytest.param(
            [[1.0, {"action": "installed", "agent": 6}], [2.0, {"action": "installed", "agent": 7}]], 7, id="last"
        ),
        pytest.param([[1.0, {"agent": 7}], [2.0, "noise"], [3.0, {"agent": True}], [4]], 7, id="noise-skipped"),
    ],
)
def test_the_agents_marker_is_read_from_plain_events(events: list[Any], version: int | None) -> None:
    assert daskrpc._installed_version(events) == version


def test_a_reply_to_events_that_no_scheduler_sends_is_refused() -> None:
    with pytest.raises(daskcomm.Misbehaved):
        daskrpc._installed_version({"agent": 7})


async def test_an_older_agents_wrapper_gives_the_stock_policy_back() -> None:
    """A scheduler where an older operator's agent put its wrapper (``SkipRuled``, holding the stock
    policy as ``inner``): this agent finds the stock object in it, whatever the wrapper's class."""

    class SkipRuled(ActiveMemoryManagerPolicy):  # as the older agent defined it
        def __init__(self, inner: ReduceReplicas, replication: Any):
            self.inner, self.replication = inner, replication

        def run(self) -> Any:
            yield from ()

    async with Scheduler(host="127.0.0.1", port=0, dashboard_address=":0") as scheduler:
        amm = scheduler.extensions["amm"]
        [stock] = amm.policies
        amm.policies.discard(stock)
        amm.add_policy(SkipRuled(stock, None))
        replication.configure(scheduler, A_RULE, {}, OWNER)
        [deferring] = amm.policies
        assert isinstance(deferring, replication.DeferRuled) and deferring.memops_stock is stock
        replication.configure(scheduler, NO_RULE, {}, OWNER)
        assert amm.policies == {stock}
