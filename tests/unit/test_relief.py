"""Pressure relief's choices on hand-built scheduler states (memops.scheduler.relief.choose)."""

from memops.scheduler.relief import Key, Load, choose

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


def test_keys_that_have_a_copy_elsewhere_are_dropped_without_a_transfer() -> None:
    workers = [Load("hot", 800 * MiB, LIMIT), Load("a", 100 * MiB, LIMIT)]
    plan = choose(
        workers, {"hot": [*keys("hot", 300, also_on="a"), Key("single", 10 * MiB, ("hot",))]}, above=0.7, to=0.55
    )
    assert plan.drops == (("hot-0", "hot"),)
    assert plan.copies == ()


def test_starved_when_every_peer_is_full() -> None:
    workers = [Load("hot", 900 * MiB, LIMIT), Load("a", 690 * MiB, LIMIT)]
    plan = choose(workers, {"hot": keys("hot", 50, 50)}, above=0.7, to=0.55)
    assert plan.copies == () and plan.starved == ("hot",)


def test_paused_closing_and_unlimited_workers_are_left_alone() -> None:
    workers = [
        Load("paused-hot", 900 * MiB, LIMIT, running=False),
        Load("hot", 800 * MiB, LIMIT),
        Load("closing", 0, LIMIT, running=False),
        Load("nolimit", 0, 0),
        Load("a", 100 * MiB, LIMIT),
    ]
    plan = choose(workers, {"hot": keys("hot", 300), "paused-hot": keys("paused-hot", 300)}, above=0.7, to=0.55)
    assert plan.hot == ("hot",)
    assert [dst for _, _, dst in plan.copies] == ["a"]


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
