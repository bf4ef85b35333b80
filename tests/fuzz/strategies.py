"""Hypothesis strategies shared by the fuzz tests: JSON-like documents, and mutations of real ones.

A mutation walks a real document (an example's spec, a worker pod) and, at a path it draws,
replaces a value with an arbitrary one, deletes a key, or blows a list or a string up; the
result is mostly the real shape, so validation gets past the first field and reaches the rest.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "deploy" / "examples").glob("*.yaml"))

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.sampled_from(["", "0", "-1", "1e400", "10m", "30%", "8Gi", "Force", "Deployment", "tcp://x:1", "*", "a" * 300]),
)
json_values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=6),
        st.dictionaries(st.text(max_size=16), children, max_size=6),
    ),
    max_leaves=30,
)
hostile_values = st.one_of(
    json_values,
    st.builds(lambda n: ["x"] * n, st.integers(min_value=1000, max_value=20_000)),  # a huge list
    st.builds(lambda n: "x" * n, st.integers(min_value=1000, max_value=200_000)),  # a huge string
    st.builds(lambda n: {f"k{i}": "v" for i in range(n)}, st.integers(min_value=100, max_value=5_000)),
)


def example_specs(kind: str) -> list[dict[str, Any]]:
    """The ``spec`` of every example of ``kind`` in deploy/examples."""
    found = []
    for path in EXAMPLES:
        for document in yaml.safe_load_all(path.read_text()):
            if isinstance(document, dict) and document.get("kind") == kind:
                found.append(document["spec"])
    return found


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [prefix]
    if isinstance(node, dict):
        for key, value in node.items():
            found.extend(_paths(value, (*prefix, key)))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            found.extend(_paths(value, (*prefix, index)))
    return found


@st.composite
def mutated(draw: st.DrawFn, documents: list[Any], *, mutations: int = 3) -> Any:
    """One of ``documents``, with up to ``mutations`` of its values replaced, deleted or blown up."""
    document = copy.deepcopy(draw(st.sampled_from(documents)))
    for _ in range(draw(st.integers(min_value=1, max_value=mutations))):
        path = draw(st.sampled_from(_paths(document)))
        if not path:
            document = draw(hostile_values)
            continue
        parent = document
        for step in path[:-1]:
            parent = parent[step]
        action = draw(st.sampled_from(["replace", "delete", "wrap", "duplicate"]))
        if action == "delete" and isinstance(parent, dict):
            del parent[path[-1]]
        elif action == "wrap":
            parent[path[-1]] = [parent[path[-1]]]
        elif action == "duplicate" and isinstance(parent[path[-1]], list):
            parent[path[-1]] = parent[path[-1]] * draw(st.integers(min_value=2, max_value=500))
        else:
            parent[path[-1]] = draw(hostile_values)
        if not isinstance(document, (dict, list)):
            break
    return document
