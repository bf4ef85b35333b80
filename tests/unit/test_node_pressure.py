"""The kubelet's next memory evictions, predicted (memops.decisions.node_pressure): pure."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any, cast

import pydantic
import pytest

from memops import specs
from memops.clients import kube
from memops.controllers import kubelets
from memops.decisions import eviction_gate, node_pressure, objects
from memops.decisions.node_pressure import PodUsage

MiB = 2**20


def pod(name: str, usage: int, request: int = 0, priority: int = 0, namespace: str = "dask") -> PodUsage:
    return PodUsage(namespace=namespace, name=name, usage=usage * MiB, request=request * MiB, priority=priority)


def test_the_ranking_is_the_kubelets() -> None:
    """Over their request first, then lower priority, then the larger use above the request."""
    pods = [
        pod("within", usage=900, request=1000),
        pod("over-high-priority", usage=300, request=100, priority=1000),
        pod("over-a-little", usage=200, request=100),
        pod("over-a-lot", usage=700, request=100),
        pod("within-low-priority", usage=50, request=100, priority=-5),
    ]
    assert [p.name for p in node_pressure.ranked(pods)] == [
        "over-a-lot",
        "over-a-little",
        "over-high-priority",
        "within-low-priority",
        "within",
    ]


def node(headroom_mib: int, pods: list[PodUsage], pressure: bool = False) -> node_pressure.NodeMemory:
    signal = node_pressure.Signal("allocatableMemory.available", (100 + headroom_mib) * MiB, 100 * MiB)
    return node_pressure.NodeMemory(node="n1", signals=(signal,), pods=tuple(pods), pressure=pressure)


OURS = {("dask", "w-1"): "w-1", ("dask", "w-2"): "w-2"}


def test_no_prediction_with_room_beyond_the_margin() -> None:
    assert node_pressure.predict(node(300, [pod("w-1", 500)]), 256 * MiB, OURS) is None


def test_within_the_margin_the_walk_stops_once_the_evictions_free_enough() -> None:
    pods = [pod("w-1", 400), pod("w-2", 300), pod("other", 200, namespace="else")]
    found = node_pressure.predict(node(100, pods), 256 * MiB, OURS)
    assert found is not None
    # 156 MiB short of the margin: the first victim (400 MiB) is enough.
    assert [p.name for p in found.victims] == ["w-1"] and found.ours == ("w-1",)
    assert found.headroom == 100 * MiB and found.signal == "allocatableMemory.available"
    # Past the threshold by 300 MiB: 556 MiB must go, two victims.
    found = node_pressure.predict(node(-300, pods), 256 * MiB, OURS)
    assert found is not None and found.ours == ("w-1", "w-2")


def test_another_namespaces_pod_ranked_first_is_counted_but_not_ours() -> None:
    pods = [pod("w-1", 300, request=100), pod("hog", 900, namespace="else")]
    found = node_pressure.predict(node(0, pods), 256 * MiB, OURS)
    assert found is not None and [p.name for p in found.victims] == ["hog"] and found.ours == ()


def test_the_pressure_condition_alone_predicts() -> None:
    found = node_pressure.predict(node(900, [pod("w-2", 10)], pressure=True), 256 * MiB, OURS)
    assert found is not None and found.ours == ("w-2",)


@pytest.mark.parametrize(("value", "capacity", "expected"), [("100Mi", 0, 100 * MiB), ("10%", 1000, 100)])
def test_thresholds(value: str, capacity: int, expected: int) -> None:
    assert node_pressure.threshold_bytes(value, capacity) == expected


def test_a_threshold_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError):
        node_pressure.threshold_bytes("150%", 1000)


def kube_pod(name: str, memory: str | None, namespace: str = "dask", **spec: Any) -> dict[str, Any]:
    resources = {"requests": {"memory": memory}} if memory else {}
    return {
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"containers": [{"name": "c", "resources": resources}], **spec},
        "status": {"phase": "Running"},
    }


def summary(pods: dict[tuple[str, str], int], *, node_available: int, node_working: int, pods_working: int) -> Any:
    return {
        "node": {
            "nodeName": "n1",
            "memory": {"availableBytes": node_available, "workingSetBytes": node_working},
            "systemContainers": [
                {"name": "kubelet", "memory": {"workingSetBytes": 1}},
                {
                    "name": "pods",
                    "memory": {"availableBytes": 2 * 2**30 - pods_working, "workingSetBytes": pods_working},
                },
            ],
        },
        "pods": [
            {
                "podRef": {"namespace": ns, "name": name},
                "memory": {"workingSetBytes": usage},
                "containers": [{"name": "c", "memory": {"workingSetBytes": usage // 2}}],
            }
            for (ns, name), usage in pods.items()
        ],
    }


NODE = {"metadata": {"name": "n1"}, "status": {"allocatable": {"memory": "2Gi"}, "conditions": []}}


def test_node_memory_reads_both_signals_and_the_pods() -> None:
    stats = summary(
        {("dask", "w-1"): 700 * MiB, ("dask", "sched"): 100 * MiB},
        node_available=20 * 2**30,
        node_working=4 * 2**30,
        pods_working=1800 * MiB,
    )
    config = {"evictionHard": {"memory.available": "300Mi"}, "enforceNodeAllocatable": ["pods"]}
    pods = [kube_pod("w-1", "100Mi"), kube_pod("sched", "512Mi", priority=10), kube_pod("gone", "1Gi")]
    seen = node_pressure.node_memory(NODE, stats, config, pods)
    by_name = {s.name: s for s in seen.signals}
    assert by_name["memory.available"].headroom == 20 * 2**30 - 300 * MiB
    # The pods' cgroup is limited to 2 GiB: the threshold applies to what is left of it.
    assert by_name["allocatableMemory.available"].headroom == (2048 - 1800 - 300) * MiB
    assert seen.tightest is not None and seen.tightest.name == "allocatableMemory.available"
    assert {(p.name, p.usage, p.request, p.priority) for p in seen.pods} == {
        ("w-1", 700 * MiB, 100 * MiB, 0),
        ("sched", 100 * MiB, 512 * MiB, 10),
    }, "a pod the summary does not show is not ranked"


def test_without_enforced_allocatable_only_the_node_signal() -> None:
    stats = summary({}, node_available=MiB, node_working=MiB, pods_working=MiB)
    seen = node_pressure.node_memory(NODE, stats, {"enforceNodeAllocatable": []}, [])
    assert [s.name for s in seen.signals] == ["memory.available"]


def test_the_request_is_the_kubelets() -> None:
    """Containers summed, the largest init container if larger, plus the pod's overhead."""
    body = kube_pod("w", "100Mi")
    body["spec"]["containers"].append({"resources": {"requests": {"memory": "50Mi"}}})
    assert node_pressure.pod_request(body) == 150 * MiB
    body["spec"]["initContainers"] = [{"resources": {"requests": {"memory": "1Gi"}}}]
    body["spec"]["overhead"] = {"memory": "10Mi"}
    assert node_pressure.pod_request(body) == 1034 * MiB
    assert node_pressure.pod_request(kube_pod("best-effort", None, overhead={"memory": "10Mi"})) == 0


def test_the_pod_cgroups_working_set_else_its_containers() -> None:
    stats = summary({("dask", "w-1"): 700 * MiB}, node_available=1, node_working=1, pods_working=1)
    del stats["pods"][0]["memory"]
    seen = node_pressure.node_memory(NODE, stats, {}, [kube_pod("w-1", None)])
    assert [p.usage for p in seen.pods] == [350 * MiB]


def test_critical_pods_are_never_victims() -> None:
    pods = [pod("w-1", 100), pod("node-critical", 900, priority=2_000_001_000)]
    assert [p.name for p in node_pressure.ranked(pods)] == ["w-1"]


@pytest.mark.parametrize(
    "hostile",
    [
        {},
        {"node": "x", "pods": "y"},
        {"node": {"memory": {"availableBytes": "1", "workingSetBytes": True}}, "pods": [1, None, {"podRef": 3}]},
        {"node": {"memory": {"availableBytes": 2**70, "workingSetBytes": -1}, "systemContainers": {"pods": 1}}},
        {
            "pods": [
                {
                    "podRef": {"namespace": "dask", "name": "w-1"},
                    "memory": {"workingSetBytes": 2**64},
                    "containers": [{"memory": {"workingSetBytes": 2**64}}],
                }
            ]
        },
    ],
)
def test_a_malformed_summary_leaves_out_what_it_cannot_say(hostile: Any) -> None:
    seen = node_pressure.node_memory(NODE, hostile, {"evictionHard": "nope"}, [kube_pod("w-1", "1Gi")])
    assert all(isinstance(s.available, int) and s.available < 2**63 for s in seen.signals)
    assert all(0 <= p.usage < 2**63 for p in seen.pods)
    node_pressure.predict(seen, 0, OURS)  # and it does not raise either


def unlisted(name: str, usage: int, namespace: str = "else") -> PodUsage:
    """A pod of a namespace the operator may not list, as :func:`node_pressure.node_memory` ranks it."""
    return PodUsage(namespace=namespace, name=name, usage=usage * MiB, request=0, listed=False)


@pytest.mark.parametrize(("ours", "theirs"), [("a", "z"), ("z", "a")], ids=["ours-sorts-first", "ours-sorts-last"])
def test_pods_that_cannot_be_listed_rank_by_the_workers_own_figures_not_by_name(ours: str, theirs: str) -> None:
    """A worker over its request ranks ahead of them (the kubelet's first key puts it in the
    front); one within its request after them (they may be over theirs); never by the names."""
    pods = [
        pod("w-within", usage=900, request=1000, namespace=ours),
        unlisted("hog", 3000, namespace=theirs),
        pod("w-over", usage=300, request=100, priority=100, namespace=ours),
        unlisted("small", 10, namespace=theirs),
        pod("w-within-low-priority", usage=50, request=100, priority=-5, namespace=ours),
    ]
    assert [p.name for p in node_pressure.ranked(pods)] == [
        "w-over",
        "hog",
        "small",
        "w-within-low-priority",
        "w-within",
    ]


def test_a_tenant_over_its_requests_that_cannot_be_listed_gets_no_worker_within_its_request_predicted() -> None:
    """The node is within the margin because of another namespace's pod: its eviction is counted
    first, and the policy's workers, within their requests, are no victims."""
    ours = {("a", "w-1"): "w-1", ("a", "w-2"): "w-2"}
    pods = [pod("w-1", 600, request=1024, namespace="a"), pod("w-2", 600, 1024, namespace="a"), unlisted("hog", 3072)]
    found = node_pressure.predict(node(100, pods), 256 * MiB, ours)
    assert found is not None and [p.name for p in found.victims] == ["hog"] and found.ours == ()


def test_where_the_pods_that_cannot_be_listed_free_too_little_the_workers_within_their_requests_are_next() -> None:
    ours = {("a", "w-1"): "w-1"}
    pods = [pod("w-1", 600, request=1024, namespace="a"), unlisted("small", 50)]
    found = node_pressure.predict(node(100, pods), 256 * MiB, ours)
    assert found is not None and found.ours == ("w-1",)


def test_node_memory_stands_in_only_for_the_pods_of_namespaces_not_listed() -> None:
    """A pod of a listed namespace that the list does not show (deleted since) is not ranked; one
    of another namespace is, by its usage alone: no request, priority 0, marked as not listed."""
    stats = summary(
        {("dask", "w-1"): 300 * MiB, ("dask", "gone"): 500 * MiB, ("else", "hog"): 900 * MiB},
        node_available=1,
        node_working=1,
        pods_working=1,
    )
    seen = node_pressure.node_memory(NODE, stats, {}, [kube_pod("w-1", "100Mi", priority=7)], listed={"dask"})
    assert {(p.namespace, p.name, p.usage, p.request, p.priority, p.listed) for p in seen.pods} == {
        ("dask", "w-1", 300 * MiB, 100 * MiB, 7, True),
        ("else", "hog", 900 * MiB, 0, 0, False),
    }
    assert seen.unlisted == 1
    everything = node_pressure.node_memory(NODE, stats, {}, [kube_pod("w-1", "100Mi")])
    assert [p.name for p in everything.pods] == ["w-1"] and everything.unlisted == 0, "all listed: no stand-in"


def test_the_status_says_where_the_ranking_is_partial() -> None:
    seen = node_pressure.Seen(predictions=(prediction("w-1"),), unlisted={"n1": 2, "n2": 1})
    status = node_pressure.status(None, seen, node_pressure.Plan(), "t")
    (entry,) = status.nodes
    assert entry.partialRanking is True
    assert status.message.startswith(
        "nodes n1, n2: the pods of other namespaces could not be listed (ranked by their usage alone"
    ), status.message
    complete = node_pressure.status(
        None, node_pressure.Seen(predictions=(prediction("w-1"),)), node_pressure.Plan(), "t"
    )
    assert complete.nodes[0].partialRanking is False and complete.message == ""


def test_the_status_shows_a_tenant_only_its_own_pods() -> None:
    """A tenant may place a pod on any Node: its policy's status must not tell it the Node's headroom
    or how many pods of other namespaces are there, only its own workers' part."""
    others = node_pressure.Prediction(
        node="n1",
        headroom=-3 * MiB,
        signal="memory.available",
        victims=(pod("their-pod", 900, namespace="other"), pod("w-1", 100)),
        ours=("w-1",),
    )
    seen = node_pressure.Seen(predictions=(others,), unlisted={"n1": 7})
    status = node_pressure.status(None, seen, node_pressure.Plan(), "t")
    written = status.model_dump_json()
    assert "their-pod" not in written and "headroom" not in written.lower(), written
    assert str(-3 * MiB) not in written and "7" not in status.message, written
    assert status.nodes[0].model_dump() == {
        "node": "n1",
        "signal": "memory.available",
        "workers": ["w-1"],
        "drained": [],
        "partialRanking": True,
    }


def test_the_margin_is_bounded() -> None:
    spec = {"scheduler": {"address": "tcp://s:8786"}, "workload": {"kind": "Deployment", "name": "w"}}
    for margin, ok in (("4Gi", True), ("256Mi", True), ("5Gi", False), ("9e99", False)):
        body = {**spec, "eviction": {"nodePressure": {"margin": margin}}}
        if ok:
            specs.MemoryPolicySpec.model_validate(body)
        else:
            with pytest.raises(pydantic.ValidationError, match="at most 4Gi"):
                specs.MemoryPolicySpec.model_validate(body)


OWNER = objects.Owner(name="pol", namespace="dask", uid="u-1")
NOW = 1_800_000_000.0
SPEC = specs.MemoryPolicySpec.model_validate(
    {
        "scheduler": {"address": "tcp://dask-scheduler:8786"},
        "workload": {"kind": "Deployment", "name": "dask-worker"},
        "eviction": {"nodePressure": {"margin": "256Mi"}},
    }
)


def prediction(*ours: str, node_name: str = "n1") -> node_pressure.Prediction:
    victims = tuple(pod(name, 100) for name in ours)
    return node_pressure.Prediction(
        node=node_name, headroom=50 * MiB, signal="memory.available", victims=victims, ours=ours
    )


def test_plan_drains_only_the_victims_that_hold_data_alone_and_are_not_draining() -> None:
    seen = node_pressure.Seen(
        predictions=(prediction("w-1", "w-2", "w-3"), prediction("w-9", node_name="n2")),
        unique={"w-1": 10, "w-2": 0, "w-3": 5, "w-9": 1},
        room={"n1": 0, "n2": 0, "n3": 100},
    )
    running = {"metadata": {"name": "r"}, "spec": {"workers": ["w-3"]}, "status": {"phase": "Draining"}}
    done = {"metadata": {"name": "d"}, "spec": {"workers": ["w-9"]}, "status": {"phase": "Succeeded"}}
    planned = node_pressure.plan(OWNER, SPEC, seen, [running, done], NOW)
    assert planned.drained == {"n1": ("w-1",), "n2": ("w-9",)} and planned.refused == ()
    first = planned.requests[0]
    assert first["spec"]["workers"] == ["w-1"] and first["spec"]["removePods"] is False
    assert first["metadata"]["labels"][eviction_gate.REASON_LABEL] == eviction_gate.EVICTION
    assert "n1" in first["metadata"]["annotations"]["memops.dev/why"]


def test_plan_drains_nothing_without_the_schedulers_word() -> None:
    seen = node_pressure.Seen(predictions=(prediction("w-1"),), room={"n2": 2**40})
    planned = node_pressure.plan(OWNER, SPEC, seen, [], NOW)
    assert planned.requests == () and planned.drained == {}


def test_a_victim_is_drained_only_where_the_other_nodes_have_room_for_its_data() -> None:
    """Else its keys would push them into the margin, to be drained back: a ping-pong."""
    seen = node_pressure.Seen(
        predictions=(prediction("w-1", "w-2"),),
        unique={"w-1": 600 * MiB, "w-2": 600 * MiB},
        room={"n1": -50 * MiB, "n2": 700 * MiB, "n3": 300 * MiB},
    )
    planned = node_pressure.plan(OWNER, SPEC, seen, [], NOW)
    # 1,000 MiB of room elsewhere: the first victim's 600 fit; then 400 are left for the second.
    assert planned.drained == {"n1": ("w-1",)}
    (why,) = planned.refused
    assert why.startswith("node n1: w-2 holds 600 MiB alone")
    status = node_pressure.status(None, seen, planned, "t")
    assert "w-2 holds 600 MiB" in status.message and status.drains == 1


def test_status_counts_drains_across_passes() -> None:
    seen = node_pressure.Seen(predictions=(prediction("w-1", "w-2"),), message="node n3: Forbidden")
    first = node_pressure.status(None, seen, node_pressure.Plan(drained={"n1": ("w-1",)}), "t1")
    second = node_pressure.status(first, seen, node_pressure.Plan(), "t2")
    assert first.drains == 1 and second.drains == 1 and second.lastRead == "t2"
    (entry,) = second.nodes
    assert entry.workers == ["w-1", "w-2"] and entry.drained == []
    assert second.message == "node n3: Forbidden"


class Kubelet:
    """The API server as :mod:`memops.controllers.kubelets` reads it, and the kubelets (:func:`through`):
    answers by path, and the paths asked."""

    def __init__(self, answers: dict[str, Any], forbidden: frozenset[str] = frozenset()):
        self.answers, self.forbidden, self.asked = answers, forbidden, []

    async def get(self, path: str, **params: str) -> Any:
        self.asked.append(path)
        if path in self.forbidden:
            raise kube.ApiError(403, "Forbidden", "nodes/stats")
        return self.answers[path]

    async def list(self, path: str, *, field_selector: str | None = None, **_: Any) -> Any:
        self.asked.append(f"{path}?{field_selector}")
        if path in self.forbidden:
            raise kube.ApiError(403, "Forbidden", "pods")
        return self.answers[f"{path}?{field_selector}"]


def through(api: Kubelet) -> kubelets.Kubelets:
    """Kubelets whose own API (:mod:`memops.clients.kubelet_api`) ``api`` answers, at
    ``kubelet:<node><path>``."""

    class Reader:
        async def get(self, node: dict[str, Any], path: str) -> Any:
            return await api.get(f"kubelet:{node['metadata']['name']}{path}")

    @contextlib.asynccontextmanager
    async def reading(_: kube.Kube) -> AsyncIterator[Reader]:
        yield Reader()

    return kubelets.Kubelets(reading=cast(Any, reading))


async def test_the_kubelets_are_read_from_the_kubelets_themselves() -> None:
    stats = summary({("dask", "w-1"): 1900 * MiB}, node_available=2**33, node_working=2**30, pods_working=1900 * MiB)
    api = Kubelet(
        {
            "/api/v1/nodes/n1": NODE,
            "kubelet:n1/stats/summary": stats,
            "kubelet:n1/configz": {"kubeletconfig": {"evictionHard": {"memory.available": "100Mi"}}},
            "/api/v1/pods?spec.nodeName=n1": [kube_pod("w-1", "64Mi")],
        }
    )
    worker = {"metadata": {"namespace": "dask", "name": "w-1"}, "spec": {"nodeName": "n1"}}
    client = cast(kube.Kube, api)
    seen = await kubelets.read(client, through(api), pods=[worker], margin=256 * MiB, logger=logging.getLogger())
    (found,) = seen.predictions
    assert found.ours == ("w-1",) and found.signal == "allocatableMemory.available" and seen.message == ""
    assert seen.room == {"n1": found.headroom - 256 * MiB}
    # The configuration is read once, then reused.
    cache = through(api)
    await kubelets.read(client, cache, pods=[worker], margin=0, logger=logging.getLogger())
    await kubelets.read(client, cache, pods=[worker], margin=0, logger=logging.getLogger())
    assert api.asked.count("kubelet:n1/configz") == 2
    assert not [path for path in api.asked if "/proxy" in path], "never through the API server's node proxy"


async def test_a_kubelets_refusal_is_named_in_the_status_message() -> None:
    api = Kubelet({"/api/v1/nodes/n1": NODE}, forbidden=frozenset({"kubelet:n1/stats/summary"}))
    api.answers["kubelet:n1/configz"] = {}
    worker = {"metadata": {"namespace": "dask", "name": "w-1"}, "spec": {"nodeName": "n1"}}
    seen = await kubelets.read(cast(kube.Kube, api), through(api), pods=[worker], margin=0, logger=logging.getLogger())
    assert seen.predictions == () and seen.message.startswith("node n1: ")


def test_a_node_drained_in_the_last_minute_takes_no_other_nodes_keys() -> None:
    """Else keys drained off it come straight back from the Node they went to."""
    seen = node_pressure.Seen(
        predictions=(prediction("w-9", node_name="n2"),), unique={"w-9": 100 * MiB}, room={"n1": 2**30, "n2": -1}
    )
    recent = eviction_gate.drain_request(OWNER, SPEC, node="n1", pods=["w-1"], earlier=0, why="x")
    recent["metadata"]["creationTimestamp"] = "2027-01-15T07:59:30Z"  # NOW less 30 s
    planned = node_pressure.plan(OWNER, SPEC, seen, [recent], NOW)
    assert planned.drained == {} and planned.refused
    recent["metadata"]["creationTimestamp"] = "2027-01-15T07:57:30Z"  # NOW less 150 s
    assert node_pressure.plan(OWNER, SPEC, seen, [recent], NOW).drained == {"n2": ("w-9",)}


async def test_a_refused_cluster_wide_listing_lists_the_policys_namespace_and_is_not_asked_every_pass() -> None:
    stats = summary(
        {("dask", "w-1"): 1900 * MiB, ("else", "x"): MiB},
        node_available=2**33,
        node_working=2**30,
        pods_working=1900 * MiB,
    )
    api = Kubelet(
        {
            "/api/v1/nodes/n1": NODE,
            "kubelet:n1/stats/summary": stats,
            "kubelet:n1/configz": {"kubeletconfig": {}},
            "/api/v1/namespaces/dask/pods?spec.nodeName=n1": [kube_pod("w-1", "64Mi")],
        },
        forbidden=frozenset({"/api/v1/pods"}),
    )
    worker = {"metadata": {"namespace": "dask", "name": "w-1"}, "spec": {"nodeName": "n1"}}
    cache = through(api)
    for _ in range(2):
        seen = await kubelets.read(
            cast(kube.Kube, api), cache, pods=[worker], margin=256 * MiB, logger=logging.getLogger()
        )
        (found,) = seen.predictions
        assert found.ours == ("w-1",) and seen.unlisted == {"n1": 1}
    assert api.asked.count("/api/v1/pods?spec.nodeName=n1") == 1, "the refusal is remembered"
    assert api.asked.count("/api/v1/namespaces/dask/pods?spec.nodeName=n1") == 2
