"""Recycling's detection on synthetic series: a leak triggers; a spike and a worker full of Dask data do not."""

from __future__ import annotations

import pytest

from memops import specs
from memops.decisions import recycle_decisions, snapshots

GIB = 2**30
LIMIT = 4 * GIB


def series(values: list[float], *, step: float = 10.0, end: float = 10_000.0) -> list[recycle_decisions.Sample]:
    """Samples ``step`` seconds apart ending at ``end``; values are shares of LIMIT."""
    start = end - step * (len(values) - 1)
    return [
        recycle_decisions.Sample(time=start + i * step, unmanaged=int(v * LIMIT), limit=LIMIT)
        for i, v in enumerate(values)
    ]


SUSTAINED = specs.RecycleSpec.model_validate({"unmanagedMemory": {"above": "30%", "for": "10m"}})
GROWTH = specs.RecycleSpec.model_validate({"growth": {"perHour": "5%", "window": "30m"}})


def test_a_leak_that_stays_above_the_threshold_for_the_window_is_recycled() -> None:
    samples = series([0.35] * 61)  # 10 minutes at 35%
    verdict = recycle_decisions.detect("w-1", samples, SUSTAINED, now=10_000.0, age_seconds=None)
    assert verdict is not None
    assert verdict.pod == "w-1"
    assert verdict.reason == "UnmanagedMemory"
    assert "35%" in verdict.message


def test_a_one_off_spike_does_not_trigger() -> None:
    values = [0.10] * 61
    values[30] = 0.90  # one sample far above: the minimum over the window stays low
    assert recycle_decisions.detect("w-1", series(values), SUSTAINED, now=10_000.0, age_seconds=None) is None


def test_a_worker_full_of_dask_data_is_not_a_leak() -> None:
    # 90% of the limit in use, but all of it managed: unmanaged memory is small throughout.
    worker = snapshots.WorkerInfo(
        name="w-1", address="tcp://a", memory_limit=LIMIT, process_bytes=int(0.9 * LIMIT), unmanaged_bytes=GIB // 10
    )
    window = recycle_decisions.window_for(SUSTAINED)
    for t in range(0, 700, 10):
        window.add([worker], now=float(t))
    assert recycle_decisions.detect("w-1", window.samples["w-1"], SUSTAINED, now=690.0, age_seconds=None) is None


def test_a_window_not_yet_full_is_no_evidence() -> None:
    samples = series([0.50] * 20)  # only 190 s of a 10-minute rule
    assert recycle_decisions.detect("w-1", samples, SUSTAINED, now=10_000.0, age_seconds=None) is None


def test_a_dip_below_the_threshold_resets_the_rule() -> None:
    values = [0.40] * 61
    values[-5] = 0.20
    assert recycle_decisions.detect("w-1", series(values), SUSTAINED, now=10_000.0, age_seconds=None) is None


def test_a_steady_rise_is_growth() -> None:
    # From 10% to 14% over 30 minutes: 8% of the limit per hour, a clean line.
    values = [0.10 + 0.04 * i / 180 for i in range(181)]
    verdict = recycle_decisions.detect("w-1", series(values), GROWTH, now=10_000.0, age_seconds=None)
    assert verdict is not None and verdict.reason == "Growth"
    assert "8.0% of the limit per hour" in verdict.message


def test_a_slow_rise_is_not_growth() -> None:
    values = [0.10 + 0.01 * i / 180 for i in range(181)]  # 2% per hour, under the 5% rule
    assert recycle_decisions.detect("w-1", series(values), GROWTH, now=10_000.0, age_seconds=None) is None


def test_a_step_then_flat_is_not_a_steady_rise() -> None:
    # A cache filled once: a step, then flat. The line fits poorly, so no verdict.
    values = [0.10] * 90 + [0.30] + [0.12] * 90
    assert recycle_decisions.detect("w-1", series(values), GROWTH, now=10_000.0, age_seconds=None) is None


def test_the_fit_is_ordinary_least_squares() -> None:
    slope, r2 = recycle_decisions.fit([(0, 1), (1, 3), (2, 5)])
    assert slope == pytest.approx(2.0)
    assert r2 == pytest.approx(1.0)


def test_max_age_is_staggered_by_name_and_never_exceeded() -> None:
    spec = specs.RecycleSpec.model_validate({"maxAge": "24h"})
    pods = [f"dask-worker-{i}" for i in range(20)]
    deadlines = set()
    for pod in pods:
        assert recycle_decisions.detect(pod, [], spec, now=0.0, age_seconds=24 * 3600) is not None
        assert recycle_decisions.detect(pod, [], spec, now=0.0, age_seconds=21 * 3600) is None
        deadlines.add(round(24 * (1 - recycle_decisions.MAX_AGE_STAGGER * recycle_decisions.stagger(pod)), 3))
    assert len(deadlines) == len(pods)  # no two workers created together expire together


def test_plan_recycle_respects_max_unavailable_and_shuffles() -> None:
    verdicts = [
        recycle_decisions.Verdict(pod="a", reason="UnmanagedMemory", message="", severity=40),
        recycle_decisions.Verdict(pod="b", reason="UnmanagedMemory", message="", severity=60),
        recycle_decisions.Verdict(pod="c", reason="MaxAge", message="", severity=-1),
    ]
    chosen = recycle_decisions.plan_recycle(verdicts, recycling=0, max_unavailable=2, in_shuffle={"b"})
    assert [v.pod for v in chosen] == ["a", "c"]
    assert recycle_decisions.plan_recycle(verdicts, recycling=1, max_unavailable=1) == []
    assert [v.pod for v in recycle_decisions.plan_recycle(verdicts, recycling=0, max_unavailable=1)] == ["b"]


def test_the_window_forgets_workers_that_left() -> None:
    window = recycle_decisions.Window(seconds=60, spacing=5)
    worker = snapshots.WorkerInfo(name="w-1", address="tcp://a", memory_limit=LIMIT, unmanaged_bytes=GIB)
    window.add([worker], now=0.0)
    window.add([worker], now=2.0)  # closer than the spacing: not kept
    window.add([worker], now=10.0)
    assert [s.time for s in window.samples["w-1"]] == [0.0, 10.0]
    window.add([], now=20.0)
    assert window.samples == {}


def test_annotation_shows_unmanaged_old() -> None:
    samples = {"w-1": series([0.50, 0.31, 0.40], step=10.0, end=100.0)}
    assert recycle_decisions.annotation_percent(samples, "w-1", now=100.0) == "31%"


@pytest.mark.parametrize(
    "body, field",
    [
        pytest.param({}, "recycle.unmanagedMemory", id="no-rule"),
        pytest.param({"maxAge": "24h", "maxUnavailable": 0}, "maxUnavailable", id="max-unavailable"),
        pytest.param({"unmanagedMemory": {"above": "130%"}}, "above", id="percent"),
    ],
)
def test_invalid_recycle_specs_name_the_field(body: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        specs.RecycleSpec.model_validate(body)


def test_pressure_needs_relieve_to_below_relieve_above() -> None:
    with pytest.raises(ValueError, match=r"pressure\.relieveTo"):
        specs.PressureSpec.model_validate({"relieveAbove": "60%", "relieveTo": "70%"})


def test_replacement_surges_first_then_drains() -> None:
    plan = recycle_decisions.plan_replacement(marked=["old"], requested=set(), connected_unmarked=3, desired=4, surge=1)
    assert plan.extra == 1 and plan.drain == ()
    assert "waiting for replacements" in plan.message
    plan = recycle_decisions.plan_replacement(marked=["old"], requested=set(), connected_unmarked=4, desired=4, surge=1)
    assert plan.extra == 1 and plan.drain == ("old",)
    plan = recycle_decisions.plan_replacement(
        marked=["old"], requested={"old"}, connected_unmarked=4, desired=4, surge=1
    )
    assert plan.drain == ()


def test_without_surge_the_drain_starts_at_once() -> None:
    plan = recycle_decisions.plan_replacement(marked=["old"], requested=set(), connected_unmarked=3, desired=4, surge=0)
    assert plan.extra == 0 and plan.drain == ("old",)
