"""The RetirementRequest kind: its spec, its status, and what the CRD generator needs of it."""

from __future__ import annotations

import collections
import enum

import pydantic

from memops.specs.common import (
    MAX_WORKERS,
    Condition,
    Duration,
    Model,
    ObjectName,
    OnTimeout,
    ResourceKind,
    SchedulerRef,
    WorkloadRef,
)


class RetirementRequestSpec(Model):
    """Retire some workers: drain their data through the scheduler's Active Memory Manager, then
    remove their pods. Set exactly one of count and workers."""

    scheduler: SchedulerRef = pydantic.Field(description="The Dask scheduler of these workers.")
    workload: WorkloadRef = pydantic.Field(description="Whose pods these workers are.")
    count: int | None = pydantic.Field(
        default=None,
        ge=1,
        description=(
            "Retire this many workers, chosen by memops: pods not yet running a connected worker first,"
            " then the workers whose removal moves the fewest unique bytes. Exclusive with workers."
        ),
    )
    workers: list[ObjectName] | None = pydantic.Field(
        default=None,
        min_length=1,
        max_length=MAX_WORKERS,
        description=(
            "Retire exactly these pods (pod names, which are the Dask worker names), each named once."
            f" Exclusive with count. At most {MAX_WORKERS}: the status keeps an entry per worker and must stay"
            " well below the API server's object size limit; retire more with count or several requests."
        ),
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )
    timeout: Duration = pydantic.Field(
        default="10m",
        description=(
            "How long the drain may take, as a duration (90s, 10m, 1h), at most 168h. Counted from the drain's start."
        ),
    )
    onTimeout: OnTimeout = pydantic.Field(
        default=OnTimeout.ABORT,
        description=(
            "What to do with a worker whose unique data could not be moved in time or had nowhere to go."
            " Abort: keep its pod. Force: remove it anyway, and record the bytes lost in the status."
        ),
    )
    removePods: bool = pydantic.Field(
        default=True,
        description=(
            "true: memops removes the drained pods (a scale-down of the workload). false: drain only; the"
            " pods are left to whoever evicts them (a node drain), whose evictions memops then admits."
        ),
    )

    # The API server can check "exactly one of" structurally; pydantic checks it again below.
    model_config = pydantic.ConfigDict(
        json_schema_extra={"oneOf": [{"required": ["count"]}, {"required": ["workers"]}]}
    )

    @pydantic.field_validator("workers")
    @classmethod
    def _each_worker_once(cls, workers: list[str] | None) -> list[str] | None:
        if workers is not None:
            repeated = sorted(pod for pod, times in collections.Counter(workers).items() if times > 1)
            if repeated:
                raise ValueError(f"each pod may be named once; named more than once: {', '.join(repeated)}")
        return workers

    @pydantic.model_validator(mode="after")
    def _exactly_one_selection(self) -> RetirementRequestSpec:
        if (self.count is None) == (self.workers is None):
            raise ValueError("set exactly one of spec.count and spec.workers")
        return self


class Phase(enum.StrEnum):
    PENDING = "Pending"
    DRAINING = "Draining"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


class WorkerState(enum.StrEnum):
    PENDING = "Pending"
    DRAINING = "Draining"
    RETIRED = "Retired"
    KEPT = "Kept"
    FORCED = "Forced"


class LostAtDeadline(Model):
    """What memops' drain had not moved off a worker when its deadline came."""

    keys: int = pydantic.Field(default=0, description="Keys held by this worker alone at the deadline.")
    bytes: int = pydantic.Field(default=0, description="Their bytes.")
    cause: str = pydantic.Field(default="deadline", description="Why the drain stopped: deadline.")


class WorkerReason(enum.StrEnum):
    """Why a chosen worker is in its state; the worker's message is rendered from it."""

    UNIDENTIFIED = "Unidentified"
    NO_WORKER = "NoWorker"
    DRAINING = "Draining"
    DRAINED = "Drained"
    DIED = "Died"
    NOWHERE_TO_GO = "NowhereToGo"
    TIMED_OUT = "TimedOut"
    UNREACHABLE = "Unreachable"


class KeptReason(enum.StrEnum):
    """Why a pod that was to be removed was kept after all."""

    REQUEST_FAILED = "RequestFailed"
    REMOVAL_BLOCKED = "RemovalBlocked"


class WorkerCause(Model):
    """What a chosen worker's drain came to, as data: its message is rendered from this."""

    reason: WorkerReason = pydantic.Field(
        description=(
            "Unidentified: no connected worker could be matched to the pod. NoWorker: no worker, nothing to"
            " drain. Draining: its data is moving. Drained: the scheduler retired it. Died: it left the"
            " scheduler during the drain. NowhereToGo: its unique data had nowhere to go. TimedOut: the drain"
            " did not finish within spec.timeout. Unreachable: the scheduler was unreachable until spec.timeout."
        )
    )
    bytes: int = pydantic.Field(
        default=0,
        description="Died: the bytes lost with it. NowhereToGo, TimedOut: the bytes its pod held alone."
        " Unreachable: its unique bytes when the drain began.",
    )
    keys: int = pydantic.Field(default=0, description="The keys of those bytes (Unreachable: not known, 0).")
    detail: str = pydantic.Field(default="", description="Unreachable: the scheduler's error.")
    kept: KeptReason | None = pydantic.Field(
        default=None,
        description="Set when a pod that was to be removed was kept after all. RequestFailed: the request"
        " failed; RemovalBlocked: spec.timeout passed before the pod could be removed safely.",
    )
    keptDetail: str = pydantic.Field(default="", description="Why it was kept, in words.")


class WorkerStatus(Model):
    """What happened to one chosen worker."""

    pod: str = pydantic.Field(description="The pod's name, which is the Dask worker's name.")
    address: str = pydantic.Field(default="", description="The worker's Dask address when it was chosen.")
    addresses: list[str] = pydantic.Field(
        default_factory=list,
        description="Every Dask worker the pod ran when it was chosen (dask worker --nworkers N runs several);"
        " the pod is removed only once all of them are drained.",
    )
    state: WorkerState = pydantic.Field(
        default=WorkerState.PENDING,
        description=(
            "Pending: chosen, not yet draining. Draining: its data is moving. Retired: drained and its pod"
            " removed. Kept: its pod was kept because its unique data could not be moved. Forced: removed"
            " although it still held unique data (onTimeout: Force); bytesLost says how much."
        ),
    )
    uniqueBytes: int = pydantic.Field(default=0, description="Bytes held only by this worker when the drain began.")
    bytesMoved: int = pydantic.Field(default=0, description="Of those, bytes now held by another worker.")
    bytesLinked: int = pydantic.Field(
        default=0,
        description="Of the bytes moved, those handed to a worker on the same node by a hardlink on the shared"
        " spill tmpfs (sharedSpill medium Node), as memops' drain counts them: no byte over the network.",
    )
    keysLinked: int = pydantic.Field(default=0, description="The keys of bytesLinked.")
    bytesLost: int = pydantic.Field(
        default=0, description="Bytes that exist nowhere any more: removed by force, or died with the worker."
    )
    keysLost: int = pydantic.Field(default=0, description="Keys that exist nowhere any more (see bytesLost).")
    message: str = pydantic.Field(default="", description="Why the worker is in this state.")
    cause: WorkerCause | None = pydantic.Field(
        default=None, description="Why the worker is in this state, as data; message is rendered from it."
    )
    removable: bool = pydantic.Field(
        default=False, description="memops decided to remove this pod: it is drained, or forced."
    )
    podRemoved: bool = pydantic.Field(default=False, description="The pod is gone.")
    lostAtDeadline: LostAtDeadline | None = pydantic.Field(
        default=None,
        description="memops' drain stopped at spec.timeout with keys that had not moved: what this worker"
        " then held alone (the drain moves the keys that cannot be recomputed first). Kept, these stay with"
        " the pod; Forced, they are lost (bytesLost).",
    )


class ScaleDown(Model):
    """The workload scale-down that memops ordered, recorded before it is ordered so that a
    restarted operator never lowers the replicas twice."""

    pods: list[str] = pydantic.Field(description="The pods whose removal was ordered.")
    replicasFrom: int = pydantic.Field(description="The workload's replicas before the scale-down.")
    replicasTo: int = pydantic.Field(description="The replicas that memops set.")
    deployments: list[str] = pydantic.Field(
        default_factory=list,
        description=(
            "DaskWorkerGroup only: the one-replica worker Deployments of these pods, which memops deletes"
            " before it lowers spec.worker.replicas."
        ),
    )


class RetirementRequestStatus(Model):
    """Written by memops as the work goes."""

    phase: Phase = pydantic.Field(default=Phase.PENDING, description="Pending, Draining, Succeeded or Failed.")
    message: str = pydantic.Field(default="", description="A one-line summary of the outcome.")
    observedGeneration: int = pydantic.Field(default=0, description="The generation the drain was started for.")
    startTime: str = pydantic.Field(default="", description="When the drain began (RFC 3339).")
    deadline: str = pydantic.Field(default="", description="startTime plus spec.timeout (RFC 3339).")
    completionTime: str = pydantic.Field(default="", description="When the request reached Succeeded or Failed.")
    onTimeout: OnTimeout | None = pydantic.Field(
        default=None, description="The spec.onTimeout accepted at the start; later spec changes are refused."
    )
    requested: int = pydantic.Field(default=0, description="Workers the accepted spec asked to retire.")
    retired: int = pydantic.Field(default=0, description="Workers retired and their pods removed.")
    kept: int = pydantic.Field(default=0, description="Workers whose pods were kept.")
    forced: int = pydantic.Field(default=0, description="Workers removed while still holding unique data.")
    bytesMoved: int = pydantic.Field(default=0, description="Unique bytes moved to other workers, in total.")
    moved: str = pydantic.Field(
        default="", description="bytesMoved for people, in binary units as kubectl shows quantities (128Mi)."
    )
    bytesLost: int = pydantic.Field(default=0, description="Bytes lost by forced removals, in total.")
    workers: list[WorkerStatus] = pydantic.Field(default_factory=list, description="One entry per chosen worker.")
    scaleDown: ScaleDown | None = pydantic.Field(default=None, description="The scale-down memops ordered.")
    acceptedSpec: RetirementRequestSpec | None = pydantic.Field(
        default=None, description="The spec as it was when the drain started; later changes are refused."
    )
    conditions: list[Condition] = pydantic.Field(default_factory=list, description="Standard conditions.")


RETIREMENT_REQUEST = ResourceKind(
    kind="RetirementRequest",
    description=(
        "A one-shot request to retire Dask workers: memops drains their data through the scheduler's"
        " Active Memory Manager, then removes their pods. The status tells what happened to each worker."
    ),
    plural="retirementrequests",
    singular="retirementrequest",
    short_names=("retire",),
    spec=RetirementRequestSpec,
    status=RetirementRequestStatus,
    printer_columns=(
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
        {"name": "Workload", "type": "string", "jsonPath": ".spec.workload.name"},
        {"name": "Count", "type": "integer", "jsonPath": ".spec.count"},
        {"name": "Retired", "type": "integer", "jsonPath": ".status.retired"},
        {"name": "Kept", "type": "integer", "jsonPath": ".status.kept"},
        {"name": "Moved", "type": "string", "jsonPath": ".status.moved", "description": "Bytes moved"},
        {"name": "Message", "type": "string", "jsonPath": ".status.message", "priority": 1},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ),
)
