"""The HPA algorithm on memory, written from the Kubernetes documentation's examples."""

import pytest

from memops import specs
from memops.decisions import autoscaling

GiB = 2**30
MiB = 2**20


def usage(percent: float, workers: int = 4, spilled: float = 0) -> autoscaling.Usage:
    return autoscaling.Usage(workers=workers, held=int((percent + spilled) / 100 * workers * GiB), limit=workers * GiB)


@pytest.mark.parametrize(
    ("current_value", "target", "expected"),
    [
        pytest.param(100, 50, 8, id="metric-twice-the-target-doubles"),
        pytest.param(25, 50, 2, id="metric-half-the-target-halves"),
        pytest.param(52, 50, 4, id="within-the-10%-tolerance-no-change"),
        pytest.param(56, 50, 5, id="beyond-tolerance-rounds-up"),
    ],
)
def test_metric_recommendation(current_value: float, target: float, expected: int) -> None:
    assert autoscaling.metric_recommendation(4, usage(current_value), target) == expected


def test_spilled_bytes_count_as_memory_pressure() -> None:
    in_memory_only = usage(50)
    spilling = usage(50, spilled=40)
    assert autoscaling.metric_recommendation(4, in_memory_only, 50) == 4
    assert autoscaling.metric_recommendation(4, spilling, 50) == 8


def behavior(**kwargs: object) -> specs.Behavior:
    return specs.Behavior.model_validate(kwargs)


def test_scale_down_stabilization_takes_the_highest_recent_recommendation() -> None:
    rules = behavior(
        scaleDown={
            "stabilizationWindowSeconds": 300,
            "policies": [{"type": "Percent", "value": 100, "periodSeconds": 15}],
        }
    )
    history = [specs.Recommendation(time=1000 - 100, replicas=5), specs.Recommendation(time=1000 - 50, replicas=3)]
    assert autoscaling.stabilize(2, 5, history, now=1000, behavior=rules) == 5
    assert autoscaling.stabilize(2, 5, history, now=1000 + 210, behavior=rules) == 3
    assert autoscaling.stabilize(2, 5, history, now=1000 + 400, behavior=rules) == 2


def test_scale_up_is_immediate_by_default() -> None:
    history = [specs.Recommendation(time=999, replicas=2)]
    assert autoscaling.stabilize(8, 4, history, now=1000, behavior=specs.Behavior()) == 8


@pytest.mark.parametrize(
    ("select", "expected"),
    [
        pytest.param("Max", 72, id="max-picks-the-biggest-change"),
        pytest.param("Min", 76, id="min-the-smallest"),
        pytest.param("Disabled", 80, id="disabled"),
    ],
)
def test_scale_down_policies_from_the_docs(select: str, expected: int) -> None:
    """Docs: 80 replicas, Pods 4 and Percent 10 per 60 s: the first step goes to 72 under Max."""
    rules = behavior(
        scaleDown={
            "selectPolicy": select,
            "policies": [
                {"type": "Pods", "value": 4, "periodSeconds": 60},
                {"type": "Percent", "value": 10, "periodSeconds": 60},
            ],
        }
    )
    lowest, _ = autoscaling.rate_limits(80, [], now=1000, behavior=rules)
    assert lowest == expected


def test_default_scale_up_limit_is_double_or_plus_four() -> None:
    _, highest = autoscaling.rate_limits(2, [], now=1000, behavior=specs.Behavior())
    assert highest == 6  # max(100% of 2 -> 4, 2 + 4 pods -> 6)
    _, highest = autoscaling.rate_limits(10, [], now=1000, behavior=specs.Behavior())
    assert highest == 20


def test_recent_scale_events_count_against_the_policies() -> None:
    events = [specs.ScaleEvent(time=995, change=4)]  # 2 -> 6, five seconds ago
    _, highest = autoscaling.rate_limits(6, events, now=1000, behavior=specs.Behavior())
    assert highest == 6, "the period started at 2 workers: 6 is the most the policies allow"
    _, highest = autoscaling.rate_limits(6, events, now=1020, behavior=specs.Behavior())
    assert highest == 12


def autoscale(**kwargs: object) -> specs.AutoscaleSpec:
    return specs.AutoscaleSpec.model_validate({"maxReplicas": 10, "targetMemoryUtilization": 50, **kwargs})


def test_desired_replicas_is_clamped_to_min_and_max() -> None:
    high = autoscaling.desired_replicas(
        current=8, usage=usage(100, workers=8), spec=autoscale(), history=[], events=[], now=1000
    )
    assert high.replicas == 10 and "maxReplicas" in high.reason
    assert high.limits == (autoscaling.Limit.MAX_REPLICAS,)
    idle = autoscale(
        minReplicas=3,
        behavior={
            "scaleDown": {
                "stabilizationWindowSeconds": 0,
                "policies": [{"type": "Percent", "value": 100, "periodSeconds": 15}],
            }
        },
    )
    low = autoscaling.desired_replicas(current=4, usage=usage(1), spec=idle, history=[], events=[], now=1000)
    assert low.replicas == 3 and "minReplicas" in low.reason
    assert low.limits == (autoscaling.Limit.MIN_REPLICAS,)
    steady = autoscaling.desired_replicas(current=4, usage=usage(50), spec=autoscale(), history=[], events=[], now=1000)
    assert (steady.replicas, steady.limits) == (4, ())


def test_never_fewer_workers_than_the_memory_in_use_needs() -> None:
    # 4 of 6 pods run a connected worker, each at 45% of 1 GiB: the metric alone says 4
    # (4 workers x 45% / 50%), but the 1.8 GiB in use needs 4 workers at 50%: never fewer.
    spec = autoscale(
        behavior={
            "scaleDown": {
                "stabilizationWindowSeconds": 0,
                "policies": [{"type": "Percent", "value": 100, "periodSeconds": 15}],
            }
        }
    )
    result = autoscaling.desired_replicas(current=6, usage=usage(45), spec=spec, history=[], events=[], now=1000)
    assert result.replicas == 4
    assert autoscaling.fit_floor(usage(45), 50) == 4
    assert autoscaling.fit_floor(usage(45), 30) == 6


def test_min_above_max_names_the_field() -> None:
    import pydantic

    with pytest.raises(pydantic.ValidationError, match=r"autoscale\.minReplicas"):
        autoscale(minReplicas=5, maxReplicas=2)


def test_starved_pressure_relief_asks_for_one_more_worker_each_within_max() -> None:
    spec = specs.AutoscaleSpec(minReplicas=1, maxReplicas=5, targetMemoryUtilization=60)
    assert autoscaling.with_relief(3, 3, 0, spec) == (3, "")
    desired, reason = autoscaling.with_relief(3, 3, 1, spec)
    assert desired == 4 and "memory pressure" in reason
    assert autoscaling.with_relief(3, 4, 3, spec)[0] == 5  # capped at maxReplicas
    assert autoscaling.with_relief(6, 3, 1, spec) == (6, "")  # already asking for more
    assert autoscaling.with_relief(3, 3, 2, None) == (3, "")  # no autoscaler: only the status says so


def test_starvation_asks_again_only_once_the_new_workers_have_joined() -> None:
    spec = specs.AutoscaleSpec(minReplicas=1, maxReplicas=10, targetMemoryUtilization=60)
    # A pass raised the replicas to 4; the 4th worker is still starting (3 connected): no 5th.
    assert autoscaling.with_relief(4, 3, 1, spec)[0] == 4
    # It joined and the worker is starved still: one more.
    assert autoscaling.with_relief(4, 4, 1, spec)[0] == 5


def test_tasks_that_wait_for_room_ask_for_one_more_worker_where_a_new_one_could_start_them() -> None:
    spec = specs.AutoscaleSpec(minReplicas=1, maxReplicas=5, targetMemoryUtilization=60)
    usage = autoscaling.Usage(workers=3, held=1 * GiB, limit=3 * GiB)  # 1 GiB per worker
    waiting = specs.TaskAdmissionStatus(demandTasks=4, demandBytes=300 * MiB)
    desired, reason = autoscaling.with_task_demand(3, 3, waiting, usage, spec)
    assert (desired, reason) == (4, "raised to 4: 4 tasks wait for room that no worker has")
    # The worker asked for is starting (3 connected of 4): the same demand asks for no more.
    assert autoscaling.with_task_demand(4, 3, waiting, usage, spec) == (4, "")
    assert autoscaling.with_task_demand(5, 5, waiting, usage, spec) == (5, "")  # at maxReplicas
    # A peak over a new worker's room (80% of its 1 GiB limit): another worker would not start it.
    too_big = waiting.model_copy(update={"demandBytes": 900 * MiB})
    assert autoscaling.with_task_demand(3, 3, too_big, usage, spec) == (3, "")
    nothing = specs.TaskAdmissionStatus()
    assert autoscaling.with_task_demand(3, 3, nothing, usage, spec) == (3, "")
    assert autoscaling.with_task_demand(3, 3, waiting, usage, None) == (3, "")  # no autoscaler
    assert autoscaling.with_task_demand(3, 3, waiting, None, spec) == (3, "")  # the scheduler not read
