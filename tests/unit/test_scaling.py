"""A MemoryPolicy's scaling decisions: up directly, down only through a drain, never two at once."""

import pytest

from memops import specs
from memops.decisions import scaling


@pytest.mark.parametrize(
    ("current", "desired", "draining", "failure_age", "failed_generation", "action", "replicas"),
    [
        pytest.param(4, 4, 0, None, None, scaling.Action.NONE, 0, id="steady"),
        pytest.param(2, 5, 0, None, None, scaling.Action.SCALE_UP, 5, id="up-to-desired"),
        pytest.param(5, 3, 0, None, None, scaling.Action.SCALE_DOWN, 2, id="down-retires-the-difference"),
        pytest.param(5, 3, 2, None, None, scaling.Action.WAIT, 0, id="one-drain-at-a-time"),
        pytest.param(2, 5, 1, None, None, scaling.Action.WAIT, 0, id="no-scale-up-during-a-drain"),
        pytest.param(5, 3, 0, 10.0, 7, scaling.Action.WAIT, 0, id="failed-drain-cools-down"),
        pytest.param(5, 3, 0, 61.0, 7, scaling.Action.SCALE_DOWN, 2, id="cooldown-over"),
        pytest.param(5, 3, 0, 10.0, 6, scaling.Action.SCALE_DOWN, 2, id="spec-changed-since-the-failure"),
    ],
)
def test_plan_scale(
    current: int,
    desired: int,
    draining: int,
    failure_age: float | None,
    failed_generation: int | None,
    action: scaling.Action,
    replicas: int,
) -> None:
    decision = scaling.plan_scale(
        current=current,
        desired=desired,
        draining=draining,
        last_failure_age=failure_age,
        failed_generation=failed_generation,
        generation=7,
    )
    assert (decision.action, decision.replicas) == (action, replicas)


def policy(name: str, created: str, workload: str = "w") -> dict[str, object]:
    return {
        "metadata": {"name": name, "creationTimestamp": created},
        "spec": {"workload": {"kind": "Deployment", "name": workload}},
    }


def test_the_oldest_policy_on_a_workload_wins() -> None:
    first, second = policy("a", "2026-01-01T00:00:00Z"), policy("b", "2026-01-02T00:00:00Z")
    other = policy("c", "2025-01-01T00:00:00Z", workload="other")
    assert scaling.competing_policies(first, [first, second, other]) == []
    assert scaling.competing_policies(second, [first, second, other]) == ["a"]


def test_autoscalers_that_bypass_the_policy() -> None:
    hpas = [
        {"metadata": {"name": "direct"}, "spec": {"scaleTargetRef": {"kind": "Deployment", "name": "w"}}},
        {"metadata": {"name": "through-policy"}, "spec": {"scaleTargetRef": {"kind": "MemoryPolicy", "name": "p"}}},
    ]
    ref = specs.WorkloadRef(kind=specs.WorkloadKind.DEPLOYMENT, name="w")
    assert scaling.autoscalers_on(ref, hpas) == ["direct"]
