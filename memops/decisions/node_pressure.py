"""The kubelet's next memory evictions, predicted from what it decides them by.

Under node memory pressure the kubelet evicts pods itself, by its own ranking, and a hard
threshold gives them 1 s (a preStop hook gets about that, then the container is stopped): the
safety net's drain cannot happen in it. memops therefore reads the same inputs the kubelet's
eviction manager reads (the kubelet's summary statistics, its ``evictionHard`` thresholds, the
pods' requests and priorities) and predicts which pods the kubelet will evict once a threshold is
crossed. A worker of the policy among them is drained before that, while it still can be.

The kubelet watches two memory signals (``pkg/kubelet/eviction``), each as available bytes
against a capacity of available plus working set:

- ``memory.available``: the node's (its root cgroup's: capacity ``MemTotal``);
- ``allocatableMemory.available``: the pods' cgroup's, whose limit is the capacity less what is
  reserved for the system; watched when ``enforceNodeAllocatable`` holds ``pods`` (the default),
  with the same hard threshold as ``memory.available``.

A threshold is a quantity, or a percentage of the signal's capacity. The node is under pressure
when either signal's available memory is below its threshold; the kubelet looks every 10 s.

Its ranking (``rankMemoryPressure``): first the pods whose usage (the pod cgroup's working set)
exceeds their memory request, then lower priority first, then the larger usage above the
request first; a critical pod is passed by. It evicts one pod per look, then looks again. This
module walks that order until the evictions would bring the node back over its threshold plus
``margin``, and names the pods of that walk. Pure: no I/O.

Where the operator may not list the pods of other namespaces (a namespaced install), the summary
still shows their usage, but not their requests or priorities: the kubelet's order is then known
only in part. Such a pod is ranked as if it used all its memory above its request (it may: a
tenant can request little and use much), after the listed pods over their requests and before
those within them. A worker of the policy is thus ranked ahead of another tenant's pod only by its
own figures (over its request: the kubelet's first key), never by the names, and another tenant
that brings a node near its threshold by using more than it requests has its own eviction
counted first, not the policy's workers drained.
"""

from __future__ import annotations

import dataclasses
import decimal
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

from memops import specs
from memops.decisions import counts, eviction_gate, objects, timestamps
from memops.specs.common import parse_quantity

EVENT_REASON = "NodePressureDrain"
MEMORY_AVAILABLE = "memory.available"
ALLOCATABLE_AVAILABLE = "allocatableMemory.available"
DEFAULT_THRESHOLD = "100Mi"  # the kubelet's default evictionHard memory.available on Linux


@dataclasses.dataclass(frozen=True)
class PodUsage:
    """One pod on the node, as the kubelet ranks it."""

    namespace: str
    name: str
    usage: int  # bytes: its containers' working set
    request: int  # bytes: its memory request
    priority: int = 0
    listed: bool = True  # False: of a namespace the operator may not list; request and priority unknown


@dataclasses.dataclass(frozen=True)
class Signal:
    """One of the kubelet's memory signals on one node."""

    name: str
    available: int  # bytes
    threshold: int  # bytes: the kubelet evicts at or below it

    @property
    def headroom(self) -> int:
        """Bytes the node may still take before the kubelet evicts (negative: past it)."""
        return self.available - self.threshold


@dataclasses.dataclass(frozen=True)
class NodeMemory:
    """A node's memory as its kubelet judges it."""

    node: str
    signals: tuple[Signal, ...]
    pods: tuple[PodUsage, ...]
    pressure: bool = False  # the Node's MemoryPressure condition is True

    @property
    def tightest(self) -> Signal | None:
        return min(self.signals, key=lambda s: s.headroom, default=None)

    @property
    def unlisted(self) -> int:
        """The pods ranked from the summary alone (see the module's docstring)."""
        return sum(not p.listed for p in self.pods)


@dataclasses.dataclass(frozen=True)
class Prediction:
    """What the kubelet would evict from one node, and this policy's share of it."""

    node: str
    headroom: int  # bytes, of the tightest signal
    signal: str
    victims: tuple[PodUsage, ...]  # in the kubelet's order
    ours: tuple[str, ...]  # the policy's workers among them, in the same order


def threshold_bytes(value: str, capacity: int) -> int:
    """An ``evictionHard`` value in bytes: a quantity, or a percentage of ``capacity``."""
    text = value.strip()
    if text.endswith("%"):
        share = decimal.Decimal(text[:-1])
        if not 0 <= share <= 100:
            raise ValueError(f"{value!r}: a percentage between 0 and 100")
        return int(capacity * share / 100)
    return parse_quantity(text)


CRITICAL_PRIORITY = 2_000_000_000
"""The kubelet never evicts a pod of this priority or above (system-cluster-critical and
system-node-critical): it ranks it and passes it by."""


def _rank(pod: PodUsage) -> tuple[int, int, int, str, str]:
    if not pod.listed:
        # Between the two halves of the kubelet's first key: a worker over its request may be
        # evicted before such a pod (it is then drained in time), one within its request is
        # not ranked ahead of a pod that may be far over its own.
        return 1, 0, -pod.usage, pod.namespace, pod.name
    over = pod.usage > pod.request
    return 0 if over else 2, pod.priority, -(pod.usage - pod.request), pod.namespace, pod.name


def ranked(pods: Iterable[PodUsage]) -> list[PodUsage]:
    """``pods`` in the kubelet's order of eviction under memory pressure, without those it never
    evicts; the pods not listed where the module's docstring says. The names only order pods
    whose figures are equal."""
    return sorted((p for p in pods if p.priority < CRITICAL_PRIORITY), key=_rank)


def predict(node: NodeMemory, margin: int, ours: Mapping[tuple[str, str], str]) -> Prediction | None:
    """The pods the kubelet would evict from ``node`` before its tightest signal is back above its
    threshold plus ``margin``; None when the node has that much headroom already and is not
    under pressure. ``ours``: (namespace, pod) -> the name to report, for this policy's workers.

    Each eviction frees the victim's usage (its working set leaves both signals)."""
    signal = node.tightest
    if signal is None:
        return None
    if signal.headroom > margin and not node.pressure:
        return None
    need = margin - signal.headroom
    victims: list[PodUsage] = []
    freed = 0
    for pod in ranked(node.pods):
        if freed > need and victims:
            break
        victims.append(pod)
        freed += max(pod.usage, 0)
    mine = tuple(ours[(p.namespace, p.name)] for p in victims if (p.namespace, p.name) in ours)
    return Prediction(node=node.node, headroom=signal.headroom, signal=signal.name, victims=tuple(victims), ours=mine)


# -- reading the kubelet's answers --------------------------------------------------------------


def pod_request(pod: Mapping[str, Any]) -> int:
    """A pod's memory request as the kubelet counts it: its containers' sum, or its largest init
    container's if larger, plus its overhead when that is not nothing."""
    spec = pod.get("spec") or {}

    def request(container: Any) -> int:
        if not isinstance(container, Mapping):
            return 0
        value = ((container.get("resources") or {}).get("requests") or {}).get("memory")
        try:
            return parse_quantity(str(value)) if value is not None else 0
        except ValueError:
            return 0

    containers = sum(request(c) for c in spec.get("containers") or [])
    inits = max((request(c) for c in spec.get("initContainers") or []), default=0)
    overhead = (spec.get("overhead") or {}).get("memory")
    try:
        extra = parse_quantity(str(overhead)) if overhead is not None else 0
    except ValueError:
        extra = 0
    total = max(containers, inits)
    return total + extra if total else 0


def pressure_condition(node: Mapping[str, Any]) -> bool:
    conditions = (node.get("status") or {}).get("conditions") or []
    return any(
        isinstance(c, Mapping) and c.get("type") == "MemoryPressure" and c.get("status") == "True" for c in conditions
    )


def _map(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _signal(name: str, memory: Mapping[str, Any], hard: str) -> Signal | None:
    """A signal from a summary's memory figures (capacity: available plus working set); None when
    they or the threshold are missing or malformed."""
    available, working = counts.plain(memory.get("availableBytes")), counts.plain(memory.get("workingSetBytes"))
    if available is None or working is None:
        return None
    try:
        return Signal(name, available, threshold_bytes(hard, available + working))
    except (ValueError, decimal.InvalidOperation):
        return None


def _pod_usage(stats: Any) -> int:
    """A summary's pod entry: its working set, as the kubelet's ranking counts it: the pod's own
    cgroup's, else its containers' summed."""
    pod_level = counts.plain(_map(_map(stats).get("memory")).get("workingSetBytes"))
    if pod_level is not None:
        return pod_level
    containers = _map(stats).get("containers")
    return sum(
        counts.plain(_map(_map(c).get("memory")).get("workingSetBytes")) or 0
        for c in (containers if isinstance(containers, list) else [])
    )


def node_memory(
    node: Mapping[str, Any],
    summary: Mapping[str, Any],
    config: Mapping[str, Any],
    pods: Sequence[Mapping[str, Any]],
    listed: Collection[str] | None = None,
) -> NodeMemory:
    """The kubelet's view of a node from its Node object, its summary statistics
    (``/stats/summary``), its configuration (``/configz``'s ``kubeletconfig``) and the pods bound
    to it. What is missing or malformed in the kubelet's answers leaves a signal or a pod out.

    ``listed``: the namespaces whose pods on the node ``pods`` holds in full; None: every
    namespace's. A pod of the summary in another namespace is ranked by its usage alone (the
    module's docstring); one of a listed namespace that ``pods`` does not hold is gone."""
    name = str(_map(node.get("metadata")).get("name", ""))
    hard = str(_map(config.get("evictionHard")).get(MEMORY_AVAILABLE, DEFAULT_THRESHOLD))
    node_stats = _map(summary.get("node"))
    signals = [_signal(MEMORY_AVAILABLE, _map(node_stats.get("memory")), hard)]
    enforced = config.get("enforceNodeAllocatable", ["pods"])
    containers = node_stats.get("systemContainers")
    if isinstance(enforced, list) and "pods" in enforced and isinstance(containers, list):
        # The pods' cgroup: its limit is the node's capacity less what is reserved for the
        # system (not less the eviction threshold), and the summary's available is that less
        # its working set.
        pods_memory = next((_map(_map(c).get("memory")) for c in containers if _map(c).get("name") == "pods"), {})
        signals.append(_signal(ALLOCATABLE_AVAILABLE, pods_memory, hard))
    usage: dict[tuple[str, str], int] = {}
    entries = summary.get("pods")
    for stats in entries if isinstance(entries, list) else []:
        ref = _map(_map(stats).get("podRef"))
        if not ref:
            continue
        total = _pod_usage(stats)
        usage[(str(ref.get("namespace", "")), str(ref.get("name", "")))] = total
    seen = _listed_usage(pods, usage)
    if listed is not None:
        seen += [
            PodUsage(namespace=ns, name=pod, usage=bytes_, request=0, listed=False)
            for (ns, pod), bytes_ in usage.items()
            if ns not in listed
        ]
    return NodeMemory(
        node=name,
        signals=tuple(s for s in signals if s is not None),
        pods=tuple(seen),
        pressure=pressure_condition(node),
    )


def _listed_usage(pods: Sequence[Mapping[str, Any]], usage: Mapping[tuple[str, str], int]) -> list[PodUsage]:
    seen = []
    for pod in pods:
        meta = _map(pod.get("metadata"))
        key = (str(meta.get("namespace", "")), str(meta.get("name", "")))
        if key not in usage or _map(pod.get("status")).get("phase") not in ("Running", "Pending"):
            continue
        priority = _map(pod.get("spec")).get("priority")
        seen.append(
            PodUsage(
                namespace=key[0],
                name=key[1],
                usage=usage[key],
                request=pod_request(pod),
                priority=priority if isinstance(priority, int) and not isinstance(priority, bool) else 0,
            )
        )
    return seen


# -- what the policy does about it ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Seen:
    """What a pass read for ``spec.eviction.nodePressure``."""

    predictions: tuple[Prediction, ...]
    message: str = ""  # what could not be read
    unique: Mapping[str, int] = dataclasses.field(default_factory=dict)  # pod -> bytes held alone, once asked
    room: Mapping[str, int] = dataclasses.field(default_factory=dict)  # node -> bytes it may take within the margin
    unlisted: Mapping[str, int] = dataclasses.field(default_factory=dict)  # node -> pods ranked by usage alone


def to_drain(
    predictions: Iterable[Prediction],
    unique: Mapping[str, int],
    draining: Collection[str],
    room: Mapping[str, int],
) -> tuple[dict[str, tuple[str, ...]], dict[str, str]]:
    """Node -> the policy's predicted victims there to drain now, and pod -> why others are not.

    A victim is drained when it holds data existing nowhere else (``unique``: pod -> bytes; a pod
    the scheduler did not report is left alone), is not in a drain already, and the other nodes
    read (``room``: node -> bytes each may take before it is within the margin itself) have room
    for its data. A drain sends its keys off its node first; where the others have no room, the
    keys would land on them and push them into the margin in turn, to be drained back: the
    victim is then reported instead (more workers, on more nodes, are the way out). The most
    urgent node first; each drain takes its bytes from the others' room, the roomiest first."""
    left = {node: max(bytes_, 0) for node, bytes_ in room.items()}
    chosen: dict[str, tuple[str, ...]] = {}
    refused: dict[str, str] = {}
    for prediction in sorted(predictions, key=lambda p: p.headroom):
        pods = []
        for pod in prediction.ours:
            held = unique.get(pod, 0)
            if held <= 0 or pod in draining:
                continue
            others = sorted((n for n in left if n != prediction.node), key=lambda n: -left[n])
            if sum(left[n] for n in others) < held:
                refused[pod] = (
                    f"node {prediction.node}: {pod} holds {held // 2**20} MiB alone, more than the other Nodes of"
                    " the workers have room for within the margin"
                )
                continue
            pods.append(pod)
            for node in others:
                taken = min(left[node], held)
                left[node] -= taken
                held -= taken
        if pods:
            chosen[prediction.node] = tuple(pods)
    return chosen, refused


@dataclasses.dataclass(frozen=True)
class Plan:
    requests: tuple[objects.Obj, ...] = ()  # the Eviction RetirementRequests to create
    drained: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)  # node -> pods
    refused: tuple[str, ...] = ()  # victims left where they are, and why
    held: Mapping[str, str] = dataclasses.field(default_factory=dict)  # the same, by pod (status.heldBack)


def status(old: specs.NodePressureStatus | None, seen: Seen, planned: Plan, now: str) -> specs.NodePressureStatus:
    """``status.nodePressure`` after a read: the nodes within the margin, and the drains counted."""
    drained = planned.drained
    nodes = [
        specs.NodePressureNode(
            node=p.node,
            signal=p.signal,
            workers=list(dict.fromkeys(p.ours)),
            drained=list(drained.get(p.node, ())),
            partialRanking=seen.unlisted.get(p.node, 0) > 0,
        )
        for p in sorted(seen.predictions, key=lambda p: p.node)
    ]
    total = (old.drains if old is not None else 0) + sum(len(pods) for pods in drained.values())
    message = "; ".join(filter(None, [seen.message, partial(seen.unlisted), *planned.refused]))
    return specs.NodePressureStatus(nodes=nodes, drains=total, lastRead=now, message=message[:1024])


def partial(unlisted: Mapping[str, int], shown: int = 5) -> str:
    """Where the kubelet's ranking is known only in part, in words; "" where it is known in full."""
    nodes = sorted(node for node, count in unlisted.items() if count > 0)
    if not nodes:
        return ""
    # Not how many: the pods of other namespaces on a Node are not the tenant's to count.
    more = f" and {len(nodes) - shown} more" if len(nodes) > shown else ""
    return (
        f"nodes {', '.join(nodes[:shown])}{more}: the pods of other namespaces could not be listed (ranked by"
        " their usage alone, as over their requests: only a worker over its own request ranks ahead of them)"
    )


COOLING_SECONDS = 60.0
"""A Node whose workers the policy drained this recently takes no drained keys: the kubelet's
statistics are up to 10 s old, and keys sent back to a Node that was just relieved (while its
load goes on) would put it back into the margin."""


def cooling(requests: Sequence[Mapping[str, Any]], nodes: Iterable[str], now: float) -> set[str]:
    """The ``nodes`` with an Eviction request of the policy made in the last :data:`COOLING_SECONDS`
    (``now``: Unix seconds), read from the requests themselves: a restart forgets nothing."""
    found = set()
    for node in nodes:
        for request in eviction_gate.node_requests(requests, node):
            made = (request.get("metadata") or {}).get("creationTimestamp")
            try:
                age = now - timestamps.parse(str(made)).timestamp()
            except (TypeError, ValueError):
                continue
            if age < COOLING_SECONDS:
                found.add(node)
    return found


def plan(
    owner: objects.Owner,
    spec: specs.MemoryPolicySpec,
    seen: Seen,
    requests: Sequence[Mapping[str, Any]],
    now: float,
) -> Plan:
    """The Eviction RetirementRequests that drain the predicted victims now, one per node
    (:func:`to_drain`). A pod named by an unfinished request of the policy is left to it; a Node
    drained in the last minute (:func:`cooling`) has no room for other Nodes' keys."""
    draining = {
        str(w)
        for r in requests
        if (r.get("status") or {}).get("phase") not in (specs.Phase.SUCCEEDED.value, specs.Phase.FAILED.value)
        for w in (r.get("spec") or {}).get("workers") or []
    }
    cool = cooling(requests, seen.room, now)
    room = {node: 0 if node in cool else bytes_ for node, bytes_ in seen.room.items()}
    chosen, refused = to_drain(seen.predictions, seen.unique, draining, room)
    bodies = []
    for node, pods in chosen.items():
        headroom = next(p.headroom for p in seen.predictions if p.node == node)
        why = (
            f"node {node}: {headroom // 2**20} MiB above the kubelet's memory eviction threshold, within"
            f" spec.eviction.nodePressure.margin; the kubelet would evict {', '.join(pods)}"
        )
        earlier = len(eviction_gate.node_requests(requests, node))
        bodies.append(eviction_gate.drain_request(owner, spec, node=node, pods=pods, earlier=earlier, why=why))
    return Plan(requests=tuple(bodies), drained=chosen, refused=tuple(refused.values()), held=refused)
