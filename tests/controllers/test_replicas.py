"""Two replicas of the operator against one upstream API server: the eviction gate's bounds hold
between them, a paused replica's webhooks read the API, and the Lease that locks the gate.

Inputs: the gate's decision and drain (:func:`memops.controllers.eviction_webhook.decide_and_drain`)
called by two "replicas" at once, each with its own in-process guards and its own identity, both
with the chart's ServiceAccount credentials (``operator-kubeconfig``: the chart's RBAC is what
allows or refuses them); real pods bound to named nodes (no node runs); a real MemoryPolicy and
a KopfPeering as Kopf writes it. What is asserted: the RetirementRequests and Leases the API
server holds afterwards, and what each replica reads.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from memops_sandbox import install

from memops import specs
from memops.clients import kube
from memops.controllers import eviction_webhook as gate
from memops.controllers import leases, policy, standing
from memops.decisions import eviction_gate, leadership, objects, timestamps

LOGGER = logging.getLogger("test")
POLICY = "p"
SPEC = {
    "scheduler": {"address": "tcp://127.0.0.1:9"},
    "workload": {"kind": "Deployment", "name": "w"},
    "eviction": {"gate": True},
}


class Cluster:
    def __init__(self, admin: kube.Kube, operator: kube.Kube, namespace: str, policy_body: dict[str, Any]):
        self.admin, self.operator, self.namespace, self.policy = admin, operator, namespace, policy_body

    async def pods(self, nodes: list[str]) -> list[dict[str, Any]]:
        """A Running worker pod of Deployment w on each of ``nodes`` (one per entry)."""
        path = kube.resource_path("", "v1", "pods", self.namespace)
        made = []
        for i, node in enumerate(nodes):
            pod = {
                "metadata": {"name": f"w-{i}", "labels": {"app": "w"}},
                "spec": {"nodeName": node, "containers": [{"name": "w", "image": "w.invalid/w:1"}]},
            }
            await self.admin.request("POST", path, body=pod)
            running = {"phase": "Running", "podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}]}
            made.append(await self.admin.merge_patch(f"{path}/w-{i}/status", {"status": running}))
        return made

    async def requests(self) -> list[dict[str, Any]]:
        path = kube.resource_path(specs.GROUP, specs.VERSION, "retirementrequests", self.namespace)
        return await self.admin.list(path, label_selector=objects.POLICY_LABEL)

    def cache(self) -> policy.Cache:
        """A replica's index as a paused one holds it: the policy, and none of the requests."""
        return policy.Cache(
            {
                policy.INDEX_NAMES["memorypolicies"]: {(self.namespace,): [self.policy]},
                policy.INDEX_NAMES["retirementrequests"]: {},
                policy.INDEX_NAMES["deployments"]: {},
            }
        )


@pytest.fixture
async def cluster(plane: Path, request: pytest.FixtureRequest) -> AsyncIterator[Cluster]:
    admin = kube.Kube(kube.load_connection(str(plane / "kubeconfig")))
    operator = kube.Kube(kube.load_connection(str(plane / "operator-kubeconfig")))
    namespace = "t-" + hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:12]
    template = {"metadata": {"labels": {"app": "w"}}, "spec": {"containers": [{"name": "w", "image": "w.invalid/w:1"}]}}
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "w", "namespace": namespace},
        "spec": {"replicas": 0, "selector": {"matchLabels": {"app": "w"}}, "template": template},
    }
    body = {"apiVersion": specs.API_VERSION, "kind": "MemoryPolicy", "metadata": {"name": POLICY}, "spec": SPEC}
    try:
        await admin.request("POST", "/api/v1/namespaces", body={"metadata": {"name": namespace}})
        await admin.request("POST", kube.resource_path("apps", "v1", "deployments", namespace), body=deployment)
        made = await admin.request(
            "POST", kube.resource_path(specs.GROUP, specs.VERSION, "memorypolicies", namespace), body=body
        )
        yield Cluster(admin, operator, namespace, made)
    finally:
        await admin.close()
        await operator.close()


async def _evict_all(cluster: Cluster, pods: list[dict[str, Any]], replicas: list[str]) -> list[eviction_gate.Decision]:
    """Every pod's eviction reviewed at once, the reviews dealt round the replicas (each with its
    own guards, as separate processes have), every pod holding unique data."""
    guards = {holder: gate.Guards() for holder in replicas}
    spec = specs.MemoryPolicySpec.model_validate(SPEC)
    return await asyncio.gather(
        *(
            gate.decide_and_drain(
                cluster.operator,
                cluster.cache(),
                guards[replicas[i % len(replicas)]].guard(cluster.namespace, POLICY),
                pod=pod,
                policy_name=POLICY,
                spec=spec,
                held=1000,
                dryrun=False,
                user="system:serviceaccount:kube-system:node-drainer",
                logger=LOGGER,
                holder=leases.Holder(replicas[i % len(replicas)], install.NAMESPACE),
            )
            for i, pod in enumerate(pods)
        )
    )


async def test_two_replicas_start_one_drain_of_a_node(cluster: Cluster) -> None:
    """Four pods of one node evicted at once through two replicas whose indexes show nothing:
    one drain of the node, not one per replica; every eviction refused (429), the drain's, the
    one held back by it and the ones that met the other replica's Lease."""
    pods = await cluster.pods(["n1"] * 4)
    decisions = await _evict_all(cluster, pods, ["replica-a", "replica-b"])
    made = await cluster.requests()
    assert len(made) == 1, [r["metadata"]["name"] for r in made]
    assert sorted(made[0]["spec"]["workers"]) == [f"w-{i}" for i in range(4)]
    assert all(not d.allowed and d.code == 429 for d in decisions)
    assert sum(d.start_drain for d in decisions) == 1
    # Retried, through either replica: the drain the API holds is in flight, none starts.
    again = await _evict_all(cluster, pods, ["replica-b", "replica-a"])
    assert len(await cluster.requests()) == 1
    assert not any(d.start_drain for d in again)


async def test_the_bound_per_policy_holds_across_replicas(cluster: Cluster) -> None:
    """Fourteen pods on fourteen nodes, their evictions through two replicas at once, in rounds
    until none is left to try: ten drains start (the bound per policy per window), not ten per
    replica."""
    nodes = 14
    pods = await cluster.pods([f"n{i}" for i in range(nodes)])
    bound = eviction_gate.GATE_DRAINS_PER_WINDOW
    rounds = 0
    while len(await cluster.requests()) < bound and rounds < 50:
        # A review that met the other replica's Lease is refused, and retried, as clients do.
        await _evict_all(cluster, pods, ["replica-a", "replica-b"])
        rounds += 1
    assert len(await cluster.requests()) == bound, f"after {rounds} rounds"
    for _ in range(3):  # more rounds at the bound start nothing more
        decisions = await _evict_all(cluster, pods, ["replica-a", "replica-b"])
        assert not any(d.start_drain for d in decisions)
    assert len(await cluster.requests()) == bound
    # Through one replica alone (no Lease met): the four pods without a drain are held back, and say why.
    decisions = await _evict_all(cluster, pods, ["replica-a"])
    held_back = [d for d in decisions if "the most memops starts" in d.message]
    assert len(held_back) == nodes - bound, [d.message for d in decisions]


async def test_a_lease_is_taken_over_only_once_it_expired(cluster: Cluster) -> None:
    """Held, a Lease refuses another holder; expired, it is taken over, and its former holder's
    release then leaves it with the new one. It is in the operator's namespace, and says what it
    locks."""
    name, ns = leadership.lease_name(cluster.namespace, POLICY), install.NAMESPACE
    locks = {gate.LEASE_ANNOTATION: f"{cluster.namespace}/{POLICY}"}
    first = await leases.acquire(cluster.operator, ns, name, "replica-a", annotations=locks, seconds=1)
    assert first is not None
    assert await leases.acquire(cluster.operator, ns, name, "replica-b") is None, "held: refused"
    await asyncio.sleep(2.2)  # past its duration, not renewed: its holder is gone
    second = await leases.acquire(cluster.operator, ns, name, "replica-b", annotations=locks)
    assert second is not None
    await leases.release(cluster.operator, ns, name, first)  # too late: not the holder's any more
    path = kube.resource_path("coordination.k8s.io", "v1", "leases", ns, name)
    found = await cluster.admin.get(path)
    assert found["spec"]["holderIdentity"] == "replica-b"
    assert found["metadata"]["annotations"] == locks
    await leases.release(cluster.operator, ns, name, second)
    assert "holderIdentity" not in (await cluster.admin.get(path))["spec"]
    assert await leases.acquire(cluster.operator, ns, name, "replica-a") is not None, "given back: free"
    await leases.delete(cluster.operator, ns, name)
    assert await cluster.admin.get_or_none(path) is None
    await leases.delete(cluster.operator, ns, name)  # already gone: nothing to do


async def test_a_forged_lease_does_not_hold_the_gate(cluster: Cluster) -> None:
    """The gate's Lease is out of a tenant's reach, in the operator's namespace; one forged there
    anyway (by someone who may write it), held for a day by someone else, is taken over after
    LEASE_SECONDS: no eviction of the policy's workers waits a day."""
    name, ns = leadership.lease_name(cluster.namespace, POLICY), install.NAMESPACE
    path = kube.resource_path("coordination.k8s.io", "v1", "leases", ns)
    forged = {"holderIdentity": "tenant", "leaseDurationSeconds": 86400}
    forged["renewTime"] = forged["acquireTime"] = leadership.micro_time(timestamps.now())
    await cluster.admin.request("POST", path, body={"metadata": {"name": name}, "spec": forged})
    assert await leases.acquire(cluster.operator, ns, name, "replica-a") is None, "within LEASE_SECONDS: held"
    await asyncio.sleep(leadership.LEASE_SECONDS + 0.5)
    assert await leases.acquire(cluster.operator, ns, name, "replica-a") is not None
    found = await cluster.admin.get(f"{path}/{name}")
    assert found["spec"]["holderIdentity"] == "replica-a"
    assert found["spec"]["leaseDurationSeconds"] == leadership.LEASE_SECONDS
    await leases.delete(cluster.operator, ns, name)


async def test_a_paused_replica_reads_the_api_and_the_acting_one_its_indexes(cluster: Cluster) -> None:
    """The KopfPeering as Kopf writes it, with two live replicas: the older one acts, its webhook
    reads its indexes; the younger one is paused, its webhook reads the namespace's policies,
    their Deployments and requests from the API, slimmed as the indexes slim them. A forged
    record pauses; a dead peer does not."""
    ns = cluster.namespace
    now = timestamps.now()
    old = standing.Standing("replica-a", leadership.start_priority(now - datetime.timedelta(hours=1)), (ns,))
    young = standing.Standing("replica-b", leadership.start_priority(now), (ns,))
    seen = leadership.micro_time(now)
    status = {peer.identity: {"priority": peer.priority, "lastseen": seen, "lifetime": 15} for peer in (old, young)}
    peering = {
        "apiVersion": "kopf.dev/v1",
        "kind": "KopfPeering",
        "metadata": {"name": standing.PEERING},
        "status": status,
    }
    await cluster.admin.request("POST", kube.resource_path("kopf.dev", "v1", "kopfpeerings", ns), body=peering)
    assert await old.acts(cluster.admin)
    assert not await young.acts(cluster.admin)

    path = kube.resource_path(specs.GROUP, specs.VERSION, "retirementrequests", ns)
    request = objects.policy_request(
        objects.Owner(POLICY, ns, cluster.policy["metadata"]["uid"]),
        specs.MemoryPolicySpec.model_validate(SPEC),
        name="scale-down",
        count=1,
    )
    await cluster.admin.request("POST", path, body=request)
    read = await policy.api_cache(cluster.operator, ns)
    (found,) = read.of("memorypolicies")[(ns,)]
    assert found["metadata"]["uid"] == cluster.policy["metadata"]["uid"]
    assert "managedFields" not in found["metadata"]
    (deployment,) = read.of("deployments")[(ns, "w")]
    assert deployment["spec"]["selector"] == {"matchLabels": {"app": "w"}}
    assert [r["metadata"]["name"] for r in read.of("retirementrequests")[(ns, POLICY)]] == ["scale-down"]

    class Memo:
        kube = cluster.admin
        standing = young

    from_api = await standing.webhook_cache(Memo(), ns, {name: {} for name in policy.INDEX_NAMES.values()})
    assert from_api.of("memorypolicies")[(ns,)] == read.of("memorypolicies")[(ns,)]
    Memo.standing = old
    indexes = {name: {"marker": name} for name in policy.INDEX_NAMES.values()}
    assert (await standing.webhook_cache(Memo(), ns, indexes)).indexes == indexes

    # The old replica's record forged (no lifetime): it pauses, rather than believe it alone.
    status["replica-b"] = {"priority": "high"}
    path = kube.resource_path("kopf.dev", "v1", "kopfpeerings", ns, standing.PEERING)
    await cluster.admin.merge_patch(path, {"status": status})
    old.checked = young.checked = -standing.STANDING_SECONDS
    assert not await old.acts(cluster.admin)
    # The old one dead (not seen for longer than its lifetime): the young one acts.
    stale = leadership.micro_time(now - datetime.timedelta(minutes=5))
    status = {
        "replica-a": {"priority": old.priority, "lastseen": stale, "lifetime": 15},
        "replica-b": {"priority": young.priority, "lastseen": seen, "lifetime": 15},
    }
    await cluster.admin.request(
        "PUT", path, body={**peering, "metadata": {**(await cluster.admin.get(path))["metadata"]}, "status": status}
    )
    assert await young.acts(cluster.admin)


def test_the_operators_namespace_is_the_pods(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Where the gate's Leases go: POD_NAMESPACE (the chart's downward API), else the pod's
    ServiceAccount's namespace file, else "default" (a run outside a pod)."""
    monkeypatch.setattr(standing, "SERVICE_ACCOUNT_NAMESPACE", tmp_path / "namespace")
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    assert standing.own_namespace() == "default"
    (tmp_path / "namespace").write_text("ops\n")
    assert standing.own_namespace() == "ops"
    monkeypatch.setenv("POD_NAMESPACE", "memops")
    assert standing.own_namespace() == "memops"
    assert standing.standing(()).holder.namespace == "memops"
