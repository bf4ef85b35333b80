"""Label selectors with matchLabels and matchExpressions: what they match, how they render, what is refused."""

from typing import Any

import pytest

from memops.decisions import selectors

MEXP = {"matchExpressions": [{"key": "app", "operator": "In", "values": ["mexp"]}]}


@pytest.mark.parametrize(
    ("selector", "labels", "expected"),
    [
        pytest.param({"matchLabels": {"app": "w"}}, {"app": "w", "x": "y"}, True, id="matchLabels"),
        pytest.param({"matchLabels": {"app": "w"}}, {"app": "v"}, False, id="matchLabels-other-value"),
        pytest.param(MEXP, {"app": "mexp"}, True, id="In"),
        pytest.param(MEXP, {"app": "other"}, False, id="In-unrelated-pod"),
        pytest.param(MEXP, {}, False, id="In-no-label"),
        pytest.param(
            {"matchLabels": {"app": "w"}, "matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["a"]}]},
            {"app": "w", "tier": "b"},
            True,
            id="NotIn-other-value",
        ),
        pytest.param(
            {"matchLabels": {"app": "w"}, "matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["a"]}]},
            {"app": "w", "tier": "a"},
            False,
            id="NotIn-excluded",
        ),
        pytest.param({"matchExpressions": [{"key": "w", "operator": "Exists"}]}, {"w": ""}, True, id="Exists"),
        pytest.param({"matchExpressions": [{"key": "w", "operator": "Exists"}]}, {}, False, id="Exists-absent"),
        pytest.param(
            {"matchExpressions": [{"key": "w", "operator": "Exists"}, {"key": "old", "operator": "DoesNotExist"}]},
            {"w": "1", "old": "1"},
            False,
            id="DoesNotExist",
        ),
        pytest.param({}, {"app": "w"}, False, id="empty-selects-nothing"),
        pytest.param(None, {"app": "w"}, False, id="missing-selects-nothing"),
    ],
)
def test_matches(selector: Any, labels: dict[str, str], expected: bool) -> None:
    assert selectors.matches(selector, labels) is expected


@pytest.mark.parametrize(
    ("selector", "rendered"),
    [
        pytest.param({"matchLabels": {"b": "2", "a": "1"}}, "a=1,b=2", id="matchLabels-sorted"),
        pytest.param(MEXP, "app=mexp", id="In-one-value"),
        pytest.param(
            {"matchExpressions": [{"key": "app", "operator": "In", "values": ["y", "x"]}]},
            "app in (x,y)",
            id="In",
        ),
        pytest.param(
            {
                "matchLabels": {"app": "w"},
                "matchExpressions": [
                    {"key": "tier", "operator": "NotIn", "values": ["a"]},
                    {"key": "w", "operator": "Exists"},
                    {"key": "old", "operator": "DoesNotExist"},
                ],
            },
            "app=w,tier notin (a),w,!old",
            id="all-operators",
        ),
    ],
)
def test_render(selector: Any, rendered: str) -> None:
    # That the API server reads it back to the selection `matches` makes is checked against the
    # real one: tests/sandbox/test_controlplane.py.
    assert selectors.render(selector) == rendered


@pytest.mark.parametrize(
    ("selector", "message"),
    [
        pytest.param(None, "spec.selector: missing", id="missing"),
        pytest.param({}, "spec.selector: empty", id="empty"),
        pytest.param({"matchLabels": {}, "matchExpressions": []}, "spec.selector: empty", id="empty-lists"),
        pytest.param(
            {"matchExpressions": [{"key": "a", "operator": "Gt", "values": ["1"]}]},
            "spec.selector.matchExpressions[0].operator: 'Gt' is not one of",
            id="unknown-operator",
        ),
        pytest.param(
            {"matchExpressions": [{"key": "a", "operator": "In", "values": []}]},
            "spec.selector.matchExpressions[0].values: In needs at least one value",
            id="In-without-values",
        ),
        pytest.param(
            {"matchExpressions": [{"key": "a", "operator": "NotIn", "values": ["x"]}]},
            "selects by exclusion only",
            id="exclusion-only",
        ),
    ],
)
def test_refused_selectors_name_the_field(selector: Any, message: str) -> None:
    with pytest.raises(selectors.InvalidSelector, match=message.replace("[", r"\[").replace("]", r"\]")):
        selectors.render(selector)
