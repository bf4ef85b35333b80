"""A scheduler address that leads to another scheduler on each connection, in the sandbox.

Tenant A (a namespace ``…-tenant-a``) runs its own scheduler (a ``dask scheduler`` process) with one
worker pod of its own, and names, in its MemoryPolicy, an address that a TCP forwarder answers
(:mod:`tests.scheduler.forwarder`): the first connection goes to A's scheduler, every later one
to the sandbox's, whose four workers are pods of the test's own namespace (tenant B). The operator, the control
plane and the node agent are the sandbox's own.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import distributed
from memops_sandbox import common as sandbox_cli
from memops_sandbox import dask_direct

from tests import polling
from tests.e2e import windows
from tests.e2e.conftest import Sandbox
from tests.scheduler import forwarder, processes


def _installed(address: str) -> tuple[Any, Any]:
    """The relief and the replication installed in a scheduler (None each where there is none),
    asked as an owner that has neither, which changes nothing (and installs nothing)."""

    async def ask() -> tuple[Any, Any]:
        relief = await dask_direct.configure_relief(address, above=None, to=None, owner="nobody/probe")
        replication = await dask_direct.configure_replication(address, rules=None, places={}, owner="nobody/probe")
        return relief, replication

    return asyncio.run(ask())


def test_a_policy_acts_only_on_the_scheduler_it_vouched_for(sandbox: Sandbox) -> None:
    """A's policy (pressure relief, 16 replicas) vouches for A's scheduler on the first connection
    and acts there; every later pass meets B's scheduler, refuses it, and sends it nothing: B's
    scheduler gets no relief and no replication of A's, B's workers are not drained, and none of
    their addresses appears in A's status.
    (Before: relief and replication, vouched for on one connection, were installed on the next
    ones, in B's scheduler, owned by A's policy.)"""
    # A's scheduler and the forwarder listen where the operator's pod and A's worker reach them.
    host = sandbox.host_address
    port = forwarder.free_port(host)
    a_scheduler = processes.spawn_scheduler(port, host)
    try:
        a_address = f"tcp://{host}:{port}"
        tenant = sandbox.make_namespace("tenant-a")
        sandbox.kubectl("create", "serviceaccount", "dask-worker", "-n", tenant)
        workers = sandbox_cli.worker_deployment(a_address, 1)
        workers["metadata"]["namespace"] = tenant
        workers["spec"]["template"]["spec"]["serviceAccountName"] = "dask-worker"
        sandbox.apply(workers)
        with distributed.Client(a_address, timeout=30) as a_client:
            a_client.wait_for_workers(1, timeout=90)
        with forwarder.in_thread([a_address, sandbox.scheduler_address], host) as proxy:
            sandbox.apply(
                {
                    "apiVersion": "memops.dev/v1alpha1",
                    "kind": "MemoryPolicy",
                    "metadata": {"name": "p", "namespace": tenant},
                    "spec": {
                        "scheduler": {"address": proxy.address},
                        "workload": {"kind": "Deployment", "name": "dask-worker"},
                        "pressure": {"relieveAbove": "70%", "relieveTo": "55%"},
                        "replication": {"default": 16},
                    },
                }
            )

            def refused() -> dict[str, Any] | None:
                status: dict[str, Any] = sandbox.get("mempol", "p", "-n", tenant).get("status", {})
                reachable = [c for c in status.get("conditions", []) if c["type"] == "SchedulerReachable"]
                return status if reachable and reachable[0]["reason"] == "ForeignScheduler" else None

            status = sandbox.wait_for(refused, what="a later pass to refuse B's scheduler")
            # Every pass from now on meets B's scheduler: none of them may send it anything.
            polling.stays(
                lambda: refused() is not None and _installed(sandbox.scheduler_address) == (None, None),
                seconds=windows.POLICY_PASS,
                what="B's scheduler refused, and nothing of A's installed there",
            )
            status = sandbox.wait_for(refused, what="the refusal, as the last pass wrote it")
            assert len(proxy.routed) >= 2, "the refusing pass and one more met B's scheduler"
        b_pods = sandbox.get("pods", "-l", "app=dask-worker")["items"]  # on real Nodes the scheduler is a pod too
        b_ips = {p["status"]["podIP"] for p in b_pods if p["status"].get("podIP")}
        assert len(b_ips) == 4
        written = json.dumps(status)
        assert not [ip for ip in b_ips if ip in written], status
        assert _installed(sandbox.scheduler_address) == (None, None), "A's policy reached B's scheduler"
        relief, replication = _installed(a_address)
        assert relief is not None and relief["owner"] == f"{tenant}/p", "the first pass acted on A's scheduler"
        assert replication is not None and replication["owner"] == f"{tenant}/p"
        with distributed.Client(sandbox.scheduler_address, timeout=30) as b_client:
            statuses = [w["status"] for w in b_client.scheduler_info(n_workers=-1)["workers"].values()]
        assert statuses == ["running"] * 4, "no worker of B's was drained"
    finally:
        processes.kill(a_scheduler)
