"""RetirementRequest end to end: kubectl, the operator process, the upstream control plane, real Dask.

Every test scatters unique (unrecomputable) data onto real workers and checks, with a real
``distributed.Client``, what became of it.
"""

from __future__ import annotations

import signal
from collections.abc import Callable

import distributed
import pytest
import yaml

from tests import polling
from tests.e2e import windows
from tests.e2e.conftest import Sandbox, retirement_request
from tests.e2e.data import scatter_unique, workers_by_name

MiB = 2**20


def test_retire_by_count_then_by_name(sandbox: Sandbox) -> None:
    pods = sandbox.pods()
    assert len(pods) == 4
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        # Unequal holdings, so the two that move the fewest bytes are known in advance.
        holdings = scatter_unique(client, {pod: n for pod, n in zip(pods, (1, 2, 6, 8), strict=True)}, size=MiB)
        sandbox.apply(retirement_request("shrink", scheduler={"address": sandbox.scheduler_address}, count=2))
        waited = sandbox.kubectl(
            "wait", "retire/shrink", "--for=jsonpath={.status.phase}=Succeeded", "--timeout=120s", check=False
        )
        done = sandbox.wait_phase("shrink", "Succeeded", "Failed")
        assert waited.returncode == 0, (waited.stderr, done["status"])
        assert done["status"]["phase"] == "Succeeded", done["status"]
        workers = {w["pod"]: w for w in done["status"]["workers"]}
        assert set(workers) == set(pods[:2]), "count chooses the workers with the fewest unique bytes"
        for pod, keys in zip(pods[:2], (1, 2), strict=True):
            assert workers[pod]["state"] == "Retired"
            assert workers[pod]["bytesMoved"] >= keys * MiB
        assert done["status"]["retired"] == 2
        assert sandbox.pods() == pods[2:]
        assert sandbox.replicas() == 2
        holdings.assert_all_correct()
        assert set(workers_by_name(client)) == set(pods[2:])

        conditions = {c["type"]: c for c in done["status"]["conditions"]}
        assert conditions["Complete"]["status"] == "True"
        assert conditions["Complete"]["observedGeneration"] == done["metadata"]["generation"]
        events = sandbox.get("events", "--field-selector", "involvedObject.name=shrink")["items"]
        assert {"DrainStarted", "Succeeded"} <= {e["reason"] for e in events}

        sandbox.apply(retirement_request("one", scheduler={"address": sandbox.scheduler_address}, workers=[pods[3]]))
        one = sandbox.wait_phase("one", "Succeeded", "Failed")
        assert one["status"]["phase"] == "Succeeded", one["status"]
        assert one["status"]["workers"][0]["bytesMoved"] >= 8 * MiB
        assert sandbox.pods() == [pods[2]]
        assert sandbox.replicas() == 1
        holdings.assert_all_correct()

    table = sandbox.kubectl("get", "retire").stdout
    assert "shrink" in table and "Succeeded" in table


def test_nowhere_to_go_keeps_every_pod_then_force_records_the_loss(sandbox: Sandbox) -> None:
    pods = sandbox.pods()
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        holdings = scatter_unique(client, dict.fromkeys(pods, 3))
        sandbox.apply(
            retirement_request("all", scheduler={"address": sandbox.scheduler_address}, count=4, timeout="30s")
        )
        failed = sandbox.wait_phase("all", "Succeeded", "Failed")
        assert failed["status"]["phase"] == "Failed"
        assert {w["state"] for w in failed["status"]["workers"]} == {"Kept"}
        assert all("nowhere" in w["message"] for w in failed["status"]["workers"])
        assert "kept 4" in failed["status"]["message"]
        assert sandbox.pods() == pods and sandbox.replicas() == 4
        holdings.assert_all_correct()

        sandbox.apply(
            retirement_request(
                "force",
                scheduler={"address": sandbox.scheduler_address},
                workers=pods[:2],
                timeout="30s",
                onTimeout="Force",
            )
        )
        forced = sandbox.wait_phase("force", "Succeeded", "Failed")
        # Two of four can be drained onto the other two: Force only matters when data has nowhere to go.
        assert forced["status"]["phase"] == "Succeeded"
        holdings.assert_all_correct()

        remaining = sandbox.pods()
        sandbox.apply(
            retirement_request(
                "force-all",
                scheduler={"address": sandbox.scheduler_address},
                workers=remaining,
                timeout="30s",
                onTimeout="Force",
            )
        )
        lost = sandbox.wait_phase("force-all", "Succeeded", "Failed")
        status = lost["status"]
        assert {w["state"] for w in status["workers"]} == {"Forced"}
        assert status["bytesLost"] == sum(w["bytesLost"] for w in status["workers"]) >= 12 * 256 * 1024
        assert sum(w["keysLost"] for w in status["workers"]) == 12
        assert {c["type"]: c["status"] for c in status["conditions"]}["DataLost"] == "True"
        sandbox.wait_for(lambda: sandbox.pods() == [], what="forced pods to be removed")
        assert sandbox.replicas() == 0
        assert len(holdings.lost()) == 12


def _freeze_recipients(sandbox: Sandbox, keep_running: list[str]) -> list[str]:
    """SIGSTOP every worker pod but these: transfers to them hang, so a drain stays in progress."""
    frozen = [p for p in sandbox.pods() if p not in keep_running]
    for pod in frozen:
        sandbox.signal_pod(pod, signal.SIGSTOP)
    return frozen


def _thaw(sandbox: Sandbox, pods: list[str]) -> None:
    for pod in pods:
        sandbox.signal_pod(pod, signal.SIGCONT)


def test_scheduler_stopped_mid_drain_keeps_the_pod(sandbox_factory: Callable[..., Sandbox]) -> None:
    sandbox = sandbox_factory(2)
    pods = sandbox.pods()
    client = distributed.Client(sandbox.scheduler_address, timeout=30)
    holdings = scatter_unique(client, {pods[0]: 4})  # referenced until the end: the data stays
    frozen = _freeze_recipients(sandbox, keep_running=[pods[0]])
    try:
        sandbox.apply(
            retirement_request(
                "orphan", scheduler={"address": sandbox.scheduler_address}, workers=[pods[0]], timeout="15s"
            )
        )
        sandbox.wait_phase("orphan", "Draining")
        # Gone for good. On real Nodes a killed scheduler's container is started again (an empty
        # scheduler at the same address, the workers' data lost with the old one): stopped there.
        sandbox.signal_scheduler(signal.SIGSTOP if sandbox.real_nodes else signal.SIGKILL)
    finally:
        _thaw(sandbox, frozen)
    try:
        done = sandbox.wait_phase("orphan", "Failed", "Succeeded")
    finally:
        if sandbox.real_nodes:
            sandbox.signal_scheduler(signal.SIGCONT)
    assert len(holdings.futures) == 4
    client.close(timeout=5)
    worker = done["status"]["workers"][0]
    assert done["status"]["phase"] == "Failed", done["status"]
    assert worker["state"] == "Kept"
    assert worker["uniqueBytes"] >= 4 * 256 * 1024, "the worker held unique data when the drain began"
    assert "unreachable" in worker["message"]
    assert pods[0] in sandbox.pods() and sandbox.replicas() == 2


def test_worker_killed_mid_drain(sandbox_factory: Callable[..., Sandbox]) -> None:
    """Killed while the scheduler drains it (seen as closing_gracefully), with every recipient
    frozen so that nothing has moved yet: all its keys die with it, the status says so exactly,
    and its pod (restarted empty by the kubelet) is removed; the other pods' data is intact."""
    sandbox = sandbox_factory(3)
    pods = sandbox.pods()
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        holdings = scatter_unique(client, {pods[0]: 4, pods[1]: 2})
        victim = workers_by_name(client)[pods[0]]
        frozen = _freeze_recipients(sandbox, keep_running=[pods[0]])
        try:
            sandbox.apply(
                retirement_request(
                    "crash", scheduler={"address": sandbox.scheduler_address}, workers=[pods[0]], timeout="60s"
                )
            )
            sandbox.wait_for(
                lambda: (
                    client.scheduler_info(n_workers=-1)["workers"].get(victim, {}).get("status") == "closing_gracefully"
                ),
                timeout=60,
                what="the scheduler to be draining the worker",
            )
            sandbox.signal_pod(pods[0], signal.SIGKILL)  # the kubelet restarts it, empty
        finally:
            _thaw(sandbox, frozen)
        done = sandbox.wait_phase("crash", "Failed", "Succeeded")
        worker = done["status"]["workers"][0]
        assert done["status"]["phase"] == "Succeeded", done["status"]
        assert (worker["state"], worker["keysLost"], worker["bytesLost"]) == ("Retired", 4, 4 * 256 * 1024), worker
        assert worker["message"].startswith("the worker left the scheduler during the drain (it died)"), worker
        assert sorted(holdings.lost()) == sorted(holdings.keys_of(pods[0]))
        assert pods[0] not in sandbox.pods()


@pytest.mark.quiet("it kills the operator, whose Deployment starts another: no other test runs meanwhile")
def test_operator_restart_mid_drain_carries_on(sandbox_factory: Callable[..., Sandbox]) -> None:
    sandbox = sandbox_factory(3)
    pods = sandbox.pods()
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        holdings = scatter_unique(client, {pods[0]: 1, pods[1]: 2, pods[2]: 3})
        frozen = _freeze_recipients(sandbox, keep_running=[pods[0]])
        try:
            sandbox.apply(
                retirement_request("resume", scheduler={"address": sandbox.scheduler_address}, count=1, timeout="90s")
            )
            draining = sandbox.wait_phase("resume", "Draining")
            sandbox.kill_operator()
        finally:
            _thaw(sandbox, frozen)
        sandbox.apply(
            retirement_request("resume", scheduler={"address": sandbox.scheduler_address}, count=2, timeout="90s")
        )
        sandbox.start_operator()
        done = sandbox.wait_phase("resume", "Succeeded", "Failed")
        assert done["status"]["phase"] == "Succeeded", done["status"]
        assert done["status"]["startTime"] == draining["status"]["startTime"], "the drain was not started over"
        assert [w["pod"] for w in done["status"]["workers"]] == [pods[0]]
        assert {c["type"] for c in done["status"]["conditions"]} >= {"SpecChangeRejected"}
        assert sandbox.pods() == pods[1:] and sandbox.replicas() == 2
        holdings.assert_all_correct()


def test_two_requests_for_one_worker_do_not_both_act(sandbox: Sandbox) -> None:
    pods = sandbox.pods()
    both = "---\n".join(
        yaml.safe_dump(retirement_request(name, scheduler={"address": sandbox.scheduler_address}, workers=[pods[0]]))
        for name in ("first", "second")
    )
    sandbox.apply(both)
    results = [sandbox.wait_phase(name, "Succeeded", "Failed") for name in ("first", "second")]
    phases = sorted(r["status"]["phase"] for r in results)
    assert phases == ["Failed", "Succeeded"]
    loser = next(r for r in results if r["status"]["phase"] == "Failed")
    assert loser["status"]["message"].startswith("spec.workers[0]:")
    assert sandbox.replicas() == 3 and pods[0] not in sandbox.pods()


def test_baseline_plain_scale_down_loses_the_data(sandbox: Sandbox) -> None:
    """What memops exists to prevent: `kubectl scale` SIGTERMs workers that still hold data."""
    pods = sandbox.pods()
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        holdings = scatter_unique(client, dict.fromkeys(pods, 10), size=64 * 1024)
        sandbox.kubectl("scale", "deployment/dask-worker", "--replicas=2")
        sandbox.wait_for(
            lambda: len(workers_by_name(client)) == 2 and len(sandbox.pods()) == 2, what="two workers to be removed"
        )
        lost = holdings.lost()
        removed = [p for p in pods if p not in sandbox.pods()]
        print(f"baseline: kubectl scale 4->2 lost {len(lost)} of {len(holdings.futures)} scattered keys")
        assert lost == sorted(k for pod in removed for k in holdings.keys_of(pod))
        assert len(lost) == 20


@pytest.mark.parametrize("phase", ["Succeeded"])
def test_spec_change_after_completion_is_refused(sandbox: Sandbox, phase: str) -> None:
    sandbox.apply(retirement_request("done", scheduler={"address": sandbox.scheduler_address}, count=1))
    sandbox.wait_phase("done", phase)
    sandbox.kubectl("patch", "retire", "done", "--type=merge", "-p", '{"spec":{"count":2}}')
    rejected = sandbox.wait_for(
        lambda: [c for c in sandbox.get("retire", "done")["status"]["conditions"] if c["type"] == "SpecChangeRejected"],
        what="the SpecChangeRejected condition",
    )
    assert rejected[0]["observedGeneration"] == 2
    # A second drain, had the change started one, would lower the replicas some steps later.
    polling.stays(
        lambda: sandbox.replicas() == 3 and len(sandbox.pods()) == 3,
        seconds=windows.REQUEST_STEPS,
        what="the changed spec retired nothing more",
    )
