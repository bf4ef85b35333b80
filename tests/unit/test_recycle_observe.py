"""What the recycling read finds to record and to show (applied later by the pass' apply)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from memops import specs
from memops.controllers import recycle
from memops.decisions import objects


def _request(name: str, phase: str, *, recorded: bool = False) -> objects.Obj:
    annotations = {
        objects.RECYCLE_ANNOTATION: json.dumps(
            {"reason": "Leak", "message": "grew", "startTime": "2026-01-01T00:00:00Z"}
        ),
        objects.POD_ANNOTATION: f"pod-{name}",
    }
    if recorded:
        annotations[objects.RECORDED_ANNOTATION] = "true"
    status: dict[str, Any] = {"phase": phase, "completionTime": "2026-01-01T00:01:00Z", "message": "kept: no room"}
    return {"metadata": {"name": name, "annotations": annotations}, "status": status}


@pytest.mark.parametrize(
    ("request_", "recorded", "ended", "unmark"),
    [
        pytest.param(_request("r", "Succeeded"), ("r",), [("pod-r", "Recycled", "grew", 60.0)], (), id="recycled"),
        pytest.param(
            _request("r", "Failed"), ("r",), [("pod-r", "Kept", "kept: no room", 60.0)], ("pod-r",), id="kept"
        ),
        pytest.param(_request("r", "Succeeded", recorded=True), (), [], (), id="recorded-before"),
        pytest.param(_request("r", "Draining"), (), [], (), id="not-finished"),
    ],
)
def test_finished_drains_are_recorded_once(
    request_: objects.Obj, recorded: tuple[str, ...], ended: list[tuple[str, str, str, float]], unmark: tuple[str, ...]
) -> None:
    record = specs.RecycleStatus()
    found, new, unmarked = recycle._record_finished([request_], record)
    assert found == recorded
    assert [(e.pod, e.outcome, e.message, e.seconds) for e in new] == ended
    assert unmarked == unmark
    assert [r.request for r in record.recent] == [e for e in ("r",) if ended]
    again = recycle._record_finished([request_], record)
    assert again[1] == (), "an entry already in the record is not counted again"
