"""In-place growth's decisions (:mod:`memops.decisions.resize_decisions`) and its spec
(:mod:`memops.specs.memorypolicy_resize`).

A worker of 1Gi whose pod asks 1Gi and holds 1Gi, on a node with 4Gi to spare and peers with no
room, under ``resize: {maxLimit: 4Gi}`` (grow above 75%, to 60%, steps of 64Mi); each case
changes what it names."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import pydantic
import pytest

from memops.decisions import resize_decisions as rd
from memops.decisions import shared_spill
from memops.specs.memorypolicy_resize import ResizeSpec

Mi = 2**20
Gi = 2**30
SETTINGS = ResizeSpec(maxLimit="4Gi").settings()


def inputs(
    process: int = 300 * Mi,
    *,
    dask_limit: int = Gi,
    limit: int = Gi,
    actual: int | None = Gi,
    request: int | None = Gi,
    state: rd.PodResize = rd.PodResize.NONE,
    baseline: int = Gi,
    baseline_request: int | None = Gi,
    node_room: int = 4 * Gi,
    peers_room: int = 0,
    since: float | None = None,
    decrease_allowed: bool = True,
    spilled: int = 0,
    spill_charged: bool = False,
    spill_linked: int = 0,
    pending: float | None = None,
) -> rd.Inputs:
    return rd.Inputs(
        worker=rd.WorkerMemory(
            process=process, managed=process // 2, unmanaged=process // 2, spilled=spilled, limit=dask_limit
        ),
        container=rd.ContainerMemory(
            request=request, limit=limit, allocated=request, actual_limit=actual, decrease_allowed=decrease_allowed
        ),
        resize=rd.ResizeStatus(state),
        baseline_limit=baseline,
        baseline_request=baseline_request,
        node_room=node_room,
        peers_room=peers_room,
        seconds_since_resize=since,
        spill_charged=spill_charged,
        spill_linked=spill_linked,
        seconds_pending=pending,
    )


def decision(action: rd.Action, reason: rd.Reason, **fields: Any) -> rd.Decision:
    return rd.Decision(action, reason, **fields)


HOT = 800 * Mi  # 78% of 1Gi: over growAbove (75%)
GROWN = 1344 * Mi  # 800Mi / 60% = 1333.4Mi, up to a multiple of 64Mi (21 * 64Mi)


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        pytest.param(inputs(), decision(rd.Action.NONE, rd.Reason.NO_PRESSURE), id="calm"),
        pytest.param(
            inputs(HOT),
            decision(rd.Action.GROW, rd.Reason.PEERS_FULL, limit=GROWN, request=GROWN),
            id="near-pause-peers-full-grows-request-with-limit",
        ),
        pytest.param(
            inputs(HOT, request=512 * Mi, baseline_request=512 * Mi),
            decision(rd.Action.GROW, rd.Reason.PEERS_FULL, limit=GROWN, request=GROWN - 512 * Mi),
            id="burstable-keeps-its-gap",
        ),
        pytest.param(
            inputs(HOT, peers_room=Gi),
            decision(rd.Action.RELIEVE, rd.Reason.PEERS_HAVE_ROOM),
            id="peers-have-room-relief-moves-it",
        ),
        pytest.param(
            inputs(int(3.6 * Gi), limit=4 * Gi, actual=4 * Gi, dask_limit=4 * Gi, peers_room=4 * Gi),
            decision(rd.Action.RELIEVE, rd.Reason.AT_MAXIMUM, message="cannot grow past 4Gi"),
            id="at-maximum-falls-back-to-relief-even-when-moving-costs-more",
        ),
        pytest.param(
            inputs(int(3.6 * Gi), limit=4 * Gi, actual=4 * Gi, dask_limit=4 * Gi),
            decision(rd.Action.SCALE_UP, rd.Reason.AT_MAXIMUM, message="cannot grow past 4Gi"),
            id="at-maximum-peers-full-scales-up",
        ),
        pytest.param(
            inputs(int(2.9 * Gi), limit=3 * Gi, actual=3 * Gi, dask_limit=3 * Gi, peers_room=4 * Gi),
            decision(rd.Action.GROW, rd.Reason.MOVING_COSTS_MORE, limit=4 * Gi, request=2 * Gi),
            id="moving-more-than-preferGrowthAbove-grows-up-to-the-maximum",
        ),
        pytest.param(
            inputs(HOT, node_room=100 * Mi),
            decision(rd.Action.GROW, rd.Reason.PEERS_FULL, limit=Gi + 64 * Mi, request=Gi + 64 * Mi),
            id="node-grants-part-of-it",
        ),
        pytest.param(
            inputs(HOT, node_room=32 * Mi),
            decision(rd.Action.SCALE_UP, rd.Reason.NODE_FULL, message="cannot grow past 1Gi"),
            id="node-full-peers-full-scales-up",
        ),
        pytest.param(
            inputs(HOT, node_room=32 * Mi, peers_room=Gi),
            decision(rd.Action.RELIEVE, rd.Reason.PEERS_HAVE_ROOM),
            id="node-full-peers-room-relieves",
        ),
        pytest.param(
            inputs(600 * Mi, spilled=200 * Mi, spill_charged=True),
            decision(rd.Action.GROW, rd.Reason.PEERS_FULL, limit=GROWN, request=GROWN),
            id="tmpfs-spill-counts-against-the-limit",
        ),
        pytest.param(
            inputs(600 * Mi, spilled=200 * Mi),
            decision(rd.Action.NONE, rd.Reason.NO_PRESSURE),
            id="disk-spill-does-not",
        ),
        # Medium Node: a file linked from a peer is charged to the peer's pod, which wrote it.
        pytest.param(
            inputs(600 * Mi, spilled=200 * Mi, spill_charged=True, spill_linked=180 * Mi),
            decision(rd.Action.NONE, rd.Reason.NO_PRESSURE),
            id="spill-linked-from-a-peer-does-not-count",
        ),
        pytest.param(
            inputs(600 * Mi, spilled=300 * Mi, spill_charged=True, spill_linked=100 * Mi),
            decision(rd.Action.GROW, rd.Reason.PEERS_FULL, limit=GROWN, request=GROWN),
            id="spill-it-wrote-itself-counts",
        ),
        # The kubelet's answers.
        pytest.param(
            inputs(HOT, limit=GROWN, state=rd.PodResize.IN_PROGRESS),
            decision(rd.Action.WAIT, rd.Reason.RESIZING),
            id="in-progress-waits",
        ),
        pytest.param(
            inputs(HOT, limit=GROWN), decision(rd.Action.WAIT, rd.Reason.RESIZING), id="asked-not-yet-applied-waits"
        ),
        pytest.param(
            inputs(HOT, limit=GROWN, state=rd.PodResize.DEFERRED, since=30),
            decision(rd.Action.SCALE_UP, rd.Reason.RESIZE_DEFERRED),
            id="deferred-peers-full-scales-up-and-keeps-the-ask",
        ),
        pytest.param(
            inputs(HOT, limit=GROWN, state=rd.PodResize.DEFERRED, peers_room=Gi, since=30),
            decision(rd.Action.RELIEVE, rd.Reason.RESIZE_DEFERRED),
            id="deferred-peers-room-relieves",
        ),
        pytest.param(
            inputs(HOT, limit=GROWN, state=rd.PodResize.INFEASIBLE, peers_room=Gi),
            decision(rd.Action.RELIEVE, rd.Reason.RESIZE_INFEASIBLE, revert_to=Gi),
            id="infeasible-relieves-and-takes-the-ask-back",
        ),
        pytest.param(
            inputs(HOT, limit=GROWN, state=rd.PodResize.ERROR),
            decision(rd.Action.SCALE_UP, rd.Reason.RESIZE_FAILED, revert_to=Gi),
            id="failed-scales-up",
        ),
        pytest.param(
            inputs(300 * Mi, limit=GROWN, state=rd.PodResize.INFEASIBLE),
            decision(rd.Action.NONE, rd.Reason.RESIZE_INFEASIBLE, revert_to=Gi),
            id="infeasible-without-pressure-only-takes-it-back",
        ),
        # Dask follows the container.
        pytest.param(
            inputs(HOT, limit=GROWN, actual=GROWN, request=GROWN),
            decision(rd.Action.TELL_DASK, rd.Reason.CONTAINER_RESIZED, limit=GROWN),
            id="grown-container-then-dask",
        ),
        pytest.param(
            inputs(300 * Mi, limit=GROWN, actual=GROWN, request=GROWN, dask_limit=Gi),
            decision(rd.Action.TELL_DASK, rd.Reason.CONTAINER_RESIZED, limit=GROWN),
            id="shrink-whose-patch-failed-dask-raised-again",
        ),
        # Shrink.
        pytest.param(
            inputs(300 * Mi, limit=2 * Gi, actual=2 * Gi, dask_limit=2 * Gi, request=2 * Gi),
            decision(rd.Action.SHRINK, rd.Reason.PRESSURE_GONE, limit=Gi, request=Gi),
            id="pressure-gone-back-to-the-baseline",
        ),
        pytest.param(
            inputs(1200 * Mi, limit=3 * Gi, actual=3 * Gi, dask_limit=3 * Gi, request=3 * Gi),
            decision(rd.Action.SHRINK, rd.Reason.PRESSURE_GONE, limit=2048 * Mi, request=2048 * Mi),
            id="partway-memory-under-the-smaller-limit-s-target",
        ),
        pytest.param(
            inputs(1200 * Mi, limit=2 * Gi, actual=2 * Gi, dask_limit=2 * Gi, request=2 * Gi),
            decision(rd.Action.NONE, rd.Reason.NO_PRESSURE),
            id="memory-over-any-smaller-limit-s-target-stays",
        ),
        pytest.param(
            inputs(300 * Mi, limit=2 * Gi, actual=2 * Gi, dask_limit=2 * Gi, since=60),
            decision(rd.Action.NONE, rd.Reason.NO_PRESSURE),
            id="cooling-down",
        ),
        pytest.param(
            inputs(300 * Mi, limit=2 * Gi, actual=2 * Gi, dask_limit=2 * Gi, decrease_allowed=False),
            decision(rd.Action.NONE, rd.Reason.NO_PRESSURE),
            id="decrease-would-restart-the-container",
        ),
        pytest.param(
            inputs(300 * Mi, limit=Gi, actual=2 * Gi, dask_limit=Gi, state=rd.PodResize.INFEASIBLE),
            decision(rd.Action.REVERT, rd.Reason.RESIZE_INFEASIBLE, limit=2 * Gi),
            id="refused-decrease-is-taken-back",
        ),
        pytest.param(
            inputs(limit=Gi, actual=None, request=None),
            decision(rd.Action.NONE, rd.Reason.NO_PRESSURE),
            id="no-status-yet-reads-the-spec",
        ),
        pytest.param(
            inputs(limit=None, actual=None),  # type: ignore[arg-type]
            decision(rd.Action.NONE, rd.Reason.NO_PRESSURE, message="the container or the worker has no memory limit"),
            id="no-limit",
        ),
    ],
)
def test_decide(given: rd.Inputs, expected: rd.Decision) -> None:
    assert rd.decide(given, SETTINGS) == expected


def test_a_grown_limit_is_one_the_worker_sits_under_grow_to() -> None:
    """Grown, the worker is no longer over growAbove: the next pass does not grow it again."""
    grown = rd.decide(inputs(HOT), SETTINGS)
    assert grown.limit is not None
    after = inputs(HOT, limit=grown.limit, actual=grown.limit, request=grown.request, dask_limit=grown.limit, since=0)
    assert HOT <= SETTINGS.grow_to * grown.limit
    assert rd.decide(after, SETTINGS) == decision(rd.Action.NONE, rd.Reason.NO_PRESSURE)


def test_spill_linked_from_a_peer_is_not_what_grows_a_worker() -> None:
    """Medium Node: 600Mi of process and 200Mi spilled, of which 180Mi are a peer's files linked in.
    Counted in full, as Dask counts them, the worker is at 78% of 1Gi and would grow; its pod is
    charged only the 20Mi it wrote, 61%, and it does not."""
    stock = inputs(600 * Mi, spilled=200 * Mi, spill_charged=True)
    linked = dataclasses.replace(stock, spill_linked=180 * Mi)
    assert rd.used_bytes(stock) == HOT and rd.decide(stock, SETTINGS).action is rd.Action.GROW
    assert rd.used_bytes(linked) == 620 * Mi
    assert rd.decide(linked, SETTINGS) == decision(rd.Action.NONE, rd.Reason.NO_PRESSURE)
    assert not rd.is_pressed(rd.WorkerSeen("w-1", "tcp://10.0.0.1:1234", "worker", linked), SETTINGS)


def test_medium_memory_counts_its_spill_whatever_is_said_of_links() -> None:
    """Without spill charged to the pod nothing is counted, linked or not; with it, a linked figure
    of 0 (medium Memory, or no report) counts all of Dask's spilled bytes."""
    assert rd.used_bytes(inputs(600 * Mi, spilled=200 * Mi, spill_linked=180 * Mi)) == 600 * Mi
    assert rd.used_bytes(inputs(600 * Mi, spilled=200 * Mi, spill_charged=True)) == HOT


@pytest.mark.parametrize(
    ("report", "counted"),
    [
        pytest.param({"bytes": 2**62, "ownBytes": 0}, 0, id="more-linked-than-spilled"),
        pytest.param({"bytes": 100 * Mi, "ownBytes": -Gi}, 200 * Mi, id="negative-own"),
        pytest.param({"bytes": -Gi, "ownBytes": 0}, 200 * Mi, id="negative-bytes"),
        pytest.param({"bytes": "200Mi", "ownBytes": 0}, 200 * Mi, id="text"),
        pytest.param({"bytes": 100 * Mi, "ownBytes": 200 * Mi}, 200 * Mi, id="own-over-bytes"),
        pytest.param({"bytes": 2**70, "ownBytes": 0}, 200 * Mi, id="huge"),
        pytest.param({"bytes": 1.5e20, "ownBytes": 0.0}, 200 * Mi, id="floats"),
        pytest.param({"bytes": True, "ownBytes": False}, 200 * Mi, id="bools"),
        pytest.param({"bytes": 100 * Mi}, 200 * Mi, id="no-own-bytes"),
        pytest.param([100 * Mi, 0], 200 * Mi, id="not-a-map"),
    ],
)
def test_a_hostile_spill_report_never_counts_spill_below_zero(report: Any, counted: int) -> None:
    """What a worker says of its links, through the same path as the policy pass, leaves the spill
    counted against its limit between nothing and Dask's ``spilled`` (200Mi), and never raises."""
    linked = shared_spill.linked_bytes({"tcp://10.0.0.1:1234": report}).get("tcp://10.0.0.1:1234", 0)
    given = inputs(600 * Mi, spilled=200 * Mi, spill_charged=True, spill_linked=linked)
    assert rd.used_bytes(given) - 600 * Mi == counted
    rd.decide(given, SETTINGS)


def test_a_negative_linked_figure_counts_as_none() -> None:
    assert rd.used_bytes(inputs(600 * Mi, spilled=200 * Mi, spill_charged=True, spill_linked=-Gi)) == HOT


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [
        pytest.param(512 * Mi, "512Mi", id="Mi"),
        pytest.param(4 * Gi, "4Gi", id="Gi"),
        pytest.param(1536 * Mi, "1536Mi", id="not-whole-Gi"),
        pytest.param(1000, "1000", id="bytes"),
        pytest.param(3 * 2**10, "3Ki", id="Ki"),
        pytest.param(0, "0", id="zero"),
    ],
)
def test_quantities_round_trip(nbytes: int, text: str) -> None:
    assert rd.to_quantity(nbytes) == text
    assert rd.from_quantity(text) == nbytes


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [
        pytest.param("1G", 10**9, id="decimal"),
        pytest.param("1.5Gi", 3 * Gi // 2, id="fraction"),
        pytest.param("1500m", 2, id="milli-rounds-up"),
        pytest.param("-1Gi", None, id="negative"),
        pytest.param(None, None, id="absent"),
        pytest.param("lots", None, id="garbage"),
    ],
)
def test_pod_quantities(text: Any, nbytes: int | None) -> None:
    assert rd.from_quantity(text) == nbytes


def pod(conditions: Sequence[dict[str, Any]] = (), **status: Any) -> dict[str, Any]:
    return {
        "spec": {
            "containers": [
                {"name": "sidecar"},
                {
                    "name": "worker",
                    "resources": {"requests": {"memory": "1Gi"}, "limits": {"memory": "2Gi"}},
                    "resizePolicy": [{"resourceName": "cpu", "restartPolicy": "RestartContainer"}],
                },
            ]
        },
        "status": {
            "conditions": list(conditions),
            "containerStatuses": [
                {
                    "name": "worker",
                    "allocatedResources": {"memory": "1Gi"},
                    "resources": {"requests": {"memory": "1Gi"}, "limits": {"memory": "1536Mi"}},
                }
            ],
            **status,
        },
    }


def test_container_memory_reads_the_ask_and_what_the_kubelet_applied() -> None:
    memory = rd.container_memory(pod(), "worker")
    assert memory == rd.ContainerMemory(
        request=Gi, limit=2 * Gi, allocated=Gi, actual_limit=1536 * Mi, decrease_allowed=True
    )
    assert memory.applied_limit == 1536 * Mi
    assert rd.container_memory(pod(), "missing") is None
    sidecar = rd.container_memory(pod(), "sidecar")
    assert sidecar is not None and (sidecar.limit, sidecar.applied_limit) == (None, None)


def test_a_memory_resize_policy_of_restart_forbids_decreases() -> None:
    body = pod()
    body["spec"]["containers"][1]["resizePolicy"] = [{"resourceName": "memory", "restartPolicy": "RestartContainer"}]
    memory = rd.container_memory(body, "worker")
    assert memory is not None and not memory.decrease_allowed


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        pytest.param(pod(), rd.ResizeStatus(rd.PodResize.NONE), id="none"),
        pytest.param(
            pod([{"type": "PodResizePending", "status": "True", "reason": "Deferred", "message": "Node didn't have"}]),
            rd.ResizeStatus(rd.PodResize.DEFERRED, "Node didn't have"),
            id="deferred",
        ),
        pytest.param(
            pod([{"type": "PodResizePending", "status": "True", "reason": "Infeasible", "message": "too big"}]),
            rd.ResizeStatus(rd.PodResize.INFEASIBLE, "too big"),
            id="infeasible",
        ),
        pytest.param(
            pod([{"type": "PodResizeInProgress", "status": "True"}]),
            rd.ResizeStatus(rd.PodResize.IN_PROGRESS),
            id="in-progress",
        ),
        pytest.param(
            pod([{"type": "PodResizeInProgress", "status": "True", "reason": "Error", "message": "runc said no"}]),
            rd.ResizeStatus(rd.PodResize.ERROR, "runc said no"),
            id="error",
        ),
        pytest.param(
            pod([{"type": "PodResizePending", "status": "False", "reason": "Deferred"}]),
            rd.ResizeStatus(rd.PodResize.NONE),
            id="condition-false",
        ),
        pytest.param(pod(resize="Infeasible"), rd.ResizeStatus(rd.PodResize.INFEASIBLE), id="legacy-status-resize"),
    ],
)
def test_resize_status(given: dict[str, Any], expected: rd.ResizeStatus) -> None:
    assert rd.resize_status(given) == expected


def test_node_room_is_allocatable_minus_every_request() -> None:
    assert rd.node_room(8 * Gi, [Gi, 2 * Gi, 512 * Mi]) == 4 * Gi + 512 * Mi
    assert rd.node_room(Gi, [2 * Gi]) == 0


def test_the_largest_maximum_is_accepted() -> None:
    assert ResizeSpec(maxLimit="64Ti").settings().max_limit == 64 * 2**40


def test_the_spec_in_decision_units() -> None:
    spec = ResizeSpec.model_validate({"maxLimit": "16Gi", "growAbove": "78%", "cooldown": "10m", "shrink": False})
    assert spec.settings() == dataclasses.replace(
        SETTINGS, max_limit=16 * Gi, grow_above=0.78, cooldown=600.0, shrink=False
    )
    assert SETTINGS.step == 64 * Mi and SETTINGS.prefer_growth_above == Gi and SETTINGS.grow_to == 0.6


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        pytest.param({"maxLimit": "4Gi", "growTo": "80%"}, "growTo", id="to-above-above"),
        pytest.param({"maxLimit": "64Mi", "step": "128Mi"}, "step", id="step-above-maximum"),
        pytest.param({"maxLimit": "0"}, "more than zero", id="zero-maximum"),
        pytest.param({"maxLimit": "9e99"}, "at most 64Ti", id="maximum-beyond-any-node"),
        pytest.param({"maxLimit": "65Ti"}, "at most 64Ti", id="maximum-past-the-bound"),
        pytest.param({}, "maxLimit", id="maximum-required"),
        pytest.param({"maxLimit": "4Gi", "grow": True}, "grow", id="unknown-field"),
    ],
)
def test_the_spec_refuses(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=message):
        ResizeSpec.model_validate(fields)


# -- a deferred ask is taken back after a bound --------------------------------------------------
# A deferred ask keeps the node's memory: the scheduler counts a pod's resize request whatever the
# kubelet answered but Infeasible, so a tenant's growth left deferred would keep other tenants' pods
# off the node for as long as it stays so. Past rd.DEFERRED_SECONDS (2 minutes) memops takes it back.


@pytest.mark.parametrize(
    ("process", "peers_room", "since", "pending", "action", "reason", "revert_to"),
    [
        pytest.param(HOT, 0, 60.0, None, "ScaleUp", "ResizeDeferred", None, id="within-the-bound-left-to-the-kubelet"),
        pytest.param(HOT, 0, 180.0, None, "ScaleUp", "ResizeDeferredTooLong", Gi, id="past-the-bound-taken-back"),
        pytest.param(
            HOT, Gi, 180.0, None, "Relieve", "ResizeDeferredTooLong", Gi, id="past-the-bound-taken-back-peers-relieve"
        ),
        pytest.param(300 * Mi, 0, 180.0, None, "None", "ResizeDeferredTooLong", Gi, id="no-pressure-only-taken-back"),
        # The kubelet's time (the condition's lastTransitionTime) counts over memops' own stamp on the
        # pod, which the pod's owner can rewrite.
        pytest.param(HOT, 0, 10.0, 180.0, "ScaleUp", "ResizeDeferredTooLong", Gi, id="the-kubelets-time-counts"),
        pytest.param(HOT, 0, 600.0, 30.0, "ScaleUp", "ResizeDeferred", None, id="a-stamp-rewritten-long-ago"),
        pytest.param(HOT, 0, None, None, "ScaleUp", "ResizeDeferredTooLong", Gi, id="no-time-counts-as-long-ago"),
    ],
)
def test_a_growth_the_kubelet_defers_past_the_bound_is_taken_back(
    process: int,
    peers_room: int,
    since: float | None,
    pending: float | None,
    action: str,
    reason: str,
    revert_to: int | None,
) -> None:
    given = inputs(
        process, limit=GROWN, state=rd.PodResize.DEFERRED, peers_room=peers_room, since=since, pending=pending
    )
    found = rd.decide(given, SETTINGS)
    assert (found.action.value, found.reason.value, found.revert_to, found.limit) == (action, reason, revert_to, None)


def test_a_deferred_ask_already_taken_back_is_not_taken_back_again() -> None:
    """The pod's spec is back at what the kubelet applied; its condition has not caught up yet: said
    as when it was taken back, so that the pass holds the growth as then."""
    found = rd.decide(inputs(HOT, state=rd.PodResize.DEFERRED, since=1.0, pending=600.0), SETTINGS)
    assert (found.action, found.reason, found.revert_to) == (
        rd.Action.SCALE_UP,
        rd.Reason.RESIZE_DEFERRED_TOO_LONG,
        None,
    )


def test_the_deferral_bound_is_two_minutes() -> None:
    assert rd.DEFERRED_SECONDS == 120.0


def test_the_pending_conditions_time_is_read() -> None:
    condition = {
        "type": "PodResizePending",
        "status": "True",
        "reason": "Deferred",
        "message": "Node didn't have enough capacity: memory",
        "lastTransitionTime": "2026-01-01T00:00:00Z",
    }
    found = rd.resize_status(pod([condition]))
    assert (found.state, found.since) == (rd.PodResize.DEFERRED, 1767225600.0)
    assert rd.resize_status(pod([{**condition, "lastTransitionTime": "yesterday"}])).since is None
    assert rd.resize_status(pod(resize="Deferred")).since is None


# -- a pod's memory request, as the node admits it ---------------------------------------------


def _requesting(*, init: Sequence[dict[str, Any]] = (), **spec: Any) -> dict[str, Any]:
    worker = {"name": "worker", "resources": {"requests": {"memory": "1Gi"}, "limits": {"memory": "1Gi"}}}
    return {"spec": {"containers": [worker], "initContainers": list(init), **spec}}


SIDECAR = {"name": "memops-spill-owner", "restartPolicy": "Always", "resources": {"requests": {"memory": "64Mi"}}}
SETUP = {"name": "setup", "resources": {"requests": {"memory": "256Mi"}}}


@pytest.mark.parametrize(
    ("pod_body", "expected"),
    [
        pytest.param(_requesting(), Gi, id="one-container"),
        pytest.param(_requesting(init=[SIDECAR]), Gi + 64 * Mi, id="a-restartable-init-container-runs-beside"),
        pytest.param(_requesting(overhead={"memory": "120Mi"}), Gi + 120 * Mi, id="the-runtime-class-overhead"),
        pytest.param(_requesting(init=[SETUP]), Gi, id="an-init-container-that-ended-fits-in-the-rest"),
        pytest.param(
            _requesting(init=[SIDECAR, {**SETUP, "resources": {"requests": {"memory": "2Gi"}}}]),
            2 * Gi + 64 * Mi,
            id="an-init-container-larger-than-the-rest-with-the-sidecars-started-before-it",
        ),
        pytest.param(
            _requesting(init=[SIDECAR], overhead={"memory": "120Mi"}, resources={"requests": {"memory": "3Gi"}}),
            3 * Gi + 120 * Mi,
            id="pod-level-resources-and-overhead",
        ),
    ],
)
def test_a_pods_request_counts_every_container_and_the_overhead(pod_body: dict[str, Any], expected: int) -> None:
    assert rd.pod_request(pod_body) == expected


def test_a_pods_request_counts_what_the_kubelet_allocated() -> None:
    """A resize the kubelet admitted is in the container's allocatedResources, before its spec says so."""
    body = _requesting(init=[SIDECAR])
    body["status"] = {
        "containerStatuses": [{"name": "worker", "allocatedResources": {"memory": "1536Mi"}}],
        "initContainerStatuses": [{"name": "memops-spill-owner", "allocatedResources": {"memory": "128Mi"}}],
    }
    assert rd.pod_request(body) == 1536 * Mi + 128 * Mi


# -- the administrator's bounds: where growth may act, and how far -----------------------------


def test_the_administrator_lists_the_namespaces_and_the_ceiling() -> None:
    """``memops run --resize-in dask --resize-in ml --max-resize-limit 32Gi --max-resize-limit-in ml=8Gi``."""
    admin = rd.administrator("32Gi", ["ml=8Gi"], ["dask", "ml"])
    assert (admin.ceiling_in("dask"), admin.ceiling_in("ml"), admin.ceiling_in("other")) == (32 * Gi, 8 * Gi, None)
    every = rd.administrator("64Gi", [], ["*"])
    assert every.ceiling_in("any") == 64 * Gi
    assert rd.administrator().ceiling_in("dask") is None, "by default, no namespace"
    assert rd.administrator().ceiling == 64 * Gi, "and a ceiling of 64Gi"


@pytest.mark.parametrize(
    ("ceiling", "per_namespace", "namespaces", "message"),
    [
        pytest.param("9e99", [], [], "at most 64Ti", id="ceiling-beyond-the-schemas"),
        pytest.param("lots", [], [], "not a quantity", id="ceiling-not-a-quantity"),
        pytest.param("0", [], [], "more than zero", id="ceiling-zero"),
        pytest.param("64Gi", ["ml"], [], "NAMESPACE=QUANTITY", id="per-namespace-without-a-quantity"),
        pytest.param("64Gi", ["ml=9e99"], [], "at most 64Ti", id="per-namespace-beyond"),
        pytest.param("64Gi", ["Team=8Gi"], [], "not a namespace name", id="per-namespace-not-a-namespace"),
        pytest.param("64Gi", [], ["team,ml"], "not a namespace name", id="opt-in-not-a-namespace"),
    ],
)
def test_the_administrators_flags_are_checked(
    ceiling: str, per_namespace: list[str], namespaces: list[str], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        rd.administrator(ceiling, per_namespace, namespaces)


def test_the_operator_refuses_bad_resize_flags(capsys: pytest.CaptureFixture[str]) -> None:
    from memops import cli

    assert cli.main(["run", "--max-resize-limit", "9e99"]) == 2
    assert "at most 64Ti" in capsys.readouterr().err
    assert cli.main(["run", "--resize-in", "team,ml"]) == 2
    assert "'team,ml' is not a namespace name" in capsys.readouterr().err
    assert cli.main(["run", "--max-resize-limit-in", "ml"]) == 2
    assert "NAMESPACE=QUANTITY" in capsys.readouterr().err
