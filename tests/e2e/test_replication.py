"""Replication targets through a MemoryPolicy: the operator installs them in the sandbox's real
scheduler, reports them in status.replication, annotates the worker pods with what each holds
alone, keeps scattered data at two copies through a SIGKILLed pod, and takes replication out of
the scheduler with the policy."""

from __future__ import annotations

import signal
from typing import Any

import distributed

from memops.decisions import replication_plan as replication
from tests.e2e.conftest import Sandbox
from tests.e2e.data import scatter_unique, workers_by_name
from tests.e2e.test_policy import memory_policy

RULES = {"rules": [{"keys": {"scattered": True}, "replicas": 2}], "maxReplicatedFraction": 0.5}


def installed(client: distributed.Client) -> bool:
    def state(dask_scheduler: Any) -> bool:  # nested: sent by value, as tests/ is not importable there
        return "memops-replication" in dask_scheduler.plugins

    return bool(client.run_on_scheduler(state))


def test_scattered_data_keeps_two_copies_through_a_sigkilled_pod(sandbox: Sandbox) -> None:
    pods = sandbox.pods()
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        holdings = scatter_unique(client, {pods[0]: 6})
        futures = list(holdings.futures.values())
        sandbox.apply(memory_policy("copies", sandbox.scheduler_address, replicas=4, replication=RULES))

        def two_copies() -> bool:
            return all(len(h) == 2 for h in client.who_has(futures).values())

        sandbox.wait_for(two_copies, what="two copies of each scattered key")
        status = sandbox.wait_for(
            lambda: (
                (s := sandbox.get("mempol", "copies").get("status", {}).get("replication"))
                and s.get("keysUnder") == 0
                and s.get("bytesSpent", 0) > 0
                and s
            ),
            what="status.replication at target",
        )
        assert status["budgetBytes"] > status["bytesSpent"]

        def annotated() -> dict[str, str] | None:
            meta = sandbox.get("pod", pods[0])["metadata"]
            values = meta.get("annotations") or {}
            return values if replication.UNIQUE_BYTES in values else None

        values = sandbox.wait_for(annotated, what="the pod's replication annotations")
        assert values[replication.TARGET] == "1" and values[replication.UNDER] == "0"
        assert "controller.kubernetes.io/pod-deletion-cost" in values

        # A pod lost without notice: nanny and worker SIGKILLed together, no preStop.
        holder = next(iter(client.who_has(futures).values()))[0]
        victim = next(name for name, address in workers_by_name(client).items() if address == holder)
        sandbox.signal_pod(victim, signal.SIGKILL)
        sandbox.wait_for(lambda: holder not in workers_by_name(client).values(), what="the worker gone")
        assert client.gather(futures) == list(holdings.values.values())  # nothing lost
        sandbox.wait_for(two_copies, what="the lost copies made again")

        sandbox.kubectl("delete", "mempol/copies")
        sandbox.wait_for(lambda: not installed(client), what="replication removed with the policy")
