"""``memops sandbox``: the sandbox on the upstream control plane.

Starts, in this order: the control plane (:mod:`memops_sandbox.controlplane`), the operator's
CRDs, ServiceAccount and RBAC as the chart renders them (:mod:`memops_sandbox.install`), a real
``dask scheduler``, the node agent with ``--nodes`` Nodes (each with its own client
certificate), a Deployment ``dask-worker`` whose pods the real ReplicaSet controller makes and
the real scheduler binds, then the operator (``memops run`` under its ServiceAccount's token,
its webhook on TLS) and the chart's webhook configuration pointed at it. The state directory's
contract, which the test suite and users rely on: ``kubeconfig``, ``operator-kubeconfig`` (its
user reads ``operator-token``, a token bound to a Secret: see :mod:`memops_sandbox.install`),
``scheduler-address``, and ``ready`` last.

``memops-sandbox plane`` runs the first two steps alone (no Dask, no nodes, no operator).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import importlib
import logging
import os
import shutil
import ssl
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from memops_sandbox import build, certs, common, controlplane, install

logger = logging.getLogger(__name__)
NODE_PREFIX = "node-"


def node_names(count: int) -> list[str]:
    return [f"{NODE_PREFIX}{index}" for index in range(count)]


def operator_command(
    webhook_port: int,
    metrics_port: int,
    cert: Path,
    key: Path,
    flags: Sequence[str] = (),
    *,
    client_ca: Path | None = None,
) -> list[str]:
    """``memops run`` as the chart's Deployment runs it (all namespaces, peering, the webhook on
    TLS with the installer's certificate, left unmanaged, and the chart's ``flags``:
    :func:`memops_sandbox.install.operator_flags`), on loopback ports. ``client_ca``: answer only
    the API server's webhook client certificate, signed by it (the chart's ``webhook.clientCA``
    and ``webhook.clientNames``)."""
    client = (
        []
        if client_ca is None
        else [f"--webhook-client-ca-file={client_ca}", f"--webhook-client-name={certs.WEBHOOK_CLIENT}"]
    )
    return [
        common.executable("memops"),
        "run",
        "--all-namespaces",
        f"--webhook-port={webhook_port}",
        "--webhook-host=127.0.0.1",
        f"--webhook-cert-file={cert}",
        f"--webhook-key-file={key}",
        "--webhook-unmanaged",
        *client,
        f"--metrics-port={metrics_port}",
        "--metrics-host=127.0.0.1",
        *flags,
    ]


async def _wait_for_tls(
    port: int, context: ssl.SSLContext, process: asyncio.subprocess.Process, timeout: float
) -> None:
    """Until a TLS handshake with 127.0.0.1:``port`` succeeds (verifying the certificate, and
    presenting the client certificate, as the API server will), or the process exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.returncode is not None:
            raise RuntimeError(f"the operator exited with {process.returncode} before serving its webhook")
        with contextlib.suppress(OSError):
            _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
            return
        await asyncio.sleep(0.1)
    raise TimeoutError(f"the operator's webhook did not answer on port {port} within {timeout:.0f} s")


@contextlib.asynccontextmanager
async def plane_with_operator_access(
    state_dir: Path,
    values: dict[str, Any] | None = None,
    *,
    advertise: str | None = None,
    webhook_services: Sequence[str] = (),
) -> AsyncIterator[tuple[controlplane.Plane, list[dict[str, Any]]]]:
    """The control plane with the chart's CRDs, ServiceAccount and RBAC (rendered with ``values``)
    applied and ``DIR/operator-kubeconfig`` written; yields the plane and the rendered chart."""
    binaries = await asyncio.to_thread(build.ensure)
    # Helm's library renders the chart while the control plane starts.
    rendering = asyncio.create_task(asyncio.to_thread(install.render_chart, values))

    async def apply(plane: controlplane.Plane, api: controlplane.Api) -> None:
        started = time.monotonic()
        await install.install(plane, api, await rendering)
        logger.info("the chart's CRDs and RBAC applied in %.1f s", time.monotonic() - started)

    try:
        async with controlplane.running(
            state_dir, binaries, meanwhile=apply, advertise=advertise, webhook_services=webhook_services
        ) as plane:
            yield plane, await rendering
    finally:
        rendering.cancel()


@contextlib.asynccontextmanager
async def _operator(
    plane: controlplane.Plane, objects: list[dict[str, Any]], state_dir: Path
) -> AsyncIterator[asyncio.subprocess.Process]:
    cert, key = plane.pki.serving("webhook")
    # The port the API server presents its webhook client certificate to.
    webhook_port = plane.webhook_port
    metrics_port = common.free_port(webhook_port)
    # The pod's namespace, as the chart's Deployment gives it: the eviction gate's Leases are there.
    env = {**os.environ, "KUBECONFIG": str(state_dir / "operator-kubeconfig"), "POD_NAMESPACE": install.NAMESPACE}
    client_ca = plane.pki.path("webhook-client-ca")
    process = await controlplane.spawn(
        "operator",
        operator_command(webhook_port, metrics_port, cert, key, install.operator_flags(objects), client_ca=client_ca),
        plane.logs,
        env=env,
    )
    (state_dir / "operator.pid").write_text(str(process.pid))
    (state_dir / "metrics-url").write_text(f"http://127.0.0.1:{metrics_port}/metrics\n")
    try:
        context = ssl.create_default_context(cadata=plane.ca.decode())
        context.load_cert_chain(
            plane.pki.path("apiserver-webhook-client"), plane.pki.path("apiserver-webhook-client", "key")
        )
        await _wait_for_tls(webhook_port, context, process, 60)
        async with plane.session() as api:
            await install.register_webhook(api, objects, f"https://127.0.0.1:{webhook_port}", plane.ca)
        yield process
    finally:
        await common.stop(process, grace=10)


async def serve(
    workers: int,
    state_dir: Path,
    *,
    nodes: int = 2,
    node_agent: bool = False,
    operator: bool = True,
    memory_limit: str = "1GiB",
    audit_log: Path | None = None,
    values: dict[str, Any] | None = None,
    on_ready: Callable[[], None] | None = None,
    node_memory: str | None = None,
    eviction_threshold: str | None = None,
    swap: str | None = None,
) -> None:
    """Run the sandbox until cancelled; ``on_ready`` is called once ``ready`` is written.

    With ``audit_log``, the API server's audit events (``DIR/audit.log``, upstream JSON lines)
    are appended to it once the plane has stopped, so that one file gathers every sandbox of a
    test session. ``values`` are the chart's (Helm values, as ``--set`` gives them):
    ``rbac.daskWorkerGroups``, say, grants what that feature needs."""
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / "ready").unlink(missing_ok=True)
    common_args: dict[str, Any] = dict(
        nodes=nodes, operator=operator, memory_limit=memory_limit, values=values, on_ready=on_ready
    )
    try:
        if node_agent:
            await _serve(workers, state_dir, **common_args)
        else:
            await _serve_on_real_nodes(
                workers,
                state_dir,
                **common_args,
                node_memory=node_memory,
                eviction_threshold=eviction_threshold,
                swap=swap,
            )
    finally:
        if audit_log is not None:
            append_audit(state_dir / "audit.log", audit_log)


def append_audit(source: Path, target: Path) -> None:
    """Append the lines of ``source`` (if it exists) to ``target``."""
    if not source.exists():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    with source.open("rb") as lines, target.open("ab") as out:
        # Whole: sandboxes of two test lanes may stop at once, and a reader takes it shared.
        fcntl.flock(out, fcntl.LOCK_EX)
        shutil.copyfileobj(lines, out)


async def _serve(
    workers: int,
    state_dir: Path,
    *,
    nodes: int,
    operator: bool,
    memory_limit: str,
    values: dict[str, Any] | None,
    on_ready: Callable[[], None] | None,
) -> None:
    names = node_names(nodes)
    async with contextlib.AsyncExitStack() as outer:
        # The Dask scheduler starts while the control plane does: neither needs the other.
        (address, _), (plane, objects) = await _together(
            outer.enter_async_context(common.dask_scheduler(state_dir)),
            outer.enter_async_context(plane_with_operator_access(state_dir, values)),
        )
        from memops_sandbox import nodeagent  # the node agent's Nodes only (a second of imports)

        agent = nodeagent.NodeAgent(plane.nodes_kubeconfig(names), names, state_dir)
        async with contextlib.AsyncExitStack() as stack:
            agent_task = asyncio.create_task(agent.run())
            stack.push_async_callback(_stop_agent, agent, agent_task)
            async with plane.session() as api:
                deployment = common.worker_deployment(address, workers, memory_limit)
                await api.create(install.path_of(deployment), deployment)
            # The operator starts while the workers do: no MemoryPolicy exists yet, so the pods
            # being made now have nothing to get from its webhook.
            await _together(
                _unless_done(agent_task, common.wait_for_workers(address, workers, common.start_allowance(workers))),
                *([stack.enter_async_context(_operator(plane, objects, state_dir))] if operator else []),
            )
            (state_dir / "scheduler-address").write_text(address + "\n")
            (state_dir / "ready").write_text("ready\n")
            if on_ready is not None:
                on_ready()
            # The node agent runs until cancelled: if it ends, the sandbox has no kubelet left.
            await agent_task
            raise RuntimeError("the node agent stopped")


async def _serve_on_real_nodes(
    workers: int,
    state_dir: Path,
    *,
    nodes: int,
    operator: bool,
    memory_limit: str,
    values: dict[str, Any] | None,
    on_ready: Callable[[], None] | None,
    node_memory: str | None = None,
    eviction_threshold: str | None = None,
    swap: str | None = None,
) -> None:
    """:func:`serve` on real Nodes (:mod:`memops_sandbox.nodes`): the Dask scheduler and workers
    are pods in containers with memory limits, from the sandbox's own Dask image."""
    from memops_sandbox import images
    from memops_sandbox import nodes as real_nodes

    real_nodes.check_machine()
    names = node_names(nodes)
    binaries, archives = await _together(
        asyncio.to_thread(build.ensure_node_binaries), asyncio.to_thread(images.ensure)
    )
    dask_image = archives["dask"].ref
    async with contextlib.AsyncExitStack() as stack:
        machine = stack.enter_context(real_nodes.machine(names, state_dir))
        if swap is not None:  # before the kubelets start: each reports the swap it finds (nodeInfo.swap)
            stack.enter_context(real_nodes.swap(real_nodes.parse_memory(swap)))
        values = install.merge_values(
            values or {},
            install.pod_values(
                archives["operator"].ref, archives["pause"].ref, certs.WEBHOOK_CLIENT, replicas=1 if operator else 0
            ),
        )
        # Dask's own image's ref names the sandbox's Dask image too, so that manifests written for
        # a cluster (the Dask Helm chart's, dask-kubernetes') run here as they are.
        aliases = {common.DASK_IMAGE: dask_image}
        # The containerds start, and take the images, while the control plane starts; and this
        # process imports meanwhile what it needs only once the Nodes run (the Dask client).
        (plane, objects), _, _ = await _together(
            stack.enter_async_context(
                plane_with_operator_access(
                    state_dir, values, advertise=machine[0].ip, webhook_services=install.webhook_service_hosts(values)
                )
            ),
            stack.enter_async_context(
                real_nodes.runtimes(machine, binaries, list(archives.values()), state_dir / "logs", aliases=aliases)
            ),
            asyncio.to_thread(importlib.import_module, "memops.clients.daskrpc"),
        )
        async with plane.session() as api:
            # The Dask scheduler exists before its Node does: the kube-scheduler binds its pod the
            # moment the kubelets register.
            for manifest in common.scheduler_manifests(dask_image):
                await api.create(install.path_of(manifest), manifest)
            service = await api.get(f"/api/v1/namespaces/{common.NAMESPACE}/services/{common.SCHEDULER}")
            address = f"tcp://{service['spec']['clusterIP']}:{common.SCHEDULER_PORT}"
            await stack.enter_async_context(
                real_nodes.running(
                    plane,
                    machine,
                    binaries,
                    node_memory=node_memory,
                    eviction_hard=real_nodes.memory_eviction(eviction_threshold) if eviction_threshold else None,
                )
            )
            # Not before kube-proxy runs: until it has programmed the webhook's Service, the API
            # server's calls to it would hang to their timeout rather than fail at once.
            await install.install_operator(api, objects, plane.pki.path("webhook-client-ca").read_bytes())
            # The workers once the scheduler answers: a worker that finds no scheduler retries
            # with a growing backoff (Dask's connect), seconds apart by the time it would answer.
            await common.wait_for_workers(address, 0, common.start_allowance(workers))
            deployment = common.worker_deployment(address, workers, memory_limit, image=dask_image)
            await api.create(install.path_of(deployment), deployment)
            await _together(
                common.wait_for_workers(address, workers, common.start_allowance(workers)),
                *([_operator_ready(api, state_dir, install.webhook_service_hosts(values)[0])] if operator else []),
            )
        (state_dir / "scheduler-address").write_text(address + "\n")
        (state_dir / "ready").write_text("ready\n")
        if on_ready is not None:
            on_ready()
        await asyncio.Event().wait()


async def _operator_ready(api: controlplane.Api, state_dir: Path, webhook_host: str, timeout: float = 120) -> None:
    """Until the chart's operator pod is Ready (Kopf's /healthz answers) and its webhook's Service
    takes connections where the API server calls it (kube-proxy programs the Service a moment
    after the pod is Ready; until then a call fails open, and pods miss the safety net); then its
    metrics' address goes to ``DIR/metrics-url``."""
    selector = "app.kubernetes.io/component=operator"
    name, namespace = webhook_host.split(".")[:2]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        listed = await api.get(f"/api/v1/namespaces/{install.NAMESPACE}/pods?labelSelector={selector}")
        ready = [pod for pod in listed["items"] if pod_ready(pod)]
        service = await api.get(f"/api/v1/namespaces/{namespace}/services/{name}")
        if ready and await _accepts(service["spec"]["clusterIP"], 443):
            url = metrics_url(ready[0])
            if url is not None:
                (state_dir / "metrics-url").write_text(url + "\n")
            return
        await asyncio.sleep(0.2)
    raise TimeoutError(f"the operator's pod and its webhook's Service were not ready within {timeout:.0f} s")


def pod_ready(pod: dict[str, Any]) -> bool:
    """Whether the pod's ``Ready`` condition is ``True``."""
    conditions = pod.get("status", {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def metrics_url(pod: dict[str, Any]) -> str | None:
    """The Prometheus endpoint of an operator pod: its address and the port named ``metrics`` of
    its first container (None without one)."""
    ports = {p.get("name"): p["containerPort"] for p in pod["spec"]["containers"][0].get("ports", [])}
    return f"http://{pod['status']['podIP']}:{ports['metrics']}/metrics" if "metrics" in ports else None


async def _accepts(host: str, port: int) -> bool:
    """Whether ``host:port`` takes a TCP connection (from this machine, as the API server)."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 2)
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


async def _together(*awaitables: Awaitable[Any]) -> list[Any]:
    """Await ``awaitables`` at once and return their results; at the first failure, cancel the
    others and raise it as it is (what a context entered meanwhile started, its stack stops)."""
    tasks = [asyncio.ensure_future(awaitable) for awaitable in awaitables]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            error = task.exception() if task.done() and not task.cancelled() else None
            if error is not None:
                raise error
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _unless_done(task: asyncio.Task[None], awaitable: Awaitable[None]) -> None:
    """Await ``awaitable``, failing at once (with the task's exception) if ``task`` ends first."""
    waiting = asyncio.ensure_future(awaitable)
    try:
        await asyncio.wait({task, waiting}, return_when=asyncio.FIRST_COMPLETED)
        if not waiting.done():
            task.result()  # raises what the task raised
            raise RuntimeError("the node agent stopped")
        waiting.result()
    finally:
        waiting.cancel()


async def _stop_agent(agent: Any, task: asyncio.Task[None]) -> None:
    """Stop the node agent's pods (grace periods honoured), then its task. A task that failed
    has raised its error to the sandbox already (see :func:`serve`)."""
    await agent.shutdown()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task


async def serve_plane(state_dir: Path) -> None:
    """``memops-sandbox plane``: the control plane and the operator's access, until cancelled."""
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / "ready").unlink(missing_ok=True)
    async with plane_with_operator_access(state_dir) as _:
        (state_dir / "ready").write_text("ready\n")
        await asyncio.Event().wait()


def run_until_signalled(main: Any, state_dir: Path) -> int:
    """Run the coroutine ``main`` until SIGINT or SIGTERM; everything it started is stopped
    before this returns, and ``ready`` is removed."""
    import signal

    async def runner() -> None:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await main

    try:
        asyncio.run(runner())
    finally:
        (state_dir / "ready").unlink(missing_ok=True)
    return 0


def launch_plane(state_dir: Path, *, timeout: float = 300) -> subprocess.Popen[bytes]:
    """Start ``memops-sandbox plane`` as its own process and wait for ``DIR/ready``; for tests.
    Its output goes to ``DIR/../<name>-plane.log``. Stop it with SIGTERM."""
    log = state_dir.parent / f"{state_dir.name}-plane.log"
    command = [common.executable("memops-sandbox"), "plane", "--state-dir", str(state_dir)]
    with log.open("wb") as output:
        process = subprocess.Popen(command, stdout=output, stderr=output, start_new_session=True)
    deadline = time.monotonic() + timeout
    while not (state_dir / "ready").exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            process.wait()
            raise RuntimeError("the control plane did not become ready:\n" + log.read_text()[-3000:])
        time.sleep(0.1)
    return process
