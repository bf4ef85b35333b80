"""The node agent's sandbox (process Nodes, no containers), on its own: it touches nothing that is
one per machine (its pods have loopback addresses, its Nodes no bridge or cgroup), so these tests
run in the lane beside the real Nodes' (tests/conftest.py)."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from tests.e2e.conftest import Sandbox


@pytest.mark.node_agent(
    "it counts the node agent's own processes (real Nodes' stop and crash cleanup: tests/e2e/test_real_nodes.py)"
)
def test_sandbox_stops_every_process_it_started(sandbox_factory: Callable[..., Sandbox]) -> None:
    sandbox = sandbox_factory(2)
    pids = [sandbox.pod_pid(pod) for pod in sandbox.pods()]
    pids.append(sandbox.scheduler_pid())
    pids.append(int((sandbox.state_dir / "operator.pid").read_text()))
    assert (sandbox.state_dir / "ready").exists()
    sandbox.stop()
    assert sandbox.process.returncode == 0
    assert not (sandbox.state_dir / "ready").exists(), "ready is withdrawn on the way out"
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        raise AssertionError(f"process {pid} outlived the sandbox")
