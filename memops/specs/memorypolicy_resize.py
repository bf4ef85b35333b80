"""The MemoryPolicy's ``spec.resize``: grow a worker's memory in place before it is killed.

``MemoryPolicySpec.resize`` and ``MemoryPolicyStatus.resize``;
:mod:`memops.decisions.resize_decisions` reads the spec through :meth:`ResizeSpec.settings`.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated

import pydantic

from memops.specs import common

MAX_LIMIT = "64Ti"
"""The largest ``maxLimit`` a policy may write, and the largest ceiling an administrator may set
(``memops run --max-resize-limit``): beyond the memory of the largest machines sold (32 TiB). The
CRD refuses more (a CEL rule of Kubernetes' quantity library, 1.28+), and so does the model, for an
object stored before the rule."""


@dataclasses.dataclass(frozen=True)
class ResizeSettings:
    """``spec.resize`` in the units the decisions use."""

    max_limit: int
    """Bytes: the largest container memory limit a worker is grown to."""
    grow_above: float
    """Share of the limit: memory over it, that relief cannot place, grows the worker."""
    grow_to: float
    """Share of the grown limit that the worker's memory then uses."""
    prefer_growth_above: int
    """Bytes: when relief would move more than this, grow instead, even where peers have room."""
    shrink: bool
    """Whether to lower a grown limit again once the pressure is gone."""
    step: int
    """Bytes: limits are whole multiples of it."""
    cooldown: float
    """Seconds after a resize during which no decrease is asked."""


class ResizeSpec(common.Model):
    """Grow a worker's memory limit in place (the pod's resize subresource, Kubernetes 1.35+) when it
    nears Dask's pause threshold and relief cannot place its keys, and tell Dask the new limit."""

    maxLimit: Annotated[common.Quantity, common.quantity_at_most(MAX_LIMIT)] = pydantic.Field(
        description=(
            "The largest memory limit a worker's container is grown to (16Gi), at most 64Ti. Growth is"
            " also bounded by the ceiling the operator's administrator set for the namespace (memops run"
            " --max-resize-limit, 64Gi by default), and by what the node can grant: its allocatable"
            " memory minus the requests of its pods."
        ),
        json_schema_extra=common.quantity_rule(MAX_LIMIT),
    )
    growAbove: common.Percent = pydantic.Field(
        default="75%",
        description=(
            "Process memory over this share of the limit grows the worker, when relief cannot place the"
            " excess on peers or would move more than preferGrowthAbove. Keep it below Dask's pause"
            " threshold (80% by default), and above pressure.relieveAbove so that relief tries first."
        ),
    )
    growTo: common.Percent = pydantic.Field(
        default="60%", description="The grown limit puts the worker's memory at this share of it."
    )
    preferGrowthAbove: common.Quantity = pydantic.Field(
        default="1Gi",
        description=(
            "When relief would move more than this to bring the worker under growTo, grow instead: moving"
            " costs the network, serialization and the peers' room; growing costs only node memory."
        ),
    )
    shrink: bool = pydantic.Field(
        default=True,
        description=(
            "Lower a grown limit again, toward the pod's own, once the worker's memory is under the smaller"
            " limit's target: Dask first, then the container. Needs the container's resizePolicy for memory"
            " to be NotRequired (decreases are best-effort, Kubernetes 1.34+); otherwise a grown worker"
            " keeps its limit until it is replaced."
        ),
    )
    step: common.Quantity = pydantic.Field(
        default="64Mi", description="Limits are whole multiples of this, so that small changes do not resize."
    )
    cooldown: common.Duration = pydantic.Field(
        default="5m", description="No decrease within this time of the worker's last resize."
    )

    @pydantic.model_validator(mode="after")
    def _to_below_above(self) -> ResizeSpec:
        if common.parse_percent(self.growTo) >= common.parse_percent(self.growAbove):
            raise ValueError(f"resize.growTo ({self.growTo}) must be below resize.growAbove ({self.growAbove})")
        if common.parse_quantity(self.step) > common.parse_quantity(self.maxLimit):
            raise ValueError(f"resize.step ({self.step}) must not be above resize.maxLimit ({self.maxLimit})")
        return self

    def settings(self) -> ResizeSettings:
        return ResizeSettings(
            max_limit=common.parse_quantity(self.maxLimit),
            grow_above=common.parse_percent(self.growAbove) / 100,
            grow_to=common.parse_percent(self.growTo) / 100,
            prefer_growth_above=common.parse_quantity(self.preferGrowthAbove),
            shrink=self.shrink,
            step=common.parse_quantity(self.step),
            cooldown=common.parse_duration(self.cooldown).total_seconds(),
        )


class ResizedWorker(common.Model):
    """What in-place growth last did about one worker, while it matters (a grown limit, an ask the
    kubelet has not granted, a fallback)."""

    pod: str = pydantic.Field(description="The worker's pod.")
    action: str = pydantic.Field(
        description=(
            "Grow, Shrink, TellDask (the container has a new limit, Dask is told), Revert (an ask taken"
            " back), Wait (the kubelet is applying it), Relieve or ScaleUp (the fallbacks)."
        )
    )
    reason: str = pydantic.Field(
        description=(
            "Why: PeersFull or MovingCostsMore (grown), PressureGone (shrunk), ResizeDeferred,"
            " ResizeInfeasible or ResizeFailed (the kubelet's answer: fell back), ResizeDeferredTooLong"
            " (deferred for over 2 minutes: taken back, and fell back), AtMaximum (at maxLimit or the"
            " administrator's ceiling) or NodeFull (no room to grow: fell back), ContainerResized, Resizing."
        )
    )
    limit: str = pydantic.Field(default="", description="The container's memory limit asked for, or in force.")
    message: str = pydantic.Field(default="", description="The kubelet's message, or the figures.")
    time: str = pydantic.Field(default="", description="When memops decided it (RFC 3339).")


class ResizeStatus(common.Model):
    """What in-place growth did: the workers whose limit memops changed or could not change."""

    workers: list[ResizedWorker] = pydantic.Field(
        default_factory=list, description="One entry per worker with a grown limit, a pending ask or a fallback."
    )
    resized: int = pydantic.Field(default=0, description="Resizes asked since the policy was created.")
    message: str = pydantic.Field(
        default="",
        description=(
            "The fallbacks of the last pass and why, and what it could not apply, in one line; or that"
            " growth is not allowed in the namespace (the operator's memops run --resize-in)."
        ),
    )
