"""Task admission's pure parts: profiles, reservations, room, who is preempted, the operator's
settings as the scheduler reads them, and the status' metrics."""

from __future__ import annotations

import prometheus_client
import pytest

from memops import specs
from memops.controllers import admission_install, metrics
from memops.decisions import autoscaling
from memops.scheduler import admission
from memops.worker import admission as worker_admission

MIB = 2**20


def test_a_profile_is_the_median_of_the_last_peaks_and_the_table_forgets_the_oldest_prefix() -> None:
    profiles = worker_admission.Profiles(limit=3)
    for peak in (300, 10, 310, 290, 305):  # one overlap-free outlier does not move it
        profiles.add("spike", peak * MIB)
    assert profiles.peak("spike") == 300 * MIB
    for peak in range(20):
        profiles.add("many", peak)
    assert len(profiles.peaks["many"]) == worker_admission.KEPT
    profiles.add("a", 1)
    profiles.add("b", 2)  # four prefixes in a table of three: the least recently seen goes
    assert set(profiles.peaks) == {"many", "a", "b"}
    assert profiles.peak("spike") is None
    assert [p for p, _, _ in profiles.top(2)] == ["many", "b"]


def test_a_reservation_is_the_peak_above_small_a_probe_when_unprofiled_and_nothing_below() -> None:
    assert worker_admission.requirement(300 * MIB, small=128 * MIB, probe=None) == 300 * MIB
    assert worker_admission.requirement(8 * MIB, small=128 * MIB, probe=800.0) is None
    assert worker_admission.requirement(None, small=128 * MIB, probe=800.0) == 800.0
    assert worker_admission.requirement(None, small=128 * MIB, probe=None) is None


def test_room_counts_what_running_tasks_grew_once_not_twice() -> None:
    limit, pause = 1000, 0.8
    assert worker_admission.room(limit, pause, 300) == 500
    assert worker_admission.room(limit, pause, 900) == 0  # past the pause threshold: none, never negative
    # A task that reserved 300 and has grown the process from 200 to 500: the growth is in its
    # reservation (Dask subtracts that), not in the room as well.
    assert worker_admission.room(limit, pause, 500, [(300.0, 200)]) == 600
    # Growth beyond the reservations is the process', and counts.
    assert worker_admission.room(limit, pause, 700, [(300.0, 200)]) == 400
    # Keys that Dask would spill to disk are room too, but never more than the process holds
    # beyond the running tasks' growth.
    assert worker_admission.room(limit, pause, 300, spillable=160) == 660
    assert worker_admission.room(limit, pause, 500, [(300.0, 200)], spillable=10**9) == 800


def test_processes_that_share_a_container_share_its_limit_when_their_own_add_up_past_it() -> None:
    gib = 2**30
    # `dask worker --nworkers 2 --memory-limit 2GiB` in a 2 GiB container: each process told 2 GiB.
    assert worker_admission.pod_share(2 * gib, 2 * gib, 2) == gib
    assert worker_admission.pod_share(gib, 2 * gib, 2) == gib, "limits that fit the container stay"
    assert worker_admission.pod_share(gib, 24 * gib, 3) == gib, "a LocalCluster on a large machine"
    assert worker_admission.pod_share(2 * gib, 2 * gib, 1) == 2 * gib
    assert worker_admission.pod_share(0, 2 * gib, 2) == 0, "no limit: nothing to admit against"


class _Process:
    def __init__(self, *cmdline: str, children: tuple[_Process, ...] = (), parent: _Process | None = None):
        self.line = list(cmdline)
        self.kids = children
        self.up = parent

    def cmdline(self) -> list[str]:
        return self.line

    def parent(self) -> _Process | None:
        return self.up

    def children(self) -> tuple[_Process, ...]:
        return self.kids


def test_the_siblings_are_the_processes_started_as_this_one_pipes_aside() -> None:
    spawned = (
        "python",
        "-c",
        "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd={}, pipe_handle={})",
    )
    me, other = (_Process(*(part.format(n, n + 2) for part in spawned)) for n in (5, 9))
    tracker = _Process("python", "-c", "from multiprocessing.resource_tracker import main;main(5)")
    me.up = _Process("dask", "worker", "--nworkers", "2", children=(me, other, tracker))
    assert worker_admission.siblings(me) == 2
    me.up = _Process("dask", "worker", children=(me, tracker))
    assert worker_admission.siblings(me) == 1
    assert worker_admission.siblings(_Process("dask", "worker", "--no-nanny")) == 1, "no parent: alone"


def test_growth_is_shared_by_the_pages_each_tasks_thread_touched() -> None:
    share = worker_admission.attribute
    big = {"a": 10**12, "b": 10**12}
    # a holds 300 MiB; b then grows by 300 MiB alone: a's share does not move.
    assert share({"a": 300 * MIB, "b": 0}, big, 300 * MIB, {"b": 76_800}, 0) == {"a": 300 * MIB, "b": 300 * MIB}
    # Both start together and each touches as many pages: half each, not all of it to both.
    assert share({"a": 0, "b": 0}, big, 600 * MIB, {"a": 100, "b": 100}, 0) == {"a": 300 * MIB, "b": 300 * MIB}
    # Pages touched by a thread that runs no task (the event loop) are shared evenly.
    assert share({"a": 0, "b": 0}, big, 100 * MIB, {}, 50) == {"a": 50 * MIB, "b": 50 * MIB}
    # A task whose thread was not counted yet (it just started) takes the pages touched elsewhere.
    assert share({"a": 300 * MIB, "b": 0}, big, 100 * MIB, {"a": 0}, 40, fresh={"b"}) == {
        "a": 300 * MIB,
        "b": 100 * MIB,
    }
    # Memory given back leaves each in proportion to what it holds, among those whose threads ran.
    assert share({"a": 300 * MIB, "b": 100 * MIB}, big, -200 * MIB, {}, 0) == {"a": 150 * MIB, "b": 50 * MIB}
    assert share({"a": 300 * MIB, "b": 100 * MIB}, big, -50 * MIB, {}, 0, busy={"b"}) == {"a": 300 * MIB, "b": 50 * MIB}


def test_a_tasks_share_is_never_more_than_the_process_grew_since_it_started_nor_below_zero() -> None:
    # a's thread touched most pages, but the process grew by only 50 MiB since a started.
    held = worker_admission.attribute({"a": 0, "b": 0}, {"a": 50 * MIB, "b": 10**12}, 400 * MIB, {"a": 9, "b": 1}, 0)
    assert held == {"a": 50 * MIB, "b": 350 * MIB}, "what a's cap refuses is b's: no growth is lost"
    assert worker_admission.attribute({"a": 10 * MIB}, {"a": 10**12}, -50 * MIB, {}, 0) == {"a": 0}
    assert worker_admission.attribute({}, {}, 100, {}, 5) == {}


def test_the_newest_task_of_the_highest_level_is_preempted_within_its_retries() -> None:
    running = [("old", 1.0, 1), ("new", 2.0, 1), ("keeper", 3.0, 0), ("urgent", 0.5, 5)]
    assert worker_admission.victim(running, {}, 3) == "urgent"
    assert worker_admission.victim(running, {"urgent": 3}, 3) == "new"
    assert worker_admission.victim([("keeper", 3.0, 0)], {}, 3) is None
    assert worker_admission.level("fit-model", None, ("fit-*",)) == 1
    assert worker_admission.level("fit-model", 7, ()) == 7
    assert worker_admission.level("fit-model", 99, ()) == 9
    assert worker_admission.level("fit-model", False, ("fit-*",)) == 0
    assert worker_admission.level("load", None, ("fit-*",)) == 0


@pytest.mark.parametrize(
    ("value", "expected"),
    [("x" * 201, None), ("", None), (7, None), ("ok", "ok")],
)
def test_a_peers_prefix_is_a_bounded_string(value: object, expected: str | None) -> None:
    assert worker_admission.bounded_prefix(value) == expected


@pytest.mark.parametrize(("value", "expected"), [(-1, None), (2**51, None), (True, None), ("9", None), (5, 5)])
def test_a_peers_peak_is_a_bounded_integer(value: object, expected: int | None) -> None:
    assert worker_admission.bounded_peak(value) == expected


def test_the_scheduler_reads_the_operators_settings_and_defaults_what_is_out_of_range() -> None:
    spec = specs.TaskAdmissionSpec(preemptible=["fit-*", "score"], small="64Mi", preemptAbove=0.85)
    plain = admission_install.settings(spec)
    assert plain == {
        "small": 64 * MIB,
        "preemptAbove": 0.85,
        "preemptible": ["fit-*", "score"],
        "maxRetries": 3,
        "probe": True,
    }
    chosen = admission.settings_from(plain)
    assert chosen is not None
    settings, probe = chosen
    assert (settings.small, settings.preempt_above, settings.preemptible, probe) == (
        64 * MIB,
        0.85,
        ("fit-*", "score"),
        True,
    )
    hostile = admission.settings_from(
        {"small": -1, "preemptAbove": 0.99, "preemptible": ["x" * 999, 3], "maxRetries": 10**6, "probe": False}
    )
    assert hostile is not None
    assert hostile[0] == worker_admission.Settings(preemptible=())
    assert hostile[1] is False
    assert admission.settings_from("not a map") is None


def test_the_spec_refuses_a_repeated_glob_and_a_preemption_threshold_at_the_nannys() -> None:
    with pytest.raises(ValueError, match="listed twice"):
        specs.TaskAdmissionSpec(preemptible=["a", "a"])
    with pytest.raises(ValueError, match="preemptAbove"):
        specs.TaskAdmissionSpec(preemptAbove=0.95)
    assert specs.MemoryPolicySpec.model_fields["tasks"].default is None


def test_demand_is_served_by_scaling_else_nothing() -> None:
    base = {"scheduler": {"address": "tcp://s:8786"}, "workload": {"kind": "Deployment", "name": "w"}, "tasks": {}}
    assert admission_install.demand_action(specs.MemoryPolicySpec.model_validate(base)) == "None"
    scaled = specs.MemoryPolicySpec.model_validate(
        {**base, "autoscale": {"minReplicas": 1, "maxReplicas": 4, "targetMemoryUtilization": 60}}
    )
    two_of_1gib = autoscaling.Usage(workers=2, held=0, limit=2 * 2**30)
    assert admission_install.demand_action(scaled, peak=700 * MIB, usage=two_of_1gib) == "Scale"
    # A new worker of 1 GiB pauses at 819 MiB: it could not start a task of 900 MiB.
    assert admission_install.demand_action(scaled, peak=900 * MIB, usage=two_of_1gib) == "None"
    assert admission_install.demand_action(scaled, peak=700 * MIB, usage=None) == "None", "no worker to size one by"
    assert admission_install.demand_action(scaled, resizing=True, peak=900 * MIB, usage=two_of_1gib) == "Resize"


def test_only_the_top_prefixes_label_the_peak_gauge_and_a_prefix_that_leaves_them_loses_its_series() -> None:
    def series() -> set[str]:
        return {
            s.labels["prefix"]
            for m in metrics.REGISTRY.collect()
            if m.name == "memops_task_peak_bytes"
            for s in m.samples
            if s.labels.get("policy") == "unit-admission"
        }

    first = specs.TaskAdmissionStatus(top=[specs.TaskPeak(prefix="spike", peakBytes=300, observations=8)])
    metrics.tasks_observed("ns", "unit-admission", first)
    assert series() == {"spike"}
    second = specs.TaskAdmissionStatus(top=[specs.TaskPeak(prefix="join", peakBytes=500, observations=2)])
    metrics.tasks_observed("ns", "unit-admission", second)
    assert series() == {"join"}
    metrics.policy_gone("ns", "unit-admission")
    assert series() == set()
    assert isinstance(metrics.REGISTRY, prometheus_client.CollectorRegistry)
