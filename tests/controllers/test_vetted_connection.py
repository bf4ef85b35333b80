"""One address, another scheduler on each connection: memops acts only where it vouched.

Inputs: the upstream control plane (``memops-sandbox plane``: etcd and kube-apiserver with
memops' CRDs, one plane for the module, a namespace per test); two real Dask schedulers, each a
process of its own with one worker process: tenant A's (its worker listens on and advertises
127.0.0.2, the IP of its pod in this test's namespace) and tenant B's (127.0.0.3: no pod of the
namespace has it). Between memops and them a TCP forwarder (:mod:`tests.scheduler.forwarder`) at
the address that A's resources name, which sends the first connection to A's scheduler and every
later one to B's: what an ExternalName Service or a DNS name that tenant A switches does, or a TCP
proxy of A's at one fixed IP. The real MemoryPolicy pass (:meth:`memops.controllers.policy.Policy.reconcile`)
and the real RetirementRequest steps (:meth:`memops.controllers.retirement.Retirement.step`) run in
this process, as the admin. No node runs: the pod is written with its IP as a kubelet would. Kopf's
event posting is switched off (it needs a running operator).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

import kopf
import pytest
from kopf._core.engines import posting

from memops import specs
from memops.clients import kube
from memops.controllers import policy, retirement
from tests.scheduler import forwarder

LOGGER = logging.getLogger("test")
POD = "w-5d4f8b7c9-abcde"
A_IP, B_IP = forwarder.A_IP, forwarder.B_IP
POD_IP = A_IP  # the pod of the client fixture (tests/controllers/conftest.py) is tenant A's worker


@pytest.fixture
async def tenants() -> AsyncIterator[forwarder.Tenants]:
    async with forwarder.two_tenants(a_worker_name=POD) as both:
        yield both


@pytest.fixture(autouse=True)
def no_event_posting() -> None:
    settings = kopf.OperatorSettings()
    settings.posting.enabled = False
    posting.settings_var.set(settings)


async def test_a_policy_acts_only_on_the_scheduler_it_vouched_for(
    client: tuple[kube.Kube, str], tenants: forwarder.Tenants
) -> None:
    """A policy with pressure relief and replication targets, whose address leads to A's scheduler
    on the first connection and to B's afterwards. A pass installs relief and replication where it
    vouched, over that one connection; later passes meet B's scheduler, refuse it, and send it
    nothing. B's scheduler gets no relief, no replication, no agent, and no B worker's address
    appears in A's status.
    (Before: the pass vouched on one connection and installed relief and replication on new ones,
    in B's scheduler, owned by A's policy.)"""
    kube_client, namespace = client
    async with forwarder.Forwarder([tenants.a, tenants.b]).serving() as proxy:
        spec = {
            "scheduler": {"address": proxy.address},
            "workload": {"kind": "Deployment", "name": "w"},
            "pressure": {"relieveAbove": "70%", "relieveTo": "55%"},
            "replication": {"default": 16},
        }
        body = {"apiVersion": specs.API_VERSION, "kind": "MemoryPolicy", "metadata": {"name": "p"}, "spec": spec}
        path = kube.resource_path(specs.GROUP, specs.VERSION, "memorypolicies", namespace)
        await kube_client.request("POST", path, body=body)
        conditions = []
        for _ in range(3):
            stored = kopf.Body(await kube_client.get(f"{path}/p"))
            await policy.Policy(client=kube_client, body=stored, logger=LOGGER).reconcile()
            status = (await kube_client.get(f"{path}/p"))["status"]
            conditions.append(next(c for c in status["conditions"] if c["type"] == "SchedulerReachable"))
            assert B_IP not in json.dumps(status), status
        assert conditions[0]["status"] == "True", conditions[0]
        assert [c["reason"] for c in conditions[1:]] == ["ForeignScheduler"] * 2, conditions
        assert proxy.routed[0].endswith(tenants.a.rsplit(":", 1)[1]) and len(proxy.routed) >= 3
        assert await forwarder.on_scheduler(tenants.a, forwarder.memops_in), "the first pass acted on A's scheduler"
        await forwarder.assert_untouched(tenants)


async def test_a_retirement_acts_only_on_the_scheduler_it_vouched_for(
    client: tuple[kube.Kube, str], tenants: forwarder.Tenants
) -> None:
    """A RetirementRequest whose address leads to A's scheduler on the first connection and to
    B's afterwards. Its start chooses A's worker on the connection it vouched on; its drain steps
    meet B's scheduler, refuse it, and retire nothing there. B's worker is never drained, nothing
    of memops reaches B's scheduler, and no B worker's address appears in the request's status.
    (Before: the start read the holdings on a second connection, installing memops' agent in B's
    scheduler and reading what B's workers hold, before it checked them.)"""
    kube_client, namespace = client
    async with forwarder.Forwarder([tenants.a, tenants.b]).serving() as proxy:
        spec = {
            "scheduler": {"address": proxy.address},
            "workload": {"kind": "Deployment", "name": "w"},
            "workers": [POD],
            "timeout": "5m",
        }
        body = {"apiVersion": specs.API_VERSION, "kind": "RetirementRequest", "metadata": {"name": "r"}, "spec": spec}
        path = kube.resource_path(specs.GROUP, specs.VERSION, "retirementrequests", namespace)
        await kube_client.request("POST", path, body=body)
        stored = kopf.Body(await kube_client.get(f"{path}/r"))
        request = retirement.Retirement(client=kube_client, body=stored, logger=LOGGER)
        status = await request.step(specs.RetirementRequestStatus())
        await forwarder.assert_untouched(tenants)
        assert status.phase == specs.Phase.DRAINING, status.message
        assert [w.pod for w in status.workers] == [POD]
        for _ in range(2):
            status = await request.step(status)
            await forwarder.assert_untouched(tenants)
            assert status.phase == specs.Phase.DRAINING, status.message
            reachable = next(c for c in status.conditions if c.type == "SchedulerReachable")
            assert (reachable.status, reachable.reason) == ("False", "ForeignScheduler"), reachable
        written = (await kube_client.get(f"{path}/r"))["status"]
        assert B_IP not in json.dumps(written), written
        assert len(proxy.routed) >= 3
        # A's worker was never retired either: the drain steps met B's scheduler, not A's.
        assert list((await forwarder.on_scheduler(tenants.a, forwarder.workers)).values()) == ["Status.running"]


async def test_a_request_at_its_deadline_names_the_refusal_not_a_slow_answer(
    client: tuple[kube.Kube, str], tenants: forwarder.Tenants
) -> None:
    """A RetirementRequest whose address leads to B's scheduler, which answers 1.5 s late (as under
    CI's load), started after its deadline: it fails as ForeignScheduler, what the scheduler's
    answer shows, and B's worker is untouched.
    (Before: a start cut its call to what was left of the deadline, at least a second, and failed
    the request as SchedulerUnreachable.)"""
    kube_client, namespace = client
    async with forwarder.Forwarder([tenants.b], delay=1.5).serving() as proxy:
        spec = {
            "scheduler": {"address": proxy.address},
            "workload": {"kind": "Deployment", "name": "w"},
            "count": 1,
            "timeout": "1s",
        }
        body = {"apiVersion": specs.API_VERSION, "kind": "RetirementRequest", "metadata": {"name": "r"}, "spec": spec}
        path = kube.resource_path(specs.GROUP, specs.VERSION, "retirementrequests", namespace)
        await kube_client.request("POST", path, body=body)
        stored = kopf.Body(await kube_client.get(f"{path}/r"))
        await asyncio.sleep(1.5)  # past the deadline (creationTimestamp has whole seconds)
        request = retirement.Retirement(client=kube_client, body=stored, logger=LOGGER)
        status = await request.step(specs.RetirementRequestStatus())
        assert status.phase == specs.Phase.FAILED, status.message
        [failed] = [c for c in status.conditions if c.type == "Failed"]
        assert failed.reason == "ForeignScheduler", failed
        assert proxy.routed, "the start asked the scheduler"
        await forwarder.assert_untouched(tenants)
