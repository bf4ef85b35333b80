"""What one MemoryPolicy pass asks of the scheduler, and the losses it records from it (preStop drains', workers').

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
from memops_sandbox import dask_direct

from memops import specs
from memops.clients import daskcomm, kube
from memops.controllers import metrics, policy
from memops.decisions import timestamps
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
        await dask_direct.start_drain(scheduler.address, names=[POD], deadline=0.3, origin="preStop")

        async def stopped() -> bool:
            return (await dask_direct.drain_status(scheduler.address))[worker.address]["state"] != drain.State.DRAINING

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
            assert asked.take() == [
                ["identity", "events", "memops_agent:drain_status", "memops_agent:departures", "memops_agent:holdings"]
            ], "one connection, the agent's marker read once"
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


@pytest.mark.parametrize("write_fails", [False, True], ids=["written", "first-write-fails"])
async def test_a_worker_that_left_on_its_own_is_recorded_once_with_its_pods_reason(
    client: tuple[kube.Kube, str], monkeypatch: pytest.MonkeyPatch, write_fails: bool
) -> None:
    """The worker of the policy's pod left the scheduler with scattered keys held nowhere else, and
    its container was OOM-killed and restarted (the pod's status says so, as a kubelet writes it),
    its new worker back in the scheduler. The pass records it in ``status.workerLosses`` with the
    pod's reason and the keys' figures, posts one ``WorkerLost`` Warning and counts it once in the
    metrics, over two passes and a restarted operator (a new :class:`Policy`). ``first-write-fails``:
    the first pass that finds the loss cannot write its status (the API server answers 500 once);
    the next pass finds the loss again, and it is still recorded, said and counted once."""
    kube_client, namespace = client
    events: list[dict[str, Any]] = []
    monkeypatch.setattr(kopf, "event", lambda body, **event: events.append(event))
    spec = {"scheduler": {"address": ""}, "workload": {"kind": "Deployment", "name": "w"}}
    path = kube.resource_path(specs.GROUP, specs.VERSION, "memorypolicies", namespace)
    pods = kube.resource_path("", "v1", "pods", namespace)
    counted = metrics.WORKER_LOSSES.labels(namespace, "p", "OOMKilled")
    lost_bytes = metrics.WORKER_LOST_BYTES.labels(namespace, "p", "OOMKilled")
    counted_before, lost_bytes_before = counted._value.get(), lost_bytes._value.get()
    async with Scheduler(host="127.0.0.1", dashboard_address=":0") as scheduler:
        spec["scheduler"]["address"] = scheduler.address
        body = {"apiVersion": specs.API_VERSION, "kind": "MemoryPolicy", "metadata": {"name": "p"}, "spec": spec}
        await kube_client.request("POST", path, body=body)

        async def reconcile(operator: policy.Policy | None = None) -> policy.Policy:
            stored = kopf.Body(await kube_client.get(f"{path}/p"))
            operator = operator or policy.Policy(client=kube_client, body=stored, logger=LOGGER)
            operator.body = stored  # as Kopf hands the daemon its body: the status as the last pass wrote it
            await operator.reconcile()
            return operator

        async with Client(scheduler.address, asynchronous=True) as dask_client:
            # The client keeps its futures throughout: the keys are lost with the worker, not released.
            async with Worker(scheduler.address, name=POD, nthreads=1) as worker:
                operator = await reconcile()  # installs the agent: it records departures from then on
                data = await dask_client.scatter({f"s{i}": b"s" * 1024 for i in range(3)}, workers=[worker.address])
                held = scheduler.workers[worker.address].nbytes
            assert len(data) == 3
            # The worker has gone with its keys; its container was OOM-killed and restarted.
            killed = timestamps.render(timestamps.now())
            terminated = {"reason": "OOMKilled", "exitCode": 137, "startedAt": killed, "finishedAt": killed}
            container = {
                "name": "w",
                "image": "w.invalid/w:1",
                "imageID": "",
                "ready": True,
                "restartCount": 1,
                "state": {"running": {"startedAt": killed}},
                "lastState": {"terminated": terminated},
            }
            await kube_client.merge_patch(f"{pods}/{POD}/status", {"status": {"containerStatuses": [container]}})
            async with Worker(scheduler.address, name=POD, nthreads=1):  # the restarted container's
                if write_fails:
                    await _fail_once(monkeypatch, kube_client, f"{path}/p/status", reconcile(operator))
                    assert not (await kube_client.get(f"{path}/p"))["status"].get("workerLosses")
                    assert events == [], "nothing said of what the status does not hold"
                recorded = []
                for _ in range(2):
                    operator = await reconcile(operator)
                    recorded.append((await kube_client.get(f"{path}/p"))["status"].get("workerLosses"))
                await reconcile()  # a restarted operator
                recorded.append((await kube_client.get(f"{path}/p"))["status"].get("workerLosses"))
    assert recorded[0] == recorded[1] == recorded[2], "recorded once"
    [loss] = recorded[0]
    assert loss["pod"] == POD and loss["reason"] == "OOMKilled" and loss["exitCode"] == 137
    assert (loss["keys"], loss["bytes"], loss["irreplaceableKeys"]) == (3, held, 3)
    assert [e["reason"] for e in events] == ["WorkerLost"]
    assert (
        events[0]["type"] == "Warning" and f"pod {POD}" in events[0]["message"] and "OOMKilled" in events[0]["message"]
    )
    assert (counted._value.get() - counted_before, lost_bytes._value.get() - lost_bytes_before) == (1, held)


async def _fail_once(monkeypatch: pytest.MonkeyPatch, client: kube.Kube, path: str, work: Any) -> None:
    """Run ``work`` while the API server answers the first write (a PATCH) of ``path`` with a 500."""
    request = client.request
    failed = _fail_request_once(monkeypatch, client, "PATCH", path)
    with pytest.raises(kube.ApiError, match="injected"):
        await work
    monkeypatch.setattr(client, "request", request)
    assert failed == [("PATCH", path)], "the pass wrote its status"


@pytest.mark.parametrize("failing", ["pod", "request", "status"])
async def test_a_write_that_fails_once_is_done_by_the_next_pass_and_nothing_twice(
    client: tuple[kube.Kube, str], monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    """A policy scales its one worker, which holds data nowhere else, down to none. Its pass marks
    the worker's pod against node autoscalers (the disruption annotations), creates the drain's
    RetirementRequest and writes its status. The API server answers one of those writes with a 500,
    once: the next pass of the same daemon, at once, does what was not done, and nothing twice: the
    pod marked, one request, one scale-down in the status and in the events."""
    kube_client, namespace = client
    events: list[dict[str, Any]] = []
    monkeypatch.setattr(kopf, "event", lambda body, **event: events.append(event))
    path = kube.resource_path(specs.GROUP, specs.VERSION, "memorypolicies", namespace)
    requests = kube.resource_path(specs.GROUP, specs.VERSION, "retirementrequests", namespace)
    pod = kube.resource_path("", "v1", "pods", namespace, POD)
    writes = {"pod": ("PATCH", pod), "request": ("POST", requests), "status": ("PATCH", f"{path}/p/status")}
    async with (
        Scheduler(host="127.0.0.1", dashboard_address=":0") as scheduler,
        Worker(scheduler.address, name=POD, nthreads=1) as worker,
        Client(scheduler.address, asynchronous=True) as dask_client,
    ):
        data = await dask_client.scatter({f"u{i}": b"u" * 1024 for i in range(3)}, workers=[worker.address])
        operator = await _replicas_policy(kube_client, path, scheduler.address, 0)
        failed = _fail_request_once(monkeypatch, kube_client, *writes[failing])
        try:
            await operator.reconcile()
        except kube.ApiError as error:
            assert "injected" in str(error)
        assert failed == [writes[failing]], "the pass made that write"
        operator.body = kopf.Body(await kube_client.get(f"{path}/p"))  # as Kopf hands the daemon its body
        await operator.reconcile()
        status = (await kube_client.get(f"{path}/p"))["status"]
        made = (await kube_client.get(requests))["items"]
        annotations = (await kube_client.get(pod))["metadata"].get("annotations") or {}
        assert len(data) == 3  # kept referenced: the keys stay on the worker, held nowhere else
    assert annotations.get("cluster-autoscaler.kubernetes.io/safe-to-evict") == "false", annotations
    assert [r["spec"].get("count") for r in made] == [1], "one drain of the one worker"
    assert status["lastScaleReason"] == "ScaleDown" and len(status["scaleEvents"]) == 1, status
    assert [e["reason"] for e in events if e["reason"] == "ScaleDown"] == ["ScaleDown"], events


@pytest.mark.parametrize("failing", ["scale", "status"])
async def test_a_scale_up_whose_write_fails_once_is_done_and_recorded_once(
    client: tuple[kube.Kube, str], monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    """A policy raises its Deployment from one worker to two: its pass patches the Deployment's
    ``/scale``, then writes its status. The API server answers one of the two with a 500, once: the
    next pass of the same daemon scales (if it had not) and records the scale-up, once each."""
    kube_client, namespace = client
    events: list[dict[str, Any]] = []
    monkeypatch.setattr(kopf, "event", lambda body, **event: events.append(event))
    path = kube.resource_path(specs.GROUP, specs.VERSION, "memorypolicies", namespace)
    deployment = kube.resource_path("apps", "v1", "deployments", namespace, "w")
    writes = {"scale": ("PATCH", f"{deployment}/scale"), "status": ("PATCH", f"{path}/p/status")}
    async with (
        Scheduler(host="127.0.0.1", dashboard_address=":0") as scheduler,
        Worker(scheduler.address, name=POD, nthreads=1),
    ):
        operator = await _replicas_policy(kube_client, path, scheduler.address, 1)
        await operator.reconcile()  # at rest at one worker: its status says so
        await kube_client.merge_patch(f"{path}/p", {"spec": {"replicas": 2}})
        operator.body = kopf.Body(await kube_client.get(f"{path}/p"))
        failed = _fail_request_once(monkeypatch, kube_client, *writes[failing])
        with pytest.raises(kube.ApiError, match="injected"):
            await operator.reconcile()
        assert failed == [writes[failing]], "the pass made that write"
        operator.body = kopf.Body(await kube_client.get(f"{path}/p"))
        await operator.reconcile()
        status = (await kube_client.get(f"{path}/p"))["status"]
        replicas = (await kube_client.get(deployment))["spec"]["replicas"]
    assert replicas == 2
    assert status["lastScaleReason"] == "ScaleUp" and [e["change"] for e in status["scaleEvents"]] == [1], status
    assert [e["reason"] for e in events if e["reason"] == "ScaleUp"] == ["ScaleUp"], events


async def _replicas_policy(client: kube.Kube, path: str, address: str, replicas: int) -> policy.Policy:
    """MemoryPolicy ``p`` of Deployment ``w`` at ``replicas`` workers, and its daemon's pass."""
    spec = {"scheduler": {"address": address}, "workload": {"kind": "Deployment", "name": "w"}, "replicas": replicas}
    body = {"apiVersion": specs.API_VERSION, "kind": "MemoryPolicy", "metadata": {"name": "p"}, "spec": spec}
    await client.request("POST", path, body=body)
    return policy.Policy(client=client, body=kopf.Body(await client.get(f"{path}/p")), logger=LOGGER)


def _fail_request_once(monkeypatch: pytest.MonkeyPatch, client: kube.Kube, method: str, path: str) -> list[Any]:
    """The API server answers the first ``method`` request to ``path`` with a 500; the list returned
    gets that request once it has."""
    request = client.request
    failed: list[Any] = []

    async def failing(verb: str, target: str, **kwargs: Any) -> Any:
        if (verb, target) == (method, path) and not failed:
            failed.append((verb, target))
            raise kube.ApiError(500, "InternalError", "injected: the write failed")
        return await request(verb, target, **kwargs)

    monkeypatch.setattr(client, "request", failing)
    return failed
