"""The disruption annotations through a MemoryPolicy's whole pass and its goodbye, with no cluster.

Inputs: the real pass (:class:`memops.controllers.policy.Policy`) on a stand-in for the API
(:class:`Api`: Deployments, pods found by label selector, merge-patches applied to them, the
policy's status kept), and the scheduler as the pass' read sees it (:func:`_scheduler`: reached,
with each worker's unique bytes, or out of reach), so that no Dask scheduler runs. Each pass is a
new :class:`Policy`, as after a restart of the operator: what it knows of earlier passes is what
they wrote into the pods and the status. What is asserted: which pods carry
``karpenter.sh/do-not-disrupt`` and ``cluster-autoscaler.kubernetes.io/safe-to-evict`` after the
passes, whatever the policy's ``spec.workload`` names by then.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import logging
from collections.abc import AsyncIterator, Mapping
from types import SimpleNamespace
from typing import Any, cast

import kopf
import pytest

from memops import cli
from memops.clients import kube
from memops.controllers import policy
from memops.decisions import disruption, objects, policy_findings, snapshots, timestamps

NAMESPACE, POLICY = "team", "p"
LOGGER = logging.getLogger("test")
MARKS = (objects.DO_NOT_DISRUPT, objects.SAFE_TO_EVICT)
UNREACHABLE = policy_findings.SchedulerSeen("SchedulerUnreachable", "spec.scheduler.address: no answer")


def _deployment(name: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": name}}},
        "status": {"replicas": 1},
    }


def _pod(name: str, app: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": {"app": app}},
        "spec": {"nodeName": "node-a", "containers": [{"name": "worker"}]},
        "status": {"phase": "Running", "podIP": "10.0.0.1"},
    }


def _spec(workload: str) -> dict[str, Any]:
    return {
        "scheduler": {"address": "tcp://dask-scheduler:8786"},
        "workload": {"kind": "Deployment", "name": workload},
        "replicas": 1,
    }


def _selected(selector: str | None, labels: Mapping[str, str]) -> bool:
    """``k=v,k2=v2``, as :func:`memops.decisions.selectors.render` writes a matchLabels."""
    if not selector:
        return True
    return all(labels.get(key) == value for key, value in (part.split("=", 1) for part in selector.split(",")))


def _merge(target: dict[str, Any], patch: Mapping[str, Any]) -> None:
    """A JSON merge-patch (RFC 7386): None removes a key."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, Mapping):
            _merge(target.setdefault(key, {}), value)
        else:
            target[key] = copy.deepcopy(value)


class Api:
    """The API as a policy's pass and goodbye use it, in the namespace ``team``."""

    def __init__(self, deployments: list[str], pods: list[dict[str, Any]]):
        self.deployments = {name: _deployment(name) for name in deployments}
        self.pods = {str(p["metadata"]["name"]): p for p in pods}
        self.status: dict[str, Any] = {}

    async def get_or_none(self, path: str) -> dict[str, Any] | None:
        kind, name = path.rsplit("/", 2)[-2:]
        assert kind == "deployments", path
        return copy.deepcopy(self.deployments.get(name))

    async def list(self, path: str, label_selector: str | None = None, **_: Any) -> list[dict[str, Any]]:
        if path.endswith("/pods"):
            return [copy.deepcopy(p) for p in self.pods.values() if _selected(label_selector, p["metadata"]["labels"])]
        return []  # no other policy, HPA, RetirementRequest or FailedPreStopHook event

    async def list_not_older_than(
        self, path: str, version: str | None, label_selector: str | None = None, **_: Any
    ) -> tuple[list[dict[str, Any]], str]:
        return await self.list(path, label_selector=label_selector), "1"

    async def merge_patch(self, path: str, patch: dict[str, Any]) -> dict[str, Any]:
        if path.endswith("/status"):
            _merge(self.status, patch["status"])
            return {}
        kind, name = path.rsplit("/", 2)[-2:]
        assert kind == "pods", path
        _merge(self.pods[name], patch)
        return copy.deepcopy(self.pods[name])

    def marks(self, pod: str) -> dict[str, str]:
        """What a node autoscaler reads of the pod."""
        annotations = self.pods[pod]["metadata"].get("annotations") or {}
        return {key: annotations[key] for key in MARKS if key in annotations}

    def age_condition(self, kind: str, seconds: float) -> None:
        """The status as the clock would show it ``seconds`` later: the condition's last transition earlier."""
        for condition in self.status["conditions"]:
            if condition["type"] == kind:
                moment = timestamps.parse(condition["lastTransitionTime"]) - datetime.timedelta(seconds=seconds)
                condition["lastTransitionTime"] = timestamps.render(moment)


def _scheduler(unique: Mapping[str, int] | None) -> Any:
    """``Policy.reach_scheduler`` as the pass sees it: reached, with each pod's worker holding
    ``unique`` bytes alone; or (None) out of reach."""

    @contextlib.asynccontextmanager
    async def reach(spec: Any, *, keys: bool = False) -> AsyncIterator[tuple[policy_findings.SchedulerSeen, Any]]:
        if unique is None:
            yield UNREACHABLE, None
            return
        workers = tuple(
            snapshots.WorkerInfo(name=pod, address=f"tcp://10.0.0.1:{40000 + i}", memory_limit=2**30, unique_bytes=held)
            for i, (pod, held) in enumerate(sorted(unique.items()))
        )
        yield policy_findings.SchedulerSeen(), (object(), snapshots.SchedulerSnapshot(workers=workers))

    return reach


def _reconciler(api: Api, workload: str, **settings: Any) -> policy.Policy:
    body = {
        "metadata": {"name": POLICY, "namespace": NAMESPACE, "uid": "uid-p", "generation": 1},
        "spec": _spec(workload),
        "status": copy.deepcopy(api.status),
    }
    return policy.Policy(client=cast(kube.Kube, api), body=kopf.Body(body), logger=LOGGER, **settings)


async def one_pass(api: Api, workload: str, unique: Mapping[str, int] | None, **settings: Any) -> None:
    reconciler = _reconciler(api, workload, **settings)
    reconciler.reach_scheduler = _scheduler(unique)  # type: ignore[method-assign]
    await reconciler.reconcile()


async def test_a_scheduler_out_of_reach_after_protection_leaves_no_marks_for_long() -> None:
    """Protected while the scheduler answered; then it stops answering. A short outage keeps
    the marks (nothing is known to have changed), a long one takes them off: nothing can say any
    more that the worker still holds data alone."""
    api = Api(["w"], [_pod("w-1", "w")])
    await one_pass(api, "w", {"w-1": 4096})
    assert api.marks("w-1") == {objects.DO_NOT_DISRUPT: "true", objects.SAFE_TO_EVICT: "false"}
    await one_pass(api, "w", None)
    assert api.marks("w-1"), "a moment out of reach changes nothing"
    api.age_condition("SchedulerReachable", 15 * 60)
    await one_pass(api, "w", None)
    assert api.marks("w-1") == {}, "out of reach for long: the marks come off"


async def test_a_switch_of_the_workload_unprotects_the_old_workloads_pods() -> None:
    api = Api(["old", "new"], [_pod("old-1", "old"), _pod("new-1", "new")])
    await one_pass(api, "old", {"old-1": 4096})
    assert api.marks("old-1")
    await one_pass(api, "new", {"new-1": 0})
    assert api.marks("old-1") == {}, "the policy's marks leave the pod it no longer manages"
    assert api.marks("new-1") == {}


async def test_deleting_the_policy_after_a_switch_unprotects_the_old_workloads_pods() -> None:
    api = Api(["old", "new"], [_pod("old-1", "old"), _pod("new-1", "new")])
    await one_pass(api, "old", {"old-1": 4096})
    assert api.marks("old-1")
    await _reconciler(api, "new").goodbye()
    assert api.marks("old-1") == {}, "memops finds its marks by its own label, not by the current spec.workload"


async def test_a_namespace_the_administrator_turned_protection_off_in_gets_none() -> None:
    """Protected under the operator's defaults; then the administrator lists the namespace
    (``memops run --no-disruption-protection-in team``): the marks come off, and are not set again
    while the worker still holds data alone."""
    api = Api(["w"], [_pod("w-1", "w")])
    await one_pass(api, "w", {"w-1": 4096})
    assert api.marks("w-1")
    off = disruption.Administrator(off_namespaces=frozenset({NAMESPACE}))
    await one_pass(api, "w", {"w-1": 4096}, protection=off)
    assert api.marks("w-1") == {}
    await one_pass(api, "w", {"w-1": 4096}, protection=off)
    assert api.marks("w-1") == {}
    elsewhere = disruption.Administrator(off_namespaces=frozenset({"other"}))
    await one_pass(api, "w", {"w-1": 4096}, protection=elsewhere)
    assert api.marks("w-1"), "another namespace's setting changes nothing here"


async def test_a_switch_to_a_workload_that_is_not_there_unprotects_too() -> None:
    """The policy cannot act (WorkloadNotFound): it protects nothing, and its label finds what it protected."""
    api = Api(["old"], [_pod("old-1", "old")])
    await one_pass(api, "old", {"old-1": 4096})
    assert api.marks("old-1")
    await one_pass(api, "missing", {"old-1": 4096})
    assert api.status["conditions"], "the pass was blocked, and said so"
    assert api.marks("old-1") == {}


async def test_what_a_protected_pod_carries_after_its_protection() -> None:
    """The state of protection lives on the pod: the label that finds it, and when protection began,
    which stays once the marks are off (so that the bound is not renewed)."""
    api = Api(["w"], [_pod("w-1", "w")])
    await one_pass(api, "w", {"w-1": 4096})
    metadata = api.pods["w-1"]["metadata"]
    assert metadata["labels"][objects.PROTECTED_LABEL] == POLICY
    began = metadata["annotations"][objects.PROTECTION_BEGAN_ANNOTATION]
    assert began == metadata["annotations"][objects.PROTECTED_ANNOTATION]
    await _reconciler(api, "w").goodbye()
    metadata = api.pods["w-1"]["metadata"]
    assert objects.PROTECTED_LABEL not in metadata["labels"] and api.marks("w-1") == {}
    assert metadata["annotations"] == {objects.PROTECTION_BEGAN_ANNOTATION: began}


def test_the_operators_flags_refuse_what_would_protect_nothing_as_asked(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["run", "--max-disruption-protection", "forever"]) == 2
    assert "'forever' is not a duration" in capsys.readouterr().err
    assert cli.main(["run", "--no-disruption-protection-in", "team,ml"]) == 2
    assert "'team,ml' is not a namespace name" in capsys.readouterr().err


class _Configured:
    """A scheduler as the goodbye reaches it: what it is asked to remove."""

    def __init__(self) -> None:
        self.removed: list[str] = []

    async def configure_relief(self, **_: Any) -> None:
        self.removed.append("pressure")

    async def configure_replication(self, **_: Any) -> None:
        self.removed.append("replication")

    async def configure_placement(self, **_: Any) -> None:
        self.removed.append("placement")

    async def configure_admission(self, **_: Any) -> None:
        self.removed.append("tasks")


def _reachable(monkeypatch: pytest.MonkeyPatch) -> tuple[_Configured, list[int]]:
    scheduler, reached = _Configured(), []

    @contextlib.asynccontextmanager
    async def vetted(*_: Any, **__: Any) -> AsyncIterator[Any]:
        reached.append(1)
        yield SimpleNamespace(scheduler=scheduler)

    monkeypatch.setattr(policy.vetting, "vetted", vetted)
    return scheduler, reached


async def test_the_goodbye_removes_what_a_pass_installed_though_its_status_never_said_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The policy was deleted while a pass installed replication and placement: that pass' status
    patch was refused, so the status does not name them, and the goodbye removes them all the same."""
    scheduler, _ = _reachable(monkeypatch)
    api = Api(["w"], [_pod("w-1", "w")])
    reconciler = _reconciler(api, "w")
    reconciler.installed |= {"replication", "placement"}
    await reconciler.goodbye()
    assert scheduler.removed == ["replication", "placement"]


async def test_the_goodbye_of_a_policy_that_installed_nothing_reaches_no_scheduler(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nothing in the status, nothing installed by a pass: no connection (the namespace may be going)."""
    _, reached = _reachable(monkeypatch)
    await _reconciler(Api(["w"], [_pod("w-1", "w")]), "w").goodbye()
    assert reached == []
    api = Api(["w"], [_pod("w-1", "w")])
    api.status = {"pressure": {"relieved": 1}}
    scheduler, reached = _reachable(monkeypatch)
    await _reconciler(api, "w").goodbye()
    assert reached == [1] and scheduler.removed == ["pressure"], "what the status names is removed"
