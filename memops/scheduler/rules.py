"""Replication rules: which key gets which target; pure, and run inside the scheduler.

Key rules (a Dask key prefix, as ``key_split`` gives it; a regular expression over that prefix;
or ``scattered`` data) are matched here, by :func:`key_target`, once per prefix; pod rules come
from the operator already turned into the addresses of the pods they mark, and :func:`target`
combines both for one key. :func:`parse` checks the plain data that the operator sends (the
scheduler trusts nothing it is sent), and :func:`check_pattern` refuses patterns that could make
a match run away; the MemoryPolicy's schema calls it too, so a bad pattern is refused when it is
written. Imports only the standard library: the operator sends it by value with memops' agent.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection, Mapping
from typing import Any

MAX_RULES = 32
"""Key rules and pod rules, each: rules are matched per key prefix, so this bounds that cost."""
MAX_PATTERN_CHARS = 256
MAX_REPLICAS = 16
_CATASTROPHIC = re.compile(r"[+*}]\)*[+*{?]|\([^)]*[+*][^)]*\)[+*{]|\\[1-9]|\(\?[<P]?[=!]")
"""Nested or stacked quantifiers (``(a+)+``, ``a**``), backreferences and lookarounds: the
constructs that make a backtracking match take exponential time; refused."""


class RuleError(ValueError):
    """A rule that is refused; the message names the field."""


@dataclasses.dataclass(frozen=True)
class KeyRule:
    replicas: int
    prefix: str | None = None
    pattern: str | None = None
    scattered: bool = False


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


def check_pattern(pattern: str, field: str = "pattern") -> re.Pattern[str]:
    """Compile a user's pattern, refusing what could make matching run away."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise RuleError(f"{field}: longer than {MAX_PATTERN_CHARS} characters")
    if _CATASTROPHIC.search(pattern):
        raise RuleError(f"{field}: nested quantifiers, backreferences and lookarounds are not allowed")
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise RuleError(f"{field}: not a regular expression: {exc}") from exc


def _replicas(value: Any, field: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_REPLICAS:
        raise RuleError(f"{field}: an integer from 1 to {MAX_REPLICAS}")
    return value


def parse(data: Mapping[str, Any]) -> Rules:
    """Rules from the operator's plain data (msgpack), checked again here: the scheduler trusts
    nothing it is sent. ``keys``: ``[{"replicas", "prefix" | "pattern" | "scattered"}]``;
    ``pods``: ``[{"replicas", "workers": [address, ...]}]``."""
    keys, pods = list(data.get("keys") or ()), list(data.get("pods") or ())
    if len(keys) > MAX_RULES or len(pods) > MAX_RULES:
        raise RuleError(f"rules: at most {MAX_RULES} key rules and {MAX_RULES} pod rules")
    key_rules = []
    for i, rule in enumerate(keys):
        field = f"rules[{i}]"
        replicas = _replicas(rule.get("replicas"), f"{field}.replicas")
        chosen = [k for k in ("prefix", "pattern", "scattered") if rule.get(k) not in (None, False)]
        if len(chosen) != 1:
            raise RuleError(f"{field}.keys: exactly one of prefix, pattern, scattered")
        if rule.get("pattern") is not None:
            check_pattern(str(rule["pattern"]), f"{field}.keys.pattern")
        prefix = rule.get("prefix")
        if prefix is not None and (not isinstance(prefix, str) or len(prefix) > MAX_PATTERN_CHARS):
            raise RuleError(f"{field}.keys.prefix: a string of at most {MAX_PATTERN_CHARS} characters")
        key_rules.append(
            KeyRule(replicas, prefix=prefix, pattern=rule.get("pattern"), scattered=bool(rule.get("scattered")))
        )
    pod_rules = tuple(
        PodRule(_replicas(rule.get("replicas"), f"podRules[{i}].replicas"), _addresses(rule))
        for i, rule in enumerate(pods)
    )
    fraction = float(data.get("maxReplicatedFraction", 0.3))
    ceiling = float(data.get("ceiling", 0.7))
    if not 0 <= fraction <= 1 or not 0 < ceiling <= 1:
        raise RuleError("maxReplicatedFraction and ceiling: shares from 0 to 1")
    return Rules(_replicas(data.get("default", 1), "default"), tuple(key_rules), pod_rules, fraction, ceiling)


def _addresses(rule: Mapping[str, Any]) -> frozenset[str]:
    workers = rule.get("workers") or ()
    if len(workers) > 100_000:
        raise RuleError("podRules: too many workers")
    return frozenset(map(str, workers))


def key_target(rules: Rules, prefix: str, scattered: bool) -> int:
    """The most replicas that a key rule asks of a key with this prefix (0: no key rule matches).

    Pure, and the same for every key of a prefix except for ``scattered``: the policy caches it
    by (prefix, scattered). ``pattern`` must match the whole prefix (``re.fullmatch``)."""
    wanted = 0
    for rule in rules.keys:
        if (
            (rule.prefix is not None and prefix == rule.prefix)
            or (rule.pattern is not None and re.fullmatch(rule.pattern, prefix) is not None)
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
