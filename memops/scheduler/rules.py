"""Replication rules: which key gets which target; pure, and run inside the scheduler.

Key rules (a Dask key prefix, as ``key_split`` gives it; a glob over that prefix; or
``scattered`` data) are matched here, by :func:`key_target`, once per prefix; pod rules come from
the operator already turned into the addresses of the pods they mark, and :func:`target` combines
both for one key. :func:`parse` checks the plain data that the operator sends (the scheduler
trusts nothing it is sent); the MemoryPolicy's schema calls :func:`compile_glob` too, so a glob is
refused when it is written.

Globs, not regular expressions: ``re`` backtracks, no blocklist of shapes keeps every exponential
one out (``(a|a)*b`` takes a second on 24 characters, ``(.|.|.|.|.|.|.|.)*X`` as long on 7), and
the match runs on the scheduler's event loop. :class:`Glob` matches the pieces between a glob's
stars with regular expressions that have no repetition and no alternation, each piece once and
leftmost first, so a match costs at most (prefix length) x (glob length) character comparisons,
whatever the glob. Imports only the standard library: the operator sends it by value with
memops' agent.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection, Mapping
from typing import Any

MAX_RULES = 32
"""Key rules and pod rules, each: rules are matched per key prefix, so this bounds that cost."""
MAX_PATTERN_CHARS = 256
"""The longest prefix or glob."""
MAX_REPLICAS = 16
PATTERN_REFUSED = (
    'regular expressions are no longer accepted, their match time has no bound; write a glob instead (glob: "train-*")'
)


class RuleError(ValueError):
    """A rule that is refused; the message names the field."""


@dataclasses.dataclass(frozen=True)
class Glob:
    """A compiled glob: ``head`` must match at the start of a text, ``tail`` at its end (None:
    the glob has no star, and ``head`` must match the whole text), ``middle`` in order between.

    Every piece matches a fixed number of characters (``head_width``, ``tail_width``) and is a
    regular expression without repetition or alternation, so a ``search`` tries each position
    once and never backtracks. The leftmost match of each middle piece is the right one: the
    star before it takes whatever lies between, and leftmost leaves the most room to the rest.
    """

    head: re.Pattern[str]
    head_width: int
    middle: tuple[re.Pattern[str], ...]
    tail: re.Pattern[str] | None
    tail_width: int

    def match(self, text: str) -> bool:
        """Whether the whole of ``text`` matches (what ``fnmatch.fnmatchcase`` answers)."""
        if self.tail is None:
            return len(text) == self.head_width and self.head.match(text) is not None
        start, end = self.head_width, len(text) - self.tail_width
        if end < start or self.head.match(text) is None or self.tail.match(text, end) is None:
            return False
        for piece in self.middle:
            found = piece.search(text, start, end)
            if found is None:
                return False
            start = found.end()
        return True


def _code_point(char: str) -> str:
    return f"\\U{ord(char):08x}"  # means only this character to re, inside a set or out


def _char_set(body: str) -> str:
    """A regular expression for one character of the set ``[body]``, read as fnmatch reads it:
    ``!`` first negates, ``a-z`` is a range (empty if reversed), another ``-`` is itself."""
    negated = body.startswith("!")
    if negated:
        body = body[1:]
    members, k = [], 0
    while k < len(body):
        if k + 2 < len(body) and body[k + 1] == "-":
            if body[k] <= body[k + 2]:
                members.append(f"{_code_point(body[k])}-{_code_point(body[k + 2])}")
            k += 3
        else:
            members.append(_code_point(body[k]))
            k += 1
    if not members:
        return "." if negated else "(?!)"  # no member: a negated set takes any character, a set none
    return "[" + ("^" if negated else "") + "".join(members) + "]"


def _pieces(glob: str) -> list[list[str]]:
    """The glob split at its stars, each piece a list of one-character regular expressions."""
    pieces: list[list[str]] = [[]]
    i, n = 0, len(glob)
    while i < n:
        c = glob[i]
        i += 1
        if c == "*":
            pieces.append([])
        elif c == "?":
            pieces[-1].append(".")
        elif c == "[":
            j = i + 1 if i < n and glob[i] == "!" else i
            j = j + 1 if j < n and glob[j] == "]" else j  # "]" first is a member
            while j < n and glob[j] != "]":
                j += 1
            if j >= n:
                pieces[-1].append(re.escape(c))  # no closing bracket: a plain "["
            else:
                pieces[-1].append(_char_set(glob[i:j]))
                i = j + 1
        else:
            pieces[-1].append(re.escape(c))
    return pieces


def compile_glob(glob: Any, field: str = "glob") -> Glob:
    """Compile a user's glob: ``*`` any characters, ``?`` one, ``[a-z]`` one of a set, ``[!a-z]``
    one not in it, anything else itself. Every string of at most :data:`MAX_PATTERN_CHARS`
    characters is a glob, and none can make a match run away."""
    if not isinstance(glob, str) or len(glob) > MAX_PATTERN_CHARS:
        raise RuleError(f"{field}: a string of at most {MAX_PATTERN_CHARS} characters")
    compiled = _COMPILED.get(glob)
    if compiled is None:
        if len(_COMPILED) >= 4 * MAX_RULES:
            _COMPILED.clear()
        compiled = _COMPILED[glob] = _compile(glob)
    return compiled


_COMPILED: dict[str, Glob] = {}
"""Globs compiled already, at most ``4 * MAX_RULES``. A plain dict, not ``functools.lru_cache``:
this module goes to the scheduler by value, and a cached function's wrapper pickles by reference,
which a scheduler without memops installed cannot load."""


def _compile(glob: str) -> Glob:
    pieces = _pieces(glob)
    compiled = [re.compile("".join(piece), re.DOTALL) for piece in pieces]
    if len(pieces) == 1:
        return Glob(compiled[0], len(pieces[0]), (), None, 0)
    return Glob(compiled[0], len(pieces[0]), tuple(compiled[1:-1]), compiled[-1], len(pieces[-1]))


@dataclasses.dataclass(frozen=True)
class KeyRule:
    replicas: int
    prefix: str | None = None
    glob: str | None = None
    scattered: bool = False
    matcher: Glob | None = dataclasses.field(default=None, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.glob is not None:
            object.__setattr__(self, "matcher", compile_glob(self.glob))


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
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_REPLICAS:
        raise RuleError(f"{field}: an integer from 1 to {MAX_REPLICAS}")
    return value


def _list(value: Any, field: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)) or len(value) > MAX_RULES:
        raise RuleError(f"{field}: a list of at most {MAX_RULES} rules")
    return list(value)


def _share(value: Any, field: str, *, zero: bool) -> float:
    """A share of memory (0 to 1); ``zero``: whether 0 itself is allowed."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not (0 <= value <= 1 if zero else 0 < value <= 1):
        raise RuleError(f"{field}: a share from 0 to 1")
    return float(value)


def parse(data: Any) -> Rules:
    """Rules from the operator's plain data (msgpack), checked again here: the scheduler trusts
    nothing it is sent, and refuses anything else with a :class:`RuleError` naming the field.
    ``keys``: ``[{"replicas", "prefix" | "glob" | "scattered"}]``; ``pods``: ``[{"replicas",
    "workers": [address, ...]}]``."""
    if not isinstance(data, Mapping):
        raise RuleError("rules: a mapping")
    keys, pods = _list(data.get("keys"), "rules"), _list(data.get("pods"), "podRules")
    key_rules = []
    for i, rule in enumerate(keys):
        field = f"rules[{i}]"
        if not isinstance(rule, Mapping):
            raise RuleError(f"{field}: a mapping")
        replicas = _replicas(rule.get("replicas"), f"{field}.replicas")
        if rule.get("pattern") is not None:
            raise RuleError(f"{field}.keys.pattern: {PATTERN_REFUSED}")
        chosen = [k for k in ("prefix", "glob", "scattered") if rule.get(k) not in (None, False)]
        if len(chosen) != 1:
            raise RuleError(f"{field}.keys: exactly one of prefix, glob, scattered")
        glob = rule.get("glob")
        if glob is not None:
            compile_glob(glob, f"{field}.keys.glob")
        prefix = rule.get("prefix")
        if prefix is not None and (not isinstance(prefix, str) or len(prefix) > MAX_PATTERN_CHARS):
            raise RuleError(f"{field}.keys.prefix: a string of at most {MAX_PATTERN_CHARS} characters")
        if rule.get("scattered") not in (None, True, False):
            raise RuleError(f"{field}.keys.scattered: true or false")
        key_rules.append(KeyRule(replicas, prefix=prefix, glob=glob, scattered=bool(rule.get("scattered"))))
    pod_rules = []
    for i, rule in enumerate(pods):
        if not isinstance(rule, Mapping):
            raise RuleError(f"podRules[{i}]: a mapping")
        pod_rules.append(PodRule(_replicas(rule.get("replicas"), f"podRules[{i}].replicas"), _addresses(rule, i)))
    fraction = _share(data.get("maxReplicatedFraction", 0.3), "maxReplicatedFraction", zero=True)
    ceiling = _share(data.get("ceiling", 0.7), "ceiling", zero=False)
    return Rules(_replicas(data.get("default", 1), "default"), tuple(key_rules), tuple(pod_rules), fraction, ceiling)


def _addresses(rule: Mapping[str, Any], index: int) -> frozenset[str]:
    workers = rule.get("workers") or ()
    if not isinstance(workers, (list, tuple)) or not all(isinstance(w, str) for w in workers):
        raise RuleError(f"podRules[{index}].workers: a list of worker addresses")
    if len(workers) > 100_000:
        raise RuleError(f"podRules[{index}].workers: too many workers")
    return frozenset(workers)


def key_target(rules: Rules, prefix: str, scattered: bool) -> int:
    """The most replicas that a key rule asks of a key with this prefix (0: no key rule matches).

    Pure, and the same for every key of a prefix except for ``scattered``: the policy caches it
    by (prefix, scattered). ``glob`` must match the whole prefix (:meth:`Glob.match`)."""
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
