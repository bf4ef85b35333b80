"""When a copy on its way between workers is given up: one rule for the drain and pressure relief."""

from __future__ import annotations

import pytest

from memops.scheduler import drain, relief, transfers

MIB = 2**20


@pytest.mark.parametrize(
    ("nbytes", "grace", "elapsed", "expired"),
    [
        pytest.param(0, 5.0, 5.0, False, id="small-at-its-grace"),
        pytest.param(0, 5.0, 5.01, True, id="small-past-its-grace"),
        pytest.param(500 * MIB, 5.0, 14.9, False, id="large-within-its-transfer-time"),
        pytest.param(500 * MIB, 5.0, 15.1, True, id="large-past-its-transfer-time"),
        pytest.param(500 * MIB, 10.0, 19.9, False, id="the-drain's-longer-grace"),
    ],
)
def test_a_copy_is_given_up_after_its_grace_and_its_transfer_time(
    nbytes: int, grace: float, elapsed: float, expired: bool
) -> None:
    assert transfers.expired(100.0, nbytes, grace, 100.0 + elapsed) is expired


def test_the_drain_and_relief_follow_the_same_rule_with_their_own_grace() -> None:
    copy = drain.Copy(target="tcp://b", nbytes=100 * MIB, asked=0.0)
    move = relief.Move(source="tcp://a", nbytes=100 * MIB, target="tcp://b", planned=0.0)
    for now in (1.0, 6.9, 7.1, 11.9, 12.1):
        assert copy.expired(now) is transfers.expired(0.0, 100 * MIB, drain.IN_FLIGHT_SECONDS, now)
        assert move.expired(now) is transfers.expired(0.0, 100 * MIB, relief.IN_FLIGHT_SECONDS, now)
    assert not relief.Move(source="a", nbytes=0, target="b", planned=0.0, left=1.0).expired(100.0), "left: not given up"
