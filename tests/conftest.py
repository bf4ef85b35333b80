"""Suite-wide: every ``memops sandbox`` of the run appends its API requests to one audit log.

Sets ``$MEMOPS_AUDIT_LOG`` (unless it is already set) for the whole session, before any
sandbox starts; the sandboxes inherit it. ``tests/packaging/test_rbac.py``, which runs after
``tests/e2e``, reads the operator's requests from it and checks the shipped RBAC against them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from memops_sandbox import common as sandbox


@pytest.fixture(scope="session", autouse=True)
def audit_log(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The session's audit log (it may not exist yet: no sandbox has started)."""
    preset = os.environ.get(sandbox.AUDIT_LOG_ENV)
    path = Path(preset) if preset else tmp_path_factory.getbasetemp() / "api-audit.jsonl"
    os.environ[sandbox.AUDIT_LOG_ENV] = str(path)
    try:
        yield path
    finally:
        if preset is None:
            os.environ.pop(sandbox.AUDIT_LOG_ENV, None)
