"""Conditions keep their lastTransitionTime until their status changes."""

from memops import specs
from memops.decisions import conditions


def test_transition_time_moves_only_when_status_changes() -> None:
    first = conditions.set_condition([], "Ready", True, reason="A", generation=1, at="2026-01-01T00:00:00Z")
    same = conditions.set_condition(
        first, "Ready", True, reason="B", message="m", generation=2, at="2026-01-02T00:00:00Z"
    )
    flipped = conditions.set_condition(same, "Ready", False, reason="C", generation=3, at="2026-01-03T00:00:00Z")
    assert same[0].lastTransitionTime == "2026-01-01T00:00:00Z"
    assert (same[0].reason, same[0].message, same[0].observedGeneration) == ("B", "m", 2)
    assert flipped[0].lastTransitionTime == "2026-01-03T00:00:00Z"
    assert flipped[0].status == "False"


def test_other_conditions_are_kept() -> None:
    existing = [specs.Condition(type="Other", status="True", reason="X")]
    updated = conditions.set_condition(existing, "Ready", None, reason="Unknown", generation=1)
    assert [(c.type, c.status) for c in updated] == [("Other", "True"), ("Ready", "Unknown")]
    assert conditions.get_condition(updated, "Ready") is updated[1]


def _types(conds: list[specs.Condition]) -> dict[str, str]:
    return {c.type: c.status for c in conds}


def test_kstatus_conditions_follow_a_requests_phase() -> None:
    status = specs.RetirementRequestStatus(phase=specs.Phase.DRAINING, message="draining 2", observedGeneration=3)
    draining = conditions.request_summary(status)
    assert _types(draining) == {"Reconciling": "True", "Stalled": "False", "Ready": "False"}
    assert all(c.observedGeneration == 3 for c in draining)

    status.phase, status.message = specs.Phase.FAILED, "kept 1 worker"
    status.conditions = conditions.set_condition(
        draining, "Failed", True, reason="DrainTimedOut", message="kept", generation=3
    )
    failed = conditions.request_summary(status)
    assert _types(failed)["Stalled"] == "True" and _types(failed)["Reconciling"] == "False"
    stalled = conditions.get_condition(failed, "Stalled")
    assert stalled is not None and stalled.reason == "DrainTimedOut"

    status.phase, status.conditions = specs.Phase.SUCCEEDED, []
    assert _types(conditions.request_summary(status)) == {"Reconciling": "False", "Stalled": "False", "Ready": "True"}
