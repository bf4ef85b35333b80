"""What a peer's count is believed to be: the one rule that every reader of a scheduler's reply, a
worker's report and the kubelet's summary shares."""

from __future__ import annotations

from typing import Any

import pytest

from memops.decisions import counts


@pytest.mark.parametrize(
    ("value", "plain", "shown"),
    [
        (0, 0, 0),
        (7, 7, 7),
        (2**63 - 1, 2**63 - 1, 2**63 - 1),
        (2**63, None, 0),
        (-1, None, 0),
        (True, None, 0),
        (1.0, None, 0),
        ("7", None, 0),
        (None, None, 0),
        ([7], None, 0),
    ],
)
def test_only_plain_integers_in_range_are_believed(value: Any, plain: int | None, shown: int) -> None:
    assert counts.plain(value) == plain
    assert counts.or_zero(value) == shown
