"""The webhook finds a new pod's MemoryPolicy in the operator's caches, in the pod's namespace only."""

from __future__ import annotations

from typing import Any

import pytest

from memops.controllers import safetynet_webhook


def policy(name: str, namespace: str, workload: str, created: str, kind: str = "Deployment", **spec: Any) -> Any:
    return {
        "metadata": {"name": name, "namespace": namespace, "creationTimestamp": created},
        "spec": {
            "scheduler": {"address": "tls://dask-scheduler:8786", "tls": {"secretName": f"{namespace}-tls"}},
            "workload": {"kind": kind, "name": workload},
            **spec,
        },
    }


def deployment(namespace: str, name: str, labels: dict[str, str]) -> dict[tuple[str, ...], list[dict[str, Any]]]:
    body = {"metadata": {"name": name, "namespace": namespace}, "spec": {"selector": {"matchLabels": labels}}}
    return {(namespace, name): [body]}


DEPLOYMENTS = {**deployment("a", "workers", {"app": "w"}), **deployment("b", "workers", {"app": "w"})}


@pytest.mark.parametrize(
    ("namespace", "labels", "policies", "expected"),
    [
        pytest.param("a", {"app": "w"}, [policy("p", "a", "workers", "T1")], "p", id="selected"),
        pytest.param("a", {"app": "x"}, [policy("p", "a", "workers", "T1")], None, id="labels-differ"),
        pytest.param(
            "a",
            {"app": "w"},
            [policy("young", "a", "workers", "T2"), policy("old", "a", "workers", "T1")],
            "old",
            id="oldest-wins",
        ),
        pytest.param(
            "a",
            {"app": "w"},
            [policy("bad", "a", "workers", "T0", replicas=-1), policy("good", "a", "workers", "T1")],
            "good",
            id="invalid-skipped",
        ),
        pytest.param("a", {"app": "w"}, [policy("p", "a", "missing", "T1")], None, id="workload-not-cached"),
        pytest.param(
            "a",
            {"app": "w"},
            [policy("theirs", "b", "workers", "T0")],
            None,
            id="another-namespaces-policy-never",
        ),
        pytest.param(
            "a",
            {"dask.org/component": "worker", "dask.org/workergroup-name": "dk-default"},
            [policy("dk", "a", "dk-default", "T1", kind="DaskWorkerGroup")],
            "dk",
            id="daskworkergroup-by-its-labels",
        ),
    ],
)
def test_policy_for_reads_the_caches(
    namespace: str, labels: dict[str, str], policies: list[Any], expected: str | None
) -> None:
    found = safetynet_webhook.policy_for(namespace, labels, policies=policies, deployments=DEPLOYMENTS)
    assert (found[0] if found else None) == expected
    if found is not None:
        tls = found[1].scheduler.tls
        assert tls is not None and tls.secretName == f"{namespace}-tls", "only the pod's own namespace's Secret"


class _Broken:
    """A cache whose every read fails, as a defect in the webhook's own code would."""

    def get(self, *args: Any) -> Any:
        raise RuntimeError("a defect")

    def __getitem__(self, key: Any) -> Any:
        raise RuntimeError("a defect")


async def test_a_failure_inside_the_webhook_never_blocks_the_pod() -> None:
    """Kopf turns an exception in a mutating handler into ``allowed: false`` (a successful call,
    which ``failurePolicy: Ignore`` does not cover): the handler must return instead, unpatched."""
    import logging

    import kopf

    from memops.controllers import policy

    registry = kopf.OperatorRegistry()
    safetynet_webhook.register(registry)
    (handler,) = [h for h in registry._webhooks.get_all_handlers() if h.id == "safety-net"]
    body = kopf.Body({"metadata": {"name": "p", "namespace": "a", "labels": {"app": "w"}}, "spec": {"containers": []}})
    patch = kopf.Patch()
    indexes = {name: _Broken() for name in policy.INDEX_NAMES.values()}
    await handler.fn(body=body, patch=patch, memo=kopf.Memo(), logger=logging.getLogger("test"), **indexes)
    assert not patch
