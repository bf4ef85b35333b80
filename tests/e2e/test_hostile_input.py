"""Hostile specs through kubectl: refused at apply naming the field, or ended in a status."""

from __future__ import annotations

import yaml

from tests.e2e.conftest import Sandbox, retirement_request


def test_hostile_specs_are_refused_or_end_in_a_status(sandbox: Sandbox) -> None:
    address = sandbox.scheduler_address
    pods = sandbox.pods()
    escape = {"kind": "Deployment", "name": "../../kube-system/deployments/coredns"}
    refused = {
        "escape": ({"count": 1, "workload": escape}, "spec.workload.name"),
        "twice": ({"workers": [pods[0], pods[0]]}, f'spec.workers[1]: Duplicate value: "{pods[0]}"'),
        "secret": (
            {"count": 1, "scheduler": {"address": "tls://x:8786", "tls": {"secretName": "../kube-system/x"}}},
            "spec.scheduler.tls.secretName",
        ),
    }
    for name, (spec, field) in refused.items():
        result = sandbox.apply(retirement_request(name, **{"scheduler": {"address": address}, **spec}), check=False)
        assert result.returncode != 0, name
        assert field in result.stderr, (name, result.stderr)
    assert sandbox.get("retirementrequests")["items"] == []

    # A TLS Secret that does not exist: a condition naming the field, then Failed at the deadline.
    tls = {"address": address.replace("tcp://", "tls://"), "tls": {"secretName": "dask-tls"}}
    sandbox.apply(retirement_request("no-secret", scheduler=tls, count=1, timeout="5s"))
    retrying = sandbox.wait_for(
        lambda: [
            c
            for c in sandbox.get("retire", "no-secret").get("status", {}).get("conditions", [])
            if c["type"] == "Retrying" and c["status"] == "True"
        ],
        what="the Retrying condition",
    )
    assert retrying[0]["message"].startswith("spec.scheduler.tls.secretName: Secret 'dask-tls'")
    failed = sandbox.wait_phase("no-secret", "Failed", "Succeeded")
    assert failed["status"]["phase"] == "Failed"
    assert "spec.scheduler.tls.secretName" in failed["status"]["message"]

    # The API server refuses these at apply, by the CRD's CEL rule, naming the field (the operator
    # checks the same bound for an API server that does not evaluate CEL: tests/unit).
    for name, timeout in (("forever", "100000000h"), ("week-and-a-day", "192h")):
        request = retirement_request(name, scheduler={"address": address}, count=1, timeout=timeout)
        result = sandbox.apply(request, check=False)
        assert result.returncode != 0, name
        assert "spec.timeout" in result.stderr and "must be at most 168h" in result.stderr, result.stderr

    # A 200 KB annotation: the request is handled, and Kopf's own annotation stays small.
    noted = retirement_request("noted", scheduler={"address": address}, count=1)
    noted["metadata"]["annotations"] = {"example.com/note": "x" * 200_000}
    sandbox.kubectl("create", "-f", "-", input=yaml.safe_dump(noted))  # apply would copy it into its own
    done = sandbox.wait_phase("noted", "Failed", "Succeeded")
    assert done["status"]["phase"] == "Succeeded"
    kopf_annotation = done["metadata"]["annotations"]["memops.dev/last-handled-configuration"]
    assert len(kopf_annotation) < 1000, len(kopf_annotation)
    assert sandbox.pods() != pods and sandbox.replicas() == 3
    assert "Traceback" not in sandbox.operator_log()
