"""In-place growth and the disruption annotations in the policy pass' decision
(:func:`memops.decisions.policy_decisions.decide`): the orders for the apply, ``status.resize``,
the fallback to relief or to one more worker, the events; and the read's pure helpers in
:mod:`memops.decisions.resize_decisions`.

A policy of 4 replicas with ``resize: {maxLimit: 4Gi}`` (grow above 75%, to 60%, steps of
64Mi) over one worker ``w-1`` of 1Gi whose pod asks 1Gi, on a node with 4Gi to spare, in a
namespace where the administrator allows growth up to 64Gi; each case changes what it names."""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import pytest

from memops import specs
from memops.clients import kube
from memops.controllers import resize
from memops.decisions import autoscaling, conditions, objects, policy_decisions, scaling, snapshots
from memops.decisions import resize_decisions as rd

NOW = 1_800_000_000.0
OWNER = objects.Owner(name="p", namespace="dask", uid="u-1")
Mi = 2**20
Gi = 2**30
Action = rd.Action


def _spec(**fields: Any) -> specs.MemoryPolicySpec:
    base = {"scheduler": {"address": "tcp://s:8786"}, "workload": {"kind": "Deployment", "name": "w"}, "replicas": 4}
    return specs.MemoryPolicySpec.model_validate(base | {"resize": {"maxLimit": "4Gi"}} | fields)


def _worker(
    process: int = 300 * Mi,
    *,
    limit: int = Gi,
    asked: int | None = None,
    dask_limit: int | None = None,
    state: rd.PodResize = rd.PodResize.NONE,
    message: str = "",
    peers_room: int = 0,
    since: float | None = None,
) -> rd.WorkerSeen:
    """``limit``: what the container has (the kubelet's report); ``asked``: its spec (default the same)."""
    inputs = rd.Inputs(
        worker=rd.WorkerMemory(
            process=process, managed=process // 2, unmanaged=process // 2, spilled=0, limit=dask_limit or limit
        ),
        container=rd.ContainerMemory(
            request=asked or limit, limit=asked or limit, allocated=limit, actual_limit=limit, decrease_allowed=True
        ),
        resize=rd.ResizeStatus(state, message),
        baseline_limit=Gi,
        baseline_request=Gi,
        node_room=4 * Gi,
        peers_room=peers_room,
        seconds_since_resize=since,
    )
    return rd.WorkerSeen("w-1", "tcp://10.0.0.1:1234", "worker", inputs)


def _inputs(
    *workers: rd.WorkerSeen | None,
    spec: specs.MemoryPolicySpec | None = None,
    current: int = 4,
    old: specs.ResizeStatus | None = None,
    now: float = NOW,
    tasks: specs.TaskAdmissionStatus | None = None,
    **fields: Any,
) -> policy_decisions.Inputs:
    reachable = conditions.set_condition([], "SchedulerReachable", True, reason="Connected", generation=3)
    fields.setdefault("resize_ceiling", 64 * Gi)  # memops run --resize-in dask (and --max-resize-limit 64Gi)
    fields.setdefault("usage", autoscaling.Usage(workers=current, held=current * Gi, limit=current * 2 * Gi))
    fields.setdefault("connected", current)
    return policy_decisions.Inputs(
        owner=OWNER,
        generation=3,
        spec=spec or _spec(),
        status=specs.MemoryPolicyStatus(conditions=reachable, resize=old, tasks=tasks),
        current=current,
        replicas=current,
        now=now,
        resize=tuple(w for w in workers if w is not None) if workers != (None,) else None,
        **fields,
    )


def _entry(decision: policy_decisions.Decision) -> tuple[str, str, str] | None:
    assert decision.status.resize is not None
    found = decision.status.resize.workers
    return (found[0].action, found[0].reason, found[0].limit) if found else None


def _orders(decision: policy_decisions.Decision) -> list[tuple[Action, int, int | None]]:
    return [(o.action, o.limit, o.request) for o in decision.resizes]


@pytest.mark.parametrize(
    ("worker", "orders", "entry", "desired"),
    [
        pytest.param(_worker(), [], None, 4, id="no-pressure-nothing"),
        pytest.param(
            _worker(900 * Mi),
            [(Action.GROW, 1536 * Mi, 1536 * Mi)],
            ("Grow", "PeersFull", "1536Mi"),
            4,
            id="pressed-peers-full-grows",
        ),
        pytest.param(_worker(900 * Mi, peers_room=Gi), [], None, 4, id="pressed-peers-with-room-relief-does-it"),
        pytest.param(
            _worker(300 * Mi, limit=2 * Gi, dask_limit=Gi),
            [(Action.TELL_DASK, 2 * Gi, None)],
            ("TellDask", "ContainerResized", "2Gi"),
            4,
            id="container-grown-dask-told",
        ),
        pytest.param(
            _worker(900 * Mi, asked=2 * Gi, state=rd.PodResize.IN_PROGRESS),
            [],
            ("Wait", "Resizing", "1Gi"),
            4,
            id="kubelet-applying-wait",
        ),
        pytest.param(
            _worker(900 * Mi, asked=2 * Gi, state=rd.PodResize.DEFERRED, peers_room=Gi, since=30),
            [],
            ("Relieve", "ResizeDeferred", "1Gi"),
            4,
            id="deferred-falls-back-to-relief",
        ),
        pytest.param(
            _worker(900 * Mi, asked=2 * Gi, state=rd.PodResize.DEFERRED, since=30),
            [],
            ("ScaleUp", "ResizeDeferred", "1Gi"),
            5,
            id="deferred-no-room-one-more-worker",
        ),
        pytest.param(
            _worker(900 * Mi, asked=2 * Gi, state=rd.PodResize.INFEASIBLE),
            [(Action.REVERT, Gi, Gi)],
            ("ScaleUp", "ResizeInfeasible", "1Gi"),
            5,
            id="infeasible-taken-back-and-one-more-worker",
        ),
        pytest.param(
            _worker(300 * Mi, limit=2 * Gi, since=3600),
            [(Action.SHRINK, Gi, Gi)],
            ("Shrink", "PressureGone", "1Gi"),
            4,
            id="pressure-gone-shrinks",
        ),
    ],
)
def test_the_pass_orders_and_records(
    worker: rd.WorkerSeen,
    orders: list[tuple[Action, int, int | None]],
    entry: tuple[str, str, str] | None,
    desired: int,
) -> None:
    decision = policy_decisions.decide(_inputs(worker))
    assert _orders(decision) == orders
    assert _entry(decision) == entry
    assert decision.desired == desired
    assert decision.scale_up_to == (desired if desired > 4 else None)


def test_a_fallback_is_said_in_the_status_and_once_as_an_event() -> None:
    worker = _worker(
        900 * Mi, asked=2 * Gi, state=rd.PodResize.DEFERRED, message="Node didn't have enough memory", since=30
    )
    first = policy_decisions.decide(_inputs(worker))
    assert first.status.resize is not None
    assert first.status.resize.message == (
        "w-1: the kubelet deferred its growth (Node didn't have enough memory): one more worker"
    )
    assert [(e.type, e.reason) for e in first.events if e.reason.startswith("Resize")] == [
        ("Warning", "ResizeDeferred")
    ]
    # The next pass, the same: no second event, and the entry keeps the time it started.
    later = policy_decisions.decide(_inputs(worker, current=5, old=first.status.resize, now=NOW + 10))
    assert later.status.resize is not None
    assert [e for e in later.events if e.reason.startswith("Resize")] == []
    assert later.status.resize.workers == first.status.resize.workers


def test_the_worker_added_for_a_failed_growth_stays_while_it_fails() -> None:
    """The extra worker gives the peers room; the growth is still deferred, so the decision turns to
    relief: the worker added for it is kept (not drained by the next pass) and the entry says so."""
    before = specs.ResizeStatus(
        workers=[specs.ResizedWorker(pod="w-1", action="ScaleUp", reason="ResizeDeferred", limit="1Gi")]
    )
    deferred = _worker(900 * Mi, asked=2 * Gi, state=rd.PodResize.DEFERRED, peers_room=Gi, since=30)
    decision = policy_decisions.decide(_inputs(deferred, spec=_spec(replicas=4), current=5, old=before))
    assert decision.desired == 5
    assert decision.action == scaling.Action.NONE, "no drain of the worker just added"
    assert _entry(decision) == ("ScaleUp", "ResizeDeferred", "1Gi")
    # Once the pressure is gone, so is the extra worker: the policy drains back to its replicas.
    calm = policy_decisions.decide(_inputs(_worker(), current=5, old=decision.status.resize))
    assert (calm.desired, calm.action) == (4, scaling.Action.SCALE_DOWN)


def test_the_worker_added_for_a_failed_growth_stays_on_a_pass_without_the_scheduler() -> None:
    """Five workers (four and one added for a deferred growth): a pass whose scheduler did not answer
    reads no worker's memory, and does not scale down; the same pass without resize does."""
    before = specs.ResizeStatus(
        workers=[specs.ResizedWorker(pod="w-1", action="ScaleUp", reason="ResizeDeferred", limit="1Gi")]
    )
    unread = {"current": 5, "old": before, "usage": None, "connected": 0}
    held = policy_decisions.decide(_inputs(None, **unread))
    assert held.action != scaling.Action.SCALE_DOWN
    assert held.status.resize == before, "the record stays as written last"
    plain = policy_decisions.decide(_inputs(None, spec=_spec(resize=None), **unread))
    assert plain.action == scaling.Action.SCALE_DOWN


def test_growth_counts_and_says_it() -> None:
    decision = policy_decisions.decide(_inputs(_worker(900 * Mi), old=specs.ResizeStatus(resized=2)))
    assert decision.status.resize is not None and decision.status.resize.resized == 3
    assert [(e.type, e.reason, e.message) for e in decision.events if e.reason == "Grow"] == [
        ("Normal", "Grow", "w-1 grows to 1536Mi (PeersFull)")
    ]


def test_a_grown_worker_at_rest_keeps_its_line() -> None:
    line = specs.ResizedWorker(pod="w-1", action="TellDask", reason="ContainerResized", limit="2Gi", time="t")
    at_rest = _worker(300 * Mi, limit=2 * Gi, since=10)  # within the cooldown: no decrease yet
    decision = policy_decisions.decide(_inputs(at_rest, old=specs.ResizeStatus(workers=[line])))
    assert decision.status.resize is not None and decision.status.resize.workers == [line]
    back = policy_decisions.decide(_inputs(_worker(), old=decision.status.resize))
    assert back.status.resize is not None and back.status.resize.workers == [], "back at its template's limit"


@pytest.mark.parametrize(
    ("spec", "workers", "old", "expected"),
    [
        pytest.param(_spec(resize=None), (_worker(900 * Mi),), None, None, id="off-no-status"),
        pytest.param(
            _spec(),
            (None,),
            specs.ResizeStatus(resized=7),
            specs.ResizeStatus(resized=7),
            id="not-read-status-as-written",
        ),
    ],
)
def test_without_growth(
    spec: specs.MemoryPolicySpec,
    workers: tuple[rd.WorkerSeen | None, ...],
    old: specs.ResizeStatus | None,
    expected: specs.ResizeStatus | None,
) -> None:
    decision = policy_decisions.decide(_inputs(*workers, spec=spec, old=old))
    assert decision.resizes == ()
    assert decision.status.resize == expected


@pytest.mark.parametrize(
    ("eviction", "annotations", "expected"),
    [
        pytest.param({}, {}, {"w-1": {objects.DO_NOT_DISRUPT, objects.SAFE_TO_EVICT}}, id="on-by-default"),
        pytest.param({"disruptionAnnotations": False}, {}, {}, id="off-sets-nothing"),
        pytest.param(
            {"disruptionAnnotations": False},
            {objects.DO_NOT_DISRUPT: "true", objects.SAFE_TO_EVICT: "false", objects.PROTECTED_ANNOTATION: "1"},
            {"w-1": {objects.DO_NOT_DISRUPT, objects.SAFE_TO_EVICT}},
            id="off-takes-off-what-memops-set",
        ),
    ],
)
def test_the_disruption_annotations_in_the_pass(
    eviction: dict[str, Any], annotations: dict[str, str], expected: dict[str, set[str]]
) -> None:
    seen = policy_decisions.DisruptionSeen(pods={"w-1": annotations}, unique={"w-1": 4096})
    decision = policy_decisions.decide(_inputs(spec=_spec(resize=None, eviction=eviction), disruption=seen))
    memops_own = {objects.PROTECTED_ANNOTATION, objects.PROTECTION_BEGAN_ANNOTATION}
    found = {pod: set(patch["annotations"]) - memops_own for pod, patch in decision.annotations.items()}
    assert found == expected


def test_no_disruption_read_no_annotations() -> None:
    assert policy_decisions.decide(_inputs(spec=_spec(resize=None))).annotations == {}


# -- the read's pure helpers --------------------------------------------------------------------


def _info(address: str, process: int, limit: int = Gi, status: str = "running") -> snapshots.WorkerInfo:
    return snapshots.WorkerInfo(name=address, address=address, memory_limit=limit, process_bytes=process, status=status)


@pytest.mark.parametrize(
    ("ceiling", "expected"),
    [
        pytest.param(None, 0, id="no-relief-no-room"),
        pytest.param(0.7, int(0.7 * Gi) - 200 * Mi, id="room-under-relieve-above-of-running-peers"),
    ],
)
def test_peers_room(ceiling: float | None, expected: int) -> None:
    workers = [
        _info("hot", 900 * Mi),
        _info("a", 200 * Mi),
        _info("b", 800 * Mi),  # over the ceiling: no room, not negative
        _info("c", 0, status="paused"),
    ]
    assert rd.peers_room(workers, "hot", ceiling) == expected


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        pytest.param(None, (None, None), id="no-template"),
        pytest.param({"containers": [{"name": "worker"}]}, (None, None), id="no-resources"),
        pytest.param(
            {"containers": [{"resources": {"limits": {"memory": "2Gi"}, "requests": {"memory": "1Gi"}}}, {}]},
            (2 * Gi, Gi),
            id="first-container",
        ),
    ],
)
def test_template_memory(template: dict[str, Any] | None, expected: tuple[int | None, int | None]) -> None:
    assert rd.template_memory(template) == expected


@pytest.mark.parametrize(
    ("annotation", "expected"),
    [
        pytest.param(None, None, id="never"),
        pytest.param("garbled", None, id="unreadable"),
        pytest.param(f"{NOW - 90:.0f}", 90.0, id="seconds"),
        pytest.param(f"{NOW + 90:.0f}", 0.0, id="clock-skew-not-negative"),
    ],
)
def test_seconds_since(annotation: str | None, expected: float | None) -> None:
    assert rd.seconds_since(annotation, NOW) == expected


@pytest.mark.parametrize(
    ("since", "orders", "entry"),
    [
        pytest.param(10.0, [], ("ScaleUp", "ResizeInfeasible", "1Gi"), id="within-cooldown-not-asked-again"),
        pytest.param(
            3600.0,
            [(Action.GROW, 1536 * Mi, 1536 * Mi)],
            ("Grow", "PeersFull", "1536Mi"),
            id="after-cooldown-asked-again",
        ),
    ],
)
def test_a_growth_refused_as_infeasible_is_not_asked_again_at_once(
    since: float, orders: list[tuple[Action, int, int | None]], entry: tuple[str, str, str]
) -> None:
    """The kubelet refused the last growth as infeasible and memops took the ask back (stamping the
    pod): the worker is still pressed, but the same ask would be refused again, pass after pass."""
    before = specs.ResizeStatus(
        workers=[specs.ResizedWorker(pod="w-1", action="ScaleUp", reason="ResizeInfeasible", limit="1Gi")]
    )
    decision = policy_decisions.decide(_inputs(_worker(900 * Mi, since=since), current=5, old=before))
    assert _orders(decision) == orders
    assert _entry(decision) == entry


_NODE_SPILL = {
    "medium": "Node",
    "sizeLimit": "2Gi",
    "hostPath": "/var/lib/memops/spill",
    "nodeSelector": {"feature.node.kubernetes.io/memory-swap.enabled": "true"},
}


@pytest.mark.parametrize(
    ("shared", "linked", "expected"),
    [
        pytest.param(_NODE_SPILL, {"tcp://10.0.0.1:1234": 180 * Mi}, 180 * Mi, id="node-links-from-the-last-read"),
        pytest.param(_NODE_SPILL, {"tcp://10.0.0.9:1234": 180 * Mi}, 0, id="node-no-report-links-nothing"),
        pytest.param(_NODE_SPILL, None, 0, id="node-no-read-yet"),
        pytest.param(
            {"medium": "Memory", "sizeLimit": "2Gi"}, {"tcp://10.0.0.1:1234": 180 * Mi}, 0, id="memory-never-links"
        ),
    ],
)
async def test_growth_reads_the_linked_bytes_of_the_worker_it_decides_for(
    shared: dict[str, Any], linked: dict[str, int] | None, expected: int
) -> None:
    """The controller gives each worker's decision its bytes linked from other writers, by its Dask
    address, only with medium Node: with 180Mi of its 200Mi spilled linked from a peer, the worker
    at 600Mi of process is not pressed, where counted in full it would be."""
    pod = {
        "metadata": {"name": "w-1"},
        "spec": {"containers": [{"name": "worker", "resources": {"limits": {"memory": "1Gi"}}}]},
    }
    worker = snapshots.WorkerInfo(
        name="w-1", address="tcp://10.0.0.1:1234", memory_limit=Gi, process_bytes=600 * Mi, spilled_bytes=200 * Mi
    )
    spec = _spec(sharedSpill=shared)
    [seen] = await resize.observe(
        cast(kube.Kube, None),  # no node named: its room is not read
        spec=spec,
        pods=[pod],
        snapshot=snapshots.SchedulerSnapshot(workers=(worker,)),
        template=None,
        now=NOW,
        linked=linked,
    )
    assert seen.inputs.spill_charged and seen.inputs.spill_linked == expected
    assert spec.resize is not None
    assert rd.is_pressed(seen, spec.resize.settings()) == (expected == 0)


# -- the administrator's bounds, and a deferred ask taken back ---------------------------------


@pytest.mark.parametrize(
    ("ceiling", "orders", "entry"),
    [
        pytest.param(64 * Gi, [(Action.GROW, 1536 * Mi, 1536 * Mi)], ("Grow", "PeersFull", "1536Mi"), id="above-it"),
        pytest.param(
            1280 * Mi, [(Action.GROW, 1280 * Mi, 1280 * Mi)], ("Grow", "PeersFull", "1280Mi"), id="up-to-the-ceiling"
        ),
        pytest.param(Gi, [], ("ScaleUp", "AtMaximum", "1Gi"), id="at-the-ceiling-falls-back"),
    ],
)
def test_the_administrators_ceiling_bounds_the_policys_maximum(
    ceiling: int, orders: list[tuple[Action, int, int | None]], entry: tuple[str, str, str]
) -> None:
    """The policy allows 4Gi; the administrator's ceiling in its namespace is the lower bound when lower."""
    decision = policy_decisions.decide(_inputs(_worker(900 * Mi), resize_ceiling=ceiling))
    assert _orders(decision) == orders
    assert _entry(decision) == entry


def test_a_namespace_the_administrator_did_not_list_gets_no_growth() -> None:
    """No ``--resize-in`` for the namespace: nothing is asked of pods/resize nor of Dask, whatever the
    policy says; the status and one event say why."""
    before = specs.ResizeStatus(resized=2)
    for worker in (_worker(900 * Mi), _worker(300 * Mi, limit=2 * Gi, dask_limit=Gi)):
        decision = policy_decisions.decide(_inputs(worker, resize_ceiling=None, old=before))
        assert decision.resizes == () and decision.desired == 4
        assert decision.status.resize is not None
        assert decision.status.resize.resized == 2 and decision.status.resize.workers == []
        assert "not allowed in namespace dask" in decision.status.resize.message
        assert "--resize-in" in decision.status.resize.message
        assert [(e.type, e.reason) for e in decision.events] == [("Warning", "ResizeNotAllowed")]
    later = policy_decisions.decide(_inputs(_worker(900 * Mi), resize_ceiling=None, old=decision.status.resize))
    assert later.events == (), "said once"


def test_a_growth_deferred_past_the_bound_is_taken_back_and_not_asked_again_at_once() -> None:
    """Deferred for 3 minutes: the ask is taken back to what the kubelet applied (the request too),
    the status and a Warning say so, and one more worker takes the excess. The next passes do not
    ask it again for 10 minutes (the node's memory would be held again), then they do."""
    deferred = _worker(900 * Mi, asked=1536 * Mi, state=rd.PodResize.DEFERRED, message="no room", since=180)
    first = policy_decisions.decide(_inputs(deferred))
    assert _orders(first) == [(Action.REVERT, Gi, Gi)]
    assert _entry(first) == ("ScaleUp", "ResizeDeferredTooLong", "1Gi")
    assert first.desired == 5
    assert first.status.resize is not None and "took it back" in first.status.resize.message
    warnings = [e for e in first.events if e.type == "Warning"]
    assert [e.reason for e in warnings] == ["ResizeDeferredTooLong"] and "took it back" in warnings[0].message
    # Taken back, the kubelet's condition not cleared yet: nothing more is asked, nothing said again.
    stale = _worker(900 * Mi, state=rd.PodResize.DEFERRED, message="no room", since=2)
    between = policy_decisions.decide(_inputs(stale, current=5, old=first.status.resize, now=NOW + 2))
    assert _orders(between) == [] and between.status.resize == first.status.resize
    assert [e for e in between.events if e.type == "Warning"] == []
    # Taken back: the pod's spec is what the kubelet applied, its stamp is fresh.
    taken_back = _worker(900 * Mi, since=10)
    second = policy_decisions.decide(_inputs(taken_back, current=5, old=first.status.resize, now=NOW + 10))
    assert _orders(second) == [] and _entry(second) == ("ScaleUp", "ResizeDeferredTooLong", "1Gi")
    assert second.desired == 5 and [e for e in second.events if e.type == "Warning"] == []
    # A stamp rewritten on the pod does not shorten the wait: the status' line began 5 minutes ago.
    rewritten = _worker(900 * Mi, since=3600)
    third = policy_decisions.decide(_inputs(rewritten, current=5, old=second.status.resize, now=NOW + 300))
    assert _orders(third) == []
    # Ten minutes on, the growth is asked again.
    again = policy_decisions.decide(
        _inputs(_worker(900 * Mi, since=610), current=5, old=third.status.resize, now=NOW + 610)
    )
    assert _orders(again) == [(Action.GROW, 1536 * Mi, 1536 * Mi)]


# -- growth for task admission's demand ----------------------------------------------------------

DEMAND = specs.TaskAdmissionStatus(demandTasks=2, demandBytes=900 * Mi, demandAction="None")
"""On the last pass: two tasks wait whose profiled peak (900Mi) fits no worker of 1Gi (its pause
threshold, 80%, is 819.2Mi)."""
FOR_DEMAND = 1536 * Mi  # (300Mi held + 900Mi) / 80% = 1500Mi, up to a multiple of 64Mi


def _named(seen: rd.WorkerSeen, pod: str, **inputs: Any) -> rd.WorkerSeen:
    return rd.WorkerSeen(pod, f"tcp://{pod}:1234", seen.container, dataclasses.replace(seen.inputs, **inputs))


def test_tasks_that_fit_no_worker_grow_one_worker_in_place() -> None:
    """The worker that needs the least growth grows, to where its pause threshold holds its memory
    and the peak; the status and an event say why; no other worker grows on the same pass."""
    workers = (_named(_worker(300 * Mi), "w-1"), _named(_worker(500 * Mi), "w-0"))
    decision = policy_decisions.decide(_inputs(*workers, spec=_spec(tasks={}), tasks=DEMAND))
    assert [(o.pod, o.action, o.limit) for o in decision.resizes] == [("w-1", Action.GROW, FOR_DEMAND)]
    assert decision.status.resize is not None
    assert [(w.pod, w.action, w.reason, w.limit) for w in decision.status.resize.workers] == [
        ("w-1", "Grow", "TaskDemand", "1536Mi")
    ]
    assert ("Normal", "Grow", "w-1 grows to 1536Mi (TaskDemand)") in [
        (e.type, e.reason, e.message) for e in decision.events
    ]
    assert policy_decisions.serves_demand(decision.status.resize, NOW)


@pytest.mark.parametrize(
    ("spec", "tasks", "worker", "fields"),
    [
        pytest.param(_spec(), DEMAND, _worker(), {}, id="admission-off"),
        pytest.param(_spec(tasks={}), None, _worker(), {}, id="no-demand"),
        pytest.param(_spec(tasks={}), DEMAND.model_copy(update={"demandTasks": 0}), _worker(), {}, id="none-waiting"),
        pytest.param(_spec(tasks={}, resize={"maxLimit": "1280Mi"}), DEMAND, _worker(), {}, id="over-max-limit"),
        pytest.param(_spec(tasks={}), DEMAND, _worker(since=10), {}, id="resized-lately"),
        pytest.param(_spec(tasks={}), DEMAND, _worker(state=rd.PodResize.IN_PROGRESS), {}, id="resizing"),
        pytest.param(_spec(tasks={}), DEMAND, _worker(), {"resize_ceiling": Gi}, id="administrators-ceiling"),
    ],
)
def test_no_growth_for_demand(
    spec: specs.MemoryPolicySpec, tasks: specs.TaskAdmissionStatus | None, worker: rd.WorkerSeen, fields: Any
) -> None:
    decision = policy_decisions.decide(_inputs(worker, spec=spec, tasks=tasks, **fields))
    assert [o for o in decision.resizes if o.action is Action.GROW] == []


def test_a_node_without_room_for_the_growth_grows_another_worker() -> None:
    full = _named(_worker(100 * Mi), "w-0", node_room=128 * Mi)  # it would need 1280Mi
    roomy = _named(_worker(300 * Mi), "w-1")
    decision = policy_decisions.decide(_inputs(full, roomy, spec=_spec(tasks={}), tasks=DEMAND))
    assert [(o.pod, o.limit) for o in decision.resizes] == [("w-1", FOR_DEMAND)]


def test_the_growth_for_demand_keeps_its_reason_until_dask_has_the_limit_then_settles() -> None:
    """Applying, then Dask told: the line says TaskDemand throughout, and no worker grows again
    for the same demand (its figure in the status was read before the worker's new capacity
    reached the scheduler) until the line has settled."""
    spec = _spec(tasks={})
    asked = specs.ResizedWorker(
        pod="w-1", action="Grow", reason="TaskDemand", limit="1536Mi", time="2027-01-15T08:00:00Z"
    )
    applying = _named(_worker(asked=FOR_DEMAND, state=rd.PodResize.IN_PROGRESS, since=5), "w-1")
    other = _named(_worker(), "w-2")
    waiting = policy_decisions.decide(
        _inputs(applying, other, spec=spec, tasks=DEMAND, old=specs.ResizeStatus(workers=[asked]))
    )
    assert waiting.resizes == ()
    assert waiting.status.resize is not None
    assert [(w.pod, w.action, w.reason) for w in waiting.status.resize.workers] == [("w-1", "Wait", "TaskDemand")]
    assert policy_decisions.serves_demand(waiting.status.resize, NOW)

    applied = _named(_worker(limit=FOR_DEMAND, dask_limit=Gi, since=40), "w-1")
    told = policy_decisions.decide(_inputs(applied, other, spec=spec, tasks=DEMAND, old=waiting.status.resize))
    assert [(o.pod, o.action, o.limit) for o in told.resizes] == [("w-1", Action.TELL_DASK, FOR_DEMAND)]
    assert told.status.resize is not None

    grown = _named(_worker(limit=FOR_DEMAND, since=45), "w-1")
    later = NOW + 5
    after = policy_decisions.decide(_inputs(grown, other, spec=spec, tasks=DEMAND, old=told.status.resize, now=later))
    assert after.resizes == (), "the demand read before Dask had the limit grows no second worker"
    assert policy_decisions.serves_demand(after.status.resize, later)
    settled = NOW + rd.DEMAND_SETTLE_SECONDS + 1
    assert not policy_decisions.serves_demand(after.status.resize, settled)


def test_growth_serves_the_demand_before_a_new_worker_does() -> None:
    """With both growth and autoscaling: a worker grows in place and none is added for the demand;
    where none can grow far enough, one more worker is."""
    autoscale = {"minReplicas": 1, "maxReplicas": 8, "targetMemoryUtilization": 50}
    # At the target (4 recommended), and a new worker's limit (1.25Gi a worker, on average) holds the peak.
    usage = autoscaling.Usage(workers=4, held=5 * Gi // 2, limit=5 * Gi)
    grows = policy_decisions.decide(
        _inputs(_worker(), spec=_spec(tasks={}, autoscale=autoscale, replicas=None), tasks=DEMAND, usage=usage)
    )
    assert [o.action for o in grows.resizes] == [Action.GROW]
    assert grows.desired == 4
    capped = _spec(tasks={}, autoscale=autoscale, replicas=None, resize={"maxLimit": "1Gi"})
    scales = policy_decisions.decide(_inputs(_worker(), spec=capped, tasks=DEMAND, usage=usage))
    assert scales.resizes == ()
    assert scales.desired == 5


def test_a_grown_worker_keeps_the_capacity_that_waiting_tasks_need() -> None:
    """At rest past its cooldown, a worker grown to 1536Mi would shrink back to 1Gi; while tasks
    wait whose peak only its capacity holds, it does not. With no such tasks, it does."""
    grown = _worker(300 * Mi, limit=FOR_DEMAND, since=3600)
    line = specs.ResizedWorker(pod="w-1", action="TellDask", reason="TaskDemand", limit="1536Mi", time="t")
    waiting = specs.TaskAdmissionStatus(demandTasks=1, demandBytes=1000 * Mi)
    kept = policy_decisions.decide(
        _inputs(grown, spec=_spec(tasks={}), tasks=waiting, old=specs.ResizeStatus(workers=[line]))
    )
    assert kept.resizes == ()
    shrinks = policy_decisions.decide(_inputs(grown, spec=_spec(tasks={}), old=specs.ResizeStatus(workers=[line])))
    assert [(o.action, o.limit) for o in shrinks.resizes] == [(Action.SHRINK, Gi)]


@pytest.mark.parametrize(
    ("resizing", "autoscale", "expected"),
    [
        (True, None, "Resize"),
        (False, {"minReplicas": 1, "maxReplicas": 4, "targetMemoryUtilization": 50}, "Scale"),
        (False, None, "None"),
    ],
)
def test_the_demand_action_says_what_serves_it(resizing: bool, autoscale: Any, expected: str) -> None:
    from memops.controllers import admission_install
    from memops.decisions import autoscaling

    spec = _spec(tasks={}, autoscale=autoscale, replicas=None if autoscale else 4)
    two_of_1gib = autoscaling.Usage(workers=2, held=0, limit=2 * Gi)
    assert admission_install.demand_action(spec, resizing, 500 * Mi, two_of_1gib) == expected
