"""Shared spill: the schema's refusals, the host directories allowed, the memory arithmetic, the pod
mutation, the QoS class, the policy's conditions, and what the webhook's plan_injection does with
all of them."""

from __future__ import annotations

import logging
from typing import Any, cast

import pydantic
import pytest

from memops import cli, crds, specs
from memops.clients import daskrpc, prestop_hook
from memops.decisions import policy_decisions, safetynet, shared_spill
from tests.unit.policy_inputs import pass_inputs, policy_spec

GI = 2**30
MI = 2**20


def spill(medium: str = "Memory", size: str = "2Gi", **fields: Any) -> specs.SharedSpillSpec:
    return specs.SharedSpillSpec.model_validate({"medium": medium, "sizeLimit": size, **fields})


NODE = {"hostPath": "/var/lib/memops/spill", "nodeSelector": {"feature.node.kubernetes.io/memory-swap.enabled": "true"}}
HOOK = prestop_hook.PRE_STOP_SCRIPT
ROOTS = frozenset({"/var/lib/memops/spill"})  # memops run --shared-spill-host-root /var/lib/memops/spill


def worker(limit: str | None = "8Gi", *args: str, request: str | None = None, **container: Any) -> dict[str, Any]:
    resources: dict[str, Any] = {}
    if limit is not None:
        resources["limits"] = {"memory": limit, "cpu": "2"}
    if request is not None:
        resources["requests"] = {"memory": request, "cpu": "2"}
    return {"name": "worker", "command": ["dask", "worker", "tcp://s:8786", *args], "resources": resources, **container}


# -- the schema --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        pytest.param({"medium": "Node", "sizeLimit": "1Gi"}, "hostPath is required", id="node-without-hostpath"),
        pytest.param({"medium": "Memory", "sizeLimit": "1Gi", **NODE}, "for medium Node only", id="memory-with-host"),
        pytest.param({"medium": "Memory", "sizeLimit": "1Gi", "links": False}, "sharedSpill.links", id="memory-links"),
        pytest.param(
            {"medium": "Memory", "sizeLimit": "1Gi", "links": True}, "sharedSpill.links", id="memory-links-true"
        ),
        pytest.param({"medium": "Memory", "sizeLimit": "1Gi", "swap": "SpillOnly"}, "SpillOnly", id="memory-owner"),
        pytest.param(
            {"medium": "Node", "sizeLimit": "1Gi", **NODE, "swap": "SpillOnly", "links": False},
            "SpillOnly",
            id="owner-without-links",
        ),
        pytest.param({"medium": "Node", "sizeLimit": "1Gi", **NODE, "swap": "Spill"}, "swap", id="unknown-swap"),
        pytest.param({"medium": "Disk", "sizeLimit": "1Gi"}, "medium", id="unknown-medium"),
        pytest.param({"medium": "Memory", "sizeLimit": "-1Gi"}, "sizeLimit", id="negative-size"),
        pytest.param({"medium": "Memory", "sizeLimit": "0"}, "sizeLimit", id="zero-size"),
        pytest.param({"medium": "Memory", "sizeLimit": "8 GiB"}, "sizeLimit", id="not-a-quantity"),
        pytest.param({"medium": "Memory"}, "sizeLimit", id="no-size"),
        pytest.param({"medium": "Node", "sizeLimit": "1Gi", "hostPath": "spill"}, "hostPath", id="relative"),
        pytest.param({"medium": "Node", "sizeLimit": "1Gi", "hostPath": "/"}, "hostPath", id="root"),
        pytest.param({"medium": "Node", "sizeLimit": "1Gi", "hostPath": "/a/../etc"}, "hostPath", id="dotdot"),
        pytest.param({"medium": "Node", "sizeLimit": "1Gi", "hostPath": "/a/./b"}, "hostPath", id="dot"),
        pytest.param({"medium": "Node", "sizeLimit": "1Gi", "hostPath": "/a\x00b"}, "hostPath", id="nul"),
        pytest.param({"medium": "Node", "sizeLimit": "1Gi", "hostPath": "/a//b"}, "hostPath", id="double-slash"),
        pytest.param({"medium": "Node", "sizeLimit": "1Gi", "hostPath": "/etc/memops"}, "hostPath", id="etc"),
        pytest.param({"medium": "Node", "sizeLimit": "1Gi", "hostPath": "/proc"}, "hostPath", id="proc"),
        pytest.param({"medium": "Node", "sizeLimit": "1Gi", "hostPath": "/sys/fs"}, "hostPath", id="sys"),
        pytest.param({"medium": "Node", "sizeLimit": "1Gi", "hostPath": "/dev/sda"}, "hostPath", id="dev"),
        pytest.param({"medium": "Node", "sizeLimit": "1Gi", "hostPath": "/dev/shm"}, "hostPath", id="dev-shm-itself"),
        pytest.param({"medium": "Node", "sizeLimit": "1Gi", "hostPath": "/var/run/x"}, "hostPath", id="var-run"),
        pytest.param({"medium": "Node", "sizeLimit": "1Gi", "hostPath": "/var/lib"}, "hostPath", id="kubelet-parent"),
        pytest.param(
            {"medium": "Node", "sizeLimit": "1Gi", "hostPath": "/var/lib/kubelet/pods"}, "hostPath", id="kubelet"
        ),
        pytest.param(
            {"medium": "Node", "sizeLimit": "1Gi", "hostPath": "/x", "nodeSelector": {"-bad-": "v"}},
            "nodeSelector",
            id="label-key",
        ),
        pytest.param(
            {"medium": "Node", "sizeLimit": "1Gi", "hostPath": "/x", "nodeSelector": {"a": "not valid"}},
            "nodeSelector",
            id="label-value",
        ),
    ],
)
def test_the_schema_refuses_and_names_the_field(fields: dict[str, Any], field: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=field):
        specs.SharedSpillSpec.model_validate(fields)


@pytest.mark.parametrize("path", ["/var/lib/memops/spill", "/dev/shm/memops", "/mnt/spill", "/srv/tmpfs-1"])
def test_plain_host_paths_are_accepted(path: str) -> None:
    assert spill("Node", hostPath=path).hostPath == path


def test_links_are_on_unless_turned_off_and_the_schema_writes_no_default() -> None:
    """Links are on when unset, yet the CRD has no default for them: the API server would write it
    into every sharedSpill, and the rule would then refuse every medium Memory."""
    assert spill("Node", **NODE).links is None
    assert spill("Node", links=False, **NODE).links is False
    assert spill("Memory").links is None
    crd = crds.crd_for(specs.MEMORY_POLICY)
    spec: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    shared = spec["properties"]["sharedSpill"]
    assert shared["properties"]["links"]["type"] == "boolean" and "default" not in shared["properties"]["links"]
    rule = {
        "rule": "self.medium != 'Memory' || !has(self.links)",
        "message": "sharedSpill.links is for medium Node only",
    }
    assert rule in shared["x-kubernetes-validations"]


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [("8Gi", 8 * GI), ("512M", 512 * 10**6), ("1e9", 10**9), ("1.5Gi", 3 * GI // 2), ("1500m", 2), ("100", 100)],
)
def test_quantities(text: str, nbytes: int) -> None:
    assert specs.parse_quantity(text) == nbytes


# -- the host directories the administrators allowed ---------------------------------------------


@pytest.mark.parametrize(
    ("path", "roots", "refused"),
    [
        pytest.param("/mnt/spill", {"/mnt/spill"}, None, id="the-root"),
        pytest.param("/mnt/spill", {"/mnt/spill/"}, None, id="root-with-trailing-slash"),
        pytest.param("/mnt/spill", {"/mnt//spill/."}, None, id="root-unnormalised"),
        pytest.param("/srv/b", {"/srv/a", "/srv/b"}, None, id="one-of-two"),
        pytest.param("/mnt/spill-other", {"/mnt/spill"}, "must be one of /mnt/spill", id="string-prefix-only"),
        pytest.param("/mnt/spill", {"/mnt/spill-other"}, "must be one of /mnt/spill-other", id="root-is-longer"),
        pytest.param("/mnt/spill/tenant", {"/mnt/spill"}, "symbolic link", id="under-a-root"),
        pytest.param("/mnt", {"/mnt/spill"}, "must be one of /mnt/spill", id="a-roots-parent"),
        pytest.param("/mnt/Spill", {"/mnt/spill"}, "must be one of", id="case-matters"),
        pytest.param("/mnt/x/../spill", {"/mnt/spill"}, "must be one of", id="dotdot-never-resolved"),
        pytest.param("/mnt/spill", set(), "allows no host directory", id="none-allowed"),
        pytest.param("/mnt/spill", {"mnt/spill"}, "allows no host directory", id="relative-root-ignored"),
        pytest.param("/mnt/spill", {"/"}, "allows no host directory", id="slash-is-no-root"),
    ],
)
def test_a_host_path_must_be_an_allowed_root(path: str, roots: set[str], refused: str | None) -> None:
    message = shared_spill.host_path_refusal(path, frozenset(roots))
    if refused is None:
        assert message is None
    else:
        assert message is not None and refused in message
        assert message.startswith(f"spec.sharedSpill.hostPath: {path!r}")
        assert ("symbolic link" in message) == (refused == "symbolic link")


@pytest.mark.parametrize(
    ("texts", "roots"),
    [
        pytest.param([], frozenset(), id="none"),
        pytest.param(["/mnt/spill/", "/mnt//spill"], frozenset({"/mnt/spill"}), id="normalised-once"),
        pytest.param(["/mnt/spill", "/mnt/spill-other"], frozenset({"/mnt/spill", "/mnt/spill-other"}), id="siblings"),
        pytest.param(["/dev/shm/memops"], frozenset({"/dev/shm/memops"}), id="dev-shm"),
    ],
)
def test_allowed_roots_are_normalised(texts: list[str], roots: frozenset[str]) -> None:
    assert shared_spill.host_roots(texts) == roots


@pytest.mark.parametrize(
    ("texts", "message"),
    [
        pytest.param(["spill"], "absolute", id="relative"),
        pytest.param(["/"], "absolute", id="slash"),
        pytest.param(["/mnt/../etc"], "'..'", id="dotdot"),
        pytest.param(["/etc/spill"], "could never use it", id="system-directory"),
        pytest.param(["/var/lib"], "could never use it", id="holds-the-kubelets"),
        pytest.param(["/mnt/my spill"], "could never use it", id="a-character-hostpath-refuses"),
        pytest.param(["/mnt", "/mnt/spill"], "lies under '/mnt'", id="nested"),
    ],
)
def test_roots_that_no_policy_could_use_or_that_nest_are_refused(texts: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        shared_spill.host_roots(texts)


def test_memops_run_refuses_a_bad_root(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["run", "--shared-spill-host-root", "/mnt/spill", "--shared-spill-host-root", "/proc/x"]) == 2
    assert "--shared-spill-host-root '/proc/x'" in capsys.readouterr().err


def test_node_medium_outside_the_roots_gets_no_mutation() -> None:
    pod_spec: dict[str, Any] = {"containers": [worker("8Gi", request="4Gi")]}
    for roots in (frozenset(), frozenset({"/var/lib/memops"}), frozenset({"/var/lib/memops/spill-other"})):
        verdict, mutation = shared_spill.plan(
            pod_spec, spill("Node", **NODE), host_roots=roots, namespace="ns", policy="p"
        )
        assert mutation is None and verdict.refusal == shared_spill.Refusal.HOST_PATH_NOT_ALLOWED
    # Memory needs no host directory: allowed with none.
    _, mutation = shared_spill.plan(pod_spec, spill(size="2Gi"), host_roots=frozenset(), namespace="ns", policy="p")
    assert mutation is not None


# -- the arithmetic ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("container", "size", "scale", "target", "terminate"),
    [
        # L = M = 8Gi, S = 2Gi: RSS must stay under 6Gi = 0.75 of M; terminate 0.95 -> 0.75.
        pytest.param(worker("8Gi"), "2Gi", 6 / (8 * 0.95), 0.473, 0.75, id="auto-limit"),
        # A small spill that already fits under terminate: nothing changes.
        pytest.param(worker("8Gi"), "256Mi", 1.0, 0.6, 0.95, id="fits-unscaled"),
        # --memory-limit 4GiB in an 8Gi container with 2Gi of spill: 4 * 0.95 < 6, unscaled.
        pytest.param(worker("8Gi", "--memory-limit", "4GiB"), "2Gi", 1.0, 0.6, 0.95, id="explicit-limit-fits"),
        # --memory-limit=6GB: 6e9 * 0.95 = 5.7e9 > 6Gi - ... scaled to (8Gi - 3Gi) / 5.7e9.
        pytest.param(
            worker("8Gi", "--memory-limit=6GB"), "3Gi", 5 * GI / (6e9 * 0.95), 0.565, 0.894, id="explicit-scaled"
        ),
        # Two worker processes share the container: auto gives each L / 2; together 2 * M.
        pytest.param(worker("8Gi", "--nworkers", "2"), "2Gi", 6 / (8 * 0.95), 0.473, 0.75, id="nworkers"),
        # The user's own fractions are the base.
        pytest.param(
            worker("8Gi", env=[{"name": "DASK_DISTRIBUTED__WORKER__MEMORY__TARGET", "value": "0.5"}]),
            "2Gi",
            6 / (8 * 0.95),
            0.394,
            0.75,
            id="user-target",
        ),
        # Unreadable (a variable): Dask would cap it at the cgroup's limit, so L is the safe side.
        pytest.param(
            worker("8Gi", "--memory-limit", "$(LIMIT)"), "2Gi", 6 / (8 * 0.95), 0.473, 0.75, id="unreadable-limit"
        ),
        # Above the cgroup's limit: Dask takes the cgroup's.
        pytest.param(worker("8Gi", "--memory-limit", "64GiB"), "2Gi", 6 / (8 * 0.95), 0.473, 0.75, id="above-cgroup"),
        # One argument with a space, as click takes it: 6 GB, not 6 bytes.
        pytest.param(
            worker("8Gi", "--memory-limit", "6 GB"), "3Gi", 5 * GI / (6e9 * 0.95), 0.565, 0.894, id="spaced-value"
        ),
        # A fraction --memory-limit is of the container's limit.
        pytest.param(worker("8Gi", "--memory-limit", "0.5"), "2Gi", 1.0, 0.6, 0.95, id="fraction-limit"),
        # Written in a shell script, as many images start workers.
        pytest.param(
            {
                "name": "w",
                "command": ["sh", "-c", "exec dask worker s:8786 --memory-limit 4GiB"],
                "resources": {"limits": {"memory": "8Gi"}},
            },
            "2Gi",
            1.0,
            0.6,
            0.95,
            id="shell-script",
        ),
    ],
)
def test_thresholds_are_scaled_so_that_data_plus_spill_fit(
    container: dict[str, Any], size: str, scale: float, target: float, terminate: float
) -> None:
    verdict = shared_spill.fit(container, spill(size=size))
    assert verdict.allowed, verdict.message
    assert verdict.scale == pytest.approx(scale, abs=1e-3)
    assert verdict.fractions["target"] == pytest.approx(target, abs=1e-3)
    assert verdict.fractions["terminate"] == pytest.approx(terminate, abs=1e-3)
    # The promise: every worker process at its terminate threshold, plus the spill, fits in L.
    limit, dask, workers = verdict.container_limit, verdict.dask_limit, verdict.workers
    assert limit is not None and dask is not None
    assert workers * dask * (verdict.fractions["terminate"] or 0) + verdict.spill <= limit
    order = [verdict.fractions[name] or 0 for name in shared_spill.THRESHOLDS]
    assert order == sorted(order), "target < spill < pause < terminate must keep their order"


@pytest.mark.parametrize(
    ("container", "size", "refusal", "field"),
    [
        pytest.param(worker("8Gi"), "8Gi", shared_spill.Refusal.DOES_NOT_FIT, "spec.sharedSpill.sizeLimit", id="S=L"),
        pytest.param(worker("8Gi"), "16Gi", shared_spill.Refusal.DOES_NOT_FIT, "spec.sharedSpill.sizeLimit", id="S>L"),
        pytest.param(
            worker("8Gi"), "7900Mi", shared_spill.Refusal.DOES_NOT_FIT, "spec.sharedSpill.sizeLimit", id="no-headroom"
        ),
        pytest.param(
            worker("8Gi"), "7Gi", shared_spill.Refusal.DOES_NOT_FIT, "spec.sharedSpill.sizeLimit", id="target-too-low"
        ),
        # The user's own target is above a tenth: the scaling, not the user, takes it under.
        pytest.param(
            worker("8Gi", env=[{"name": "DASK_DISTRIBUTED__WORKER__MEMORY__TARGET", "value": "0.6"}]),
            "7Gi",
            shared_spill.Refusal.DOES_NOT_FIT,
            "spec.sharedSpill.sizeLimit",
            id="user-target-too-low",
        ),
        pytest.param(
            worker("8Gi", env=[{"name": "DASK_DISTRIBUTED__WORKER__MEMORY__TARGET", "value": "0.1"}]),
            "2Gi",
            shared_spill.Refusal.DOES_NOT_FIT,
            "spec.sharedSpill.sizeLimit",
            id="user-target-a-tenth",
        ),
        pytest.param(worker(None), "1Gi", shared_spill.Refusal.NO_MEMORY_LIMIT, "limits.memory", id="no-limit"),
        pytest.param(
            worker("8Gi", "--memory-limit", "0"), "1Gi", shared_spill.Refusal.NO_DASK_LIMIT, "--memory-limit", id="off"
        ),
        pytest.param(
            worker("8Gi", "--local-directory", "/scratch"),
            "1Gi",
            shared_spill.Refusal.LOCAL_DIRECTORY,
            "--local-directory",
            id="local-directory",
        ),
        pytest.param(
            worker(
                "8Gi",
                env=[
                    {"name": "DASK_DISTRIBUTED__WORKER__MEMORY__TARGET", "value": "False"},
                    {"name": "DASK_DISTRIBUTED__WORKER__MEMORY__SPILL", "value": "false"},
                ],
            ),
            "1Gi",
            shared_spill.Refusal.SPILL_DISABLED,
            "never spills",
            id="spill-off",
        ),
    ],
)
def test_what_cannot_fit_is_refused_naming_the_field(
    container: dict[str, Any], size: str, refusal: shared_spill.Refusal, field: str
) -> None:
    verdict = shared_spill.fit(container, spill(size=size))
    assert verdict.refusal == refusal
    assert field in verdict.message


def test_a_disabled_threshold_stays_as_the_user_has_it() -> None:
    container = worker("8Gi", env=[{"name": "DASK_DISTRIBUTED__WORKER__MEMORY__TERMINATE", "value": "False"}])
    verdict = shared_spill.fit(container, spill(size="2Gi"))
    assert verdict.fractions["terminate"] is None
    # pause (0.8) is then the highest guard: scaled to (8 - 2) / 8 = 0.75.
    assert verdict.fractions["pause"] == pytest.approx(0.75, abs=1e-3)


@pytest.mark.parametrize(
    ("target", "size", "written"),
    [
        # Every key spilled at once (links and maps): 0.001 x 0.789 rounds down to 0, which is off.
        pytest.param("0.001", "2Gi", 0.001, id="a-thousandth"),
        pytest.param("0.001", "7Gi", 0.001, id="a-thousandth-scaled-hard"),
        pytest.param("0.05", "2Gi", 0.039, id="under-a-tenth"),
        pytest.param("0.05", None, 0.05, id="not-scaled"),
    ],
)
def test_a_target_the_user_sets_under_a_tenth_is_kept_scaled(target: str, size: str | None, written: float) -> None:
    container = worker("8Gi", env=[{"name": "DASK_DISTRIBUTED__WORKER__MEMORY__TARGET", "value": target}])
    verdict = shared_spill.fit(container, spill(size=size or "256Mi"))
    assert verdict.allowed, verdict.message
    assert (verdict.scale < 1) == (size is not None)
    assert verdict.fractions["target"] == pytest.approx(written, abs=1e-9)
    pod_spec = {"containers": [container]}
    _, mutation = shared_spill.plan(
        pod_spec, spill(size=size or "256Mi"), host_roots=frozenset(), namespace="ns", policy="p"
    )
    assert mutation is not None
    shared_spill.apply(pod_spec, mutation)
    env = {e["name"]: e["value"] for e in pod_spec["containers"][0]["env"]}
    # Dask reads 0 as off: target off would keep every key in memory up to the spill threshold.
    assert float(env["DASK_DISTRIBUTED__WORKER__MEMORY__TARGET"]) >= shared_spill.MIN_FRACTION


# -- the mutation --------------------------------------------------------------------------------


def test_memory_medium_gets_a_per_pod_emptydir_and_the_dask_environment() -> None:
    pod_spec = {"containers": [worker("8Gi", env=[{"name": "DASK_TEMPORARY_DIRECTORY", "value": "/tmp"}])]}
    _, mutation = shared_spill.plan(pod_spec, spill(size="2Gi"), host_roots=frozenset(), namespace="ns", policy="p")
    assert mutation is not None
    shared_spill.apply(pod_spec, mutation)
    assert pod_spec["volumes"] == [
        {"name": shared_spill.VOLUME_NAME, "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}}
    ]
    container = pod_spec["containers"][0]
    assert container["volumeMounts"] == [{"name": shared_spill.VOLUME_NAME, "mountPath": shared_spill.MOUNT_PATH}]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["DASK_TEMPORARY_DIRECTORY"] == shared_spill.MOUNT_PATH  # the user's /tmp is replaced
    assert [e["name"] for e in container["env"]].count("DASK_TEMPORARY_DIRECTORY") == 1
    assert env["DASK_DISTRIBUTED__WORKER__MEMORY__TARGET"] == "0.473"
    assert env["DASK_DISTRIBUTED__WORKER__MEMORY__TERMINATE"] == "0.75"
    assert "affinity" not in pod_spec
    shared_spill.apply(pod_spec, mutation)  # again: nothing more
    assert len(pod_spec["volumes"]) == 1 and len(container["volumeMounts"]) == 1


def test_node_medium_shares_the_host_directory_and_requires_the_selected_nodes() -> None:
    existing = {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}
    pod_spec: dict[str, Any] = {
        "containers": [worker("8Gi", request="4Gi")],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        existing,
                        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]},
                    ]
                }
            }
        },
    }
    _, mutation = shared_spill.plan(pod_spec, spill("Node", **NODE), host_roots=ROOTS, namespace="ns", policy="p")
    assert mutation is not None
    shared_spill.apply(pod_spec, mutation)
    # Not a subdirectory per pod: every worker of the policy on the node sees the same tree
    # (hand-over by hardlink), its policy's directory of the host root and nothing else.
    assert pod_spec["volumes"] == [
        {
            "name": shared_spill.VOLUME_NAME,
            "hostPath": {"path": "/var/lib/memops/spill/ns/p", "type": "DirectoryOrCreate"},
        }
    ]
    assert pod_spec["containers"][0]["volumeMounts"] == [
        {"name": shared_spill.VOLUME_NAME, "mountPath": shared_spill.MOUNT_PATH}
    ]
    ours = {"key": "feature.node.kubernetes.io/memory-swap.enabled", "operator": "In", "values": ["true"]}
    terms = pod_spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    # Terms are ORed: each one must carry the requirement.
    assert all(ours in term["matchExpressions"] for term in terms)
    assert terms[0]["matchExpressions"][0] == existing["matchExpressions"][0]


def host_volume(directory: str) -> dict[str, Any]:
    return {"name": "memops-spill", "hostPath": {"path": directory, "type": "DirectoryOrCreate"}}


MOUNT = {"name": "memops-spill", "mountPath": "/memops-spill"}


@pytest.mark.parametrize(
    ("medium", "namespace", "policy", "volume", "mount"),
    [
        pytest.param("Node", "team-a", "spill", host_volume("/var/lib/memops/spill/team-a/spill"), MOUNT, id="node"),
        # One policy name in two namespaces: two directories.
        pytest.param(
            "Node",
            "team-b",
            "spill",
            host_volume("/var/lib/memops/spill/team-b/spill"),
            MOUNT,
            id="node-other-namespace",
        ),
        pytest.param(
            "Node",
            "team-a",
            "spill.v2",
            host_volume("/var/lib/memops/spill/team-a/spill.v2"),
            MOUNT,
            id="node-dotted-policy",
        ),
        # Never the whole root: no namespace, or a name that is not one path component, no volume.
        pytest.param("Node", "", "spill", None, None, id="no-namespace"),
        pytest.param("Node", "team-a", "", None, None, id="no-policy"),
        pytest.param("Node", "..", "spill", None, None, id="dotdot-namespace"),
        pytest.param("Node", "team-a", ".", None, None, id="dot-policy"),
        pytest.param("Node", "team-a", "x/../../team-b/spill", None, None, id="slash-policy"),
        pytest.param(
            "Memory",
            "team-a",
            "spill",
            {"name": "memops-spill", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}},
            MOUNT,
            id="memory-per-pod",
        ),
    ],
)
def test_the_spill_volume_and_mount_of_each_namespace_and_policy(
    medium: str, namespace: str, policy: str, volume: dict[str, Any] | None, mount: dict[str, Any] | None
) -> None:
    """Medium Node's volume is the policy's own ``<root>/<namespace>/<policy>`` directory, mounted
    whole (no ``subPath``), never the root itself, which every tenant's pods would share."""
    spill_spec = spill(medium, **(NODE if medium == "Node" else {}))
    directory = shared_spill.spill_directory(str(spill_spec.hostPath or ""), namespace, policy)
    built = shared_spill.volume_and_mount(spill_spec, directory)
    assert built == (None if volume is None else (volume, mount))
    pod_spec: dict[str, Any] = {"containers": [worker("8Gi", request="4Gi")]}
    verdict, mutation = shared_spill.plan(pod_spec, spill_spec, host_roots=ROOTS, namespace=namespace, policy=policy)
    if volume is None:
        assert mutation is None and verdict.refusal == shared_spill.Refusal.HOST_PATH_NOT_ALLOWED
    else:
        assert mutation is not None and (mutation.volume, mutation.mount) == (volume, mount)


def test_the_directory_of_a_root_written_loosely_is_under_the_root() -> None:
    """The allowed root may be written with a trailing ``/`` or ``//``: its components decide."""
    assert shared_spill.spill_directory("//var/lib/memops/spill/", "ns", "p") == "/var/lib/memops/spill/ns/p"
    assert shared_spill.spill_directory("var/lib", "ns", "p") is None
    assert shared_spill.spill_directory("/var/../etc", "ns", "p") is None


ROOT = "/var/lib/memops/spill"


def _reach(volume: dict[str, Any], mount: dict[str, Any]) -> str:
    """The host directory that a mount of the volume shows the container: the volume's path, and
    the mount's subPath under it (the kubelet keeps a subPath inside its volume)."""
    sub = str(mount.get("subPath") or "")
    return "/".join(part for part in (volume["hostPath"]["path"].rstrip("/"), sub) if part)


# A tenant's mounts of memops' volume in containers that memops never looks at.
OTHER_MOUNTS = [
    pytest.param("containers", {}, id="second-container-no-subpath"),
    pytest.param("containers", {"subPath": "team-b/spill"}, id="second-container-other-tenant"),
    pytest.param("initContainers", {}, id="init-container-no-subpath"),
    pytest.param("initContainers", {"subPath": "team-b/spill"}, id="init-container-other-tenant"),
]


@pytest.mark.parametrize(("kind", "extra"), OTHER_MOUNTS)
def test_any_mount_of_the_spill_volume_reaches_only_the_policys_directory(kind: str, extra: dict[str, str]) -> None:
    """Whatever container mounts the volume that memops adds, now or later (an ephemeral
    container, through a subresource that the webhook never sees), with no subPath or with
    another tenant's, it reaches the policy's own directory or below it, never the root or
    another tenant's directory: the volume's path is the policy's directory."""
    own = f"{ROOT}/team-a/spill"
    pod_spec: dict[str, Any] = {"containers": [worker("8Gi", request="4Gi")]}
    verdict, mutation = shared_spill.plan(
        pod_spec, spill("Node", **NODE), host_roots=ROOTS, namespace="team-a", policy="spill"
    )
    assert mutation is not None, verdict
    shared_spill.apply(pod_spec, mutation)
    intruder = {"name": "intruder", "image": "busybox", "volumeMounts": [{**MOUNT, "mountPath": "/x", **extra}]}
    pod_spec.setdefault(kind, []).append(intruder)
    (volume,) = [v for v in pod_spec["volumes"] if v["name"] == shared_spill.VOLUME_NAME]
    for container in [*pod_spec["containers"], *pod_spec.get("initContainers", [])]:
        for mount in container.get("volumeMounts") or []:
            reached = _reach(volume, mount)
            assert reached == own or reached.startswith(own + "/"), (container["name"], reached)


@pytest.mark.parametrize(("kind", "extra"), OTHER_MOUNTS)
@pytest.mark.parametrize("medium", ["Node", "Memory"])
def test_a_pod_that_already_mounts_the_spill_volume_name_is_refused(
    medium: str, kind: str, extra: dict[str, str]
) -> None:
    """A mount of ``memops-spill`` declared before memops adds the volume: the webhook refuses the
    spill (the pod keeps the safety net), and the policy's status says why."""
    pod_spec: dict[str, Any] = {"containers": [worker("8Gi", request="4Gi")]}
    intruder = {"name": "intruder", "image": "busybox", "volumeMounts": [{**MOUNT, "mountPath": "/x", **extra}]}
    pod_spec.setdefault(kind, []).append(intruder)
    spill_spec = spill(medium, **(NODE if medium == "Node" else {}))
    verdict, mutation = shared_spill.plan(pod_spec, spill_spec, host_roots=ROOTS, namespace="team-a", policy="spill")
    assert mutation is None and verdict.refusal == shared_spill.Refusal.VOLUME_NAME_TAKEN, verdict
    assert kind in verdict.message and "intruder" in verdict.message
    spec = policy_spec(sharedSpill={"sizeLimit": "2Gi", "medium": medium, **(NODE if medium == "Node" else {})})
    pod = {"metadata": {"name": "w-1", "namespace": "team-a"}, "spec": pod_spec}
    change = safetynet.plan_injection(pod, "spill", spec, hook=HOOK, host_roots=ROOTS)
    assert change["annotations"][shared_spill.ANNOTATION] == "Refused: VolumeNameTaken"
    assert all(v.get("name") != shared_spill.VOLUME_NAME for v in change["spec"].get("volumes") or [])
    ready = shared_spill.condition(spill_spec, pod_spec, host_roots=ROOTS).ready
    assert ready is not None and ready[:2] == (False, "VolumeNameTaken")


def test_a_pod_that_already_has_a_volume_of_that_name_is_refused() -> None:
    pod_spec: dict[str, Any] = {
        "containers": [worker("8Gi", request="4Gi")],
        "volumes": [{"name": shared_spill.VOLUME_NAME, "hostPath": {"path": "/"}}],
    }
    verdict, mutation = shared_spill.plan(
        pod_spec, spill("Node", **NODE), host_roots=ROOTS, namespace="team-a", policy="spill"
    )
    assert mutation is None and verdict.refusal == shared_spill.Refusal.VOLUME_NAME_TAKEN


@pytest.mark.parametrize(
    ("args", "size", "max_spill"),
    [
        pytest.param(("--memory-limit=2GiB",), "2Gi", 2 * 2**30, id="one-process"),
        pytest.param(("--nworkers", "2", "--memory-limit=2GiB"), "2Gi", 2**30, id="two-processes"),
    ],
)
@pytest.mark.parametrize("medium", ["Node", "Memory"])
def test_size_limit_binds_what_each_worker_process_spills(
    medium: str, args: tuple[str, ...], size: str, max_spill: int
) -> None:
    """A hostPath has no sizeLimit: Dask's max-spill is each process' share of it, on either medium."""
    pod_spec: dict[str, Any] = {"containers": [worker("8Gi", *args, request="4Gi")]}
    spill_spec = spill(medium, size=size, **(NODE if medium == "Node" else {}))
    _, mutation = shared_spill.plan(pod_spec, spill_spec, host_roots=ROOTS, namespace="ns", policy="p")
    assert mutation is not None
    env = {e["name"]: e["value"] for e in mutation.env}
    assert env[shared_spill.MAX_SPILL_ENV] == str(max_spill)
    assert shared_spill.MAX_SPILL_ENV == "DASK_DISTRIBUTED__WORKER__MEMORY__MAX_SPILL"


def test_plan_injection_mounts_the_pods_namespace_directory() -> None:
    spec = policy_spec(sharedSpill={"medium": "Node", "sizeLimit": "2Gi", **NODE})
    pod = {"metadata": {"name": "w-1", "namespace": "team-a"}, "spec": {"containers": [worker("8Gi", request="4Gi")]}}
    volume = safetynet.plan_injection(pod, "p", spec, hook=HOOK, host_roots=ROOTS)["spec"]["volumes"][-1]
    assert volume["hostPath"]["path"] == "/var/lib/memops/spill/team-a/p"
    # The admission request's namespace wins over what the object says.
    change = safetynet.plan_injection(pod, "p", spec, hook=HOOK, host_roots=ROOTS, namespace="team-b")
    assert change["spec"]["volumes"][-1]["hostPath"]["path"] == "/var/lib/memops/spill/team-b/p"


def test_a_pod_without_affinity_gets_one_term() -> None:
    pod_spec: dict[str, Any] = {"containers": [worker("8Gi", request="4Gi")]}
    _, mutation = shared_spill.plan(pod_spec, spill("Node", **NODE), host_roots=ROOTS, namespace="ns", policy="p")
    assert mutation is not None
    shared_spill.apply(pod_spec, mutation)
    terms = pod_spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert (
        len(terms) == 1 and terms[0]["matchExpressions"][0]["key"] == "feature.node.kubernetes.io/memory-swap.enabled"
    )


# -- QoS, as Kubernetes computes it --------------------------------------------------------------


def _qos_pod(*containers: dict[str, Any], init: tuple[dict[str, Any], ...] = ()) -> dict[str, Any]:
    return {
        "containers": [{"name": f"c{i}", "resources": r} for i, r in enumerate(containers)],
        "initContainers": [{"name": f"i{i}", "resources": r} for i, r in enumerate(init)],
    }


G = {"limits": {"cpu": "1", "memory": "1Gi"}}  # requests default to limits


@pytest.mark.parametrize(
    ("pod_spec", "qos"),
    [
        pytest.param(_qos_pod({}), shared_spill.QoS.BEST_EFFORT, id="nothing"),
        pytest.param(_qos_pod(G), shared_spill.QoS.GUARANTEED, id="limits-only"),
        pytest.param(
            _qos_pod({"requests": {"cpu": "1000m", "memory": "1024Mi"}, "limits": {"cpu": "1", "memory": "1Gi"}}),
            shared_spill.QoS.GUARANTEED,
            id="equal-written-differently",
        ),
        pytest.param(
            _qos_pod({"requests": {"memory": "512Mi", "cpu": "1"}, "limits": {"cpu": "1", "memory": "1Gi"}}),
            shared_spill.QoS.BURSTABLE,
            id="request-below-limit",
        ),
        pytest.param(_qos_pod({"limits": {"memory": "1Gi"}}), shared_spill.QoS.BURSTABLE, id="no-cpu-limit"),
        pytest.param(_qos_pod(G, {}), shared_spill.QoS.BURSTABLE, id="guaranteed-and-besteffort"),
        pytest.param(_qos_pod(G, init=({},)), shared_spill.QoS.BURSTABLE, id="init-besteffort"),
        pytest.param(
            {**_qos_pod({}), "resources": {"limits": {"cpu": "1", "memory": "1Gi"}}},
            shared_spill.QoS.GUARANTEED,
            id="pod-level",
        ),
    ],
)
def test_qos_class(pod_spec: dict[str, Any], qos: shared_spill.QoS) -> None:
    assert shared_spill.qos_class(pod_spec) == qos


# -- the policy's conditions ----------------------------------------------------------------------


def _conditions(
    spill_spec: dict[str, Any] | None, template: dict[str, Any] | None, roots: frozenset[str] = ROOTS
) -> dict[str, Any]:
    spec = policy_spec(**({"sharedSpill": spill_spec} if spill_spec is not None else {}))
    decision = policy_decisions.decide(pass_inputs(spec, template=template, host_roots=roots))
    return {c.type: c for c in decision.status.conditions}


@pytest.mark.parametrize(
    ("spill_spec", "template", "ready", "swappable"),
    [
        pytest.param(None, None, None, None, id="no-spill"),
        pytest.param(
            {"medium": "Memory", "sizeLimit": "2Gi"},
            {"containers": [worker("8Gi")]},
            ("True", "Injected"),
            None,
            id="memory-fits",
        ),
        pytest.param(
            {"medium": "Memory", "sizeLimit": "8Gi"},
            {"containers": [worker("8Gi")]},
            ("False", "DoesNotFit"),
            None,
            id="memory-refused",
        ),
        pytest.param(
            {"medium": "Node", "sizeLimit": "2Gi", **NODE},
            {"containers": [worker("8Gi", request="4Gi")]},
            ("True", "Injected"),
            ("True", "Burstable"),
            id="node-burstable",
        ),
        pytest.param(
            {"medium": "Node", "sizeLimit": "2Gi", **NODE},
            {"containers": [worker("8Gi")]},
            ("True", "Injected"),
            ("False", "NotBurstable"),
            id="node-guaranteed",
        ),
        pytest.param(
            {"medium": "Node", "sizeLimit": "2Gi", **NODE},
            None,
            ("Unknown", "TemplateUnknown"),
            ("Unknown", "TemplateUnknown"),
            id="not-read",
        ),
        pytest.param(
            {"medium": "Node", "sizeLimit": "2Gi", **NODE, "hostPath": "/var/lib/memops/spill-other"},
            {"containers": [worker("8Gi", request="4Gi")]},
            ("False", "HostPathNotAllowed"),
            ("True", "Burstable"),
            id="node-not-allowed",
        ),
        pytest.param(
            # Refused before the template is needed: the host path alone decides.
            {"medium": "Node", "sizeLimit": "2Gi", **NODE, "hostPath": "/var/lib/memops/spill/x"},
            None,
            ("False", "HostPathNotAllowed"),
            ("Unknown", "TemplateUnknown"),
            id="node-not-allowed-not-read",
        ),
    ],
)
def test_the_policy_reports_the_webhooks_verdict(
    spill_spec: dict[str, Any] | None,
    template: dict[str, Any] | None,
    ready: tuple[str, str] | None,
    swappable: tuple[str, str] | None,
) -> None:
    found = _conditions(spill_spec, template)
    for type_, expected in ((shared_spill.READY, ready), (shared_spill.SWAPPABLE, swappable)):
        if expected is None:
            assert type_ not in found
        else:
            assert (found[type_].status, found[type_].reason) == expected
            assert found[type_].observedGeneration == 3
    if ready == ("False", "DoesNotFit"):
        assert "spec.sharedSpill.sizeLimit" in found[shared_spill.READY].message
    if ready == ("False", "HostPathNotAllowed"):
        message = found[shared_spill.READY].message
        assert message.startswith("spec.sharedSpill.hostPath: ") and "one of /var/lib/memops/spill" in message
    if swappable == ("False", "NotBurstable"):
        assert "Guaranteed" in found[shared_spill.SWAPPABLE].message


def test_without_allowed_roots_the_policy_says_how_to_allow_one() -> None:
    found = _conditions({"medium": "Node", "sizeLimit": "2Gi", **NODE}, {"containers": [worker("8Gi")]}, frozenset())
    ready = found[shared_spill.READY]
    assert (ready.status, ready.reason) == ("False", "HostPathNotAllowed")
    assert "--shared-spill-host-root" in ready.message and "sharedSpill.hostRoots" in ready.message


def test_conditions_go_when_the_spill_goes() -> None:
    spec = policy_spec(sharedSpill={"medium": "Memory", "sizeLimit": "2Gi"})
    first = policy_decisions.decide(pass_inputs(spec, template={"containers": [worker("8Gi")]}))
    again = policy_decisions.decide(pass_inputs(policy_spec(), status=first.status))
    assert shared_spill.READY not in {c.type for c in again.status.conditions}


def test_template_spec_of_each_kind() -> None:
    pod_spec = {"containers": [worker()]}
    assert shared_spill.template_spec({"kind": "Deployment", "spec": {"template": {"spec": pod_spec}}}) == pod_spec
    group = {"kind": "DaskWorkerGroup", "spec": {"worker": {"spec": pod_spec}}}
    assert shared_spill.template_spec(group) == pod_spec
    assert shared_spill.template_spec({"kind": "Deployment", "spec": {}}) is None


# -- the webhook's plan ---------------------------------------------------------------------------


def _pod(container: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": "w-1"}, "spec": {"containers": [container]}}


def test_plan_injection_adds_the_spill_beside_the_safety_net() -> None:
    spec = policy_spec(sharedSpill={"medium": "Memory", "sizeLimit": "2Gi"})
    change = safetynet.plan_injection(_pod(worker("8Gi")), "p", spec, hook=HOOK)
    container = change["spec"]["containers"][0]
    names = [e["name"] for e in container["env"]]
    assert "MEMOPS_SCHEDULER_ADDRESS" in names and "DASK_TEMPORARY_DIRECTORY" in names
    assert "preStop" in container["lifecycle"]
    assert change["spec"]["volumes"][0]["name"] == shared_spill.VOLUME_NAME
    assert change["annotations"][shared_spill.ANNOTATION] == "Memory"


@pytest.mark.parametrize(
    ("spill_spec", "roots", "annotation"),
    [
        pytest.param({"medium": "Memory", "sizeLimit": "8Gi"}, ROOTS, "Refused: DoesNotFit", id="does-not-fit"),
        pytest.param(
            {"medium": "Node", "sizeLimit": "2Gi", **NODE}, frozenset(), "Refused: HostPathNotAllowed", id="no-root"
        ),
        pytest.param(
            {"medium": "Node", "sizeLimit": "2Gi", **NODE},
            frozenset({"/var/lib/memops"}),
            "Refused: HostPathNotAllowed",
            id="under-a-root",
        ),
    ],
)
def test_a_refused_spill_leaves_the_pod_with_the_safety_net_only(
    spill_spec: dict[str, Any], roots: frozenset[str], annotation: str
) -> None:
    spec = policy_spec(sharedSpill=spill_spec)
    change = safetynet.plan_injection(_pod(worker("8Gi", request="4Gi")), "p", spec, hook=HOOK, host_roots=roots)
    container = change["spec"]["containers"][0]
    assert "volumes" not in change["spec"] and "volumeMounts" not in container and "affinity" not in change["spec"]
    assert not any(e["name"].startswith("DASK_") for e in container["env"])
    assert "preStop" in container["lifecycle"]
    assert change["annotations"][shared_spill.ANNOTATION] == annotation


def test_plan_injection_mounts_an_allowed_host_path() -> None:
    spec = policy_spec(sharedSpill={"medium": "Node", "sizeLimit": "2Gi", **NODE})
    change = safetynet.plan_injection(
        _pod(worker("8Gi", request="4Gi")), "p", spec, hook=HOOK, host_roots=ROOTS, namespace="ns"
    )
    assert change["spec"]["volumes"][0]["hostPath"]["path"] == "/var/lib/memops/spill/ns/p"
    assert change["annotations"][shared_spill.ANNOTATION] == "Node"


SIDECAR = {"name": "sidecar", "resources": {"requests": {"memory": "64Mi"}, "limits": {"memory": "128Mi"}}}


@pytest.mark.parametrize(
    ("pod_spec", "swaps", "reason"),
    [
        pytest.param({"containers": [worker("8Gi", request="4Gi")]}, True, "Burstable", id="burstable"),
        pytest.param({"containers": [worker("8Gi")]}, False, "NotBurstable", id="guaranteed"),
        # The pod is Burstable through its sidecar, but the worker's request equals its limit.
        pytest.param({"containers": [worker("8Gi"), SIDECAR]}, False, "WorkerNotSwappable", id="worker-guaranteed"),
        pytest.param(
            {"containers": [worker("8Gi", request="4Gi")], "priorityClassName": "system-node-critical"},
            False,
            "CriticalPod",
            id="critical",
        ),
    ],
)
def test_swap_as_the_kubelet_decides_it(pod_spec: dict[str, Any], swaps: bool, reason: str) -> None:
    assert shared_spill.swap_verdict(pod_spec)[:2] == (swaps, reason)


def test_the_deployment_index_keeps_what_the_verdict_reads() -> None:
    """The policy pass reads a Deployment from the operator's index, which drops most of the pod
    template: what it keeps must give the verdict that the full template gives."""
    from memops.controllers import policy

    for spill_spec in (spill(size="2Gi"), spill(size="8Gi"), spill("Node", size="2Gi", **NODE)):
        for container in (
            worker("8Gi", "--memory-limit=6GB", request="4Gi"),
            worker("8Gi", env=[{"name": "DASK_DISTRIBUTED__WORKER__MEMORY__TARGET", "value": "0.5"}]),
            worker(None),
        ):
            full = {"containers": [container, SIDECAR], "initContainers": [{"name": "init", "image": "busybox"}]}
            slim = policy._slim_pod_spec(full)
            verdict = shared_spill.condition(spill_spec, full, host_roots=ROOTS)
            assert shared_spill.condition(spill_spec, slim, host_roots=ROOTS) == verdict


def test_links_condition_is_true_when_every_worker_took_the_plugin() -> None:
    found = {f"tcp://10.0.0.{i}:40000": {"status": "Active"} for i in range(3)}
    value, reason, message = shared_spill.links_condition(found)
    assert (value, reason) == (True, "Active") and "all 3 workers" in message


def test_links_condition_names_the_workers_that_refused_and_bounds_what_they_say() -> None:
    found: dict[str, Any] = {f"tcp://10.0.0.{i}:40000": {"status": "Active"} for i in range(3)}
    found |= {f"tcp://10.0.1.{i}:40000": {"status": "Refused", "reason": "spill is not a zict.File"} for i in range(7)}
    found["tcp://10.0.2.1:40000"] = {"status": "Refused", "reason": "x" * 10_000}  # a worker's words
    found["tcp://10.0.2.2:40000"] = "not a mapping"
    value, reason, message = shared_spill.links_condition(found)
    assert (value, reason) == (False, "Refused")
    assert message.startswith("9 of 12 workers refused same-node links"), message
    assert "tcp://10.0.1.0:40000: spill is not a zict.File" in message
    assert message.count("tcp://") == shared_spill.LINKS_NAMED and message.endswith("; and 4 more"), message
    assert len(message) < 2_000


def test_links_condition_is_unknown_without_workers() -> None:
    assert shared_spill.links_condition({})[:2] == (None, "NoWorkers")


class LinksScheduler:
    """The scheduler as the pass' ``install_links`` sees it: what it is asked, and every worker Active."""

    address = "tcp://10.0.0.1:8786"

    def __init__(self) -> None:
        self.asked: list[bool] = []

    async def install_links(self, *, report: bool = True) -> dict[str, Any]:
        self.asked.append(report)
        return {"tcp://10.0.0.2:40000": {"status": "Active"}} if report else {}


async def test_links_false_installs_nothing_and_says_so() -> None:
    """With ``links: false`` the pass does not install the plugin and the condition names the field;
    turned back on, the workers are asked again although they are the same ones."""
    import kopf

    from memops.clients import kube
    from memops.controllers import policy

    body = kopf.Body({"metadata": {"name": "p", "namespace": "dask", "uid": "u", "generation": 1}, "spec": {}})
    client = kube.Kube(kopf.ConnectionInfo(server="https://127.0.0.1:6443"))  # never called
    reconciler = policy.Policy(client=client, body=body, logger=logging.getLogger(__name__))
    scheduler = LinksScheduler()
    workers = frozenset({"tcp://10.0.0.2:40000"})

    def spill_spec(**fields: Any) -> specs.MemoryPolicySpec:
        return policy_spec(sharedSpill={"medium": "Node", "sizeLimit": "2Gi", **NODE, **fields})

    async def install(spec: specs.MemoryPolicySpec, found: list[specs.Condition]) -> list[specs.Condition]:
        return await reconciler.install_links(cast(daskrpc.Scheduler, scheduler), spec, workers, found, 2)

    found = await install(spill_spec(), [])
    assert scheduler.asked == [True] and [(c.status, c.reason) for c in found] == [("True", "Active")]
    found = await install(spill_spec(links=False), found)
    assert scheduler.asked == [True], "links: false must not install the plugin"
    [disabled] = found
    assert (disabled.type, disabled.status, disabled.reason) == (shared_spill.LINKS, "False", "Disabled")
    assert disabled.message.startswith("spec.sharedSpill.links is false") and disabled.observedGeneration == 2
    assert await install(spill_spec(links=False), found) == found  # every pass: the same condition
    # The spill's figures come from the plugin: none read, rather than a status of an empty tmpfs.
    old = specs.SharedSpillStatus(workers=1, bytes=10)
    assert await reconciler.read_spill(cast(daskrpc.Scheduler, scheduler), spill_spec(links=False), old) is None
    found = await install(spill_spec(links=True), found)
    assert scheduler.asked == [True, True] and [(c.status, c.reason) for c in found] == [("True", "Active")]
    await client.close()


def test_spill_status_counts_a_linked_file_once_and_skips_what_is_not_plain_numbers() -> None:
    # Two workers on one node link one 100-byte file that a wrote; a third holds 10 bytes of its own.
    reports: dict[str, Any] = {
        "a": {"bytes": 100, "ownBytes": 100, "share": 50.0},
        "b": {"bytes": 100, "ownBytes": 0, "share": 50.0},
        "c": {"bytes": 10, "ownBytes": 10, "share": 10},
        "hostile-share": {"bytes": 10, "share": 11},  # more than its own bytes
        "hostile-own": {"bytes": 10, "ownBytes": 11, "share": 1},
        "hostile-own-text": {"bytes": 10, "ownBytes": "10", "share": 1},
        "hostile-nan": {"bytes": 10, "share": float("nan")},
        "hostile-bool": {"bytes": True, "share": 0},
        "hostile-text": {"bytes": "10", "share": 1},
        "hostile-huge": {"bytes": 2**70, "share": 1},
        "not-a-map": [100, 50],
    }
    found = shared_spill.spill_status(reports, "2026-11-26T00:00:00Z")
    assert found == specs.SharedSpillStatus(
        workers=3, bytes=110, bytesCountedPerWorker=210, bytesWithoutWriter=0, lastRead="2026-11-26T00:00:00Z"
    )


def test_files_the_spill_owner_allocated_are_the_owners_neither_a_workers_nor_without_a_writer() -> None:
    """a's pod has the owner: 80 of its 100 bytes were allocated by the owner, 20 by a itself (the owner
    refused them); b, without one, wrote its 50. Nothing is without a writer, and what a grows by
    leaves out the owner's 80."""
    reports: dict[str, Any] = {
        "a": {"bytes": 100, "ownBytes": 20, "ownerBytes": 80, "share": 100},
        "b": {"bytes": 50, "ownBytes": 50, "share": 50},
        "hostile-owner": {"bytes": 10, "ownBytes": 5, "ownerBytes": 6, "share": 10},
        "hostile-owner-text": {"bytes": 10, "ownBytes": 5, "ownerBytes": "5", "share": 10},
    }
    found = shared_spill.spill_status(reports, "2026-11-26T00:00:00Z")
    assert (found.workers, found.bytes, found.bytesWithoutWriter, found.bytesChargedToOwners) == (2, 150, 0, 80)
    assert shared_spill.linked_bytes(reports)["a"] == 80


def test_a_file_only_its_linkers_name_is_charged_to_no_worker() -> None:
    """a wrote 100 bytes and handed them over to b by a link, then was drained and left: the kernel
    no longer charges those pages to any worker's pod (its parent's, the node's), and neither does the
    status; b's own 30 bytes stay b's."""
    reports: dict[str, Any] = {"b": {"bytes": 130, "ownBytes": 30, "share": 130}}
    found = shared_spill.spill_status(reports, "2026-11-26T00:00:00Z")
    assert (found.bytes, found.bytesWithoutWriter) == (130, 100)


def test_linked_bytes_are_what_a_worker_holds_less_what_it_wrote() -> None:
    """Each worker's bytes linked from other writers, for in-place growth; a report that is not
    plain byte counts, says nothing of its own bytes, or claims more than it holds, is left out
    (its worker then counts as linking nothing)."""
    reports: dict[str, Any] = {
        "a": {"bytes": 100, "ownBytes": 100, "share": 50.0},  # wrote it: links nothing
        "b": {"bytes": 130, "ownBytes": 30, "share": 80.0},  # links a's 100 bytes
        "no-spill": {"bytes": 0, "ownBytes": 0, "share": 0},
        "no-share": {"bytes": 10, "ownBytes": 4},  # the share is not read here
        "hostile-negative": {"bytes": 10, "ownBytes": -5, "share": 1},
        "hostile-negative-bytes": {"bytes": -10, "ownBytes": -20, "share": 0},
        "hostile-own": {"bytes": 10, "ownBytes": 11, "share": 1},
        "hostile-text": {"bytes": "10", "ownBytes": 0, "share": 1},
        "hostile-float": {"bytes": 10.0, "ownBytes": 0, "share": 1},
        "hostile-bool": {"bytes": True, "ownBytes": False, "share": 0},
        "hostile-huge": {"bytes": 2**70, "ownBytes": 0, "share": 1},
        "hostile-no-own": {"bytes": 10, "share": 1},
        "not-a-map": [100, 50],
    }
    assert shared_spill.linked_bytes(reports) == {"a": 0, "b": 100, "no-spill": 0, "no-share": 6}
    assert shared_spill.linked_bytes({}) == {}


class SpillScheduler:
    """The scheduler as the pass' ``read_spill`` sees it: the workers' spill reports, or no answer."""

    def __init__(self, reports: dict[str, Any]) -> None:
        self.reports: dict[str, Any] | None = reports

    async def spill_shares(self) -> dict[str, Any]:
        if self.reports is None:
            raise daskrpc.SchedulerUnreachable("tcp://10.0.0.1:8786", "gone")
        return self.reports


async def test_the_spill_read_keeps_each_workers_linked_bytes_for_growth() -> None:
    """Medium Node: the pass keeps, from its spill read, each worker's bytes linked from other
    writers; a failed read, or another medium, forgets them."""
    import kopf

    from memops.clients import kube
    from memops.controllers import policy

    body = kopf.Body({"metadata": {"name": "p", "namespace": "dask", "uid": "u", "generation": 1}, "spec": {}})
    client = kube.Kube(kopf.ConnectionInfo(server="https://127.0.0.1:6443"))  # never called
    reconciler = policy.Policy(client=client, body=body, logger=logging.getLogger(__name__))
    node = policy_spec(sharedSpill={"medium": "Node", "sizeLimit": "2Gi", **NODE})
    reports: dict[str, Any] = {"tcp://a:1": {"bytes": 100, "ownBytes": 100, "share": 50}}
    reports["tcp://b:1"] = {"bytes": 130, "ownBytes": 30}
    reports["tcp://c:1"] = {"bytes": 10, "ownBytes": "a lot", "share": 1}  # hostile: counts as linking nothing
    scheduler = SpillScheduler(reports)
    found = await reconciler.read_spill(cast(daskrpc.Scheduler, scheduler), node, None)
    assert found is not None and found.workers == 1  # b has no share: not in the status, but its links count
    assert reconciler.spill_linked == {"tcp://a:1": 0, "tcp://b:1": 100}
    scheduler.reports = None
    reconciler.spill_read = -policy._SPILL_SECONDS  # due again
    assert await reconciler.read_spill(cast(daskrpc.Scheduler, scheduler), node, found) == found
    assert reconciler.spill_linked == {}
    reconciler.spill_linked = {"tcp://b:1": 100}
    memory = policy_spec(sharedSpill={"medium": "Memory", "sizeLimit": "2Gi"})
    assert await reconciler.read_spill(cast(daskrpc.Scheduler, scheduler), memory, found) is None
    assert reconciler.spill_linked == {}
    await client.close()


def test_the_status_sharedspill_field_is_in_the_schema() -> None:
    status = specs.MemoryPolicyStatus.model_validate({"sharedSpill": {"workers": 2, "bytes": 5}})
    assert status.sharedSpill is not None and status.sharedSpill.bytesCountedPerWorker == 0


# -- swap: SpillOnly, the spill owner ---------------------------------------------------------------


OWNER_SCRIPT = "print('the owner')"


def test_spill_only_adds_the_owner_sidecar_and_the_worker_requests_its_limit() -> None:
    pod_spec: dict[str, Any] = {"containers": [worker("2Gi", request="1Gi", image="dask:1")]}
    verdict, mutation = shared_spill.plan(
        pod_spec,
        spill("Node", size="4Gi", **NODE, swap="SpillOnly"),
        host_roots=ROOTS,
        namespace="ns",
        policy="p",
        owner_script=OWNER_SCRIPT,
    )
    # 4Gi of spill does not fit in a 2Gi worker, but the owner, not the worker, is charged for it.
    assert verdict.allowed and verdict.scale == 1.0, verdict.message
    assert mutation is not None
    shared_spill.apply(pod_spec, mutation)
    shared_spill.apply(pod_spec, mutation)  # again: nothing more
    [sidecar] = pod_spec["initContainers"]
    assert sidecar["name"] == shared_spill.OWNER and sidecar["restartPolicy"] == "Always"
    assert sidecar["image"] == "dask:1"
    assert sidecar["command"] == ["python", "-c", OWNER_SCRIPT, shared_spill.OWNER_SOCKET, shared_spill.MOUNT_PATH]
    assert sidecar["resources"] == {
        "requests": {"memory": str(64 * MI)},
        "limits": {"memory": str(4 * GI + 64 * MI)},
    }
    assert {"name": shared_spill.VOLUME_NAME, "mountPath": shared_spill.MOUNT_PATH, "readOnly": True} in sidecar[
        "volumeMounts"
    ]
    security = sidecar["securityContext"]
    assert security["runAsNonRoot"] and security["capabilities"] == {"drop": ["ALL"]}
    assert not security["allowPrivilegeEscalation"] and security["readOnlyRootFilesystem"]
    container = pod_spec["containers"][0]
    assert container["resources"]["requests"] == {"memory": "2Gi", "cpu": "2"}
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env[shared_spill.OWNER_SOCKET_ENV] == shared_spill.OWNER_SOCKET
    assert [v["name"] for v in pod_spec["volumes"]] == [shared_spill.VOLUME_NAME, shared_spill.OWNER]
    assert [m["name"] for m in container["volumeMounts"]] == [shared_spill.VOLUME_NAME, shared_spill.OWNER]
    # The kubelet's own rules: the pod is Burstable, the worker container never swaps.
    assert shared_spill.qos_class(pod_spec) == shared_spill.QoS.BURSTABLE
    assert shared_spill.swap_verdict(pod_spec)[:2] == (False, "WorkerNotSwappable")


def test_without_spill_only_the_spill_is_the_workers_and_no_sidecar_is_added() -> None:
    pod_spec: dict[str, Any] = {"containers": [worker("8Gi", request="4Gi")]}
    verdict, mutation = shared_spill.plan(
        pod_spec, spill("Node", size="4Gi", **NODE), host_roots=ROOTS, namespace="ns", policy="p"
    )
    assert mutation is not None and verdict.scale < 1.0
    shared_spill.apply(pod_spec, mutation)
    assert "initContainers" not in pod_spec
    assert pod_spec["containers"][0]["resources"]["requests"]["memory"] == "4Gi"


def test_the_swappable_condition_says_the_spill_may_swap_and_the_worker_may_not() -> None:
    pod_spec = {"containers": [worker("8Gi", request="4Gi")]}
    verdict = shared_spill.condition(spill("Node", **NODE, swap="SpillOnly"), pod_spec, host_roots=ROOTS)
    assert verdict.swappable is not None
    swaps, reason, message = verdict.swappable
    assert (swaps, reason) == (True, "SpillOnly")
    assert "spec.sharedSpill.swap" in message
    assert shared_spill.OWNER in verdict.ready[2]
    critical = {**pod_spec, "priorityClassName": "system-cluster-critical"}
    found = shared_spill.condition(spill("Node", **NODE, swap="SpillOnly"), critical, host_roots=ROOTS).swappable
    assert found is not None and found[:2] == (False, "CriticalPod")


def test_the_webhook_gives_the_owner_the_worker_modules_own_source() -> None:
    from memops.controllers import safetynet_webhook
    from memops.worker import owner

    assert "def serve(" in safetynet_webhook.OWNER_SCRIPT
    assert 'if __name__ == "__main__"' in safetynet_webhook.OWNER_SCRIPT
    assert owner.SOCKET_ENV == shared_spill.OWNER_SOCKET_ENV
