"""What both kinds share: the API group, durations, quantities and names as Kubernetes writes them,
the scheduler and workload references, the status condition, and what the CRD generator needs of a
kind (its printer columns among it).
"""

from __future__ import annotations

import datetime
import decimal
import enum
import re
from typing import Annotated, Any, Literal

import pydantic

GROUP = "memops.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

# Go's time.ParseDuration syntax, which is what Kubernetes users write ("10m", "1h30m", "90s").
DURATION_PATTERN = r"^([0-9]+(\.[0-9]+)?(ms|s|m|h))+$"
DURATION_MAX_LENGTH = 32
"""Longer texts are refused before parsing; "167h59m59.999s" is 14 characters."""
_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h)")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}

MAX_DURATION = "168h"
"""The longest drain timeout or recycling window: a week. A drain moves data worker to worker at
tenths of a GiB per second, so one that has not finished in a week never will; the webhook's
grace period follows the drain timeout, and a week is already far beyond what a node drain
or a rollout waits for."""
MAX_AGE = "8760h"
"""The longest ``recycle.maxAge``: a year. Longer means never, which is written by leaving it out."""


def parse_duration(text: str, maximum: str | None = None) -> datetime.timedelta:
    """Parse a Go-style duration ("10m", "1h30m", "1.5s") into a timedelta.

    Raises ValueError, never OverflowError: beyond ``maximum`` (or beyond what a timedelta
    holds, without one) the text is refused.
    """
    if len(text) > DURATION_MAX_LENGTH or not re.fullmatch(DURATION_PATTERN, text):
        raise ValueError(f"{text!r} is not a duration such as 90s, 10m or 1h30m")
    seconds = sum(float(num) * _DURATION_UNITS[unit] for num, unit in _DURATION_PART.findall(text))
    limit = _seconds(maximum) if maximum is not None else _LARGEST_SECONDS
    if not seconds <= limit:  # also refuses inf and nan
        shown = maximum if maximum is not None else f"{_LARGEST_SECONDS:.0f}s"
        raise ValueError(f"{text!r} is longer than the maximum duration, {shown}")
    return datetime.timedelta(seconds=seconds)


_LARGEST_SECONDS = 100 * 365 * 86400.0
"""No duration memops handles is longer than a century: far below timedelta's limit, and adding
it to today stays far below datetime's year 9999."""


def _seconds(text: str) -> float:
    return sum(float(num) * _DURATION_UNITS[unit] for num, unit in _DURATION_PART.findall(text))


def _duration_field(maximum: str) -> Any:
    """A duration's schema: the pattern, a maxLength and a CEL rule for the API server (Kubernetes
    1.25 and later; CEL's ``duration()`` reads Go's syntax, which is exactly what the pattern allows)."""
    return pydantic.Field(
        pattern=DURATION_PATTERN,
        max_length=DURATION_MAX_LENGTH,
        json_schema_extra={
            "example": "10m",
            "x-kubernetes-validations": [
                {"rule": f"duration(self) <= duration('{maximum}')", "message": f"must be at most {maximum}"}
            ],
        },
    )


def _at_most(maximum: str) -> pydantic.AfterValidator:
    """The same bound in pydantic, for the controllers and for API servers without CEL."""

    def check(text: str) -> str:
        parse_duration(text, maximum)
        return text

    return pydantic.AfterValidator(check)


def quantity_at_most(maximum: str) -> pydantic.AfterValidator:
    """A quantity's bound in pydantic, for the controllers and for objects stored before the CRD's
    rule (:func:`quantity_rule`) existed."""

    def check(text: str) -> str:
        if parse_quantity(text) > parse_quantity(maximum):
            raise ValueError(f"{text!r} must be at most {maximum}")
        return text

    return pydantic.AfterValidator(check)


def quantity_rule(maximum: str) -> dict[str, Any]:
    """The same bound for the API server: a CEL rule of Kubernetes' quantity library (1.28+)."""
    rule = f"quantity(self).compareTo(quantity('{maximum}')) <= 0"
    return {"x-kubernetes-validations": [{"rule": rule, "message": f"must be at most {maximum}"}]}


Duration = Annotated[str, _duration_field(MAX_DURATION), _at_most(MAX_DURATION)]
"""A drain timeout or a recycling window, at most :data:`MAX_DURATION`."""
LongDuration = Annotated[str, _duration_field(MAX_AGE), _at_most(MAX_AGE)]
"""A worker's maximum age, at most :data:`MAX_AGE`."""


# Kubernetes' DNS-1123 subdomain: what the API server requires of the names of Pods, Deployments,
# Secrets and custom resources (DaskWorkerGroups). memops puts these names in API paths, so a name
# that is not one ("../../kube-system/deployments/coredns") must never get that far.
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
DNS_SUBDOMAIN_MAX_LENGTH = 253

ObjectName = Annotated[
    str,
    pydantic.Field(
        min_length=1,
        max_length=DNS_SUBDOMAIN_MAX_LENGTH,
        pattern=DNS_SUBDOMAIN_PATTERN,
        json_schema_extra={"example": "dask-worker"},
    ),
]
"""The name of a Kubernetes object in the resource's namespace (a DNS-1123 subdomain)."""

MAX_WORKERS = 1000
"""The most pods one RetirementRequest may name. The status keeps an entry per worker (a few
hundred bytes each), and the object must stay well below the API server's 1.5 MiB limit; more
workers are retired with ``count``, or with several requests."""


PERCENT_PATTERN = r"^([0-9]|[1-9][0-9]|100)%$"

Percent = Annotated[
    str,
    pydantic.Field(pattern=PERCENT_PATTERN, json_schema_extra={"example": "30%"}),
]
"""A share written as Kubernetes writes them in ``maxUnavailable``: "30%"."""


def parse_percent(text: str) -> float:
    """Parse a percentage: "30%" is 30.0."""
    if not re.fullmatch(PERCENT_PATTERN, text):
        raise ValueError(f"{text!r} is not a percentage such as 30%")
    return float(text[:-1])


# A Kubernetes resource quantity (apimachinery's resource.Quantity), as sizes are written: a
# plain number of bytes or one with a binary (Ki..Ei) or decimal (k..E) suffix, or an exponent.
QUANTITY_PATTERN = r"^([0-9]+(\.[0-9]+)?|\.[0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E|[eE][0-9]{1,2})?$"
QUANTITY_MAX_LENGTH = 32
_QUANTITY_SUFFIXES = {
    "": decimal.Decimal(1),
    "m": decimal.Decimal("0.001"),
    "k": decimal.Decimal(10**3),
    "M": decimal.Decimal(10**6),
    "G": decimal.Decimal(10**9),
    "T": decimal.Decimal(10**12),
    "P": decimal.Decimal(10**15),
    "E": decimal.Decimal(10**18),
    "Ki": decimal.Decimal(2**10),
    "Mi": decimal.Decimal(2**20),
    "Gi": decimal.Decimal(2**30),
    "Ti": decimal.Decimal(2**40),
    "Pi": decimal.Decimal(2**50),
    "Ei": decimal.Decimal(2**60),
}


def quantity_value(text: str) -> decimal.Decimal:
    """A quantity's exact value ("1500m" is 1.5, "1Gi" is 1073741824). Negative and signed forms,
    which no size is written as, are refused."""
    if len(text) > QUANTITY_MAX_LENGTH or not re.fullmatch(QUANTITY_PATTERN, text):
        raise ValueError(f"{text!r} is not a quantity such as 8Gi or 512M")
    number = re.match(r"[0-9.]+", text)
    assert number is not None
    digits, suffix = number.group(), text[number.end() :]
    if suffix[:1] in ("e", "E"):
        return decimal.Decimal(digits).scaleb(int(suffix[1:]))
    return decimal.Decimal(digits) * _QUANTITY_SUFFIXES[suffix]


def parse_quantity(text: str) -> int:
    """A quantity of bytes ("8Gi", "512M", "1e9", "1500m") as an integer, rounded up as the
    kubelet rounds a memory quantity (``Quantity.Value()``)."""
    return int(quantity_value(text).to_integral_value(rounding=decimal.ROUND_CEILING))


def _positive_quantity(text: str) -> str:
    if parse_quantity(text) <= 0:
        raise ValueError(f"{text!r} must be more than zero bytes")
    return text


Quantity = Annotated[
    str,
    pydantic.Field(pattern=QUANTITY_PATTERN, max_length=QUANTITY_MAX_LENGTH, json_schema_extra={"example": "8Gi"}),
    pydantic.AfterValidator(_positive_quantity),
]
"""A size in bytes, written as Kubernetes quantities are ("8Gi", "512M")."""


class Model(pydantic.BaseModel):
    """Base of every spec model: Kubernetes field names, unknown fields refused."""

    model_config = pydantic.ConfigDict(extra="forbid", use_enum_values=False, populate_by_name=True)


class OnTimeout(enum.StrEnum):
    ABORT = "Abort"
    FORCE = "Force"


class WorkloadKind(enum.StrEnum):
    DEPLOYMENT = "Deployment"
    DASK_WORKER_GROUP = "DaskWorkerGroup"  # dask-kubernetes, kubernetes.dask.org/v1


class TLSRef(Model):
    """Where the operator finds its client certificate for a tls:// scheduler."""

    secretName: ObjectName = pydantic.Field(
        description=(
            "A Secret in the request's namespace with keys ca.crt, tls.crt and tls.key (PEM),"
            " used as the client's certificate authority, certificate and key."
        ),
    )


class SchedulerRef(Model):
    """How the operator reaches the Dask scheduler."""

    address: str = pydantic.Field(
        pattern=r"^(tcp|tls)://[^\s]+$",
        description=(
            "The scheduler's Dask comm address, e.g. tcp://dask-scheduler:8786 or tls://dask-scheduler:8786."
            " The operator speaks the Dask protocol to it, never the scheduler's HTTP API."
        ),
    )
    tls: TLSRef | None = pydantic.Field(
        default=None, description="Client certificates for a tls:// address (required for tls://)."
    )

    @pydantic.model_validator(mode="after")
    def _tls_needs_certificates(self) -> SchedulerRef:
        if self.address.startswith("tls://") and self.tls is None:
            raise ValueError("scheduler.tls.secretName is required for a tls:// scheduler address")
        return self


class WorkloadRef(Model):
    """The Kubernetes object whose pods run the Dask workers."""

    kind: WorkloadKind = pydantic.Field(
        description=(
            "The kind of the workload: Deployment (apps/v1), or DaskWorkerGroup (kubernetes.dask.org/v1,"
            " dask-kubernetes' operator)."
        )
    )
    name: ObjectName = pydantic.Field(description="The workload's name, in the same namespace.")


class Condition(Model):
    """A Kubernetes status condition (metav1.Condition)."""

    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str = pydantic.Field(default="", description="CamelCase reason for the condition's last transition.")
    message: str = pydantic.Field(default="", description="Human-readable details.")
    lastTransitionTime: str = pydantic.Field(default="", description="When the status last changed (RFC 3339).")
    observedGeneration: int = pydantic.Field(
        default=0, description="The metadata.generation that the condition was set for."
    )


def column(name: str, type_: str, json_path: str, **extra: Any) -> dict[str, Any]:
    """One of a kind's ``kubectl get`` columns (an ``additionalPrinterColumns`` entry)."""
    return {"name": name, "type": type_, "jsonPath": json_path, **extra}


def printer_columns(*columns: dict[str, Any]) -> tuple[dict[str, Any], ...]:
    """A kind's own columns, then the two that every kind ends with: its one-line message (shown by
    ``kubectl get -o wide`` only) and its age."""
    return (
        *columns,
        column("Message", "string", ".status.message", priority=1),
        column("Age", "date", ".metadata.creationTimestamp"),
    )


class ResourceKind(pydantic.BaseModel):
    """Everything the CRD generator needs to know about one kind besides its models."""

    model_config = pydantic.ConfigDict(frozen=True, arbitrary_types_allowed=True)

    kind: str
    description: str
    plural: str
    short_names: tuple[str, ...]
    spec: type[Model]
    status: type[Model]
    printer_columns: tuple[dict[str, Any], ...]
    scale: dict[str, str] | None = None
    validations: tuple[dict[str, str], ...] = ()
    """CEL rules on the whole object (``x-kubernetes-validations`` at the schema's root)."""

    @property
    def singular(self) -> str:
        """The kind in lower case, as the API server names it when a CRD does not say."""
        return self.kind.lower()
