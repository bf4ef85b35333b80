"""What the admission webhooks read of the objects they are handed, checked before any decision.

The safety net's webhook reads a new pod (:func:`memops.decisions.safetynet.plan_injection`); the eviction
gate reads the Eviction, the pod, the workload's pods and its RetirementRequests
(:mod:`memops.decisions.eviction_gate`). The deciding code reads plain dicts and trusts their shape: the API
server types every Pod and Eviction, and the CRDs' schemas type the requests. These shapes state
that trust, field by field, for the fields the deciding code reads, so that an object outside it
(a client or a cache that is not the API server, a schema that changed) is refused here, by a
:class:`MalformedObject` naming the field, and never crashes the decision with a TypeError.

Pure: pydantic only (strict: no "30" for 30, no ``true`` for a number).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Required

import pydantic
from typing_extensions import TypedDict  # pydantic reads only this one before Python 3.12


class MalformedObject(ValueError):
    """An object whose fields are not what the API server sends; the message names the field."""


class _Metadata(TypedDict, total=False):
    name: str
    namespace: str
    labels: dict[str, str] | None
    annotations: dict[str, str] | None
    creationTimestamp: str | None
    deletionTimestamp: str | None


class _RequiredMetadata(TypedDict, total=False):
    name: Required[str]
    namespace: str
    labels: dict[str, str] | None
    creationTimestamp: str | None
    deletionTimestamp: str | None


class _Named(TypedDict, total=False):
    name: Required[str]  # a volume, a volume mount


class _EnvVar(TypedDict, total=False):
    name: Required[str]
    value: str | None
    valueFrom: dict[str, Any] | None


class _Resources(TypedDict, total=False):
    limits: dict[str, str | int | float] | None
    requests: dict[str, str | int | float] | None


class _Container(TypedDict, total=False):
    name: str
    command: list[str] | None
    args: list[str] | None
    env: list[_EnvVar]
    lifecycle: dict[str, Any]
    resources: _Resources | None
    volumeMounts: list[_Named] | None


class _Term(TypedDict, total=False):
    matchExpressions: list[dict[str, Any]] | None


class _NodeSelector(TypedDict, total=False):
    nodeSelectorTerms: list[_Term] | None


class _NodeAffinity(TypedDict, total=False):
    requiredDuringSchedulingIgnoredDuringExecution: _NodeSelector


class _Affinity(TypedDict, total=False):
    nodeAffinity: _NodeAffinity


class _PodSpec(TypedDict, total=False):
    terminationGracePeriodSeconds: int
    nodeName: str | None
    containers: list[_Container]
    initContainers: list[_Container] | None
    volumes: list[_Named] | None
    affinity: _Affinity | None
    resources: _Resources | None


class _PodStatus(TypedDict, total=False):
    phase: str | None


class _Pod(TypedDict, total=False):
    metadata: _Metadata
    spec: _PodSpec
    status: _PodStatus | None


class _ListedPod(TypedDict, total=False):
    """A pod the API server has stored, which has a name (a pod under admission may have only
    ``generateName``)."""

    metadata: Required[_RequiredMetadata]
    spec: _PodSpec
    status: _PodStatus | None


class _Eviction(TypedDict, total=False):
    metadata: _Metadata
    deleteOptions: dict[str, Any] | None


class _WorkerEntry(TypedDict, total=False):
    pod: str | None
    state: str | None
    bytesLost: int | None
    message: str | None


class _RequestSpec(TypedDict, total=False):
    workers: list[str] | None
    onTimeout: str | None


class _RequestStatus(TypedDict, total=False):
    phase: str | None
    deadline: str | None
    message: str | None
    workers: list[_WorkerEntry] | None


class _Request(TypedDict, total=False):
    metadata: Required[_RequiredMetadata]
    spec: _RequestSpec | None
    status: _RequestStatus | None


class _Listed(TypedDict, total=False):
    """A MemoryPolicy or a Deployment as the policy controller's indexes keep them: their spec is
    read by the spec model or the selector parser, which refuse what they cannot read."""

    metadata: Required[_RequiredMetadata]
    spec: dict[str, Any]


POD = pydantic.TypeAdapter(_Pod)
LISTED_POD = pydantic.TypeAdapter(_ListedPod)
EVICTION = pydantic.TypeAdapter(_Eviction)
REQUEST = pydantic.TypeAdapter(_Request)
LISTED = pydantic.TypeAdapter(_Listed)
LABELS = pydantic.TypeAdapter(dict[str, str])


def check(shape: pydantic.TypeAdapter[Any], value: Any, what: str) -> Mapping[str, Any]:
    """``value``, if it has ``shape``; else :class:`MalformedObject` naming the first wrong field."""
    try:
        shape.validate_python(value, strict=True)
    except pydantic.ValidationError as exc:
        error = exc.errors()[0]
        field = ".".join(str(part) for part in error["loc"]) or "(the object)"
        raise MalformedObject(f"{what}: {field}: {error['msg']}") from None
    return value  # type: ignore[no-any-return]


def well_formed(shape: pydantic.TypeAdapter[Any], values: Iterable[Any]) -> list[Any]:
    """The ``values`` that have ``shape``; the others are left out (a cache's malformed object
    must not stop the decision about the well-formed ones)."""
    kept = []
    for value in values:
        try:
            shape.validate_python(value, strict=True)
        except pydantic.ValidationError:
            continue
        kept.append(value)
    return kept
