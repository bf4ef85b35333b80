"""What memops refuses, and what it leaves alone: specs that the CRDs' schemas refuse naming the
field, schedulers that are unreachable or hostile, hostile specs that end in a status, and the real
Nodes' workers as a user finds them."""

from __future__ import annotations

from pathlib import Path

import distributed
import yaml
from memops_sandbox import nodes as real_nodes

from tests.e2e.conftest import Sandbox, retirement_request
from tests.e2e.test_policy import condition, memory_policy
from tests.e2e.test_real_nodes import cgroup_limit
from tests.scheduler import hostile

KOPF_STREAM_CANCEL = "in request_cancel_callback"
"""Kopf's watch stream cancels its request from a done-callback of its stopper that asserts it runs
in a task; a callback never does, so a stream stopped before its first answer (a watched namespace
of an earlier test going away) logs that assertion's traceback. It is Kopf's, in its own watch, and
changes nothing memops does."""


def memops_tracebacks(log: str) -> list[str]:
    """The tracebacks in the operator's ``log``, but for Kopf's :data:`KOPF_STREAM_CANCEL`."""
    blocks = log.split("Traceback (most recent call last):")[1:]
    return [block[:3000] for block in blocks if KOPF_STREAM_CANCEL not in block[:3000]]


def test_workers_are_containers_whose_limit_dask_reads_from_the_cgroup(sandbox: Sandbox) -> None:
    """Every worker pod runs in a container under a real kubelet (a containerd container ID), its
    container's cgroup carries the pod's ``resources.limits.memory``, and each Dask worker's
    ``memory_limit`` is that limit: read from the cgroup (``--memory-limit 1.0``, a fraction of it),
    as the manifest names no size."""
    nodes = {n["metadata"]["name"]: n for n in sandbox.get("nodes")["items"]}
    assert len(nodes) == 2
    for node in nodes.values():
        assert node["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://")
    pods = sandbox.get("pods", "-l", "app=dask-worker")["items"]
    assert len(pods) == 4
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        workers = client.scheduler_info(n_workers=-1)["workers"].values()
        limits = {str(w["name"]): int(w["memory_limit"]) for w in workers}
    for pod in pods:
        name = pod["metadata"]["name"]
        [container] = pod["spec"]["containers"]
        assert container["args"][container["args"].index("--memory-limit") + 1] == "1.0"
        limit = int(container["resources"]["limits"]["memory"])
        [status] = pod["status"]["containerStatuses"]
        assert status["containerID"].startswith("containerd://") and status["ready"], status
        assert cgroup_limit(real_nodes.container_pid(status["containerID"])) == limit
        assert limits[name] == limit, f"{name}: Dask's memory_limit is the container's"


def test_an_invalid_pressure_spec_is_rejected_naming_the_field(sandbox: Sandbox) -> None:
    result = sandbox.apply(
        memory_policy("bad", sandbox.scheduler_address, replicas=4, pressure={"relieveAbove": "170%"}), check=False
    )
    assert result.returncode != 0
    assert "spec.pressure.relieveAbove" in result.stderr


def test_unreachable_scheduler_is_a_condition(sandbox: Sandbox) -> None:
    sandbox.apply(memory_policy("far", "tcp://127.0.0.1:9", replicas=4))
    reachable = sandbox.wait_for(lambda: condition(sandbox, "far", "SchedulerReachable"), what="reachability")
    assert reachable["status"] == "False" and reachable["message"].startswith("spec.scheduler.address:")


def test_a_hostile_scheduler_fails_the_request_and_runs_nothing(sandbox: Sandbox, tmp_path: Path) -> None:
    """Its ``identity`` answers a pickled object that would create a file when unpickled."""
    pods = sandbox.pods()
    marker = tmp_path / "pwned"
    with hostile.in_thread("serialized", marker, sandbox.host_address) as address:
        sandbox.apply(retirement_request("hostile", scheduler={"address": address}, count=1, timeout="60s"))
        failed = sandbox.wait_phase("hostile", "Failed", "Succeeded", timeout=60)
    assert not marker.exists(), "the scheduler's pickle ran in the operator"
    condition = next(c for c in failed["status"]["conditions"] if c["type"] == "Failed")
    assert (condition["status"], condition["reason"]) == ("True", "SchedulerMisbehaved"), condition
    assert "spec.scheduler.address" in condition["message"] and "memops refuses" in condition["message"]
    assert "__Serialized__" in condition["message"], condition["message"]
    assert sandbox.pods() == pods and sandbox.replicas() == 4


def test_unreachable_scheduler_fails_with_an_explanation_and_touches_nothing(sandbox: Sandbox) -> None:
    pods = sandbox.pods()
    sandbox.apply(retirement_request("lost", scheduler={"address": "tcp://127.0.0.1:9"}, count=1, timeout="6s"))
    pending = sandbox.wait_for(
        lambda: [
            c
            for c in sandbox.get("retire", "lost").get("status", {}).get("conditions", [])
            if c["type"] == "SchedulerReachable" and c["status"] == "False"
        ],
        what="the SchedulerReachable=False condition",
    )
    assert "spec.scheduler.address" in pending[0]["message"]
    failed = sandbox.wait_phase("lost", "Failed", "Succeeded")
    assert failed["status"]["phase"] == "Failed"
    assert "spec.scheduler.address" in failed["status"]["message"]
    assert sandbox.pods() == pods and sandbox.replicas() == 4


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
    assert memops_tracebacks(sandbox.operator_log()) == []


def test_invalid_specs_are_refused_and_the_operator_keeps_serving(sandbox: Sandbox) -> None:
    address = sandbox.scheduler_address
    cases = {
        "negative-count": ({"count": -1}, "spec.count"),
        "both": ({"count": 1, "workers": ["x"]}, "oneOf"),
        "on-timeout": ({"count": 1, "onTimeout": "Maybe"}, "spec.onTimeout"),
        "duration": ({"count": 1, "timeout": "ten minutes"}, "spec.timeout"),
        "kind": ({"count": 1, "workload": {"kind": "StatefulSet", "name": "dask-worker"}}, "spec.workload.kind"),
    }
    for name, (spec, field) in cases.items():
        result = sandbox.apply(retirement_request(name, scheduler={"address": address}, **spec), check=False)
        assert result.returncode != 0, name
        assert field in result.stderr, (name, result.stderr)
    assert sandbox.get("retirementrequests")["items"] == []
    explained = sandbox.kubectl("explain", "retirementrequest.spec.count").stdout
    assert "fewest unique bytes" in " ".join(explained.split())

    sandbox.apply(
        retirement_request(
            "ghost", scheduler={"address": address}, count=1, workload={"kind": "Deployment", "name": "no-such-workers"}
        )
    )
    ghost = sandbox.wait_phase("ghost", "Failed", "Succeeded")
    assert ghost["status"]["phase"] == "Failed"
    assert ghost["status"]["message"].startswith("spec.workload.name:")

    sandbox.apply(retirement_request("fine", scheduler={"address": address}, count=1))
    assert sandbox.wait_phase("fine", "Failed", "Succeeded")["status"]["phase"] == "Succeeded"
