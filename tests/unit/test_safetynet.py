"""What a worker pod of a MemoryPolicy's workload gets at creation."""

from typing import Any

import pytest

from memops import specs
from memops.clients import prestop_hook
from memops.decisions import safetynet

HOOK = prestop_hook.PRE_STOP_SCRIPT

SPEC = specs.MemoryPolicySpec.model_validate(
    {
        "scheduler": {"address": "tcp://dask-scheduler:8786"},
        "workload": {"kind": "Deployment", "name": "dask-worker"},
        "drain": {"timeout": "2m"},
    }
)


def pod(**container: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "w-1", "labels": {"app": "w"}},
        "spec": {"containers": [{"name": "worker", "command": ["dask", "worker"], **container}]},
    }


def test_prestop_drain_and_a_grace_period_that_covers_the_drain() -> None:
    change = safetynet.plan_injection(pod(env=[{"name": "KEEP", "value": "1"}]), "analytics", SPEC, hook=HOOK)
    container = change["spec"]["containers"][0]
    assert change["spec"]["terminationGracePeriodSeconds"] == 120 + safetynet.GRACE_MARGIN_SECONDS
    assert container["lifecycle"]["preStop"]["exec"]["command"][:2] == ["python", "-c"]
    assert 'call("retire_workers", workers=idle' in container["lifecycle"]["preStop"]["exec"]["command"][2]
    env = {e["name"]: e for e in container["env"]}
    assert env["KEEP"]["value"] == "1"
    assert env["MEMOPS_SCHEDULER_ADDRESS"]["value"] == "tcp://dask-scheduler:8786"
    assert env["MEMOPS_POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["MEMOPS_DRAIN_TIMEOUT"]["value"] == "120"
    # The hook's deadline: the grace period less the margin to close (it cannot see the pod's).
    assert env["MEMOPS_DRAIN_DEADLINE"]["value"] == "120"
    assert env["MEMOPS_NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    # Every IP of the pod (both families on a dual-stack cluster): the hook finds its workers by them.
    assert env["MEMOPS_POD_IPS"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIPs"
    assert (
        'operation="drain",\n        workers=sorted(workers),'
        in container["lifecycle"]["preStop"]["exec"]["command"][2]
    )
    assert 'origin="preStop"' in container["lifecycle"]["preStop"]["exec"]["command"][2]
    assert change["annotations"] == {safetynet.ANNOTATION: "analytics"}


def test_a_host_network_pod_gets_no_pod_ips_as_its_proof() -> None:
    """A hostNetwork pod's IPs are its node's, shared with every such pod there: a worker on them
    may be another pod's, so the hook goes by name alone. A MEMOPS_POD_IPS of the user's is
    replaced like every MEMOPS_ variable, never trusted."""
    own = [{"name": "MEMOPS_POD_IPS", "value": "10.0.0.9"}]
    body = pod(env=own)
    assert [
        e
        for e in safetynet.plan_injection(body, "a", SPEC, hook=HOOK)["spec"]["containers"][0]["env"]
        if e["name"] == "MEMOPS_POD_IPS"
    ] == [{"name": "MEMOPS_POD_IPS", "valueFrom": {"fieldRef": {"fieldPath": "status.podIPs"}}}]
    body["spec"]["hostNetwork"] = True
    env = safetynet.plan_injection(body, "a", SPEC, hook=HOOK)["spec"]["containers"][0]["env"]
    assert "MEMOPS_POD_IPS" not in {e["name"] for e in env}
    assert "MEMOPS_POD_NAME" in {e["name"] for e in env}


def test_an_existing_prestop_hook_and_a_longer_grace_period_are_kept() -> None:
    own = {"preStop": {"exec": {"command": ["true"]}}}
    body = pod(lifecycle=own)
    body["spec"]["terminationGracePeriodSeconds"] = 3600
    change = safetynet.plan_injection(body, "analytics", SPEC, hook=HOOK)
    assert change["spec"]["containers"][0]["lifecycle"] == own
    assert change["spec"]["terminationGracePeriodSeconds"] == 3600


def test_prestop_script_compiles() -> None:
    compile(prestop_hook.PRE_STOP_SCRIPT, "<preStop>", "exec")


def test_a_tls_scheduler_gets_the_policys_client_certificate_from_its_secret() -> None:
    spec = SPEC.model_copy(
        update={"scheduler": specs.SchedulerRef(address="tls://dask-scheduler:8786", tls={"secretName": "dask-tls"})}
    )
    container = safetynet.plan_injection(pod(), "analytics", spec, hook=HOOK)["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    refs = {
        name: env[name]["valueFrom"]["secretKeyRef"] for name in ("MEMOPS_TLS_CA", "MEMOPS_TLS_CERT", "MEMOPS_TLS_KEY")
    }
    assert refs == {
        "MEMOPS_TLS_CA": {"name": "dask-tls", "key": "ca.crt"},
        "MEMOPS_TLS_CERT": {"name": "dask-tls", "key": "tls.crt"},
        "MEMOPS_TLS_KEY": {"name": "dask-tls", "key": "tls.key"},
    }
    assert "preStop" in container["lifecycle"]
    plain = safetynet.plan_injection(pod(), "analytics", SPEC, hook=HOOK)["spec"]["containers"][0]
    assert not any(e["name"].startswith("MEMOPS_TLS") for e in plain["env"])


def test_the_grace_period_has_a_maximum() -> None:
    longest = SPEC.model_copy(update={"drain": specs.DrainSpec(timeout="168h")})
    change = safetynet.plan_injection(pod(), "analytics", longest, hook=HOOK)
    assert change["spec"]["terminationGracePeriodSeconds"] == safetynet.MAX_GRACE_SECONDS == 7 * 86400 + 30


DEPLOYMENT = specs.WorkloadRef(kind=specs.WorkloadKind.DEPLOYMENT, name="dask-worker")
GROUP = specs.WorkloadRef(kind=specs.WorkloadKind.DASK_WORKER_GROUP, name="dk-default")


@pytest.mark.parametrize(
    ("pod_name", "workload", "expected"),
    [
        pytest.param("dask-worker-7d9f6b-x2k4q", DEPLOYMENT, True, id="deployment-pod"),
        pytest.param("dask-worker-big-7d9f6b-x2k4q", DEPLOYMENT, False, id="another-deployment-with-the-prefix"),
        pytest.param("dask-worker-x2k4q", DEPLOYMENT, False, id="not-through-a-replicaset"),
        pytest.param("dask-worker", DEPLOYMENT, False, id="the-name-alone"),
        pytest.param("dk-default-worker-0a1b2c3d4e-6c8d9f-x2k4q", GROUP, True, id="group-worker-pod"),
        pytest.param("dk-default-7d9f6b-x2k4q", GROUP, False, id="group-name-but-not-a-worker"),
    ],
)
def test_a_gone_pod_is_recognised_by_its_name(pod_name: str, workload: specs.WorkloadRef, expected: bool) -> None:
    assert safetynet.is_workload_pod(pod_name, workload) is expected


def hook_event(pod_name: str, when: str, reason: str = "FailedPreStopHook", kind: str = "Pod") -> dict[str, Any]:
    return {
        "reason": reason,
        "message": "PreStopHook failed",
        "involvedObject": {"kind": kind, "name": pod_name, "fieldPath": "spec.containers{worker}"},
        "lastTimestamp": when,
    }


@pytest.mark.parametrize(
    ("events", "previous", "limit", "expected"),
    [
        pytest.param([], [], 10, [], id="none"),
        pytest.param(
            [hook_event("dask-worker-a1-bbbbb", "T2"), hook_event("dask-worker-a1-ccccc", "T1")],
            [],
            10,
            [("dask-worker-a1-ccccc", "T1"), ("dask-worker-a1-bbbbb", "T2")],
            id="oldest-first",
        ),
        pytest.param(
            [
                hook_event("other-a1-bbbbb", "T1"),
                hook_event("dask-worker-a1-bbbbb", "T1", reason="FailedPostStartHook"),
                hook_event("dask-worker-a1-bbbbb", "T1", kind="Node"),
            ],
            [],
            10,
            [],
            id="other-workloads-reasons-and-kinds-ignored",
        ),
        pytest.param(
            [hook_event("dask-worker-a1-bbbbb", "T2")],
            [specs.FailedHook(pod="dask-worker-a1-ccccc", time="T1", message="PreStopHook failed")],
            10,
            [("dask-worker-a1-ccccc", "T1"), ("dask-worker-a1-bbbbb", "T2")],
            id="kept-after-its-event-expired",
        ),
        pytest.param(
            [hook_event("dask-worker-a1-bbbbb", "T1")],
            [specs.FailedHook(pod="dask-worker-a1-bbbbb", time="T1", message="PreStopHook failed")],
            10,
            [("dask-worker-a1-bbbbb", "T1")],
            id="listed-once",
        ),
        pytest.param(
            [hook_event(f"dask-worker-a1-p{i:04d}", f"T{i:02d}") for i in range(15)],
            [],
            3,
            [(f"dask-worker-a1-p{i:04d}", f"T{i:02d}") for i in (12, 13, 14)],
            id="bounded-to-the-latest",
        ),
    ],
)
def test_failed_hooks_of_the_workload_from_the_kubelets_events(
    events: list[dict[str, Any]], previous: list[specs.FailedHook], limit: int, expected: list[tuple[str, str]]
) -> None:
    hooks = safetynet.failed_hooks(events, DEPLOYMENT, previous, limit)
    assert [(h.pod, h.time) for h in hooks] == expected


DEPLOYMENT = specs.WorkloadRef(kind=specs.WorkloadKind.DEPLOYMENT, name="dask-worker")
T0 = 1_900_000_000.0


def drain(pod: str, *, origin: str = "preStop", keys: Any = 3, ended: Any = T0, cause: str = "worker left") -> Any:
    """One entry of the agent's ``drain_status``, as :mod:`memops.scheduler.drain` reports it."""
    return {
        "state": "gone",
        "name": pod,
        "origin": origin,
        "endedAt": ended,
        "lostAtDeadline": {"keys": keys, "bytes": 3 * 2**20, "irreplaceableKeys": 2, "cause": cause},
    }


@pytest.mark.parametrize(
    ("entry", "recorded"),
    [
        pytest.param(drain("dask-worker-5d9c7-abcde"), True, id="a-hook-drain-that-lost-keys"),
        pytest.param(drain("dask-worker-5d9c7-abcde", origin=""), False, id="the-operators-own-drain"),
        pytest.param(drain("dask-worker-5d9c7-abcde", keys=0), False, id="nothing-lost"),
        pytest.param(drain("other-5d9c7-abcde"), False, id="another-workloads-pod"),
        pytest.param(drain("dask-worker-5d9c7-abcde", keys="3"), False, id="keys-not-a-number"),
        pytest.param(drain("dask-worker-5d9c7-abcde", ended=True), False, id="time-not-a-number"),
        pytest.param(drain("dask-worker-5d9c7-abcde", ended=1e300), False, id="time-out-of-range"),
        pytest.param({**drain("dask-worker-5d9c7-abcde"), "lostAtDeadline": None}, False, id="still-draining"),
        pytest.param("not a map", False, id="hostile-entry"),
    ],
)
def test_hook_losses_records_only_the_workloads_hook_drains_that_lost_keys(entry: Any, recorded: bool) -> None:
    losses = safetynet.hook_losses({"tcp://10.0.0.1:1": entry}, DEPLOYMENT)
    assert len(losses) == recorded
    if recorded:
        (loss,) = losses
        assert (loss.pod, loss.keys, loss.bytes, loss.irreplaceableKeys, loss.cause) == (
            "dask-worker-5d9c7-abcde",
            3,
            3 * 2**20,
            2,
            "worker left",
        )
        assert loss.time == "2030-03-17T17:46:40Z"


def test_hook_losses_are_recorded_once_across_passes_and_restarts() -> None:
    drains = {"tcp://10.0.0.1:1": drain("dask-worker-5d9c7-aaaaa"), "tcp://10.0.0.2:1": drain("dask-worker-5d9c7-b")}
    first = safetynet.hook_losses(drains, DEPLOYMENT)
    assert len(first) == 2
    # The next pass (or a restarted operator, reading the status back) finds nothing new.
    again = safetynet.hook_losses(drains, DEPLOYMENT, first)
    assert again == first
    old = specs.SafetyNetStatus(lostAtDeadline=first)
    assert safetynet.new_losses(old, specs.SafetyNetStatus(lostAtDeadline=again)) == []
    assert safetynet.new_losses(None, old) == first


def test_hook_losses_keep_the_latest_and_do_not_count_a_dropped_one_again() -> None:
    drains = {f"tcp://10.0.0.{i}:1": drain(f"dask-worker-5d9c7-p{i}", ended=T0 + i) for i in range(4)}
    kept = safetynet.hook_losses(drains, DEPLOYMENT, limit=2)
    assert [loss.pod for loss in kept] == ["dask-worker-5d9c7-p2", "dask-worker-5d9c7-p3"]
    # p0 and p1 fell off the list; the agent still reports them: they are not new.
    assert safetynet.hook_losses(drains, DEPLOYMENT, kept, limit=2) == kept
    newer = {**drains, "tcp://10.0.0.9:1": drain("dask-worker-5d9c7-p9", ended=T0 + 9)}
    assert [loss.pod for loss in safetynet.hook_losses(newer, DEPLOYMENT, kept, limit=2)] == [
        "dask-worker-5d9c7-p3",
        "dask-worker-5d9c7-p9",
    ]
