"""What the sandbox's parts share, and what the test suite and the benchmarks drive it with.

The worker Deployment users would write, a real ``dask scheduler`` process, free loopback ports,
stopping a process group, and :func:`launch`, which starts ``memops sandbox`` as its own process
and waits for its state directory's ``ready``. Used by :mod:`memops_sandbox.upstream` and
:mod:`memops_sandbox.controlplane`, and by ``tests/`` and ``bench/``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

WORKLOAD = "dask-worker"
NAMESPACE = "default"
AUDIT_LOG_ENV = "MEMOPS_AUDIT_LOG"
DASK_IMAGE = f"ghcr.io/dask/dask:{importlib.metadata.version('distributed')}"
"""Dask's own image, at this environment's version of distributed: what users' manifests name. On
real Nodes the sandbox's Dask image (same versions, built here) answers to it too."""


def worker_deployment(
    scheduler_address: str,
    replicas: int,
    memory_limit: str = "1GiB",
    *,
    image: str | None = None,
    namespace: str | None = NAMESPACE,
) -> dict[str, Any]:
    """The Deployment users would write for Dask workers: the pod name is the worker name, and the
    worker listens on the pod's IP (as ``dask worker`` does on a cluster, where that is the
    address on the way to the scheduler), which is how memops tells that it is this pod's.

    With ``image`` (real Nodes), the container runs that image with ``resources.limits.memory``
    of ``memory_limit``, and ``--memory-limit 1.0``: all of what Dask reads from the container's
    cgroup, as on a cluster. Without, the process node agent runs ``dask worker`` as a host
    process with ``--memory-limit``. With ``namespace`` None, the manifest names none: kubectl
    applies it to its context's."""
    deployment: dict[str, Any] = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": WORKLOAD, **({"namespace": namespace} if namespace else {}), "labels": {"app": WORKLOAD}},
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
                            "image": DASK_IMAGE,
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
    if image is not None:
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        container["image"] = image
        container["imagePullPolicy"] = "IfNotPresent"
        index = container["args"].index("--memory-limit")
        # A fraction (at most 1) is of the memory Dask finds, the cgroup's limit: the container's
        # whole limit, whatever CPUs it sees ("auto" would take the share of the CPUs that its
        # thread is, and Dask reads no CPU quota where cpu and cpuacct are mounted apart).
        container["args"][index + 1] = "1.0"
        # A small CPU request: the Nodes share this machine's cores.
        container["resources"] = {"limits": {"memory": quantity(memory_limit)}, "requests": {"cpu": "50m"}}
    return deployment


SCHEDULER = "dask-scheduler"
SCHEDULER_PORT = 8786


def quantity(size: str) -> str:
    """A Dask size (``1GiB``, ``512 MB``) as a Kubernetes quantity, in bytes."""
    from dask.utils import parse_bytes

    return str(parse_bytes(size))


def scheduler_manifests(image: str, memory_limit: str = "2GiB", *, namespace: str = NAMESPACE) -> list[dict[str, Any]]:
    """``dask scheduler`` as a Deployment of one pod, and its Service ``dask-scheduler``, as the
    Dask Helm chart makes them."""
    labels = {"app": SCHEDULER}
    deployment: dict[str, Any] = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": SCHEDULER, "namespace": namespace, "labels": labels},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "containers": [
                        {
                            "name": "scheduler",
                            "image": image,
                            "imagePullPolicy": "IfNotPresent",
                            "command": ["dask", "scheduler"],
                            "args": ["--port", str(SCHEDULER_PORT), "--no-dashboard"],
                            "ports": [{"name": "tcp-comm", "containerPort": SCHEDULER_PORT}],
                            # Its request is what it uses at most in the scenarios, not its
                            # limit: a Node with --node-memory has room for it and the workers,
                            # and the kubelet ranks it after any pod over its request.
                            "resources": {
                                "requests": {"memory": "512Mi"},
                                "limits": {"memory": quantity(memory_limit)},
                            },
                        }
                    ]
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": SCHEDULER, "namespace": namespace, "labels": labels},
        "spec": {"selector": labels, "ports": [{"name": "tcp-comm", "port": SCHEDULER_PORT, "targetPort": "tcp-comm"}]},
    }
    return [deployment, service]


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
        executable("dask"),
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
        await stop(process, grace=10)
        log.close()


def executable(name: str) -> str:
    """Console scripts of this environment, found next to the running interpreter first."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else (shutil.which(name) or name)


async def stop(process: asyncio.subprocess.Process, *, grace: float) -> None:
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


async def wait_for_workers(address: str, count: int, timeout: float) -> None:
    # Imported here, not with the module: distributed and the API client take about a second to
    # import, which the sandbox's process spends while its control plane starts instead.
    from memops.clients import daskrpc
    from memops_sandbox import dask_direct

    async with asyncio.timeout(timeout):
        while True:
            with contextlib.suppress(daskrpc.SchedulerUnreachable):
                snapshot = await dask_direct.fetch_snapshot(address, timeout=5)
                if len(snapshot.workers) >= count:
                    return
            await asyncio.sleep(0.2)


def launch(
    state_dir: Path, workers: int, *args: str, log: Path | None = None, real_nodes: bool = False
) -> subprocess.Popen[bytes]:
    """Start ``memops sandbox`` as its own process and wait until it has written ``ready``.

    For the test suite and the benchmarks, which drive the sandbox as a user does. Without
    ``real_nodes``, on the process node agent (``--node-agent``): the scenarios written for it
    signal its pods' processes by the pid files it writes.
    """
    agent = [] if real_nodes else ["--node-agent"]
    command = [executable("memops"), "sandbox", "--workers", str(workers), "--state-dir", str(state_dir), *agent, *args]
    log = log or state_dir.parent / f"{state_dir.name}-sandbox.log"
    failure = built(real_nodes)
    if failure:
        raise RuntimeError("the sandbox's binaries or images could not be built:\n" + failure)
    with log.open("wb") as output:
        process = subprocess.Popen(command, stdout=output, stderr=output, start_new_session=True)
    deadline = time.monotonic() + 60 + start_allowance(workers)
    while not (state_dir / "ready").exists():
        if process.poll() is not None or time.monotonic() > deadline:
            _end(process)
            inside = state_dir / "sandbox.log"
            detail = log.read_text()[-3000:] + (inside.read_text()[-3000:] if inside.exists() else "")
            raise RuntimeError("the sandbox did not become ready:\n" + detail)
        time.sleep(0.1)
    return process


def built(real_nodes: bool) -> str:
    """Wait for what the sandbox runs to be built, before its start's deadline begins: "" when it
    is, else the build's last words. A part that another process is building (CI builds beside
    the tests that need no sandbox) is waited for, however long; found in the cache, it takes half
    a second. On the node agent's Nodes only the control plane is needed."""
    if not real_nodes:
        from memops_sandbox import build

        try:
            build.ensure()
        except build.BuildError as error:
            return str(error)
        return ""
    done = subprocess.run([executable("memops-sandbox"), "build"], capture_output=True, text=True)
    return "" if done.returncode == 0 else (done.stdout + done.stderr)[-3000:]


def _end(process: subprocess.Popen[bytes]) -> None:
    """Stop a sandbox that failed to start and everything it started (its session's processes):
    asked first, so that it takes its Nodes down and leaves nothing behind for the next sandbox,
    then killed."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(60)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
