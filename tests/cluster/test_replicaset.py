"""The Deployment stand-in: upstream's deletion ranking (pure), and reconciliation against the store."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

from memops.cluster import memstore, replicaset
from memops.cluster.apiserver import BUILTIN_KINDS


def pod(
    name: str,
    *,
    node: str = "n1",
    phase: str = "Running",
    ready: str | None = "2026-01-01T00:00:00Z",
    cost: int | None = None,
    restarts: int = 0,
    created: str = "2026-01-01T00:00:00Z",
) -> dict[str, Any]:
    annotations = {replicaset.DELETION_COST: str(cost)} if cost is not None else {}
    conditions = [{"type": "Ready", "status": "True", "lastTransitionTime": ready}] if ready else []
    return {
        "metadata": {"name": name, "annotations": annotations, "creationTimestamp": created},
        "spec": {"nodeName": node},
        "status": {"phase": phase, "conditions": conditions, "containerStatuses": [{"restartCount": restarts}]},
    }


@pytest.mark.parametrize(
    ("pods", "first"),
    [
        pytest.param([pod("assigned"), pod("unassigned", node="")], "unassigned", id="1-unassigned-first"),
        pytest.param([pod("running"), pod("pending", phase="Pending", ready=None)], "pending", id="2-pending-first"),
        pytest.param([pod("running"), pod("unknown", phase="Unknown")], "unknown", id="2-unknown-before-running"),
        pytest.param([pod("ready"), pod("not-ready", ready=None)], "not-ready", id="3-not-ready-first"),
        pytest.param(
            [pod("cheap", cost=-100), pod("default"), pod("dear", cost=100)], "cheap", id="4-lowest-cost-first"
        ),
        pytest.param(
            [pod("cost-beats-restarts", cost=-1), pod("restarts", restarts=9)],
            "cost-beats-restarts",
            id="4-cost-before-later-rules",
        ),
        pytest.param([pod("alone", node="n2"), pod("crowded", node="n1")], "crowded", id="5-crowded-node-first"),
        pytest.param(
            [pod("old-ready", ready="2026-01-01T00:00:00Z"), pod("new-ready", ready="2026-01-02T00:00:00Z")],
            "new-ready",
            id="6-ready-more-recently-first",
        ),
        pytest.param([pod("calm"), pod("restarty", restarts=3)], "restarty", id="7-more-restarts-first"),
        pytest.param([pod("older"), pod("newer", created="2026-01-03T00:00:00Z")], "newer", id="8-newer-first"),
    ],
)
def test_rank_pods_for_deletion(pods: list[dict[str, Any]], first: str) -> None:
    related = [*pods, pod("neighbour", node="n1")]
    assert replicaset.rank_pods_for_deletion(pods, related)[0]["metadata"]["name"] == first


@pytest.fixture
def store() -> memstore.MemoryStore:
    store = memstore.MemoryStore()
    for kind in BUILTIN_KINDS:
        store.register(kind)
    store.objects[("namespaces", None, "default")] = {"metadata": {"name": "default"}}
    return store


def deployment(replicas: int) -> dict[str, Any]:
    return {
        "metadata": {"name": "w", "namespace": "default"},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": "w"}},
            "template": {"metadata": {"labels": {"app": "w"}}, "spec": {"containers": [{"name": "c"}]}},
        },
    }


async def test_scale_up_down_honours_deletion_cost_and_gc(store: memstore.MemoryStore) -> None:
    controller = replicaset.DeploymentController(store)
    await store.create("deployments", "default", deployment(3))
    await controller.reconcile_all()
    pods = store.list("pods", "default", {"app": "w"})
    assert len(pods) == 3
    assert all(
        p["metadata"]["name"].startswith("w-") and p["metadata"]["ownerReferences"][0]["kind"] == "Deployment"
        for p in pods
    )
    chosen = pods[1]["metadata"]["name"]
    await store.patch("pods", "default", chosen, {"metadata": {"annotations": {replicaset.DELETION_COST: "-5"}}})
    await store.patch("deployments", "default", "w", {"spec": {"replicas": 2}})
    await controller.reconcile_all()
    assert chosen not in {p["metadata"]["name"] for p in store.list("pods")}, "the cheapest pod goes first"
    assert len(store.list("pods")) == 2
    assert store.get("deployments", "default", "w")["status"]["replicas"] == 2
    await store.delete("deployments", "default", "w")
    await controller.reconcile_all()
    assert store.list("pods") == []


async def test_controller_reacts_to_events(store: memstore.MemoryStore) -> None:
    controller = replicaset.DeploymentController(store, resync_seconds=60)
    task = asyncio.create_task(controller.run())
    try:
        await asyncio.sleep(0)
        await store.create("deployments", "default", deployment(2))
        async with asyncio.timeout(5):
            while len(store.list("pods")) < 2:
                await asyncio.sleep(0.01)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
