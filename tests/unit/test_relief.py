"""Pressure relief's choices on hand-built scheduler states (memops.scheduler.relief.choose), and what a
copy costs its recipient until a heartbeat shows it (landing_cost)."""

import pytest
from distributed.scheduler import MemoryState

from memops.scheduler.relief import LANDING, Key, Load, choose, landing_cost

MiB = 2**20
LIMIT = 1000 * MiB


def keys(worker: str, *sizes_mib: int, also_on: str | None = None) -> list[Key]:
    holders = (worker, also_on) if also_on else (worker,)
    return [Key(f"{worker}-{i}", size * MiB, holders) for i, size in enumerate(sizes_mib)]


def test_a_hot_worker_sheds_its_largest_keys_until_under_relieve_to() -> None:
    workers = [Load("hot", 800 * MiB, LIMIT), Load("a", 100 * MiB, LIMIT), Load("b", 300 * MiB, LIMIT)]
    plan = choose(workers, {"hot": keys("hot", 100, 200, 50, 10)}, above=0.7, to=0.55)
    assert plan.hot == ("hot",) and plan.starved == ()
    # 800 -> under 550 needs 250 MiB: the 200 MiB key, then the 100 MiB one; no more.
    assert [(k, src) for k, src, _ in plan.copies] == [("hot-1", "hot"), ("hot-0", "hot")]
    # Each goes to the peer with the most headroom at that moment.
    assert [dst for _, _, dst in plan.copies] == ["a", "a"]
    assert plan.drops == ()


def test_no_recipient_is_pushed_over_relieve_above() -> None:
    workers = [Load("hot", 900 * MiB, LIMIT), Load("a", 650 * MiB, LIMIT), Load("b", 600 * MiB, LIMIT)]
    plan = choose(workers, {"hot": keys("hot", 80, 60, 40)}, above=0.7, to=0.55)
    landed = {"a": 650 * MiB, "b": 600 * MiB}
    sizes = {k.key: k.nbytes for k in keys("hot", 80, 60, 40)}
    for key, _, recipient in plan.copies:
        landed[recipient] += sizes[key]
        assert landed[recipient] <= 0.7 * LIMIT
    # 80 fits only on b (600 + 80 = 680); then 60 fits nowhere (a: 710, b: 740); 40 fits on a.
    assert [(k, dst) for k, _, dst in plan.copies] == [("hot-0", "b"), ("hot-2", "a")]
    assert plan.starved == ("hot",), "it is still far over relieveTo: more workers are needed"


def test_recipients_are_projected_across_hot_workers_in_one_plan() -> None:
    """Two hot workers in one cycle share the one peer's headroom; neither pushes it over."""
    workers = [Load("h1", 900 * MiB, LIMIT), Load("h2", 850 * MiB, LIMIT), Load("a", 400 * MiB, LIMIT)]
    plan = choose(workers, {"h1": keys("h1", 200, 100, 100), "h2": keys("h2", 200, 100)}, above=0.7, to=0.55)
    # a takes 300 MiB from h1 (400 -> 700, exactly relieveAbove); nothing more fits, from either.
    assert [(k, dst) for k, _, dst in plan.copies] == [("h1-0", "a"), ("h1-1", "a")]
    assert plan.hot == ("h1", "h2") and plan.starved == ("h1", "h2")


def test_keys_that_have_a_copy_elsewhere_are_dropped_without_a_transfer() -> None:
    workers = [Load("hot", 800 * MiB, LIMIT), Load("a", 100 * MiB, LIMIT)]
    plan = choose(
        workers, {"hot": [*keys("hot", 300, also_on="a"), Key("single", 10 * MiB, ("hot",))]}, above=0.7, to=0.55
    )
    assert plan.drops == (("hot-0", "hot"),)
    assert plan.copies == ()


def test_a_copy_on_a_worker_being_retired_is_no_copy() -> None:
    workers = [Load("hot", 800 * MiB, LIMIT), Load("leaving", 100 * MiB, LIMIT, running=False, leaving=True)]
    plan = choose(workers, {"hot": keys("hot", 300, also_on="leaving")}, above=0.7, to=0.55)
    assert plan.drops == () and plan.copies == ()
    assert plan.starved == ("hot",), "the only peer is leaving: nowhere to go"


def test_starved_when_every_peer_is_full() -> None:
    workers = [Load("hot", 900 * MiB, LIMIT), Load("a", 690 * MiB, LIMIT)]
    plan = choose(workers, {"hot": keys("hot", 50, 50)}, above=0.7, to=0.55)
    assert plan.copies == () and plan.starved == ("hot",)


def test_a_worker_whose_memory_is_not_keys_is_hot_but_not_starved() -> None:
    """Moving keys cannot relieve unmanaged memory, and more workers would not help it."""
    workers = [Load("leaky", 900 * MiB, LIMIT), Load("a", 0, LIMIT)]
    plan = choose(workers, {"leaky": keys("leaky", 20)}, above=0.7, to=0.55)
    assert plan.copies == (("leaky-0", "leaky", "a"),)
    assert plan.hot == ("leaky",) and plan.starved == ()


@pytest.mark.parametrize(
    ("worker", "relieved", "copied"),
    [
        pytest.param(Load("w", 900 * MiB, LIMIT, running=False), True, True, id="paused-is-relieved"),
        pytest.param(
            Load("w", 900 * MiB, LIMIT, running=False, leaving=True), False, False, id="closing-is-left-alone"
        ),
        pytest.param(Load("w", 900 * MiB, 0), False, False, id="no-limit-is-left-alone"),
    ],
)
def test_which_workers_are_relieved(worker: Load, relieved: bool, copied: bool) -> None:
    workers = [worker, Load("a", 100 * MiB, LIMIT)]
    plan = choose(workers, {"w": keys("w", 400)}, above=0.7, to=0.55)
    assert (plan.hot == ("w",)) is relieved
    assert bool(plan.copies) is copied


@pytest.mark.parametrize(
    "recipient",
    [
        pytest.param(Load("r", 0, LIMIT, running=False), id="paused"),
        pytest.param(Load("r", 0, LIMIT, running=False, leaving=True), id="closing"),
        pytest.param(Load("r", 0, 0), id="no-limit"),
    ],
)
def test_paused_closing_and_unlimited_workers_are_sent_no_keys(recipient: Load) -> None:
    plan = choose([Load("hot", 800 * MiB, LIMIT), recipient], {"hot": keys("hot", 300)}, above=0.7, to=0.55)
    assert plan.copies == () and plan.starved == ("hot",)


def test_a_worker_relieved_a_short_while_ago_is_sent_no_keys() -> None:
    """Else a peer that relief filled would send keys back to the worker they came from."""
    workers = [Load("peer", 800 * MiB, LIMIT), Load("was-hot", 100 * MiB, LIMIT), Load("b", 650 * MiB, LIMIT)]
    plan = choose(workers, {"peer": keys("peer", 100)}, above=0.7, to=0.55, cooling={"was-hot"})
    assert plan.copies == () and plan.starved == ("peer",)
    assert choose(workers, {"peer": keys("peer", 100)}, above=0.7, to=0.55).copies == (("peer-0", "peer", "was-hot"),)


def test_relief_goes_on_until_relieve_to_once_started() -> None:
    """Between the thresholds a worker is relieved only if it went over relieveAbove first."""
    workers = [Load("w", 650 * MiB, LIMIT), Load("a", 0, LIMIT)]
    assert choose(workers, {"w": keys("w", 150)}, above=0.7, to=0.55) == choose(workers, {}, above=0.7, to=0.55)
    plan = choose(workers, {"w": keys("w", 150)}, above=0.7, to=0.55, relieving={"w"})
    assert plan.copies == (("w-0", "w", "a"),) and plan.hot == ("w",)
    # Under relieveTo it is done.
    done = choose([Load("w", 540 * MiB, LIMIT), workers[1]], {"w": keys("w", 150)}, above=0.7, to=0.55, relieving={"w"})
    assert done.hot == () and done.copies == ()
    # Between the thresholds with nothing left to move, it is let go.
    idle = choose(workers, {"w": []}, above=0.7, to=0.55, relieving={"w"})
    assert idle.hot == () and idle.starved == ()


def test_a_worker_under_relieve_above_is_not_touched_and_in_flight_relief_counts() -> None:
    workers = [Load("w", 690 * MiB, LIMIT), Load("a", 0, LIMIT)]
    assert choose(workers, {"w": keys("w", 300)}, above=0.7, to=0.55).copies == ()
    # 800 MiB reported, but 300 MiB already on their way off: it is no longer hot.
    hot = [Load("w", 800 * MiB, LIMIT), Load("a", 300 * MiB, LIMIT)]
    plan = choose(hot, {"w": keys("w", 300)}, above=0.7, to=0.55, freed={"w": 300 * MiB})
    assert plan.hot == () and plan.copies == ()
    # Bytes already coming to a peer count against its headroom.
    plan = choose(
        [*hot[:1], Load("a", 100 * MiB, LIMIT)], {"w": keys("w", 300)}, above=0.7, to=0.55, incoming={"a": 400 * MiB}
    )
    assert plan.copies == () and plan.starved == ("w",)


@pytest.mark.parametrize(
    "landed, heard, expected",
    [
        pytest.param(0.0, 100.0, LANDING, id="on-its-way"),
        pytest.param(101.0, 100.0, LANDING, id="landed-since-the-heartbeat"),
        pytest.param(99.0, 100.0, 0.0, id="a-heartbeat-shows-it"),
    ],
)
def test_a_copy_costs_its_recipient_in_full_until_a_heartbeat_shows_it(
    landed: float, heard: float, expected: float
) -> None:
    assert landing_cost(landed, heard) == expected


def test_the_schedulers_optimistic_memory_never_counts_a_key_landed_since_the_heartbeat() -> None:
    """Why landing_cost charges a landed key in full: the scheduler's managed memory has it at
    once, but ``optimistic`` is capped at the heartbeat's process memory, which predates it. So
    the larger of ``process`` and ``optimistic`` is always ``process``, which lacks the key."""
    before = MemoryState(process=300 * MiB, unmanaged_old=150 * MiB, managed=100 * MiB, spilled=0)
    after = MemoryState(process=300 * MiB, unmanaged_old=150 * MiB, managed=164 * MiB, spilled=0)  # +64 MiB landed
    assert max(before.process, before.optimistic) == max(after.process, after.optimistic) == 300 * MiB
