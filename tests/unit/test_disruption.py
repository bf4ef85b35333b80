"""The disruption annotations (:mod:`memops.decisions.disruption`): which worker pods get
``karpenter.sh/do-not-disrupt`` and ``cluster-autoscaler.kubernetes.io/safe-to-evict``, and when
memops takes them off again. A pod named ``w-1`` at ``NOW``; each case says what it holds alone."""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

import pytest

from memops import specs
from memops.decisions import conditions, disruption, objects, policy_decisions, timestamps

NOW = 1_800_000_000.0
HOUR = 3600.0
SET = {objects.DO_NOT_DISRUPT: "true", objects.SAFE_TO_EVICT: "false"}
REMOVE = {objects.DO_NOT_DISRUPT: None, objects.SAFE_TO_EVICT: None, objects.PROTECTED_ANNOTATION: None}
LABEL = {objects.PROTECTED_LABEL: "p"}
UNPROTECT = {"annotations": REMOVE, "labels": {objects.PROTECTED_LABEL: None}}
"""What takes memops' protection off a pod that carries all of it."""


def at(seconds_ago: float) -> str:
    return f"{NOW - seconds_ago:.0f}"


def mine(seconds_ago: float, began: float | None = None, label: str = "p", ours: bool = True) -> disruption.PodSeen:
    """A pod as memops protects it: since ``seconds_ago``, first protected ``began`` seconds ago
    (the same time unless said), labelled as policy ``label``'s."""
    annotations = {
        **SET,
        objects.PROTECTED_ANNOTATION: at(seconds_ago),
        objects.PROTECTION_BEGAN_ANNOTATION: at(seconds_ago if began is None else began),
    }
    return disruption.PodSeen(annotations, {objects.PROTECTED_LABEL: label}, ours=ours)


def pod(annotations: Mapping[str, str] | None = None, **labels: str) -> disruption.PodSeen:
    return disruption.PodSeen(dict(annotations or {}), {k.replace("_", "/", 1): v for k, v in labels.items()})


def protect(since: float, began: float | None = None) -> dict[str, Any]:
    """The patch that protects a pod: since ``since`` seconds ago, first ``began`` seconds ago."""
    annotations = {
        **SET,
        objects.PROTECTED_ANNOTATION: at(since),
        objects.PROTECTION_BEGAN_ANNOTATION: at(since if began is None else began),
    }
    return {"annotations": annotations, "labels": LABEL}


def plan(
    found: disruption.PodSeen,
    unique: int | None,
    enabled: bool = True,
    max_seconds: float = HOUR,
    reached: bool = True,
    unreachable_since: float | None = None,
) -> dict[str, Any] | None:
    held = ({"w-1": unique} if unique is not None else {}) if reached else None
    patches = disruption.plan_annotations(
        {"w-1": found},
        held,
        policy="p",
        enabled=enabled,
        max_seconds=max_seconds,
        now=NOW,
        unreachable_since=unreachable_since,
    )
    assert set(patches) <= {"w-1"}
    return patches.get("w-1")


@pytest.mark.parametrize(
    ("found", "unique", "enabled", "expected"),
    [
        pytest.param(pod(), 1024, True, protect(0), id="unique-data-protects"),
        pytest.param(pod(), 0, True, None, id="no-unique-data-nothing"),
        pytest.param(pod(), None, True, None, id="worker-not-connected-left-as-is"),
        pytest.param(mine(100), 1024, True, None, id="already-protected-no-write"),
        pytest.param(mine(100), 0, True, UNPROTECT, id="data-copied-unprotects"),
        pytest.param(mine(5), 0, True, None, id="set-moments-ago-stays-a-while"),
        pytest.param(mine(100), None, True, None, id="worker-gone-left-as-is"),
        pytest.param(mine(5), 1024, False, UNPROTECT, id="switched-off-removes-at-once"),
        pytest.param(pod(), 1024, False, None, id="switched-off-sets-nothing"),
        pytest.param(pod({objects.DO_NOT_DISRUPT: "true"}), 0, True, None, id="someone-elses-annotation-never-removed"),
        pytest.param(
            pod({objects.SAFE_TO_EVICT: "true"}), 1024, True, None, id="someone-elses-annotation-never-overwritten"
        ),
        pytest.param(
            disruption.PodSeen({**mine(100).annotations, objects.DO_NOT_DISRUPT: "false"}, LABEL),
            1024,
            True,
            protect(100),
            id="changed-by-hand-set-again-same-since",
        ),
        pytest.param(
            pod({**SET, objects.PROTECTED_ANNOTATION: "garbled"}),
            0,
            True,
            {"annotations": {**REMOVE, objects.PROTECTION_BEGAN_ANNOTATION: "0"}},
            id="unreadable-mark-counts-as-old",
        ),
        # The bound (an hour here), counted from the first protection.
        pytest.param(mine(HOUR - 1), 1024, True, None, id="within-the-bound-stays"),
        pytest.param(mine(HOUR), 1024, True, UNPROTECT, id="at-the-bound-comes-off-with-unique-data"),
        pytest.param(mine(60, began=HOUR), 1024, True, UNPROTECT, id="the-bound-counts-from-the-first-protection"),
        pytest.param(
            pod({objects.PROTECTION_BEGAN_ANNOTATION: at(HOUR)}),
            1024,
            True,
            None,
            id="bound-spent-never-protected-again",
        ),
        pytest.param(
            pod({objects.PROTECTION_BEGAN_ANNOTATION: at(600)}),
            1024,
            True,
            protect(0, began=600),
            id="protected-again-keeps-when-it-first-began",
        ),
        pytest.param(
            disruption.PodSeen({**SET, objects.PROTECTED_ANNOTATION: at(2 * HOUR)}),
            1024,
            True,
            {"annotations": {**REMOVE, objects.PROTECTION_BEGAN_ANNOTATION: at(2 * HOUR)}},
            id="marks-set-before-the-bound-count-from-their-own-time",
        ),
        pytest.param(
            disruption.PodSeen({**SET, objects.PROTECTED_ANNOTATION: at(100)}),
            1024,
            True,
            protect(100),
            id="marks-set-before-the-label-get-it",
        ),
        pytest.param(
            disruption.PodSeen({**mine(100).annotations, objects.PROTECTION_BEGAN_ANNOTATION: at(-86400)}, LABEL),
            1024,
            True,
            UNPROTECT,
            id="a-beginning-in-the-future-counts-as-long-ago",
        ),
        pytest.param(
            disruption.PodSeen({**mine(100).annotations, objects.PROTECTION_BEGAN_ANNOTATION: "inf"}, LABEL),
            1024,
            True,
            UNPROTECT,
            id="an-unreadable-beginning-counts-as-long-ago",
        ),
        # Pods the policy's label found outside its workload, and the label alone.
        pytest.param(mine(100, ours=False), 1024, True, UNPROTECT, id="left-the-workload-unprotected"),
        pytest.param(pod(**LABEL), 0, True, {"labels": {objects.PROTECTED_LABEL: None}}, id="a-bare-label-goes"),
        pytest.param(mine(100, label="q"), 1024, True, protect(100), id="another-policys-label-becomes-ours"),
    ],
)
def test_plan_annotations(
    found: disruption.PodSeen, unique: int | None, enabled: bool, expected: dict[str, Any] | None
) -> None:
    assert plan(found, unique, enabled) == expected


@pytest.mark.parametrize(
    ("unreachable_since", "expected"),
    [
        pytest.param(NOW - 60, None, id="a-minute-out-of-reach-changes-nothing"),
        pytest.param(NOW - disruption.UNREACHABLE_SECONDS, UNPROTECT, id="long-out-of-reach-unprotects"),
        pytest.param(None, UNPROTECT, id="out-of-reach-since-unknown-counts-as-long"),
    ],
)
def test_a_scheduler_out_of_reach(unreachable_since: float | None, expected: dict[str, Any] | None) -> None:
    assert plan(mine(100), None, reached=False, unreachable_since=unreachable_since) == expected
    assert plan(pod(), None, reached=False, unreachable_since=unreachable_since) is None, "nothing is ever set"


def test_a_bound_of_nothing_protects_nothing() -> None:
    assert plan(pod(), 1024, max_seconds=0) is None
    assert plan(mine(5), 1024, max_seconds=0) == UNPROTECT


def test_only_the_pods_that_change_are_written() -> None:
    pods = {"a": pod(), "b": mine(100), "c": pod()}
    patches = disruption.plan_annotations(
        pods, {"a": 1, "b": 1, "c": 0, "d": 5}, policy="p", enabled=True, max_seconds=HOUR, now=NOW
    )
    assert sorted(patches) == ["a"], "b holds its protection, c holds nothing alone, d is no pod of the workload"


def test_release_takes_off_the_policys_marks_only() -> None:
    pods = {
        "labelled": mine(5, ours=False),
        "before-labels": disruption.PodSeen({**SET, objects.PROTECTED_ANNOTATION: at(5)}, ours=False),
        "another-policys": mine(5, label="q", ours=False),
        "owners": pod({objects.DO_NOT_DISRUPT: "true"}),
        "bare-label": pod(**LABEL),
    }
    assert disruption.release(pods, "p", NOW) == {
        "labelled": UNPROTECT,
        "before-labels": {"annotations": {**REMOVE, objects.PROTECTION_BEGAN_ANNOTATION: at(5)}},
        "bare-label": {"labels": {objects.PROTECTED_LABEL: None}},
    }


@pytest.mark.parametrize(
    ("own", "administrator", "expected"),
    [
        pytest.param(None, HOUR, HOUR, id="absent-the-administrators"),
        pytest.param("10m", HOUR, 600.0, id="lower-wins"),
        pytest.param("168h", HOUR, HOUR, id="never-above-the-administrators"),
        pytest.param("0s", HOUR, 0.0, id="none"),
        pytest.param("10m", 0.0, 0.0, id="off-in-the-namespace"),
    ],
)
def test_the_bound_is_the_lower_of_the_policys_and_the_administrators(
    own: str | None, administrator: float, expected: float
) -> None:
    eviction = specs.EvictionSpec.model_validate({"maxDisruptionProtection": own} if own else {})
    assert disruption.bound(eviction, administrator) == expected


def test_the_administrators_flags() -> None:
    assert disruption.administrator() == disruption.DEFAULTS
    assert disruption.DEFAULTS.max_in("team") == HOUR
    set_ = disruption.administrator("30m", ["team", "ml"])
    assert (set_.max_in("team"), set_.max_in("ml"), set_.max_in("other")) == (0.0, 0.0, 1800.0)
    for bad in (("forever", []), ("9000h", []), ("1h", ["team,ml"]), ("1h", ["Team"])):
        with pytest.raises(ValueError):
            disruption.administrator(*bad)


# -- the pass' decision (memops.decisions.policy_decisions.decide) -------------------------------


def _decide(
    seen: policy_decisions.DisruptionSeen,
    *,
    protection: float | None = None,
    unreachable_since: float | None = None,
    **eviction: Any,
) -> dict[str, Any]:
    """The pass' disruption patches; with ``unreachable_since``, SchedulerReachable has been False since then."""
    spec = specs.MemoryPolicySpec.model_validate(
        {
            "scheduler": {"address": "tcp://dask-scheduler:8786"},
            "workload": {"kind": "Deployment", "name": "w"},
            "replicas": 1,
            "eviction": eviction,
        }
    )
    reachable = conditions.set_condition([], "SchedulerReachable", True, reason="Connected", generation=1)
    if unreachable_since is not None:
        since = timestamps.render(datetime.datetime.fromtimestamp(unreachable_since, tz=datetime.UTC))
        reachable = conditions.set_condition(
            [], "SchedulerReachable", False, reason="SchedulerUnreachable", generation=1, at=since
        )
    inputs = policy_decisions.Inputs(
        owner=objects.Owner(name="p", namespace="team", uid="uid-p"),
        generation=1,
        spec=spec,
        status=specs.MemoryPolicyStatus(conditions=reachable),
        current=1,
        replicas=1,
        now=NOW,
        disruption=seen,
        **({} if protection is None else {"protection": protection}),  # None: the operator's default
    )
    return dict(policy_decisions.decide(inputs).annotations)


def test_a_worker_that_holds_unique_data_for_ever_is_not_protected_for_ever() -> None:
    """Its scheduler reports unique bytes on every pass: protection still ends, at the operator's
    default bound (an hour), and is not set again on the passes after."""
    before = {**SET, objects.PROTECTED_ANNOTATION: f"{NOW - 2 * 3600:.0f}"}  # protected two hours ago
    seen = policy_decisions.DisruptionSeen(pods={"w-1": before}, unique={"w-1": 4096})
    patches = _decide(seen)
    assert set(patches) == {"w-1"}, "protected for two hours: the marks come off"
    began = f"{NOW - 2 * 3600:.0f}"
    assert patches["w-1"] == {"annotations": {**REMOVE, objects.PROTECTION_BEGAN_ANNOTATION: began}}
    # The next pass: the marks are off, and the pod says when its protection began.
    after = {objects.PROTECTION_BEGAN_ANNOTATION: began}
    assert _decide(policy_decisions.DisruptionSeen(pods={"w-1": after}, unique={"w-1": 4096})) == {}


def _seen(
    annotations: Mapping[str, str], unique: int | None, labels: Mapping[str, str] = LABEL
) -> policy_decisions.DisruptionSeen:
    held = {"w-1": unique} if unique is not None else None
    return policy_decisions.DisruptionSeen(pods={"w-1": annotations}, unique=held, labels={"w-1": labels})


def test_the_policys_own_bound_only_lowers_the_administrators() -> None:
    protected = mine(20 * 60).annotations
    assert _decide(_seen(protected, 4096), maxDisruptionProtection="10m") == {"w-1": UNPROTECT}
    assert _decide(_seen(protected, 4096), maxDisruptionProtection="2h") == {}
    assert _decide(_seen(protected, 4096), protection=600, maxDisruptionProtection="2h") == {"w-1": UNPROTECT}


def test_a_namespace_without_protection() -> None:
    """The administrator's bound is 0 there (``--no-disruption-protection-in``)."""
    assert _decide(_seen(mine(5).annotations, 4096), protection=0) == {"w-1": UNPROTECT}
    assert _decide(_seen({}, 4096, labels={}), protection=0) == {}


def test_the_scheduler_out_of_reach_counts_from_its_condition() -> None:
    protected = mine(100).annotations
    assert _decide(_seen(protected, None), unreachable_since=NOW - 60) == {}
    assert _decide(_seen(protected, None), unreachable_since=NOW - 600) == {"w-1": UNPROTECT}


def test_a_pod_that_left_the_workload_is_unprotected_whatever_the_scheduler_says() -> None:
    seen = policy_decisions.DisruptionSeen(
        pods={}, unique={"old-1": 4096}, labels={"old-1": LABEL}, strays={"old-1": mine(100).annotations}
    )
    assert _decide(seen) == {"old-1": UNPROTECT}
