"""Drain throughput: memops' RetirementRequest against stock ``retire_workers`` and the raw copy rate.

Each scenario retires N workers holding SIZE of unique data each, in keys of KEY bytes, three
ways in the same sandbox and the same run:

- TCP (anchor): the same number of bytes sent over one loopback TCP connection from this process to a
  receiving process that reads them into one reused buffer: what the machine's sockets carry with
  no Dask and no Python work per byte, the ceiling every drain here is a share of;
- raw (anchor): ``Client.replicate(n=2)`` of the same bytes, the scheduler telling other workers to
  copy them with no AMM in between (one ``get_data`` message per recipient and sender);
- stock (anchor): the scheduler's ``retire_workers`` of those N workers, called directly;
- memops: one RetirementRequest (``workers: [pod]`` for one worker, ``count: N`` for several),
  applied with kubectl; the operator drains with memops' drain where its agent runs (it does here);
- drain: memops' drain (``memops.scheduler.drain``) started directly at the scheduler through the
  agent (``dask_direct.start_drain``), polled until its workers are closed: the drain policy's own
  rate beside stock ``retire_workers``, without the operator and the API server around it.

Every phase is timed inside the workers, by a worker plugin that records when a key of the
phase goes into flight and reaches memory on its recipient: "drain" is first byte in flight ->
last key in memory, the same instrument for stock and memops; its rate is SIZE x N over it (raw has
no flight state: it is timed from the call to the last key in memory). The
client-side figures (call -> return, apply -> Succeeded) are in the second table. No key may
be lost: after each phase every key must be held by a worker that stays.

With ``count: N`` memops chooses the workers that hold the fewest unique bytes, so for N > 1
the other workers hold a ballast a little larger than SIZE (in both stock and memops phases).

    python bench/throughput.py                      # the matrix in docs/performance.md (15-20 min)
    python bench/throughput.py --small              # the small pass CI runs
    python bench/throughput.py --scenarios 1024:16384:1 --runs 5   # SIZE_MIB:KEY_KIB:N
    python bench/throughput.py --knobs              # stock retire of 1 GiB under Dask config knobs
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import dataclasses
import json
import multiprocessing
import os
import socket
import ssl
import statistics
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import benchkit
import cloudpickle
import distributed
import yaml
from distributed.diagnostics.plugin import SchedulerPlugin, WorkerPlugin
from memops_sandbox import dask_direct

MIB = 2**20
GIB = 2**30
SCATTER_BATCH = 256 * MIB  # the client holds at most this much of a fill at once
WORKERS = 4


class Api:
    """Just enough HTTP to poll the sandbox's API server without starting kubectl."""

    def __init__(self, kubeconfig: Path):
        config = yaml.safe_load(kubeconfig.read_text())
        cluster, user = config["clusters"][0]["cluster"], config["users"][0]["user"]
        self.server = cluster["server"]
        self.headers = {"Authorization": f"Bearer {user['token']}"} if "token" in user else {}
        self.context: ssl.SSLContext | None = None
        if "certificate-authority-data" in cluster:  # the upstream plane: TLS, a client certificate
            ca = base64.b64decode(cluster["certificate-authority-data"]).decode()
            self.context = ssl.create_default_context(cadata=ca)
            if "client-certificate-data" in user:
                pem = kubeconfig.with_name(kubeconfig.name + ".client.pem")
                parts = (base64.b64decode(user[key]) for key in ("client-certificate-data", "client-key-data"))
                pem.write_bytes(b"".join(parts))
                self.context.load_cert_chain(pem)

    def get(self, path: str) -> dict[str, Any] | None:
        request = urllib.request.Request(self.server + path, headers=self.headers)
        try:
            with urllib.request.urlopen(request, timeout=10, context=self.context) as response:
                result: dict[str, Any] = json.loads(response.read())
                return result
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise

    def wait_phase(self, path: str, name: str, phases: Sequence[str], timeout: float = 900) -> dict[str, Any]:
        """The object's status once its phase is one of ``phases``, from a watch (as ``kubectl
        wait`` does): nothing is asked of the API server while the drain runs, so that the
        memops phase loads the machine no more than the stock one, which just waits for its call."""
        query = urllib.parse.urlencode(
            {"watch": "true", "fieldSelector": f"metadata.name={name}", "timeoutSeconds": str(int(timeout))}
        )
        request = urllib.request.Request(f"{self.server}{path}?{query}", headers=self.headers)
        with urllib.request.urlopen(request, timeout=timeout, context=self.context) as response:
            for line in response:
                event = json.loads(line)
                status: dict[str, Any] = event.get("object", {}).get("status") or {}
                if status.get("phase") in phases:
                    return status
        raise RuntimeError(f"{name} did not reach {'/'.join(phases)} within {timeout:.0f} s")


class TransferClock(WorkerPlugin):
    """Records, on each worker, when keys of a benchmark phase go into flight and reach memory."""

    name = "memops-bench-transfer-clock"

    def __init__(self) -> None:
        self.events: list[tuple[float, str, str]] = []

    def transition(self, key: Any, start: str, finish: str, **kwargs: Any) -> None:
        if finish in ("flight", "memory") and str(key).startswith("tp-"):
            self.events.append((time.time(), str(key), finish))


class RemovalClock(SchedulerPlugin):
    """Records, in the scheduler, when each worker was removed: the moment its data is safe
    elsewhere and its pod may go, whoever retired it (stock, memops' drain, the operator)."""

    name = "memops-bench-removal-clock"

    def __init__(self) -> None:
        self.removed: dict[str, float] = {}

    def remove_worker(self, scheduler: Any, worker: str, **kwargs: Any) -> None:
        self.removed[worker] = time.time()


def _removed(dask_scheduler: Any = None) -> dict[str, float]:
    return dict(dask_scheduler.plugins[RemovalClock.name].removed)


def removed(client: distributed.Client, addresses: Sequence[str], since: float) -> float:
    """Seconds from ``since`` to the last of ``addresses`` removed from the scheduler."""
    times: dict[str, float] = client.run_on_scheduler(_removed)
    missing = [a for a in addresses if a not in times]
    if missing:
        raise RuntimeError(f"the scheduler did not remove {missing}")
    return max(times[a] for a in addresses) - since


def _take_events(dask_worker: Any = None) -> list[tuple[float, str, str]]:
    plugin = dask_worker.plugins[TransferClock.name]
    events, plugin.events = plugin.events, []
    return list(events)


@dataclass(frozen=True)
class Scenario:
    size: int  # bytes of unique data on each retiring worker
    key_size: int
    retiring: int  # N: workers retired at once

    @property
    def label(self) -> str:
        return f"{_human(self.size)} in {_human(self.key_size)} keys, N={self.retiring}"

    @property
    def keys(self) -> int:
        return max(self.size // self.key_size, 1)


def _human(size: int) -> str:
    if size >= GIB and size % GIB == 0:
        return f"{size // GIB} GiB"
    if size >= MIB:
        return f"{size / MIB:g} MiB"
    return f"{size // 1024} KiB"


def parse_scenario(text: str) -> Scenario:
    size_mib, key_kib, retiring = (int(part) for part in text.split(":"))
    return Scenario(size_mib * MIB, key_kib * 1024, retiring)


def fill(client: distributed.Client, address: str, keys: int, key_size: int, tag: str) -> list[distributed.Future]:
    """Scatter ``keys`` distinct values of ``key_size`` bytes to one worker, a batch at a time."""
    base = os.urandom(min(key_size, 16 * MIB))
    pattern = base * -(-key_size // len(base))
    futures: list[distributed.Future] = []
    per_batch = max(SCATTER_BATCH // key_size, 1)
    for first in range(0, keys, per_batch):
        batch = {
            f"{tag}-{i}": pattern[: key_size - 8] + i.to_bytes(8, "little")
            for i in range(first, min(first + per_batch, keys))
        }
        futures += client.scatter(batch, workers=[address], hash=False).values()
    return futures


def wait_workers(
    client: distributed.Client, count: int, timeout: float = 120, gone: Sequence[str] = ()
) -> dict[str, str]:
    """Pod name -> address, once ``count`` workers are connected and none runs in a pod of ``gone``."""
    deadline = time.monotonic() + timeout
    while len(found := benchkit.workers(client)) < count or set(found) & set(gone):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{count} workers did not come back")
        time.sleep(0.1)
    return found


def check_kept(client: distributed.Client, futures: Sequence[distributed.Future], gone: Sequence[str]) -> None:
    """Every key is held by a worker that stays: nothing was lost."""
    holders: dict[str, list[str]] = client.sync(client.scheduler.who_has, keys=[f.key for f in futures])
    lost = [k for k, h in holders.items() if not [a for a in h if a not in gone]]
    assert not lost, f"{len(lost)} keys lost, e.g. {lost[:3]}"


def drain_window(events: dict[str, list[tuple[float, str, str]]], since: float, prefix: str) -> tuple[float, float]:
    """(first key of ``prefix`` in flight, last one in memory) after ``since``, over the workers."""
    flights = [t for evs in events.values() for t, k, f in evs if t >= since and f == "flight" and k.startswith(prefix)]
    landed = [t for evs in events.values() for t, k, f in evs if t >= since and f == "memory" and k.startswith(prefix)]
    if not flights or not landed:
        raise RuntimeError(f"no transfer of {prefix!r} was recorded")
    return min(flights), max(landed)


def transfers(client: distributed.Client, since: float, prefix: str) -> tuple[float, float, int, float]:
    """(first key of ``prefix`` in flight, last one in memory, keys received, the busiest
    recipient's share of them) after ``since``.

    Keys received counts every landing: more than the keys moved when the AMM asked two workers
    for the same key (each cycle re-suggests a replica for every key still unique, including keys
    already on their way to a recipient). The busiest recipient's share: a recipient gathers from
    one sender one message at a time, so the drain lasts about as long as its share takes.
    """
    events = collect(client)
    first, last = drain_window(events, since, prefix)
    by_worker = [
        sum(1 for t, k, f in evs if t >= since and f == "memory" and k.startswith(prefix)) for evs in events.values()
    ]
    landed = sum(by_worker)
    return first, last, landed, max(by_worker) / max(landed, 1)


def collect(client: distributed.Client) -> dict[str, list[tuple[float, str, str]]]:
    result: dict[str, list[tuple[float, str, str]]] = client.run(_take_events)
    return result


@dataclass
class Phases:
    """One run of a scenario; seconds."""

    tcp: float = 0.0  # loopback TCP: connected -> the receiver has every byte
    raw: float = 0.0  # replicate: call -> last key in memory on its recipient
    stock_first: float = 0.0  # call -> first byte in flight
    stock_drain: float = 0.0  # first byte -> last key in memory
    stock_return: float = 0.0  # call -> retire_workers returned (worker closed and removed)
    stock_closed: float = 0.0  # call -> the last retired worker removed from the scheduler (scheduler's clock)
    memops_first: float = 0.0  # kubectl apply -> first byte in flight
    memops_event_first: float = 0.0  # the API server's watch event (its create complete) -> first byte in flight
    memops_drain: float = 0.0
    memops_succeeded: float = 0.0  # kubectl apply -> phase Succeeded (pods gone)
    memops_closed: float = 0.0  # kubectl apply -> the last retired worker removed from the scheduler
    stock_cpu: float = 0.0  # CPU seconds of the API server, kubelet and operator from the call to its return
    memops_cpu: float = 0.0  # the same, from kubectl apply to Succeeded (kubectl itself not counted)
    stock_received: int = 0  # keys that landed on a recipient: more than the keys when some moved twice
    memops_received: int = 0
    stock_busiest: float = 0.0  # the share of the keys received that the busiest recipient received
    memops_busiest: float = 0.0
    drain_busiest: float = 0.0
    drain_first: float = 0.0  # memops' drain, started at the scheduler: call -> first byte in flight
    drain_drain: float = 0.0
    drain_return: float = 0.0  # call -> the status poll saw every drained worker closed and removed
    drain_closed: float = 0.0  # call -> the last drained worker removed from the scheduler
    drain_received: int = 0


@dataclass(frozen=True)
class Timed:
    """One retirement at the scheduler; seconds, but ``received`` (keys) and ``cpu`` (CPU seconds)."""

    first: float  # call -> first byte in flight
    drain: float  # first byte -> last key in memory
    returned: float  # call -> the call returned
    closed: float  # call -> the last retired worker removed from the scheduler
    received: int
    cpu: float
    busiest: float


class Bench:
    def __init__(self, client: distributed.Client, box: benchkit.Sandbox):
        self.client = client
        self.box = box
        self.api = Api(box.state / "kubeconfig")

    def loaded(
        self, scenario: Scenario, tag: str
    ) -> tuple[list[str], list[distributed.Future], list[distributed.Future]]:
        """Fill the first N pods with SIZE each (and the others with a ballast when N > 1)."""
        by_pod = wait_workers(self.client, WORKERS)
        pods = sorted(by_pod)
        retiring = pods[: scenario.retiring]
        data: list[distributed.Future] = []
        for j, pod in enumerate(retiring):
            data += fill(self.client, by_pod[pod], scenario.keys, scenario.key_size, f"{tag}-w{j}")
        ballast: list[distributed.Future] = []
        if scenario.retiring > 1:  # so that count: N chooses the loaded workers
            for j, pod in enumerate(pods[scenario.retiring :]):
                ballast += fill(self.client, by_pod[pod], scenario.keys + 1, scenario.key_size, f"ballast{tag}-{j}")
        return retiring, data, ballast

    def run(
        self, scenario: Scenario, run: int, with_memops: bool = True, stock_twice: bool = False, swap: bool = False
    ) -> Phases:
        """The phases; with ``swap`` memops and the drain swap places around stock (every other run
        of a scenario), so that none always follows the same one (a worker just restarted, memory
        just released). With
        ``stock_twice`` a second stock retire takes memops' place: how far two identical
        drains in one run differ, the noise any memops/stock ratio carries."""
        phases = Phases()
        collect(self.client)  # start from an empty record
        phases.tcp = loopback_tcp(scenario.keys * scenario.key_size * scenario.retiring)
        self.raw(scenario, run, phases)
        if not with_memops:
            self.stock(scenario, run, phases)
        elif stock_twice:
            self.stock(scenario, run, phases)
            second = Phases()
            self.stock(scenario, run + 50, second)
            phases.memops_first, phases.memops_drain = second.stock_first, second.stock_drain
            phases.memops_succeeded, phases.memops_cpu = second.stock_return, second.stock_cpu
            phases.memops_received = second.stock_received
            phases.memops_closed, phases.memops_busiest = second.stock_closed, second.stock_busiest
        elif swap:
            self.memops(scenario, run, phases)
            self.stock(scenario, run, phases)
            self.drain(scenario, run, phases)
        else:
            self.drain(scenario, run, phases)
            self.stock(scenario, run, phases)
            self.memops(scenario, run, phases)
        return phases

    def raw(self, scenario: Scenario, run: int, phases: Phases) -> None:
        """The same bytes copied worker to worker by ``replicate``, without the AMM."""
        client = self.client
        _, data, ballast = self.loaded(scenario, f"tp-{run}-raw")
        started = time.time()
        client.replicate(data, n=2)
        # A replicated key reaches memory on its recipient with no flight state in between.
        landed = [t for evs in collect(client).values() for t, _, f in evs if t >= started and f == "memory"]
        phases.raw = max(landed) - started
        del data, ballast
        time.sleep(0.5)

    def stock(self, scenario: Scenario, run: int, phases: Phases) -> None:
        """``retire_workers`` of the same workers, called directly."""

        def retire(addresses: list[str]) -> None:
            retired = self.client.retire_workers(workers=addresses, close_workers=True)
            assert sorted(retired) == sorted(addresses), retired

        timed = self.retire_directly(scenario, f"tp-{run}-stock", retire)
        phases.stock_first, phases.stock_drain, phases.stock_return = timed.first, timed.drain, timed.returned
        phases.stock_closed, phases.stock_busiest = timed.closed, timed.busiest
        phases.stock_received, phases.stock_cpu = timed.received, timed.cpu

    def drain(self, scenario: Scenario, run: int, phases: Phases) -> None:
        """memops' drain of the same workers, started at the scheduler through memops' agent."""

        def retire(addresses: list[str]) -> None:
            states = asyncio.run(drain_until_done(self.box.address, addresses))
            assert all(s["state"] == "done" for s in states.values()), states

        # The agent is installed before the clock starts (the operator does it once per scheduler).
        def install() -> None:
            asyncio.run(dask_direct.drain_status(self.box.address))

        timed = self.retire_directly(scenario, f"tp-{run}-drain", retire, before=install)
        phases.drain_first, phases.drain_drain, phases.drain_return = timed.first, timed.drain, timed.returned
        phases.drain_closed, phases.drain_busiest = timed.closed, timed.busiest
        phases.drain_received = timed.received

    def retire_directly(
        self,
        scenario: Scenario,
        tag: str,
        retire: Callable[[list[str]], None],
        before: Callable[[], None] | None = None,
    ) -> Timed:
        """Load the workers, time ``retire`` of them at the scheduler, check that no key was lost.

        Then the retired pods are replaced, as the memops phase does (its pods are deleted, then
        the Deployment is scaled back up): every phase leaves the same history behind, a new pod
        with a new name and a new worker process, for whichever phase comes next.
        """
        client = self.client
        retiring, data, ballast = self.loaded(scenario, tag)
        addresses = [benchkit.workers(client)[p] for p in retiring]
        collect(client)
        if before is not None:
            before()
        cpu = self.box.control_plane_cpu()
        started = time.time()
        retire(addresses)
        returned = time.time()
        cpu = self.box.control_plane_cpu() - cpu
        first, last, received, busiest = transfers(client, started, tag)
        closed = removed(client, addresses, started)
        check_kept(client, data, addresses)
        del data, ballast
        benchkit.kubectl(self.box.env, "delete", "pod", *retiring, "--wait=false")
        wait_workers(client, WORKERS, gone=retiring)
        time.sleep(0.5)
        return Timed(
            first=first - started,
            drain=last - first,
            returned=returned - started,
            closed=closed,
            received=received,
            cpu=cpu,
            busiest=busiest,
        )

    def memops(self, scenario: Scenario, run: int, phases: Phases) -> None:
        """One RetirementRequest through kubectl; the operator calls the same ``retire_workers``."""
        client = self.client
        tag = f"tp-{run}-memops"
        retiring, data, ballast = self.loaded(scenario, tag)
        addresses = [benchkit.workers(client)[p] for p in retiring]
        name = f"tp-{run}-{scenario.size // MIB}-{scenario.key_size // 1024}-{scenario.retiring}"
        spec: dict[str, Any] = {
            "scheduler": {"address": self.box.address},
            "workload": {"kind": "Deployment", "name": "dask-worker"},
            "timeout": "10m",
        }
        spec.update({"workers": retiring} if scenario.retiring == 1 else {"count": scenario.retiring})
        request = {
            "apiVersion": "memops.dev/v1alpha1",
            "kind": "RetirementRequest",
            "metadata": {"name": name, "namespace": "default"},
            "spec": spec,
        }
        collect(client)
        cpu = self.box.control_plane_cpu()
        applied = time.time()
        benchkit.kubectl(self.box.env, "apply", "-f", "-", stdin=yaml.safe_dump(request))
        status = self.api.wait_phase(
            "/apis/memops.dev/v1alpha1/namespaces/default/retirementrequests", name, ("Succeeded", "Failed")
        )
        succeeded = time.time()
        phases.memops_cpu = self.box.control_plane_cpu() - cpu
        assert status["phase"] == "Succeeded", status
        chosen = sorted(w["pod"] for w in status.get("workers", []))
        assert chosen == sorted(retiring), f"memops chose {chosen}, the loaded workers are {retiring}"
        first, last, phases.memops_received, phases.memops_busiest = transfers(client, applied, tag)
        phases.memops_first, phases.memops_drain = first - applied, last - first
        phases.memops_event_first = first - benchkit.created_at(self.box, "retirementrequests", name)
        phases.memops_succeeded = succeeded - applied
        phases.memops_closed = removed(client, addresses, applied)
        check_kept(client, data, addresses)
        del data, ballast
        benchkit.kubectl(self.box.env, "scale", "deployment/dask-worker", f"--replicas={WORKERS}")
        wait_workers(client, WORKERS)
        time.sleep(0.5)


TCP_BUFFER = 16 * MIB


def _receive(listener: socket.socket, expected: int) -> None:
    """In the receiving process: read ``expected`` bytes into one reused buffer, then say so."""
    connection, _ = listener.accept()
    buffer = memoryview(bytearray(TCP_BUFFER))
    received = 0
    with connection:
        connection.sendall(b"r")  # ready: the sender's clock starts after this process has started
        while received < expected:
            count = connection.recv_into(buffer)
            if not count:
                raise RuntimeError(f"the sender closed after {received} of {expected} bytes")
            received += count
        connection.sendall(b"k")


def loopback_tcp(size: int) -> float:
    """Seconds for ``size`` bytes over one loopback TCP connection to another process."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        receiver = multiprocessing.get_context("spawn").Process(target=_receive, args=(listener, size))
        receiver.start()
        try:
            payload = memoryview(os.urandom(TCP_BUFFER))
            with socket.create_connection(listener.getsockname()) as connection:
                if connection.recv(1) != b"r":
                    raise RuntimeError("the receiver did not start")
                started = time.perf_counter()
                for offset in range(0, size, TCP_BUFFER):
                    connection.sendall(payload[: min(TCP_BUFFER, size - offset)])
                if connection.recv(1) != b"k":
                    raise RuntimeError("the receiver did not confirm")
                seconds = time.perf_counter() - started
        finally:
            receiver.join(30)
            if receiver.is_alive():
                receiver.kill()
    return seconds


async def drain_until_done(address: str, workers: Sequence[str], timeout: float = 600) -> dict[str, Any]:
    """Start memops' drain of ``workers`` and poll its status until none is draining."""
    # An ordinary retirement, as stock's and the RetirementRequest's: the node stays. (The drain
    # remembers the workers' nodes that the operator gave it in an earlier phase; a dying node
    # would keep keys off the drained worker's neighbour there.)
    await dask_direct.start_drain(address, workers, deadline=timeout, nodes_dying=False)
    async with asyncio.timeout(timeout):
        while True:
            states = await dask_direct.drain_status(address, workers)
            if all(s["state"] != "draining" for s in states.values()):
                return states
            await asyncio.sleep(0.1)  # the operator's own cadence (daskrpc.POLL_SECONDS / 5)


def start(client: distributed.Client) -> None:
    module = sys.modules[TransferClock.__module__]
    if module.__name__ != "__main__":  # not importable on the workers: send it by value
        cloudpickle.register_pickle_by_value(module)
    client.register_plugin(TransferClock())
    client.register_plugin(RemovalClock())


def sandbox_memory(scenarios: Sequence[Scenario]) -> str:
    """Worker memory limits that keep the largest scenario under the spill threshold (0.6):
    a retiring worker's data, or a recipient's ballast plus its share of what it receives."""
    need = max(
        max(s.size, s.size + s.key_size + s.size * s.retiring // max(WORKERS - s.retiring, 1)) for s in scenarios
    )
    return f"{max(-(-4 * need // GIB), 2)}GiB"


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """Dask configuration for the sandbox's scheduler and workers, which inherit this environment."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def measure(
    scenarios: Sequence[Scenario],
    runs: int,
    env: dict[str, str] | None = None,
    with_memops: bool = True,
    stock_twice: bool = False,
) -> dict[Scenario, list[Phases]]:
    results: dict[Scenario, list[Phases]] = {s: [] for s in scenarios}
    with environment(env or {}), benchkit.running_sandbox(WORKERS, "--worker-memory", sandbox_memory(scenarios)) as box:
        with distributed.Client(box.address, timeout=30) as client:
            start(client)
            bench = Bench(client, box)
            for run in range(runs):  # runs outermost: a burst of load elsewhere hits every scenario alike
                for index, scenario in enumerate(scenarios):
                    # The order swaps every other run of each scenario (``run * 100 + index`` is the
                    # phases' tag, not their order).
                    swap = run % 2 == 1
                    results[scenario].append(bench.run(scenario, run * 100 + index, with_memops, stock_twice, swap))
    return results


KNOBS: dict[str, dict[str, str]] = {
    "defaults (AMM every 2 s, messages up to 50 MB)": {},
    "AMM interval 100 ms": {"DASK_DISTRIBUTED__SCHEDULER__ACTIVE_MEMORY_MANAGER__INTERVAL": "100ms"},
    "message-bytes-limit 10 MB": {"DASK_DISTRIBUTED__WORKER__TRANSFER__MESSAGE_BYTES_LIMIT": "10MB"},
    "message-bytes-limit 256 MB": {"DASK_DISTRIBUTED__WORKER__TRANSFER__MESSAGE_BYTES_LIMIT": "256MB"},
}
KNOB_SCENARIOS = ["1024:16384:1", "256:64:1"]


def knobs(texts: Sequence[str], runs: int) -> None:
    """Stock retire_workers under Dask configuration knobs, each in its own sandbox; the raw copy
    (which none of these knobs touches) is the anchor within each sandbox."""
    scenarios = [parse_scenario(t) for t in texts]
    rows = []
    for label, env in KNOBS.items():
        results = measure(scenarios, runs, env, with_memops=False)
        for scenario, phases in results.items():
            moved = scenario.keys * scenario.key_size * scenario.retiring / GIB
            rows.append(
                [
                    label,
                    scenario.label,
                    f"{median(moved / p.raw for p in phases):.2f}",
                    f"{median(moved / p.stock_drain for p in phases):.2f}",
                    f"{median(p.raw / p.stock_drain for p in phases):.2f}",
                    f"{median(p.stock_first for p in phases):.3f}",
                    f"{median(p.stock_return for p in phases):.3f}",
                ]
            )
    print(
        f"\nStock retire_workers under Dask knobs, median of {runs} runs; a sandbox per knob; ratios within each run\n"
    )
    headers = ["knob", "scenario", "raw GiB/s", "stock GiB/s", "stock/raw", "call -> 1st byte s", "call -> returned s"]
    print(markdown(headers, rows))


def median(values: Iterator[float]) -> float:
    return statistics.median(list(values))


def markdown(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def print_tables(results: dict[Scenario, list[Phases]], runs: int) -> None:
    print(f"\nDrain throughput, median of {runs} runs, one sandbox of {WORKERS} workers, ratios taken within each run.")
    print("drain: first byte in flight -> last key in memory on its recipient, timed inside the workers.")
    print("TCP: the same bytes over one loopback TCP connection between two processes (the ceiling).\n")
    rows = []
    for scenario, phases in results.items():
        moved = scenario.keys * scenario.key_size * scenario.retiring / GIB
        rows.append(
            [
                scenario.label,
                f"{median(moved / p.tcp for p in phases):.2f}",
                f"{median(moved / p.raw for p in phases):.2f}",
                f"{median(moved / p.stock_drain for p in phases):.2f}",
                f"{median(moved / p.memops_drain for p in phases):.2f}",
                f"{median(moved / p.drain_drain for p in phases):.2f}" if phases[0].drain_drain else "-",
                f"{median(p.raw / p.stock_drain for p in phases):.2f}",
                f"{median(p.raw / p.memops_drain for p in phases):.2f}",
                f"{median(p.raw / p.drain_drain for p in phases):.2f}" if phases[0].drain_drain else "-",
                f"{median(p.stock_drain / p.memops_drain for p in phases):.2f}",
                f"{median(p.stock_drain / p.drain_drain for p in phases):.2f}" if phases[0].drain_drain else "-",
                f"{min(p.stock_drain / p.memops_drain for p in phases):.2f}"
                f" to {max(p.stock_drain / p.memops_drain for p in phases):.2f}",
                f"{min(p.stock_drain / p.drain_drain for p in phases):.2f}"
                f" to {max(p.stock_drain / p.drain_drain for p in phases):.2f}"
                if phases[0].drain_drain
                else "-",
                f"{median(p.tcp / p.stock_drain for p in phases):.2f}",
                f"{median(p.tcp / p.drain_drain for p in phases):.2f}" if phases[0].drain_drain else "-",
            ]
        )
    headers = ["scenario", "TCP GiB/s", "raw GiB/s", "stock GiB/s", "memops GiB/s", "drain GiB/s", "stock/raw"]
    headers += ["memops/raw", "drain/raw", "memops/stock", "drain/stock"]
    headers += ["memops/stock, runs' range", "drain/stock, runs' range", "stock/TCP", "drain/TCP"]
    print(markdown(headers, rows))
    print("\nRetired: from the call (stock, drain) or kubectl apply (memops) to the last retired worker removed from")
    print("the scheduler (its data safe elsewhere, its pod free to go), on the scheduler's clock; the rate is the")
    print("bytes moved over that time, what a user waiting on a scale-down or a preStop hook sees.\n")
    rows = []
    for scenario, phases in results.items():
        moved = scenario.keys * scenario.key_size * scenario.retiring / GIB
        has_drain = bool(phases[0].drain_closed)
        rows.append(
            [
                scenario.label,
                f"{median(p.stock_closed for p in phases):.3f}",
                f"{median(p.memops_closed for p in phases):.3f}",
                f"{median(p.drain_closed for p in phases):.3f}" if has_drain else "-",
                f"{median(moved / p.stock_closed for p in phases):.2f}",
                f"{median(moved / p.memops_closed for p in phases):.2f}",
                f"{median(moved / p.drain_closed for p in phases):.2f}" if has_drain else "-",
                f"{median(p.stock_closed / p.memops_closed for p in phases):.2f}",
                f"{median(p.stock_closed / p.drain_closed for p in phases):.2f}" if has_drain else "-",
                f"{min(p.stock_closed / p.drain_closed for p in phases):.2f}"
                f" to {max(p.stock_closed / p.drain_closed for p in phases):.2f}"
                if has_drain
                else "-",
                f"{median(p.tcp / p.drain_closed for p in phases):.2f}" if has_drain else "-",
                f"{median(p.stock_busiest for p in phases):.2f} / {median(p.memops_busiest for p in phases):.2f}"
                f" / {median(p.drain_busiest for p in phases):.2f}",
            ]
        )
    headers = ["scenario", "stock: retired s", "memops: retired s", "drain: retired s", "stock GiB/s"]
    headers += ["memops GiB/s", "drain GiB/s", "memops/stock", "drain/stock", "drain/stock, runs' range", "drain/TCP"]
    headers += ["busiest recipient's share: stock / memops / drain"]
    print(markdown(headers, rows))
    print(
        "\nEnd to end, seconds (median): from the call (stock) or kubectl apply (memops) to the first byte in flight,"
    )
    print("memops also from the API server's watch event (its audit log's create, complete: what the operator's watch")
    print("gets; the RetirementRequest path's goal is its first byte within 0.1 s of it);")
    print("and to retire_workers returning (worker closed and removed) or the request Succeeded (pods gone);")
    print("CPU seconds the control plane, the node agent and the operator used meanwhile, on the cores Dask uses;")
    print("keys that landed on a recipient per key moved (over 1: the AMM sent some keys to two workers).\n")
    rows = [
        [
            scenario.label,
            f"{median(p.stock_first for p in phases):.3f}",
            f"{median(p.stock_return for p in phases):.3f}",
            f"{median(p.stock_cpu for p in phases):.2f}",
            f"{median(p.memops_first for p in phases):.3f}",
            f"{median(p.memops_event_first for p in phases):.3f}",
            f"{median(p.memops_succeeded for p in phases):.3f}",
            f"{median(p.memops_cpu for p in phases):.2f}",
            f"{median(p.stock_received / (scenario.keys * scenario.retiring) for p in phases):.2f}",
            f"{median(p.memops_received / (scenario.keys * scenario.retiring) for p in phases):.2f}",
            f"{median(p.drain_first for p in phases):.3f}",
            f"{median(p.drain_return for p in phases):.3f}",
            f"{median(p.drain_received / (scenario.keys * scenario.retiring) for p in phases):.3f}",
        ]
        for scenario, phases in results.items()
    ]
    headers = ["scenario", "stock: 1st byte", "stock: returned", "stock: CPU s", "memops: 1st byte"]
    headers += ["memops: watch event -> 1st byte"]
    headers += ["memops: Succeeded", "memops: CPU s", "stock: keys received/moved", "memops: keys received/moved"]
    headers += ["drain: 1st byte", "drain: closed", "drain: keys received/moved"]
    print(markdown(headers, rows))


DEFAULT = ["100:16384:1", "1024:16384:1", "4096:16384:1", "1024:64:1", "1024:1024:1", "1024:262144:1", "512:16384:2"]
SMALL = ["64:1024:1", "64:16384:2"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", nargs="+", metavar="SIZE_MIB:KEY_KIB:N", help=f"default: {' '.join(DEFAULT)}")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--small", action="store_true", help=f"the CI pass: {' '.join(SMALL)}, one run")
    parser.add_argument("--json", type=Path, help="also write every run's figures here")
    parser.add_argument("--knobs", action="store_true", help=f"stock retire under {len(KNOBS)} Dask configurations")
    parser.add_argument(
        "--stock-twice", action="store_true", help="a second stock retire in memops' place: the noise floor (A/A)"
    )
    args = parser.parse_args(argv)
    if args.knobs:
        knobs(args.scenarios or KNOB_SCENARIOS, args.runs)
        return 0
    texts = args.scenarios or (SMALL if args.small else DEFAULT)
    runs = 1 if args.small else args.runs
    scenarios = [parse_scenario(t) for t in texts]
    results = measure(scenarios, runs, stock_twice=args.stock_twice)
    if args.stock_twice:
        print("\n--stock-twice: the 'memops' columns below are a second stock retire_workers (A/A)")
    print_tables(results, runs)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps({s.label: [dataclasses.asdict(p) for p in r] for s, r in results.items()}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
