"""Conditions keep their lastTransitionTime until their status changes."""

from memops import conditions, specs


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
