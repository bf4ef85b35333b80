"""What one MemoryPolicy pass reads, made for :func:`memops.decisions.policy_decisions.decide`: the
unit tests of the pass and of what it holds back build their inputs here."""

from __future__ import annotations

import datetime
from typing import Any

from memops import specs
from memops.decisions import autoscaling, conditions, objects, policy_decisions, timestamps

NOW = 1_800_000_000.0
OWNER = objects.Owner(name="p", namespace="dask", uid="u-1")
GIB = 2**30


def policy_spec(**fields: Any) -> specs.MemoryPolicySpec:
    return specs.MemoryPolicySpec.model_validate(
        {"scheduler": {"address": "tcp://s:8786"}, "workload": {"kind": "Deployment", "name": "w"}} | fields
    )


def ago(seconds: float) -> str:
    return timestamps.render(datetime.datetime.fromtimestamp(NOW - seconds, tz=datetime.UTC))


def reachable(ok: bool) -> specs.MemoryPolicyStatus:
    found = conditions.set_condition(
        [],
        "SchedulerReachable",
        ok,
        reason="Connected" if ok else "SchedulerUnreachable",
        message="" if ok else "spec.scheduler.address: no answer",
        generation=3,
    )
    return specs.MemoryPolicyStatus(conditions=found)


def pass_inputs(spec: specs.MemoryPolicySpec, current: int = 4, **fields: Any) -> policy_decisions.Inputs:
    """A pass of generation 3 at :data:`NOW`, its scheduler reached, ``current`` workers each holding
    1 GiB of 2; ``fields`` replace any of them."""
    values: dict[str, Any] = {
        "owner": OWNER,
        "generation": 3,
        "spec": spec,
        "status": reachable(True),
        "current": current,
        "replicas": current,
        "now": NOW,
        "usage": autoscaling.Usage(workers=current, held=current * GIB, limit=current * 2 * GIB),
        "connected": current,
    }
    return policy_decisions.Inputs(**(values | fields))
