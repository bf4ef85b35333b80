"""The controllers reach a scheduler only through the vetted seam (:func:`memops.clients.daskrpc.vetted`).

:mod:`memops.clients.daskrpc` has no other way in. The calls by address that the sandbox, the tests
and the benchmarks make on schedulers they run themselves are ``memops_sandbox.dask_direct``'s,
through ``vetted`` too, with a vouch that vouches for every worker: a controller that called one
would act on a scheduler that nobody checked to be the namespace's. No controller imports it (nor
any module of memops but the command, which runs the sandbox: an import contract of pyproject.toml).
"""

import ast
from pathlib import Path

import memops.controllers
from memops.clients import daskrpc

BY_ADDRESS = (
    "connect",
    "fetch_snapshot",
    "configure_relief",
    "configure_replication",
    "start_drain",
    "drain_status",
    "retire_workers",
    "ping",
)
"""The calls by address that daskrpc once offered beside :func:`memops.clients.daskrpc.vetted`, unvouched."""


def test_daskrpc_has_no_way_in_but_vetted() -> None:
    assert [name for name in BY_ADDRESS if hasattr(daskrpc, name)] == []


def test_no_controller_opens_a_connection_that_nobody_vouched_for() -> None:
    found = []
    for path in sorted(Path(memops.controllers.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = [node.module or ""]
            else:
                continue
            if any(m == "memops_sandbox" or m.startswith("memops_sandbox.") for m in modules):
                found.append(f"{path.name}:{node.lineno}: imports {', '.join(modules)}")
    assert not found, found
