"""The sums that run inside the scheduler, on hand-built stand-ins for its WorkerState and TaskState."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from memops.decisions import snapshots
from memops.scheduler import holdings


@dataclass(eq=False)
class Worker:
    address: str
    has_what: dict[Any, None] = field(default_factory=dict)
    nbytes: int = 0


@dataclass(eq=False)
class Task:
    key: Any
    nbytes: int
    who_has: set[Worker] = field(default_factory=set)

    def get_nbytes(self) -> int:
        return self.nbytes if self.nbytes >= 0 else 95  # as distributed's DEFAULT_DATA_SIZE


def state(placement: dict[Any, tuple[int, list[str]]]) -> tuple[list[Worker], dict[Any, Task], list[Task]]:
    """Workers and tasks as the scheduler keeps them: totals per worker, and the replicated set."""
    workers = {a: Worker(a) for _, holders in placement.values() for a in holders}
    tasks = {}
    for key, (size, holders) in placement.items():
        ts = tasks[key] = Task(key, size)
        for address in holders:
            ws = workers[address]
            ts.who_has.add(ws)
            ws.has_what[ts] = None
            ws.nbytes += ts.get_nbytes()
    return list(workers.values()), tasks, [ts for ts in tasks.values() if len(ts.who_has) > 1]


PLACEMENT = {
    "x": (10, ["a"]),
    ("y", 0): (7, ["a", "b"]),
    "z": (5, ["b"]),
    "w": (3, ["a", "b", "c"]),
    "unknown-size": (-1, ["c"]),
}


def test_unique_is_the_total_minus_the_replicated_share() -> None:
    workers, _, replicated = state(PLACEMENT)
    assert holdings.holdings(workers, replicated) == {
        "a": (20, 3, 10, 1),
        "b": (15, 3, 5, 1),
        "c": (3 + 95, 2, 95, 1),
    }


def test_the_same_figures_as_summing_who_has_key_by_key() -> None:
    """The operator's own sums (for a scheduler that refuses run_function) agree."""
    workers, _, replicated = state(PLACEMENT)
    who_has = {k: tuple(h) for k, (_, h) in PLACEMENT.items()}
    nbytes = {k: size if size >= 0 else 95 for k, (size, _) in PLACEMENT.items()}
    assert holdings.holdings(workers, replicated) == snapshots.holdings(who_has, nbytes)


def test_a_worker_holding_nothing_or_only_copies_holds_nothing_unique() -> None:
    workers, _, replicated = state({"k": (8, ["a", "b"])})
    empty = Worker("e")
    assert holdings.holdings([*workers, empty], replicated) == {"a": (8, 1, 0, 0), "b": (8, 1, 0, 0), "e": (0, 0, 0, 0)}


def test_placement_of_keys_known_and_forgotten() -> None:
    _, tasks, _ = state(PLACEMENT)
    found = holdings.placement(tasks, [("y", 0), "gone"])
    assert found[("y", 0)][0] == 7 and sorted(found[("y", 0)][1]) == ["a", "b"]
    assert found["gone"] == (0, [])


def test_summarize_places_the_keys_of_the_workers_asked_for() -> None:
    workers, tasks, replicated = state(PLACEMENT)

    class Scheduler:
        def __init__(self) -> None:
            self.workers = {w.address: w for w in workers}
            self.tasks = tasks
            self.replicated_tasks = set(replicated)

    summary = holdings.summarize(Scheduler(), workers=["b", "not-connected"], keys=["x"])
    assert set(summary["placement"]) == {"x", ("y", 0), "z", "w"}
    assert summary["holdings"]["b"] == (15, 3, 5, 1)
