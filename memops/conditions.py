"""Status conditions as Kubernetes API conventions define them (metav1.Condition).

Pure functions over the spec models' :class:`memops.specs.Condition`; used by every
controller so that ``lastTransitionTime`` changes only when ``status`` does, and every
condition carries the ``observedGeneration`` it was computed for.
"""

from __future__ import annotations

from memops import specs, timestamps


def now() -> str:
    return timestamps.render(timestamps.now())


def set_condition(
    conditions: list[specs.Condition],
    type_: str,
    status: bool | None,
    *,
    reason: str,
    message: str = "",
    generation: int,
    at: str | None = None,
) -> list[specs.Condition]:
    """Return ``conditions`` with ``type_`` set; other conditions are kept as they are."""
    value = "Unknown" if status is None else ("True" if status else "False")
    previous = next((c for c in conditions if c.type == type_), None)
    transition = previous.lastTransitionTime if previous is not None and previous.status == value else (at or now())
    updated = specs.Condition(
        type=type_,
        status=value,  # type: ignore[arg-type]
        reason=reason,
        message=message,
        lastTransitionTime=transition,
        observedGeneration=generation,
    )
    return [c for c in conditions if c.type != type_] + [updated]


def get_condition(conditions: list[specs.Condition], type_: str) -> specs.Condition | None:
    return next((c for c in conditions if c.type == type_), None)
