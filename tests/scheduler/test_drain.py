"""memops' drain with a deadline: its pure choices, then on a real scheduler with real workers.

The drain is started over the comm through memops' agent, as the operator and the preStop hook
do; what moved is read from each worker's own transfer log (``transfer_incoming_log``: every key
it received, by whom), so "each key once" counts what the workers did, not what the drain says.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any

import dask
import distributed
import pytest
from distributed import Client, LocalCluster
from memops_sandbox import dask_direct

from memops.scheduler import drain
from tests import polling

MiB = 2**20


# -- pure choices --------------------------------------------------------------------------------


def key(name: str, nbytes: int = MiB, irreplaceable: bool = False, seconds: float = 0.0) -> drain.Key:
    return drain.Key(name, nbytes, irreplaceable, seconds)


@pytest.mark.parametrize(
    "keys, expected",
    [
        pytest.param([key("a"), key("s", irreplaceable=True)], ["s", "a"], id="scattered-first"),
        pytest.param(
            [key("cheap", seconds=0.1), key("dear", seconds=10.0), key("unknown")],
            ["dear", "cheap", "unknown"],
            id="recompute-seconds-per-byte",
        ),
        pytest.param(
            [key("big", nbytes=10 * MiB, seconds=10.0), key("small", nbytes=MiB, seconds=2.0)],
            ["small", "big"],
            id="per-byte-not-per-key",
        ),
        pytest.param(
            [key("b", irreplaceable=True, nbytes=2 * MiB), key("a", irreplaceable=True, nbytes=MiB)],
            ["a", "b"],
            id="ties-smallest-first",
        ),
        pytest.param(
            [key("dear", seconds=100.0), key("s", nbytes=100 * MiB, irreplaceable=True)],
            ["s", "dear"],
            id="irreplaceable-beats-any-cost",
        ),
    ],
)
def test_rank(keys: list[drain.Key], expected: list[str]) -> None:
    assert [k.key for k in drain.rank(keys)] == expected


def recipient(
    name: str,
    node: str | None,
    headroom: int = 100 * MiB,
    window: int = drain.WINDOW_BYTES,
    room: int | None = None,
    queued: int = 0,
) -> drain.Recipient:
    return drain.Recipient(name, node, headroom, window, room=room, queued=queued)


@pytest.mark.parametrize(
    "keys, recipients, expected, unplaced",
    [
        pytest.param(
            [key("k1"), key("k2"), key("k3"), key("k4")],
            [recipient("x", "n2"), recipient("y", "n3")],
            [("k1", "x"), ("k2", "y"), ("k3", "x"), ("k4", "y")],
            [],
            id="spread-over-equal-recipients",
        ),
        pytest.param(
            [key("k1"), key("k2"), key("k3")],
            [recipient("x", "n2", headroom=10 * MiB), recipient("y", "n3", headroom=11 * MiB)],
            [("k1", "y"), ("k2", "x"), ("k3", "y")],
            [],
            id="by-headroom-counting-what-it-was-given",
        ),
        pytest.param(
            [key("k1"), key("k2"), key("k3"), key("k4")],
            [recipient("x", "n2", headroom=1000 * MiB, room=500 * MiB), recipient("y", "n3", room=50 * MiB)],
            [("k1", "x"), ("k2", "y"), ("k3", "x"), ("k4", "y")],
            [],
            id="equal-shares-below-the-target-whatever-the-headroom",
        ),
        pytest.param(
            [key("k1"), key("k2"), key("k3")],
            [recipient("x", "n2", queued=2 * MiB), recipient("y", "n3", headroom=99 * MiB)],
            [("k1", "y"), ("k2", "y"), ("k3", "x")],
            [],
            id="bytes-already-on-their-way-count",
        ),
        pytest.param(
            [key("k1"), key("k2"), key("k3")],
            [recipient("x", "n2", headroom=10 * MiB, room=MiB), recipient("y", "n3", headroom=50 * MiB, room=0)],
            [("k1", "x"), ("k2", "y"), ("k3", "y")],
            [],
            id="above-its-target-the-most-headroom-takes-it",
        ),
        pytest.param(
            [key("k1"), key("k2")],
            [recipient("same", "n1", headroom=1000 * MiB), recipient("other", "n2")],
            [("k1", "other"), ("k2", "other")],
            [],
            id="off-the-dying-node-first",
        ),
        pytest.param(
            [key("k1"), key("k2")],
            [recipient("same", "n1"), recipient("unknown", None, headroom=MiB)],
            [("k1", "unknown"), ("k2", "same")],
            [],
            id="no-node-counts-as-another-node-and-the-dying-node-last",
        ),
        pytest.param(
            [key("huge", nbytes=200 * MiB), key("k1")],
            [recipient("x", "n2")],
            [("k1", "x")],
            ["huge"],
            id="too-large-for-every-headroom",
        ),
        pytest.param(
            [key("k1", nbytes=3 * MiB), key("k2", nbytes=3 * MiB)],
            [recipient("x", "n2", window=4 * MiB)],
            [("k1", "x")],
            [],
            id="window-full-the-rest-waits",
        ),
        pytest.param(
            [key("k1", nbytes=3 * MiB), key("k2", nbytes=3 * MiB), key("k3", nbytes=3 * MiB)],
            [recipient("other", "n2", window=4 * MiB), recipient("same", "n1", headroom=1000 * MiB)],
            [("k1", "other")],
            [],
            id="a-full-window-off-the-dying-node-makes-keys-wait-not-go-to-it",
        ),
        pytest.param(
            [key("k1", nbytes=3 * MiB), key("k2", nbytes=3 * MiB)],
            [recipient("other", "n2", headroom=4 * MiB), recipient("same", "n1")],
            [("k1", "other"), ("k2", "same")],
            [],
            id="no-headroom-off-the-dying-node-then-the-dying-node",
        ),
        pytest.param(
            [key("k1", nbytes=300 * MiB)],
            [recipient("x", "n2", headroom=1000 * MiB)],
            [("k1", "x")],
            [],
            id="a-key-larger-than-the-window-goes-alone",
        ),
        pytest.param([key("k1")], [], [], ["k1"], id="no-recipients"),
    ],
)
def test_assign(
    keys: list[drain.Key], recipients: list[drain.Recipient], expected: list[tuple[str, str]], unplaced: list[str]
) -> None:
    assert drain.assign(keys, recipients, {"n1"}) == (expected, unplaced)


# -- on a real scheduler -------------------------------------------------------------------------


pytestmark = pytest.mark.dask_cluster(
    workers=4, config={"distributed.scheduler.active-memory-manager.start": True}, memory_limit="1GiB"
)


async def received(client: Client) -> dict[str, collections.Counter[str]]:
    """Worker -> how many times it received each key (its transfer log)."""

    def log(dask_worker: Any) -> list[str]:
        return [str(k) for entry in dask_worker.transfer_incoming_log for k in entry["keys"]]

    return {w: collections.Counter(keys) for w, keys in (await client.run(log)).items()}


async def until_finished(address: str, worker: str, bound: float = 60) -> dict[str, Any]:
    async def finished() -> dict[str, Any] | None:
        state = (await dask_direct.drain_status(address, [worker]))[worker]
        return dict(state) if state["state"] != drain.State.DRAINING else None

    return await polling.poll(finished, timeout=bound, what=f"the drain of {worker} to end", interval=0.05)


async def test_each_key_moves_once_to_recipients_off_the_dying_node(cluster: tuple[LocalCluster, Client]) -> None:
    """Every unique key of the drained worker is received exactly once, by workers on other
    nodes only, spread over both; then the worker is closed, and every key is intact."""
    local, client = cluster
    dying, neighbour, far1, far2 = sorted(local.scheduler.workers)
    nodes = {dying: "n1", neighbour: "n1", far1: "n2", far2: "n3"}
    data = await client.scatter({f"k{i}": b"x" * (256 * 1024) for i in range(400)}, workers=[dying], hash=False)
    await dask_direct.start_drain(local.scheduler_address, [dying], deadline=60, nodes=nodes)
    state = await until_finished(local.scheduler_address, dying)
    assert state["state"] == drain.State.DONE and state["keysMoved"] == 400 and state["asked"] == 400
    counts = await received(client)
    assert dying not in counts  # closed
    total = sum(counts.values(), collections.Counter())
    assert set(total) == set(data) and set(total.values()) == {1}, "each key received once"
    assert not counts[neighbour], "nothing to the dying node"
    assert min(sum(counts[far1].values()), sum(counts[far2].values())) >= 150, "spread, not one recipient"
    assert await client.gather(list(data.values())) == [b"x" * (256 * 1024)] * 400


def make(i: int, base: bytes) -> bytes:
    return bytes([i % 256]) * MiB


async def test_a_short_deadline_moves_the_keys_that_cannot_be_recomputed_first(
    cluster: tuple[LocalCluster, Client],
) -> None:
    """One key on its way at a time (a 1-byte window), and a deadline too short for every key:
    the scattered keys move first, the computed ones (whose input is still in memory) are left,
    reported lost at the deadline, and the worker is set back to running (``restore``)."""
    local, client = cluster
    dying, _, other, _ = sorted(local.scheduler.workers)
    base = await client.scatter(b"base", workers=[other])
    computed = client.map(make, range(150), base=base, workers=[dying], allow_other_workers=False, pure=False)
    await distributed.wait(computed)
    scattered = await client.scatter({f"s{i}": b"s" * MiB for i in range(5)}, workers=[dying], hash=False)
    # The drained worker fetched base for its tasks; the Active Memory Manager would drop one of
    # the two replicas meanwhile, and base would be one more key that only the drained worker holds.
    await client.amm.stop()
    ws = local.scheduler.workers[dying]
    alone = sum(1 for ts in ws.has_what if ts.who_has == {ws})
    assert alone == 155, alone
    await dask_direct.start_drain(local.scheduler_address, [dying], deadline=1.0, restore=True, window=1)
    state = await until_finished(local.scheduler_address, dying)
    assert state["state"] == drain.State.DEADLINE
    assert 0.9 < state["seconds"] < 2.0, "stopped at its deadline"
    counts = await received(client)
    moved = set(sum((c for w, c in counts.items() if w != dying), collections.Counter()))
    assert set(scattered) <= moved, "the keys that cannot be recomputed went first"
    lost = state["lostAtDeadline"]
    assert 0 < lost["keys"] == alone - state["keysMoved"] and lost["irreplaceableKeys"] == 0
    assert lost["bytes"] == lost["keys"] * MiB and lost["cause"] == "deadline"
    assert state["origin"] == "" and abs(state["endedAt"] - time.time()) < 60, "the operator's drain, stopped now"
    # What the report says is lost is what only the drained worker holds, but for the keys on
    # their way at the deadline (a 1-byte window: one per recipient), which may have landed since.
    only_there = [ts.key for ts in local.scheduler.workers[dying].has_what if len(ts.who_has) == 1]
    assert lost["keys"] - 3 <= len(only_there) <= lost["keys"]

    async def running_again() -> bool:
        return local.scheduler.workers[dying].status.name == "running"

    await polling.poll(running_again, timeout=10, what="the worker running again", interval=0.05)
    assert len(await client.gather(computed)) == 150


async def test_retire_workers_drains_with_memops_where_the_agent_runs(cluster: tuple[LocalCluster, Client]) -> None:
    """dask_direct.retire_workers, as the RetirementRequest controller calls it: memops' drain, the
    worker retired, its keys received once each, all intact."""
    local, client = cluster
    a, *_ = sorted(local.scheduler.workers)
    data = await client.scatter({f"r{i}": b"r" * (128 * 1024) for i in range(200)}, workers=[a], hash=False)
    outcome = await dask_direct.retire_workers(local.scheduler_address, [a], timeout=60)
    assert outcome.by_memops and outcome.retired == (a,) and not outcome.timed_out and not outcome.lost_at_deadline
    total = sum((await received(client)).values(), collections.Counter())
    assert set(total) == set(data) and set(total.values()) == {1}
    assert len(await client.gather(list(data.values()))) == 200


def pause(dask_worker: Any) -> None:
    """Run on a worker: its own memory monitor pauses it within 100 ms (any process is above 1e-9),
    so the scheduler no longer counts it as running, and a drain gives it nothing."""
    dask_worker.memory_manager.memory_pause_fraction = 1e-9


async def pause_all(local: LocalCluster, client: Client, workers: list[str]) -> None:
    """Pause ``workers`` and wait until the scheduler no longer counts them as running."""
    await client.run(pause, workers=workers)
    await polling.poll(
        lambda: not {local.scheduler.workers[w] for w in workers} & local.scheduler.running, timeout=10, interval=0.05
    )


def resume(dask_worker: Any) -> None:
    """Run on a worker: its memory monitor resumes it, back under the configured threshold."""
    dask_worker.memory_manager.memory_pause_fraction = dask.config.get("distributed.worker.memory.pause")


async def test_a_hook_keeps_keys_off_its_nodes_other_workers_where_the_operator_located_them(
    cluster: tuple[LocalCluster, Client],
) -> None:
    """A preStop hook names only its own worker and node. The operator's pass has told the agent
    where every worker runs (with the drains' read, as the policy does), so the neighbour on the
    same node, whose own hook has not started yet, takes nothing: without that, even shares would
    give it a third of the keys, which its own hook would move again. Workers that left are not
    remembered."""
    local, client = cluster
    dying, neighbour, far1, far2 = sorted(local.scheduler.workers)
    gone = "tcp://192.0.2.1:1"  # a worker the operator's pods still show, the scheduler no longer
    located = {dying: "n1", neighbour: "n1", far1: "n2", far2: "n3", gone: "n4"}
    await dask_direct.fetch_snapshot(local.scheduler_address, keys=False, drains=True, nodes=lambda: located)
    assert local.scheduler.plugins[drain.NAME].nodes == {a: n for a, n in located.items() if a != gone}
    name = str(local.scheduler.workers[dying].name)
    data = await client.scatter({f"h{i}": b"h" * (256 * 1024) for i in range(120)}, workers=[dying], hash=False)
    await dask_direct.start_drain(
        local.scheduler_address, names=[name], deadline=60, nodes={name: "n1"}, origin="preStop"
    )
    state = await until_finished(local.scheduler_address, dying)
    assert state["state"] == drain.State.DONE and state["keysMoved"] == 120
    counts = await received(client)
    assert not counts[neighbour], "nothing to the other worker of the dying node"
    total = sum(counts.values(), collections.Counter())
    assert set(total) == set(data) and set(total.values()) == {1}
    assert min(sum(counts[far1].values()), sum(counts[far2].values())) >= 40, "spread over the other nodes"


async def test_a_node_said_dying_by_any_caller_stays_dying(cluster: tuple[LocalCluster, Client]) -> None:
    """The operator's ordinary retirement drains a worker (its node stays), then a preStop hook or a
    node drain says that the node is dying, then an ordinary retirement again: the running drain
    treats the node as dying from the second call on, whatever the third says, and sends every key
    not yet asked for off it. The other workers are paused while the callers ask (nothing can be
    asked for yet); with the first or the last caller's word, the neighbour on the same node would
    take its share of the keys (as it does while its node stays: the keys spread by headroom)."""
    local, client = cluster
    dying, neighbour, far1, far2 = sorted(local.scheduler.workers)
    nodes = {dying: "n1", neighbour: "n1", far1: "n2", far2: "n3"}
    others = [neighbour, far1, far2]
    data = await client.scatter({f"d{i}": b"d" * (256 * 1024) for i in range(60)}, workers=[dying], hash=False)
    await pause_all(local, client, others)
    address = local.scheduler_address
    for nodes_dying in (False, True, False):
        await dask_direct.start_drain(address, [dying], deadline=60, nodes=nodes, nodes_dying=nodes_dying)
    # All three become recipients in the same pass of the drain (which runs on this event loop):
    # resumed one by one, the first would take every key alone. The scheduler hears it as from the
    # workers themselves; they fetch what they are asked once their own monitors resume them.
    for worker in others:
        local.scheduler.handle_worker_status_change("running", worker, stimulus_id="test-resume")
    await client.run(resume, workers=others)
    state = await until_finished(address, dying)
    assert state["state"] == drain.State.DONE and state["keysMoved"] == 60
    counts = await received(client)
    assert not counts[neighbour], "nothing to the dying node"
    total = sum(counts.values(), collections.Counter())
    assert set(total) == set(data) and set(total.values()) == {1}
    assert await client.gather(list(data.values())) == [b"d" * (256 * 1024)] * 60


async def test_a_retirement_waits_for_a_paused_recipient_before_it_gives_up(
    cluster: tuple[LocalCluster, Client],
) -> None:
    """An ordinary retirement (``restore``: set back if nothing can take the keys) starts while
    every other worker is paused, as a recipient that the drain itself filled is until it has
    spilled. It waits rather than give up at once: resumed a second later, they take every key.
    Then, with every other worker paused for good, the next one gives up after
    ``NO_RECIPIENT_SECONDS``, its worker back to running with its keys."""
    local, client = cluster
    address = local.scheduler_address
    first, *others = sorted(local.scheduler.workers)
    data = await client.scatter({f"p{i}": b"p" * (256 * 1024) for i in range(40)}, workers=[first], hash=False)
    await pause_all(local, client, others)
    await dask_direct.start_drain(address, [first], deadline=60, restore=True, nodes_dying=False)
    await asyncio.sleep(1.0)
    assert (await dask_direct.drain_status(address, [first]))[first]["state"] == drain.State.DRAINING, "it waits"
    await client.run(resume, workers=others)
    state = await until_finished(address, first)
    assert state["state"] == drain.State.DONE and state["keysMoved"] == 40
    assert await client.gather(list(data.values())) == [b"p" * (256 * 1024)] * 40

    second, *paused = others
    kept = await client.scatter({f"q{i}": b"q" * (256 * 1024) for i in range(10)}, workers=[second], hash=False)
    await pause_all(local, client, paused)
    await dask_direct.start_drain(address, [second], deadline=60, restore=True, nodes_dying=False)
    state = await until_finished(address, second)
    assert state["state"] == drain.State.NO_RECIPIENTS and state["keysMoved"] == 0
    assert state["seconds"] >= drain.NO_RECIPIENT_SECONDS - 0.1
    await polling.poll(lambda: local.scheduler.workers[second].status.name == "running", timeout=10, interval=0.05)
    assert {w for f in kept.values() for w in local.scheduler.tasks[f.key].who_has} == {local.scheduler.workers[second]}
    await client.run(resume, workers=paused)


async def test_the_shorter_deadline_of_two_callers_stops_the_drain(cluster: tuple[LocalCluster, Client]) -> None:
    """A RetirementRequest's drain (a minute), then a preStop hook's for the same worker (two
    seconds: the pod is killed at its end), then another caller's of thirty: the running drain
    stops at the hook's deadline and reports what it could not move. Nothing can move: every
    other worker is paused."""
    local, client = cluster
    dying, *others = sorted(local.scheduler.workers)
    data = await client.scatter({f"t{i}": b"t" * MiB for i in range(5)}, workers=[dying], hash=False)
    await pause_all(local, client, others)
    address = local.scheduler_address
    await dask_direct.start_drain(address, [dying], deadline=60, nodes_dying=False, restore=False)
    begun = time.monotonic()
    hook = await dask_direct.start_drain(address, [dying], deadline=2, origin="preStop")
    later = await dask_direct.start_drain(address, [dying], deadline=30, nodes_dying=False)
    assert hook[dying]["deadlineIn"] <= 2 and later[dying]["deadlineIn"] <= 2, "the earlier deadline, reported"
    state = await until_finished(address, dying, bound=20)
    assert state["state"] == drain.State.DEADLINE and time.monotonic() - begun < 5
    assert state["lostAtDeadline"]["keys"] == 5 and state["lostAtDeadline"]["cause"] == "deadline"
    assert state["origin"] == "", "the first caller's drain, shortened"
    await client.run(resume, workers=others)
    assert len(await client.gather(list(data.values()))) == 5, "kept: the worker stays"


async def test_a_copy_dropped_from_a_recipient_that_began_draining_too_is_asked_for_again(
    cluster: tuple[LocalCluster, Client],
) -> None:
    """A rollout drains the old pods one after the other while the new ones are still starting:
    the first drained worker's keys land on the only other running worker, which then begins its
    own drain. Each of those keys has two replicas, both on leaving workers, and the Active Memory
    Manager's ReduceReplicas drops one (from the worker using more memory, here the recipient).
    The first drain counted those keys as moved; it must see that they are again held only by it,
    and ask for them again once new workers run, rather than hold them until its deadline."""
    local, client = cluster
    first, second, new1, new2 = sorted(local.scheduler.workers)
    await client.amm.stop()  # the drop is made below, as ReduceReplicas makes it, at a known time
    news = [new1, new2]
    await pause_all(local, client, news)
    data = await client.scatter({f"r{i}": b"r" * (256 * 1024) for i in range(30)}, workers=[first], hash=False)
    address = local.scheduler_address
    # One key on its way at a time, so that the second drain begins while the first is under way.
    await dask_direct.start_drain(address, [first], deadline=60, window=1)
    seconds = local.scheduler.workers[second]
    plugin = local.scheduler.plugins[drain.NAME]
    await polling.poll(
        lambda: plugin.workers[first].keys_moved >= 3, timeout=20, what="keys copied to the second", interval=0.01
    )
    await dask_direct.start_drain(address, [second], deadline=60)
    await polling.poll(lambda: not plugin.copies, timeout=20, what="no copy on its way", interval=0.05)
    moved = [k for k in data if seconds in local.scheduler.tasks[k].who_has]
    assert len(moved) >= 3  # and one more may have landed after its drain gave it up (its target left running)
    local.scheduler.request_remove_replicas(second, moved, stimulus_id="test-reduce-replicas")
    firsts = local.scheduler.workers[first]
    await polling.poll(
        lambda: all(local.scheduler.tasks[k].who_has == {firsts} for k in moved),
        timeout=20,
        what="the second worker's replicas dropped",
        interval=0.05,
    )
    for worker in news:
        local.scheduler.handle_worker_status_change("running", worker, stimulus_id="test-resume")
    await client.run(resume, workers=news)
    # A copy that its drain gave up when the second worker left running may still land there
    # afterwards: the second drain then moves it, and the first counts it moved no more.
    assert (await until_finished(address, second, bound=30))["state"] == drain.State.DONE
    state = await until_finished(address, first, bound=30)
    assert state["state"] == drain.State.DONE and not state["lostAtDeadline"]
    assert len(moved) <= state["keysMoved"] <= 30, "a key copied twice counts once"
    news_ws = {local.scheduler.workers[w] for w in news}
    assert all(local.scheduler.tasks[k].who_has & news_ws for k in data), "every key on a new worker"
    assert await client.gather(list(data.values())) == [b"r" * (256 * 1024)] * 30


async def test_a_drain_whose_keys_all_left_while_nothing_could_take_them_ends_done(
    cluster: tuple[LocalCluster, Client],
) -> None:
    """A preStop hook's drain (nothing set back) while every other worker is paused: no recipient,
    so nothing is asked for. The client then releases every key: nothing is left to move, and the
    drain ends ``done`` at once. (Before: its order still named the keys, and with no recipient the
    pass never read it, so it drained until its deadline.)"""
    local, client = cluster
    dying, *others = sorted(local.scheduler.workers)
    data = await client.scatter({f"r{i}": b"r" * MiB for i in range(5)}, workers=[dying], hash=False)
    await pause_all(local, client, others)
    address = local.scheduler_address
    await dask_direct.start_drain(address, [dying], deadline=60, nodes_dying=False, restore=False)
    await asyncio.sleep(1.0)
    assert (await dask_direct.drain_status(address, [dying]))[dying]["state"] == drain.State.DRAINING, "nowhere to go"
    await client.cancel(list(data.values()))
    del data
    begun = time.monotonic()
    state = await until_finished(address, dying, bound=20)
    assert state["state"] == drain.State.DONE and state["keysMoved"] == 0, state
    assert time.monotonic() - begun < 10, "ended once its keys left, not at its deadline"
    await client.run(resume, workers=others)
