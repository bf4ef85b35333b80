"""Replication targets, operator side: pod rules into worker addresses, and annotation batching."""

from __future__ import annotations

from typing import Any

import pytest

from memops import specs
from memops.decisions import replication_plan
from memops.decisions.objects import POD_DELETION_COST
from memops.scheduler import rules as scheduler_rules

MiB = 2**20


def pod(name: str, node: str, **labels: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": labels}, "spec": {"nodeName": node}}


PODS = [pod("w-0", "n-spot", team="a"), pod("w-1", "n-od", team="b"), pod("w-2", "n-od", team="a"), pod("w-3", "")]
NODES = {
    "n-spot": {"karpenter.sh/capacity-type": "spot", replication_plan.ZONE_LABEL: "z1"},
    "n-od": {"karpenter.sh/capacity-type": "on-demand", replication_plan.ZONE_LABEL: "z2"},
}
ADDRESSES = {"w-0": "tcp://a:1", "w-1": "tcp://b:1", "w-2": "tcp://c:1"}  # w-3 has no worker yet


@pytest.mark.parametrize(
    ("rule", "marked"),
    [
        pytest.param({"nodeSelector": {"karpenter.sh/capacity-type": "spot"}}, ["tcp://a:1"], id="node-selector"),
        pytest.param({"labelSelector": {"matchLabels": {"team": "a"}}}, ["tcp://a:1", "tcp://c:1"], id="match-labels"),
        pytest.param(
            {"labelSelector": {"matchExpressions": [{"key": "team", "operator": "NotIn", "values": ["a"]}]}},
            ["tcp://b:1"],
            id="not-in",
        ),
        pytest.param(
            {"labelSelector": {"matchExpressions": [{"key": "team", "operator": "DoesNotExist"}]}},
            [],
            id="does-not-exist-and-no-worker",
        ),
        pytest.param({"nodeSelector": {"nothing": "here"}}, [], id="no-node-matches"),
    ],
)
def test_pod_rules_become_worker_addresses(rule: dict[str, Any], marked: list[str]) -> None:
    spec = specs.ReplicationSpec.model_validate(
        {"rules": [{"keys": {"prefix": "load-parquet"}, "replicas": 2}, {"pods": rule, "replicas": 2}]}
    )
    rules, places = replication_plan.agent_rules(spec, pods=PODS, nodes=NODES, addresses=ADDRESSES, ceiling=0.7)
    assert rules["keys"] == [{"prefix": "load-parquet", "replicas": 2}]
    assert rules["pods"] == [{"workers": marked, "replicas": 2}]
    assert places == {"tcp://a:1": ("n-spot", "z1"), "tcp://b:1": ("n-od", "z2"), "tcp://c:1": ("n-od", "z2")}


def test_a_glob_rule_reaches_the_scheduler_as_written() -> None:
    """The operator sends a key rule as written; the scheduler's own check accepts it and
    matches the glob against key prefixes."""
    spec = specs.ReplicationSpec.model_validate({"rules": [{"keys": {"glob": "load-*"}, "replicas": 3}]})
    rules, _ = replication_plan.agent_rules(spec, pods=PODS, nodes=NODES, addresses=ADDRESSES, ceiling=0.7)
    assert rules["keys"] == [{"glob": "load-*", "replicas": 3}]
    parsed = scheduler_rules.parse(rules)
    assert scheduler_rules.key_target(parsed, "load-parquet", False) == 3
    assert scheduler_rules.key_target(parsed, "read-parquet", False) == 0


FIGURES = replication_plan.PodFigures(unique_bytes=100 * MiB, replicated_bytes=50 * MiB, target=2, under_keys=0)
WRITTEN = {**FIGURES.annotations(), replication_plan.UPDATED: "1000"}


@pytest.mark.parametrize(
    ("current", "figures", "now", "written"),
    [
        pytest.param({}, FIGURES, 1000.0, True, id="never-written"),
        pytest.param(WRITTEN, FIGURES, 2000.0, False, id="unchanged"),
        pytest.param(
            WRITTEN, replication_plan.PodFigures(105 * MiB, 50 * MiB, 2, 0), 2000.0, False, id="moved-under-10-percent"
        ),
        pytest.param(
            WRITTEN, replication_plan.PodFigures(150 * MiB, 50 * MiB, 2, 0), 2000.0, True, id="moved-over-10-percent"
        ),
        pytest.param(
            {**WRITTEN, replication_plan.UNIQUE_BYTES: "1000"},
            replication_plan.PodFigures(500_000, 50 * MiB, 2, 0),
            2000.0,
            False,
            id="small-figure-moves-less-than-1-mib",
        ),
        pytest.param(WRITTEN, replication_plan.PodFigures(100 * MiB, 50 * MiB, 2, 1), 2000.0, True, id="count-moved"),
        pytest.param(
            WRITTEN, replication_plan.PodFigures(900 * MiB, 50 * MiB, 2, 3), 1020.0, False, id="at-most-every-30-s"
        ),
    ],
)
def test_annotations_are_batched(
    current: dict[str, str], figures: replication_plan.PodFigures, now: float, written: bool
) -> None:
    patches = replication_plan.plan_annotations({"w-0": current}, {"w-0": figures}, now)
    assert ("w-0" in patches) == written
    if written:
        assert patches["w-0"][replication_plan.UNIQUE_BYTES] == str(figures.unique_bytes)
        assert patches["w-0"][POD_DELETION_COST] == str(figures.unique_bytes // MiB)
        assert patches["w-0"][replication_plan.UPDATED] == f"{now:.0f}"


def test_pods_without_figures_or_gone_get_no_write() -> None:
    assert replication_plan.plan_annotations({"w-0": {}}, {"w-9": FIGURES}, 0.0) == {}


def test_pod_figures_from_the_agent() -> None:
    figures = replication_plan.pod_figures(
        agent_workers={"tcp://a:1": [10, 1, 2, 30]}, addresses={"w-0": "tcp://a:1", "w-1": "tcp://b:1"}, default=1
    )
    assert figures == {
        "w-0": replication_plan.PodFigures(unique_bytes=30, replicated_bytes=10, target=2, under_keys=1),
        "w-1": replication_plan.PodFigures(unique_bytes=0, replicated_bytes=0, target=1, under_keys=0),
    }


@pytest.mark.parametrize(
    ("rule", "error"),
    [
        pytest.param({"keys": {"pattern": "(a|a)*b"}, "replicas": 2}, r"keys\.pattern: regular", id="pattern"),
        pytest.param({"keys": {"glob": "*" * 257}, "replicas": 2}, "at most 256 characters", id="long-glob"),
        pytest.param({"keys": {}, "replicas": 2}, "exactly one of prefix", id="no-key-selector"),
        pytest.param({"replicas": 2}, "exactly one of keys, pods", id="no-selector"),
        pytest.param({"pods": {}, "replicas": 2}, "exactly one of nodeSelector", id="empty-pods"),
        pytest.param({"keys": {"prefix": "x"}, "replicas": 0}, "greater than or equal to 1", id="replicas"),
    ],
)
def test_spec_refuses_bad_rules(rule: dict[str, Any], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        specs.ReplicationSpec.model_validate({"rules": [rule]})
