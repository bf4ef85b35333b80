"""The MemoryPolicy kind: its spec (drain, eviction, autoscaling, recycling, pressure relief,
replication, shared spill; in-place growth from :mod:`memops.specs.memorypolicy_resize`), its
status, and what the CRD generator needs of it."""

from __future__ import annotations

import enum
import re
from typing import Annotated

import pydantic

from memops.rulesyntax import bounds, globs
from memops.specs.common import (
    DNS_SUBDOMAIN_MAX_LENGTH,
    DNS_SUBDOMAIN_PATTERN,
    Condition,
    Duration,
    LongDuration,
    Model,
    OnTimeout,
    Percent,
    Quantity,
    ResourceKind,
    SchedulerRef,
    WorkloadRef,
    column,
    parse_percent,
    printer_columns,
    quantity_at_most,
    quantity_rule,
)
from memops.specs.memorypolicy_resize import ResizeSpec, ResizeStatus


class DrainSpec(Model):
    """How a MemoryPolicy drains a worker before its pod is removed."""

    timeout: Duration = pydantic.Field(default="10m", description="How long one drain may take, at most 168h.")
    onTimeout: OnTimeout = pydantic.Field(
        default=OnTimeout.ABORT, description="Abort: keep pods that still hold unique data. Force: remove them."
    )


DEFAULT_NODE_TAINTS = (
    "node.kubernetes.io/unschedulable",  # kubectl cordon / drain
    "ToBeDeletedByClusterAutoscaler",  # cluster-autoscaler, just before it drains the node
    "karpenter.sh/disrupted",  # Karpenter v1, when it disrupts the node
    "karpenter.sh/disruption",  # Karpenter before v1 (value "disrupting")
    "aws-node-termination-handler/spot-itn",  # AWS Node Termination Handler: spot interruption notice
    "aws-node-termination-handler/scheduled-maintenance",
    "cloud.google.com/impending-node-termination",  # GKE's node termination handler
)

# Taint and label keys are qualified names: an optional DNS prefix and a name of at most 63.
QUALIFIED_NAME_PATTERN = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
QualifiedName = Annotated[str, pydantic.Field(min_length=1, max_length=316, pattern=QUALIFIED_NAME_PATTERN)]


class NodeSignals(Model):
    """Taints and labels that announce a Node's end: memops drains its workers there at once."""

    taints: list[QualifiedName] = pydantic.Field(
        default_factory=lambda: list(DEFAULT_NODE_TAINTS),
        max_length=64,
        description=(
            "Taint keys (any value, any effect). Defaults: cordon's node.kubernetes.io/unschedulable,"
            " cluster-autoscaler's ToBeDeletedByClusterAutoscaler, Karpenter's karpenter.sh/disrupted"
            " (and karpenter.sh/disruption before v1), AWS Node Termination Handler's spot-itn and"
            " scheduled-maintenance, GKE's cloud.google.com/impending-node-termination."
        ),
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )
    labels: list[QualifiedName] = pydantic.Field(
        default_factory=list,
        max_length=64,
        description="Label keys (any value) that termination handlers of your platform set on a Node.",
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )


MAX_MARGIN = "4Gi"
"""The largest node-pressure margin: the kubelet's thresholds are a few hundred MiB, and a margin of
more would drain workers of Nodes far from any pressure, and read every kubelet of the policy's
Nodes on every pass, on a tenant's say."""


class NodePressureSpec(Model):
    """Drain the workers that the kubelet would evict under node memory pressure, before it does."""

    margin: Annotated[Quantity, quantity_at_most(MAX_MARGIN)] = pydantic.Field(
        default="256Mi",
        description=(
            "Act when a Node's available memory is within this of the kubelet's evictionHard memory.available"
            f" threshold (the node's, or its pods' allocatable share), at most {MAX_MARGIN}: its workers that the"
            " kubelet would evict first, by its own ranking, are drained while they still can be. Needs the"
            " chart's rbac.kubeletStats (get nodes/stats and nodes/configz: the kubelet's summary statistics and"
            " configuration, read from the kubelet itself)."
        ),
        json_schema_extra=quantity_rule(MAX_MARGIN),
    )


class EvictionSpec(Model):
    """How the workers' evictions (kubectl drain, cluster-autoscaler, Karpenter) are answered."""

    gate: bool = pydantic.Field(
        default=True,
        description=(
            "Answer evictions of the workers: one that holds data existing nowhere else is refused"
            " with 429 (which evicting clients retry) while memops drains it; a drained one is admitted."
        ),
    )
    nodeSignals: NodeSignals = pydantic.Field(
        default_factory=NodeSignals,
        description="Start draining a Node's workers as soon as the Node is marked for its end.",
    )
    disruptionAnnotations: bool = pydantic.Field(
        default=True,
        description=(
            "While a worker holds data that exists nowhere else, its pod carries karpenter.sh/do-not-disrupt"
            ' "true" and cluster-autoscaler.kubernetes.io/safe-to-evict "false", so that node autoscalers'
            " leave its node; both go once its data has another copy (or has moved). memops removes only"
            " the ones it set."
        ),
    )
    maxDisruptionProtection: Duration | None = pydantic.Field(
        default=None,
        description=(
            "How long a worker's pod may carry the disruption annotations in all, counted from the first time"
            " memops set them on it; then they go for good, and evictions are still answered by draining first."
            " The operator's --max-disruption-protection (1h unless its administrators chose otherwise) is the"
            " most it can be: a longer value counts as that. 0s: never. Absent: the operator's."
        ),
    )
    nodePressure: NodePressureSpec | None = pydantic.Field(
        default=None,
        description=(
            "Beat the kubelet's own eviction under node memory pressure, which gives no grace period and runs no"
            " preStop hook. Off unless set."
        ),
    )


class PolicyType(enum.StrEnum):
    PODS = "Pods"
    PERCENT = "Percent"


class SelectPolicy(enum.StrEnum):
    MAX = "Max"
    MIN = "Min"
    DISABLED = "Disabled"


class ScalingPolicy(Model):
    """One HPA scaling policy: at most ``value`` Pods, or ``value`` Percent, per period."""

    type: PolicyType = pydantic.Field(description="Pods or Percent.")
    value: int = pydantic.Field(ge=1, description="How many pods, or what percent of them.")
    periodSeconds: int = pydantic.Field(ge=1, le=1800, description="The window the policy counts changes over.")


class ScalingRules(Model):
    """HPA v2 HPAScalingRules for one direction."""

    stabilizationWindowSeconds: int = pydantic.Field(
        default=0, ge=0, le=3600, description="Look back this long for the most cautious recommendation."
    )
    selectPolicy: SelectPolicy = pydantic.Field(
        default=SelectPolicy.MAX, description="Max: the policy allowing the biggest change; Min: the smallest."
    )
    policies: list[ScalingPolicy] = pydantic.Field(default_factory=list, description="Limits on the rate of change.")


def _default_scale_up() -> ScalingRules:
    # The HPA's defaults (Kubernetes docs, "Default Behavior").
    return ScalingRules(
        stabilizationWindowSeconds=0,
        policies=[
            ScalingPolicy(type=PolicyType.PERCENT, value=100, periodSeconds=15),
            ScalingPolicy(type=PolicyType.PODS, value=4, periodSeconds=15),
        ],
    )


def _default_scale_down() -> ScalingRules:
    return ScalingRules(
        stabilizationWindowSeconds=300, policies=[ScalingPolicy(type=PolicyType.PERCENT, value=100, periodSeconds=15)]
    )


class Behavior(Model):
    """HPA v2 ``behavior``; absent parts take the HPA's defaults."""

    scaleUp: ScalingRules = pydantic.Field(default_factory=_default_scale_up, description="Rules for scaling up.")
    scaleDown: ScalingRules = pydantic.Field(default_factory=_default_scale_down, description="Rules for scaling down.")


class AutoscaleSpec(Model):
    """Memory-driven autoscaling with the HorizontalPodAutoscaler's algorithm."""

    minReplicas: int = pydantic.Field(default=1, ge=1, description="Never fewer workers.")
    maxReplicas: int = pydantic.Field(ge=1, description="Never more workers.")
    targetMemoryUtilization: int = pydantic.Field(
        ge=1,
        le=100,
        description=(
            "Percent of the workers' memory limit to hold: process memory (managed and unmanaged) plus"
            " what was spilled to disk, which is memory pressure too."
        ),
    )
    behavior: Behavior = pydantic.Field(default_factory=Behavior, description="HPA v2 behavior.")

    @pydantic.model_validator(mode="after")
    def _min_not_above_max(self) -> AutoscaleSpec:
        if self.minReplicas > self.maxReplicas:
            raise ValueError(
                f"autoscale.minReplicas ({self.minReplicas}) is above autoscale.maxReplicas ({self.maxReplicas})"
            )
        return self


class UnmanagedMemoryRule(Model):
    """Recycle a worker whose unmanaged memory stays high."""

    above: Percent = pydantic.Field(
        description="Unmanaged memory (the process' memory that is not Dask data) over this share of the limit."
    )
    for_: Duration = pydantic.Field(
        default="10m",
        alias="for",
        description="How long every sample must stay above: a one-off spike never triggers.",
    )


class GrowthRule(Model):
    """Recycle a worker whose unmanaged memory rises steadily."""

    perHour: Percent = pydantic.Field(description="Growth of unmanaged memory, as a share of the limit per hour.")
    window: Duration = pydantic.Field(
        default="30m", description="The line is fitted over this window of samples, and only when it fits well."
    )


class RecycleSpec(Model):
    """Replace leaky workers by evidence: start a replacement, drain the old worker, remove its pod."""

    unmanagedMemory: UnmanagedMemoryRule | None = pydantic.Field(
        default=None, description="Sustained unmanaged memory."
    )
    growth: GrowthRule | None = pydantic.Field(default=None, description="A steady rise of unmanaged memory.")
    maxAge: LongDuration | None = pydantic.Field(
        default=None,
        description=(
            "Recycle workers older than this, at most 8760h; each worker's deadline is staggered by up to 10% of it."
        ),
    )
    maxUnavailable: int = pydantic.Field(default=1, ge=1, description="Workers being recycled at once.")
    surge: int = pydantic.Field(
        default=1, ge=0, description="Replacements started before the drain, so that capacity never drops."
    )

    @pydantic.model_validator(mode="after")
    def _some_rule(self) -> RecycleSpec:
        if self.unmanagedMemory is None and self.growth is None and self.maxAge is None:
            raise ValueError("recycle needs at least one of recycle.unmanagedMemory, recycle.growth, recycle.maxAge")
        return self


class PressureSpec(Model):
    """Move keys off a worker that is filling up, to workers with headroom, before it spills or is killed."""

    relieveAbove: Percent = pydantic.Field(
        default="70%", description="Process memory over this share of the limit starts moving keys off the worker."
    )
    relieveTo: Percent = pydantic.Field(default="55%", description="Keys move until the worker is under this share.")

    @pydantic.model_validator(mode="after")
    def _to_below_above(self) -> PressureSpec:
        if parse_percent(self.relieveTo) >= parse_percent(self.relieveAbove):
            raise ValueError(
                f"pressure.relieveTo ({self.relieveTo}) must be below pressure.relieveAbove ({self.relieveAbove})"
            )
        return self


# -- graph-aware placement (spec.placement) ------------------------------------------------------


MAX_PLACED_TASKS = 1_000_000
"""The most that ``placement.maxTasks`` may be: placing a graph holds the scheduler's event loop
for a time in proportion to its tasks (see docs/performance.md)."""


class PlacementSpec(Model):
    """Place each graph submitted to the scheduler by its structure: the tasks that share root tasks
    run on one worker, so that independent subgraphs move nothing between workers; shuffles and
    graphs that do not partition are left to Dask, and a computation can opt out with
    ``dask.annotate(memops_placement=False)``."""

    maxTasks: int = pydantic.Field(
        default=10_000,
        ge=1,
        le=MAX_PLACED_TASKS,
        description=(
            "Graphs with more tasks than this are left to Dask: placing one holds the scheduler's event"
            " loop, about 4 us per task."
        ),
    )


class PlacementStatus(Model):
    graphsPlaced: int = pydantic.Field(default=0, description="Graphs placed since placement was installed.")
    graphsLeft: dict[str, int] = pydantic.Field(
        default_factory=dict, description="Graphs left to Dask, by reason (does not partition, opted out, ...)."
    )
    groups: int = pydantic.Field(default=0, description="Groups of tasks placed, each on one worker.")
    tasksPlaced: int = pydantic.Field(default=0, description="Tasks placed in those groups.")
    groupsMoved: int = pydantic.Field(
        default=0, description="Groups moved off a worker that paused, retired, was drained or left."
    )
    longestMilliseconds: float = pydantic.Field(
        default=0.0, description="The longest that placing one graph held the scheduler's event loop."
    )
    message: str = pydantic.Field(default="", description="Why placement is not in force, in one line.")


# -- memory-aware task admission (spec.tasks) ----------------------------------------------------


class UnprofiledTasks(enum.StrEnum):
    PROBE = "Probe"
    RUN = "Run"


class TaskAdmissionSpec(Model):
    """Profile each task prefix's peak memory on the workers; start a task only where its peak fits
    under Dask's pause threshold; preempt a preemptible task before the nanny kills its worker."""

    unprofiled: UnprofiledTasks = pydantic.Field(
        default=UnprofiledTasks.PROBE,
        description=(
            "A prefix never profiled: Probe runs its tasks one at a time per worker until one has finished"
            " (its first wave cannot kill a worker); Run starts them as stock Dask does."
        ),
    )
    small: Quantity = pydantic.Field(
        default="128Mi",
        description="Tasks whose profiled peak is under this reserve nothing and run as stock Dask runs them.",
    )
    preemptAbove: float | None = pydantic.Field(
        default=0.9,
        ge=0.5,
        le=0.94,
        description=(
            "Share of the worker's memory limit above which the newest preemptible task is stopped and"
            " rescheduled (below the nanny's 0.95); unset: never."
        ),
    )
    preemptible: list[Annotated[str, pydantic.Field(min_length=1, max_length=bounds.MAX_PATTERN_CHARS)]] = (
        pydantic.Field(
            default_factory=list,
            max_length=bounds.MAX_RULES,
            json_schema_extra={"x-kubernetes-list-type": "set"},
            description=(
                "Globs of task prefixes that may be preempted (also: dask.annotate(memops_preemptible=level)"
                " on a computation); none by default."
            ),
        )
    )
    maxRetries: int = pydantic.Field(
        default=3, ge=0, le=10, description="Times one task may be preempted on one worker."
    )

    @pydantic.field_validator("preemptible")
    @classmethod
    def _globs(cls, preemptible: list[str]) -> list[str]:
        for glob in preemptible:
            globs.compile_glob(glob, "tasks.preemptible[]")
        if len(set(preemptible)) != len(preemptible):
            raise ValueError("tasks.preemptible: a glob is listed twice")
        return preemptible


class TaskPeak(Model):
    prefix: str = pydantic.Field(description="The task prefix.")
    peakBytes: int = pydantic.Field(description="The median of its last peaks: what one task adds to its worker.")
    observations: int = pydantic.Field(description="Peaks kept for it (at most 8).")


class TaskAdmissionStatus(Model):
    profiled: int = pydantic.Field(default=0, description="Task prefixes profiled.")
    top: list[TaskPeak] = pydantic.Field(default_factory=list, description="The prefixes with the highest peaks.")
    tasksAdmitted: int = pydantic.Field(default=0, description="Tasks that reserved their profiled peak.")
    tasksProbed: int = pydantic.Field(default=0, description="Tasks of a prefix not profiled yet, run as probes.")
    waiting: int = pydantic.Field(default=0, description="Tasks waiting on workers for room.")
    preempted: int = pydantic.Field(default=0, description="Tasks preempted (stopped and rescheduled).")
    demandTasks: int = pydantic.Field(default=0, description="Tasks whose peak fits no worker: they wait.")
    demandBytes: int = pydantic.Field(default=0, description="The largest peak that fits no worker.")
    demandAction: str = pydantic.Field(
        default="",
        description="What serves that demand: Resize (a worker grown in place, spec.resize), Scale (one more"
        " worker, within spec.autoscale.maxReplicas, where a new worker could start it and no worker can grow"
        " for it), or None.",
    )
    message: str = pydantic.Field(default="", description="Why admission is not in force, in one line.")


# -- replication targets (spec.replication) -----------------------------------------------------


class KeySelector(Model):
    """Which keys: exactly one of a Dask key prefix, a glob over it, or scattered data."""

    prefix: str | None = pydantic.Field(
        default=None,
        max_length=bounds.MAX_PATTERN_CHARS,
        description='A Dask key prefix, as key_split gives it ("load-parquet").',
    )
    glob: str | None = pydantic.Field(
        default=None,
        max_length=bounds.MAX_PATTERN_CHARS,
        description='A glob that the whole key prefix must match ("load-*"): * any characters, ? one,'
        " [a-z] one of a set, [!a-z] one not in it (Python's fnmatch); matched in time linear in the prefix.",
    )
    pattern: str | None = pydantic.Field(
        default=None,
        max_length=bounds.MAX_PATTERN_CHARS,
        description="Refused: a regular expression's match had no time bound. Write glob instead.",
        json_schema_extra={"x-kubernetes-validations": [{"rule": "false", "message": bounds.PATTERN_REFUSED}]},
    )
    scattered: bool | None = pydantic.Field(
        default=None, description="Data with no task to recompute it (client.scatter, or whose task is gone)."
    )

    @pydantic.field_validator("pattern")
    @classmethod
    def _no_pattern(cls, pattern: str | None) -> str | None:
        if pattern is not None:
            raise ValueError(f"replication.rules[].keys.pattern: {bounds.PATTERN_REFUSED}")
        return pattern

    @pydantic.model_validator(mode="after")
    def _exactly_one(self) -> KeySelector:
        chosen = [n for n in ("prefix", "glob", "scattered") if getattr(self, n) not in (None, False)]
        if len(chosen) != 1:
            raise ValueError("replication.rules[].keys: exactly one of prefix, glob, scattered: true")
        if self.glob is not None:
            globs.compile_glob(self.glob, "replication.rules[].keys.glob")
        return self


class LabelSelectorRequirement(Model):
    key: str = pydantic.Field(max_length=317, description="The label's key.")
    operator: str = pydantic.Field(
        pattern="^(In|NotIn|Exists|DoesNotExist)$", description="In, NotIn, Exists, DoesNotExist."
    )
    values: list[str] = pydantic.Field(default_factory=list, max_length=64, description="For In and NotIn.")


class LabelSelector(Model):
    matchLabels: dict[str, str] = pydantic.Field(default_factory=dict, description="Labels that must all match.")
    matchExpressions: list[LabelSelectorRequirement] = pydantic.Field(
        default_factory=list, max_length=16, description="Requirements that must all hold."
    )


class PodSelector(Model):
    """Which worker pods: by their node's labels, or by their own."""

    nodeSelector: dict[str, str] | None = pydantic.Field(
        default=None, description="Labels of the node the pod runs on (karpenter.sh/capacity-type: spot)."
    )
    labelSelector: LabelSelector | None = pydantic.Field(default=None, description="The pod's own labels.")

    @pydantic.model_validator(mode="after")
    def _one(self) -> PodSelector:
        if (self.nodeSelector is None) == (self.labelSelector is None):
            raise ValueError("replication.rules[].pods: exactly one of nodeSelector, labelSelector")
        return self


class ReplicationRule(Model):
    keys: KeySelector | None = pydantic.Field(default=None, description="The keys this rule covers.")
    pods: PodSelector | None = pydantic.Field(
        default=None,
        description="The pods this rule marks: data held on them must also exist on a pod outside them.",
    )
    replicas: int = pydantic.Field(ge=1, le=bounds.MAX_REPLICAS, description="Copies to keep of each covered key.")

    @pydantic.model_validator(mode="after")
    def _keys_or_pods(self) -> ReplicationRule:
        if (self.keys is None) == (self.pods is None):
            raise ValueError("replication.rules[]: exactly one of keys, pods")
        return self


class ReplicationSpec(Model):
    """Keep N copies of the data that matters; re-replicate after a loss."""

    default: int = pydantic.Field(
        default=1, ge=1, le=bounds.MAX_REPLICAS, description="Copies of a key no rule covers."
    )
    rules: list[ReplicationRule] = pydantic.Field(
        default_factory=list,
        max_length=bounds.MAX_RULES,
        description="Each key's target is the most replicas of the rules that cover it.",
    )
    maxReplicatedFraction: float = pydantic.Field(
        default=0.3, ge=0, le=1, description="The most of the workers' memory limits that extra copies may take."
    )


class ReplicationStatus(Model):
    keysUnder: int = pydantic.Field(default=0, description="Ruled keys with fewer copies than their target.")
    bytesUnder: int = pydantic.Field(default=0, description="Their bytes.")
    keysOver: int = pydantic.Field(default=0, description="Ruled keys with more copies than their target.")
    bytesOver: int = pydantic.Field(default=0, description="Bytes of the copies above target.")
    bytesSpent: int = pydantic.Field(default=0, description="Bytes of the extra copies of ruled keys.")
    budgetBytes: int = pydantic.Field(default=0, description="maxReplicatedFraction of the workers' memory limits.")
    copies: int = pydantic.Field(default=0, description="Copies made since replication was installed.")
    bytesCopied: int = pydantic.Field(default=0, description="Their bytes.")
    message: str = pydantic.Field(default="", description="Why replication cannot do all it should, in one line.")


# -- shared spill (spec.sharedSpill) ------------------------------------------------------------


class SpillMedium(enum.StrEnum):
    MEMORY = "Memory"  # an emptyDir of medium Memory, per pod
    NODE = "Node"  # a tmpfs that the node provides, shared by the node's workers, reached by hostPath


class SpillSwap(enum.StrEnum):
    POD = "Pod"  # the spilled pages are charged to the worker container: they swap as it does
    SPILL_ONLY = "SpillOnly"  # charged to the spill-owner sidecar, which may swap; the worker never does


HOST_PATH_PATTERN = r"^(/[A-Za-z0-9_.-]+)+$"
HOST_PATH_MAX_LENGTH = 255
SENSITIVE_HOST_PATHS = (
    "/bin",
    "/boot",
    "/dev",
    "/etc",
    "/home",
    "/lib",
    "/lib32",
    "/lib64",
    "/proc",
    "/root",
    "/run",
    "/sbin",
    "/sys",
    "/usr",
    "/var/lib/containerd",
    "/var/lib/cni",
    "/var/lib/docker",
    "/var/lib/etcd",
    "/var/lib/kubelet",
    "/var/log",
    "/var/run",
)
"""Host paths that a worker pod must never be given: the node's configuration, kernel interfaces,
devices, the container runtime's and the kubelet's state (other pods' Secrets), logs, and their
parents ("/var" would contain "/var/lib/kubelet"). ``/dev/shm``'s subdirectories are allowed: a
node's own tmpfs is usually there."""
ALLOWED_UNDER_SENSITIVE = ("/dev/shm",)
"""Subdirectories (never the directory itself) of these are allowed although a parent is sensitive."""


def check_host_path(path: str) -> str:
    """Refuse a host path that is not a plain absolute path, or that reaches what a worker must not
    see. The message names ``sharedSpill.hostPath``."""
    where = "sharedSpill.hostPath"
    if "\x00" in path or len(path) > HOST_PATH_MAX_LENGTH or not re.fullmatch(HOST_PATH_PATTERN, path):
        raise ValueError(f"{where}: {path!r} must be an absolute path of letters, digits, '.', '_' and '-'")
    parts = path.split("/")[1:]
    if any(part in (".", "..") for part in parts):
        raise ValueError(f"{where}: {path!r} must not contain '.' or '..' components")
    if any(path.startswith(allowed + "/") for allowed in ALLOWED_UNDER_SENSITIVE):
        return path
    for sensitive in SENSITIVE_HOST_PATHS:
        if path == sensitive or path.startswith(sensitive + "/") or sensitive.startswith(path + "/"):
            raise ValueError(f"{where}: {path!r} is or contains {sensitive}, which a worker pod must not be given")
    return path


def _host_path_cel() -> list[dict[str, str]]:
    """The same refusals for the API server, so that ``kubectl apply`` already fails."""
    sensitive = "|".join(re.escape(p[1:]) for p in SENSITIVE_HOST_PATHS)
    parents = sorted({"/".join(p.split("/")[:i]) for p in SENSITIVE_HOST_PATHS for i in range(2, p.count("/") + 1)})
    parent = "|".join(re.escape(p[1:]) for p in parents)
    allowed = "|".join(re.escape(p[1:]) for p in ALLOWED_UNDER_SENSITIVE)
    return [
        {"rule": r"!self.matches('(^|/)\\.\\.?(/|$)')", "message": "must not contain '.' or '..' components"},
        {
            "rule": f"self.matches('^/({allowed})/') || !self.matches('^/({sensitive})(/|$)')",
            "message": f"must not be or be under {', '.join(SENSITIVE_HOST_PATHS)}"
            " (subdirectories of /dev/shm are allowed)",
        },
        {"rule": f"!self.matches('^/({parent})$')", "message": "must not contain a sensitive host path"},
    ]


HostPath = Annotated[
    str,
    pydantic.Field(
        pattern=HOST_PATH_PATTERN,
        max_length=HOST_PATH_MAX_LENGTH,
        json_schema_extra={"example": "/var/lib/memops/spill", "x-kubernetes-validations": _host_path_cel()},
    ),
    pydantic.AfterValidator(check_host_path),
]

# A label value: at most 63 characters, alphanumeric at both ends (apimachinery validation.IsValidLabelValue).
LABEL_VALUE_PATTERN = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
LabelValue = Annotated[str, pydantic.Field(max_length=63, pattern=LABEL_VALUE_PATTERN)]
MAX_NODE_SELECTOR_LABELS = 16


def check_label_key(key: str) -> str:
    """A label key: an optional DNS-subdomain prefix (at most 253) and a name (at most 63)."""
    prefix, _, name = key.rpartition("/")
    if (
        not re.fullmatch(QUALIFIED_NAME_PATTERN, key)
        or len(name) > 63
        or len(prefix) > DNS_SUBDOMAIN_MAX_LENGTH
        or (bool(prefix) and not re.fullmatch(DNS_SUBDOMAIN_PATTERN, prefix))
    ):
        raise ValueError(f"sharedSpill.nodeSelector: {key[:80]!r} is not a label key")
    return key


class SharedSpillSpec(Model):
    """Spill the workers' data to a tmpfs instead of disk: per pod (medium Memory), or a tmpfs that
    the node provides and the node's workers share, which can reach swap (medium Node)."""

    medium: SpillMedium = pydantic.Field(
        description=(
            "Memory: an emptyDir of medium Memory per pod (since Kubernetes 1.31 mounted noswap where the"
            " kernel supports it: its pages never reach swap). Node: the tmpfs at hostPath that the node"
            " provides (see the optional node DaemonSet), shared by the node's workers and swap-backed on"
            " nodes with swap; its pods get node affinity from nodeSelector and should be Burstable."
        )
    )
    sizeLimit: Quantity = pydantic.Field(
        description=(
            "The most spilled bytes per pod (8Gi). Tmpfs pages count against the pod's memory limit, so"
            " memops lowers Dask's memory thresholds until Dask's data plus this fit inside the limit,"
            " and refuses a size that cannot fit."
        )
    )
    hostPath: HostPath | None = pydantic.Field(
        default=None,
        description=(
            "Node only, required: the node's tmpfs directory (/var/lib/memops/spill). An absolute path,"
            " never a system directory (/etc, /proc, /sys, /dev except /dev/shm/..., /run, the kubelet's)."
        ),
    )
    nodeSelector: dict[str, LabelValue] | None = pydantic.Field(
        default=None,
        max_length=MAX_NODE_SELECTOR_LABELS,
        description=(
            "Node only: labels of the nodes that provide the tmpfs (feature.node.kubernetes.io/memory-swap.enabled:"
            ' "true"); the workers\' pods are required to run there.'
        ),
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "self.all(k, k.size() <= 316 && k.matches('"
                    + QUALIFIED_NAME_PATTERN.replace("\\", "\\\\")
                    + "'))",
                    "message": "every key must be a label key (an optional DNS prefix and a name of at most 63)",
                }
            ]
        },
    )
    # Optional rather than a schema default of true: the API server would write the default into
    # every sharedSpill, medium Memory's too, and the rule below could not tell it from a user's.
    links: bool | None = pydantic.Field(
        default=None,
        description=(
            "Node only, true when unset: same-node fetches of spilled keys by hardlink, and reads of them"
            " as memory maps (the plugin memops installs on the workers, memops.worker.links). False keeps"
            " the node tmpfs but lets the workers fetch and unspill as stock Dask does (for pure-Python"
            " data, which a map does not spare a copy: it is unpickled into private memory on every read)."
        ),
    )

    swap: SpillSwap | None = pydantic.Field(
        default=None,
        description=(
            "Node only, Pod when unset: what of a worker pod may reach swap on a swap-backed node. Pod: the"
            " kernel charges a spilled page to the worker container that wrote it, which swaps as the kubelet"
            " decides for that container (under LimitedSwap, cgroup v2: a Burstable pod's container whose memory"
            " request is below its limit), computing memory and spill alike. SpillOnly: a sidecar of memops"
            " (memops-spill-owner) allocates each spill file before the worker writes it, so its pages are"
            " charged to the sidecar (memory request 64Mi, limit sizeLimit plus 64Mi: Burstable, so it may swap)"
            " and not to the worker, whose memory request memops raises to its limit (the kubelet never swaps"
            " such a container) and whose Dask thresholds need no room for the spill. Needs links."
        ),
    )

    model_config = pydantic.ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!has(self.swap) || self.swap != 'SpillOnly' || (self.medium == 'Node'"
                    " && (!has(self.links) || self.links))",
                    "message": "sharedSpill.swap SpillOnly needs medium Node and links",
                },
                {
                    "rule": "self.medium != 'Node' || has(self.hostPath)",
                    "message": "sharedSpill.hostPath is required for medium Node",
                },
                {
                    "rule": "self.medium != 'Memory' || (!has(self.hostPath) && !has(self.nodeSelector))",
                    "message": "sharedSpill.hostPath and sharedSpill.nodeSelector are for medium Node only",
                },
                {
                    "rule": "self.medium != 'Memory' || !has(self.links)",
                    "message": "sharedSpill.links is for medium Node only",
                },
            ]
        }
    )

    @pydantic.field_validator("nodeSelector")
    @classmethod
    def _label_keys(cls, labels: dict[str, str] | None) -> dict[str, str] | None:
        for key in labels or {}:
            check_label_key(key)
        return labels

    @pydantic.model_validator(mode="after")
    def _medium_fields(self) -> SharedSpillSpec:
        if self.medium == SpillMedium.NODE and self.hostPath is None:
            raise ValueError("sharedSpill.hostPath is required for medium Node")
        if self.medium == SpillMedium.MEMORY and (self.hostPath is not None or self.nodeSelector is not None):
            raise ValueError("sharedSpill.hostPath and sharedSpill.nodeSelector are for medium Node only")
        if self.medium == SpillMedium.MEMORY and self.links is not None:
            raise ValueError("sharedSpill.links is for medium Node only")
        if self.swap == SpillSwap.SPILL_ONLY and (self.medium != SpillMedium.NODE or self.links is False):
            raise ValueError("sharedSpill.swap SpillOnly needs medium Node and links")
        return self


class MemoryPolicySpec(Model):
    """How one Dask cluster's memory is managed, for as long as the policy exists."""

    scheduler: SchedulerRef = pydantic.Field(description="The Dask scheduler of these workers.")
    workload: WorkloadRef = pydantic.Field(description="Whose pods the workers are.")
    replicas: int | None = pydantic.Field(
        default=None, ge=0, description="Desired number of workers. Every scale-down drains first."
    )
    drain: DrainSpec = pydantic.Field(default_factory=DrainSpec, description="How workers are drained.")
    autoscale: AutoscaleSpec | None = pydantic.Field(
        default=None,
        description="Memory-driven autoscaling; when set, it decides the replicas instead of spec.replicas.",
    )
    recycle: RecycleSpec | None = pydantic.Field(default=None, description="Replace leaky or old workers safely.")
    pressure: PressureSpec | None = pydantic.Field(
        default=None, description="Relieve a worker's memory pressure by moving keys to its peers."
    )
    replication: ReplicationSpec | None = pydantic.Field(
        default=None, description="Keep N copies of the keys that matter, on other nodes; re-replicate after a loss."
    )
    placement: PlacementSpec | None = pydantic.Field(
        default=None,
        description=(
            "Graph-aware placement: the tasks that share root tasks run on one worker, and stay on running"
            " workers while memops drains, retires and adds them. Off when unset: Dask schedules as it does."
        ),
    )
    tasks: TaskAdmissionSpec | None = pydantic.Field(
        default=None,
        description=(
            "Memory-aware task admission: profile tasks' peaks, start a task only where its peak fits, preempt"
            " preemptible tasks before the nanny kills the worker. Off when unset: Dask schedules as it does."
        ),
    )
    eviction: EvictionSpec = pydantic.Field(
        default_factory=EvictionSpec,
        description="Node drains and evictions: drain the workers first, and never block for ever.",
    )
    sharedSpill: SharedSpillSpec | None = pydantic.Field(
        default=None,
        description=(
            "Spill to a tmpfs (per pod, or the node's, shared and swap-backed) instead of disk; the worker"
            " pods get the volume and Dask's configuration at creation, the workload is not changed."
        ),
    )
    resize: ResizeSpec | None = pydantic.Field(
        default=None,
        description=(
            "Grow a worker's memory in place (the pod's resize subresource, Kubernetes 1.35+) when it nears"
            " Dask's pause threshold and relief cannot place its keys, tell Dask its new limit, and shrink it"
            " back when the pressure is gone."
        ),
    )


class Recommendation(Model):
    time: float = pydantic.Field(description="When (Unix seconds).")
    replicas: int = pydantic.Field(description="What the metric recommended, before stabilization.")


class ScaleEvent(Model):
    time: float = pydantic.Field(description="When (Unix seconds).")
    change: int = pydantic.Field(description="Workers added (positive) or removed (negative).")


class WorkerMemory(Model):
    pod: str = pydantic.Field(description="The pod, which is the Dask worker's name.")
    bytes: int = pydantic.Field(description="Process memory plus bytes spilled to disk.")
    spilledBytes: int = pydantic.Field(default=0, description="Bytes spilled to disk.")
    percent: int = pydantic.Field(description="bytes over the worker's memory limit, in percent.")


class MemoryStatus(Model):
    bytes: int = pydantic.Field(default=0, description="Held by all workers: process memory plus spilled.")
    limitBytes: int = pydantic.Field(default=0, description="The workers' memory limits, summed.")
    percent: int = pydantic.Field(default=0, description="bytes over limitBytes, in percent.")
    workers: list[WorkerMemory] = pydantic.Field(default_factory=list, description="Per worker.")


class Recycling(Model):
    pod: str = pydantic.Field(description="The worker's pod.")
    reason: str = pydantic.Field(description="UnmanagedMemory, Growth or MaxAge.")
    message: str = pydantic.Field(default="", description="The figures that triggered it.")
    startTime: str = pydantic.Field(default="", description="When the worker was marked for recycling.")
    completionTime: str = pydantic.Field(default="", description="When its pod was removed, or the drain failed.")
    seconds: float | None = pydantic.Field(default=None, description="How long the recycling took.")
    outcome: str = pydantic.Field(default="", description="Recycled, or Kept when its data could not move.")
    request: str = pydantic.Field(default="", description="The RetirementRequest that drained it.")


class RecycleStatus(Model):
    recycling: list[Recycling] = pydantic.Field(default_factory=list, description="Workers being recycled now.")
    recent: list[Recycling] = pydantic.Field(default_factory=list, description="The last recycled workers.")
    total: int = pydantic.Field(default=0, description="Workers recycled since the policy was created.")


class PressureStatus(Model):
    keysMoved: int = pydantic.Field(default=0, description="Keys moved off workers under pressure so far.")
    bytesMoved: int = pydantic.Field(default=0, description="Bytes moved off workers under pressure so far.")
    hot: list[str] = pydantic.Field(
        default_factory=list, description="Workers being relieved now: over relieveAbove, or on their way to relieveTo."
    )
    starved: list[str] = pydantic.Field(
        default_factory=list, description="Hot workers with no peer that has headroom: more workers are needed."
    )
    message: str = pydantic.Field(default="", description="Why relief cannot do all it should, in one line.")


class NodePressureNode(Model):
    """A Node of the policy's workers within the margin of a threshold. Only what concerns the
    policy's own pods: the Node's headroom and the pods of other namespaces are not the tenant's to
    read (a tenant may place pods on any Node)."""

    node: str = pydantic.Field(description="The Node.")
    signal: str = pydantic.Field(
        description="The kubelet's tightest signal: memory.available or allocatableMemory.available."
    )
    workers: list[str] = pydantic.Field(
        default_factory=list,
        description="This policy's workers that the kubelet would evict, by its ranking, to get the margin back.",
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )
    drained: list[str] = pydantic.Field(
        default_factory=list,
        description="Those drained ahead of it (the others hold no data that exists nowhere else, or are draining).",
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )
    partialRanking: bool = pydantic.Field(
        default=False,
        description=(
            "The operator may not list the pods of other namespaces on the Node (a namespaced install): their"
            " usage comes from the kubelet, their requests and priorities are unknown, and they are ranked as"
            " over their requests, after the workers over theirs and before those within them."
        ),
    )


class NodePressureStatus(Model):
    """The kubelet's predicted evictions on the Nodes of the policy's workers (spec.eviction.nodePressure)."""

    nodes: list[NodePressureNode] = pydantic.Field(
        default_factory=list, description="The Nodes within the margin of a threshold, at the last read."
    )
    drains: int = pydantic.Field(
        default=0, description="Workers drained ahead of the kubelet since the policy was created."
    )
    lastRead: str = pydantic.Field(default="", description="When the kubelets were last read (RFC 3339).")
    message: str = pydantic.Field(default="", description="What could not be read, in one line.")


class SharedSpillStatus(Model):
    """What the workers' spill on the node tmpfs holds (medium Node), read from the workers' spill
    directories through memops' agent, each file (inode) once however many workers link it."""

    workers: int = pydantic.Field(default=0, description="Workers that reported their spill directories.")
    bytes: int = pydantic.Field(
        default=0,
        description="What the spill files hold, each file once however many workers link it: what the tmpfs holds.",
    )
    bytesCountedPerWorker: int = pydantic.Field(
        default=0,
        description="The same files counted once per worker that links them, as Dask's own spilled figures count"
        " them; the difference to bytes is what same-node links saved.",
    )
    bytesWithoutWriter: int = pydantic.Field(
        default=0,
        description="Of bytes, files that no worker which wrote them names any more, only workers that linked them"
        " (a drained worker's hand-over): the kernel charges a tmpfs page to the pod that wrote it while that pod"
        " lives, then to the pods' parent cgroup, against the node's allocatable memory and no worker's limit.",
    )
    bytesChargedToOwners: int = pydantic.Field(
        default=0,
        description="Of bytes, files whose pages the pods' memops-spill-owner sidecars allocated (swap: SpillOnly):"
        " charged to those sidecars, which may swap, and to no worker container's limit.",
    )
    lastRead: str = pydantic.Field(default="", description="When the workers were last asked (RFC 3339).")


class FailedHook(Model):
    pod: str = pydantic.Field(description="The pod whose preStop hook failed: it left without the safety net's drain.")
    time: str = pydantic.Field(default="", description="When the kubelet reported it (its FailedPreStopHook event).")
    message: str = pydantic.Field(default="", description="The kubelet's event message.")


class HookLoss(Model):
    """What the safety net's preStop drain of one pod had not moved when the pod's time ran out."""

    pod: str = pydantic.Field(description="The pod whose preStop hook drained it (its Dask worker's name).")
    time: str = pydantic.Field(default="", description="When the drain stopped (the scheduler's clock).")
    keys: int = pydantic.Field(default=0, ge=0, description="Keys held by this worker alone, lost with it.")
    bytes: int = pydantic.Field(default=0, ge=0, description="Their bytes.")
    irreplaceableKeys: int = pydantic.Field(
        default=0, ge=0, description="Of those keys, how many could not be recomputed (scattered, or inputs released)."
    )
    cause: str = pydantic.Field(
        default="deadline",
        description="deadline: the drain stopped at the hook's deadline; worker left: the pod was killed first"
        " (a deletion's grace period shorter than the pod's own).",
    )


class SafetyNetStatus(Model):
    failedHooks: list[FailedHook] = pydantic.Field(
        default_factory=list, description="The last pods of the workload that left with a failed preStop hook."
    )
    lostAtDeadline: list[HookLoss] = pydantic.Field(
        default_factory=list,
        description="The last pods whose preStop drain ran out of time, with what stayed on them (memops' agent's"
        " drain status, read by the operator).",
    )


class WorkerLoss(Model):
    """A worker of the workload that left the scheduler on its own (killed by the kernel's OOM killer, by
    its nanny, with its pod) with keys that no other worker held."""

    pod: str = pydantic.Field(description="The pod the worker ran in.")
    time: str = pydantic.Field(default="", description="When the worker left (the scheduler's clock).")
    reason: str = pydantic.Field(
        default="Unknown",
        description="Why, from the pod: its container's termination reason at that moment (OOMKilled, Error,"
        " ...), Evicted, Deleted (the pod was deleted or is gone), or Unknown (the pod does not say: a worker"
        " process killed inside a container that kept running).",
    )
    exitCode: int | None = pydantic.Field(default=None, description="The container's exit code, with its reason.")
    keys: int = pydantic.Field(default=0, ge=0, description="Keys held by this worker alone, lost with it.")
    bytes: int = pydantic.Field(default=0, ge=0, description="Their bytes.")
    irreplaceableKeys: int = pydantic.Field(
        default=0, ge=0, description="Of those keys, how many could not be recomputed (scattered, or inputs released)."
    )


MAX_HELD_BACK = 32
"""Entries of ``status.heldBack`` at most: the count-level one first, then by pod. Every pass
writes the list anew, so it stays short enough to read at a glance."""


class HeldBackRule(enum.StrEnum):
    """The rule that holds back a removal which the policy's pass would otherwise make."""

    # A drain of the policy kept the pod (its RetirementRequest's status.workers[].cause), and the
    # scale-down waits out the cooldown after a failed drain:
    NOWHERE_TO_GO = "NowhereToGo"
    DRAIN_TIMED_OUT = "DrainTimedOut"
    DRAIN_UNREACHABLE = "DrainUnreachable"
    WORKER_UNIDENTIFIED = "WorkerUnidentified"
    REQUEST_FAILED = "RequestFailed"
    REMOVAL_BLOCKED = "RemovalBlocked"
    DRAIN_FAILED = "DrainFailed"
    # Autoscaling keeps workers that the memory metric alone would remove:
    STABILIZATION_WINDOW = "StabilizationWindow"
    SCALE_DOWN_POLICIES = "ScaleDownPolicies"
    MEMORY_IN_USE = "MemoryInUse"
    MIN_REPLICAS = "MinReplicas"
    # Recycling holds a worker that is due:
    MAX_UNAVAILABLE = "MaxUnavailable"
    IN_SHUFFLE = "InShuffle"
    OTHER_DRAIN_RUNNING = "OtherDrainRunning"
    AWAITING_REPLACEMENTS = "AwaitingReplacements"
    # spec.eviction.nodePressure holds a drain ahead of the kubelet's eviction:
    NO_ROOM_ON_OTHER_NODES = "NoRoomOnOtherNodes"


class HeldBack(Model):
    """A removal that the policy's pass would make but holds back, and the rule that holds it."""

    pod: str = pydantic.Field(
        default="",
        description="The worker's pod. Empty for the workers of a scale-down held back before any is chosen"
        " (autoscaling's rules, a failed drain that kept no pod): workers says how many.",
    )
    rule: HeldBackRule = pydantic.Field(
        description="NowhereToGo, DrainTimedOut, DrainUnreachable, WorkerUnidentified, RequestFailed,"
        " RemovalBlocked: the policy's last scale-down drain kept the pod (no worker had room for its unique"
        " data; the drain ran out of spec.drain.timeout; the scheduler was unreachable; no worker could be"
        " matched to the pod; the request failed; the pod could not be removed in time), and the scale-down waits"
        " out the cooldown after a failed drain. DrainFailed: the same, for a failed drain that kept no pod."
        " StabilizationWindow, ScaleDownPolicies, MemoryInUse, MinReplicas: spec.autoscale keeps workers that the"
        " memory metric alone would remove. MaxUnavailable, InShuffle, OtherDrainRunning, AwaitingReplacements:"
        " a worker due for recycling waits (maxUnavailable are being recycled; it takes part in a P2P shuffle;"
        " another drain of the policy runs; its replacements have not connected yet). NoRoomOnOtherNodes: the"
        " kubelet would evict the worker, and the other Nodes have no room for its unique data.",
    )
    workers: int = pydantic.Field(default=1, ge=1, description="How many workers the rule holds back: 1 for a pod.")
    message: str = pydantic.Field(default="", description="Why, with the figures, in one line.")
    since: str = pydantic.Field(
        default="", description="Since when this rule has held it back, pass after pass (RFC 3339)."
    )


class MemoryPolicyStatus(Model):
    replicas: int = pydantic.Field(default=0, description="Workers that exist now.")
    desiredReplicas: int = pydantic.Field(default=0, description="Workers that memops is steering towards.")
    selector: str = pydantic.Field(default="", description="The workers' label selector, for the /scale subresource.")
    observedGeneration: int = pydantic.Field(default=0, description="The generation last acted on.")
    lastScaleTime: str = pydantic.Field(default="", description="When memops last changed the workers' count.")
    lastScaleReason: str = pydantic.Field(default="", description="Why: ScaleUp, or ScaleDown through a drain.")
    message: str = pydantic.Field(default="", description="What memops is doing now, in one line.")
    heldBack: list[HeldBack] = pydantic.Field(
        default_factory=list,
        max_length=MAX_HELD_BACK,
        description="Why not: each worker that this pass would retire (a scale-down, recycling, a drain ahead of"
        " the kubelet's eviction) but holds back, with the rule that holds it; at most one entry per pod, and"
        " one without a pod for a scale-down held back before any worker is chosen. Each new entry is also a"
        " Kubernetes Event on the policy, whose reason is the rule.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["pod"]},
    )
    memory: MemoryStatus | None = pydantic.Field(
        default=None, description="The workers' memory, per worker and in total."
    )
    recommendations: list[Recommendation] = pydantic.Field(
        default_factory=list, description="Recent autoscaling recommendations, for the stabilization windows."
    )
    scaleEvents: list[ScaleEvent] = pydantic.Field(
        default_factory=list, description="Recent changes of the workers' count, for the scaling policies."
    )
    recycle: RecycleStatus | None = pydantic.Field(default=None, description="Workers recycled, and why.")
    pressure: PressureStatus | None = pydantic.Field(default=None, description="What pressure relief did.")
    nodePressure: NodePressureStatus | None = pydantic.Field(
        default=None, description="The kubelet's evictions that memops predicts, and the drains ahead of them."
    )
    sharedSpill: SharedSpillStatus | None = pydantic.Field(
        default=None, description="What the workers' shared spill holds (medium Node, links not false), each file once."
    )
    replication: ReplicationStatus | None = pydantic.Field(default=None, description="Keys against their targets.")
    placement: PlacementStatus | None = pydantic.Field(default=None, description="What graph-aware placement did.")
    tasks: TaskAdmissionStatus | None = pydantic.Field(default=None, description="What task admission did.")
    safetyNet: SafetyNetStatus | None = pydantic.Field(
        default=None, description="Pods that left with a failed safety-net hook (the kubelet's events)."
    )
    resize: ResizeStatus | None = pydantic.Field(
        default=None, description="What in-place growth did: workers grown, shrunk, and the fallbacks."
    )
    workerLosses: list[WorkerLoss] = pydantic.Field(
        default_factory=list,
        description="The last workers of the workload that left on their own with keys held nowhere else (memops'"
        " agent's record in the scheduler, read by the operator), newest last. Drains of memops report their"
        " own losses (RetirementRequests, safetyNet.lostAtDeadline).",
    )
    conditions: list[Condition] = pydantic.Field(default_factory=list, description="Standard conditions.")


MEMORY_POLICY = ResourceKind(
    kind="MemoryPolicy",
    plural="memorypolicies",
    short_names=("mempol",),
    scale={
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    },
    # The policy's name is a label value on its RetirementRequests, which Kubernetes caps at 63.
    validations=(
        {
            "rule": "self.metadata.name.size() <= 63",
            "message": "metadata.name must be at most 63 characters: it labels the policy's RetirementRequests",
        },
    ),
    printer_columns=printer_columns(
        column("Workload", "string", ".spec.workload.name"),
        column("Desired", "integer", ".status.desiredReplicas"),
        column("Replicas", "integer", ".status.replicas"),
        column("Memory%", "integer", ".status.memory.percent"),
        column("Last-Scale", "string", ".status.lastScaleReason"),
    ),
    description=(
        "How one Dask cluster's memory is managed for as long as the policy exists; every scale-down"
        " that it governs drains the workers first."
    ),
    spec=MemoryPolicySpec,
    status=MemoryPolicyStatus,
)
