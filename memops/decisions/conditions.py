"""Status conditions as Kubernetes API conventions define them (metav1.Condition).

Pure functions over the spec models' :class:`memops.specs.Condition`; used by every
controller so that ``lastTransitionTime`` changes only when ``status`` does, and every
condition carries the ``observedGeneration`` it was computed for.
"""

from __future__ import annotations

from memops import specs
from memops.decisions import timestamps


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


def is_true(conditions: list[specs.Condition], type_: str) -> bool:
    condition = get_condition(conditions, type_)
    return condition is not None and condition.status == "True"


def with_kstatus(
    conditions: list[specs.Condition],
    *,
    generation: int,
    reconciling: tuple[str, str] | None = None,
    stalled: tuple[str, str] | None = None,
) -> list[specs.Condition]:
    """``Reconciling`` and ``Stalled`` as kstatus (Flux, ``kubectl wait``) defines them.

    Both have "abnormal-true" polarity: True, with a (reason, message), only while the object
    is being worked on or cannot progress without a change from someone; False otherwise.
    ``Ready`` is set by the controllers themselves.
    """
    for type_, value in (("Reconciling", reconciling), ("Stalled", stalled)):
        reason, message = value if value is not None else (f"No{type_}", "")
        conditions = set_condition(
            conditions, type_, value is not None, reason=reason, message=message, generation=generation
        )
    return conditions


def request_summary(status: specs.RetirementRequestStatus) -> list[specs.Condition]:
    """A RetirementRequest's ``Ready``, ``Reconciling`` and ``Stalled``, from its phase."""
    generation = status.observedGeneration
    failed = get_condition(status.conditions, "Failed")
    if status.phase == specs.Phase.FAILED:
        reason = failed.reason if failed is not None and failed.status == "True" else "Failed"
        updated = with_kstatus(status.conditions, generation=generation, stalled=(reason, status.message))
    elif status.phase == specs.Phase.SUCCEEDED:
        updated = with_kstatus(status.conditions, generation=generation)
    else:
        updated = with_kstatus(
            status.conditions, generation=generation, reconciling=(status.phase.value, status.message)
        )
    return set_condition(
        updated,
        "Ready",
        status.phase == specs.Phase.SUCCEEDED,
        reason=status.phase.value,
        message=status.message,
        generation=generation,
    )
