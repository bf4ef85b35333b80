"""The eviction gate's decisions and the node signals (:mod:`memops.decisions.eviction_gate`): pure, no I/O."""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

import pytest

from memops import specs
from memops.decisions import eviction_gate, timestamps

Phase, State = specs.Phase, specs.WorkerState


def view(
    phase: specs.Phase,
    state: specs.WorkerState | None = None,
    lost: int = 0,
    on_timeout: specs.OnTimeout = specs.OnTimeout.ABORT,
) -> eviction_gate.RequestView:
    return eviction_gate.RequestView(
        name="evict-n1-abc", phase=phase, state=state, deadline="T", bytes_lost=lost, on_timeout=on_timeout
    )


@pytest.mark.parametrize(
    ("unique", "request_", "allowed", "start", "warning"),
    [
        pytest.param(0, None, True, False, False, id="nothing-unique-evicted-at-once"),
        pytest.param(1000, None, False, True, False, id="unique-data-refused-and-drain-started"),
        pytest.param(None, None, False, True, False, id="scheduler-unknown-refused-and-drain-started"),
        pytest.param(1000, view(Phase.DRAINING, State.DRAINING), False, False, False, id="draining-refused"),
        pytest.param(None, view(Phase.PENDING), False, False, False, id="pending-scheduler-unknown-refused"),
        pytest.param(0, view(Phase.DRAINING, State.DRAINING), True, False, False, id="drain-moved-all-admitted"),
        pytest.param(0, view(Phase.SUCCEEDED, State.RETIRED), True, False, False, id="drained-admitted"),
        pytest.param(None, view(Phase.SUCCEEDED, State.RETIRED), True, False, False, id="drained-scheduler-gone"),
        pytest.param(5, view(Phase.SUCCEEDED, State.FORCED, 5), True, False, False, id="force-lets-it-through"),
        pytest.param(None, view(Phase.SUCCEEDED, State.FORCED, 5), True, False, False, id="force-scheduler-gone"),
        pytest.param(5, view(Phase.FAILED, State.KEPT), False, False, True, id="abort-keeps-refusing"),
        pytest.param(None, view(Phase.FAILED, State.KEPT), False, False, True, id="abort-scheduler-gone"),
        pytest.param(0, view(Phase.FAILED, State.KEPT), True, False, False, id="abort-but-data-gone-since"),
        pytest.param(7, view(Phase.SUCCEEDED, State.RETIRED), False, True, False, id="data-again-drains-again"),
        pytest.param(None, view(Phase.FAILED), False, False, True, id="never-started-abort-keeps-refusing"),
        pytest.param(
            None, view(Phase.FAILED, on_timeout=specs.OnTimeout.FORCE), True, False, False, id="never-started-force"
        ),
        pytest.param(0, view(Phase.FAILED), True, False, False, id="never-started-but-nothing-unique"),
    ],
)
def test_decide(
    unique: int | None, request_: eviction_gate.RequestView | None, allowed: bool, start: bool, warning: bool
) -> None:
    decision = eviction_gate.decide(pod="w-1", unique_bytes=unique, request=request_)
    assert (decision.allowed, decision.start_drain, decision.warning) == (allowed, start, warning)
    assert decision.code == 429
    # A warning belongs to its refusal episode (the request), which names its one event.
    assert decision.episode == ("evict-n1-abc" if warning else "")
    assert "w-1" in decision.message


def test_refusal_says_why_and_what_next() -> None:
    refused = eviction_gate.decide(pod="w-1", unique_bytes=None, request=None)
    assert "scheduler could not be asked" in refused.message and "retry" in refused.message
    kept = eviction_gate.decide(pod="w-1", unique_bytes=5, request=view(Phase.FAILED, State.KEPT))
    assert "onTimeout is Abort" in kept.message and "onTimeout: Force" in kept.message
    forced = eviction_gate.decide(pod="w-1", unique_bytes=5, request=view(Phase.SUCCEEDED, State.FORCED, 5))
    assert "5 bytes lost" in forced.message


def node(
    taints: tuple[str, ...] | list[str] = (), labels: dict[str, str] | None = None, cordoned: bool = False
) -> dict[str, Any]:
    spec: dict[str, Any] = {"taints": [{"key": k, "effect": "NoSchedule"} for k in taints]}
    if cordoned:
        spec["unschedulable"] = True
    return {"metadata": {"name": "n1", "labels": labels or {}}, "spec": spec}


@pytest.mark.parametrize(
    ("obj", "signals", "expected"),
    [
        pytest.param(node(), specs.NodeSignals(), None, id="plain-node"),
        pytest.param(node(cordoned=True), specs.NodeSignals(), "taint node.kubernetes.io/unschedulable", id="cordon"),
        pytest.param(
            node(["ToBeDeletedByClusterAutoscaler"]),
            specs.NodeSignals(),
            "taint ToBeDeletedByClusterAutoscaler",
            id="cluster-autoscaler",
        ),
        pytest.param(
            node(["karpenter.sh/disrupted"]), specs.NodeSignals(), "taint karpenter.sh/disrupted", id="karpenter"
        ),
        pytest.param(node(["example.com/other"]), specs.NodeSignals(), None, id="unrelated-taint"),
        pytest.param(node(cordoned=True), specs.NodeSignals(taints=[]), None, id="signals-turned-off"),
        pytest.param(
            node(labels={"example.com/terminating": "true"}),
            specs.NodeSignals(labels=["example.com/terminating"]),
            "label example.com/terminating",
            id="label-from-the-list",
        ),
    ],
)
def test_node_signal(obj: dict[str, Any], signals: specs.NodeSignals, expected: str | None) -> None:
    assert eviction_gate.node_signal(obj, signals) == expected


def test_node_signals_refuse_bad_keys() -> None:
    with pytest.raises(ValueError, match="taints"):
        specs.NodeSignals.model_validate({"taints": ["not a key!"]})


def test_request_name_is_an_idempotency_key() -> None:
    one = eviction_gate.request_name("pol", "node-1", ["b", "a"])
    assert one == eviction_gate.request_name("pol", "node-1", ["a", "b", "a"])
    assert one != eviction_gate.request_name("pol", "node-1", ["a"])
    assert one != eviction_gate.request_name("pol", "node-1", ["a", "b"], earlier=1)
    assert one.startswith("evict-node-1-")
    long = eviction_gate.request_name("pol", "n" * 253, ["a"])
    assert len(long) <= 253
    assert len(eviction_gate.node_label("n" * 253)) <= 63


def pod(name: str, node_name: str, phase: str = "Running", deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "spec": {"nodeName": node_name}, "status": {"phase": phase}}


def test_pods_to_drain_takes_the_nodes_running_unclaimed_workers_together() -> None:
    pods = [
        pod("c", "n1"),
        pod("a", "n1"),
        pod("b", "n2"),
        pod("d", "n1", phase="Pending"),
        pod("e", "n1", deleting=True),
        pod("f", "n1"),
    ]
    assert eviction_gate.pods_to_drain(pods, "n1", busy={"f"}) == ["a", "c"]


def test_latest_request_prefers_the_unfinished_one() -> None:
    def request(name: str, phase: str, created: str, state: str = "Retired") -> dict[str, Any]:
        return {
            "metadata": {"name": name, "creationTimestamp": created},
            "spec": {"workers": ["w-1"]},
            "status": {"phase": phase, "workers": [{"pod": "w-1", "state": state, "bytesLost": 3}]},
        }

    found = eviction_gate.latest_request(
        "w-1", [request("old", "Succeeded", "2"), request("new", "Draining", "1", "Draining")]
    )
    assert found is not None and found.name == "new" and found.state == State.DRAINING
    assert eviction_gate.latest_request("w-2", [request("old", "Succeeded", "2")]) is None


def test_mark_drained_leaves_the_pods_to_the_eviction() -> None:
    workers = [
        specs.WorkerStatus(pod="a", state=State.DRAINING, removable=True, message="drained; removing its pod"),
        specs.WorkerStatus(pod="b", state=State.FORCED, removable=True, bytesLost=5, message="removing the pod"),
        specs.WorkerStatus(pod="c", state=State.DRAINING),
    ]
    a, b, c = eviction_gate.mark_drained(workers)
    assert (a.state, a.removable, a.podRemoved) == (State.RETIRED, False, False)
    assert "left to the eviction" in a.message
    assert (b.state, b.removable, b.bytesLost) == (State.FORCED, False, 5)
    assert c == workers[2]


def test_one_refusal_event_per_pod_and_episode() -> None:
    name = eviction_gate.refusal_event_name("w-1", "evict-n1-abc")
    assert name == eviction_gate.refusal_event_name("w-1", "evict-n1-abc"), "every retry: the same event"
    assert name.startswith("w-1.memops-refused-")
    assert name != eviction_gate.refusal_event_name("w-1", "evict-n1-def"), "a new episode: a new event"
    assert name != eviction_gate.refusal_event_name("w-2", "evict-n1-abc")
    assert len(eviction_gate.refusal_event_name("p" * 253, "x")) <= 253


SEEN = {"default/p": ("taint node.kubernetes.io/unschedulable", 100.0)}


@pytest.mark.parametrize(
    ("policy", "signal", "now", "due"),
    [
        pytest.param("default/p", "taint node.kubernetes.io/unschedulable", 101.0, False, id="same-signal-soon"),
        pytest.param("default/p", "taint node.kubernetes.io/unschedulable", 130.0, True, id="same-signal-later"),
        pytest.param("default/p", "label node.kubernetes.io/spot", 101.0, True, id="changed-signal"),
        pytest.param("other/p", "taint node.kubernetes.io/unschedulable", 101.0, True, id="another-policy"),
    ],
)
def test_node_signals_are_acted_on_at_most_once_per_interval(policy: str, signal: str, now: float, due: bool) -> None:
    assert eviction_gate.node_signal_due(SEEN, policy, signal, now, interval=30.0) is due


@pytest.mark.parametrize(
    ("body", "admission", "expected"),
    [
        pytest.param({"deleteOptions": {"dryRun": ["All"]}}, False, True, id="kubectl-drain-dry-run-server"),
        pytest.param({}, True, True, id="query-dry-run"),
        pytest.param({"deleteOptions": {}}, False, False, id="real-eviction"),
        pytest.param({"deleteOptions": {"dryRun": "All"}}, False, False, id="not-a-list"),
        pytest.param({"deleteOptions": None}, False, False, id="null-options"),
    ],
)
def test_a_dry_run_is_read_from_the_query_or_the_evictions_delete_options(
    body: dict[str, Any], admission: bool, expected: bool
) -> None:
    assert eviction_gate.dry_run(body, admission) is expected


def test_a_dry_run_is_answered_as_a_real_eviction_but_starts_nothing() -> None:
    dry = eviction_gate.decide(pod="w-1", unique_bytes=1000, request=None, dry_run=True)
    assert not dry.allowed and dry.code == 429 and not dry.start_drain and "dry run" in dry.message
    assert eviction_gate.decide(pod="w-1", unique_bytes=0, request=None, dry_run=True).allowed


@pytest.mark.parametrize(
    "labels, drains",
    [
        pytest.param(
            {eviction_gate.REASON_LABEL: eviction_gate.EVICTION, eviction_gate.NODE_LABEL: "n1"}, True, id="eviction"
        ),
        pytest.param({eviction_gate.REASON_LABEL: "scale-down"}, False, id="another-reason"),
        pytest.param({"app": "x"}, False, id="no-reason"),
        pytest.param(None, False, id="no-labels"),
    ],
)
def test_only_an_eviction_request_drains_its_workers_node(labels: dict[str, str] | None, drains: bool) -> None:
    """The drain keeps recipients off the workers' node only for a request that drains the node:
    an ordinary retirement's neighbours on that node take spilled keys by link."""
    assert eviction_gate.drains_node(labels) is drains


# -- what a review claims, confirmed; what a drain it starts may be ---------------------------------


def _pod(**changes: Any) -> dict[str, Any]:
    pod: dict[str, Any] = {
        "metadata": {"name": "w-1", "namespace": "team-b", "uid": "u-1"},
        "spec": {"nodeName": "n1"},
        "status": {"phase": "Running"},
    }
    for path, value in changes.items():
        section, key = path.split("__")
        pod[section][key] = value
    return pod


def _eviction(namespace: str | None = "team-b", name: str = "w-1", uid: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if namespace is not None:
        meta["namespace"] = namespace
    body: dict[str, Any] = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": meta}
    if uid is not None:
        body["deleteOptions"] = {"preconditions": {"uid": uid}}
    return body


@pytest.mark.parametrize(
    ("review", "pod", "doubt"),
    [
        pytest.param(_eviction(), _pod(), None, id="the-pod-as-claimed"),
        pytest.param(_eviction(uid="u-1"), _pod(), None, id="its-uid-as-claimed"),
        pytest.param(_eviction(), None, "no pod w-1 in namespace team-b", id="no-such-pod"),
        pytest.param(_eviction(namespace=None), _pod(), "names no pod and namespace", id="no-namespace-no-default"),
        pytest.param(_eviction(name=""), _pod(), "names no pod and namespace", id="no-name"),
        pytest.param(_eviction(uid="u-2"), _pod(), "has uid u-1, not u-2", id="another-pod-of-that-name"),
        pytest.param(
            _eviction(namespace="team-a"), _pod(), "is team-b/w-1, not team-a/w-1", id="the-pod-of-another-namespace"
        ),
        pytest.param(
            _eviction(), _pod(metadata__deletionTimestamp="2026-01-01T00:00:00Z"), "being deleted", id="terminating"
        ),
        pytest.param(_eviction(), _pod(status__phase="Pending"), "not running on a node", id="pending"),
        pytest.param(_eviction(), _pod(spec__nodeName=None), "not running on a node", id="unscheduled"),
    ],
)
def test_a_review_is_acted_on_only_as_the_api_bears_it_out(
    review: dict[str, Any], pod: dict[str, Any] | None, doubt: str | None
) -> None:
    """A forged review must never make memops act on a pod that does not exist, nor in a namespace
    that the pod is not in: the gate reads the pod and starts nothing unless this says None."""
    found = eviction_gate.confirm_claim(review, pod)
    if doubt is None:
        assert found is None
    else:
        assert found is not None and doubt in found


NOW = timestamps.parse("2026-11-26T10:00:00Z")


def _request(
    name: str,
    *,
    age: float | None = 60,
    phase: str = "Succeeded",
    by: str | None = "system:serviceaccount:kube-system:drainer",
    reason: str = eviction_gate.EVICTION,
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": {eviction_gate.REASON_LABEL: reason}, "annotations": {}}
    if by is not None:
        meta["annotations"][eviction_gate.REQUESTED_BY_ANNOTATION] = by
    if age is not None:
        meta["creationTimestamp"] = timestamps.render(NOW - datetime.timedelta(seconds=age))
    return {"metadata": meta, "status": {"phase": phase}}


@pytest.mark.parametrize(
    ("requests", "count"),
    [
        pytest.param([], 0, id="none"),
        pytest.param([_request("a"), _request("b", age=599)], 2, id="within-the-window"),
        pytest.param([_request("a", age=600), _request("b", age=3600)], 0, id="past-the-window"),
        pytest.param([_request("a", by=None)], 0, id="a-node-signals-is-not-the-gates"),
        pytest.param([_request("a", reason="scale-down")], 0, id="not-an-eviction"),
        pytest.param([_request("a", age=None)], 1, id="just-made-counts"),
    ],
)
def test_the_gates_drains_are_counted_in_the_window(requests: list[dict[str, Any]], count: int) -> None:
    assert eviction_gate.gate_drains_since(requests, NOW) == count


START = eviction_gate.decide(pod="w-1", unique_bytes=1000, request=None)


@pytest.mark.parametrize(
    ("running", "started", "starts", "says"),
    [
        pytest.param(None, 0, True, "memops started draining", id="first-drain-starts"),
        pytest.param(
            None, eviction_gate.GATE_DRAINS_PER_WINDOW - 1, True, "memops started", id="last-within-the-bound"
        ),
        pytest.param("evict-n1-1", 0, False, "one drain per node at a time", id="node-already-draining"),
        pytest.param(None, eviction_gate.GATE_DRAINS_PER_WINDOW, False, "the most memops starts", id="bound-reached"),
        pytest.param(None, 1000, False, "retry the eviction later", id="a-flood-of-reviews"),
    ],
)
def test_a_drain_starts_one_per_node_and_within_the_bound(
    running: str | None, started: int, starts: bool, says: str
) -> None:
    """Held back, the eviction is still refused with 429 (the data stays; the client retries)."""
    decision = eviction_gate.guard_drain(START, pod="w-1", node="n1", running=running, started=started)
    assert (decision.start_drain, decision.allowed, decision.code) == (starts, False, 429)
    assert says in decision.message


def test_only_a_drain_to_start_is_guarded() -> None:
    admitted = eviction_gate.decide(pod="w-1", unique_bytes=0, request=None)
    assert eviction_gate.guard_drain(admitted, pod="w-1", node="n1", running="r", started=99) is admitted


def test_in_flight_finds_an_unfinished_request() -> None:
    assert eviction_gate.in_flight([_request("a"), _request("b", phase="Failed")]) is None
    assert eviction_gate.in_flight([_request("a"), _request("b", phase="Draining")]) == "b"
    assert eviction_gate.in_flight([{"metadata": {"name": "c"}}]) == "c", "no status yet: just made, in flight"


@pytest.mark.parametrize(
    ("userinfo", "recorded"),
    [
        pytest.param({"username": "system:serviceaccount:b:default"}, "system:serviceaccount:b:default", id="user"),
        pytest.param({}, "unknown", id="none-given"),
        pytest.param(None, "unknown", id="no-userinfo"),
        pytest.param({"username": "x" * 400}, "x" * 253, id="bounded"),
    ],
)
def test_the_drain_records_who_asked(userinfo: dict[str, Any] | None, recorded: str) -> None:
    assert eviction_gate.requested_by(userinfo) == recorded


@pytest.mark.parametrize(
    ("created", "indexed", "unseen"),
    [
        pytest.param([_request("a", age=1)], [], ["a"], id="not-shown-yet-counts"),
        pytest.param([_request("a", age=1)], [_request("a", age=1)], [], id="shown-the-index-is-the-record"),
        pytest.param([_request("a", age=600)], [], [], id="past-the-window"),
        pytest.param([_request("a", age=None)], [], ["a"], id="no-time-just-made"),
    ],
)
def test_the_requests_the_index_does_not_show_yet(
    created: list[dict[str, Any]], indexed: list[dict[str, Any]], unseen: list[str]
) -> None:
    assert [r["metadata"]["name"] for r in eviction_gate.unseen_requests(created, indexed, NOW)] == unseen


KEPT_AT = datetime.datetime(2026, 11, 29, 9, 0, tzinfo=datetime.UTC)


@pytest.mark.parametrize(
    ("unique", "completed", "later", "dry", "start"),
    [
        pytest.param(5, KEPT_AT, 10, False, False, id="too-soon-refused"),
        pytest.param(5, KEPT_AT, 30, False, True, id="room-may-be-made-drains-again"),
        pytest.param(5, KEPT_AT, 30, True, False, id="dry-run-says-so-starts-nothing"),
        pytest.param(None, KEPT_AT, 600, False, False, id="scheduler-gone-refused"),
        pytest.param(5, None, 0, False, True, id="no-completion-time-drains-again"),
    ],
)
def test_a_drain_that_kept_the_data_is_tried_again(
    unique: int | None, completed: datetime.datetime | None, later: int, dry: bool, start: bool
) -> None:
    """Abort kept the pod's data (nowhere to put it); an eviction KEPT_RETRY_SECONDS after that
    drain ended starts another (a new worker may have room now), still refused: nothing is lost."""
    kept = dataclasses.replace(view(Phase.FAILED, State.KEPT), completed=completed)
    now = KEPT_AT + datetime.timedelta(seconds=later)
    decision = eviction_gate.decide(pod="w-1", unique_bytes=unique, request=kept, dry_run=dry, now=now)
    assert not decision.allowed
    assert decision.start_drain is start
    if start or dry:
        assert "drain" in decision.message and "again" in decision.message and "evict-n1-abc" in decision.message


def test_latest_request_reads_when_it_ended() -> None:
    request = {
        "metadata": {"name": "evict-n1-abc", "creationTimestamp": "2026-11-29T08:59:00Z"},
        "spec": {"workers": ["w-1"]},
        "status": {
            "phase": "Failed",
            "completionTime": "2026-11-29T09:00:00Z",
            "workers": [{"pod": "w-1", "state": "Kept"}],
        },
    }
    found = eviction_gate.latest_request("w-1", [request])
    assert found is not None and found.completed == KEPT_AT and found.state == State.KEPT
    request["status"]["completionTime"] = "yesterday"
    found = eviction_gate.latest_request("w-1", [request])
    assert found is not None and found.completed is None
