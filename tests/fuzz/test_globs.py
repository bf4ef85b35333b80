"""The scheduler's glob matcher against Python's own: the same answer for every glob and text.

:class:`memops.scheduler.rules.Glob` matches without backtracking, and must still mean what
``fnmatch.fnmatchcase`` means (docs/resources.md says so). Globs are drawn from the characters
that mean something to a glob (and to a regular expression, which must mean nothing), texts
from a few letters so that matches are common.
"""

from __future__ import annotations

import fnmatch

from hypothesis import given, settings
from hypothesis import strategies as st

from memops.scheduler import rules

BUDGET = settings(max_examples=500, deadline=None, derandomize=True, database=None)
globs = st.text(alphabet="ab-*?[]!^\\.|()+{}", max_size=24)
texts = st.text(alphabet="ab-[]!^\\.\n", max_size=24)


@BUDGET
@given(glob=globs, text=texts)
def test_glob_matches_as_fnmatch(glob: str, text: str) -> None:
    assert rules.compile_glob(glob).match(text) == fnmatch.fnmatchcase(text, glob)


@BUDGET
@given(glob=globs, text=texts)
def test_glob_matches_a_text_made_to_match(glob: str, text: str) -> None:
    """Texts made from the glob itself (its stars filled in), so the matching branch is covered."""
    made = glob.replace("*", text).replace("?", "a")
    assert rules.compile_glob(glob).match(made) == fnmatch.fnmatchcase(made, glob)
