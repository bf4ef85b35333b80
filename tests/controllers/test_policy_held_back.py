"""Why not, one ``kubectl`` away: a MemoryPolicy pass names the pod it holds back and the rule that holds
it, in ``status.heldBack`` and in one Event, on a real API server.

Inputs: the upstream control plane (``memops-sandbox plane``: etcd and kube-apiserver with memops'
CRDs, a namespace per test, no node), a real Dask scheduler and worker in this process, and the real
pass (:class:`memops.controllers.policy.Policy`), as the admin. The worker's pod is written Running
at the worker's IP, as a kubelet would, so that the scheduler is shown to be the namespace's. The
policy's last scale-down is a RetirementRequest that the policy owns, Failed with the pod Kept, its
status written as the retirement's daemon writes it. Kopf's event posting is replaced by a list.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf
import pytest
from distributed import Scheduler, Worker

from memops import specs
from memops.clients import kube
from memops.controllers import policy
from memops.decisions import drain_decisions, objects, timestamps

LOGGER = logging.getLogger("test")
POD = "w-5d4f8b7c9-kept1"


def _kept_worker(address: str) -> dict[str, Any]:
    """The drain's verdict on the pod: its 64 keys held nowhere else had nowhere to go."""
    cause = specs.WorkerCause(reason=specs.WorkerReason.NOWHERE_TO_GO, bytes=64 * 2**20, keys=64)
    worker = specs.WorkerStatus(pod=POD, address=address, state=specs.WorkerState.KEPT, cause=cause)
    worker.message = drain_decisions.render(worker)
    return worker.model_dump(mode="json", exclude_none=True)


async def test_a_pod_kept_by_the_last_drain_is_held_back_by_name_and_said_once(
    client: tuple[kube.Kube, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``replicas: 0`` of 1, and the last scale-down's drain kept the pod (NowhereToGo) a moment ago:
    two passes wait out the cooldown, the status names the pod and the rule and keeps when the hold
    began, and one Warning Event says it (reason ``NowhereToGo``), not one per pass. A spec change
    lifts the cooldown: the pass makes its next scale-down and holds nothing back."""
    kube_client, namespace = client
    events: list[dict[str, Any]] = []
    monkeypatch.setattr(kopf, "event", lambda body, **event: events.append(event))
    path = kube.resource_path(specs.GROUP, specs.VERSION, "memorypolicies", namespace)
    requests = kube.resource_path(specs.GROUP, specs.VERSION, "retirementrequests", namespace)
    async with (
        Scheduler(host="127.0.0.1", dashboard_address=":0") as scheduler,
        Worker(scheduler.address, name=POD, nthreads=1) as worker,
    ):
        spec = {"scheduler": {"address": scheduler.address}, "workload": {"kind": "Deployment", "name": "w"}}
        body = {"apiVersion": specs.API_VERSION, "kind": "MemoryPolicy", "metadata": {"name": "p"}, "spec": spec}
        created = await kube_client.request("POST", path, body=body | {"spec": spec | {"replicas": 0}})
        owner = objects.Owner(name="p", namespace=namespace, uid=created["metadata"]["uid"])
        request = objects.policy_request(
            owner,
            specs.MemoryPolicySpec.model_validate(spec),
            name="p-g1-0",
            count=1,
            annotations={objects.GENERATION_ANNOTATION: str(created["metadata"]["generation"])},
        )
        await kube_client.request("POST", requests, body=request)
        failed = {
            "phase": "Failed",
            "completionTime": timestamps.render(timestamps.now()),
            "message": "retired 0 of 1 workers; kept 1 that still hold unique data",
            "workers": [_kept_worker(worker.address)],
        }
        await kube_client.merge_patch(f"{requests}/p-g1-0/status", {"status": failed})

        async def reconcile() -> dict[str, Any]:
            # As Kopf hands the daemon its body: the status as the last pass wrote it.
            stored = kopf.Body(await kube_client.get(f"{path}/p"))
            await policy.Policy(client=kube_client, body=stored, logger=LOGGER).reconcile()
            return dict((await kube_client.get(f"{path}/p"))["status"])

        first, second = await reconcile(), await reconcile()
        assert first["heldBack"] == second["heldBack"], "the same hold, its start kept"
        [held] = first["heldBack"]
        assert (held["pod"], held["rule"], held["workers"]) == (POD, "NowhereToGo", 1)
        assert held["message"].startswith("the scheduler could not retire the worker: its unique data had nowhere")
        assert "(RetirementRequest p-g1-0)" in held["message"] and held["since"]
        assert [(e["type"], e["reason"]) for e in events] == [("Warning", "NowhereToGo")]
        assert events[0]["message"].startswith(f"{POD} held back: ")
        reachable = next(c for c in second["conditions"] if c["type"] == "SchedulerReachable")
        assert reachable["status"] == "True", reachable

        await kube_client.merge_patch(f"{path}/p", {"spec": {"drain": {"timeout": "5m"}}})
        after = await reconcile()
        assert after.get("heldBack", []) == [] and after["lastScaleReason"] == "ScaleDown"
        names = [r["metadata"]["name"] for r in await kube_client.list(requests)]
        assert sorted(names) == ["p-g1-0", "p-g2-1"], "the next scale-down, of the new generation"
        assert len(events) == 2 and events[1]["reason"] == "ScaleDown", "a lifted hold says nothing"
