"""A seeded fault soak on real Nodes: faults as they come, and what memops promises checked after each.

A workload keeps unique, unrecomputable data on every worker (scattered keys, topped up after
every step), keys of one prefix under a replication target (``rep``, two copies), and a
computation, under a MemoryPolicy with the eviction gate, pressure relief and a drain timeout;
the operator runs as the chart's two replicas. A schedule drawn from the seed injects, one per
step:

- ``scale``: ``spec.replicas`` of the policy changed (a GitOps edit; up or down by one);
- ``retire``: a RetirementRequest of one worker, with a deadline;
- ``operator-kill``: a scale-down, and the reconciling operator replica's pod deleted at once
  while its drain runs (its container SIGKILLed; the other replica takes over and resumes it);
- ``node-drain``: ``kubectl drain`` of the Node with the most workers (their evictions go through
  the gate), then ``kubectl uncordon``;
- ``scheduler-cut``: the operator cut off from the scheduler for 10 to 30 s (its replicas'
  packets to the scheduler's pod dropped on the Node, as a network partition drops them), with a
  scale-down under way: memops waits for the scheduler, and its drain carries on after;
- ``apiserver-restart``: the API server SIGKILLed while a scale-down drains (the sandbox starts
  it again, as a kubelet keeps a static pod; the operators' watches and writes fail meanwhile);
- ``worker-kill``: a worker's container SIGKILLed (abrupt: its unique keys may be lost);
- ``short-grace``: a worker pod deleted with a one-second grace period (abrupt, the same);
- ``oom-kill``: a task that takes more than the worker's container may hold at once: the kernel's
  OOM killer kills the worker process, and its nanny starts another (abrupt);
- ``nanny-kill``: a task whose memory grows as a leak does, until the nanny kills its worker at
  95% of the memory limit, before the kernel would (abrupt).

After each step, once the workload has settled, it checks: no key lost except on a worker killed
abruptly in that step; the policy's ``status.workerLosses`` records every such loss with its count
of irreplaceable keys; every RetirementRequest ends by its deadline; a step's change of
``spec.replicas`` makes one scale-down request at most (a replica that took over resumed the drain
rather than starting a second); every worker pod carries the
safety net's preStop hook (the webhooks answered while a replica was down); the operator's memory.
The table at the end has a row per fault; the exit status is 1 if any check failed.

    python bench/soak.py --seed 36 --minutes 2     # the seed CI runs (.ci/run, after the tests)
    python bench/soak.py --seed 7 --minutes 30     # the table in docs/performance.md

"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time
from typing import Any

import benchkit
import distributed
import psutil
from memops_sandbox import install
from memops_sandbox import nodes as real_nodes
from memops_sandbox.common import SCHEDULER

from memops.decisions import objects

WORKERS = 4
KEYS_PER_WORKER = 2
SIZE = 64 * 1024
POLICY = "soak"
ABRUPT = ("worker-kill", "short-grace", "oom-kill", "nanny-kill")
FAULTS = ("scale", "retire", "operator-kill", "node-drain", "scheduler-cut", "apiserver-restart", *ABRUPT)
CUT_SECONDS = (10.0, 30.0)
MiB = 2**20
WORKER_LIMIT = 1024 * MiB
"""The sandbox's worker containers' memory limit, which is also Dask's (``--memory-limit 1.0``)."""
SETTLE_SECONDS = 240.0
RETIRE_TIMEOUT = 90


@dataclasses.dataclass
class Row:
    """One fault's figures over the run."""

    injected: int = 0
    keys_lost: int = 0
    lost_unexplained: int = 0
    losses_recorded: int = 0
    losses_unrecorded: int = 0
    replicated_lost_before_copied: int = 0
    seconds: float = 0.0


@dataclasses.dataclass
class Soak:
    box: benchkit.Sandbox
    client: distributed.Client
    rng: random.Random
    replicas: int = WORKERS
    keys: dict[str, distributed.Future] = dataclasses.field(default_factory=dict)
    """Unique key -> its future (where it is, the scheduler says: keys move)."""
    replicated: dict[str, distributed.Future] = dataclasses.field(default_factory=dict)
    rows: dict[str, Row] = dataclasses.field(default_factory=lambda: collections.defaultdict(Row))
    failures: list[str] = dataclasses.field(default_factory=list)
    lost_by_pod: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    requests: dict[str, float] = dataclasses.field(default_factory=dict)
    """RetirementRequest -> its deadline (epoch seconds)."""
    rss: list[int] = dataclasses.field(default_factory=list)
    computation: list[distributed.Future] = dataclasses.field(default_factory=list)
    step: int = 0

    def kubectl(self, *args: str, stdin: str | None = None) -> str:
        return benchkit.kubectl(self.box.env, *args, stdin=stdin)

    def get(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json"))

    def worker_pods(self) -> list[dict[str, Any]]:
        items = self.get("pods", "-l", "app=dask-worker")["items"]
        return [p for p in items if not p["metadata"].get("deletionTimestamp")]

    def top_up(self) -> None:
        """Unique keys on every worker, replicated keys anywhere, and a computation running."""
        for pod, address in benchkit.workers(self.client).items():
            for i in range(KEYS_PER_WORKER):
                key = f"u-{self.step}-{pod}-{i}"
                future = self.client.scatter({key: os.urandom(SIZE)}, workers=[address], hash=False)[key]
                self.keys[key] = future
        for i in range(2):
            key = f"rep-{self.step}-{i}"
            self.replicated[key] = self.client.scatter({key: os.urandom(SIZE)}, hash=False)[key]
        self.computation = self.client.map(_work, range(200), pure=False)

    def policy(self) -> dict[str, Any]:
        return dict(self.get("mempol", POLICY))

    def operator_pods(self) -> list[dict[str, Any]]:
        items = self.get("pods", "-n", install.NAMESPACE, "-l", benchkit.OPERATOR)["items"]
        return [p for p in items if not p["metadata"].get("deletionTimestamp")]

    def leader(self) -> dict[str, Any] | None:
        """The operator replica that reconciles: the live peer of the highest priority."""
        peers = (self.get("clusterkopfpeering", "memops").get("status") or {}).items()
        names = {p["metadata"]["name"]: p for p in self.operator_pods()}
        ranked = sorted(((r.get("priority", 0), name) for name, r in peers if name in names), reverse=True)
        return names[ranked[0][1]] if ranked else None

    def sigkill(self, pod: dict[str, Any]) -> None:
        """SIGKILL the pod's container (its process group): the kubelet restarts it. The pod's
        status may still name a container killed a moment ago: read again until it names the
        running one."""
        name, namespace = pod["metadata"]["name"], pod["metadata"]["namespace"]
        for _ in range(60):
            statuses = pod["status"].get("containerStatuses") or []
            if statuses and statuses[0].get("containerID"):
                try:
                    os.killpg(real_nodes.container_pid(statuses[0]["containerID"]), signal.SIGKILL)
                    return
                except LookupError:
                    pass
            time.sleep(1)
            pod = self.get("pod", "-n", namespace, name)
        raise RuntimeError(f"{namespace}/{name} has no running container to kill")

    def kill_operator_pod(self, pod: dict[str, Any]) -> None:
        """A crashed replica: its pod deleted at once (the kubelet SIGKILLs its container), and
        the Deployment starts another. Not its container killed in place: the kubelet would
        restart that one with a back-off that doubles on every kill, and a soak that kills the
        leader every minute or two has both replicas in CrashLoopBackOff within ten minutes
        (seen: every webhook then goes unanswered, a pod created meanwhile gets no preStop hook),
        which is an outage of the operator, not a crash of one replica."""
        self.kubectl(
            "delete",
            "pod",
            "-n",
            install.NAMESPACE,
            pod["metadata"]["name"],
            "--grace-period=0",
            "--force",
            "--wait=false",
        )

    def scale(self, replicas: int) -> None:
        self.replicas = replicas
        patch = json.dumps({"spec": {"replicas": replicas}})
        self.kubectl("patch", f"mempol/{POLICY}", "--type=merge", "-p", patch)

    def inject(self, fault: str) -> set[str]:
        """Inject ``fault``; the pods killed abruptly (whose unique keys may be lost)."""
        pods = self.worker_pods()
        victim = self.rng.choice(pods)
        name = victim["metadata"]["name"]
        if fault == "scale":
            up = self.replicas <= 2 or (self.replicas < WORKERS + 1 and self.rng.random() < 0.5)
            self.scale(self.replicas + (1 if up else -1))
        elif fault == "retire":
            request = f"r-{self.step}"
            self.kubectl("apply", "-f", "-", stdin=json.dumps(retirement(request, self.box.address, name)))
            self.requests[request] = time.time() + RETIRE_TIMEOUT + 30
        elif fault == "operator-kill":
            self.scale(max(2, self.replicas - 1) if self.replicas > 2 else self.replicas + 1)
            time.sleep(self.rng.uniform(0.5, 2.0))  # the drain has started (or is about to)
            leader = self.leader()
            if leader is not None:
                self.kill_operator_pod(leader)
        elif fault == "node-drain":
            self.drain_busiest(pods)
        elif fault == "worker-kill":
            self.sigkill(victim)
            return {name}
        elif fault == "short-grace":
            self.kubectl("delete", "pod", name, "--grace-period=1", "--wait=false")
            return {name}
        elif fault in ("oom-kill", "nanny-kill"):
            self.exhaust(name, at_once=fault == "oom-kill")
            return {name}
        elif fault == "scheduler-cut":
            self.cut_scheduler()
        elif fault == "apiserver-restart":
            self.restart_api_server()
        return set()

    def restart_api_server(self) -> None:
        """A scale-down of one worker, and 0.5 to 2 s later the API server SIGKILLed; until it
        answers again (the sandbox starts it again at once)."""
        self.scale(self.replicas - 1 if self.replicas > 2 else self.replicas + 1)
        time.sleep(self.rng.uniform(0.5, 2.0))
        pid = int((self.box.state / "logs" / "kube-apiserver.pid").read_text())
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if self.kubectl("get", "--raw", "/readyz") == "ok":
                    return
            except subprocess.CalledProcessError:
                pass
            time.sleep(1)
        self.failures.append(f"step {self.step}: the API server did not answer again within 120 s")

    def exhaust(self, pod: str, *, at_once: bool) -> None:
        """A task on ``pod``'s worker that takes more memory than it may hold: at once (the
        kernel's OOM kill) or as a leak grows (the nanny's). It takes memory in that worker
        process only (its pid): if the worker that its nanny starts after the kill runs it again,
        it returns at once."""
        address = benchkit.workers(self.client)[pod]
        pid = self.pid(address)
        task = _allocate if at_once else _grow
        future = self.client.submit(task, pid, workers=[address], allow_other_workers=False, pure=False, priority=100)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and self.pid(address) == pid:
            time.sleep(0.5)
        self.client.cancel(future)
        if self.pid(address) == pid:
            self.failures.append(f"step {self.step}: {pod}'s worker was not killed within 60 s: no fault")

    def pid(self, address: str) -> int | None:
        """The pid of the worker process at ``address``; None once it is gone."""
        try:
            answer = self.client.run(os.getpid, workers=[address], on_error="return").get(address)
        except (OSError, KeyError, distributed.TimeoutError):
            return None
        return answer if isinstance(answer, int) else None

    def cut_scheduler(self) -> None:
        """The operator's replicas cannot reach the scheduler's pod for 10 to 30 s (their packets
        dropped on the Node: pod-to-pod traffic, bridged or routed, passes the host's FORWARD
        chain), while a scale-down of one worker is under way."""
        [scheduler] = self.get("pods", "-l", f"app={SCHEDULER}")["items"]
        operators = [p["status"]["podIP"] for p in self.operator_pods() if p["status"].get("podIP")]
        rules = [["FORWARD", "-s", ip, "-d", scheduler["status"]["podIP"], "-j", "DROP"] for ip in operators]
        for rule in rules:
            subprocess.run(["iptables", "-w", "-I", *rule], check=True)
        try:
            self.scale(self.replicas - 1 if self.replicas > 2 else self.replicas + 1)
            time.sleep(self.rng.uniform(*CUT_SECONDS))
        finally:
            for rule in rules:
                subprocess.run(["iptables", "-w", "-D", *rule], check=False)

    def drain_busiest(self, pods: list[dict[str, Any]]) -> None:
        """``kubectl drain`` of the Node with the most workers, as an administrator drains one:
        cordoned first, and where every worker is on it, one more worker first (on another Node),
        so that its workers' data has somewhere to go (else the gate keeps them, rightly, and the
        drain waits: tests/e2e/test_eviction.py has that case)."""
        node = collections.Counter(p["spec"].get("nodeName") for p in pods).most_common(1)[0][0]
        self.kubectl("cordon", node)
        try:
            if all(p["spec"].get("nodeName") == node for p in pods):
                self.scale(self.replicas + 1)
                self.settle()
            self.kubectl("drain", node, "--pod-selector=app=dask-worker", "--ignore-daemonsets", "--timeout=240s")
        except subprocess.CalledProcessError as error:
            self.failures.append(f"step {self.step}: kubectl drain {node} failed: {error.stderr.strip()[-300:]}")
        finally:
            self.kubectl("uncordon", node)

    def settle(self) -> None:
        """Until the policy's count of workers runs, each connected, no drain is in flight, and
        both operator replicas are Ready (each fault meets a whole operator)."""
        deadline = time.monotonic() + SETTLE_SECONDS
        while time.monotonic() < deadline:
            pods = self.worker_pods()
            requests = self.get("retire")["items"]
            busy = [r for r in requests if (r.get("status") or {}).get("phase") not in ("Succeeded", "Failed")]
            connected = benchkit.workers(self.client)
            names = {p["metadata"]["name"] for p in pods}
            ready = [p for p in self.operator_pods() if _ready(p)]
            if len(pods) == self.replicas and names <= set(connected) and not busy and len(ready) == 2:
                return
            time.sleep(0.5)
        self.failures.append(f"step {self.step}: not settled within {SETTLE_SECONDS:.0f} s")

    def check_keys(self, fault: str, abrupt: set[str], before: dict[str, set[str]]) -> None:
        """Keys lost in this step: allowed only where every worker that held the key before the
        fault (``before``: key -> pods) was killed abruptly in it (keys move: a drain, relief)."""
        held = self.holders(self.keys)
        row = self.rows[fault]
        for key in [k for k in self.keys if not held.get(k)]:
            del self.keys[key]
            row.keys_lost += 1
            where = before.get(key, set())
            for pod in where:
                self.lost_by_pod[pod] += 1
            if not where or not where <= abrupt:
                row.lost_unexplained += 1
                self.failures.append(
                    f"step {self.step} ({fault}): {key} lost, held before by {sorted(where)}, not killed abruptly"
                )
        replicated = self.holders(self.replicated)
        for key in [k for k in self.replicated if not replicated.get(k)]:
            del self.replicated[key]
            where = before.get(key, set())
            if where <= abrupt:
                row.replicated_lost_before_copied += 1  # killed before the second copy was made
            else:
                self.failures.append(f"step {self.step} ({fault}): {key} lost, held before by {sorted(where)}")

    def holders(self, futures: dict[str, distributed.Future]) -> dict[str, set[str]]:
        """Key -> the pods whose workers hold it. A future whose key was lost is cancelled (the
        scheduler forgot it); the others are asked about as futures (for keys given as strings
        the scheduler answers nothing)."""
        alive = [f for f in futures.values() if f.status == "finished"]
        who_has = self.client.who_has(alive) if alive else {}
        pods = {address: pod for pod, address in benchkit.workers(self.client).items()}
        return {key: {pods.get(a, a) for a in who_has.get(key) or ()} for key in futures}

    def snapshot(self) -> dict[str, set[str]]:
        """Where every tracked key is, before a fault."""
        return {**self.holders(self.keys), **self.holders(self.replicated)}

    def check_losses(self, fault: str, abrupt: set[str], lost_before: dict[str, int]) -> None:
        """Each abrupt kill that lost keys is in status.workerLosses with at least those keys."""
        row = self.rows[fault]
        deadline = time.monotonic() + 60
        for pod in abrupt:
            if self.lost_by_pod[pod] == lost_before.get(pod, 0):
                continue  # nothing lost in this step (a loss of an earlier kill is not counted again)
            while True:
                losses = (self.policy().get("status") or {}).get("workerLosses") or []
                recorded = sum(int(e.get("irreplaceableKeys", 0)) for e in losses if e.get("pod") == pod)
                if recorded >= self.lost_by_pod[pod] or time.monotonic() > deadline:
                    break
                time.sleep(1)
            if recorded >= self.lost_by_pod[pod]:
                row.losses_recorded += 1
            else:
                row.losses_unrecorded += 1
                self.failures.append(
                    f"step {self.step} ({fault}): {pod} lost {self.lost_by_pod[pod]} keys, status.workerLosses"
                    f" records {recorded}"
                )

    def scale_downs(self) -> set[str]:
        """The policy's scale-down requests (each carries the time of its scale event)."""
        items = self.get("retire", "-l", f"{objects.POLICY_LABEL}={POLICY}")["items"]
        marked = [r for r in items if objects.SCALE_EVENT_ANNOTATION in (r["metadata"].get("annotations") or {})]
        return {r["metadata"]["name"] for r in marked}

    def check_one_drain(self, fault: str, before: set[str]) -> None:
        """A step changes ``spec.replicas`` by one at most: one scale-down request at most, however
        many replicas of the operator or API servers came and went meanwhile."""
        made = sorted(self.scale_downs() - before)
        if len(made) > 1:
            self.failures.append(f"step {self.step} ({fault}): {len(made)} scale-downs for one: {made}")

    def check_requests(self) -> None:
        for request, deadline in list(self.requests.items()):
            status = self.get("retire", request).get("status") or {}
            if status.get("phase") in ("Succeeded", "Failed"):
                del self.requests[request]
            elif time.time() > deadline:
                del self.requests[request]
                self.failures.append(f"{request} not ended by its deadline: {status.get('phase')}")

    def check_safety_net(self) -> None:
        for pod in self.worker_pods():
            [container, *_] = pod["spec"]["containers"]
            if not (container.get("lifecycle") or {}).get("preStop"):
                self.failures.append(f"step {self.step}: {pod['metadata']['name']} has no preStop hook")

    def sample_memory(self) -> None:
        for pod in self.operator_pods():
            statuses = pod["status"].get("containerStatuses") or []
            if statuses and statuses[0].get("containerID") and statuses[0].get("ready"):
                try:  # a container restarted a moment ago: no sample this time
                    process = psutil.Process(real_nodes.container_pid(statuses[0]["containerID"]))
                    self.rss.append(sum(p.memory_info().rss for p in [process, *process.children(recursive=True)]))
                except (LookupError, psutil.NoSuchProcess):
                    continue


def _ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def retirement(name: str, address: str, pod: str) -> dict[str, Any]:
    return {
        "apiVersion": "memops.dev/v1alpha1",
        "kind": "RetirementRequest",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "scheduler": {"address": address},
            "workload": {"kind": "Deployment", "name": "dask-worker"},
            "workers": [pod],
            "timeout": f"{RETIRE_TIMEOUT}s",
        },
    }


def _work(i: int) -> int:
    time.sleep(0.02)
    return i


def _allocate(pid: int) -> int:
    """In the worker process ``pid`` only: 1.5 times its container's limit at once (a bytearray is
    written as it is made), faster than the nanny looks (every 100 ms)."""
    if os.getpid() != pid:
        return 0
    return len(bytearray(WORKER_LIMIT * 3 // 2))


def _grow(pid: int) -> int:
    """In the worker process ``pid`` only: 16 MiB more every 0.2 s, as a leak grows, until the
    nanny kills the process at 95% of its memory limit (or, unkilled, 30 s have passed)."""
    if os.getpid() != pid:
        return 0
    held, end = [], time.monotonic() + 30
    while time.monotonic() < end:
        held.append(bytearray(16 * MiB))
        time.sleep(0.2)
    return len(held)


def run_steps(soak: Soak, minutes: float) -> None:
    end = time.monotonic() + minutes * 60
    reported = 0
    while time.monotonic() < end:
        soak.step += 1
        soak.top_up()
        soak.sample_memory()
        fault = soak.rng.choice(FAULTS)
        started = time.monotonic()
        print(f"step {soak.step}: {fault}", flush=True)
        before, drains = soak.snapshot(), soak.scale_downs()
        single = sum(1 for k in soak.replicated if len(before.get(k, ())) < 2 and not k.startswith(f"rep-{soak.step}-"))
        if single:  # older than this step's top-up, yet not copied twice: the target is behind
            print(f"  {single} of the earlier replicated keys have one copy", flush=True)
        abrupt = soak.inject(fault)
        soak.settle()
        soak.rows[fault].injected += 1
        soak.rows[fault].seconds += time.monotonic() - started
        lost, lost_before = soak.rows[fault].keys_lost, dict(soak.lost_by_pod)
        soak.check_keys(fault, abrupt, before)
        print(f"  {soak.rows[fault].keys_lost - lost} keys lost; abrupt: {sorted(abrupt)}", flush=True)
        soak.check_losses(fault, abrupt, lost_before)
        soak.check_requests()
        soak.check_one_drain(fault, drains)
        soak.check_safety_net()
        for failure in soak.failures[reported:]:
            print(f"  check failed: {failure}", flush=True)
        reported = len(soak.failures)
    soak.sample_memory()


def table(soak: Soak, seed: int, minutes: float) -> str:
    lines = [
        f"Fault soak, seed {seed}, {minutes:g} minutes, {soak.step} steps ({WORKERS} workers, 2 operator replicas)",
        "",
        "| fault | injected | keys lost | lost, unexplained | losses recorded | losses unrecorded"
        " | replicated keys lost before their second copy | mean s to settle |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for fault in FAULTS:
        row = soak.rows.get(fault) or Row()
        mean = row.seconds / row.injected if row.injected else 0.0
        lines.append(
            f"| {fault} | {row.injected} | {row.keys_lost} | {row.lost_unexplained} | {row.losses_recorded}"
            f" | {row.losses_unrecorded} | {row.replicated_lost_before_copied} | {mean:.1f} |"
        )
    if soak.rss:
        lines.append(
            f"\n- operator memory (RSS of its container): first {soak.rss[0] / 2**20:.0f} MiB,"
            f" largest {max(soak.rss) / 2**20:.0f} MiB, last {soak.rss[-1] / 2**20:.0f} MiB"
        )
    lines.append(f"- checks failed: {len(soak.failures)}")
    lines += [f"  - {failure}" for failure in soak.failures]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--minutes", type=float, default=2.0)
    options = parser.parse_args()
    with benchkit.running_sandbox(WORKERS) as box:
        benchkit.kubectl(box.env, "scale", "-n", install.NAMESPACE, "deployment/memops", "--replicas=2")
        benchkit.apply_policy(
            box,
            POLICY,
            replicas=WORKERS,
            drain={"timeout": "60s"},
            eviction={"gate": True},
            pressure={"relieveAbove": "80%", "relieveTo": "65%"},
            replication={"rules": [{"keys": {"prefix": "rep"}, "replicas": 2}], "maxReplicatedFraction": 0.5},
        )
        # The workers' pods again, now that the policy is there: the safety net's hook is in them.
        benchkit.kubectl(box.env, "rollout", "restart", "deployment/dask-worker")
        benchkit.kubectl(box.env, "rollout", "status", "deployment/dask-worker", "--timeout=300s")
        benchkit.kubectl(box.env, "rollout", "status", "-n", install.NAMESPACE, "deployment/memops", "--timeout=300s")
        with distributed.Client(box.address, timeout=30) as client:
            soak = Soak(box, client, random.Random(options.seed))
            soak.settle()
            run_steps(soak, options.minutes)
            print(table(soak, options.seed, options.minutes))
            return 1 if soak.failures else 0


if __name__ == "__main__":
    sys.exit(main())
