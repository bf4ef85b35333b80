"""Fuzzing the spec models: any document is either a valid spec or a ValidationError naming a
field, quickly; never another exception (which the controllers would not turn into a status)."""

from __future__ import annotations

import time
from typing import Any

import pydantic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memops import specs
from tests.fuzz import strategies

SLOW_SECONDS = 2.0
"""One validation's bound: about a millisecond is usual, so this allows for a loaded machine."""
BUDGET = settings(
    max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow], database=None
)
"""About a second of CPU per test (more where the machine is shared): derandomized, so CI runs the
same examples every time; run with more examples (and without derandomize) to search further."""

MODELS = {
    "MemoryPolicy": specs.MemoryPolicySpec,
    "RetirementRequest": specs.RetirementRequestSpec,
}


def validate(model: type[pydantic.BaseModel], document: Any) -> None:
    started = time.perf_counter()
    try:
        model.model_validate(document)
    except pydantic.ValidationError as exc:
        for error in exc.errors():
            # A field's path; at the root, the spec itself is not an object, or a rule across
            # fields says which in its message.
            named = any(name in error["msg"] for name in model.model_fields)
            assert error["loc"] or error["type"] == "model_type" or named, error
    finally:
        elapsed = time.perf_counter() - started
        assert elapsed < SLOW_SECONDS, f"{elapsed:.2f} s to validate"


@pytest.mark.parametrize("kind", MODELS)
@BUDGET
@given(data=st.data())
def test_arbitrary_documents(kind: str, data: st.DataObject) -> None:
    validate(MODELS[kind], data.draw(strategies.json_values))


@pytest.mark.parametrize("kind", MODELS)
@settings(BUDGET, max_examples=60)
@given(data=st.data())
def test_mutated_examples(kind: str, data: st.DataObject) -> None:
    validate(MODELS[kind], data.draw(strategies.mutated(strategies.example_specs(kind))))
