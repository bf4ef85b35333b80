"""The node agent: the sandbox's kubelet, against a real kube-apiserver.

``NodeAgent`` registers one or more Nodes, keeps them Ready (a Lease in ``kube-node-lease``
renewed every 10 s, and the Ready condition's heartbeat), and runs the pods that the scheduler
binds to them as real processes on this machine. It does what the kubelet does wherever memops
relies on it, and cites where upstream does it (kubernetes v1.37). Where it differs, it says so:

- no images: a pod's single container runs its ``command`` + ``args`` from PATH (this Python's
  own scripts first), in its own working directory ``RUN_DIR/nodes/<node>/pods/<ns>_<name>``;
  no init or sidecar containers, resources or cgroups; of volumes, ``emptyDir`` and ``hostPath``
  only, as node directories that paths under their mount path are rewritten to
  (:mod:`memops_sandbox.nodeagent_volumes`);
- each pod gets its own loopback address (127.x.y.z) as ``status.podIP``, chosen before the
  container starts so that ``fieldRef: status.podIP`` (and ``status.podIPs``) works; each node's
  pods come from its own 127.(100+i).0.0/16 and the node's address (``hostIP``) is 127.(100+i).0.1.
  No network namespace: the pods share this machine's network, and only the address a pod's
  Python processes find for themselves is the pod's (:mod:`memops_sandbox.nodeagent_net`), so
  that ``dask worker`` without ``--host`` listens on its pod's IP, as on a cluster;
- restart back-off starts at 0.5 s and doubles to 5 s (upstream: 10 s to 5 min), so tests do
  not wait;
- the Ready condition's heartbeat is posted every minute (upstream: every 5 min when nothing
  changed; the Lease is the heartbeat the node lifecycle controller reads first).

Each container's output goes to ``RUN_DIR/pods/<namespace>_<name>.log`` and its process id to
``…pid``, so that tests can signal a pod's processes the way a crash or an OOM kill would.
Each node has a scratch directory ``RUN_DIR/nodes/<node>`` and a tmpfs directory under
``/dev/shm``, both named in the Node's annotations (``memops.dev/scratch-dir``,
``memops.dev/tmpfs-dir``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import shutil
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memops_sandbox import nodeagent_api as api
from memops_sandbox import nodeagent_env as envs
from memops_sandbox import nodeagent_net as net
from memops_sandbox import nodeagent_status as statuses
from memops_sandbox import nodeagent_volumes as volumes

Obj = dict[str, Any]
logger = logging.getLogger("memops_sandbox.nodeagent")  # the same name when run with -m

SCRATCH_ANNOTATION = "memops.dev/scratch-dir"
TMPFS_ANNOTATION = "memops.dev/tmpfs-dir"
DEFAULT_CAPACITY = {"cpu": "8", "memory": "16Gi", "pods": "110"}
KUBELET_VERSION = "v1.37.2"


@dataclass(frozen=True)
class Timing:
    """The agent's clocks, each next to the upstream default it follows or shortens."""

    lease_duration: int = 40
    """Seconds: the kubelet's ``nodeLeaseDurationSeconds`` default (pkg/kubelet/apis/config/v1beta1/defaults.go)."""
    lease_renew: float = 10.0
    """Seconds: ``lease_duration * nodeLeaseRenewIntervalFraction`` (0.25, pkg/kubelet/kubelet.go)."""
    status_report: float = 60.0
    """Seconds between Ready heartbeats when nothing changed (upstream ``nodeStatusReportFrequency``: 5 min)."""
    backoff_initial: float = 0.5
    """Seconds before the first restart of an exited container (upstream 10 s, pkg/kubelet/kubelet.go)."""
    backoff_max: float = 5.0
    """Seconds: the back-off's ceiling (upstream ``MaxContainerBackOff``, 300 s)."""
    minimum_grace: float = 2.0
    """Seconds a container gets after preStop, whatever is left (``minimumGracePeriodInSeconds``,
    pkg/kubelet/kuberuntime/kuberuntime_manager.go)."""


def exit_code(returncode: int) -> int:
    """A runtime reports a process killed by signal N as exit code 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def pod_ref(pod: Obj) -> str:
    """``format.Pod``: ``name_namespace(uid)``, as the kubelet's messages name pods."""
    meta = pod["metadata"]
    return f"{meta['name']}_{meta.get('namespace', '')}({meta.get('uid', '')})"


@dataclass
class Node:
    """One node served by the agent."""

    name: str
    index: int
    api: api.Api
    scratch: Path
    tmpfs: Path
    pods: dict[str, PodWorker] = field(default_factory=dict)
    uid: str = ""
    next_ip: int = 2
    ips: set[str] = field(default_factory=set)

    @property
    def host_ip(self) -> str:
        return f"127.{100 + self.index}.0.1"

    def allocate_ip(self, wanted: str | None = None) -> str:
        """Round robin through the node's /16, as host-local IPAM does (it resumes after the last
        address it reserved), so that a dead pod's address is not handed out again at once."""
        if wanted and wanted.startswith(f"127.{100 + self.index}.") and wanted not in self.ips:
            self.ips.add(wanted)
            return wanted
        for _ in range(65534):
            n = self.next_ip
            self.next_ip = 2 if n >= 65534 else n + 1
            ip = f"127.{100 + self.index}.{n // 256}.{n % 256}"
            if ip not in self.ips and n % 256 not in (0, 255):
                self.ips.add(ip)
                return ip
        raise RuntimeError(f"node {self.name}: no pod addresses left")


class PodWorker:
    """One pod on one node: its container's process, probes, restarts, termination."""

    def __init__(self, agent: NodeAgent, node: Node, pod: Obj):
        self.agent = agent
        self.node = node
        self.pod = pod
        meta = pod["metadata"]
        self.namespace = str(meta.get("namespace", "default"))
        self.name = str(meta["name"])
        self.uid = str(meta.get("uid", ""))
        self.spec: Obj = pod["spec"]
        container = (self.spec.get("containers") or [{}])[0]
        self.container: Obj = container
        previous = ((pod.get("status") or {}).get("containerStatuses") or [{}])[0]
        self.state = statuses.Container(
            name=str(container.get("name", "")),
            image=str(container.get("image", "")),
            restart_count=int(previous.get("restartCount", 0)),
        )
        self.ip = node.allocate_ip((pod.get("status") or {}).get("podIP"))
        self.start_time = (pod.get("status") or {}).get("startTime") or statuses.now()
        self.env: dict[str, str] = {}
        self.process: asyncio.subprocess.Process | None = None
        self.deleting = asyncio.Event()
        self.deadline: float | None = None
        self.grace_changed = asyncio.Event()
        self.report_lock = asyncio.Lock()
        self.task: asyncio.Task[None] | None = None

    # -- files -------------------------------------------------------------------------------

    @property
    def files(self) -> Path:
        return self.agent.run_dir / "pods" / f"{self.namespace}_{self.name}"

    @property
    def workdir(self) -> Path:
        return self.node.scratch / "pods" / f"{self.namespace}_{self.name}"

    @property
    def path(self) -> str:
        return f"/api/v1/namespaces/{self.namespace}/pods/{self.name}"

    # -- API ---------------------------------------------------------------------------------

    async def report(self, *, terminal: bool = False, node_shutdown: bool = False) -> None:
        """Patch the pod's status; the uid in the patch makes it a precondition, as the status
        manager's ``PatchPodStatus`` does, so a new pod with this name is never touched."""
        async with self.report_lock:
            status = statuses.pod_status(
                self.pod,
                self.state,
                pod_ip=self.ip,
                host_ip=self.node.host_ip,
                start_time=self.start_time,
                terminal=terminal,
                node_shutdown=node_shutdown,
            )
            try:
                self.pod = await self.node.api.patch(
                    f"{self.path}/status", {"metadata": {"uid": self.uid}, "status": status}
                )
            except api.TRANSIENT as exc:
                # The pod may be gone; otherwise the next change writes the whole status again.
                logger.info("pod %s/%s: status not written: %s", self.namespace, self.name, exc)

    async def event(self, kind: str, reason: str, message: str) -> None:
        """A core/v1 Event about the container, as ``recordContainerEvent`` writes it
        (pkg/kubelet/kuberuntime/kuberuntime_container.go): source component ``kubelet`` and
        host the node (``makeEventRecorder``, cmd/kubelet/app/server.go)."""
        await self.agent.post_event(
            self.node,
            {
                "kind": "Pod",
                "namespace": self.namespace,
                "name": self.name,
                "uid": self.uid,
                "apiVersion": "v1",
                "fieldPath": f"spec.containers{{{self.state.name}}}",
            },
            kind,
            reason,
            message,
        )

    # -- lifecycle ---------------------------------------------------------------------------

    async def prepare(self) -> list[str]:
        """The container's environment and command line; secrets and config maps are read as
        the node (the Node authorizer lets a node read those of pods bound to it)."""
        extra = [f"spec.containers[{i}]" for i in range(1, len(self.spec.get("containers") or []))]
        extra += [f"spec.initContainers[{i}]" for i in range(len(self.spec.get("initContainers") or []))]
        if extra:
            raise envs.ConfigError(f"the node agent runs one container per pod; not run: {', '.join(extra)}")
        secret_names, config_map_names = envs.references(self.container)
        secrets = {
            name: await self.agent.read_optional(self.node, "secrets", self.namespace, name) for name in secret_names
        }
        config_maps = {
            name: await self.agent.read_optional(self.node, "configmaps", self.namespace, name)
            for name in config_map_names
        }
        env = envs.container_env(
            self.pod,
            self.container,
            pod_ip=self.ip,
            host_ip=self.node.host_ip,
            secrets=secrets,
            config_maps=config_maps,
        )
        # No mount namespace: paths under a volume's mountPath name its node directory instead.
        found = volumes.mounts(self.pod, self.container, tmpfs=self.node.tmpfs, scratch=self.node.scratch, env=env)
        self.env = {name: volumes.translate(value, found) for name, value in env.items()}
        return [volumes.translate(part, found) for part in envs.command_line(self.container, self.env)]

    def process_env(self) -> dict[str, str]:
        """The environment of the container's process, of its exec probes and of its exec hooks;
        their route lookups answer the pod's IP (:mod:`memops_sandbox.nodeagent_net`)."""
        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        site = net.write_site(self.agent.run_dir / "pod-network")
        return net.pod_env({**os.environ, "PATH": path, **self.env}, site=site, pod_ip=self.ip)

    async def run(self) -> None:
        backoff = self.agent.timing.backoff_initial
        while not self.deleting.is_set():
            try:
                argv = await self.prepare()
            except api.TRANSIENT as exc:  # ConfigError is a ValueError
                # CreateContainerConfigError: the kubelet retries each sync until it works.
                self.state.reason, self.state.message = "CreateContainerConfigError", str(exc)
                await self.event("Warning", "Failed", f"Error: {exc}")
                await self.report()
                if await self.wait_deleting(backoff):
                    break
                backoff = min(backoff * 2, self.agent.timing.backoff_max)
                continue
            if not await self.start(argv):
                if await self.wait_deleting(backoff):
                    break
                backoff = min(backoff * 2, self.agent.timing.backoff_max)
                continue
            started = time.monotonic()
            probes = asyncio.create_task(self.probe())
            assert self.process is not None
            exited = asyncio.create_task(self.process.wait())
            deleting = asyncio.create_task(self.deleting.wait())
            try:
                await asyncio.wait({exited, deleting}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                probes.cancel()
                deleting.cancel()
                if not exited.done():
                    exited.cancel()
                await asyncio.gather(probes, deleting, return_exceptions=True)
            if self.deleting.is_set() and self.alive():
                break
            code = exit_code(self.process.returncode or 0)
            self.stopped(code)
            if self.deleting.is_set():
                break
            policy = self.spec.get("restartPolicy", "Always")
            if policy == "Never" or (policy == "OnFailure" and code == 0):
                await self.report()
                await self.deleting.wait()
                break
            # The back-off is reset after a container ran long enough (upstream 10 min, here 1 min).
            if time.monotonic() - started > 60:
                backoff = self.agent.timing.backoff_initial
            logger.info("pod %s/%s: container exited %s; restarting in %.1fs", self.namespace, self.name, code, backoff)
            self.state.restart_count += 1
            self.state.last_terminated = self.state.terminated()
            self.state.state, self.state.reason = "waiting", "CrashLoopBackOff"
            self.state.message = (
                f"back-off {backoff:g}s restarting failed container={self.state.name} pod={pod_ref(self.pod)}"
            )
            # ``doBackOff`` (pkg/kubelet/kuberuntime/kuberuntime_manager.go)
            await self.event(
                "Warning",
                "BackOff",
                f"Back-off restarting failed container {self.state.name} in pod {pod_ref(self.pod)}",
            )
            await self.report()
            if await self.wait_deleting(backoff):
                break
            backoff = min(backoff * 2, self.agent.timing.backoff_max)
        await self.terminate()

    async def wait_deleting(self, seconds: float) -> bool:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):  # not wait_for: it can lose a cancellation on 3.11
                await self.deleting.wait()
        return self.deleting.is_set()

    async def start(self, argv: list[str]) -> bool:
        """Start the container's process: ``startContainer`` writes Created, then Started
        (pkg/kubelet/kuberuntime/kuberuntime_container.go). No image is pulled, so no Pulled."""
        self.files.parent.mkdir(parents=True, exist_ok=True)
        workdir = Path(self.container["workingDir"]) if self.container.get("workingDir") else self.workdir
        workdir.mkdir(parents=True, exist_ok=True)
        with self.files.with_suffix(".log").open("ab") as log:
            try:
                self.process = await asyncio.create_subprocess_exec(
                    *argv,
                    stdout=log,
                    stderr=log,
                    env=self.process_env(),
                    cwd=workdir,
                    start_new_session=True,
                )
            except OSError as exc:
                self.state.state, self.state.reason, self.state.message = "waiting", "RunContainerError", str(exc)
                await self.event("Warning", "Failed", f"Error: {exc}")
                await self.report()
                return False
        self.files.with_suffix(".pid").write_text(str(self.process.pid))
        self.state.container_id = f"memops://{self.uid[:8]}-{self.process.pid}"
        await self.event("Normal", "Created", "Container created")
        self.state.state, self.state.reason, self.state.message = "running", "", ""
        self.state.started_at = statuses.now()
        self.state.exit_code = None
        self.state.ready = "readinessProbe" not in self.container
        await self.event("Normal", "Started", "Container started")
        await self.report()
        return True

    def stopped(self, code: int) -> None:
        self.state.state, self.state.exit_code = "terminated", code
        self.state.reason, self.state.message = statuses.exit_reason(code), ""
        self.state.finished_at = statuses.now()
        self.state.ready = False

    def alive(self) -> bool:
        return self.process is not None and self.process.returncode is None

    def signal(self, sig: signal.Signals) -> None:
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, sig)

    async def exec(self, command: list[str], timeout: float) -> tuple[bool, str]:
        """Run an exec probe or hook in the container's environment; (succeeded, output)."""
        try:
            process = await asyncio.create_subprocess_exec(
                *command,
                env=self.process_env(),
                cwd=self.workdir,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as exc:
            return False, str(exc)
        try:
            async with asyncio.timeout(timeout):
                output, _ = await process.communicate()
        except (TimeoutError, asyncio.CancelledError):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
            raise
        return process.returncode == 0, output.decode(errors="replace").strip()

    async def probe(self) -> None:
        """Readiness and liveness exec probes (pkg/kubelet/prober/worker.go): every
        ``periodSeconds`` (10) after ``initialDelaySeconds``, a result flips only after
        ``successThreshold`` (1) or ``failureThreshold`` (3) results in a row; a failed result
        is an ``Unhealthy`` event (pkg/kubelet/prober/prober.go); a liveness failure kills the
        container, which then restarts as its restartPolicy says."""
        await asyncio.gather(*(self.probe_loop(kind) for kind in ("readiness", "liveness")))

    async def probe_loop(self, kind: str) -> None:
        spec = self.container.get(f"{kind}Probe")
        if not spec:
            return
        if "exec" not in spec:
            logger.warning("pod %s/%s: only exec probes are run; %s probe ignored", self.namespace, self.name, kind)
            return
        command = envs.probe_command(list(spec["exec"].get("command") or []), self.container)
        period = float(spec.get("periodSeconds", 10))
        timeout = float(spec.get("timeoutSeconds", 1))
        successes, failures = int(spec.get("successThreshold", 1)), int(spec.get("failureThreshold", 3))
        await asyncio.sleep(float(spec.get("initialDelaySeconds", 0)))
        run_ok = run_failed = 0
        label = kind.capitalize()
        while self.alive():
            try:
                ok, output = await self.exec(command, timeout)
            except TimeoutError:
                ok, output = False, f"command timed out after {timeout:g}s"
            run_ok, run_failed = (run_ok + 1, 0) if ok else (0, run_failed + 1)
            if not ok:
                await self.event("Warning", "Unhealthy", f"{label} probe failed: {output}")
            if kind == "readiness":
                ready = self.state.ready
                if ok and run_ok >= successes:
                    ready = True
                elif not ok and run_failed >= failures:
                    ready = False
                if ready != self.state.ready:
                    self.state.ready = ready
                    await self.report()
            elif run_failed >= failures:
                message = f"Container {self.state.name} failed liveness probe, will be restarted"
                await self.event("Normal", "Killing", message)
                await self.stop_process(float(self.spec.get("terminationGracePeriodSeconds", 30)))
                return
            await asyncio.sleep(period)

    async def stop_process(self, grace: float) -> None:
        """SIGTERM to the process group, SIGKILL once ``grace`` ends (CRI's StopContainer)."""
        self.signal(signal.SIGTERM)
        if self.process is None:
            return
        try:
            async with asyncio.timeout(max(grace, 0.0)):
                await self.process.wait()
        except TimeoutError:
            self.signal(signal.SIGKILL)
            await self.process.wait()
        self.signal(signal.SIGKILL)  # whatever the container left behind in its group

    def mark_deleting(self, pod: Obj | None) -> None:
        """The pod has a deletionTimestamp (or is gone): its grace counts from now, preStop
        included. A later deletion with a shorter grace shortens it, as upstream honours."""
        meta = (pod or {}).get("metadata") or {}
        grace = float(meta.get("deletionGracePeriodSeconds", 0 if pod is None else 30))
        deadline = time.monotonic() + grace
        if self.deadline is None or deadline < self.deadline:
            self.deadline = deadline
            self.grace_changed.set()
        if pod is not None:
            self.pod = pod
        self.deleting.set()

    def remaining(self) -> float:
        return max((self.deadline or time.monotonic()) - time.monotonic(), 0.0)

    async def terminate(self, *, node_shutdown: bool = False) -> None:
        """``killContainer`` (pkg/kubelet/kuberuntime/kuberuntime_container.go): a Killing
        event, the preStop hook within the grace period (a failed hook is a Warning
        ``FailedPreStopHook`` event, "PreStopHook failed", and the kill goes on), then
        SIGTERM, SIGKILL when what is left of the grace (at least 2 s) runs out. Then the pod
        turns terminal and, if it was deleted, the status manager's final delete with grace 0
        (``syncPod`` once ``canBeDeleted``, pkg/kubelet/status/status_manager.go)."""
        if self.alive():
            await self.event("Normal", "Killing", f"Stopping container {self.state.name}")
            pre_stop = ((self.container.get("lifecycle") or {}).get("preStop") or {}).get("exec")
            if pre_stop and self.remaining() > 0:
                ok = True
                try:
                    ok, output = await self.exec(list(pre_stop.get("command") or []), self.remaining())
                except TimeoutError:
                    logger.info("pod %s/%s: preStop hook did not finish in the grace period", self.namespace, self.name)
                if not ok:
                    logger.info("pod %s/%s: preStop hook failed: %s", self.namespace, self.name, output)
                    # The message leaves the hook's output out "so that secrets won't leak" (upstream).
                    await self.event("Warning", "FailedPreStopHook", "PreStopHook failed")
            grace = max(self.remaining(), self.agent.timing.minimum_grace)
            self.signal(signal.SIGTERM)
            assert self.process is not None
            deadline = time.monotonic() + grace
            while self.alive():
                left = deadline - time.monotonic()
                if left <= 0:
                    self.signal(signal.SIGKILL)
                    await self.process.wait()
                    break
                self.grace_changed.clear()
                waiting = asyncio.create_task(self.process.wait())
                shortened = asyncio.create_task(self.grace_changed.wait())
                await asyncio.wait({waiting, shortened}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                waiting.cancel()
                shortened.cancel()
                if self.grace_changed.is_set():
                    # A second deletion with a shorter grace period.
                    shorter = time.monotonic() + max(self.remaining(), self.agent.timing.minimum_grace)
                    deadline = min(deadline, shorter)
            self.signal(signal.SIGKILL)
            self.stopped(exit_code(self.process.returncode or 0))
        self.files.with_suffix(".pid").unlink(missing_ok=True)
        volumes.remove_empty_dirs(self.pod, tmpfs=self.node.tmpfs, scratch=self.node.scratch)
        await self.report(terminal=True, node_shutdown=node_shutdown)
        if not node_shutdown:
            await self.agent.delete_pod(self.node, self.namespace, self.name, self.uid)


class NodeAgent:
    """Serves ``nodes`` against the API server of ``kubeconfig`` until cancelled."""

    def __init__(
        self,
        kubeconfig: Path,
        nodes: list[str],
        run_dir: Path,
        *,
        capacity: dict[str, str] | None = None,
        timing: Timing | None = None,
    ):
        self.kubeconfig = Path(kubeconfig)
        self.node_names = list(nodes)
        self.run_dir = Path(run_dir)
        self.capacity = {**DEFAULT_CAPACITY, **(capacity or {})}
        self.timing = timing or Timing()
        digest = hashlib.sha256(str(self.run_dir.resolve()).encode()).hexdigest()[:10]
        self.tmpfs_root = Path("/dev/shm") / f"memops-{digest}"
        self.nodes: dict[str, Node] = {}
        self.tasks: list[asyncio.Task[None]] = []
        self.closed = False
        self.events: dict[tuple[str, ...], tuple[str, int]] = {}

    # -- API helpers -------------------------------------------------------------------------

    async def read_optional(self, node: Node, plural: str, namespace: str, name: str) -> Obj | None:
        try:
            return await node.api.get(f"/api/v1/namespaces/{namespace}/{plural}/{name}")
        except api.ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def post_event(self, node: Node, involved: Obj, kind: str, reason: str, message: str) -> None:
        """Write an Event; a repeat of the same one (same object, reason and message) bumps the
        first one's count and lastTimestamp instead, as client-go's EventCorrelator does
        (``eventObserve``, staging/src/k8s.io/client-go/tools/record/events_cache.go)."""
        stamp = statuses.now()
        namespace = involved["namespace"]
        key = (node.name, involved["uid"], involved.get("fieldPath", ""), kind, reason, message)
        try:
            if key in self.events:
                name, count = self.events[key]
                body: Obj = {"count": count + 1, "lastTimestamp": stamp}
                await node.api.patch(f"/api/v1/namespaces/{namespace}/events/{name}", body)
                self.events[key] = (name, count + 1)
                return
            name = f"{involved['name']}.{time.time_ns():x}"
            body = {
                "metadata": {"name": name, "namespace": namespace},
                "involvedObject": involved,
                "reason": reason,
                "message": message,
                "type": kind,
                "source": {"component": "kubelet", "host": node.name},
                "firstTimestamp": stamp,
                "lastTimestamp": stamp,
                "count": 1,
                "reportingComponent": "kubelet",
                "reportingInstance": node.name,
            }
            await node.api.create(f"/api/v1/namespaces/{namespace}/events", body)
            self.events[key] = (name, 1)
        except api.TRANSIENT as exc:
            # The kubelet's event broadcaster drops what it cannot write, too.
            logger.warning("event %s for %s not written: %s", reason, involved["name"], exc)
            self.events.pop(key, None)

    async def delete_pod(self, node: Node, namespace: str, name: str, uid: str) -> None:
        """The final delete (grace 0, this uid only); retried, as the status manager retries."""
        body = {"gracePeriodSeconds": 0, "preconditions": {"uid": uid}}
        for attempt in range(10):
            try:
                await node.api.delete(f"/api/v1/namespaces/{namespace}/pods/{name}", body)
                return
            except api.ApiError as exc:
                if exc.status in (404, 409):
                    return
                failure: BaseException = exc
            except api.TRANSIENT as exc:
                failure = exc
            logger.warning("pod %s/%s: delete failed (attempt %d): %s", namespace, name, attempt + 1, failure)
            await asyncio.sleep(1)

    # -- nodes -------------------------------------------------------------------------------

    def node_object(self, node: Node) -> Obj:
        """The Node as ``initialNode`` and the node status setters build it
        (pkg/kubelet/kubelet_node_status.go, pkg/kubelet/nodestatus/setters.go); no taints."""
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": node.name,
                "labels": {
                    "kubernetes.io/hostname": node.name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    "beta.kubernetes.io/os": "linux",
                    "beta.kubernetes.io/arch": "amd64",
                },
                "annotations": {SCRATCH_ANNOTATION: str(node.scratch), TMPFS_ANNOTATION: str(node.tmpfs)},
            },
            "spec": {},
            "status": self.node_status(node),
        }

    def node_status(self, node: Node) -> Obj:
        stamp = statuses.now()
        conditions = [
            ("MemoryPressure", "False", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
            ("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
            ("PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
            ("Ready", "True", "KubeletReady", "kubelet is posting ready status"),
        ]
        return {
            "capacity": dict(self.capacity),
            "allocatable": dict(self.capacity),
            "conditions": [
                {
                    "type": kind,
                    "status": value,
                    "reason": reason,
                    "message": message,
                    "lastHeartbeatTime": stamp,
                    "lastTransitionTime": stamp,
                }
                for kind, value, reason, message in conditions
            ],
            "addresses": [{"type": "InternalIP", "address": node.host_ip}, {"type": "Hostname", "address": node.name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
            "nodeInfo": {
                "machineID": "",
                "systemUUID": "",
                "bootID": "",
                "kernelVersion": os.uname().release,
                "osImage": "memops node agent",
                "containerRuntimeVersion": "memops://0",
                "kubeletVersion": KUBELET_VERSION,
                "kubeProxyVersion": "",
                "operatingSystem": "linux",
                "architecture": "amd64",
            },
        }

    async def register(self, node: Node) -> None:
        """``registerWithAPIServer`` (pkg/kubelet/kubelet_node_status.go): create the Node, or
        take over the existing one (its status is rewritten; its labels are merged)."""
        body = self.node_object(node)
        while True:
            try:
                try:
                    created = await node.api.create("/api/v1/nodes", body)
                except api.ApiError as exc:
                    if exc.status != 409:
                        raise
                    meta = {"labels": body["metadata"]["labels"], "annotations": body["metadata"]["annotations"]}
                    created = await node.api.patch(f"/api/v1/nodes/{node.name}", {"metadata": meta})
                    await self.post_node_status(node, transition=True)
                node.uid = created["metadata"]["uid"]
                return
            except api.TRANSIENT as exc:
                logger.warning("node %s: registration failed, retrying: %s", node.name, exc)
                await asyncio.sleep(1)

    async def post_node_status(self, node: Node, *, transition: bool = False) -> None:
        status = self.node_status(node)
        if not transition:
            # A heartbeat moves lastHeartbeatTime only; lastTransitionTime stays (strategic
            # merge of conditions by type keeps what this patch leaves out).
            for condition in status["conditions"]:
                del condition["lastTransitionTime"]
        await node.api.patch(f"/api/v1/nodes/{node.name}/status", {"status": status})

    async def keep_lease(self, node: Node) -> None:
        """The node lease controller (staging/src/k8s.io/component-helpers/apimachinery/lease/controller.go):
        create the Lease owned by the Node, then renew it every ``lease_renew`` seconds."""
        path = "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases"
        lease: Obj | None = None
        while True:
            try:
                spec = {
                    "holderIdentity": node.name,
                    "leaseDurationSeconds": self.timing.lease_duration,
                    "renewTime": statuses.now_micro(),
                }
                if lease is None:
                    try:
                        lease = await node.api.get(f"{path}/{node.name}")
                    except api.ApiError as exc:
                        if exc.status != 404:
                            raise
                        owner = {"apiVersion": "v1", "kind": "Node", "name": node.name, "uid": node.uid}
                        body = {"metadata": {"name": node.name, "ownerReferences": [owner]}, "spec": spec}
                        lease = await node.api.create(path, body)
                        spec = {}
                if spec:
                    lease = await node.api.put(f"{path}/{node.name}", {**lease, "spec": {**lease["spec"], **spec}})
            except api.TRANSIENT as exc:
                logger.warning("node %s: lease not renewed: %s", node.name, exc)
                lease = None  # a conflict or a missing lease: read it again
            await asyncio.sleep(self.timing.lease_renew)

    async def keep_status(self, node: Node) -> None:
        while True:
            await asyncio.sleep(self.timing.status_report)
            try:
                await self.post_node_status(node)
            except api.TRANSIENT as exc:
                logger.warning("node %s: status not posted: %s", node.name, exc)

    # -- pods --------------------------------------------------------------------------------

    async def watch_pods(self, node: Node) -> None:
        """List then watch the pods bound to the node, as the kubelet's API source does
        (``NewSourceApiserver``, pkg/kubelet/config/apiserver.go: a fieldSelector on
        spec.nodeName); a 410 Gone lists again."""
        selector = f"spec.nodeName={node.name}"
        path = "/api/v1/pods"
        version = ""
        while True:
            try:
                if not version:
                    listed = await node.api.get(path, fieldSelector=selector)
                    version = listed["metadata"]["resourceVersion"]
                    seen = set()
                    for pod in listed.get("items") or []:
                        seen.add(pod["metadata"]["uid"])
                        await self.sync(node, pod)
                    for uid, worker in list(node.pods.items()):
                        if uid not in seen:
                            worker.mark_deleting(None)
                async for event in node.api.watch(
                    path, fieldSelector=selector, resourceVersion=version, timeoutSeconds="300"
                ):
                    obj = event["object"]
                    version = obj.get("metadata", {}).get("resourceVersion") or version
                    if event["type"] == "BOOKMARK":
                        continue
                    await self.sync(node, obj, deleted=event["type"] == "DELETED")
            except api.Gone:
                version = ""
            except api.TRANSIENT as exc:
                logger.warning("node %s: pod watch failed, listing again: %s", node.name, exc)
                version = ""
                await asyncio.sleep(1)

    async def sync(self, node: Node, pod: Obj, *, deleted: bool = False) -> None:
        meta = pod["metadata"]
        uid = meta["uid"]
        worker = node.pods.get(uid)
        phase = (pod.get("status") or {}).get("phase")
        if deleted:
            if worker is not None:
                worker.mark_deleting(None)
            return
        if worker is not None:
            if meta.get("deletionTimestamp"):
                worker.mark_deleting(pod)
            return
        if meta.get("deletionTimestamp"):
            # Deleted before it ran here (or it finished while the agent was away).
            worker = PodWorker(self, node, pod)
            if phase not in ("Succeeded", "Failed"):
                await worker.report(terminal=True)
            node.ips.discard(worker.ip)
            await self.delete_pod(node, worker.namespace, worker.name, uid)
            return
        if phase in ("Succeeded", "Failed"):
            return
        worker = PodWorker(self, node, pod)
        node.pods[uid] = worker
        worker.task = asyncio.create_task(self.supervise(node, worker), name=f"pod {worker.namespace}/{worker.name}")

    async def supervise(self, node: Node, worker: PodWorker) -> None:
        try:
            await worker.run()
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("pod %s/%s failed in the node agent", worker.namespace, worker.name)
            worker.signal(signal.SIGKILL)  # never leave a process nobody supervises
        finally:
            if node.pods.get(worker.uid) is worker and not self.closed:
                del node.pods[worker.uid]
                node.ips.discard(worker.ip)
                for key in [key for key in self.events if key[1] == worker.uid]:
                    del self.events[key]

    # -- the agent ---------------------------------------------------------------------------

    def make_node(self, index: int, name: str) -> Node:
        scratch = self.run_dir / "nodes" / name
        tmpfs = self.tmpfs_root / name
        scratch.mkdir(parents=True, exist_ok=True)
        tmpfs.mkdir(parents=True, exist_ok=True)
        credentials = api.load_credentials(self.kubeconfig, node=name, scratch=self.run_dir / "nodeagent-credentials")
        return Node(name=name, index=index, api=api.Api(credentials), scratch=scratch, tmpfs=tmpfs)

    async def run(self) -> None:
        """Register the nodes, then keep them and run their pods until cancelled."""
        for index, name in enumerate(self.node_names):
            if name not in self.nodes:
                self.nodes[name] = self.make_node(index, name)
        await asyncio.gather(*(self.register(node) for node in self.nodes.values()))
        if self.closed:  # shut down while registering
            return
        for node in self.nodes.values():
            self.tasks += [
                asyncio.create_task(self.keep_lease(node), name=f"lease {node.name}"),
                asyncio.create_task(self.keep_status(node), name=f"status {node.name}"),
                asyncio.create_task(self.watch_pods(node), name=f"pods {node.name}"),
            ]
        try:
            await asyncio.gather(*self.tasks)
        finally:
            for task in self.tasks:
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)

    async def shutdown(self) -> None:
        """Stop as a node shutdown does (pkg/kubelet/nodeshutdown/nodeshutdown_manager_linux.go):
        stop supervising first, so that no container is restarted meanwhile, then give every
        container its grace period (``terminationGracePeriodSeconds``, preStop included) at once,
        and mark the pods Failed, "Terminated", as upstream does; they are not deleted. Upstream
        caps each grace by the shutdown's own period (``shutdownGracePeriod``); here there is none."""
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.closed = True
        workers = [worker for node in self.nodes.values() for worker in node.pods.values()]
        supervisors = [worker.task for worker in workers if worker.task is not None]
        for task in supervisors:
            task.cancel()
        await asyncio.gather(*supervisors, return_exceptions=True)

        async def stop(worker: PodWorker) -> None:
            worker.deadline = time.monotonic() + float(worker.spec.get("terminationGracePeriodSeconds", 30))
            try:
                async with asyncio.timeout(worker.remaining() + 10):
                    await worker.terminate(node_shutdown=True)
            except Exception as exc:  # the API server may be gone already: the processes matter
                logger.info("pod %s/%s: shutdown: %s", worker.namespace, worker.name, exc)
                worker.signal(signal.SIGKILL)

        await asyncio.gather(*(stop(worker) for worker in workers), return_exceptions=True)
        for node in self.nodes.values():
            node.pods.clear()
            await node.api.close()
        shutil.rmtree(self.tmpfs_root, ignore_errors=True)


def _configure(env: Mapping[str, str]) -> None:  # pragma: no cover - for ``python -m``
    logging.basicConfig(level=env.get("MEMOPS_NODEAGENT_LOG", "INFO"))


async def _main(argv: list[str]) -> None:  # pragma: no cover - for ``python -m``
    import argparse

    parser = argparse.ArgumentParser(description="The sandbox's node agent.")
    parser.add_argument("--kubeconfig", type=Path, required=True)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("nodes", nargs="+")
    args = parser.parse_args(argv)
    agent = NodeAgent(args.kubeconfig, args.nodes, args.run_dir)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    running = asyncio.create_task(agent.run())
    await asyncio.wait({running, asyncio.create_task(stop.wait())}, return_when=asyncio.FIRST_COMPLETED)
    running.cancel()
    try:
        await running
    except asyncio.CancelledError:
        pass
    finally:
        await agent.shutdown()


if __name__ == "__main__":  # pragma: no cover
    _configure(os.environ)
    asyncio.run(_main(sys.argv[1:]))
