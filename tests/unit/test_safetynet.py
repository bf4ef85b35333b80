"""What a worker pod of a MemoryPolicy's workload gets at creation."""

from typing import Any

from memops import safetynet, specs

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
    change = safetynet.plan_injection(pod(env=[{"name": "KEEP", "value": "1"}]), "analytics", SPEC)
    container = change["spec"]["containers"][0]
    assert change["spec"]["terminationGracePeriodSeconds"] == 120 + safetynet.GRACE_MARGIN_SECONDS
    assert container["lifecycle"]["preStop"]["exec"]["command"][:2] == ["python", "-c"]
    assert 'call("retire_workers", names=[name]' in container["lifecycle"]["preStop"]["exec"]["command"][2]
    env = {e["name"]: e for e in container["env"]}
    assert env["KEEP"]["value"] == "1"
    assert env["MEMOPS_SCHEDULER_ADDRESS"]["value"] == "tcp://dask-scheduler:8786"
    assert env["MEMOPS_POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["MEMOPS_DRAIN_TIMEOUT"]["value"] == "120"
    assert change["annotations"] == {safetynet.ANNOTATION: "analytics"}


def test_an_existing_prestop_hook_and_a_longer_grace_period_are_kept() -> None:
    own = {"preStop": {"exec": {"command": ["true"]}}}
    body = pod(lifecycle=own)
    body["spec"]["terminationGracePeriodSeconds"] = 3600
    change = safetynet.plan_injection(body, "analytics", SPEC)
    assert change["spec"]["containers"][0]["lifecycle"] == own
    assert change["spec"]["terminationGracePeriodSeconds"] == 3600


def test_prestop_script_compiles() -> None:
    compile(safetynet.PRE_STOP_SCRIPT, "<preStop>", "exec")


def test_a_tls_scheduler_gets_the_policys_client_certificate_from_its_secret() -> None:
    spec = SPEC.model_copy(
        update={"scheduler": specs.SchedulerRef(address="tls://dask-scheduler:8786", tls={"secretName": "dask-tls"})}
    )
    container = safetynet.plan_injection(pod(), "analytics", spec)["spec"]["containers"][0]
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
    plain = safetynet.plan_injection(pod(), "analytics", SPEC)["spec"]["containers"][0]
    assert not any(e["name"].startswith("MEMOPS_TLS") for e in plain["env"])


def test_the_grace_period_has_a_maximum() -> None:
    longest = SPEC.model_copy(update={"drain": specs.DrainSpec(timeout="168h")})
    change = safetynet.plan_injection(pod(), "analytics", longest)
    assert change["spec"]["terminationGracePeriodSeconds"] == safetynet.MAX_GRACE_SECONDS == 7 * 86400 + 30
