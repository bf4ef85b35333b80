"""Graph-aware placement's pure parts: how a graph is grouped, and how groups are dealt to workers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import SimpleNamespace

import dask.array as da
from dask.core import get_dependencies
from dask.order import order as dask_order
from hypothesis import given
from hypothesis import strategies as st

from memops.scheduler import placement


def graph_of(collection: object) -> tuple[list[object], dict[object, set[object]]]:
    """A dask collection's keys in ``dask.order``'s order (topological), and their dependencies."""
    graph = dict(collection.__dask_graph__())  # type: ignore[attr-defined]
    priorities = dask_order(graph)
    return sorted(graph, key=priorities.__getitem__), {k: get_dependencies(graph, k) for k in graph}


def groups_of(order: Sequence[object], deps: Mapping[object, set[object]], workers: int) -> placement.Grouping[object]:
    return placement.group(order, lambda k: deps[k], workers)


def test_the_seeds_sum_over_one_axis_groups_whole_subtrees_and_shares_only_the_top_of_the_reduction() -> None:
    """160 column chunks summed over the columns (the seed's example, scaled): each chunk and its
    partial sum go with their neighbours up to a subtree of the reduction; only the few tasks that
    combine subtrees are shared, and the graph partitions."""
    x = da.ones((1000, 160), chunks=(1000, 1))
    order, deps = graph_of(x.sum(axis=1).sum())
    grouping = groups_of(order, deps, 4)
    assert len(grouping.groups) == 10 and {len(g) for g in grouping.groups} == {37}, grouping.groups
    assert len(grouping.shared) == len(order) - 370 == 6
    assert grouping.partitions
    chunks = {k for k in order if not deps[k]}
    for members in grouping.groups:
        # a group's chunks are contiguous columns: the ones a subtree of the reduction sums
        columns = sorted(k[2] for k in members if k in chunks)  # type: ignore[index]
        assert columns == list(range(columns[0], columns[0] + 16)), columns


def test_a_shuffle_does_not_partition() -> None:
    """Every output of an all-to-all exchange needs every input: placement stands aside."""
    deps: dict[object, set[object]] = {f"in-{i}": set() for i in range(32)}
    deps.update({f"split-{i}": {f"in-{i}"} for i in range(32)})
    deps.update({f"out-{j}": {f"split-{i}" for i in range(32)} for j in range(32)})
    grouping = groups_of(list(deps), deps, 4)
    assert not grouping.partitions
    assert grouping.crossing > placement.CROSSING_LIMIT * grouping.edges


def test_keys_computed_before_are_not_part_of_the_graph() -> None:
    """A graph over persisted data: its first tasks depend only on keys outside it, so they are its
    roots; each chain is a group."""
    deps: dict[object, set[object]] = {}
    for i in range(8):
        deps[f"map-{i}"] = {f"persisted-{i}"}
        deps[f"next-{i}"] = {f"map-{i}"}
    grouping = groups_of(list(deps), deps, 4)
    assert sorted(map(sorted, grouping.groups)) == [[f"map-{i}", f"next-{i}"] for i in range(8)]
    assert grouping.edges == 8 and grouping.shared == []
    assert grouping.outside == frozenset(range(8))


def test_only_the_groups_that_read_keys_computed_before_are_marked_so() -> None:
    """Placement looks for where earlier data is held only for the groups that read some."""
    deps: dict[object, set[object]] = {f"root-{i}": set() for i in range(6)}
    deps.update({f"next-{i}": {f"root-{i}"} for i in range(6)})
    deps["next-4"] = {"root-4", "persisted"}
    grouping = groups_of(list(deps), deps, 2)
    marked = [grouping.groups[i] for i in grouping.outside]
    assert marked == [["root-4", "next-4"]]


def test_a_group_never_grows_past_its_share_of_the_graph() -> None:
    """One reduction over everything: the levels below stay grouped in shares, the top is shared."""
    x = da.ones((64,), chunks=(1,))
    order, deps = graph_of(x.sum(split_every=2))
    grouping = groups_of(order, deps, 4)
    cap = -(-len(order) // (4 * placement.SLICES))
    assert all(len(g) <= cap for g in grouping.groups), [len(g) for g in grouping.groups]
    assert grouping.partitions and len(grouping.groups) >= 4


def test_consecutive_groups_fill_one_worker_before_the_next_and_the_least_loaded_fills_first() -> None:
    homes = placement.assign([10] * 8, {"b": 0.0, "a": 0.0, "c": 5.0, "d": 0.0}, {"a": 1, "b": 1, "c": 1, "d": 1})
    assert homes == ["a", "a", "b", "b", "d", "d", "c", "c"]


def test_a_worker_with_more_threads_takes_a_larger_share() -> None:
    homes = placement.assign([10] * 9, {"a": 0.0, "b": 0.0}, {"a": 2, "b": 1})
    assert homes.count("a") == 6 and homes.count("b") == 3, homes


def test_a_worker_that_just_joined_takes_the_first_new_groups() -> None:
    homes = placement.assign([10] * 2, {"busy": 40.0, "new": 0.0}, {"busy": 1, "new": 1})
    assert homes == ["new", "new"]


@st.composite
def dags(draw: st.DrawFn) -> tuple[list[int], dict[int, set[int]]]:
    size = draw(st.integers(1, 60))
    deps = {i: set(draw(st.lists(st.integers(0, i - 1), max_size=4))) if i else set() for i in range(size)}
    return list(range(size)), deps


@given(dags(), st.integers(1, 8))
def test_every_task_is_in_one_group_or_shared_and_a_grouped_task_is_with_its_grouped_dependencies(
    dag: tuple[list[int], dict[int, set[int]]], workers: int
) -> None:
    order, deps = dag
    grouping = placement.group(order, deps.__getitem__, workers)
    where = {task: n for n, members in enumerate(grouping.groups) for task in members}
    assert len(where) + len(grouping.shared) == len(order)
    assert not set(where) & set(grouping.shared)
    for task, n in where.items():
        assert all(where.get(d, n) == n for d in deps[task]), (task, deps[task])
    assert grouping.edges == sum(len(d) for d in deps.values())
    homes = placement.assign([len(g) for g in grouping.groups], {"a": 0.0, "b": 0.0}, {"a": 1, "b": 1})
    assert len(homes) == len(grouping.groups) and set(homes) <= {"a", "b"}


def test_a_graph_sorts_by_dasks_order_alone_only_where_that_gives_dasks_priority_order() -> None:
    """One generation and no priority annotation: the place in ``dask.order`` orders as the whole
    priority does. Otherwise the whole priority is the key."""
    same = [SimpleNamespace(priority=(0, 7, i)) for i in (5, 1, 4, 2, 3)]
    key = placement._order_key(same, {})
    assert sorted(same, key=key) == sorted(same, key=lambda ts: ts.priority)
    assert key is not placement._PRIORITY
    earlier = [*same, SimpleNamespace(priority=(0, 6, 9))]  # left from an earlier graph: first
    assert placement._order_key(earlier, {}) is placement._PRIORITY
    assert placement._order_key(same, {"priority": {"x": 1}}) is placement._PRIORITY
