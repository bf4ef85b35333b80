"""The disruption annotations (:mod:`memops.decisions.disruption`): which worker pods get
``karpenter.sh/do-not-disrupt`` and ``cluster-autoscaler.kubernetes.io/safe-to-evict``, and when
memops takes them off again. A pod named ``w-1`` at ``NOW``; each case says what it holds alone."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from memops.decisions import disruption, objects

NOW = 1_800_000_000.0
SET = {objects.DO_NOT_DISRUPT: "true", objects.SAFE_TO_EVICT: "false"}
REMOVE = {objects.DO_NOT_DISRUPT: None, objects.SAFE_TO_EVICT: None, objects.PROTECTED_ANNOTATION: None}


def mine(seconds_ago: float) -> dict[str, str]:
    """The annotations as memops set them, ``seconds_ago``."""
    return {**SET, objects.PROTECTED_ANNOTATION: f"{NOW - seconds_ago:.0f}"}


@pytest.mark.parametrize(
    ("annotations", "unique", "enabled", "expected"),
    [
        pytest.param({}, 1024, True, {**SET, objects.PROTECTED_ANNOTATION: f"{NOW:.0f}"}, id="unique-data-protects"),
        pytest.param({}, 0, True, None, id="no-unique-data-nothing"),
        pytest.param({}, None, True, None, id="worker-not-connected-left-as-is"),
        pytest.param(mine(100), 1024, True, None, id="already-protected-no-write"),
        pytest.param(mine(100), 0, True, REMOVE, id="data-copied-unprotects"),
        pytest.param(mine(5), 0, True, None, id="set-moments-ago-stays-a-while"),
        pytest.param(mine(100), None, True, None, id="worker-gone-left-as-is"),
        pytest.param(mine(5), 1024, False, REMOVE, id="switched-off-removes-at-once"),
        pytest.param({}, 1024, False, None, id="switched-off-sets-nothing"),
        pytest.param({objects.DO_NOT_DISRUPT: "true"}, 0, True, None, id="someone-elses-annotation-never-removed"),
        pytest.param(
            {objects.SAFE_TO_EVICT: "true"}, 1024, True, None, id="someone-elses-annotation-never-overwritten"
        ),
        pytest.param(
            {**mine(100), objects.DO_NOT_DISRUPT: "false"},
            1024,
            True,
            {**SET, objects.PROTECTED_ANNOTATION: f"{NOW - 100:.0f}"},
            id="changed-by-hand-set-again-same-since",
        ),
        pytest.param(
            {**SET, objects.PROTECTED_ANNOTATION: "garbled"}, 0, True, REMOVE, id="unreadable-mark-counts-as-old"
        ),
    ],
)
def test_plan_annotations(
    annotations: Mapping[str, str], unique: int | None, enabled: bool, expected: Mapping[str, str | None] | None
) -> None:
    found = {"w-1": unique} if unique is not None else {}
    patches = disruption.plan_annotations({"w-1": annotations}, found, enabled=enabled, now=NOW)
    assert patches == ({"w-1": expected} if expected is not None else {})


def test_only_the_pods_that_change_are_written() -> None:
    pods = {"a": {}, "b": mine(100), "c": {}}
    patches = disruption.plan_annotations(pods, {"a": 1, "b": 1, "c": 0, "d": 5}, enabled=True, now=NOW)
    assert sorted(patches) == ["a"], "b holds its protection, c holds nothing alone, d is no pod of the workload"
