"""The operator as the chart runs it by default: two replicas, one reconciling, both serving the
webhooks; and a rollout of the operator while a drain runs and a direct scale-down happens.

Inputs: the session's sandbox, whose operator (the chart's Deployment, one replica there) this
test runs as two replicas with the chart's rolling strategy for two, then gives back. Five worker
pods under a MemoryPolicy (rolled once, so that each has the safety net), unique data on each.
What is asserted: Kopf's peering object shows the two replicas, the older one reconciling; a
drain that a rollout of the operator interrupts ends Succeeded, once, with nothing lost, as does
the direct scale-down's pod (its preStop drain); and the drain finishes at most 15 s later than
the same drain without a rollout, measured in the same test.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from typing import Any

import distributed
import pytest

from tests.e2e.conftest import OPERATOR_NAMESPACE, OPERATOR_PODS, Sandbox, retirement_request
from tests.e2e.data import scatter_unique
from tests.e2e.test_policy import memory_policy
from tests.e2e.test_upstream_controllers import ready, restart

TWO = {
    "spec": {
        "replicas": 2,
        "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
    }
}
ONE = {"spec": {"replicas": 1, "strategy": {"type": "Recreate", "rollingUpdate": None}}}
HANDOVER_SECONDS = 15.0
WORKERS = 5


def operator_pods(sandbox: Sandbox) -> list[dict[str, Any]]:
    listed = sandbox.kubectl("get", "pods", "-n", OPERATOR_NAMESPACE, "-l", OPERATOR_PODS, "-o", "json").stdout
    items: list[dict[str, Any]] = json.loads(listed)["items"]
    return items


def serving(sandbox: Sandbox) -> list[str]:
    """The operator pods that are Ready and not being deleted (the webhook Service's endpoints)."""
    return [
        p["metadata"]["name"]
        for p in operator_pods(sandbox)
        if not p["metadata"].get("deletionTimestamp")
        and any(c["type"] == "Ready" and c["status"] == "True" for c in p.get("status", {}).get("conditions", []))
    ]


def peers(sandbox: Sandbox) -> dict[str, dict[str, Any]]:
    """Kopf's peering record: replica (its pod's name) -> priority, lastseen, lifetime."""
    found = sandbox.kubectl("get", "clusterkopfpeering", "memops", "-o", "json").stdout
    status: dict[str, dict[str, Any]] = json.loads(found).get("status") or {}
    return status


def settled(sandbox: Sandbox, old: set[str]) -> list[str] | None:
    """Two Ready replicas, none of ``old``, both in the peering record: their names, oldest first."""
    names = serving(sandbox)
    if len(names) != 2 or set(names) & old or len(operator_pods(sandbox)) != 2:
        return None
    record = peers(sandbox)
    if not set(names) <= set(record):
        return None
    return sorted(names, key=lambda n: -int(record[n]["priority"]))


def log_of(sandbox: Sandbox, pod: str) -> str:
    return sandbox.kubectl("logs", "-n", OPERATOR_NAMESPACE, pod, check=False).stdout


def timed_drain(
    sandbox: Sandbox, name: str, pod: str, frozen: list[str], meanwhile: Callable[[], None] = lambda: None
) -> tuple[dict[str, Any], dict[str, Any], float]:
    """Drain ``pod`` while ``frozen`` (every other worker) are stopped, so that it stays Draining;
    run ``meanwhile``, thaw them, and return the request as it was Draining and as it ended, and
    the seconds from the thaw to its end."""
    for other in frozen:
        sandbox.signal_pod(other, signal.SIGSTOP)
    try:
        request = retirement_request(name, scheduler={"address": sandbox.scheduler_address}, workers=[pod])
        request["spec"]["timeout"] = "5m"
        sandbox.apply(request)
        draining = sandbox.wait_phase(name, "Draining")
        meanwhile()
    finally:
        for other in frozen:
            sandbox.signal_pod(other, signal.SIGCONT)
    thawed = time.monotonic()
    done = sandbox.wait_phase(name, "Succeeded", "Failed", timeout=240)
    return draining, done, time.monotonic() - thawed


@pytest.mark.quiet("it runs the operator as two replicas and rolls them out: no other test runs meanwhile")
def test_an_operator_rollout_during_a_drain_and_a_direct_scale_down_loses_nothing(
    sandbox_factory: Callable[..., Sandbox],
) -> None:
    sandbox = sandbox_factory(WORKERS)
    sandbox.apply(memory_policy("replicas", sandbox.scheduler_address))  # no replicas: it adopts the count
    sandbox.wait_for(lambda: ready(sandbox, "replicas"), what="the policy Ready")
    restart(sandbox, "1")  # the sandbox's pods predate the policy: each new one gets the safety net

    def netted() -> list[str] | None:
        pods = sandbox.get("pods", "-l", "app=dask-worker")["items"]
        names = [p["metadata"]["name"] for p in pods if not p["metadata"].get("deletionTimestamp")]
        ok = len(pods) == WORKERS and all(
            (p["metadata"].get("annotations") or {}).get("memops.dev/safety-net") == "replicas" for p in pods
        )
        return sorted(names) if ok else None

    pods = sandbox.wait_for(netted, timeout=240, what="every worker pod with the safety net")
    before = {p["metadata"]["name"] for p in operator_pods(sandbox)}
    patch = ("patch", "deployment", "memops", "-n", OPERATOR_NAMESPACE, "--type=merge", "-p")
    sandbox.kubectl(*patch, json.dumps(TWO))
    try:
        # Two replicas: the one that was there (the older) reconciles, the new one is paused.
        first = sandbox.wait_for(lambda: settled(sandbox, set()), timeout=120, what="two operator replicas")
        assert first[0] in before, "the replica that was there is the older, and reconciles"
        sandbox.wait_for(lambda: "Pausing operations in favour of" in log_of(sandbox, first[1]), what="a pause")
        assert "Pausing operations" not in log_of(sandbox, first[0])
        with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
            sandbox.wait_for(
                lambda: {str(w["name"]) for w in client.scheduler_info(n_workers=-1)["workers"].values()} == set(pods),
                what="the rolled-out pods' workers",
            )
            holdings = scatter_unique(client, dict.fromkeys(pods, 4))
            # The same drain without a rollout: what the drain itself takes after the thaw.
            _, baseline, alone = timed_drain(sandbox, "alone", pods[4], pods[:4])
            assert baseline["status"]["phase"] == "Succeeded", baseline["status"]

            def roll_and_scale() -> None:
                """The operator rolled out, and once its reconciling replica is leaving, the
                workers scaled down directly by one (pods[3], by its deletion cost)."""
                sandbox.kubectl("rollout", "restart", "deployment/memops", "-n", OPERATOR_NAMESPACE)
                sandbox.wait_for(
                    lambda: first[0] not in serving(sandbox), timeout=120, what="the reconciling replica leaving"
                )
                cost = "controller.kubernetes.io/pod-deletion-cost=-2147483648"
                sandbox.kubectl("annotate", "pod", pods[3], cost, "--overwrite")
                sandbox.kubectl("scale", "deployment/dask-worker", f"--replicas={WORKERS - 2}")

            draining, done, handed_over = timed_drain(sandbox, "handover", pods[0], pods[1:4], roll_and_scale)
            print(
                f"drain after the thaw: {alone:.1f} s alone, {handed_over:.1f} s across an operator rollout"
                f" (bound: {HANDOVER_SECONDS:.0f} s more)"
            )
            assert done["status"]["phase"] == "Succeeded", done["status"]
            assert [w["pod"] for w in done["status"]["workers"]] == [pods[0]]
            assert done["status"]["workers"][0]["keysLost"] == 0
            assert done["status"]["startTime"] == draining["status"]["startTime"], "the drain was not started over"
            assert handed_over - alone <= HANDOVER_SECONDS, "the rollout delayed the drain too long"
            sandbox.wait_for(
                lambda: not {pods[0], pods[3], pods[4]} & set(sandbox.pods()), timeout=180, what="pods 0, 3 and 4 gone"
            )
            holdings.assert_all_correct()
        # Rolled out: two new replicas, the older of them reconciling; the old ones left the record.
        second = sandbox.wait_for(lambda: settled(sandbox, set(first)), timeout=120, what="the new replicas")
        assert not set(first) & {p for p, r in peers(sandbox).items() if int(r.get("lifetime", 0)) > 0}
        assert "Pausing operations in favour of" in log_of(sandbox, second[1]), "the younger new replica is paused"
    finally:
        sandbox.kubectl(*patch, json.dumps(ONE))
        sandbox.wait_for(
            lambda: len(serving(sandbox)) == 1 and len(operator_pods(sandbox)) == 1, timeout=180, what="one operator"
        )
