"""What one MemoryPolicy pass asks of the scheduler, and the preStop losses it records from it.

Inputs: the upstream control plane (``memops-sandbox plane``: etcd and kube-apiserver with
memops' CRDs, one plane for the module, a namespace per test), a real Dask scheduler and worker
in this process, and the real pass (:class:`memops.controllers.policy.Policy`), as the admin. No
node runs: the worker's pod is written with its IP (127.0.0.1, the worker's) as a kubelet would,
so that the scheduler is shown to be the namespace's. What memops asks the scheduler is counted
on its side of the connection (:func:`memops.clients.daskcomm.connect`, wrapped: every call still goes
to the real scheduler). Kopf's event posting is switched off (it needs a running operator).
"""

from __future__ import annotations

import logging
from typing import Any

import kopf
import pytest
from distributed import Client, Scheduler, Worker
from kopf._core.engines import posting

from memops import specs
from memops.clients import daskcomm, daskrpc, kube
from memops.controllers import policy
from memops.scheduler import drain
from tests import polling

LOGGER = logging.getLogger("test")
POD = "w-5d4f8b7c9-abcde"
"""A Deployment's pod name, as the hook's drain names it (and as the worker is named)."""
NODE = "node-a"


class Asked:
    """Every connection memops opens to a Dask server and what it calls on it, in order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.connections: list[list[str]] = []
        connect = daskcomm.connect

        async def counted(address: str, **kwargs: Any) -> daskcomm.Comm:
            comm = await connect(address, **kwargs)
            calls: list[str] = []
            self.connections.append(calls)
            call = comm.call

            async def counted_call(op: str, **arguments: Any) -> Any:
                calls.append(f"{op}:{arguments['operation']}" if "operation" in arguments else op)
                return await call(op, **arguments)

            comm.call = counted_call  # type: ignore[method-assign]
            return comm

        monkeypatch.setattr(daskcomm, "connect", counted)

    def take(self) -> list[list[str]]:
        taken, self.connections = self.connections, []
        return taken


async def test_a_pass_reads_the_workers_and_the_prestop_losses_over_one_connection(
    client: tuple[kube.Kube, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A preStop hook's drain stopped at its deadline with the worker's only copies. Each pass then
    opens one connection to the scheduler and asks it: ``identity`` (whose workers the tenancy
    check finds to be the namespace's pods), memops' agent for the drains, once, telling it where
    the workers run, and the agent's holdings (each worker's unique bytes, for the disruption
    annotations, which are on by default); the loss lands in ``status.safetyNet.lostAtDeadline`` from that
    reply, once over two passes.
    (Before: the pass opened a second connection, and asked the agent there, for the drains.)"""
    kube_client, namespace = client
    settings = kopf.OperatorSettings()
    settings.posting.enabled = False
    posting.settings_var.set(settings)
    async with (
        Scheduler(host="127.0.0.1", dashboard_address=":0") as scheduler,
        Worker(scheduler.address, name=POD, nthreads=1) as worker,
        Client(scheduler.address, asynchronous=True) as dask_client,
    ):
        data = await dask_client.scatter({f"h{i}": b"h" * 1024 for i in range(3)}, workers=[worker.address])
        # The hook's drain: no other worker can take the keys, so it stops at its deadline.
        await daskrpc.start_drain(scheduler.address, names=[POD], deadline=0.3, origin="preStop")

        async def stopped() -> bool:
            return (await daskrpc.drain_status(scheduler.address))[worker.address]["state"] != drain.State.DRAINING

        await polling.poll(stopped, timeout=10, what="the hook's drain to stop", interval=0.05)
        spec = {"scheduler": {"address": scheduler.address}, "workload": {"kind": "Deployment", "name": "w"}}
        body = {"apiVersion": specs.API_VERSION, "kind": "MemoryPolicy", "metadata": {"name": "p"}, "spec": spec}
        path = kube.resource_path(specs.GROUP, specs.VERSION, "memorypolicies", namespace)
        await kube_client.request("POST", path, body=body)
        asked = Asked(monkeypatch)
        losses = []
        for _ in range(2):
            # As Kopf hands the daemon its body: the status as the last pass wrote it.
            stored = kopf.Body(await kube_client.get(f"{path}/p"))
            await policy.Policy(client=kube_client, body=stored, logger=LOGGER).reconcile()
            # "events": whether the agent is there, read once per connection from its marker
            assert asked.take() == [["identity", "events", "memops_agent:drain_status", "memops_agent:holdings"]], (
                "one connection, the drains once"
            )
            status = (await kube_client.get(f"{path}/p"))["status"]
            reachable = next(c for c in status["conditions"] if c["type"] == "SchedulerReachable")
            assert reachable["status"] == "True", reachable
            losses.append(status["safetyNet"]["lostAtDeadline"])
        assert losses[0] == losses[1], "recorded once, not again on the next pass"
        # The same call told the agent where the worker runs, for the hooks' drains to come.
        assert scheduler.plugins[drain.NAME].nodes == {worker.address: NODE}
        [loss] = losses[0]
        assert (loss["pod"], loss["keys"], loss["bytes"], loss["cause"]) == (POD, 3, 3 * 1024, "deadline")
        assert len(data) == 3  # kept referenced: the keys stay on the worker, held nowhere else
