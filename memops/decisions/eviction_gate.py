"""The eviction gate's decisions, and the node signals that start a drain before the eviction.

Pure: :mod:`memops.controllers.eviction_webhook` gathers the inputs (the pod, the policy, what the
scheduler says the pod's workers hold alone, the pod's Eviction RetirementRequest) and acts on
the :class:`Decision`.

How a node drain goes with memops (docs/resources.md, "Node drains and evictions"):

1. An evicting client (``kubectl drain``, cluster-autoscaler, Karpenter) POSTs
   ``pods/<name>/eviction``. The API server calls memops' validating webhook on that subresource.
2. A worker holding data that exists nowhere else is refused with **429 TooManyRequests**, the
   code of a PodDisruptionBudget refusal, which those clients retry; memops at once creates one
   RetirementRequest (``removePods: false``, label ``memops.dev/reason: eviction``) for every
   worker of the policy on that node, so a node's workers drain together.
3. The request drains and does not scale the workload down: the evicting client removes the pod
   and the ReplicaSet starts its replacement elsewhere. A drained worker has left the scheduler,
   so it holds nothing: the next attempt is admitted.
4. A drain that cannot finish ends at the policy's ``drain.timeout`` in its ``onTimeout``:
   Force admits the eviction (the request records the bytes lost); Abort keeps refusing, and
   says so on the pod (an event) and in the request (its Failed condition).

What a review says is a claim. Where the webhook verifies its caller's client certificate
(``memops run --webhook-client-ca-file``) only the API server can make one; where it cannot,
anyone who reaches the webhook's port can. So the gate's side effect, a drain, is bounded as
if every review were forged: the claim is confirmed against the API (:func:`confirm_claim`),
at most one drain per node and policy runs at a time and at most
:data:`GATE_DRAINS_PER_WINDOW` start per policy per :data:`GATE_WINDOW_SECONDS`
(:func:`guard_drain`), and each records who asked (:data:`REQUESTED_BY_ANNOTATION`). The
gate decides and starts drains of one policy one at a time, counting the requests it made that
its watch has not shown yet (:func:`unseen_requests`), so that a burst of concurrent reviews is
held to the same bounds as reviews one after the other.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import hashlib
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

from memops import specs
from memops.decisions import objects, timestamps

REASON_LABEL = "memops.dev/reason"
"""On a RetirementRequest: why it exists. ``eviction`` for the gate's and the node signals' drains."""
EVICTION = "eviction"
NODE_LABEL = "memops.dev/node"
"""On an Eviction RetirementRequest: the node whose workers it drains (a digest if over 63 characters)."""
REQUESTED_BY_ANNOTATION = "memops.dev/requested-by"
"""On an Eviction RetirementRequest that the gate made: the user of the eviction (the review's
``userInfo.username``: authenticated by the API server, or merely claimed where the webhook does
not verify its caller)."""
TOO_MANY_REQUESTS = 429
"""What the Eviction API answers for a PodDisruptionBudget refusal, and what evicting clients retry."""
CORDON_TAINT = "node.kubernetes.io/unschedulable"


class Verdict(enum.StrEnum):
    ALLOW = "Allow"
    REFUSE = "Refuse"


@dataclasses.dataclass(frozen=True)
class RequestView:
    """What the gate reads of the pod's latest Eviction RetirementRequest."""

    name: str
    phase: specs.Phase
    state: specs.WorkerState | None = None  # this pod's entry, once the drain has started
    deadline: str = ""
    bytes_lost: int = 0
    message: str = ""
    on_timeout: specs.OnTimeout = specs.OnTimeout.ABORT
    completed: datetime.datetime | None = None  # its status.completionTime (None: absent or unreadable)

    @property
    def finished(self) -> bool:
        return self.phase in (specs.Phase.SUCCEEDED, specs.Phase.FAILED)


@dataclasses.dataclass(frozen=True)
class Decision:
    verdict: Verdict
    message: str
    start_drain: bool = False  # create the node's Eviction RetirementRequest (idempotent by name)
    warning: bool = False  # post a Warning event on the pod: the eviction is refused for good
    code: int = TOO_MANY_REQUESTS
    episode: str = ""  # the refusal's episode (its RetirementRequest): one Warning event for each

    @property
    def allowed(self) -> bool:
        return self.verdict == Verdict.ALLOW


def dry_run(eviction: Mapping[str, Any], admission_dry_run: bool) -> bool:
    """Whether an eviction is a dry run (``kubectl drain --dry-run=server``).

    The AdmissionReview's ``dryRun`` reflects only the request's own ``?dryRun=All``; kubectl
    and client-go put it in the Eviction's ``deleteOptions.dryRun`` instead, which the API server
    reconciles with the query only after admission (``propagateDryRun`` in kubernetes
    ``pkg/registry/core/pod/storage/eviction.go``). So both count.
    """
    options = eviction.get("deleteOptions")
    flags = options.get("dryRun") if isinstance(options, Mapping) else None
    return admission_dry_run or (isinstance(flags, list) and "All" in flags)


def decide(
    *,
    pod: str,
    unique_bytes: int | None,
    request: RequestView | None,
    dry_run: bool = False,
    now: datetime.datetime | None = None,
) -> Decision:
    """Admit or refuse one eviction of a policy's worker pod.

    ``unique_bytes``: what the pod's workers hold that no other worker holds, by the scheduler;
    0 also when no worker of the pod is connected (a drained worker has left the scheduler);
    None when the scheduler could not be asked in time. ``request``: the pod's latest Eviction
    RetirementRequest, if any. A refusal always says why and what happens next. ``dry_run``:
    answer as for a real eviction, but start nothing. ``now``: with it, a drain that kept the
    pod's data for want of room is tried again :data:`KEPT_RETRY_SECONDS` after it ended.
    """
    if request is not None and not request.finished:
        if unique_bytes == 0:
            return Decision(Verdict.ALLOW, f"{pod} holds no unique data now (RetirementRequest {request.name})")
        left = "unknown: the scheduler did not answer" if unique_bytes is None else f"{unique_bytes} bytes"
        return Decision(
            Verdict.REFUSE,
            f"memops is draining pod {pod} (RetirementRequest {request.name}, until {request.deadline or 'its'}"
            f" deadline); unique data left: {left}; retry the eviction",
        )
    if request is not None and request.state == specs.WorkerState.FORCED:
        return Decision(
            Verdict.ALLOW,
            f"drain of {pod} timed out and the policy's drain.onTimeout is Force: evicted with"
            f" {request.bytes_lost} bytes lost (RetirementRequest {request.name})",
        )
    if request is not None and request.state == specs.WorkerState.KEPT and unique_bytes != 0:
        if unique_bytes is not None and _retry_due(request, now):
            return _drain_again(pod, request, dry_run)
        return Decision(
            Verdict.REFUSE,
            f"pod {pod} still holds data that exists nowhere else and its drain ended without moving it"
            f" (RetirementRequest {request.name}: {request.message}); the policy's drain.onTimeout is Abort,"
            f" so memops keeps refusing, and drains it again {KEPT_RETRY_SECONDS:.0f} s after that drain ended:"
            " make room for the data, or set drain.onTimeout: Force",
            warning=True,
            episode=request.name,
        )
    if unique_bytes == 0:
        return Decision(Verdict.ALLOW, f"{pod} holds no data that exists nowhere else")
    if request is not None and request.phase == specs.Phase.FAILED and request.state is None:
        # The drain never started (the scheduler unreachable or refused until the deadline):
        # nothing confirms what the pod holds, and the request's onTimeout decides.
        if request.on_timeout == specs.OnTimeout.FORCE:
            return Decision(
                Verdict.ALLOW,
                f"the drain of {pod} could not start before its deadline (RetirementRequest {request.name}:"
                f" {request.message}); drain.onTimeout is Force: evicted, whatever it held is lost",
            )
        return Decision(
            Verdict.REFUSE,
            f"the drain of {pod} could not start before its deadline (RetirementRequest {request.name}:"
            f" {request.message}); the policy's drain.onTimeout is Abort, so memops keeps refusing: make the"
            " scheduler reachable and delete that request to try again, or set drain.onTimeout: Force",
            warning=True,
            episode=request.name,
        )
    if unique_bytes is None and request is not None and request.state == specs.WorkerState.RETIRED:
        return Decision(Verdict.ALLOW, f"{pod} was drained (RetirementRequest {request.name})")
    why = (
        "the scheduler could not be asked what it holds, so memops drains it first (its drain decides by"
        " the policy's drain.timeout)"
        if unique_bytes is None
        else f"it holds {unique_bytes} bytes that exist nowhere else"
    )
    if dry_run:
        return Decision(Verdict.REFUSE, f"pod {pod}: {why}; a real eviction would start draining it (dry run)")
    return Decision(
        Verdict.REFUSE, f"pod {pod}: {why}; memops started draining it: retry the eviction", start_drain=True
    )


def confirm_claim(eviction: Mapping[str, Any], pod: Mapping[str, Any] | None) -> str | None:
    """Why the API does not bear out what an eviction's review claims, or None when it does.

    ``eviction``: the review's object (an Eviction); ``pod``: the pod of that name read from the
    API in the Eviction's namespace (None: there is none). A review must name its namespace (no
    default to fall back on: "default" is somebody's namespace too), its pod must exist there
    with the uid that the Eviction's preconditions name, if any, and run on a node, not be
    going already. Anything else starts nothing: the API server, which decides the eviction
    itself, refuses one of a pod that does not exist, and a pod being deleted is drained by
    its preStop hook.
    """
    meta = eviction.get("metadata") or {}
    namespace, name = str(meta.get("namespace") or ""), str(meta.get("name") or "")
    if not namespace or not name:
        return "the review names no pod and namespace"
    if pod is None:
        return f"no pod {name} in namespace {namespace}"
    pod_meta, pod_spec = pod.get("metadata") or {}, pod.get("spec") or {}
    if (pod_meta.get("namespace"), pod_meta.get("name")) != (namespace, name):
        return f"the pod read is {pod_meta.get('namespace')}/{pod_meta.get('name')}, not {namespace}/{name}"
    options = eviction.get("deleteOptions")
    preconditions = options.get("preconditions") if isinstance(options, Mapping) else None
    uid = preconditions.get("uid") if isinstance(preconditions, Mapping) else None
    if uid and uid != pod_meta.get("uid"):
        return f"pod {namespace}/{name} has uid {pod_meta.get('uid')}, not {uid}"
    if pod_meta.get("deletionTimestamp"):
        return f"pod {namespace}/{name} is being deleted already"
    if not pod_spec.get("nodeName") or (pod.get("status") or {}).get("phase") != "Running":
        return f"pod {namespace}/{name} is not running on a node"
    return None


GATE_DRAINS_PER_WINDOW = 10
"""At most this many drains start from evictions per policy in :data:`GATE_WINDOW_SECONDS`.

A drain is one node's workers of the policy, and real evicting clients drain few nodes at a
time: ``kubectl drain`` one, cluster-autoscaler one non-empty node at a time
(``--max-drain-parallelism`` 1), Karpenter 10% of the nodes by its default disruption budget.
A node's drain takes a minute or more (the data moves, then the pods go), so 10 in 10 minutes
covers a policy on 10 nodes drained at once, or a drain a minute for as long as it lasts. A
flood of forged reviews is held to the same: at most 10 drains of a policy's workers in 10
minutes (the scheduler's data moves, the workers restart), instead of one per review. An
eviction past the bound is refused with 429 (its data is kept; the client retries)."""
GATE_WINDOW_SECONDS = 600.0


def in_flight(requests: Iterable[Mapping[str, Any]]) -> str | None:
    """The name of an unfinished request among ``requests`` (a node's Eviction requests of one
    policy), or None."""
    for request in requests:
        if (request.get("status") or {}).get("phase") not in (specs.Phase.SUCCEEDED.value, specs.Phase.FAILED.value):
            return str(request["metadata"]["name"])
    return None


def gate_drains_since(
    requests: Iterable[Mapping[str, Any]], now: datetime.datetime, window: float = GATE_WINDOW_SECONDS
) -> int:
    """How many of a policy's ``requests`` the gate made (labelled for an eviction, annotated with
    who asked) in the ``window`` seconds before ``now``. The requests' creation times are the
    record: it holds across operator restarts and replicas."""
    count = 0
    for request in requests:
        meta = request.get("metadata") or {}
        if (meta.get("labels") or {}).get(REASON_LABEL) != EVICTION:
            continue
        if REQUESTED_BY_ANNOTATION not in (meta.get("annotations") or {}):
            continue  # a node signal's: its Node said so, not a review
        created = meta.get("creationTimestamp")
        if not created:
            count += 1  # just made, not read back yet: it counts
            continue
        moment = timestamps.parse_or_none(created)
        if moment is None or (now - moment).total_seconds() < window:
            count += 1
    return count


def unseen_requests(
    created: Iterable[Mapping[str, Any]],
    indexed: Iterable[Mapping[str, Any]],
    now: datetime.datetime,
    window: float = GATE_WINDOW_SECONDS,
) -> list[Mapping[str, Any]]:
    """Of the requests that this process ``created`` (the API's replies), those that the watched
    ``indexed`` ones do not show yet and that are younger than ``window``.

    The index learns of a request only when its watch event comes, a moment after the POST
    returns; eviction reviews are answered concurrently, so a burst of them would each see the
    same index and each start a drain. Counted with the index, these keep :func:`guard_drain`'s
    bounds whole. Once the index shows a request it is the record (its status, or its deletion),
    so it is dropped from here."""
    shown = {str((r.get("metadata") or {}).get("name")) for r in indexed}
    unseen = []
    for request in created:
        meta = request.get("metadata") or {}
        if str(meta.get("name")) in shown:
            continue
        moment = timestamps.parse_or_none(meta.get("creationTimestamp"))
        age = 0.0 if moment is None else (now - moment).total_seconds()  # no time of the API's: just made
        if age < window:
            unseen.append(request)
    return unseen


def guard_drain(
    decision: Decision,
    *,
    pod: str,
    node: str,
    running: str | None,
    started: int,
    limit: int = GATE_DRAINS_PER_WINDOW,
    window: float = GATE_WINDOW_SECONDS,
) -> Decision:
    """``decision`` as it may be acted on: a drain starts only if none of the node's runs for the
    policy (``running``: its name) and fewer than ``limit`` started in the ``window`` (``started``,
    by :func:`gate_drains_since`). Held back, the eviction is still refused (429, retried by the
    client), and the refusal says why; its data stays where it is."""
    if not decision.start_drain:
        return decision
    if running is not None:
        return Decision(
            Verdict.REFUSE,
            f"memops is draining node {node}'s workers (RetirementRequest {running}); pod {pod} drains after"
            " it (one drain per node at a time): retry the eviction",
        )
    if started >= limit:
        return Decision(
            Verdict.REFUSE,
            f"pod {pod} holds data that exists nowhere else, and {started} drains started for evictions of"
            f" this policy's workers in the last {window / 60:g} minutes, the most memops starts: retry the"
            " eviction later",
        )
    return decision


def requested_by(userinfo: Mapping[str, Any] | None) -> str:
    """The user of an eviction, by its review (``userInfo.username``), as an annotation value."""
    name = str((userinfo or {}).get("username") or "") or "unknown"
    return name[:253]


def drain_event_name(pod: str, request: str) -> str:
    """The name of the pod's ``EvictionDrainStarted`` event for one drain (one per request)."""
    digest = hashlib.sha256(f"{pod}\n{request}".encode()).hexdigest()[:16]
    return f"{pod[:200]}.memops-drain-{digest}"


def node_signal(node: Mapping[str, Any], signals: specs.NodeSignals) -> str | None:
    """The taint or label of ``node`` that announces its end, by ``signals``; None if none does.

    A cordoned node (``spec.unschedulable``) counts as its taint: the node lifecycle controller
    adds the taint, but a moment later.
    """
    spec = node.get("spec") or {}
    taints = {str(t.get("key", "")) for t in spec.get("taints") or [] if isinstance(t, Mapping)}
    if spec.get("unschedulable"):
        taints.add(CORDON_TAINT)
    for key in signals.taints:
        if key in taints:
            return f"taint {key}"
    labels = (node.get("metadata") or {}).get("labels") or {}
    for key in signals.labels:
        if key in labels:
            return f"label {key}"
    return None


REFUSED_EVENT = "EvictionRefused"
DRAIN_STARTED_EVENT = "EvictionDrainStarted"


def refusal_event_name(pod: str, episode: str) -> str:
    """The name of the pod's ``EvictionRefused`` event for one refusal episode.

    ``kubectl drain`` retries every 5 s, cluster-autoscaler and Karpenter as often: an event per
    attempt would flood the namespace. The same pod and episode give the same name, so the
    event is created once (a second create is a 409), across attempts and operator restarts;
    a new episode (a new RetirementRequest) gets a new event.
    """
    digest = hashlib.sha256(f"{pod}\n{episode}".encode()).hexdigest()[:16]
    return f"{pod[:200]}.memops-refused-{digest}"


NODE_SIGNAL_SECONDS = 30.0
"""A node's signal is acted on at most this often per policy (unless the signal changes): a Node
is updated often (conditions, images, leases of older kubelets), and each action lists the
workload's pods. The drain itself is idempotent by name; this bounds the requests."""


def node_signal_due(
    seen: Mapping[str, tuple[str, float]],
    policy: str,
    signal: str,
    now: float,
    interval: float = NODE_SIGNAL_SECONDS,
) -> bool:
    """Whether a Node event's ``signal`` should be acted on for ``policy`` (its namespace/name),
    given what was acted on last (``seen``: policy -> (signal, monotonic time)): a new or changed
    signal at once, the same one again once ``interval`` has passed."""
    last = seen.get(policy)
    return last is None or last[0] != signal or now - last[1] >= interval


def drains_node(labels: Mapping[str, Any] | None) -> bool:
    """A RetirementRequest that drains a node for its end (the eviction gate's, or the node
    signals'): its workers' node is going, so recipients there are the last resort. Any other
    request retires workers from a node that stays."""
    return (labels or {}).get(REASON_LABEL) == EVICTION


def node_label(node: str) -> str:
    """A label value naming the node: its name, or a digest of a name longer than 63 characters."""
    return node if len(node) <= 63 else "sha256-" + hashlib.sha256(node.encode()).hexdigest()[:40]


def request_name(policy: str, node: str, pods: Iterable[str], earlier: int = 0) -> str:
    """The name of the Eviction RetirementRequest for these pods: the same inputs, the same name,
    so that an eviction retried (or several of one node at once) creates one request. ``earlier``:
    the pods' Eviction requests that already exist, so that a second drain gets a new name."""
    text = "\n".join([policy, node, *sorted(set(pods)), str(earlier)])
    digest = hashlib.sha256(text.encode()).hexdigest()[:10]
    return f"evict-{node[:200].strip('.-')}-{digest}"


def node_requests(requests: Iterable[Mapping[str, Any]], node: str) -> list[Mapping[str, Any]]:
    """A policy's Eviction RetirementRequests for ``node``, among its ``requests``."""
    return [
        r
        for r in requests
        if (r["metadata"].get("labels") or {}).get(REASON_LABEL) == EVICTION
        and (r["metadata"].get("labels") or {}).get(NODE_LABEL) == node_label(node)
    ]


def drain_request(
    owner: objects.Owner,
    spec: specs.MemoryPolicySpec,
    *,
    node: str,
    pods: Iterable[str],
    earlier: int,
    why: str,
    requested_by: str | None = None,
) -> objects.Obj:
    """The node's Eviction RetirementRequest for ``pods``: a drain only (``removePods: false``),
    since whoever evicts them (a node drain, the kubelet) removes the pods. ``why`` goes to its
    ``memops.dev/why`` annotation; ``requested_by``, the user of the eviction that started it (the
    gate's), to :data:`REQUESTED_BY_ANNOTATION`."""
    chosen = tuple(dict.fromkeys(pods))
    annotations = {"memops.dev/why": why[:1024]}
    if requested_by is not None:
        annotations[REQUESTED_BY_ANNOTATION] = requested_by
    body = objects.policy_request(
        owner,
        spec,
        name=request_name(owner.name, node, chosen, earlier),
        workers=chosen,
        labels={REASON_LABEL: EVICTION, NODE_LABEL: node_label(node)},
        annotations=annotations,
    )
    body["spec"]["removePods"] = False
    return body


def latest_request(pod: str, requests: Sequence[Mapping[str, Any]]) -> RequestView | None:
    """The pod's Eviction RetirementRequest that counts: one still running, else the newest."""
    mine = [r for r in requests if pod in ((r.get("spec") or {}).get("workers") or [])]
    if not mine:
        return None
    mine.sort(
        key=lambda r: (
            (r.get("status") or {}).get("phase", "Pending") not in ("Succeeded", "Failed"),
            str(r["metadata"].get("creationTimestamp", "")),
        )
    )
    chosen = mine[-1]
    status = chosen.get("status") or {}
    try:
        phase = specs.Phase(status.get("phase", "Pending"))
    except ValueError:
        phase = specs.Phase.PENDING
    entry = next((w for w in status.get("workers") or [] if w.get("pod") == pod), None)
    state: specs.WorkerState | None = None
    if entry is not None:
        try:
            state = specs.WorkerState(entry.get("state", "Pending"))
        except ValueError:
            state = None
    try:
        on_timeout = specs.OnTimeout((chosen.get("spec") or {}).get("onTimeout", "Abort"))
    except ValueError:
        on_timeout = specs.OnTimeout.ABORT
    return RequestView(
        name=str(chosen["metadata"]["name"]),
        on_timeout=on_timeout,
        phase=phase,
        state=state,
        deadline=str(status.get("deadline", "")),
        bytes_lost=int((entry or {}).get("bytesLost", 0) or 0),
        message=str((entry or {}).get("message", "") or status.get("message", "")),
        completed=timestamps.parse_or_none(status.get("completionTime")),
    )


KEPT_RETRY_SECONDS = 30.0
"""How long after a drain that kept a pod's data (nowhere to put it) an eviction of that pod
starts another: room may have been made since (a new worker, one on another Node, a scale-up),
and the client that evicts retries, as ``kubectl drain`` does every five seconds. Bounded as
every drain the gate starts is (:func:`guard_drain`)."""


def _retry_due(request: RequestView, now: datetime.datetime | None) -> bool:
    if now is None:
        return False
    if request.completed is None:
        return True  # no time to wait from: what the request says is not to be trusted for ever
    return (now - request.completed).total_seconds() >= KEPT_RETRY_SECONDS


def _drain_again(pod: str, request: RequestView, dry_run: bool) -> Decision:
    why = (
        f"pod {pod} holds data that exists nowhere else, and its last drain found nowhere to put it"
        f" (RetirementRequest {request.name}: {request.message})"
    )
    if dry_run:
        return Decision(Verdict.REFUSE, f"{why}; a real eviction would drain it again (dry run)")
    return Decision(Verdict.REFUSE, f"{why}; memops started draining it again: retry the eviction", start_drain=True)


def pods_to_drain(pods: Sequence[Mapping[str, Any]], node: str, busy: Collection[str]) -> list[str]:
    """The workload's pods on ``node`` that a new Eviction request should drain together: running,
    not being deleted, and not in ``busy`` (pods that another Eviction request has)."""
    chosen = []
    for pod in pods:
        meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
        if spec.get("nodeName") != node or meta.get("deletionTimestamp") or status.get("phase") != "Running":
            continue
        if meta["name"] not in busy:
            chosen.append(str(meta["name"]))
    return sorted(chosen)


def mark_drained(workers: Sequence[specs.WorkerStatus]) -> list[specs.WorkerStatus]:
    """``removePods: false``: the drained workers are done; their pods are left to the evicting
    client. A Forced one stays Forced (the gate admits its eviction, with its loss recorded)."""
    result = []
    for w in workers:
        if w.removable and not w.podRemoved and w.state == specs.WorkerState.DRAINING:
            w = w.model_copy(
                update={
                    "state": specs.WorkerState.RETIRED,
                    "removable": False,
                    "message": w.message.replace("; removing its pod", "; its pod is left to the eviction"),
                }
            )
        elif w.removable and not w.podRemoved and w.state == specs.WorkerState.FORCED:
            w = w.model_copy(
                update={
                    "removable": False,
                    "message": w.message.replace("removing the pod", "admitting the pod's eviction"),
                }
            )
        result.append(w)
    return result
