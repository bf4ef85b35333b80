"""Passes inside the scheduler stay short however much there is to do, and still get it all done.

memops' drain of many keys at once, and replication after a rule over many keys. A real
``distributed.Scheduler``'s bookkeeping (constructed, not started: no worker process), fed as
``bench/scale.py`` feeds it; passes run one after the other, and every copy that a pass asks for
lands before the next (``add_replica``, as a recipient's ``add-keys`` does). What a pass may spend
is set so that what it does does not depend on the machine's speed: the drain's time budget to
nothing (a pass then serves one drained worker, and of it one slice of keys), replication's
measured cost of a key to a second (a pass then hands over its minimum of keys).
"""

from __future__ import annotations

import asyncio
from typing import Any

import dask
import pytest
from distributed import Scheduler
from distributed.core import Status
from distributed.scheduler import TaskGroup, TaskPrefix, TaskState, WorkerState

from memops.scheduler import drain, replication
from memops.scheduler import rules as ruling

WORKERS = 12
DRAINED = 4
KEYS_PER_WORKER = 600  # more than a slice (drain._SLICE) per drained worker


class Stream:
    """A worker's batched stream as the drain writes to it: what it asks is kept, to be enacted."""

    def __init__(self, address: str, sent: list[tuple[str, dict[str, Any]]]):
        self.address, self.sent = address, sent

    def send(self, *messages: dict[str, Any]) -> None:
        self.sent.extend((self.address, m) for m in messages)

    def closed(self) -> bool:
        return True

    def abort(self) -> None:
        pass


def build(sent: list[tuple[str, dict[str, Any]]]) -> Scheduler:
    with dask.config.set({"distributed.scheduler.active-memory-manager.start": False}):
        scheduler = Scheduler(dashboard=False, dashboard_address="127.0.0.1:0", validate=False)
    prefix = TaskPrefix("x")
    for i in range(WORKERS):
        address = f"tcp://10.0.0.{i}:8786"
        ws = WorkerState(
            address=address,
            status=Status.running,
            pid=0,
            name=f"w-{i}",
            memory_limit=2**34,
            local_directory="",
            nanny=None,
            server_id=f"server-{i}",
            scheduler=scheduler,
        )
        ws.metrics = {"memory": 0, "spilled_bytes": {"memory": 0, "disk": 0}}
        scheduler.workers[address] = ws
        scheduler.running.add(ws)
        scheduler.stream_comms[address] = Stream(address, sent)  # type: ignore[assignment]
        group = TaskGroup(f"x-{i}", prefix)
        for k in range(KEYS_PER_WORKER):
            ts = TaskState((f"x-{i}", k), None, "memory", group, False)
            ts.nbytes = 1000
            scheduler.tasks[ts.key] = ts
            scheduler.add_replica(ts, ws)
    return scheduler


def asked(sent: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, Any]]:
    return [(a, key) for a, m in sent if m.get("op") == "acquire-replicas" for key in m["who_has"]]


async def test_a_pass_out_of_time_asks_one_slice_yet_every_drained_worker_finishes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # raising=False: before the budget existed, a pass asked for every key of every drained worker.
    monkeypatch.setattr(drain, "PASS_SECONDS", 0.0, raising=False)
    # As the pass reads it: a test before this one that sent the agent by value to an in-process
    # scheduler left the drain's methods reading a copy of the module's globals (cloudpickle).
    monkeypatch.setitem(drain.DrainPlugin.step.__globals__, "PASS_SECONDS", 0.0)
    sent: list[tuple[str, dict[str, Any]]] = []
    scheduler = build(sent)
    try:
        plugin = drain.DrainPlugin(scheduler)
        plugin.handover = False  # no worker to ask where its keys are spilled
        plugin.task = asyncio.get_running_loop().create_future()  # its own loop not started: passes run here
        drained = list(scheduler.workers)[:DRAINED]
        plugin.add(drained, 600.0, {}, close=False, restore=True)
        passes, first = 0, None
        while any(d.state == drain.State.DRAINING for d in plugin.workers.values()):
            assert passes < 100, "the drains did not finish"
            sent.clear()
            await plugin.step()
            passes += 1
            copies = asked(sent)
            if first is None:
                first = copies
            for address, key in copies:
                ts, ws = scheduler.tasks[key], scheduler.workers[address]
                assert ws.address not in drained
                scheduler.add_replica(ts, ws)
        assert first is not None
        sources = {ts.key[0] for ts in (scheduler.tasks[key] for _, key in first)}
        assert len(sources) == 1, "a pass out of time serves one drained worker"
        assert 0 < len(first) <= drain._SLICE, "and of it one slice of keys"
        assert {d.state for d in plugin.workers.values()} == {drain.State.DONE}
        for address in drained:
            for ts in scheduler.workers[address].has_what:
                assert any(ws.address not in drained for ws in ts.who_has or ()), ts
        assert passes > DRAINED
    finally:
        plugin.task.cancel()
        await scheduler.close()
        scheduler.http_server.stop()  # listening since construction; close() stops only a started scheduler's


async def test_a_key_on_its_way_at_the_deadline_that_lands_after_it_is_moved_not_lost() -> None:
    """At its deadline a drain counts as lost every key only the drained worker holds, those on
    their way included; one of those that lands afterwards is counted moved and no longer lost,
    so that moved and lost always add up to the keys the worker alone held."""
    sent: list[tuple[str, dict[str, Any]]] = []
    scheduler = build(sent)
    try:
        plugin = drain.DrainPlugin(scheduler)
        plugin.handover = False
        plugin.task = asyncio.get_running_loop().create_future()
        dying = next(iter(scheduler.workers))
        plugin.add([dying], 600.0, {}, close=False, restore=True)
        await plugin.step()
        on_the_way = asked(sent)
        assert on_the_way, "the first pass asked for copies"
        plugin.workers[dying].deadline = 0.0  # long past
        await plugin.step()
        report = plugin.report([dying])[dying]
        assert report["state"] == drain.State.DEADLINE
        assert report["lostAtDeadline"]["keys"] == KEYS_PER_WORKER - report["keysMoved"]
        for address, key in on_the_way:  # they land after the deadline
            scheduler.add_replica(scheduler.tasks[key], scheduler.workers[address])
        await plugin.step()
        report = plugin.report([dying])[dying]
        assert report["keysMoved"] == len(on_the_way)
        assert report["lostAtDeadline"]["keys"] == KEYS_PER_WORKER - len(on_the_way)
        assert report["lostAtDeadline"]["bytes"] == 1000 * (KEYS_PER_WORKER - len(on_the_way))
    finally:
        plugin.task.cancel()
        await scheduler.close()
        scheduler.http_server.stop()


async def test_a_pass_out_of_time_still_finds_no_recipients_for_every_drained_worker_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every worker drained (a retirement of all of them): none can take the others' keys, so each
    is set back to running, as stock, in the same pass. (Before: a pass out of time set back one
    worker, and the next pass gave the other workers' keys to it, then closed them.)"""
    monkeypatch.setattr(drain, "PASS_SECONDS", 0.0)
    monkeypatch.setitem(drain.DrainPlugin.step.__globals__, "PASS_SECONDS", 0.0)
    sent: list[tuple[str, dict[str, Any]]] = []
    scheduler = build(sent)
    try:
        plugin = drain.DrainPlugin(scheduler)
        plugin.handover = False
        plugin.task = asyncio.get_running_loop().create_future()
        plugin.add(list(scheduler.workers), 600.0, {}, close=False, restore=True)
        for _ in range(3):
            await plugin.step()
        assert asked(sent) == [], "no key asked for: there is nowhere to put it"
        assert {d.state for d in plugin.workers.values()} == {drain.State.NO_RECIPIENTS}
        assert {ws.status for ws in scheduler.workers.values()} == {Status.running}
    finally:
        plugin.task.cancel()
        await scheduler.close()
        scheduler.http_server.stop()


class Manager:
    """What :class:`~memops.scheduler.replication.Replication` reads of its AMM."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler


def replication_pass(policy: replication.Replication, scheduler: Scheduler) -> list[tuple[str, Any, Any]]:
    """One pass as an AMM runs a policy, every suggestion taken (its candidate); what it suggested."""
    policy.next_pass = 0.0
    taken: list[tuple[str, Any, Any]] = []
    suggestions = policy.run()
    answer = None
    while True:
        try:
            suggestion = suggestions.send(answer)
        except StopIteration:
            return taken
        answer = next(iter(suggestion.candidates))
        taken.append((suggestion.op, suggestion.ts, answer))


async def test_a_pass_after_a_rule_over_every_key_hands_over_its_minimum_yet_every_key_reaches_its_target() -> None:
    scheduler = build([])
    policy = replication.Replication(
        ruling.parse({"keys": [{"prefix": "x", "replicas": 2}], "maxReplicatedFraction": 0.9}), {}
    )
    policy.manager = Manager(scheduler)  # type: ignore[assignment]
    try:
        # Before a pass measured it, a key handed over costs a second: a pass hands over its minimum.
        policy.item_seconds = 1.0
        first: list[tuple[str, Any, Any]] | None = None
        for _ in range(1000):
            taken = replication_pass(policy, scheduler)
            if first is None and taken:
                first = taken
            for op, ts, ws in taken:
                assert op == "replicate"
                scheduler.add_replica(ts, ws)
            if all(len(ts.who_has or ()) == 2 for ts in scheduler.tasks.values()):
                break
        assert first is not None
        assert 0 < len(first) <= replication.MIN_ITEMS_PER_PASS
        assert all(len(ts.who_has or ()) == 2 for ts in scheduler.tasks.values())
    finally:
        policy.index.detach()
        await scheduler.close()
        scheduler.http_server.stop()
