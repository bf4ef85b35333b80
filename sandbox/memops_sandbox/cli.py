"""The ``memops-sandbox`` command, and ``memops sandbox`` behind memops' own CLI.

``memops-sandbox build`` builds (or finds in the cache) the control plane's and the nodes'
binaries and the nodes' images, and says where they are and how long each part took: CI runs it
before the tests, so that the build has its own log lines and times instead of hiding inside the
first test that starts a sandbox.
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
    node_agent: bool = False,
    audit_log: str | None = None,
    chart_settings: list[str] | None = None,
    node_memory: str | None = None,
    eviction_threshold: str | None = None,
    swap: str | None = None,
) -> int:
    """``memops sandbox`` (or ``--build-only``), with arguments checked by memops' CLI.

    The terminal is for the person who typed the command: a start line, a ready line and what to
    type next. Every process' log goes to a file in the state directory: this process' own
    (the launcher, the node agent) to ``sandbox.log``, the control plane's and the operator's to
    ``logs/``, the Dask scheduler's to ``scheduler.log``, the pods' to ``pods/``."""
    if not build_only:
        from memops_sandbox import install

        try:
            install.chart_directory()
        except FileNotFoundError:
            print(
                "memops sandbox: runs from a checkout of memops (the chart in helm/memops, the operator's sources):"
                " git clone the repository, then pip install -e . -e ./sandbox",
                file=sys.stderr,
            )
            return 2
    if not node_agent and not build_only:
        from memops_sandbox import nodes as real_nodes

        try:
            real_nodes.check_machine()
        except real_nodes.NodesUnavailable as error:
            print(f"memops sandbox: {error}", file=sys.stderr)
            return 1
        try:
            wanted = real_nodes.parse_memory(node_memory) if node_memory is not None else None
            if eviction_threshold is not None:
                real_nodes.parse_memory(eviction_threshold)
            if swap is not None and real_nodes.parse_memory(swap) <= 0:
                raise ValueError(f"{swap!r} is no size")
        except ValueError as error:
            print(f"memops sandbox: --node-memory, --eviction-threshold or --swap: {error}", file=sys.stderr)
            return 2
        if wanted is not None:
            if not 0 < wanted < real_nodes.machine_memory():
                print("memops sandbox: --node-memory: more than this machine has", file=sys.stderr)
                return 2
    try:
        binaries = build.ensure()
        if not node_agent:
            build.ensure_node_binaries()
    except build.BuildError as error:
        print(f"memops sandbox: {error}", file=sys.stderr)
        return 1
    if build_only:
        print(f"memops sandbox: Kubernetes {binaries.version} in {binaries.directory}")
        return 0
    from memops_sandbox import install, upstream

    try:
        values = install.chart_values(chart_settings or [])
    except ValueError as error:
        print(f"memops sandbox: {error}", file=sys.stderr)
        return 2
    # Absolute: the API server refuses a relative path in its admission configuration.
    directory = Path(state_dir).resolve() if state_dir else Path(tempfile.mkdtemp(prefix="memops-sandbox-"))
    directory.mkdir(parents=True, exist_ok=True)
    log = directory / "sandbox.log"
    log_to(log)
    print(
        f"memops sandbox: starting Kubernetes {binaries.version} ({nodes} node{'s' if nodes != 1 else ''}),"
        f" a Dask scheduler, {workers} worker{'s' if workers != 1 else ''}{' and the operator' if operator else ''};"
        f" state and logs in {directory}",
        flush=True,
    )

    def announce() -> None:
        print(
            "memops sandbox: ready. In another terminal:\n"
            f"  export KUBECONFIG={directory / 'kubeconfig'}\n"
            "  kubectl get nodes,pods,mempol,retire\n"
            + (
                f'  sed "s|tcp://dask-scheduler:8786|$(cat {directory / "scheduler-address"})|"'
                " deploy/examples/retirementrequest.yaml | kubectl apply -f -\n"
                if node_agent  # no Service: the scheduler is a process of this machine
                else "  kubectl apply -f deploy/examples/retirementrequest.yaml\n"
            )
            + "  kubectl get retire -w\n"
            f"Logs: {log}, {directory / 'logs'}/, "
            + (
                f"{directory / 'scheduler.log'}, {directory / 'pods'}/."
                if node_agent
                else f"{directory / 'nodes'}/<node>/pod-logs/ (or kubectl logs)."
            )
            + " Stop with Ctrl-C.",
            flush=True,
        )

    serving = upstream.serve(
        workers,
        directory,
        nodes=nodes,
        node_agent=node_agent,
        operator=operator,
        memory_limit=memory_limit,
        audit_log=Path(audit_log) if audit_log else None,
        values=values,
        on_ready=announce,
        node_memory=node_memory,
        eviction_threshold=eviction_threshold,
        swap=swap,
    )
    try:
        upstream.run_until_signalled(serving, directory)
    except Exception as exc:
        logging.getLogger(__name__).exception("the sandbox failed")
        print(f"memops sandbox: failed: {type(exc).__name__}: {exc}; see {log}", file=sys.stderr, flush=True)
        return 1
    print("memops sandbox: stopped.", flush=True)
    return 0


def log_to(path: Path) -> None:
    """Send every log record of this process to ``path``, none to the terminal: the root
    logger's handlers are replaced, and libraries that log to the terminal themselves
    (distributed installs its own stream handler when imported) propagate to the root instead."""
    import distributed  # noqa: F401  # imported first, so that its handlers exist to be removed

    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    for logger in [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)]:
        for handler in list(logger.handlers):
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                logger.removeHandler(handler)
                logger.propagate = True
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="memops-sandbox", description="memops' local cluster")
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser(
        "build",
        help="build the control plane's and the nodes' binaries and the images into the cache (once per version)",
    )
    make.add_argument("--version", help=f"Kubernetes release (default ${build.VERSION_ENV} or {build.VERSION})")
    plane = commands.add_parser(
        "plane",
        help="run the control plane alone, with the operator's CRDs and RBAC applied (no Dask, no nodes,"
        " no operator): DIR/kubeconfig, DIR/operator-kubeconfig (and its DIR/operator-token), then DIR/ready",
    )
    plane.add_argument("--state-dir", required=True, type=Path)
    args = parser.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C: a build in progress stops its compiler and removes its files.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    if args.command == "plane":
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        from memops_sandbox import upstream

        return upstream.run_until_signalled(upstream.serve_plane(args.state_dir), args.state_dir)
    return build_everything(args.version or build.kubernetes_version())


def build_everything(version: str) -> int:
    """``memops-sandbox build``: every binary and image the sandbox runs, each part with the
    time it took (about 0 s where the cache had it)."""
    from memops_sandbox import images

    started = time.monotonic()
    try:
        for name, binaries, seconds in build.ensure_all(version):
            print(f"memops-sandbox: {name} {binaries.version} in {binaries.directory} ({seconds:.1f} s)")
        for name in images.NAMES:
            if name == "operator" and not images.has_checkout():
                print("memops-sandbox: the operator image is built from a memops checkout; there is none here")
                continue
            image_started = time.monotonic()
            archive = images.ensure_image(name)
            size = archive.path.stat().st_size / 2**20
            print(
                f"memops-sandbox: image {archive.ref} in {archive.path} ({size:.0f} MiB,"
                f" {time.monotonic() - image_started:.1f} s)"
            )
    except (build.BuildError, images.ImageError) as error:
        print(f"memops-sandbox: {error}", file=sys.stderr)
        return 1
    print(f"memops-sandbox: built in {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
