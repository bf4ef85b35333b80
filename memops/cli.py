"""The ``memops`` command: ``run`` the operator, start a ``sandbox``, write the ``crds``."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memops", description="Memory-driven lifecycle of Dask clusters.")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="run the operator against the current kubeconfig or in-cluster config")
    scope = run.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[], help="watch this namespace (repeatable)")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace (default)")
    run.add_argument("--kubeconfig", help="path to a kubeconfig (default: $KUBECONFIG, in-cluster, ~/.kube/config)")
    run.add_argument("--liveness", metavar="URL", help="serve Kopf's liveness probe, e.g. http://0.0.0.0:8080/healthz")
    run.add_argument("--standalone", action="store_true", help="do not coordinate with other operator replicas")
    run.add_argument("--webhook-port", type=int, help="serve the mutating admission webhook (the safety net) here")
    run.add_argument("--webhook-host", default="127.0.0.1", help="the webhook's address, as the API server reaches it")
    run.add_argument("--webhook-insecure", action="store_true", help="plain HTTP for the webhook (sandbox only)")
    run.add_argument("--webhook-cert-file", metavar="PATH", help="the webhook's TLS certificate (PEM file)")
    run.add_argument("--webhook-key-file", metavar="PATH", help="the private key of --webhook-cert-file (PEM)")
    run.add_argument(
        "--webhook-client-ca-file",
        metavar="PATH",
        help="require a client certificate signed by this CA (PEM): the API server's for webhooks (its"
        " AdmissionConfiguration's kubeConfigFile); other callers fail the TLS handshake",
    )
    run.add_argument(
        "--webhook-client-name",
        dest="webhook_client_names",
        action="append",
        default=[],
        metavar="NAME",
        help="answer only a client certificate with this CN or DNS SAN (repeatable; needs"
        " --webhook-client-ca-file); others get 403",
    )
    run.add_argument(
        "--webhook-unmanaged",
        action="store_true",
        help="leave the MutatingWebhookConfiguration to the installer (Helm chart, kustomize); by default Kopf"
        " creates and patches it",
    )
    run.add_argument(
        "--shared-spill-host-root",
        dest="host_roots",
        action="append",
        default=[],
        metavar="PATH",
        help="a host directory that a MemoryPolicy's sharedSpill of medium Node may name as its hostPath"
        " (exactly: not a directory under it; repeatable). None given: medium Node is refused",
    )
    run.add_argument(
        "--max-disruption-protection",
        metavar="DURATION",
        help="the longest a worker pod carries karpenter.sh/do-not-disrupt and cluster-autoscaler's"
        ' safe-to-evict "false" in all, from the first time memops set them (default 1h; a policy\'s'
        " spec.eviction.maxDisruptionProtection can only lower it; 0s: never)",
    )
    run.add_argument(
        "--no-disruption-protection-in",
        dest="no_protection_in",
        action="append",
        default=[],
        metavar="NAMESPACE",
        help="set no disruption annotations on the pods of this namespace, and take off those memops set (repeatable)",
    )
    run.add_argument(
        "--resize-in",
        dest="resize_in",
        action="append",
        default=[],
        metavar="NAMESPACE",
        help="let a MemoryPolicy's spec.resize grow its workers in place (pods/resize, with the operator's"
        " rights) in this namespace (repeatable; '*': every namespace watched). None given: in no namespace",
    )
    run.add_argument(
        "--max-resize-limit",
        metavar="QUANTITY",
        help="the largest memory limit in-place growth gives a container (default 64Gi, at most 64Ti); a"
        " policy's spec.resize.maxLimit can only lower it",
    )
    run.add_argument(
        "--max-resize-limit-in",
        dest="max_resize_limit_in",
        action="append",
        default=[],
        metavar="NAMESPACE=QUANTITY",
        help="the same, for the policies of one namespace, instead of --max-resize-limit (repeatable)",
    )
    run.add_argument(
        "--kubelet-ca-file",
        metavar="PATH",
        help="the CA (PEM) that signs the kubelets' serving certificates, which memops reads directly for"
        " spec.eviction.nodePressure (get nodes/stats and nodes/configz); default: the API server's CA",
    )
    run.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on /metrics at this port")
    run.add_argument("--metrics-host", default="0.0.0.0", help="the metrics endpoint's address (default 0.0.0.0)")
    run.add_argument("-v", "--verbose", action="store_true", help="debug logging")

    sandbox = commands.add_parser("sandbox", help="a local cluster with real Dask workers and the operator")
    sandbox.add_argument("--workers", type=int, default=4, help="number of dask-worker pods (default 4)")
    sandbox.add_argument("--state-dir", help="where to write kubeconfig, scheduler-address and ready")
    sandbox.add_argument(
        "--nodes",
        type=int,
        default=2,
        help="Nodes, each a real kubelet with its own containerd, pods in containers with memory limits (default 2)",
    )
    sandbox.add_argument(
        "--node-agent",
        action="store_true",
        help="run the Nodes with the process node agent instead (pods as host processes: no container, no"
        " memory limit); a fallback for machines without root or cgroups",
    )
    sandbox.add_argument(
        "--set",
        dest="chart_settings",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a Helm value of the chart the sandbox installs the operator's RBAC from, e.g."
        " rbac.daskWorkerGroups=true (repeatable)",
    )
    sandbox.add_argument(
        "--build-only", action="store_true", help="build the control plane's binaries into the cache, then exit"
    )
    sandbox.add_argument("--no-operator", action="store_true", help="start everything but the operator")
    sandbox.add_argument("--worker-memory", default="1GiB", help="each worker's --memory-limit (default 1GiB)")
    sandbox.add_argument(
        "--node-memory",
        metavar="QUANTITY",
        help="each Node's memory for pods, e.g. 1536Mi: its kubelet reserves the rest of the machine for the"
        " system, so that its eviction threshold (allocatableMemory.available, evictionHard 100Mi) is within reach"
        " of its pods (default: the whole machine)",
    )
    sandbox.add_argument(
        "--eviction-threshold",
        metavar="QUANTITY",
        help="the kubelets' evictionHard memory.available, e.g. 768Mi (default 100Mi): with --node-memory, how far"
        " below its pods' limit each kubelet starts evicting them",
    )
    sandbox.add_argument(
        "--swap",
        metavar="QUANTITY",
        help="a swap file of this size, on while the sandbox runs, e.g. 1Gi: the swap-backed node (every Node is"
        " this machine, so it is every Node's swap; the kubelets run with failSwapOn false)",
    )
    sandbox.add_argument(
        "--audit-log",
        metavar="PATH",
        default=os.environ.get("MEMOPS_AUDIT_LOG") or None,
        help="append the API server's audit events (JSON lines: user, verb, resource, response code) when the"
        " sandbox stops (default: $MEMOPS_AUDIT_LOG)",
    )

    crds = commands.add_parser("crds", help="write the CRD manifests generated from the spec models")
    crds.add_argument("--output", default="crds", help="directory to write into (default: crds)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "crds":
        from memops import crds as crd_module

        for path in crd_module.write_crds(Path(args.output)):
            print(path)
        return 0
    if args.command == "sandbox":
        if importlib.util.find_spec("memops_sandbox") is None:
            print(
                "memops sandbox runs from a checkout of memops (it installs the chart in helm/memops and builds"
                " the operator's image from the sources): git clone the repository, then pip install -e . -e ./sandbox",
                file=sys.stderr,
            )
            return 2
        if args.workers < 1:
            print("memops sandbox: --workers must be at least 1", file=sys.stderr)
            return 2
        if args.nodes < 1:
            print("memops sandbox: --nodes must be at least 1", file=sys.stderr)
            return 2
        if (args.node_memory, args.eviction_threshold, args.swap) != (None, None, None) and args.node_agent:
            print(
                "memops sandbox: --node-memory, --eviction-threshold and --swap need real Nodes (kubelets),"
                " not --node-agent",
                file=sys.stderr,
            )
            return 2
        from memops_sandbox import cli as sandbox_cli

        return sandbox_cli.sandbox(
            args.workers,
            args.state_dir,
            nodes=args.nodes,
            node_agent=args.node_agent,
            operator=not args.no_operator,
            memory_limit=args.worker_memory,
            build_only=args.build_only,
            audit_log=args.audit_log,
            chart_settings=args.chart_settings,
            node_memory=args.node_memory,
            eviction_threshold=args.eviction_threshold,
            swap=args.swap,
        )
    from memops import controllers

    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    from memops.decisions import disruption, resize_decisions, shared_spill

    try:
        host_roots = shared_spill.host_roots(args.host_roots)
        maximum = args.max_disruption_protection or disruption.DEFAULT_MAX
        protection = disruption.administrator(maximum, args.no_protection_in)
        ceiling = args.max_resize_limit or resize_decisions.DEFAULT_CEILING
        growth = resize_decisions.administrator(ceiling, args.max_resize_limit_in, args.resize_in)
    except ValueError as error:
        print(f"memops run: {error}", file=sys.stderr)
        return 2
    if args.metrics_port:
        from memops.controllers import metrics

        metrics.serve(args.metrics_port, args.metrics_host)
    if bool(args.webhook_cert_file) != bool(args.webhook_key_file):
        print("memops run: --webhook-cert-file and --webhook-key-file go together", file=sys.stderr)
        return 2
    if args.webhook_client_names and not args.webhook_client_ca_file:
        print("memops run: --webhook-client-name needs --webhook-client-ca-file", file=sys.stderr)
        return 2
    if args.webhook_client_ca_file and args.webhook_insecure:
        print("memops run: --webhook-client-ca-file needs TLS, not --webhook-insecure", file=sys.stderr)
        return 2
    webhook = None
    if args.webhook_port:
        webhook = controllers.Webhook(
            port=args.webhook_port,
            host=args.webhook_host,
            insecure=args.webhook_insecure,
            certfile=args.webhook_cert_file,
            pkeyfile=args.webhook_key_file,
            managed=not args.webhook_unmanaged,
            client_ca=args.webhook_client_ca_file,
            client_names=tuple(args.webhook_client_names),
        )
    try:
        asyncio.run(
            controllers.run(
                namespaces=args.namespace,
                kubeconfig=args.kubeconfig,
                liveness_endpoint=args.liveness,
                standalone=args.standalone,
                webhook=webhook,
                host_roots=host_roots,
                protection=protection,
                growth=growth,
                kubelet_ca=args.kubelet_ca_file,
            )
        )
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
