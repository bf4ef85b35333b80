"""Task admission's sharing of a process' growth among its running tasks
(:func:`memops.worker.admission.attribute`), for any holdings, caps, change and page faults: each
share stays within 0 and its cap, and no growth is lost or made up while a task has room under its
cap. Derandomized, with a fixed budget of examples."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memops.worker import admission

FUZZ = settings(
    max_examples=400, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow], database=None
)
GIB = 2**30
sizes = st.integers(min_value=0, max_value=4 * GIB)
tasks = st.dictionaries(st.sampled_from("abcdefgh"), st.tuples(sizes, sizes, st.integers(0, 10**6)), max_size=8)


@FUZZ
@given(
    tasks=tasks,
    delta=st.integers(min_value=-4 * GIB, max_value=4 * GIB),
    other=st.integers(0, 10**6),
    fresh=st.sets(st.sampled_from("abcdefgh")),
    busy=st.sets(st.sampled_from("abcdefgh")),
)
def test_shares_stay_within_their_bounds_and_add_up_to_the_change(
    tasks: dict[str, tuple[int, int, int]], delta: int, other: int, fresh: set[str], busy: set[str]
) -> None:
    held = {key: float(min(h, cap)) for key, (h, cap, _) in tasks.items()}
    caps = {key: float(cap) for key, (_, cap, _) in tasks.items()}
    faults = {key: f for key, (_, _, f) in tasks.items()}
    result = admission.attribute(held, caps, delta, faults, other, fresh, busy)
    assert set(result) == set(held)
    for key, value in result.items():
        assert 0 <= value <= caps[key] + 1e-6
    before, after = sum(held.values()), sum(result.values())
    if delta >= 0:
        # Growth is given until every task is at its cap: none lost while one has room.
        assert after - before <= delta + 1
        assert after - before >= delta - 1 or all(abs(result[k] - caps[k]) < 1 for k in result)
    else:
        # Memory given back is taken until every task holds nothing.
        assert before - after <= -delta + 1
        assert before - after >= -delta - 1 or all(value < 1 for value in result.values())
