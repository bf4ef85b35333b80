"""Which key gets which target, and what replication decides: the pure functions that run
inside the scheduler (:mod:`memops.scheduler.rules`, :func:`memops.scheduler.replication.decide`)."""

from __future__ import annotations

from typing import Any

import pytest

from memops.scheduler import replication, rules

SPOT = frozenset({"spot-1", "spot-2"})
RULES = rules.Rules(
    default=1,
    keys=(
        rules.KeyRule(2, prefix="load-parquet"),
        rules.KeyRule(3, pattern=r"train-\d+"),
        rules.KeyRule(2, scattered=True),
    ),
    pods=(rules.PodRule(2, SPOT),),
)


@pytest.mark.parametrize(
    ("prefix", "scattered", "wanted"),
    [
        pytest.param("load-parquet", False, 2, id="prefix"),
        pytest.param("load-parquet-x", False, 0, id="prefix-is-whole"),
        pytest.param("train-12", False, 3, id="pattern"),
        pytest.param("train-12x", False, 0, id="pattern-fullmatch"),
        pytest.param("sum", True, 2, id="scattered"),
        pytest.param("sum", False, 0, id="unruled"),
        pytest.param("train-1", True, 3, id="most-replicas-win"),
    ],
)
def test_key_target(prefix: str, scattered: bool, wanted: int) -> None:
    assert rules.key_target(RULES, prefix, scattered) == wanted


@pytest.mark.parametrize(
    ("wanted", "holders", "default", "expected"),
    [
        pytest.param(0, ["od-1"], 1, None, id="unruled-reduce-replicas-decides"),
        pytest.param(0, ["od-1"], 2, rules.Target(2), id="default-above-one-rules-every-key"),
        pytest.param(2, ["od-1"], 1, rules.Target(2), id="key-rule"),
        pytest.param(0, ["spot-1"], 1, rules.Target(2, SPOT), id="held-on-a-marked-pod"),
        pytest.param(3, ["spot-2", "od-1"], 1, rules.Target(3, SPOT), id="key-and-pod-rule"),
    ],
)
def test_target(wanted: int, holders: list[str], default: int, expected: rules.Target | None) -> None:
    ruleset = rules.Rules(default=default, keys=RULES.keys, pods=RULES.pods)
    assert rules.target(ruleset, wanted, holders) == expected


@pytest.mark.parametrize(
    ("data", "error"),
    [
        pytest.param({"keys": [{"pattern": "(a+)+b", "replicas": 2}]}, "nested quantifiers", id="catastrophic"),
        pytest.param({"keys": [{"pattern": "(a|a)*\\1", "replicas": 2}]}, "backreferences", id="backreference"),
        pytest.param({"keys": [{"pattern": "a" * 300, "replicas": 2}]}, "longer than", id="long-pattern"),
        pytest.param({"keys": [{"pattern": "(", "replicas": 2}]}, "not a regular expression", id="bad-pattern"),
        pytest.param({"keys": [{"prefix": "x", "replicas": 2}] * 33}, "at most 32", id="too-many-rules"),
        pytest.param({"keys": [{"prefix": "x", "replicas": 99}]}, r"rules\[0\]\.replicas", id="replicas-range"),
        pytest.param({"keys": [{"prefix": "x", "scattered": True, "replicas": 2}]}, "exactly one", id="two-selectors"),
        pytest.param({"maxReplicatedFraction": 2}, "maxReplicatedFraction", id="fraction"),
    ],
)
def test_refused_rules_name_the_field(data: dict[str, Any], error: str) -> None:
    with pytest.raises(rules.RuleError, match=error):
        rules.parse(data)


def test_parse_round_trip() -> None:
    parsed = rules.parse(
        {
            "default": 1,
            "keys": [{"prefix": "load-parquet", "replicas": 2}, {"scattered": True, "replicas": 2}],
            "pods": [{"workers": ["spot-1"], "replicas": 2}],
            "maxReplicatedFraction": 0.3,
        }
    )
    assert parsed.pods == (rules.PodRule(2, frozenset({"spot-1"})),)
    assert rules.key_target(parsed, "load-parquet", False) == 2


GiB = 2**30
MiB = 2**20


def worker(address: str, node: str = "", zone: str = "", memory: int = GiB, **kw: Any) -> replication.Worker:
    return replication.Worker(address, memory, 4 * GiB, node, zone, **kw)


WORKERS = [
    worker("a1", "node-a", "z1"),
    worker("a2", "node-a", "z1", memory=0),
    worker("b1", "node-b", "z1", memory=GiB // 2),
    worker("c1", "node-c", "z2", memory=2 * GiB),
]


def item(key: str, holders: tuple[str, ...], replicas: int = 2, nbytes: int = 10 * MiB, **kw: Any) -> replication.Item:
    away = kw.pop("away", frozenset())
    return replication.Item(key, nbytes, holders, rules.Target(replicas, away), **kw)


@pytest.mark.parametrize(
    ("workers", "items", "fraction", "copies", "drops"),
    [
        pytest.param(WORKERS, [item("k", ("a1",))], 0.3, [("k", "c1")], [], id="another-zone-first"),
        pytest.param(WORKERS, [item("k", ("c1",))], 0.3, [("k", "a2")], [], id="new-node-and-zone-least-full"),
        pytest.param(
            [w for w in WORKERS if w.address != "c1"], [item("k", ("a1",))], 0.3, [("k", "b1")], [],
            id="another-node-over-emptier-same-node",
        ),
        pytest.param(
            [worker("a1"), worker("b1", memory=3 * GiB), worker("c1", memory=int(2.7 * GiB))],
            [item("k", ("a1",), nbytes=100 * MiB)],
            0.3,
            [],
            [],
            id="no-recipient-over-the-ceiling",
        ),
        pytest.param(
            [*WORKERS[:3], worker("c1", "node-c", "z2", running=False, leaving=True)],
            [item("k", ("a1",))],
            0.3,
            [("k", "b1")],
            [],
            id="never-a-leaving-worker",
        ),
        pytest.param(
            WORKERS,
            [item("k", ("a1", "c1"), away=frozenset({"a1", "a2"}), replicas=2)],
            0.3,
            [],
            [],
            id="marked-and-outside-copy-at-target",
        ),
        pytest.param(
            WORKERS,
            [item("k", ("a1", "a2"), away=frozenset({"a1", "a2"}))],
            0.3,
            [("k", "c1")],
            [],
            id="copy-outside-the-marked-pods-even-at-count",
        ),
        pytest.param(
            WORKERS,
            [item("k", ("a1", "b1", "c1"))],
            0.3,
            [],
            [("k", "a1")],
            id="drop-the-fullest-when-no-node-is-shared",
        ),
        pytest.param(
            WORKERS,
            [item("k", ("a2", "b1", "a1"))],
            0.3,
            [],
            [("k", "a1")],
            id="drop-a-copy-sharing-a-node-first",
        ),
        pytest.param(
            WORKERS,
            [item("k", ("a1", "b1", "c1"), replicas=1, away=frozenset({"b1", "c1"}))],
            0.3,
            [],
            [("k", "b1"), ("k", "c1")],
            id="marked-copies-dropped-never-the-last-outside",
        ),
        pytest.param(
            WORKERS,
            [
                item("cheap", ("a1",), cost=1e-9, nbytes=100 * MiB),
                item("costly", ("a1",), cost=1e-6, nbytes=100 * MiB),
                item("scattered", ("a1",), recomputable=False, nbytes=100 * MiB),
            ],
            # 16 GiB of limits: 200 MiB of budget is two copies of 100 MiB.
            200 / (16 * 1024),
            [("scattered", "c1"), ("costly", "c1")],
            [],
            id="budget-serves-unrecomputable-then-costly",
        ),
    ],
)
def test_decide(
    workers: list[replication.Worker],
    items: list[replication.Item],
    fraction: float,
    copies: list[tuple[str, str]],
    drops: list[tuple[str, str]],
) -> None:
    plan = replication.decide(workers, items, max_fraction=fraction, ceiling=0.7)
    assert list(plan.copies) == copies
    assert list(plan.drops) == drops
    assert plan.spent <= plan.budget or not plan.copies


def test_decide_counts_what_it_could_not_serve() -> None:
    plan = replication.decide(WORKERS, [item("k", ("a1",), nbytes=GiB)], max_fraction=0.01, ceiling=0.7)
    assert plan.copies == () and plan.unserved == ("k",)
