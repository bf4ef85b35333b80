"""The ``memops-sandbox`` command, and ``memops sandbox --plane upstream`` behind memops' own CLI.

``memops-sandbox build`` builds (or finds in the cache) the control plane's binaries and says
where they are and how long it took: CI runs it before the tests, so that the build has its own
log line and time instead of hiding inside the first test that starts a sandbox.
``memops-sandbox plane --state-dir DIR`` runs the control plane alone (see
:func:`memops_sandbox.upstream.serve_plane`)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from memops_sandbox import build


def sandbox(
    workers: int,
    state_dir: str | None,
    *,
    nodes: int,
    operator: bool,
    memory_limit: str,
    build_only: bool,
) -> int:
    """``memops sandbox --plane upstream`` (or ``--build-only``), with arguments checked by memops' CLI."""
    try:
        binaries = build.ensure()
    except build.BuildError as error:
        print(f"memops sandbox: {error}", file=sys.stderr)
        return 1
    if build_only:
        print(f"memops sandbox: Kubernetes {binaries.version} in {binaries.directory}")
        return 0
    from memops_sandbox import upstream

    directory = Path(state_dir) if state_dir else Path(tempfile.mkdtemp(prefix="memops-sandbox-"))
    if not state_dir:
        print(
            f"memops sandbox: state in {directory}; once {directory / 'ready'} exists:\n"
            f"  export KUBECONFIG={directory / 'kubeconfig'}\nStop with Ctrl-C.",
            flush=True,
        )
    serving = upstream.serve(workers, directory, nodes=nodes, operator=operator, memory_limit=memory_limit)
    return upstream.run_until_signalled(serving, directory)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="memops-sandbox", description="memops' local cluster")
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("build", help="build the control plane's binaries into the cache (once per version)")
    make.add_argument("--version", help=f"Kubernetes release (default ${build.VERSION_ENV} or {build.VERSION})")
    plane = commands.add_parser(
        "plane",
        help="run the control plane alone, with the operator's CRDs and RBAC applied (no Dask, no nodes,"
        " no operator): DIR/kubeconfig, DIR/operator-kubeconfig, then DIR/ready",
    )
    plane.add_argument("--state-dir", required=True, type=Path)
    args = parser.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C: a build in progress stops its compiler and removes its files.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    if args.command == "plane":
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        from memops_sandbox import upstream

        return upstream.run_until_signalled(upstream.serve_plane(args.state_dir), args.state_dir)
    started = time.monotonic()
    try:
        binaries = build.ensure(args.version or build.kubernetes_version())
    except build.BuildError as error:
        print(f"memops-sandbox: {error}", file=sys.stderr)
        return 1
    print(f"memops-sandbox: Kubernetes {binaries.version} in {binaries.directory} ({time.monotonic() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
