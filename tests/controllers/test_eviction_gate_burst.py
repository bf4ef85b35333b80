"""The eviction gate's drain bounds under a burst of concurrent reviews.

Inputs: the gate's decision and drain (:func:`memops.controllers.eviction_webhook.decide_and_drain`),
called concurrently as Kopf calls admission handlers, once per forged review; a stand-in for the
API client (:class:`SlowApi`) whose POST of a RetirementRequest takes a while, and an index that
has not seen any of them yet (its watch event comes after the POST returns). What is asserted:
the RetirementRequests created, at most one per node and policy and
:data:`memops.decisions.eviction_gate.GATE_DRAINS_PER_WINDOW` per policy, however many reviews arrive at once.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from typing import Any, cast

from memops import specs
from memops.clients import kube
from memops.controllers import eviction_webhook as gate
from memops.controllers import policy
from memops.decisions import eviction_gate, timestamps

NAMESPACE, POLICY = "team", "p"
SPEC = specs.MemoryPolicySpec.model_validate(
    {
        "scheduler": {"address": "tcp://dask-scheduler:8786"},
        "workload": {"kind": "Deployment", "name": "w"},
        "eviction": {"gate": True},
    }
)
POLICY_BODY = {"metadata": {"name": POLICY, "namespace": NAMESPACE, "uid": "uid-p"}, "spec": {}}
LOGGER = logging.getLogger("test")


def _pod(name: str, node: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": NAMESPACE, "uid": f"uid-{name}", "labels": {"app": "w"}},
        "spec": {"nodeName": node, "containers": [{"name": "worker"}]},
        "status": {"phase": "Running"},
    }


class SlowApi:
    """The API as ``start_drain`` uses it: the Deployment, its pods, and POSTs that take
    ``post_seconds`` (a RetirementRequest's is kept; a second of one name is a 409)."""

    def __init__(self, pods: list[dict[str, Any]], post_seconds: float = 0.05):
        self.pods = pods
        self.post_seconds = post_seconds
        self.requests: dict[str, dict[str, Any]] = {}

    async def get_or_none(self, path: str) -> dict[str, Any] | None:
        assert path.endswith("/deployments/w"), path
        return {"metadata": {"name": "w"}, "spec": {"selector": {"matchLabels": {"app": "w"}}}}

    async def list(self, path: str, **_: Any) -> list[dict[str, Any]]:
        assert path.endswith("/pods"), path
        return copy.deepcopy(self.pods)

    async def list_not_older_than(self, path: str, version: str | None, **_: Any) -> tuple[list[dict[str, Any]], str]:
        return await self.list(path), "1"

    async def request(self, method: str, path: str, *, body: dict[str, Any], **_: Any) -> dict[str, Any]:
        assert method == "POST", method
        await asyncio.sleep(self.post_seconds)  # the request's round trip: other reviews run meanwhile
        if not path.endswith("/retirementrequests"):
            return body  # an event
        name = body["metadata"]["name"]
        if name in self.requests:
            raise kube.ApiError(409, "AlreadyExists", name)
        created = copy.deepcopy(body)
        created["metadata"]["creationTimestamp"] = timestamps.render(timestamps.now())
        self.requests[name] = created
        return copy.deepcopy(created)


def _cache(requests: list[dict[str, Any]]) -> policy.Cache:
    return policy.Cache(
        {
            policy.INDEX_NAMES["memorypolicies"]: {(NAMESPACE,): [POLICY_BODY]},
            policy.INDEX_NAMES["retirementrequests"]: {(NAMESPACE, POLICY): requests},
            policy.INDEX_NAMES["deployments"]: {},
        }
    )


async def _burst(
    api: SlowApi, cache: policy.Cache, guards: gate.Guards, pods: list[str]
) -> list[eviction_gate.Decision]:
    by_name = {p["metadata"]["name"]: p for p in api.pods}
    return await asyncio.gather(
        *(
            gate.decide_and_drain(
                cast(kube.Kube, api),
                cache,
                guards.guard(NAMESPACE, POLICY),
                pod=by_name[name],
                policy_name=POLICY,
                spec=SPEC,
                held=1000,
                dryrun=False,
                user="system:anonymous",
                logger=LOGGER,
            )
            for name in pods
        )
    )


async def test_a_burst_over_many_nodes_starts_at_most_the_bound() -> None:
    """Fifteen reviews at once, each of a pod on its own node: ten drains start (the bound per
    policy per window), not fifteen, though the index shows none of them; every review is
    refused with 429, and the ones held back say why."""
    nodes = 15
    api = SlowApi([_pod(f"w-{i}", f"n{i}") for i in range(nodes)])
    decisions = await _burst(api, _cache([]), gate.Guards(), [f"w-{i}" for i in range(nodes)])
    assert len(api.requests) == eviction_gate.GATE_DRAINS_PER_WINDOW, sorted(api.requests)
    assert all(not d.allowed and d.code == 429 for d in decisions)
    held_back = [d for d in decisions if not d.start_drain]
    assert len(held_back) == nodes - eviction_gate.GATE_DRAINS_PER_WINDOW
    assert all("the most memops starts" in d.message for d in held_back)


async def test_a_burst_on_one_node_starts_one_drain_and_a_retried_burst_none() -> None:
    """Reviews of a node's pods at once start one drain of that node; a second burst, before the
    index shows that drain, starts no second one (each would have a new name: it counts the
    request that exists)."""
    api = SlowApi([_pod(f"w-{i}", "n1") for i in range(5)])
    guards, cache = gate.Guards(), _cache([])
    await _burst(api, cache, guards, [f"w-{i}" for i in range(5)])
    assert len(api.requests) == 1, sorted(api.requests)
    (drain,) = api.requests.values()
    assert drain["spec"]["workers"] == [f"w-{i}" for i in range(5)]
    again = await _burst(api, cache, guards, [f"w-{i}" for i in range(5)])
    assert len(api.requests) == 1, sorted(api.requests)
    assert all(not d.start_drain and "memops is draining pod" in d.message for d in again)


async def test_once_the_index_shows_a_request_it_is_the_record() -> None:
    """A request the index shows is read from there: finished and deleted there, a new drain of
    the node may start (the record of what this process made does not outlive it)."""
    api = SlowApi([_pod("w-0", "n1")])
    guards = gate.Guards()
    await _burst(api, _cache([]), guards, ["w-0"])
    (made,) = api.requests.values()
    finished = {**made, "status": {"phase": "Succeeded"}}
    await _burst(api, _cache([finished]), guards, ["w-0"])
    assert len(api.requests) == 2, "the finished drain's pod holds data again: a second drain"
    second = next(n for n in api.requests if n != made["metadata"]["name"])
    assert [r["metadata"]["name"] for r in guards.guard(NAMESPACE, POLICY).created] == [second]


def test_the_guards_are_bounded_and_keep_the_busy_ones() -> None:
    guards = gate.Guards(kept=2)
    busy = guards.guard("a", "p")
    busy.created.append({"metadata": {"name": "r"}})
    for i in range(5):
        guards.guard("b", f"p{i}")
    assert len(guards) == 2
    assert guards.guard("a", "p") is busy
