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
    assert "retire_workers(names=" in container["lifecycle"]["preStop"]["exec"]["command"][2]
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


def test_selects() -> None:
    assert safetynet.selects({"app": "w"}, {"app": "w", "x": "y"})
    assert not safetynet.selects({"app": "w"}, {"app": "v"})
    assert not safetynet.selects({}, {"app": "w"}), "an empty selector selects nothing here"
