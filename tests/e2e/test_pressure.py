"""Pressure relief through a MemoryPolicy: the operator installs it in the sandbox's real
scheduler, reports it in status.pressure, installs it again when the scheduler has lost it, and
takes it out again when spec.pressure goes or the policy is deleted."""

from __future__ import annotations

from typing import Any

import distributed

from tests.e2e.conftest import Sandbox
from tests.e2e.test_policy import memory_policy

NAME = "memops-pressure-relief"


def relief_on_scheduler(client: distributed.Client) -> dict[str, Any] | None:
    def state(dask_scheduler: Any) -> dict[str, Any] | None:
        plugin = dask_scheduler.plugins.get("memops-pressure-relief")
        return None if plugin is None else {"above": plugin.policy.above, "to": plugin.policy.to}

    result: dict[str, Any] | None = client.run_on_scheduler(state)
    return result


def test_policy_installs_retunes_and_removes_pressure_relief(sandbox: Sandbox) -> None:
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        sandbox.apply(
            memory_policy(
                "relief", sandbox.scheduler_address, replicas=4, pressure={"relieveAbove": "75%", "relieveTo": "60%"}
            )
        )
        status = sandbox.wait_for(
            lambda: (s := sandbox.get("mempol", "relief").get("status", {})).get("pressure") is not None and s,
            what="status.pressure",
        )
        assert status["pressure"]["keysMoved"] == 0 and status["pressure"]["starved"] == []
        assert relief_on_scheduler(client) == {"above": 0.75, "to": 0.6}

        # A restarted scheduler has no relief: the next pass installs it again. (Taken out here
        # behind the operator's back, as a restart would.)
        def remove_relief(dask_scheduler: Any) -> None:  # nested: sent by value, as tests/ is not importable there
            dask_scheduler.plugins.pop(NAME).manager.stop()
            dask_scheduler.handlers.pop("memops_agent")  # memops' agent, which a restart loses too

        client.run_on_scheduler(remove_relief)
        assert relief_on_scheduler(client) is None
        sandbox.wait_for(lambda: relief_on_scheduler(client) == {"above": 0.75, "to": 0.6}, what="relief re-installed")

        sandbox.kubectl("patch", "mempol/relief", "--type=merge", "-p", '{"spec":{"pressure":{"relieveAbove":"80%"}}}')
        sandbox.wait_for(
            lambda: relief_on_scheduler(client) == {"above": 0.8, "to": 0.6}, what="relief retuned in place"
        )

        sandbox.kubectl("patch", "mempol/relief", "--type=json", "-p", '[{"op":"remove","path":"/spec/pressure"}]')
        sandbox.wait_for(lambda: relief_on_scheduler(client) is None, what="relief removed from the scheduler")
        sandbox.wait_for(
            lambda: "pressure" not in sandbox.get("mempol", "relief").get("status", {}), what="status.pressure gone"
        )

        # Deleting the policy takes its relief out of the scheduler too.
        sandbox.kubectl("patch", "mempol/relief", "--type=merge", "-p", '{"spec":{"pressure":{"relieveAbove":"70%"}}}')
        sandbox.wait_for(lambda: relief_on_scheduler(client) == {"above": 0.7, "to": 0.55}, what="relief installed")
        sandbox.wait_for(lambda: sandbox.get("mempol", "relief").get("status", {}).get("pressure"), what="status")
        sandbox.kubectl("delete", "mempol/relief")
        sandbox.wait_for(lambda: relief_on_scheduler(client) is None, what="relief removed with the policy")


def test_an_invalid_pressure_spec_is_rejected_naming_the_field(sandbox: Sandbox) -> None:
    result = sandbox.apply(
        memory_policy("bad", sandbox.scheduler_address, replicas=4, pressure={"relieveAbove": "170%"}), check=False
    )
    assert result.returncode != 0
    assert "spec.pressure.relieveAbove" in result.stderr
