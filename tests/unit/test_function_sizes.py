"""No function of the handlers (memops/controllers/) or of the code that runs in the scheduler
(memops/scheduler/) is longer than 60 lines: a longer one has stopped reading straight down
(read, decide, apply) and is split by what it does. Counted from the source with ast, no import:
a function's lines run from its ``def`` (decorators left out) to its last line, nested functions
included in the function that holds them and measured on their own too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("memops/controllers", "memops/scheduler")
MAX_LINES = 60


def function_sizes(source: str) -> list[tuple[str, int, int]]:
    """(qualified name, first line, lines) of every function and method in ``source``."""
    found: list[tuple[str, int, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = getattr(child, "name", "")
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                assert child.end_lineno is not None
                found.append((prefix + name, child.lineno, child.end_lineno - child.lineno + 1))
            visit(child, f"{prefix}{name}." if name else prefix)

    visit(ast.parse(source), "")
    return found


def test_the_count() -> None:
    source = "class A:\n    @staticmethod\n    def f():\n        def g():\n            pass\n        return g\n"
    assert function_sizes(source) == [("A.f", 3, 4), ("A.f.g", 4, 2)]


@pytest.mark.parametrize("folder", FOLDERS)
def test_no_function_is_over_60_lines(folder: str) -> None:
    paths = sorted((ROOT / folder).rglob("*.py"))
    assert paths, f"no module in {folder}"
    long = [
        f"{path.relative_to(ROOT)}:{line} {name} ({lines} lines)"
        for path in paths
        for name, line, lines in function_sizes(path.read_text())
        if lines > MAX_LINES
    ]
    assert long == [], f"over {MAX_LINES} lines: {long}"
