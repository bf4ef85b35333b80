"""A pod's status as the kubelet reports it, from what the node agent knows of its container: pure.

One container per pod (the node agent runs no init or sidecar containers). The rules are
upstream's, cited at each function; ``nodeagent`` keeps a ``Container`` per pod and patches
what ``pod_status`` returns.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

Obj = dict[str, Any]


def now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    """A MicroTime, as Leases and events.k8s.io want it."""
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class Container:
    """What the runtime knows of a pod's one container (CRI's ContainerStatus, in short)."""

    name: str
    image: str = ""
    state: str = "waiting"  # waiting | running | terminated
    reason: str = "ContainerCreating"
    message: str = ""
    started_at: str = ""
    finished_at: str = ""
    exit_code: int | None = None
    container_id: str = ""
    restart_count: int = 0
    ready: bool = False
    last_terminated: Obj | None = field(default=None)

    def api_state(self) -> Obj:
        if self.state == "running":
            return {"running": {"startedAt": self.started_at}}
        if self.state == "terminated":
            return {"terminated": self.terminated()}
        waiting: Obj = {"reason": self.reason}
        if self.message:
            waiting["message"] = self.message
        return {"waiting": waiting}

    def terminated(self) -> Obj:
        result: Obj = {
            "exitCode": self.exit_code if self.exit_code is not None else 0,
            "reason": self.reason,
            "startedAt": self.started_at or None,
            "finishedAt": self.finished_at,
            "containerID": self.container_id,
        }
        if self.message:
            result["message"] = self.message
        return result

    def api_status(self) -> Obj:
        """A containerStatuses entry (``convertToAPIContainerStatuses``, pkg/kubelet/kubelet_pods.go)."""
        status: Obj = {
            "name": self.name,
            "image": self.image,
            "imageID": "",
            "ready": self.ready and self.state == "running",
            # Without a startupProbe a container counts as started once it runs (prober_manager.go).
            "started": self.state == "running",
            "restartCount": self.restart_count,
            "state": self.api_state(),
            "lastState": {"terminated": self.last_terminated} if self.last_terminated else {},
        }
        if self.container_id:
            status["containerID"] = self.container_id
        return status


def exit_reason(code: int) -> str:
    """The runtime's reason for a terminated container: Completed for 0, Error otherwise."""
    return "Completed" if code == 0 else "Error"


def phase(restart_policy: str, container: Container, *, terminal: bool) -> str:
    """``getPhase`` (pkg/kubelet/kubelet_pods.go) for one container and no init containers.

    ``terminal`` is ``podIsTerminal``: the pod is being removed (deleted, or its node shuts down)
    and its container has stopped; then it ends Succeeded only if the container exited 0.
    """
    if container.state == "running":
        return "Running"
    if terminal:
        return "Succeeded" if container.state == "terminated" and container.exit_code == 0 else "Failed"
    stopped = container.state == "terminated" or (container.state == "waiting" and container.last_terminated)
    if not stopped:
        return "Pending"
    last = container.terminated() if container.state == "terminated" else container.last_terminated or {}
    succeeded = last.get("exitCode") == 0
    if restart_policy == "Always":
        return "Running"
    if restart_policy == "OnFailure":
        return "Succeeded" if succeeded and container.state == "terminated" else "Running"
    return "Succeeded" if succeeded else "Failed"


def conditions(previous: list[Obj], container: Container, pod_phase: str) -> list[Obj]:
    """PodReadyToStartContainers, Initialized, ContainersReady, Ready and the scheduler's
    PodScheduled (``GeneratePodReadyCondition`` and friends, pkg/kubelet/status/generate.go);
    ``lastTransitionTime`` moves only when a condition's status changes."""
    ready = container.ready and container.state == "running"
    not_ready: Obj = {
        "reason": "PodCompleted" if pod_phase == "Succeeded" else "ContainersNotReady",
        "message": "" if pod_phase == "Succeeded" else f"containers with unready status: [{container.name}]",
    }
    values: dict[str, tuple[bool, Obj]] = {
        "PodReadyToStartContainers": (pod_phase not in ("Succeeded", "Failed"), {}),
        "Initialized": (True, {}),
        "Ready": (ready, {} if ready else not_ready),
        "ContainersReady": (ready, {} if ready else not_ready),
        "PodScheduled": (True, {}),
    }
    old = {c.get("type"): c for c in previous}
    result = []
    for kind, (value, extra) in values.items():
        text = "True" if value else "False"
        before = old.get(kind)
        since = before.get("lastTransitionTime") if before and before.get("status") == text else None
        condition: Obj = {"type": kind, "status": text, "lastProbeTime": None, "lastTransitionTime": since or now()}
        condition.update({key: value for key, value in extra.items() if value})
        result.append(condition)
    return result


def pod_status(
    pod: Obj,
    container: Container,
    *,
    pod_ip: str,
    host_ip: str,
    start_time: str,
    terminal: bool = False,
    node_shutdown: bool = False,
) -> Obj:
    """The status the kubelet's ``generateAPIPodStatus`` (pkg/kubelet/kubelet_pods.go) would write.

    ``node_shutdown``: the pod was stopped by the node's shutdown; upstream's shutdown manager
    (``processShutdownEvent``, pkg/kubelet/nodeshutdown/nodeshutdown_manager.go) makes it
    Failed unless it had Succeeded, with reason Terminated and a DisruptionTarget condition.
    """
    spec = pod.get("spec") or {}
    previous = pod.get("status") or {}
    pod_phase = phase(str(spec.get("restartPolicy", "Always")), container, terminal=terminal or node_shutdown)
    pod_conditions = conditions(previous.get("conditions") or [], container, pod_phase)
    reason = message = ""
    if node_shutdown:
        pod_phase = "Succeeded" if previous.get("phase") == "Succeeded" else "Failed"
        reason, message = "Terminated", "Pod was terminated in response to imminent node shutdown."
        pod_conditions.append(
            {
                "type": "DisruptionTarget",
                "status": "True",
                "reason": "TerminationByKubelet",
                "message": message,
                "lastTransitionTime": now(),
            }
        )
    status: Obj = {
        "phase": pod_phase,
        "conditions": pod_conditions,
        "hostIP": host_ip,
        "hostIPs": [{"ip": host_ip}],
        "podIP": pod_ip,
        "podIPs": [{"ip": pod_ip}],
        "startTime": start_time,
        "qosClass": (pod.get("status") or {}).get("qosClass"),
        "containerStatuses": [container.api_status()],
    }
    if reason:
        status["reason"] = reason
        status["message"] = message
    return {key: value for key, value in status.items() if value is not None}
