"""A glob over a Dask key prefix, matched in time linear in the prefix.

Globs, not regular expressions: ``re`` backtracks, no blocklist of shapes keeps every exponential
one out (``(a|a)*b`` takes a second on 24 characters, ``(.|.|.|.|.|.|.|.)*X`` as long on 7), and
the match runs on the scheduler's event loop. :class:`Glob` matches the pieces between a glob's
stars with regular expressions that have no repetition and no alternation, each piece once and
leftmost first, so a match costs at most (prefix length) x (glob length) character comparisons,
whatever the glob. The scheduler's rules match with it (:mod:`memops.scheduler.rules`), and the
MemoryPolicy's schema compiles a glob when it is written.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from memops.rulesyntax import bounds


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
    one not in it, anything else itself. Every string of at most
    :data:`~memops.rulesyntax.bounds.MAX_PATTERN_CHARS` characters is a glob, and none can make a
    match run away."""
    if not isinstance(glob, str) or len(glob) > bounds.MAX_PATTERN_CHARS:
        raise bounds.RuleError(f"{field}: a string of at most {bounds.MAX_PATTERN_CHARS} characters")
    compiled = _COMPILED.get(glob)
    if compiled is None:
        if len(_COMPILED) >= 4 * bounds.MAX_RULES:
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
