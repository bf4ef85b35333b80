"""Kubernetes label selectors (``matchLabels`` and ``matchExpressions``): matching and rendering.

Pure. Every place memops reads a workload's selector goes through here: listing its pods
(:func:`render`, for the API's ``labelSelector``), the webhook's match of a new pod
(:func:`matches`) and the ``status.selector`` that ``/scale`` reports. The operators are
those of ``metav1.LabelSelector`` (``In``, ``NotIn``, ``Exists``, ``DoesNotExist``); the
rendering is that of ``metav1.FormatLabelSelector`` (``k in (a,b)``, ``k notin (a)``, ``k``,
``!k``). An empty or missing selector selects every pod of the namespace in Kubernetes; memops
refuses it (:class:`InvalidSelector`) rather than act on pods that are not the workload's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")


class InvalidSelector(ValueError):
    """A selector memops will not act on; the message names the field."""


@dataclass(frozen=True)
class Requirement:
    key: str
    operator: str  # one of OPERATORS
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        if self.operator == "In":
            return self.key in labels and labels[self.key] in self.values
        if self.operator == "NotIn":
            return self.key not in labels or labels[self.key] not in self.values
        if self.operator == "Exists":
            return self.key in labels
        return self.key not in labels  # DoesNotExist

    def render(self) -> str:
        if self.operator == "In" and len(self.values) == 1:
            return f"{self.key}={self.values[0]}"  # as matchLabels renders, and the same set
        if self.operator == "In":
            return f"{self.key} in ({','.join(sorted(self.values))})"
        if self.operator == "NotIn":
            return f"{self.key} notin ({','.join(sorted(self.values))})"
        if self.operator == "Exists":
            return self.key
        return f"!{self.key}"


def parse(selector: Any, field: str = "spec.selector") -> tuple[Requirement, ...]:
    """The requirements of a ``LabelSelector``; raises :class:`InvalidSelector` naming the field.

    ``matchLabels`` entries become ``In`` requirements of one value, as Kubernetes reads them.
    """
    if not isinstance(selector, Mapping):
        raise InvalidSelector(f"{field}: missing: a workload without a selector would select every pod")
    requirements: list[Requirement] = []
    labels = selector.get("matchLabels") or {}
    if not isinstance(labels, Mapping):
        raise InvalidSelector(f"{field}.matchLabels: must be a map of strings")
    for key, value in sorted(labels.items()):
        requirements.append(Requirement(str(key), "In", (str(value),)))
    expressions = selector.get("matchExpressions") or []
    if not isinstance(expressions, list):
        raise InvalidSelector(f"{field}.matchExpressions: must be a list")
    for index, expression in enumerate(expressions):
        where = f"{field}.matchExpressions[{index}]"
        if not isinstance(expression, Mapping) or not expression.get("key"):
            raise InvalidSelector(f"{where}.key: required")
        operator = expression.get("operator")
        if operator not in OPERATORS:
            raise InvalidSelector(f"{where}.operator: {operator!r} is not one of {', '.join(OPERATORS)}")
        values = expression.get("values") or []
        if not isinstance(values, list):
            raise InvalidSelector(f"{where}.values: must be a list")
        if operator in ("In", "NotIn") and not values:
            raise InvalidSelector(f"{where}.values: {operator} needs at least one value")
        if operator in ("Exists", "DoesNotExist") and values:
            raise InvalidSelector(f"{where}.values: {operator} takes no values")
        requirements.append(Requirement(str(expression["key"]), str(operator), tuple(str(v) for v in values)))
    if not requirements:
        raise InvalidSelector(f"{field}: empty: a workload whose selector is empty would select every pod")
    if not any(r.operator in ("In", "Exists") for r in requirements):
        # Only exclusions (NotIn, DoesNotExist): it selects every pod but a few, which is
        # "everything" for any namespace that holds another workload.
        raise InvalidSelector(
            f"{field}: selects by exclusion only (NotIn, DoesNotExist): it would select unrelated pods"
        )
    return tuple(requirements)


def render(selector: Any, field: str = "spec.selector") -> str:
    """The selector as the API's ``labelSelector`` parameter (and ``status.selector``) takes it."""
    return ",".join(r.render() for r in parse(selector, field))


def matches(selector: Any, labels: Mapping[str, str]) -> bool:
    """Whether the selector selects these labels; an invalid or empty selector selects nothing."""
    try:
        requirements = parse(selector)
    except InvalidSelector:
        return False
    return all(r.matches(labels) for r in requirements)
