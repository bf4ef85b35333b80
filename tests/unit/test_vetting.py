"""The controllers reach a scheduler only through the vetted seam (:func:`memops.clients.daskrpc.vetted`).

The address-level functions of :mod:`memops.clients.daskrpc` (``fetch_snapshot``, ``configure_relief``,
...) open a connection of their own that nobody vouched for: they serve the sandbox, tests and
benchmarks, which run their scheduler themselves. A controller that called one would act on
whatever answers at the address on that connection, which need not be the scheduler that the
tenancy check vouched for on another.
"""

import ast
from pathlib import Path

import memops.controllers

UNVETTED = {
    "connect",
    "fetch_snapshot",
    "configure_relief",
    "configure_replication",
    "start_drain",
    "drain_status",
    "retire_workers",
    "ping",
}


def test_no_controller_opens_a_connection_that_nobody_vouched_for() -> None:
    found = []
    for path in sorted(Path(memops.controllers.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "daskrpc"
                and node.attr in UNVETTED
            ):
                found.append(f"{path.name}:{node.lineno}: daskrpc.{node.attr}")
    assert not found, found
