"""Pure decisions of in-place growth: grow a worker's memory, tell Dask, shrink it back, or fall back.

The policy pass gathers, per worker: Dask's view of its memory (:class:`WorkerMemory`, from the
scheduler), with ``sharedSpill`` medium Node the bytes of its spill that it links from other
writers (:attr:`Inputs.spill_linked`, from the workers' spill reports), its container's memory as
the pod says it (:func:`container_memory`: what is asked in ``spec`` and what the kubelet applied,
in ``status.containerStatuses[].resources`` and ``allocatedResources``), the pod's resize
conditions (:func:`resize_status`), what its node can still grant (:func:`node_room`) and what
relief could place on its peers; :func:`decide` says what to do with it, as one :class:`Decision`.
No I/O: the pod's ``resize`` subresource is patched by
:func:`memops.controllers.resize.resize_container_memory`, Dask's copies of the limit are set by the agent's
``resize`` (:mod:`memops.scheduler.worker_limits`).

The order of a change, which the decisions keep over several passes (each pass reads where things
stand, so an operator restart between two steps loses nothing):

- growth: the container first (:attr:`Action.GROW`, a patch of ``pods/resize``); once the kubelet
  reports the new limit applied, Dask (:attr:`Action.TELL_DASK`): the nanny's kill threshold rises
  only when the cgroup has the room;
- decrease: Dask first, then the container, in one step (:attr:`Action.SHRINK`): the worker refuses
  a limit whose pause threshold it is over, and if the container's patch fails, the next pass finds
  Dask below the container and raises it again (:attr:`Action.TELL_DASK`). A decrease is asked only
  where the worker's memory is under the smaller limit's target (Dask's ``target`` fraction, 60%),
  so that Dask spills nothing for it; the limit goes down step by step as the memory does;
- a growth the kubelet defers or refuses (``PodResizePending``, reason ``Deferred`` or
  ``Infeasible``), or that failed (``PodResizeInProgress``, reason ``Error``), falls back: relief
  where the peers have room for the excess, else one more worker. An infeasible ask is taken back
  (``revert_to``): it never comes true. A deferred one may, once the node has room, but meanwhile
  the scheduler counts its request on the node (other pods are kept off the memory it asks): it is
  taken back once deferred for :data:`DEFERRED_SECONDS`. A decrease that is pending or failed is
  taken back.

The administrator bounds it all (:class:`Administrator`, ``memops run``'s flags): growth acts only in
the namespaces listed, and never past their ceiling, whatever the policy's ``maxLimit``.

Assumed: Dask's limit for a container limit L is L (``--memory-limit`` from the container's limit,
or ``auto`` with as many threads as the container's CPUs); the scheduler's ``memory_limit`` is
compared with the container's.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from memops import specs
from memops.decisions import snapshots, timestamps
from memops.specs.memorypolicy_resize import MAX_LIMIT, ResizeSettings

# -- quantities ---------------------------------------------------------------------------------

_BINARY = (("Ei", 2**60), ("Pi", 2**50), ("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10))


def to_quantity(nbytes: int) -> str:
    """Bytes as an exact Kubernetes quantity: the largest binary unit that divides them
    (``536870912`` is ``512Mi``), else the plain number. Never rounded: a resize asks for exactly
    what was decided, and the kubelet reports it back in the same form."""
    if nbytes < 0:
        raise ValueError(f"a memory quantity is not negative: {nbytes}")
    for suffix, unit in _BINARY:
        if nbytes and nbytes % unit == 0:
            return f"{nbytes // unit}{suffix}"
    return str(nbytes)


def from_quantity(text: Any) -> int | None:
    """A memory quantity of a pod (``"512Mi"``, ``"1G"``) in bytes, rounded up as the kubelet
    rounds it; None when absent or not a quantity."""
    if not isinstance(text, str):
        return None
    try:
        return specs.parse_quantity(text)
    except ValueError:
        return None


def round_up(nbytes: int, step: int) -> int:
    return -(-nbytes // step) * step


def round_down(nbytes: int, step: int) -> int:
    return (nbytes // step) * step


# -- what the pod says --------------------------------------------------------------------------


class PodResize(enum.StrEnum):
    NONE = ""
    IN_PROGRESS = "InProgress"  # PodResizeInProgress: the kubelet has accepted it and is applying it
    DEFERRED = "Deferred"  # PodResizePending: not now (the node lacks room); retried by the kubelet
    INFEASIBLE = "Infeasible"  # PodResizePending: never on this node (more than it has, or not allowed)
    ERROR = "Error"  # PodResizeInProgress with reason Error: the runtime failed to apply it


@dataclasses.dataclass(frozen=True)
class ResizeStatus:
    state: PodResize
    message: str = ""
    since: float | None = None
    """Unix seconds: when the kubelet set the ``PodResizePending`` condition (its
    ``lastTransitionTime``); None for the other states, or when it does not say."""


def _transition(condition: Mapping[str, Any]) -> float | None:
    try:
        return timestamps.parse(str(condition.get("lastTransitionTime") or "")).timestamp()
    except ValueError:
        return None


def resize_status(pod: Mapping[str, Any]) -> ResizeStatus:
    """The pod's resize state from its conditions (Kubernetes 1.33+: ``PodResizePending``,
    ``PodResizeInProgress``), or from ``status.resize`` where an older API server still sets it."""
    status = pod.get("status") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or () if isinstance(c, Mapping)}
    pending = conditions.get("PodResizePending")
    if pending is not None and pending.get("status") == "True":
        reason = str(pending.get("reason") or "")
        state = PodResize.INFEASIBLE if reason == "Infeasible" else PodResize.DEFERRED
        return ResizeStatus(state, str(pending.get("message") or ""), _transition(pending))
    progress = conditions.get("PodResizeInProgress")
    if progress is not None and progress.get("status") == "True":
        state = PodResize.ERROR if progress.get("reason") == "Error" else PodResize.IN_PROGRESS
        return ResizeStatus(state, str(progress.get("message") or ""))
    legacy = {"Proposed": PodResize.IN_PROGRESS, "InProgress": PodResize.IN_PROGRESS}
    legacy |= {"Deferred": PodResize.DEFERRED, "Infeasible": PodResize.INFEASIBLE}
    return ResizeStatus(legacy.get(str(status.get("resize") or ""), PodResize.NONE))


@dataclasses.dataclass(frozen=True)
class ContainerMemory:
    """One container's memory, in bytes (None: not set)."""

    request: int | None  # spec.containers[].resources.requests: what is asked
    limit: int | None  # spec.containers[].resources.limits: what is asked
    allocated: int | None  # status.containerStatuses[].allocatedResources: the request the node admitted
    actual_limit: int | None  # status.containerStatuses[].resources.limits: what the runtime applied
    decrease_allowed: bool  # its resizePolicy for memory is NotRequired (the default): no restart

    @property
    def applied_limit(self) -> int | None:
        """The limit in force: the kubelet's report, or the asked one where it reports none."""
        return self.actual_limit if self.actual_limit is not None else self.limit


def container_memory(pod: Mapping[str, Any], container: str) -> ContainerMemory | None:
    """The memory of the container named ``container`` of the pod, or None when it has none."""
    spec = next((c for c in (pod.get("spec") or {}).get("containers") or () if c.get("name") == container), None)
    if spec is None:
        return None
    resources = spec.get("resources") or {}
    policies = {p.get("resourceName"): p.get("restartPolicy") for p in spec.get("resizePolicy") or ()}
    statuses = (pod.get("status") or {}).get("containerStatuses") or ()
    status: Mapping[str, Any] = next((s for s in statuses if s.get("name") == container), {})
    applied = status.get("resources") or {}
    return ContainerMemory(
        request=from_quantity((resources.get("requests") or {}).get("memory")),
        limit=from_quantity((resources.get("limits") or {}).get("memory")),
        allocated=from_quantity((status.get("allocatedResources") or {}).get("memory")),
        actual_limit=from_quantity((applied.get("limits") or {}).get("memory")),
        decrease_allowed=policies.get("memory", "NotRequired") == "NotRequired",
    )


def node_room(allocatable: int, requests: Iterable[int]) -> int:
    """Bytes of memory request the node can still grant: its allocatable memory minus the requests
    of the pods on it (this worker's included; terminated pods left out by the caller), each as
    :func:`pod_request` counts it. The kubelet admits a resize whose requests fit in it."""
    return max(allocatable - sum(requests), 0)


def _memory_request(container: Mapping[str, Any], statuses: Mapping[Any, Mapping[str, Any]]) -> int:
    """One container's memory request as the node admitted it: what the kubelet allocated (a
    resize it admitted), or else what the spec asks; 0 when neither says."""
    allocated = (statuses.get(container.get("name")) or {}).get("allocatedResources") or {}
    asked = ((container.get("resources") or {}).get("requests") or {}).get("memory")
    return from_quantity(allocated.get("memory") or asked) or 0


def pod_request(pod: Mapping[str, Any]) -> int:
    """A pod's memory request as the kubelet and the scheduler count it on its node (Kubernetes'
    ``PodRequests``): its containers, and its restartable init containers (sidecars, such as the
    spill owner) which run beside them; or, where more, an init container with the sidecars started
    before it; or the pod-level request, where the pod has one; then the runtime's ``overhead``."""
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    running = {s.get("name"): s for s in status.get("containerStatuses") or () if isinstance(s, Mapping)}
    starting = {s.get("name"): s for s in status.get("initContainerStatuses") or () if isinstance(s, Mapping)}
    total = sum(_memory_request(c, running) for c in spec.get("containers") or () if isinstance(c, Mapping))
    sidecars = init = 0
    for container in spec.get("initContainers") or ():
        if not isinstance(container, Mapping):
            continue
        request = _memory_request(container, starting)
        if container.get("restartPolicy") == "Always":
            total += request
            sidecars += request
            init = max(init, sidecars)
        else:
            init = max(init, request + sidecars)
    total = max(total, init)
    pod_level = from_quantity((((spec.get("resources") or {}).get("requests")) or {}).get("memory"))
    if pod_level is not None:
        total = pod_level
    return total + (from_quantity((spec.get("overhead") or {}).get("memory")) or 0)


# -- the administrator's bounds -----------------------------------------------------------------

DEFAULT_CEILING = "64Gi"
"""The administrator's ceiling on a grown limit where ``memops run --max-resize-limit`` is not given."""
EVERY_NAMESPACE = "*"
"""``memops run --resize-in '*'``: growth may act in every namespace the operator watches."""
_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


@dataclasses.dataclass(frozen=True)
class Administrator:
    """What the operator's administrators allow of in-place growth: the namespaces where it may
    act at all (``memops run --resize-in``; none by default) and the largest limit it may grow a
    container to (``--max-resize-limit``, and ``--max-resize-limit-in`` per namespace).

    Growth patches ``pods/resize`` with the operator's rights, which a tenant who may create a
    MemoryPolicy need not hold; and admission rules that match only pod creation, and quota
    systems outside the API server, never see it. So only where the administrator listed the
    namespace (a flag: only whoever runs the operator can change it, it needs no permission on
    Namespaces, and no tenant who may edit their namespace can grant it to themselves), and within
    the administrator's ceiling, whatever the policy says."""

    ceiling: int = specs.parse_quantity(DEFAULT_CEILING)
    ceilings: tuple[tuple[str, int], ...] = ()
    """Per namespace, where the administrator set one: (namespace, bytes)."""
    namespaces: frozenset[str] = frozenset()

    def ceiling_in(self, namespace: str) -> int | None:
        """The largest limit growth may ask in ``namespace``; None: growth may not act there."""
        if EVERY_NAMESPACE not in self.namespaces and namespace not in self.namespaces:
            return None
        return dict(self.ceilings).get(namespace, self.ceiling)


NOBODY = Administrator()
"""The operator's defaults: growth acts in no namespace."""


def _ceiling(text: str, flag: str) -> int:
    try:
        value = specs.parse_quantity(text)
    except ValueError as error:
        raise ValueError(f"{flag}: {error}") from None
    if value <= 0:
        raise ValueError(f"{flag}: {text!r} must be more than zero bytes")
    if value > specs.parse_quantity(MAX_LIMIT):
        raise ValueError(f"{flag}: {text!r} must be at most {MAX_LIMIT}")
    return value


def _namespace(name: str, flag: str) -> str:
    if len(name) > 63 or not _NAMESPACE.match(name):
        raise ValueError(f"{flag}: {name!r} is not a namespace name")
    return name


def administrator(
    ceiling: str = DEFAULT_CEILING, per_namespace: Iterable[str] = (), namespaces: Iterable[str] = ()
) -> Administrator:
    """The operator's flags, checked: ``--max-resize-limit`` (a quantity, at most
    :data:`memops.specs.memorypolicy_resize.MAX_LIMIT`), ``--max-resize-limit-in`` (``NAMESPACE=QUANTITY``) and
    ``--resize-in`` (namespace names, or ``*``); raises ValueError for any that is not (a typo
    would allow or bound nothing)."""
    ceilings = []
    for item in per_namespace:
        name, sep, text = item.partition("=")
        if not sep:
            raise ValueError(f"--max-resize-limit-in: {item!r} is not NAMESPACE=QUANTITY")
        ceilings.append((_namespace(name, "--max-resize-limit-in"), _ceiling(text, "--max-resize-limit-in")))
    listed = frozenset(n if n == EVERY_NAMESPACE else _namespace(n, "--resize-in") for n in namespaces)
    return Administrator(_ceiling(ceiling, "--max-resize-limit"), tuple(sorted(ceilings)), listed)


def within(settings: ResizeSettings, ceiling: int) -> ResizeSettings:
    """The policy's settings under the administrator's ceiling: the lower of the two maxima."""
    return dataclasses.replace(settings, max_limit=min(settings.max_limit, ceiling))


# -- the decision -------------------------------------------------------------------------------


class Action(enum.StrEnum):
    NONE = "None"
    WAIT = "Wait"  # the kubelet is applying a resize
    GROW = "Grow"  # patch the pod's resize to ``limit`` (and ``request``)
    TELL_DASK = "TellDask"  # the container has ``limit``: set Dask's copies to it
    SHRINK = "Shrink"  # set Dask's copies to ``limit``, then patch the pod's resize to it
    REVERT = "Revert"  # patch the pod's resize back to ``limit``, what the container has
    RELIEVE = "Relieve"  # leave the worker to relief: its peers have room for the excess
    SCALE_UP = "ScaleUp"  # one more worker


class Reason(enum.StrEnum):
    NO_PRESSURE = "NoPressure"
    PEERS_HAVE_ROOM = "PeersHaveRoom"  # relief places the excess, and moving it costs less
    PEERS_FULL = "PeersFull"  # grown: relief cannot place the excess
    MOVING_COSTS_MORE = "MovingCostsMore"  # grown: the excess is over preferGrowthAbove
    AT_MAXIMUM = "AtMaximum"  # no growth: the limit is at the policy's maxLimit
    NODE_FULL = "NodeFull"  # no growth: the node cannot grant more
    RESIZING = "Resizing"
    RESIZE_DEFERRED = "ResizeDeferred"
    RESIZE_DEFERRED_TOO_LONG = "ResizeDeferredTooLong"  # deferred past DEFERRED_SECONDS: taken back
    RESIZE_INFEASIBLE = "ResizeInfeasible"
    RESIZE_FAILED = "ResizeFailed"
    CONTAINER_RESIZED = "ContainerResized"  # Dask's limit differs from the container's
    PRESSURE_GONE = "PressureGone"
    TASK_DEMAND = "TaskDemand"  # grown: a waiting task's profiled peak fits no worker (spec.tasks)


DASK_PAUSE = 0.8
"""Dask's default pause fraction (``distributed.worker.memory.pause``)."""


@dataclasses.dataclass(frozen=True)
class WorkerMemory:
    """Dask's view of a worker (the scheduler's ``WorkerState.memory`` and ``memory_limit``), bytes."""

    process: int
    managed: int  # in memory
    unmanaged: int
    spilled: int
    limit: int  # Dask's memory limit
    target: float | None = 0.6  # Dask's fractions (None: off)
    pause: float | None = DASK_PAUSE


@dataclasses.dataclass(frozen=True)
class Inputs:
    worker: WorkerMemory
    container: ContainerMemory
    resize: ResizeStatus
    baseline_limit: int
    """The container's limit in its workload's template: a decrease goes no lower."""
    baseline_request: int | None
    """The container's request in its workload's template."""
    node_room: int
    """:func:`node_room` of the worker's node."""
    peers_room: int
    """Bytes that relief could place on the worker's peers."""
    seconds_since_resize: float | None = None
    """Since the worker's last resize (None: never resized)."""
    spill_charged: bool = False
    """The worker spills to a tmpfs charged to its pod (sharedSpill): spilled bytes use its limit."""
    spill_linked: int = 0
    """Bytes of the worker's spill that it holds by a link to a peer's file (sharedSpill medium
    Node: a fetch by link, a hand-over). The kernel charges a tmpfs page to the pod that wrote it,
    never to one that links it later, so these are not charged to this worker's pod; Dask's
    ``spilled`` counts them in full all the same. 0 where nothing is known (the safe side)."""
    seconds_pending: float | None = None
    """Since the kubelet set the pod's ``PodResizePending`` condition (its ``lastTransitionTime``);
    None where it does not say (``status.resize`` of an API server before 1.33): then
    :attr:`seconds_since_resize` counts, and without either the ask counts as long pending."""


@dataclasses.dataclass(frozen=True)
class Decision:
    action: Action
    reason: Reason
    limit: int | None = None  # bytes: the container's (and Dask's) new limit
    request: int | None = None  # bytes: the container's new request (None: unchanged)
    revert_to: int | None = None  # bytes: take back a pending ask of the pod, to this limit
    message: str = ""


def used_bytes(inputs: Inputs) -> int:
    """What counts against the limit: the process, and the spill tmpfs where the pod pays for it,
    which is Dask's ``spilled`` less what the worker links from other writers
    (:attr:`Inputs.spill_linked`). The spill counted is never negative and never more than Dask's
    ``spilled``, whatever the linked figure says."""
    worker = inputs.worker
    if not inputs.spill_charged:
        return worker.process
    return worker.process + max(0, worker.spilled - max(0, inputs.spill_linked))


def _request_for(inputs: Inputs, limit: int, applied: int) -> int | None:
    """The request that goes with a new limit: moved by as much as the limit, so that a
    Guaranteed pod (request = limit) stays Guaranteed and a Burstable one keeps its gap; never
    below the template's request (or the new limit, if that is smaller), never above the limit."""
    request = inputs.container.request
    if request is None:
        return None
    floor = min(inputs.baseline_request if inputs.baseline_request is not None else request, limit)
    return min(max(request + (limit - applied), floor), limit)


def _fallback(inputs: Inputs, reason: Reason, needed: int, message: str, revert_to: int | None = None) -> Decision:
    """Relief where the peers have room for ``needed`` bytes, else one more worker."""
    if needed <= 0:
        return Decision(Action.NONE, reason, revert_to=revert_to, message=message)
    action = Action.RELIEVE if inputs.peers_room >= needed else Action.SCALE_UP
    return Decision(action, reason, revert_to=revert_to, message=message)


DEFERRED_SECONDS = 120.0
"""How long a growth may stay deferred by the kubelet before memops takes it back: while it is
deferred, the scheduler counts its request on the node, and keeps other pods off that memory."""
DEFERRED_RETRY_SECONDS = 600.0
"""After memops took back a growth deferred too long, the least time before it asks again (or the
policy's ``cooldown``, if longer): a growth asked again at once would hold the node's memory again,
so that it would be free at most a pass in every :data:`DEFERRED_SECONDS`."""


def deferred_too_long(inputs: Inputs) -> bool:
    """Whether a deferred ask has been pending past :data:`DEFERRED_SECONDS`: by the kubelet's
    condition where it has a time, else since memops asked (the pod's stamp), else long."""
    pending = inputs.seconds_pending if inputs.seconds_pending is not None else inputs.seconds_since_resize
    return pending is None or pending >= DEFERRED_SECONDS


def refused_lately(
    inputs: Inputs, settings: ResizeSettings, message: str, reason: Reason = Reason.RESIZE_INFEASIBLE
) -> Decision:
    """A growth that the kubelet refused as infeasible, or deferred too long, asked again soon after
    the ask was taken back: not asked again yet (it would only be refused, or hold the node's memory,
    again), but fallen back as it was then."""
    needed = math.ceil(used_bytes(inputs) - settings.grow_to * inputs.worker.limit)
    return _fallback(inputs, reason, needed, message)


def decide(inputs: Inputs, settings: ResizeSettings) -> Decision:
    """What to do about one worker's memory limit (see the module's docstring)."""
    container = inputs.container
    worker = inputs.worker
    applied = container.applied_limit
    if applied is None or container.limit is None or worker.limit <= 0:
        return Decision(Action.NONE, Reason.NO_PRESSURE, message="the container or the worker has no memory limit")
    used = used_bytes(inputs)
    needed = math.ceil(used - settings.grow_to * worker.limit)
    # 1. The kubelet's answer to the last ask.
    failed = {
        PodResize.DEFERRED: Reason.RESIZE_DEFERRED,
        PodResize.INFEASIBLE: Reason.RESIZE_INFEASIBLE,
        PodResize.ERROR: Reason.RESIZE_FAILED,
    }
    if inputs.resize.state in failed:
        reason = failed[inputs.resize.state]
        if container.limit < applied:  # a decrease: take it back, Dask follows on the next pass
            return Decision(Action.REVERT, reason, limit=applied, message=inputs.resize.message)
        if inputs.resize.state is not PodResize.DEFERRED:
            return _fallback(inputs, reason, needed, inputs.resize.message, revert_to=applied)
        if container.limit == applied:  # taken back, the kubelet's condition not cleared yet: as it was said
            return _fallback(inputs, Reason.RESIZE_DEFERRED_TOO_LONG, needed, inputs.resize.message)
        if deferred_too_long(inputs):  # the ask holds the node's memory: take it back
            return _fallback(inputs, Reason.RESIZE_DEFERRED_TOO_LONG, needed, inputs.resize.message, revert_to=applied)
        return _fallback(inputs, reason, needed, inputs.resize.message)
    if inputs.resize.state is PodResize.IN_PROGRESS or container.limit != applied:
        return Decision(Action.WAIT, Reason.RESIZING)
    # 2. The container has a limit that Dask does not know yet.
    if worker.limit != applied:
        return Decision(Action.TELL_DASK, Reason.CONTAINER_RESIZED, limit=applied)
    # 3. Pressure: relief first where it can place the excess cheaply, else growth.
    if used >= settings.grow_above * worker.limit:
        if 0 < needed <= inputs.peers_room and needed <= settings.prefer_growth_above:
            return Decision(Action.RELIEVE, Reason.PEERS_HAVE_ROOM)
        wanted = round_up(math.ceil(used / settings.grow_to), settings.step)
        cap = round_down(min(settings.max_limit, applied + inputs.node_room), settings.step)
        limit = min(wanted, cap)
        if limit <= applied:
            full = Reason.AT_MAXIMUM if applied >= settings.max_limit else Reason.NODE_FULL
            return _fallback(inputs, full, needed, f"cannot grow past {to_quantity(applied)}")
        reason = Reason.PEERS_FULL if needed > inputs.peers_room else Reason.MOVING_COSTS_MORE
        return Decision(Action.GROW, reason, limit=limit, request=_request_for(inputs, limit, applied))
    # 4. No pressure: lower a grown limit, to what keeps the memory under the smaller limit's target.
    cooled = inputs.seconds_since_resize is None or inputs.seconds_since_resize >= settings.cooldown
    if settings.shrink and container.decrease_allowed and applied > inputs.baseline_limit and cooled:
        share = min(worker.target or settings.grow_to, settings.grow_to)
        limit = max(inputs.baseline_limit, round_up(math.ceil(used / share), settings.step))
        if limit <= applied - settings.step:
            return Decision(
                Action.SHRINK, Reason.PRESSURE_GONE, limit=limit, request=_request_for(inputs, limit, applied)
            )
    return Decision(Action.NONE, Reason.NO_PRESSURE)


# -- growth for task admission's demand ---------------------------------------------------------

DEMAND_SETTLE_SECONDS = 30.0
"""After any resize of the policy's workers, the least time before a growth for demand: the grown
worker tells the scheduler its new capacity within a second, and the demand that the policy's
status holds was read before that, so that growing again at once would grow a second worker for
the same task."""
_CHANGES = frozenset({Action.GROW, Action.WAIT, Action.TELL_DASK, Action.SHRINK, Action.REVERT})


def _pause(inputs: Inputs) -> float:
    """The worker's pause fraction; where pausing is off, Dask's default, as task admission takes it."""
    return inputs.worker.pause or DASK_PAUSE


def capacity(inputs: Inputs, limit: int) -> float:
    """What task admission sees of a worker of ``limit`` bytes: its pause threshold's bytes."""
    return _pause(inputs) * limit


def for_demand(
    workers: Sequence[WorkerSeen], decisions: Sequence[Decision], demand: int, settings: ResizeSettings
) -> tuple[int, Decision] | None:
    """Task admission's demand: tasks wait whose profiled peak, up to ``demand`` bytes, fits no
    worker's capacity (:func:`capacity`). The one worker to grow in place so that it fits, as the
    index into ``workers`` and its decision, or None: no demand, a change of the workers' memory
    already under way (``decisions``, each worker's own from :func:`decide`), a resize less than
    :data:`DEMAND_SETTLE_SECONDS` ago, or no worker at rest that its node and the policy's maximum
    let grow far enough. The worker chosen needs the least growth: the limit at which its pause
    threshold holds its memory now and the task's peak, in whole steps."""
    if demand <= 0 or any(d.action in _CHANGES for d in decisions):
        return None
    if any(
        w.inputs.seconds_since_resize is not None and w.inputs.seconds_since_resize < DEMAND_SETTLE_SECONDS
        for w in workers
    ):
        return None
    best: tuple[int, str, int] | None = None  # limit, pod, index
    for index, (seen, decision) in enumerate(zip(workers, decisions, strict=True)):
        inputs = seen.inputs
        applied = inputs.container.applied_limit
        at_rest = inputs.resize.state is PodResize.NONE and inputs.container.limit == applied == inputs.worker.limit
        if decision.action is not Action.NONE or not at_rest or applied is None or capacity(inputs, applied) >= demand:
            continue
        limit = round_up(math.ceil((used_bytes(inputs) + demand) / _pause(inputs)), settings.step)
        cap = round_down(min(settings.max_limit, applied + inputs.node_room), settings.step)
        if limit <= cap and (best is None or (limit, seen.pod) < best[:2]):
            best = (limit, seen.pod, index)
    if best is None:
        return None
    limit, _, index = best
    inputs = workers[index].inputs
    applied = inputs.container.applied_limit
    assert applied is not None
    message = f"tasks wait whose profiled peak, up to {demand / 2**20:.0f} MiB, fits no worker"
    return index, Decision(
        Action.GROW, Reason.TASK_DEMAND, limit=limit, request=_request_for(inputs, limit, applied), message=message
    )


def keeps_for_demand(seen: WorkerSeen, decision: Decision, demand: int) -> Decision:
    """A decrease that would take from a worker the capacity that waiting tasks need: not now."""
    applied = seen.inputs.container.applied_limit
    if decision.action is not Action.SHRINK or demand <= 0 or applied is None or decision.limit is None:
        return decision
    if capacity(seen.inputs, decision.limit) < demand <= capacity(seen.inputs, applied):
        return Decision(Action.NONE, Reason.TASK_DEMAND, message="kept for tasks that wait for its capacity")
    return decision


# -- what the policy pass gathers ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class WorkerSeen:
    """One worker as the policy pass read it for :func:`decide`: its pod, its Dask address, the
    container whose memory is resized (the pod's first: the worker's), and the decision's inputs."""

    pod: str
    address: str
    container: str
    inputs: Inputs


def worker_memory(info: snapshots.WorkerInfo) -> WorkerMemory:
    """Dask's view of a worker, from the scheduler's snapshot (Dask's default fractions)."""
    return WorkerMemory(
        process=info.process_bytes,
        managed=info.managed_bytes,
        unmanaged=info.unmanaged_bytes,
        spilled=info.spilled_bytes,
        limit=info.memory_limit,
    )


def peers_room(workers: Sequence[snapshots.WorkerInfo], address: str, ceiling: float | None) -> int:
    """Bytes that relief could place on the other running workers: what each can take before it
    passes relief's ``relieveAbove`` (``ceiling``, a share of its limit). Without relief
    (``ceiling`` None) nothing moves the keys: 0."""
    if ceiling is None:
        return 0
    return sum(
        max(0, math.floor(ceiling * w.memory_limit) - w.process_bytes)
        for w in workers
        if w.address != address and w.status == "running" and w.memory_limit > 0
    )


def template_memory(template: Mapping[str, Any] | None) -> tuple[int | None, int | None]:
    """The worker container's memory limit and request in the workload's pod template (its first
    container, as in the pods), in bytes: a decrease goes no lower."""
    containers = (template or {}).get("containers") or ()
    resources = (containers[0].get("resources") or {}) if containers else {}
    return (
        from_quantity((resources.get("limits") or {}).get("memory")),
        from_quantity((resources.get("requests") or {}).get("memory")),
    )


def seconds_since(annotation: str | None, now: float) -> float | None:
    """Since the time in the pod's :data:`memops.decisions.objects.RESIZED_ANNOTATION` (None: never,
    or unreadable)."""
    try:
        return max(0.0, now - float(annotation)) if annotation else None
    except ValueError:
        return None


def is_pressed(seen: WorkerSeen, settings: ResizeSettings) -> bool:
    """Whether the worker is over ``growAbove``: only then does the pass read its node's room."""
    return used_bytes(seen.inputs) >= settings.grow_above * seen.inputs.worker.limit
