"""The one recipient rule of the drain, replication and pressure relief
(memops.scheduler.transfers.choose_recipient), on plain names: each parameter once."""

import heapq
from collections.abc import Iterator

from memops.scheduler.transfers import choose_recipient as choose


def test_without_parameters_the_first_candidate_takes_the_key() -> None:
    assert choose(["a", "b"]) == "a"
    assert choose([]) is None


def test_excluded_names_never_take_it_from_any_of_the_collections() -> None:
    assert choose(["a", "b", "c"], excluded=(["a"], {"b"})) == "c"
    assert choose(["a", "b"], excluded=(["a", "b"],)) is None


def test_a_candidate_without_room_is_passed_over() -> None:
    room = {"a": 5, "b": 20, "c": 30}
    assert choose(["a", "b", "c"], has_room=lambda n: room[n] >= 10) == "b"
    assert choose(["a", "b", "c"], has_room=lambda n: room[n] >= 50) is None


def test_by_room_the_first_candidate_without_room_ends_the_search() -> None:
    room = {"a": 5, "b": 20}
    assert choose(["a", "b"], has_room=lambda n: room[n] >= 10, by_room=True) is None
    assert choose(["b", "a"], has_room=lambda n: room[n] >= 10, by_room=True) == "b"


def test_takes_is_asked_only_of_candidates_with_room() -> None:
    asked: list[str] = []

    def takes(name: str) -> bool:
        asked.append(name)
        return name == "c"

    assert choose(["a", "b", "c"], has_room=lambda n: n != "a", takes=takes) == "c"
    assert asked == ["b", "c"]


def test_rank_comes_before_the_order_and_ties_go_to_the_first() -> None:
    rank = {"a": (True, False), "b": (False, True), "c": (False, True), "d": (True, True)}
    assert choose(["a", "b", "c", "d"], rank=rank.__getitem__) == "b"


def test_best_rank_ends_the_search_at_the_first_candidate_with_it() -> None:
    read: list[str] = []

    def candidates() -> Iterator[str]:
        for name in ["a", "b", "c"]:
            read.append(name)
            yield name

    rank = {"a": 1, "b": 0, "c": 0}
    assert choose(candidates(), rank=rank.__getitem__, best_rank=0) == "b"
    assert read == ["a", "b"]


def test_rank_with_exclusions_and_room_ranks_only_those_that_take_it() -> None:
    rank = {"a": 0, "b": 0, "c": 1}
    chosen = choose(["a", "b", "c"], excluded=({"a"},), has_room=lambda n: n != "b", rank=rank.__getitem__)
    assert chosen == "c"


def test_a_lazy_heap_drops_only_the_entries_asked_past() -> None:
    heap = [(1, "a"), (2, "b"), (3, "c")]
    heapq.heapify(heap)

    def live() -> Iterator[str]:
        while heap:
            yield heap[0][1]
            heapq.heappop(heap)

    assert choose(live(), has_room=lambda n: n == "b") == "b"
    assert heap == [(2, "b"), (3, "c")]
