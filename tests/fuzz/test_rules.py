"""The scheduler's replication rules: its check of what it is sent, and its glob matcher.

:func:`memops.scheduler.rules.parse` reads plain data from anyone who can talk to the scheduler:
it returns rules or raises :class:`~memops.rulesyntax.bounds.RuleError` naming the field (which
the agent answers with), never another exception.

:class:`memops.rulesyntax.globs.Glob` matches without backtracking, and must still mean what
``fnmatch.fnmatchcase`` means (docs/resources.md says so). Globs are drawn from the characters
that mean something to a glob (and to a regular expression, which must mean nothing), texts
from a few letters so that matches are common.
"""

from __future__ import annotations

import fnmatch

from hypothesis import given, settings
from hypothesis import strategies as st

from memops.rulesyntax import bounds, globs
from memops.scheduler import rules
from tests.fuzz import strategies

BUDGET = settings(max_examples=500, deadline=None, derandomize=True, database=None)
patterns = st.text(alphabet="ab-*?[]!^\\.|()+{}", max_size=24)
texts = st.text(alphabet="ab-[]!^\\.\n", max_size=24)


@BUDGET
@given(glob=patterns, text=texts)
def test_glob_matches_as_fnmatch(glob: str, text: str) -> None:
    assert globs.compile_glob(glob).match(text) == fnmatch.fnmatchcase(text, glob)


@BUDGET
@given(glob=patterns, text=texts)
def test_glob_matches_a_text_made_to_match(glob: str, text: str) -> None:
    """Texts made from the glob itself (its stars filled in), so the matching branch is covered."""
    made = glob.replace("*", text).replace("?", "a")
    assert globs.compile_glob(glob).match(made) == fnmatch.fnmatchcase(made, glob)


RULES = {
    "default": 1,
    "keys": [
        {"prefix": "load-parquet", "replicas": 2},
        {"glob": "train-*", "replicas": 3},
        {"scattered": True, "replicas": 2},
    ],
    "pods": [{"workers": ["tcp://10.0.0.1:4000"], "replicas": 2}],
    "maxReplicatedFraction": 0.3,
    "ceiling": 0.7,
}


@settings(BUDGET, max_examples=300)
@given(data=st.one_of(strategies.json_values, strategies.mutated([RULES], mutations=3)))
def test_parse_returns_rules_or_a_rule_error(data: object) -> None:
    try:
        parsed = rules.parse(data)
    except bounds.RuleError as exc:
        assert str(exc).split(":")[0], exc  # the field
        return
    assert isinstance(parsed, rules.Rules)
    for prefix in ("load-parquet", "train-1", "x" * 1000):
        rules.key_target(parsed, prefix, scattered=False)
