"""The fault soak's two-minute seed, as a user runs it: ``python bench/soak.py --seed 36 --minutes 2``.

On real Nodes of its own, with the operator as the chart's two replicas, the schedule of seed 36
injects, one per step: the API server SIGKILLed mid-drain (the sandbox starts it again), the
operator cut off from the scheduler, the reconciling replica's pod killed mid-drain, a worker's
container SIGKILLed, two kernel OOM kills and one nanny's kill. After each step the script checks
that no key was lost but to an abrupt kill of every worker that held it, that each such loss is in
the policy's ``status.workerLosses``, that every RetirementRequest ended by its deadline and every
worker pod carries the safety net's hook; it exits 1 when a check failed. The longer runs and their
tables are in docs/performance.md.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SOAK = Path(__file__).resolve().parents[2] / "bench" / "soak.py"
SEED = 36
"""A seed whose first two minutes inject each fault that no other end-to-end test combines with a
drain under way (the API server's restart, the scheduler cut off) and each abrupt kill."""
REASON = "it kills the operator's replicas, restarts the API server and drains Nodes"

pytestmark = [pytest.mark.owns_cluster(REASON), pytest.mark.timeout(900)]


def test_a_two_minute_fault_soak_loses_nothing_but_to_abrupt_kills_and_records_each() -> None:
    print(f"on a sandbox of its own: {REASON}")
    command = [sys.executable, str(SOAK), "--seed", str(SEED), "--minutes", "2"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=840, check=False)
    print(result.stdout[-8000:])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    table = result.stdout[result.stdout.index("Fault soak, seed") :]
    assert "- checks failed: 0" in table
    cells = [row.split("|")[1:3] for row in table.splitlines() if row.startswith("| ")]
    injected = {fault.strip(): int(count) for fault, count in cells if count.strip().isdigit()}
    assert sum(injected.values()) >= 5, f"too few steps to mean anything: {injected}"
