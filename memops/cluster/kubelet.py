"""A local kubelet: every Pod of the emulated cluster runs as a real process on this machine.

Used by the sandbox and the end-to-end tests. It does what the kubelet does for what memops
relies on, and says where it differs:

- a pod's single container runs its ``command`` + ``args`` (there are no images: the
  command must be on PATH; this environment's own scripts come first), with ``env`` and
  ``valueFrom.fieldRef`` (``metadata.name`` and friends), ``valueFrom.secretKeyRef`` (from
  the Secret in the pod's namespace, as the kubelet resolves it when the container starts) and
  ``$(VAR)`` expansion;
- status: phase, ``Ready`` and the other pod conditions, ``containerStatuses`` with
  ``restartCount``; ``Ready`` when the process runs, or when its exec readinessProbe passes;
- each pod its own IP, from :data:`POD_NETWORK`, in ``status.podIP``/``podIPs`` before its
  container starts (so ``fieldRef: status.podIP`` works, as it does once the CNI has given the
  sandbox its address); released when the pod is gone, and handed out again only after the
  rest of the range, as a cluster's IPAM avoids reusing an address at once;
- ``restartPolicy: Always``: an exited container is restarted, after a back-off (upstream
  starts at 10 s and doubles to 5 min; here 0.5 s to 5 s, so tests do not wait);
- exec hooks and exec probes run as ``kubectl exec`` would run them in the container: with
  exactly the container's environment, PATH and working directory (:meth:`PodRuntime.exec_options`,
  the one function that ``_start`` uses too), never the node agent's own;
- deletion, as ``killContainer`` does it: the ``preStop`` exec hook, then SIGTERM to the
  container's process group, then SIGKILL when the grace period runs out; then the pod object
  is removed (the kubelet's final delete with grace period 0). A hook that fails (non-zero exit,
  or cannot start) is reported as upstream does, and changes nothing else: see
  :func:`failed_pre_stop_event`.

Each container's output goes to ``RUN_DIR/pods/<namespace>_<name>.log`` and its process id to
``…pid``, so that tests can signal a pod's processes the way a crash or an OOM kill would.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import ipaddress
import logging
import os
import re
import signal
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from memops.cluster.store import Store

Obj = dict[str, Any]
logger = logging.getLogger(__name__)

_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")
_FIELD_PATHS: dict[str, Callable[[Obj], str]] = {
    "metadata.name": lambda pod: pod["metadata"]["name"],
    "metadata.namespace": lambda pod: pod["metadata"].get("namespace", ""),
    "metadata.uid": lambda pod: pod["metadata"].get("uid", ""),
    "spec.nodeName": lambda pod: pod.get("spec", {}).get("nodeName", ""),
    "status.podIP": lambda pod: str(pod.get("status", {}).get("podIP", "")),
    "status.podIPs": lambda pod: ",".join(str(e["ip"]) for e in pod.get("status", {}).get("podIPs", [])),
    "status.hostIP": lambda pod: str(pod.get("status", {}).get("hostIP", "")),
}
HOST_IP = "127.0.0.1"
POD_NETWORK = ipaddress.ip_network("127.1.0.0/16")
"""Pod IPs: each pod gets its own loopback address (127.0.0.0/8 routes to ``lo`` on Linux), so
that, as on a cluster, a pod's IP tells it apart from every other pod's."""


MINIMUM_GRACE_SECONDS = 2.0
"""After the preStop hook, the container gets at least this long between SIGTERM and SIGKILL.

Upstream ``killContainer`` (kubernetes ``pkg/kubelet/kuberuntime/kuberuntime_container.go``):
``gracePeriod = gracePeriod - m.executePreStopHook(...)``, then "always give containers a
minimal shutdown window to avoid unnecessary SIGKILLs": ``if gracePeriod <
minimumGracePeriodInSeconds { gracePeriod = minimumGracePeriodInSeconds }`` (2), then
``StopContainer`` (SIGTERM, and SIGKILL when that runs out). Whether the hook failed plays no part.
"""

FAILED_PRE_STOP_HOOK = "FailedPreStopHook"
"""Upstream's event reason (``pkg/kubelet/events/event.go``: ``FailedPreStopHook = "FailedPreStopHook"``)."""


def failed_pre_stop_event(pod: Obj, container_name: str, node_name: str, now: str) -> Obj:
    """The Event the kubelet records when a container's preStop hook fails.

    Upstream ``executePreStopHook`` (``pkg/kubelet/kuberuntime/kuberuntime_container.go``):
    ``m.recordContainerEvent(pod, containerSpec, containerID.ID, v1.EventTypeWarning,
    events.FailedPreStopHook, "PreStopHook failed")``, with the comment "do not record the
    message in the event so that secrets won't leak from the server": the hook's output stays
    out of the event. ``recordContainerEvent`` refers to the container by the pod plus
    ``fieldPath: spec.containers{<name>}``; the source is the kubelet on the pod's node.
    """
    meta = pod["metadata"]
    namespace = meta.get("namespace") or "default"
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": namespace},
        "involvedObject": {
            "apiVersion": "v1",
            "kind": "Pod",
            "namespace": namespace,
            "name": meta["name"],
            "uid": meta.get("uid", ""),
            "fieldPath": f"spec.containers{{{container_name}}}",
        },
        "type": "Warning",
        "reason": FAILED_PRE_STOP_HOOK,
        "message": "PreStopHook failed",
        "source": {"component": "kubelet", "host": node_name},
        "reportingComponent": "kubelet",
        "reportingInstance": node_name,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }


def _now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def expand(text: str, variables: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: ``$$`` escapes, unknown references stay as written."""

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return variables.get(name, match.group(0))

    return _REFERENCE.sub(replace, text)


def container_env(
    pod: Obj, container: Obj, secret: Callable[[str], Obj | None] = lambda name: None
) -> dict[str, str]:
    """The container's environment, each value expanded against the ones defined before it.

    ``secret(name)`` finds a Secret in the pod's namespace; a missing Secret or key fails the
    container's start, as the kubelet's CreateContainerConfigError does.
    """
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "secretKeyRef" in item.get("valueFrom", {}):
            ref = item["valueFrom"]["secretKeyRef"]
            data = (secret(ref["name"]) or {}).get("data") or {}
            if ref["key"] not in data:
                raise ValueError(f"env {item['name']}: secret {ref['name']!r} has no key {ref['key']!r}")
            env[item["name"]] = base64.b64decode(data[ref["key"]]).decode()
        elif "valueFrom" in item:
            path = item["valueFrom"].get("fieldRef", {}).get("fieldPath", "")
            if path not in _FIELD_PATHS:
                raise ValueError(f"env {item['name']}: only fieldRef {sorted(_FIELD_PATHS)} are emulated")
            env[item["name"]] = str(_FIELD_PATHS[path](pod))
        else:
            env[item["name"]] = expand(str(item.get("value", "")), env)
    return env


class PodRuntime:
    """One pod's container process, restarts and termination."""

    def __init__(self, kubelet: Kubelet, pod: Obj):
        self.kubelet = kubelet
        self.namespace = pod["metadata"].get("namespace")
        self.name = pod["metadata"]["name"]
        self.pod = pod
        self.deleting = asyncio.Event()
        self.process: asyncio.subprocess.Process | None = None
        self.restarts = 0
        self.ready = False
        self.task: asyncio.Task[None] | None = None
        self.ip = ""

    @property
    def files(self) -> Path:
        return self.kubelet.run_dir / "pods" / f"{self.namespace}_{self.name}"

    async def run(self) -> None:
        self.ip = self.kubelet.allocate_ip()
        # The sandbox's address first, as the kubelet reports it once the CNI has set it up.
        await self._patch_status(
            {"phase": "Pending", "hostIP": HOST_IP, "podIP": self.ip, "podIPs": [{"ip": self.ip}]}
        )
        try:
            container = self.pod["spec"]["containers"][0]
            env = container_env(
                self.pod, container, lambda name: self.kubelet.store.get("secrets", self.namespace, name)
            )
            argv = [expand(part, env) for part in [*container.get("command", []), *container.get("args", [])]]
            if not container.get("command"):
                raise ValueError("the local kubelet has no images: containers[0].command is required")
        except (KeyError, IndexError, ValueError) as exc:
            await self._patch_status({"phase": "Failed", "reason": "CreateContainerError", "message": str(exc)})
            return
        backoff = 0.5
        while not self.deleting.is_set():
            started = await self._start(argv, env)
            if not started:
                return
            await self._report(running=True)
            probe = asyncio.create_task(self._probe(container, env))
            assert self.process is not None
            exited = asyncio.create_task(self.process.wait())
            deleting = asyncio.create_task(self.deleting.wait())
            await asyncio.wait({exited, deleting}, return_when=asyncio.FIRST_COMPLETED)
            probe.cancel()
            deleting.cancel()
            if self.deleting.is_set():
                exited.cancel()
                break
            code = self.process.returncode
            self.ready = False
            logger.info(
                "pod %s/%s: container exited with %s; restarting in %.1fs", self.namespace, self.name, code, backoff
            )
            await self._report(running=False, exit_code=code)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(backoff):  # not wait_for: it can lose a cancellation on 3.11
                    await self.deleting.wait()
            backoff = min(backoff * 2, 5.0)
            self.restarts += 1
        await self.terminate(container, env)

    def exec_options(self, env: Mapping[str, str]) -> dict[str, Any]:
        """How a process runs in this pod's container: the container itself, its exec hooks and
        its exec probes alike (the kubelet execs hooks and probes inside the container, so they
        see what the container sees). The environment is the whole of it, and its PATH is what
        finds the command (``subprocess`` resolves a bare name on the ``env`` it is given)."""
        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        container = self.pod["spec"]["containers"][0]
        return {"env": {**os.environ, **self.kubelet.env, "PATH": path, **env}, "cwd": container.get("workingDir")}

    async def _start(self, argv: list[str], env: Mapping[str, str]) -> bool:
        self.files.parent.mkdir(parents=True, exist_ok=True)
        with self.files.with_suffix(".log").open("ab") as log:
            try:
                self.process = await asyncio.create_subprocess_exec(
                    *argv, stdout=log, stderr=log, start_new_session=True, **self.exec_options(env)
                )
            except OSError as exc:
                await self._patch_status({"phase": "Failed", "reason": "StartError", "message": str(exc)})
                return False
        self.files.with_suffix(".pid").write_text(str(self.process.pid))
        return True

    async def _probe(self, container: Obj, env: Mapping[str, str]) -> None:
        probe = container.get("readinessProbe", {}).get("exec")
        if probe is None:
            self.ready = True  # no readiness probe: ready once the container runs
            await self._report(running=True)
            return
        period = float(container["readinessProbe"].get("periodSeconds", 1))
        while True:
            try:
                result = await asyncio.create_subprocess_exec(
                    *probe["command"],
                    stdout=asyncio.subprocess.DEVNULL,
                    stderr=asyncio.subprocess.DEVNULL,
                    **self.exec_options(env),
                )
                ready = await result.wait() == 0
            except OSError:
                ready = False  # a probe command that cannot start fails the probe
            if ready != self.ready:
                self.ready = ready
                await self._report(running=True)
            await asyncio.sleep(period)

    async def terminate(self, container: Obj, env: Mapping[str, str]) -> None:
        """preStop, SIGTERM, then SIGKILL at the end of the grace period; then remove the pod."""
        current = self.kubelet.store.get("pods", self.namespace, self.name) or self.pod
        grace = float(current["metadata"].get("deletionGracePeriodSeconds", 30))
        deadline = asyncio.get_running_loop().time() + grace
        pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
        if pre_stop and self._alive() and grace > 0:
            await self._pre_stop(pre_stop, container, env, grace)
        self._signal(signal.SIGTERM)
        if self.process is not None:
            remaining = deadline - asyncio.get_running_loop().time()
            if pre_stop:
                remaining = max(remaining, MINIMUM_GRACE_SECONDS)  # upstream's floor after a hook
            remaining = max(remaining, 0.0)
            try:
                await asyncio.wait_for(self.process.wait(), remaining)
            except TimeoutError:
                self._signal(signal.SIGKILL)
                await self.process.wait()
        self._signal(signal.SIGKILL)  # whatever the container left behind in its group
        self.files.with_suffix(".pid").unlink(missing_ok=True)
        with contextlib.suppress(Exception):
            await self.kubelet.store.delete("pods", self.namespace, self.name, grace_period_seconds=0)

    async def _pre_stop(self, command: list[str], container: Obj, env: Mapping[str, str], grace: float) -> None:
        """Run the hook for at most the grace period; report it if it fails, as the kubelet does.

        A hook that outlives the grace period is abandoned (here: killed) without an event, as
        upstream's ``executePreStopHook`` stops waiting for it; only an error from the hook's run
        (it exits non-zero, or cannot be started) becomes a ``FailedPreStopHook`` event.
        """
        try:
            hook = await asyncio.create_subprocess_exec(*command, **self.exec_options(env))
        except OSError as exc:
            logger.warning("pod %s/%s: preStop hook could not start: %s", self.namespace, self.name, exc)
            await self._record_failed_hook(container)
            return
        try:
            code = await asyncio.wait_for(hook.wait(), grace)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                hook.kill()
            return
        if code != 0:
            logger.warning("pod %s/%s: preStop hook exited with %s", self.namespace, self.name, code)
            await self._record_failed_hook(container)

    async def _record_failed_hook(self, container: Obj) -> None:
        event = failed_pre_stop_event(self.pod, str(container.get("name", "")), self.kubelet.node_name, _now())
        with contextlib.suppress(Exception):  # the kubelet's event recorder drops what it cannot send
            await self.kubelet.store.create("events", event["involvedObject"]["namespace"], event)

    def _alive(self) -> bool:
        return self.process is not None and self.process.returncode is None

    def _signal(self, sig: signal.Signals) -> None:
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, sig)

    async def _report(self, *, running: bool, exit_code: int | None = None) -> None:
        now = _now()
        ready = running and self.ready
        state: Obj = (
            {"running": {"startedAt": now}} if running else {"terminated": {"exitCode": exit_code, "finishedAt": now}}
        )
        status = {
            "phase": "Running",
            "hostIP": HOST_IP,
            "podIP": self.ip,
            "podIPs": [{"ip": self.ip}],
            "startTime": self.pod.get("status", {}).get("startTime") or now,
            "conditions": self._conditions(ready),
            "containerStatuses": [
                {
                    "name": self.pod["spec"]["containers"][0]["name"],
                    "ready": ready,
                    "started": running,
                    "restartCount": self.restarts,
                    "state": state,
                    "image": self.pod["spec"]["containers"][0].get("image", ""),
                }
            ],
        }
        await self._patch_status(status)

    def _conditions(self, ready: bool) -> list[Obj]:
        current = self.kubelet.store.get("pods", self.namespace, self.name) or self.pod
        previous = {c["type"]: c for c in current.get("status", {}).get("conditions", [])}
        values = {"PodScheduled": True, "Initialized": True, "ContainersReady": ready, "Ready": ready}
        result = []
        for kind, value in values.items():
            text = "True" if value else "False"
            old = previous.get(kind)
            since = old["lastTransitionTime"] if old and old.get("status") == text else _now()
            result.append({"type": kind, "status": text, "lastTransitionTime": since})
        return result

    async def _patch_status(self, status: Obj) -> None:
        with contextlib.suppress(Exception):  # the pod may be gone already
            updated = await self.kubelet.store.patch(
                "pods", self.namespace, self.name, {"status": status}, subresource="status"
            )
            self.pod = updated


class Kubelet:
    """Runs the pods of one node (``local``) until cancelled; then stops every process it started."""

    def __init__(self, store: Store, *, run_dir: Path, node_name: str = "local", env: Mapping[str, str] | None = None):
        self.store = store
        self.run_dir = Path(run_dir)
        self.node_name = node_name
        self.env = dict(env or {})
        self.pods: dict[tuple[str | None, str], PodRuntime] = {}
        self.ips_in_use: set[str] = set()
        self._last_ip = 0  # index in POD_NETWORK of the address handed out last

    def allocate_ip(self) -> str:
        """The next free address of :data:`POD_NETWORK` after the last one handed out."""
        size = POD_NETWORK.num_addresses - 2  # neither the network nor the broadcast address
        for step in range(1, size + 1):
            index = (self._last_ip + step - 1) % size + 1
            ip = str(POD_NETWORK[index])
            if ip not in self.ips_in_use:
                self._last_ip = index
                self.ips_in_use.add(ip)
                return ip
        raise RuntimeError(f"no free pod IP left in {POD_NETWORK}")

    async def run(self) -> None:
        events = self.store.watch()
        try:
            for pod in self.store.list("pods"):
                await self.sync(pod)
            async for event in events:
                if event.plural == "pods":
                    await self.sync(event.object, deleted=event.type == "DELETED")
        finally:
            await self.shutdown()

    async def sync(self, pod: Obj, *, deleted: bool = False) -> None:
        meta = pod["metadata"]
        key = (meta.get("namespace"), meta["name"])
        node = pod.get("spec", {}).get("nodeName")
        runtime = self.pods.get(key)
        if runtime is not None and runtime.pod["metadata"].get("uid") != meta.get("uid"):
            runtime = None  # a new pod with an old pod's name
        if deleted or meta.get("deletionTimestamp"):
            if runtime is not None:
                runtime.deleting.set()
            return
        if runtime is not None or (node and node != self.node_name):
            return
        if pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
            return
        if not node:
            # Binding a pod to a node is the scheduler's job; with one node there is no choice.
            pod = await self.store.patch(
                "pods", meta.get("namespace"), meta["name"], {"spec": {"nodeName": self.node_name}}
            )
        runtime = PodRuntime(self, pod)
        self.pods[key] = runtime
        runtime.task = asyncio.create_task(self._supervise(key, runtime))

    async def _supervise(self, key: tuple[str | None, str], runtime: PodRuntime) -> None:
        try:
            await runtime.run()
        except Exception:
            logger.exception("pod %s/%s failed in the local kubelet", *key)
        finally:
            self.ips_in_use.discard(runtime.ip)
            if self.pods.get(key) is runtime:
                del self.pods[key]

    async def shutdown(self) -> None:
        """Stop every container as a node shutdown does: SIGTERM, then SIGKILL after a short grace."""
        runtimes = list(self.pods.values())
        # Stop supervising first: a supervisor that saw its container exit would start it again.
        supervisors = [runtime.task for runtime in runtimes if runtime.task is not None]
        for task in supervisors:
            task.cancel()
        await asyncio.gather(*supervisors, return_exceptions=True)
        for runtime in runtimes:
            runtime._signal(signal.SIGTERM)

        async def stop(runtime: PodRuntime) -> None:
            if runtime.process is not None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(runtime.process.wait(), 10)
            runtime._signal(signal.SIGKILL)

        # All at once: the grace period is the node's, not each pod's in turn.
        await asyncio.gather(*(stop(runtime) for runtime in runtimes), return_exceptions=True)
