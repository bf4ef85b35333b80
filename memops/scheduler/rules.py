"""Replication rules: which key gets which target; pure, and run inside the scheduler.

Key rules (a Dask key prefix, as ``key_split`` gives it; a glob over that prefix; or
``scattered`` data) are matched here, by :func:`key_target`, once per prefix; pod rules come from
the operator already turned into the addresses of the pods they mark, and :func:`target` combines
both for one key. :func:`parse` checks the plain data that the operator sends (the scheduler
trusts nothing it is sent) against a rule's bounds (:mod:`memops.rulesyntax.bounds`), which the
MemoryPolicy's schema shares; globs are :mod:`memops.rulesyntax.globs`'. Imports only the standard
library and :mod:`memops.rulesyntax`: the operator sends them by value with memops' agent.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from typing import Any

from memops.rulesyntax import bounds, globs


@dataclasses.dataclass(frozen=True)
class KeyRule:
    replicas: int
    prefix: str | None = None
    glob: str | None = None
    scattered: bool = False
    matcher: globs.Glob | None = dataclasses.field(default=None, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.glob is not None:
            object.__setattr__(self, "matcher", globs.compile_glob(self.glob))


@dataclasses.dataclass(frozen=True)
class PodRule:
    replicas: int
    workers: frozenset[str]  # the addresses of the pods this rule marks


@dataclasses.dataclass(frozen=True)
class Rules:
    default: int = 1
    keys: tuple[KeyRule, ...] = ()
    pods: tuple[PodRule, ...] = ()
    max_fraction: float = 0.3
    ceiling: float = 0.7  # a worker's memory share that no copy may push it over (relief's relieveAbove)


def _replicas(value: Any, field: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= bounds.MAX_REPLICAS:
        raise bounds.RuleError(f"{field}: an integer from 1 to {bounds.MAX_REPLICAS}")
    return value


def _list(value: Any, field: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)) or len(value) > bounds.MAX_RULES:
        raise bounds.RuleError(f"{field}: a list of at most {bounds.MAX_RULES} rules")
    return list(value)


def _share(value: Any, field: str, *, zero: bool) -> float:
    """A share of memory (0 to 1); ``zero``: whether 0 itself is allowed."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not (0 <= value <= 1 if zero else 0 < value <= 1):
        raise bounds.RuleError(f"{field}: a share from 0 to 1")
    return float(value)


def parse(data: Any) -> Rules:
    """Rules from the operator's plain data (msgpack), checked again here: the scheduler trusts
    nothing it is sent, and refuses anything else with a
    :class:`~memops.rulesyntax.bounds.RuleError` naming the field. ``keys``: ``[{"replicas",
    "prefix" | "glob" | "scattered"}]``; ``pods``: ``[{"replicas", "workers": [address, ...]}]``."""
    if not isinstance(data, Mapping):
        raise bounds.RuleError("rules: a mapping")
    keys, pods = _list(data.get("keys"), "rules"), _list(data.get("pods"), "podRules")
    key_rules = []
    for i, rule in enumerate(keys):
        field = f"rules[{i}]"
        if not isinstance(rule, Mapping):
            raise bounds.RuleError(f"{field}: a mapping")
        replicas = _replicas(rule.get("replicas"), f"{field}.replicas")
        if rule.get("pattern") is not None:
            raise bounds.RuleError(f"{field}.keys.pattern: {bounds.PATTERN_REFUSED}")
        chosen = [k for k in ("prefix", "glob", "scattered") if rule.get(k) not in (None, False)]
        if len(chosen) != 1:
            raise bounds.RuleError(f"{field}.keys: exactly one of prefix, glob, scattered")
        glob = rule.get("glob")
        if glob is not None:
            globs.compile_glob(glob, f"{field}.keys.glob")
        prefix = rule.get("prefix")
        if prefix is not None and (not isinstance(prefix, str) or len(prefix) > bounds.MAX_PATTERN_CHARS):
            raise bounds.RuleError(f"{field}.keys.prefix: a string of at most {bounds.MAX_PATTERN_CHARS} characters")
        if rule.get("scattered") not in (None, True, False):
            raise bounds.RuleError(f"{field}.keys.scattered: true or false")
        key_rules.append(KeyRule(replicas, prefix=prefix, glob=glob, scattered=bool(rule.get("scattered"))))
    pod_rules = []
    for i, rule in enumerate(pods):
        if not isinstance(rule, Mapping):
            raise bounds.RuleError(f"podRules[{i}]: a mapping")
        pod_rules.append(PodRule(_replicas(rule.get("replicas"), f"podRules[{i}].replicas"), _addresses(rule, i)))
    fraction = _share(data.get("maxReplicatedFraction", 0.3), "maxReplicatedFraction", zero=True)
    ceiling = _share(data.get("ceiling", 0.7), "ceiling", zero=False)
    return Rules(_replicas(data.get("default", 1), "default"), tuple(key_rules), tuple(pod_rules), fraction, ceiling)


def _addresses(rule: Mapping[str, Any], index: int) -> frozenset[str]:
    workers = rule.get("workers") or ()
    if not isinstance(workers, (list, tuple)) or not all(isinstance(w, str) for w in workers):
        raise bounds.RuleError(f"podRules[{index}].workers: a list of worker addresses")
    if len(workers) > 100_000:
        raise bounds.RuleError(f"podRules[{index}].workers: too many workers")
    return frozenset(workers)


def key_target(rules: Rules, prefix: str, scattered: bool) -> int:
    """The most replicas that a key rule asks of a key with this prefix (0: no key rule matches).

    Pure, and the same for every key of a prefix except for ``scattered``: the policy caches it
    by (prefix, scattered). ``glob`` must match the whole prefix (:meth:`memops.rulesyntax.globs.Glob.match`)."""
    wanted = 0
    for rule in rules.keys:
        if (
            (rule.prefix is not None and prefix == rule.prefix)
            or (rule.matcher is not None and rule.matcher.match(prefix))
            or (rule.scattered and scattered)
        ):
            wanted = max(wanted, rule.replicas)
    return wanted


@dataclasses.dataclass(frozen=True)
class Target:
    replicas: int
    away: frozenset[str] = frozenset()  # marked pods: a copy must exist outside them, and none is put on them


def target(rules: Rules, wanted: int, holders: Collection[str]) -> Target | None:
    """A key's target from its key rules' ``wanted`` (:func:`key_target`) and the pods holding
    it; None when no rule covers it and the default is 1: ReduceReplicas decides such a key."""
    away: frozenset[str] = frozenset()
    for rule in rules.pods:
        if any(h in rule.workers for h in holders):
            wanted = max(wanted, rule.replicas)
            away |= rule.workers
    if not wanted and not away and rules.default == 1:
        return None
    return Target(max(wanted, rules.default), away)
