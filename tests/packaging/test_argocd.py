"""Argo CD health of MemoryPolicy and RetirementRequest (deploy/argocd/health.lua), run by a real
Lua interpreter (lupa) on statuses built by memops' own condition functions."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from memops import specs
from memops.decisions import conditions
from tests.packaging import argocd, manifests


def _request(phase: specs.Phase, *, generation: int = 1, observed: int = 1, message: str = "") -> dict[str, Any]:
    status = specs.RetirementRequestStatus(phase=phase, observedGeneration=observed, message=message)
    if phase == specs.Phase.FAILED:
        status.conditions = conditions.set_condition(
            status.conditions, "Failed", True, reason="Timeout", message=message, generation=observed
        )
    status.conditions = conditions.request_summary(status)
    return {
        "apiVersion": "memops.dev/v1alpha1",
        "kind": "RetirementRequest",
        "metadata": {"name": "r", "generation": generation},
        "status": status.model_dump(mode="json", exclude_none=True),
    }


def _policy(
    *,
    generation: int = 3,
    observed: int = 3,
    reconciling: tuple[str, str] | None = None,
    stalled: tuple[str, str] | None = None,
) -> dict[str, Any]:
    """A MemoryPolicy status as memops.controllers.policy writes it: kstatus, then Ready."""
    status = specs.MemoryPolicyStatus(observedGeneration=observed)
    status.conditions = conditions.with_kstatus(
        status.conditions, generation=observed, reconciling=reconciling, stalled=stalled
    )
    ready = stalled is None
    reason, message = stalled or ("Managing", "managing Deployment 'dask-worker'")
    status.conditions = conditions.set_condition(
        status.conditions, "Ready", ready, reason=reason, message=message, generation=observed
    )
    return {
        "apiVersion": "memops.dev/v1alpha1",
        "kind": "MemoryPolicy",
        "metadata": {"name": "p", "generation": generation},
        "status": status.model_dump(mode="json", exclude_none=True),
    }


@pytest.mark.parametrize(
    ("obj", "status", "message"),
    [
        pytest.param({"metadata": {"name": "new", "generation": 1}}, "Progressing", "Waiting", id="no-status-yet"),
        pytest.param(
            _request(specs.Phase.PENDING, observed=0), "Progressing", "generation 1", id="request-not-observed"
        ),
        pytest.param(
            _request(specs.Phase.DRAINING, message="draining 2"), "Progressing", "Draining: draining 2", id="draining"
        ),
        pytest.param(
            _request(specs.Phase.SUCCEEDED, message="retired 2"), "Healthy", "Succeeded: retired 2", id="succeeded"
        ),
        pytest.param(_request(specs.Phase.FAILED, message="kept 1"), "Degraded", "Timeout: kept 1", id="failed"),
        pytest.param(_policy(), "Healthy", "Managing", id="policy-managing"),
        pytest.param(
            _policy(reconciling=("ScaleDown", "draining 1")),
            "Progressing",
            "ScaleDown: draining 1",
            id="policy-scaling",
        ),
        pytest.param(
            _policy(stalled=("SchedulerUnreachable", "no answer")),
            "Degraded",
            "SchedulerUnreachable: no answer",
            id="policy-stalled",
        ),
        pytest.param(_policy(generation=4), "Progressing", "generation 4", id="policy-spec-not-observed"),
    ],
)
def test_health(obj: dict[str, Any], status: str, message: str) -> None:
    result = argocd.health(obj)
    assert result["status"] == status
    assert message in result["message"]


def test_a_refused_spec_change_is_degraded() -> None:
    """A RetirementRequest is one-shot: a change after the drain started is refused, and Argo CD
    shows it instead of waiting forever for a generation that memops will never observe."""
    obj = _request(specs.Phase.SUCCEEDED, generation=2, observed=1)
    status = specs.RetirementRequestStatus.model_validate(obj["status"])
    status.conditions = conditions.set_condition(
        status.conditions, "SpecChangeRejected", True, reason="OneShot", message="create a new request", generation=2
    )
    obj["status"] = status.model_dump(mode="json", exclude_none=True)
    assert argocd.health(obj) == {"status": "Degraded", "message": "OneShot: create a new request"}


def test_conditions_of_an_older_generation_are_not_trusted() -> None:
    obj = _policy()
    obj["status"]["conditions"] = [
        {**c, "observedGeneration": 2} if c["type"] == "Ready" else c for c in obj["status"]["conditions"]
    ]
    assert argocd.health(obj)["status"] == "Progressing"


def test_configmap_snippet_holds_the_script_for_both_kinds() -> None:
    patch = yaml.safe_load((manifests.ROOT / "deploy" / "argocd" / "argocd-cm-patch.yaml").read_text())
    script = argocd.SCRIPT.read_text()
    assert patch["data"] == {f"resource.customizations.health.{specs.GROUP}_{k.kind}": script for k in specs.KINDS}
