"""``memops sandbox --plane emulated``: a whole cluster on a laptop, with real Dask workers and
memops' emulated API server instead of Kubernetes; and what both planes share (the worker
Deployment, the Dask scheduler, ports, ``launch``). The default plane is the upstream one
(``memops_sandbox.upstream``); this one stays while tests and benchmarks that run the emulated
API server in-process need it (see the README).

Starts, in this order: the emulated API server (with memops' CRDs), a real ``dask
scheduler``, the local kubelet and Deployment controller, a Deployment ``dask-worker`` in
namespace ``default`` whose pods are real ``dask worker`` processes, and the operator
(``memops run``, as its own process). When all of it is up it writes, into the state
directory, ``kubeconfig``, ``scheduler-address`` and, last, ``ready``. This contract is what
the test suite and users rely on; keep it stable.

The operator connects with its own kubeconfig (``operator-kubeconfig``, user
``memops-operator``), so that the API server's audit log (``--audit-log``, or
``$MEMOPS_AUDIT_LOG``) tells its requests from kubectl's and other controllers'.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import kmock

from memops import crds, daskrpc
from memops.cluster import apiserver, kubelet, replicaset

WORKLOAD = "dask-worker"
NAMESPACE = "default"
OPERATOR_USER = "memops-operator"  # the operator's token, and so its user in the audit log
AUDIT_LOG_ENV = "MEMOPS_AUDIT_LOG"


def worker_deployment(scheduler_address: str, replicas: int, memory_limit: str = "1GiB") -> dict[str, Any]:
    """The Deployment users would write for Dask workers: the pod name is the worker name, and the
    worker listens on the pod's IP (as ``dask worker`` does on a cluster, where that is the
    address on the way to the scheduler), which is how memops tells that it is this pod's."""
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": WORKLOAD, "namespace": NAMESPACE, "labels": {"app": WORKLOAD}},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": WORKLOAD}},
            "template": {
                "metadata": {"labels": {"app": WORKLOAD}},
                "spec": {
                    "terminationGracePeriodSeconds": 30,
                    "containers": [
                        {
                            "name": "worker",
                            "image": "ghcr.io/dask/dask:2026.8.0",
                            "command": ["dask", "worker"],
                            "args": [
                                "$(DASK_SCHEDULER_ADDRESS)",
                                "--name",
                                "$(POD_NAME)",
                                "--host",
                                "$(POD_IP)",
                                "--nthreads",
                                "1",
                                "--memory-limit",
                                memory_limit,
                                "--no-dashboard",
                                "--death-timeout",
                                "60",
                            ],
                            "env": [
                                {"name": "DASK_SCHEDULER_ADDRESS", "value": scheduler_address},
                                {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                                {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                            ],
                        }
                    ],
                },
            },
        },
    }


def free_port(*taken: int) -> int:
    """A local port that nothing listens on, for a server that another process will start, and
    not one of ``taken`` (chosen already, not bound yet).

    Chosen below the kernel's ephemeral range (``ip_local_port_range``), where there is room:
    a port from that range, free when we look, can be handed to any outgoing connection or
    port-0 bind (a Dask worker's, say) before the server binds it, and the server then fails
    with "address already in use".
    """
    low = 32768
    with contextlib.suppress(OSError, ValueError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    chooser = random.SystemRandom()
    if low > 2048:
        for _ in range(100):
            candidate = chooser.randrange(max(1024, low - 16384), low)
            if candidate in taken:
                continue
            with socket.socket() as sock, contextlib.suppress(OSError):
                sock.bind(("127.0.0.1", candidate))
                return candidate
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.asynccontextmanager
async def dask_scheduler(state_dir: Path) -> AsyncIterator[tuple[str, asyncio.subprocess.Process]]:
    """A real ``dask scheduler`` process; yields its address."""
    scheduler_file = state_dir / "scheduler.json"
    scheduler_file.unlink(missing_ok=True)
    log = (state_dir / "scheduler.log").open("wb")
    process = await asyncio.create_subprocess_exec(
        _executable("dask"),
        "scheduler",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--no-dashboard",
        "--scheduler-file",
        str(scheduler_file),
        stdout=log,
        stderr=log,
        start_new_session=True,
    )
    (state_dir / "scheduler.pid").write_text(str(process.pid))
    try:
        for _ in range(600):
            if scheduler_file.exists() and scheduler_file.stat().st_size:
                break
            if process.returncode is not None:
                raise RuntimeError(f"dask scheduler exited; see {state_dir / 'scheduler.log'}")
            await asyncio.sleep(0.05)
        address = json.loads(scheduler_file.read_text())["address"]
        yield address, process
    finally:
        await _stop(process, grace=10)
        log.close()


def _executable(name: str) -> str:
    """Console scripts of this environment, found next to the running interpreter first."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else (shutil.which(name) or name)


async def _stop(process: asyncio.subprocess.Process, *, grace: float) -> None:
    if process.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        await asyncio.wait_for(process.wait(), grace)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        await process.wait()


def start_allowance(workers: int) -> float:
    """Seconds the sandbox's workers get to connect: each pod starts a nanny and a worker
    process (a second or two of CPU each), so a large sandbox on a few cores needs longer."""
    return max(120.0, 60.0 + 5.0 * workers)


async def _wait_for_workers(address: str, count: int, timeout: float) -> None:
    async with asyncio.timeout(timeout):
        while True:
            with contextlib.suppress(daskrpc.SchedulerUnreachable):
                snapshot = await daskrpc.fetch_snapshot(address, timeout=5)
                if len(snapshot.workers) >= count:
                    return
            await asyncio.sleep(0.2)


def operator_command(webhook_port: int, metrics_port: int) -> list[str]:
    """``memops run`` as the sandbox starts it: every namespace, the admission webhook on
    plain HTTP on localhost (the emulated API server calls it; nothing else can), and the
    Prometheus metrics on localhost."""
    return [
        _executable("memops"),
        "run",
        "--all-namespaces",
        "--standalone",
        "--webhook-port",
        str(webhook_port),
        "--webhook-host",
        "127.0.0.1",
        "--webhook-insecure",
        "--metrics-port",
        str(metrics_port),
        "--metrics-host",
        "127.0.0.1",
    ]


async def _wait_for_webhook(api: apiserver.ApiServer, timeout: float = 60) -> None:
    """The operator is up once Kopf has registered its MutatingWebhookConfiguration."""
    events = api.store.watch()
    async with asyncio.timeout(timeout):
        if api.store.list("mutatingwebhookconfigurations"):
            return
        async for event in events:
            if event.plural == "mutatingwebhookconfigurations":
                return


async def serve(
    workers: int,
    state_dir: Path,
    *,
    operator: bool = True,
    port: int | None = None,
    memory_limit: str = "1GiB",
    audit_log: Path | None = None,
    on_ready: Callable[[], None] | None = None,
) -> None:
    """Run the sandbox until cancelled; ``on_ready`` is called once ``ready`` is written."""
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / "ready").unlink(missing_ok=True)
    api = apiserver.ApiServer(audit_log=audit_log)
    async with api, kmock.Server(api, port=port or free_port()) as server:
        for crd in crds.all_crds():
            await api.create_crd(crd)
        url = str(server.url).rstrip("/")
        kubeconfig = state_dir / "kubeconfig"
        kubeconfig.write_text(apiserver.kubeconfig(url))
        (state_dir / "operator-kubeconfig").write_text(apiserver.kubeconfig(url, token=OPERATOR_USER))
        async with dask_scheduler(state_dir) as (address, _), asyncio.TaskGroup() as tasks:
            node = kubelet.Kubelet(api.store, run_dir=state_dir)
            controller = replicaset.DeploymentController(api.store)
            kubelet_task = tasks.create_task(node.run())
            controller_task = tasks.create_task(controller.run())
            await api.store.create("deployments", NAMESPACE, worker_deployment(address, workers, memory_limit))
            await _wait_for_workers(address, workers, start_allowance(workers))
            operator_process = None
            if operator:
                log = (state_dir / "operator.log").open("wb")
                env = {**os.environ, "KUBECONFIG": str(state_dir / "operator-kubeconfig")}
                metrics_port = free_port()
                operator_process = await asyncio.create_subprocess_exec(
                    *operator_command(free_port(metrics_port), metrics_port),
                    stdout=log,
                    stderr=log,
                    env=env,
                    start_new_session=True,
                )
                (state_dir / "metrics-url").write_text(f"http://127.0.0.1:{metrics_port}/metrics\n")
                (state_dir / "operator.pid").write_text(str(operator_process.pid))
                await _wait_for_webhook(api)
            (state_dir / "scheduler-address").write_text(address + "\n")
            (state_dir / "ready").write_text("ready\n")
            if on_ready is not None:
                on_ready()
            try:
                await asyncio.Event().wait()
            finally:
                if operator_process is not None:
                    await _stop(operator_process, grace=10)
                controller_task.cancel()
                kubelet_task.cancel()


def launch(state_dir: Path, workers: int, *args: str, log: Path | None = None) -> subprocess.Popen[bytes]:
    """Start ``memops sandbox`` as its own process and wait until it has written ``ready``.

    For the test suite and the benchmarks, which drive the sandbox as a user does.
    """
    command = [_executable("memops"), "sandbox", "--workers", str(workers), "--state-dir", str(state_dir), *args]
    log = log or state_dir.parent / f"{state_dir.name}-sandbox.log"
    with log.open("wb") as output:
        process = subprocess.Popen(command, stdout=output, stderr=output, start_new_session=True)
    deadline = time.monotonic() + 60 + start_allowance(workers)
    while not (state_dir / "ready").exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            inside = state_dir / "sandbox.log"
            detail = log.read_text()[-3000:] + (inside.read_text()[-3000:] if inside.exists() else "")
            raise RuntimeError("the sandbox did not become ready:\n" + detail)
        time.sleep(0.1)
    return process


def main(
    workers: int,
    state_dir: str | None,
    *,
    operator: bool = True,
    port: int | None = None,
    memory_limit: str = "1GiB",
    audit_log: str | None = None,
) -> int:
    directory = Path(state_dir) if state_dir else Path(tempfile.mkdtemp(prefix="memops-sandbox-"))
    directory.mkdir(parents=True, exist_ok=True)
    # The terminal is for the person who typed the command: what the API server, the kubelet and
    # the Deployment controller log (an access line per request) goes to a file beside the
    # operator's, the scheduler's and the pods' own logs.
    log = directory / "sandbox.log"
    _log_to(log)
    print(
        f"memops sandbox: starting the API server, a Dask scheduler, {workers} workers"
        f"{' and the operator' if operator else ''} (logs in {directory})...",
        flush=True,
    )

    def announce() -> None:
        print(
            "memops sandbox: ready. In another terminal:\n"
            f"  export KUBECONFIG={directory / 'kubeconfig'}\n"
            "  kubectl get pods,retire\n"
            "  kubectl apply -f deploy/examples/retirementrequest.yaml\n"
            "  kubectl get retire -w\n"
            f"Logs: {log}, {directory / 'operator.log'}, {directory / 'scheduler.log'}. Stop with Ctrl-C.",
            flush=True,
        )

    async def runner() -> None:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await serve(
                workers,
                directory,
                operator=operator,
                port=port,
                memory_limit=memory_limit,
                audit_log=Path(audit_log) if audit_log else None,
                on_ready=announce,
            )

    try:
        asyncio.run(runner())
    except Exception as exc:
        print(f"memops sandbox: failed: {type(exc).__name__}: {exc}; see {log}", file=sys.stderr, flush=True)
        logging.getLogger(__name__).exception("the sandbox failed")
        return 1
    finally:
        (directory / "ready").unlink(missing_ok=True)
    print("memops sandbox: stopped.", flush=True)
    return 0


def _log_to(path: Path) -> None:
    """Send every log record of this process to ``path`` instead of the terminal."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    root.addHandler(handler)
    root.setLevel(logging.INFO)
